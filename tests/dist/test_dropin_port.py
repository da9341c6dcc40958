"""The port of pytorch/examples' MNIST script runs unchanged under bunsan run, torchrun and mpirun.

Real launcher jobs of 2 workers (slow: tens of seconds each on 2 shared cores).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORT = ROOT / "examples" / "mnist_port.py"
CHANGED_LINES = 9  # what the port's docstring and the first-job tutorial claim
ARGS = ["--epochs", "1", "--log-interval", "4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMP_"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def test_the_port_marks_exactly_the_lines_the_readme_counts():
    marked = [line for line in PORT.read_text().splitlines() if line.rstrip().endswith("# [bunsan]")]
    assert len(marked) == CHANGED_LINES, marked
    tutorial = (ROOT / "docs" / "tutorials" / "first-job.md").read_text()
    assert f"There are {CHANGED_LINES}:" in tutorial


def _check(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # Printed by rank 0 only: once per logged batch, one test line per epoch.
    # 1437 training images over 2 workers with batch 64: 12 batches each, logged at 0, 4, 8.
    assert len(re.findall(r"^Train Epoch: 1 ", out, re.M)) == 3, out
    assert "[0/1437 (0%)]" in out  # len(train_loader.dataset) is the whole training set
    tests = re.findall(r"Test set: Average loss: ([0-9.]+), Accuracy: (\d+)/360", out)
    assert len(tests) == 1, out
    assert int(tests[0][1]) >= 250, out  # well above chance (36 of 360) after one epoch on 2 workers
    return tests[0][0] + " " + tests[0][1]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mnist_port_under_bunsan_run_and_torchrun_gives_the_same_model():
    results = {}
    commands = {
        "bunsan run": [
            sys.executable,
            "-m",
            "bunsan",
            "run",
            "-np",
            "2",
            "--master-port",
            str(_free_port()),
            str(PORT),
            *ARGS,
        ],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(PORT),
            *ARGS,
        ],
    }
    if shutil.which("mpirun") is not None:
        commands["mpirun"] = [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "2",
            "-x",
            "PYTHONPATH",
            "-x",
            "OMP_NUM_THREADS",
            sys.executable,
            str(PORT),
            *ARGS,
        ]
    for name, command in commands.items():
        proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=180, cwd=ROOT)
        results[name] = _check(proc)
    # Same seed, same shards, same arithmetic: every launcher ends with the same test loss and accuracy.
    assert len(set(results.values())) == 1, results
