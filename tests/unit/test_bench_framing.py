"""``bunsan bench compare --batch-per-worker``: the per-worker-minibatch framing."""

from __future__ import annotations

import json
import shlex

from bunsan.bench import compare
from bunsan.cli import main


def _job_batches(lines: list[str]) -> list[tuple[int, int]]:
    """(workers, global batch of the job) from dry-run command lines."""
    out = []
    for line in lines:
        words = shlex.split(line)
        spec = json.loads(words[words.index("--spec") + 1])
        out.append((int(words[words.index("-np") + 1]), spec["batch"]))
    return out


def test_global_batch_of_each_framing():
    assert [compare.global_batch(32, n, False) for n in (1, 2, 4)] == [32, 32, 32]
    assert [compare.global_batch(32, n, True) for n in (1, 2, 4)] == [32, 64, 128]


def test_per_worker_framing_gives_each_worker_the_single_process_batch(tmp_path, capsys):
    argv = [
        "bench",
        "compare",
        "--dry-run",
        "--dataset",
        "digits",
        "--model",
        "digits_cnn",
        "-np",
        "1,3",
        "--algorithms",
        "data_parallel",
        "--batch",
        "32",
        "--out",
        str(tmp_path),
    ]
    # Global framing: 32 does not split over 3 workers, refused before anything starts.
    assert main(argv) == 2
    assert "does not split evenly over 3 workers" in capsys.readouterr().err
    assert main([*argv, "--batch-per-worker"]) == 0
    assert _job_batches(capsys.readouterr().out.splitlines()) == [(1, 32), (3, 96)]
