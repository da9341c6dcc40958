"""bunsan.init() in real processes: a failing rank ends the job, whoever started it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import bunsan
    from bunsan.comm import all_reduce

    mode = sys.argv[1]
    bunsan.init(timeout_s=3 if mode == "stall" else 60)
    if mode == "stall":
        all_reduce(torch.ones(1))
        if bunsan.rank() == 1:
            time.sleep(30)  # alive but absent: rank 0's next collective times out
    if mode == "raise" and bunsan.rank() == 1:
        time.sleep(0.5)
        raise RuntimeError("boom on purpose")
    if mode == "kill0" and bunsan.rank() == 0:
        time.sleep(0.5)
        os.kill(os.getpid(), 9)
    t = torch.ones(1)
    all_reduce(t)  # without bunsan's failure watch, a survivor waits here for 60 s
    print(f"rank {bunsan.rank()} of {bunsan.size()} done {t.item():.0f}", flush=True)
    if mode == "threads":  # building an optimizer imports torch._dynamo, and with it torch.distributed.nn
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    bunsan.finalize()
    if mode == "threads":
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        print("gloo threads after finalize:", sum("gloo" in n for n in names), flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)
    return env


def _start_bare(script: Path, mode: str, world_size: int = 2) -> list[subprocess.Popen]:
    """Start ranks by hand, as a launcher that never kills anyone would."""
    port = str(_free_port())
    return [
        subprocess.Popen(
            [sys.executable, str(script), mode],
            env=_env(
                RANK=str(r),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world_size)
    ]


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> tuple[list[int], list[str], float]:
    start = time.monotonic()
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(timeout_s - (time.monotonic() - start), 0.1))
            outs.append(out + err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs, time.monotonic() - start


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.timeout(90)
def test_exception_on_one_rank_ends_the_others_within_seconds(script):
    codes, outs, elapsed = _wait_all(_start_bare(script, "raise"), timeout_s=45)
    assert codes == [1, 1]
    assert "rank 1 of 2 failed" in outs[1] and "boom on purpose" in outs[1]  # the traceback, with the rank named
    assert "stopping because rank 1 failed" in outs[0]
    # start-up (import torch, rendezvous) takes a few seconds here; the failure itself must not wait for the 60 s timeout
    assert elapsed < 30


@pytest.mark.timeout(90)
def test_rank0_killed_silently_ends_the_others(script):
    codes, outs, elapsed = _wait_all(_start_bare(script, "kill0"), timeout_s=45)
    assert codes[0] == -9 and codes[1] != 0
    assert "rank 1" in outs[1]
    assert elapsed < 30


@pytest.mark.timeout(90)
def test_collective_timeout_names_the_missing_rank(script):
    codes, outs, elapsed = _wait_all(_start_bare(script, "stall"), timeout_s=45)
    assert codes == [1, 1]
    assert "timed out: ranks [1] never reached it" in outs[0]
    assert "stopping because rank 0 failed" in outs[1]
    assert elapsed < 25  # rank 1 would sleep 30 s: the watch ended it


@pytest.mark.timeout(90)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from Linux's /proc")
def test_finalize_frees_the_gloo_threads(script):
    """Gloo threads alive at interpreter exit crashed finished jobs (SIGABRT) now and then.

    torch.distributed.nn, imported by the first optimizer after the group exists, kept
    the group alive through a default argument (see comm.group, create_world).
    """
    codes, outs, _ = _wait_all(_start_bare(script, "threads"), timeout_s=60)
    assert codes == [0, 0], outs
    for out in outs:
        assert "gloo threads after finalize: 0" in out, out


@pytest.mark.timeout(90)
def test_same_script_under_torchrun(script):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(script),
            "ok",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2 done 2" in proc.stdout and "rank 1 of 2 done 2" in proc.stdout


@pytest.mark.timeout(60)
def test_lone_process_is_a_world_of_one(script):
    proc = subprocess.run([sys.executable, str(script), "ok"], env=_env(), capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 of 1 done 1" in proc.stdout


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed (apt-get install openmpi-bin)"
)
def test_same_script_under_openmpi_mpirun(script):
    proc = subprocess.run(
        [
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
            str(script),
            "ok",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2 done 2" in proc.stdout and "rank 1 of 2 done 2" in proc.stdout
