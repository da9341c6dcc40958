"""Rank 0's resident memory over a long AsyncSGD job (the parameter server's logs must stay bounded).

    python -m tests.launch.edges_memory --world-size 4 --seconds 180

Starts tests/launch/edges_job.py with ``--algorithm async --seconds T`` on
``--world-size`` ranks and reads rank 0's VmRSS from /proc every ``--every``
seconds. Prints each sample and the growth from the first sample after
``--warmup`` seconds to the last one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from tests.launch.edges_run import JOB, ROOT, _free_port


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=10.0)
    args = parser.parse_args()
    port = _free_port()
    procs = []
    for rank in range(args.world_size):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "BUNSAN_"))}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(args.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOB), "--algorithm", "async", "--seconds", str(args.seconds)],
                env=env,
                stdout=subprocess.DEVNULL,
            )
        )
    start = time.monotonic()
    samples: list[tuple[float, int]] = []
    while procs[0].poll() is None:
        try:
            samples.append((time.monotonic() - start, rss_kib(procs[0].pid)))
        except (OSError, RuntimeError):
            break
        print(f"t={samples[-1][0]:6.1f} s  rank 0 RSS {samples[-1][1] / 1024:8.1f} MiB", flush=True)
        time.sleep(args.every)
    codes = [p.wait() for p in procs]
    after = [kib for t, kib in samples if t >= args.warmup]
    if len(after) >= 2:
        growth = (after[-1] - after[0]) / 1024
        peak = (max(after) - after[0]) / 1024
        print(
            f"rank 0 RSS from t={args.warmup:.0f} s to the end: {growth:+.1f} MiB (peak {peak:+.1f} MiB); "
            f"exit codes {codes}",
            flush=True,
        )
    else:
        print(f"too few samples after the warm-up; exit codes {codes}", flush=True)


if __name__ == "__main__":
    main()
