"""How fast an all-to-all moves its bytes against an all-gather and an all-reduce, on the job's own links.

The striped quantized exchange (``DataParallelSGD(bits=...)`` at 3 workers or more) is an
all-to-all of the coded stripes and an all-gather of the owners' sums; the cost model prices
both at the all-gather's rate (``Network.gather_bandwidth``, which the job's probe fits from
all-gathers). This times, for stripes of ``--sizes`` bytes, an all-gather of one stripe a rank,
an all-to-all of one stripe to every other rank (Gloo's one call, as the exchange makes it, and
:func:`pairwise_all_to_all`'s rounds), and an all-reduce of the whole ``N`` stripes
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


def pairwise_all_to_all(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """The all-to-all as ``N - 1`` rounds of one message each way: in round ``i`` rank ``r`` sends its
    slice for ``r + i`` and receives ``r - i``'s, and starts the next round when both are done (the
    pairwise exchange of Thakur, Rabenseifner and Gropp 2005, MPICH's all-to-all for long messages):
    every rank receives from one other at a time, where Gloo's one call has each rank's link receive
    from ``N - 1`` senders at once. Tried as the exchange's schedule; on the shaped links it was
    slower than the one call (docs/experiments/plan.md, "The all-to-all in rounds of one message")."""
    rank, n = dist.get_rank(), dist.get_world_size()
    size = tensor.numel() // n

    def piece(t: torch.Tensor, r: int) -> torch.Tensor:
        return t[r * size : (r + 1) * size]

    piece(output, rank).copy_(piece(tensor, rank))
    for i in range(1, n):
        to, source = (rank + i) % n, (rank - i) % n
        works = [dist.isend(piece(tensor, to), to), dist.irecv(piece(output, source), source)]
        for work in works:
            work.wait()


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
            "all-to-all (one call)": partial(comm.all_to_all, received, whole),
            "all-to-all (pairwise)": partial(pairwise_all_to_all, received, whole),
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
