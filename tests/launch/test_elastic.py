"""Issue 67: elastic jobs under ``bunsan run --min-np`` with the real torchft (its lighthouse and quorum).

Each job runs tests/launch/elastic_job.py on 2 or 3 workers of this machine: a worker SIGKILLs itself in the
middle of a step, and the others must go on, end with equal replicas, and between them train every sample
of every epoch exactly once; with ``--max-restarts`` a new worker joins with a live peer's state; with fewer
workers than ``--min-np`` left, the job ends with one sentence. Every process of a job carries a tag in its
environment, so what a job leaves behind is found in /proc (tests/launch/edges.py).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch import edges

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux only"),
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("torchft") is None, reason="needs torchft: pip install 'bunsan[elastic]'"
    ),
]

JOB = Path(__file__).with_name("elastic_job.py")
SAMPLES, BATCH = 600, 20


@dataclass
class Job:
    code: int
    output: str
    left: list[str]
    finals: list[dict]
    logs: dict[str, list[dict]]

    def launcher_lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("bunsan run: ")]


def run_job(tmp_path: Path, np: int, min_np: int, timeout_s: float = 150, *options: str, **env: str) -> Job:
    tag = uuid.uuid4().hex
    logs = tmp_path / "logs"
    logs.mkdir()
    environment = edges._env(tag, LOG_DIR=str(logs), **env)
    command = [sys.executable, "-m", "bunsan", "run", "-np", str(np), "--min-np", str(min_np), "--oversubscribe"]
    process = subprocess.Popen(
        [*command, *options, sys.executable, str(JOB)],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    left = edges.left_behind(tag, wait_s=8.0)
    edges.kill_tagged(tag)
    finals = [json.loads(p.read_text()) for p in sorted(logs.glob("final-*.json"))]
    steps = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in sorted(logs.glob("*.jsonl"))}
    return Job(process.returncode, output, left, finals, steps)


def assert_every_sample_once(job: Job, workers: int, epochs: int) -> None:
    """Every epoch's committed steps, over every worker that ever ran, train each of its samples once."""
    global_batch = BATCH * workers
    per_epoch = (SAMPLES // global_batch) * global_batch + (SAMPLES % global_batch)
    by_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    by_step: dict[int, int] = collections.Counter()
    for records in job.logs.values():
        for record in records:
            by_epoch[record["epoch"]].update(record["ids"])
            by_step[record["step"]] += len(record["ids"])
    assert sorted(by_epoch) == list(range(epochs)), sorted(by_epoch)
    for epoch, counts in by_epoch.items():
        assert set(counts.values()) == {1}, (epoch, [i for i, n in counts.items() if n != 1][:10])
        assert len(counts) == per_epoch, (epoch, len(counts))
    assert set(by_step.values()) <= {global_batch, SAMPLES % global_batch}, by_step


@pytest.mark.timeout(200)
def test_a_worker_killed_mid_step_leaves_the_others_training_every_sample_once(tmp_path):
    job = run_job(tmp_path, 3, 2, 150, KILL_RANK="1", KILL_STEP="13")
    assert job.code == 0, job.output
    assert "bunsan run: rank 1 was killed by SIGKILL; the other 2 go on (--min-np 2)" in job.launcher_lines(), (
        job.output
    )
    assert "[bunsan] step 13 was dropped on every worker" in job.output
    assert len(job.finals) == 2 and job.finals[0]["digest"] == job.finals[1]["digest"], job.finals
    assert {f["steps"] for f in job.finals} == {4 * 10}, job.finals  # 600 samples, global batch 60: 10 a epoch
    assert_every_sample_once(job, workers=3, epochs=4)
    assert job.left == []


@pytest.mark.timeout(200)
def test_rank_0_killed_is_one_worker_less_too(tmp_path):
    """The rendezvous is the launcher's lighthouse, not rank 0's store."""
    job = run_job(tmp_path, 3, 2, 150, KILL_RANK="0", KILL_STEP="5")
    assert job.code == 0, job.output
    assert len(job.finals) == 2 and job.finals[0]["digest"] == job.finals[1]["digest"], job.finals
    assert_every_sample_once(job, workers=3, epochs=4)
    assert job.left == []


@pytest.mark.timeout(250)
def test_a_restarted_worker_joins_with_a_live_peers_state(tmp_path):
    job = run_job(
        tmp_path, 2, 1, 200, "--max-restarts", "1", KILL_RANK="1", KILL_STEP="3", EPOCHS="25", STEP_SLEEP="0.03"
    )
    assert job.code == 0, job.output
    assert any("a new worker starts in its place" in line for line in job.launcher_lines()), job.output
    assert "joined at step" in job.output, job.output
    assert len(job.finals) == 2, job.output  # the survivor and the worker that joined
    assert job.finals[0]["digest"] == job.finals[1]["digest"], job.finals
    assert {f["steps"] for f in job.finals} == {25 * 15}, job.finals  # global batch 40: 15 steps an epoch
    assert_every_sample_once(job, workers=2, epochs=25)
    assert job.left == []


@pytest.mark.timeout(200)
def test_fewer_workers_than_min_np_end_the_job_in_one_sentence(tmp_path):
    started = time.monotonic()
    job = run_job(tmp_path, 2, 2, 150, KILL_RANK="1", KILL_STEP="3", EPOCHS="1000")
    assert job.code == 137, job.output
    assert (
        "bunsan run: rank 1 was killed by SIGKILL, and 1 worker(s) are left, fewer than --min-np 2; stopping the job"
        in job.launcher_lines()
    ), job.output
    assert time.monotonic() - started < 120
    assert job.finals == []
    assert job.left == []
