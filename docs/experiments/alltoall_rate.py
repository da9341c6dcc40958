"""How fast an all-to-all moves its bytes against an all-gather and an all-reduce, on the job's own links.

The striped quantized exchange (``DataParallelSGD(bits=...)`` at 3 workers or more) is an
all-to-all of the coded stripes and an all-gather of the owners' sums; the cost model prices
both at the all-gather's rate (``Network.gather_bandwidth``, which the job's probe fits from
all-gathers). This times, for stripes of ``--sizes`` bytes, an all-gather of one stripe a rank,
an all-to-all of one stripe to every other rank, and an all-reduce of the whole ``N`` stripes
(its time halved: a ring all-reduce is a reduce-scatter and an all-gather, each rank sending
``N - 1`` stripes in each), each the median of 6 timed calls (two passes of 3 after an untimed
one, a barrier before each), through :mod:`bunsan.comm` as the exchange calls them. It prints
each one's time and the rate of the ``N - 1`` stripes a rank sends (rank 0's clock).

On links shaped by :mod:`bunsan.bench.netns` (root; each rank in its own network namespace)::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python -m bunsan.bench.netns --network rate=100mbit -np 4 -- \\
        .venv/bin/python docs/experiments/alltoall_rate.py

or on loopback with ``torchrun --nproc-per-node 4 docs/experiments/alltoall_rate.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from bunsan import comm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100000,330000,650000,1300000,2600000", help="stripe bytes, comma-separated")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    for stripe in sizes:
        elements = max(1, stripe // 4)
        whole = torch.zeros(elements * n)
        received = torch.zeros(elements * n)
        piece = torch.zeros(elements)
        calls = {
            "all-gather": partial(comm.all_gather_into, received, piece),
            "all-to-all": partial(comm.all_to_all, received, whole),
            "all-reduce / 2": partial(comm.all_reduce, whole),
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(2):
            for name, call in calls.items():
                for i in range(4):
                    dist.barrier()
                    start = time.perf_counter()
                    call()
                    if i:  # the first of each pass untimed
                        times[name].append(time.perf_counter() - start)
        if rank == 0:
            parts = []
            for name, found in times.items():
                median = statistics.median(found) / (2 if name.startswith("all-reduce") else 1)
                parts.append(f"{name} {1e3 * median:7.1f} ms {(n - 1) * elements * 4 / median / 1e6:6.2f} MB/s")
            print(f"{n} ranks, stripe {elements * 4 / 1e6:.2f} MB: " + " | ".join(parts), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
