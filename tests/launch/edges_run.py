"""Start tests/launch/edges_job.py as a plain multi-process job and report how it ended.

Used by tests/launch/test_edges.py, and by hand for the acceptance figures::

    python -m tests.launch.edges_run --repeat 20 --algorithm async            # even data, no join()
    python -m tests.launch.edges_run --repeat 5 --algorithm data_parallel --extra 0:3
    python -m tests.launch.edges_run --repeat 5 --algorithm data_parallel --skip 1:2

Every run prints one line: the exit codes, the seconds until the last rank ended,
whether the replicas are equal, and each rank's last stderr line that starts
with ``[bunsan]`` or names an error. The summary counts runs that exited 0 with
equal replicas.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("edges_job.py")


@dataclass
class JobResult:
    codes: list[int | None]
    seconds: float
    stderr: list[str]
    replicas: list[list[float] | None] = field(default_factory=list)
    after_start: float | None = None  # seconds from the first rank's start of training to the last exit

    @property
    def equal_replicas(self) -> bool:
        first = self.replicas[0] if self.replicas else None
        return first is not None and all(
            r is not None and max(abs(a - b) for a, b in zip(first, r)) <= 1e-6 for r in self.replicas
        )

    def summary(self) -> str:
        notes = []
        for r, text in enumerate(self.stderr):
            lines = [ln for ln in text.splitlines() if ln.startswith("[bunsan]") or "Error" in ln or "terminate" in ln]
            if lines:
                notes.append(f"rank {r}: {lines[-1][:300]}")
        after = "?" if self.after_start is None else f"{self.after_start:.1f}"
        return (
            f"codes={self.codes} seconds={self.seconds:.1f} after_training_began={after} "
            f"equal={self.equal_replicas} " + " | ".join(notes)
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    job_args: list[str], *, world_size: int = 2, timeout_s: float = 60.0, env_extra: dict[str, str] | None = None
) -> JobResult:
    """Run one job of ``world_size`` ranks; kill whatever is left after ``timeout_s``."""
    import torch  # only the parent reads the replicas

    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for rank in range(world_size):
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC", "BUNSAN_"))
            }
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT),
                PYTHONUNBUFFERED="1",
                **(env_extra or {}),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(JOB), *job_args, "--out", out],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        start = time.monotonic()
        stderr: list[str] = []
        ended_at = 0.0
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=max(timeout_s - (time.monotonic() - start), 0.1))
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                _, err = proc.communicate()
            stderr.append(err)
            ended_at = time.time()
        seconds = time.monotonic() - start
        replicas = []
        for rank in range(world_size):
            path = Path(out) / f"rank{rank}.pt"
            replicas.append(torch.load(path).tolist() if path.exists() else None)
    codes = [p.returncode for p in procs]
    starts = [
        float(line.split()[-1])
        for text in stderr
        for line in text.splitlines()
        if line.startswith("edges: training starts at")
    ]
    return JobResult(codes, seconds, stderr, replicas, ended_at - min(starts) if starts else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="kill a run after this many seconds")
    args, job_args = parser.parse_known_args()
    clean = 0
    for i in range(args.repeat):
        result = run_job(job_args, world_size=args.world_size, timeout_s=args.timeout)
        ok = all(c == 0 for c in result.codes) and result.equal_replicas
        clean += ok
        print(f"run {i + 1}: {result.summary()}", flush=True)
    print(f"{clean} of {args.repeat} runs exited 0 with equal replicas ({' '.join(job_args)})", flush=True)


if __name__ == "__main__":
    main()
