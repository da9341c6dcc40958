"""Where an exact step's extra main-thread CPU goes, against model averaging's local steps: torch's profiler.

Every rank builds exact SGD and model averaging (one block for the whole run: local steps only)
on two copies of a model of :mod:`bunsan.models`, on random inputs, and alternates ``--rounds``
times: ``--steps`` steps of each under ``torch.profiler`` (CPU), after 3 untimed ones. Per rank it
prints the main-thread CPU time per step of each (``time.thread_time``), the main thread's minor
page faults per step, and the operators whose self CPU time per step differs most between the two.
Extra time in the compute kernels themselves (the forward's convolutions too, before any exchange
of that step) points at memory taken afresh from the kernel (docs/experiments/design-notes.md, "Page faults");
``BUNSAN_MALLOC_TUNING=0`` leaves malloc as a script's own process group had it before
``bunsan.distribute`` fixed it::

    OMP_NUM_THREADS=1 BUNSAN_MALLOC_TUNING=0 .venv/bin/python docs/experiments/exact_vs_local_profile.py \\
        --model resnet20 --batch 32
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from exchange_wait import finish_rank, rank_parser, run_ranks, start_rank

SHOWN = 12  # operators printed per rank


def _body(rank: int, n: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    total_steps = args.rounds * (args.steps + 3)
    kinds = (
        ("exact", "data_parallel", {}),
        ("local", "model_averaging", {"block_size": (total_steps + 1) * args.batch}),  # local steps only
    )
    x, y, built = start_rank(rank, n, port, args.model, args.batch, kinds)
    found: dict[str, list] = {name: [0.0, 0, {}] for name in built}  # CPU s, faults, op -> self CPU us
    for _ in range(args.rounds):
        for name, (model, optimizer) in built.items():
            for _ in range(3):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                cpu, faults = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                for _ in range(args.steps):
                    optimizer.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    optimizer.step()
                found[name][0] += time.thread_time() - cpu
                found[name][1] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
            dist.barrier()
            ops = found[name][2]
            for event in profile.key_averages():
                ops[event.key] = ops.get(event.key, 0.0) + event.self_cpu_time_total
    finish_rank((optimizer for _, optimizer in built.values()), rank, found, queue)


def main() -> None:
    parser = rank_parser(__doc__.split("\n")[0], workers=2, model="resnet20")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps of each per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if min(args.workers, args.batch, args.steps, args.rounds) < 1:
        parser.error("--workers, --batch, --steps and --rounds must be at least 1")
    results = run_ranks(_body, args.workers, (args,))
    steps = args.rounds * args.steps
    print(
        f"{args.model}, {args.workers} workers, {args.batch} samples per worker, {args.rounds} rounds of "
        f"{args.steps} profiled steps each; malloc tuning {os.environ.get('BUNSAN_MALLOC_TUNING', '1')}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for rank in range(args.workers):
        exact, local = results[rank]["exact"], results[rank]["local"]
        print(
            f"rank {rank}: main-thread CPU per step exact {exact[0] / steps * 1e3:.1f} ms, local "
            f"{local[0] / steps * 1e3:.1f} ms; minor page faults per step exact {exact[1] / steps:.0f}, "
            f"local {local[1] / steps:.0f}"
        )
        print("  self CPU per step (ms)   exact    local  difference  operator")
        keys = set(exact[2]) | set(local[2])
        by_difference = sorted(keys, key=lambda k: exact[2].get(k, 0.0) - local[2].get(k, 0.0), reverse=True)
        for key in by_difference[:SHOWN]:
            e, m = exact[2].get(key, 0.0) / steps / 1e3, local[2].get(key, 0.0) / steps / 1e3
            print(f"  {'':22s}{e:7.2f}  {m:7.2f}  {e - m:+10.2f}  {key}")


if __name__ == "__main__":
    main()
