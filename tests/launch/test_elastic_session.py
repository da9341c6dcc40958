"""A TrainingSession script runs unchanged in an elastic job (``bunsan run --min-np``), with the real torchft.

Each job runs tests/launch/elastic_session_job.py through test_elastic.py's ``run_job``: on 2 workers it trains
what one process trains on the global minibatch (the reference, the same script run alone); with a worker
SIGKILLed mid-step and started again (``--max-restarts``), the job ends 0, every replica equal (the joiner's
included), each sample of every epoch trained once, at the job's sample count and learning rate.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.launch import edges, test_elastic

pytestmark = test_elastic.pytestmark

JOB = Path(__file__).with_name("elastic_session_job.py")
SAMPLES, EPOCHS, STEPS = 300, 3, 8 + 5 + 5  # minibatch 40 in epoch 0 (the last of 20), then 60


def run_session_job(tmp_path: Path, monkeypatch, np: int, min_np: int, *options: str, **env: str):
    monkeypatch.setattr(test_elastic, "JOB", JOB)  # run_job starts test_elastic.JOB on every worker
    return test_elastic.run_job(tmp_path, np, min_np, 150, *options, **env)


def assert_every_sample_once(logs: dict[str, list[dict]]) -> None:
    """Over every worker that ever ran, each epoch's committed steps train each of its samples once."""
    by_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    by_step: collections.Counter[int] = collections.Counter()
    for records in logs.values():
        for record in records:
            by_epoch[record["epoch"]].update(record["ids"])
            by_step[record["step"]] += len(record["ids"])
    assert sorted(by_epoch) == list(range(EPOCHS)), sorted(by_epoch)
    for epoch, counts in by_epoch.items():
        assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, epoch
    assert sorted(by_step) == list(range(1, STEPS + 1)), by_step
    assert set(by_step.values()) == {40, 20, 60}, by_step  # each step its whole global minibatch


def assert_replicas_equal(finals: list[dict], count: int) -> None:
    assert len(finals) == count, finals
    for final in finals:
        assert final["samples"] == EPOCHS * SAMPLES and final["steps"] == STEPS, final
        for key in ("digest", "lr", "extra_state", "best", "epoch_losses", "cv_errors", "test_loss"):
            assert final[key] == finals[0][key], (key, finals)


@pytest.mark.timeout(200)
def test_a_session_on_two_workers_trains_what_one_process_trains_on_the_global_batch(tmp_path, monkeypatch):
    import torch

    reference = tmp_path / "reference"
    reference.mkdir()
    alone = subprocess.Popen(
        [sys.executable, str(JOB)],
        env=edges._env(uuid.uuid4().hex, REF_DIR=str(reference)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    job = run_session_job(tmp_path, monkeypatch, 2, 2)
    output, _ = alone.communicate(timeout=150)
    assert alone.returncode == 0, output
    assert job.code == 0, job.output
    assert_replicas_equal(job.finals, 2)
    expected = json.loads((reference / "final-reference.json").read_text())
    for key in ("samples", "steps", "lr", "extra_state", "cv_errors"):
        assert job.finals[0][key] == expected[key], key
    for key in ("epoch_losses", "epoch_errors"):
        assert job.finals[0][key] == pytest.approx(expected[key], rel=1e-6), key
    alone_model = torch.load(reference / "model-reference.pt")
    for path in sorted((tmp_path / "logs").glob("model-*.pt")):
        for name, value in torch.load(path).items():
            torch.testing.assert_close(value, alone_model[name], rtol=0, atol=2e-6)
    assert_every_sample_once(job.logs)
    assert all(len(r["ids"]) in (10, 20, 30) for records in job.logs.values() for r in records)  # halves
    # The quorum's rank 0 alone prints and writes the checkpoints: one process's files, one per epoch.
    assert job.output.count("epoch 1: loss") == 1, job.output
    files = sorted(p.name for p in (tmp_path / "logs" / "ckpt").iterdir())
    assert files == [f"run.{n * SAMPLES:012d}.pt" for n in (1, 2, 3)], files
    assert job.left == []


@pytest.mark.timeout(250)
def test_a_session_goes_on_without_a_killed_worker_and_its_restart_joins_at_the_jobs_sample_count(
    tmp_path, monkeypatch
):
    job = run_session_job(
        tmp_path,
        monkeypatch,
        3,
        2,
        "--max-restarts",
        "1",
        KILL_RANK="1",
        KILL_STEP="3",
        WAIT_JOIN="1",
        STEP_SLEEP="0.2",
    )
    assert job.code == 0, job.output
    lines = job.launcher_lines()
    assert any(line.startswith("bunsan run: rank 1 was killed by SIGKILL") for line in lines), job.output
    assert any("a new worker starts in its place" in line for line in lines), job.output
    assert "[bunsan] step 3 was dropped on every worker" in job.output, job.output
    assert "joined at step" in job.output, job.output
    assert_replicas_equal(job.finals, 3)  # the two survivors and the worker that joined
    assert max(final["dropped"] for final in job.finals) >= 1, job.finals
    assert_every_sample_once(job.logs)
    assert job.left == []
