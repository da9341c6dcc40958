"""Where ranks share cores, one collective a step leaves them staggered; a second one lines them up.

For a model of :mod:`bunsan.models` on random inputs, every rank trains exact SGD
(``DataParallelSGD``: the step's one all-reduce, its counts riding in the last bucket), the
same with one more all-reduce of 4 float64 after each step (as the fp16 and quantized
exchanges make for their counts, and as any loop that all-reduces its loss each step does),
and fp16, twice each, ``--steps`` steps (the first 5 untimed). Per run it prints the mean
step (the last rank's step ends), how far apart the ranks end a step (the median over steps
of the latest end less the earliest) and each rank's median wait in the exchange.

With 4 ranks on 2 cores the time slices of the operating system order the ranks' compute:
one all-reduce a step lets them keep that order, each rank ending its exchange several ms
after the one before it and starting its next compute as early, so no rank waits a whole
straggler; the small second all-reduce ends on every rank at about the same moment (it
acts as a barrier) and every step starts with all 4 ranks competing at once. The cost model
prices every synchronous step with the straggler of compute steps run free
(``Profile.straggler_s``): whether a real step pays it is this pattern, which the bench's own
loop (``bunsan bench predict``) meets in some runs and not in others (docs/experiments/plan.md,
"Bias and noise"). On loopback (4 local processes)::

    OMP_NUM_THREADS=1 .venv/bin/python docs/experiments/exact_stagger.py

on shaped links (root; each rank in its own network namespace)::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python -m bunsan.bench.netns --network rate=1gbit -np 4 -- \\
        .venv/bin/python docs/experiments/exact_stagger.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exchange_wait import SHAPES, local_rank, run_ranks

RUNS = (("exact", {}, False), ("exact + a small all-reduce", {}, True), ("fp16", {"compression": "fp16"}, False))
UNTIMED = 5


def train(model_name: str, steps: int) -> dict[str, list[list[tuple[float, float, float, float]]]]:
    """This rank's ``(start, end of optimizer.step(), end, exchange wait)`` of every step of every run, by run
    name (2 runs each)."""
    import bunsan
    from bunsan import models

    rank = dist.get_rank()
    x = torch.randn(32, *SHAPES[model_name], generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(rank))
    found: dict[str, list[list[tuple[float, float, float, float]]]] = {name: [] for name, _, _ in RUNS}
    for _ in range(2):
        for name, options, extra in RUNS:
            torch.manual_seed(0)
            model = models.create(model_name)
            model, optimizer = bunsan.distribute(
                model, torch.optim.SGD(model.parameters(), lr=0.01), "data_parallel", **options
            )
            inner = optimizer.algorithm
            steps_seen = []
            dist.barrier()
            for _ in range(steps):
                start = time.time()  # one clock for every process of this machine
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                stepped = time.time()
                if extra:
                    dist.all_reduce(torch.zeros(4, dtype=torch.float64))
                waited, inner.exchange_s = inner.exchange_s, 0.0
                steps_seen.append((start, stepped, time.time(), waited))
            optimizer.join()
            found[name].append(steps_seen)
    return found


def report(found: list[dict[str, Any]], model_name: str) -> None:
    n = len(found)
    med = statistics.median
    print(f"{model_name}, {n} workers, 32 samples each; load average {os.getloadavg()[0]:.2f}")
    for name, _, _ in RUNS:
        for trial in range(2):
            runs = [found[r][name][trial][UNTIMED:] for r in range(n)]
            ends = [max(run[i][2] for run in runs) for i in range(len(runs[0]))]
            mean = (ends[-1] - ends[0]) / (len(ends) - 1)

            def apart(k: int, runs: list[Any] = runs, steps: int = len(ends)) -> float:  # spread over ranks, median
                return med(max(run[i][k] for run in runs) - min(run[i][k] for run in runs) for i in range(steps))

            waits = " ".join(f"{1e3 * med(s[3] for s in run):.1f}" for run in runs)
            print(
                f"{name:28s} #{trial + 1}: step {1e3 * mean:6.2f} ms; the ranks' exchange ends {1e3 * apart(1):4.1f} ms "
                f"apart, their step {1e3 * apart(2):4.1f}; wait in the exchange per rank (ms) {waits}"
            )


def _spawned(rank: int, n: int, port: int, model_name: str, steps: int, queue: Any) -> None:
    local_rank(rank, n, port)
    import bunsan

    bunsan.init()
    queue.put((rank, train(model_name, steps)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="local processes (without a launcher's RANK)")
    parser.add_argument("--model", choices=sorted(SHAPES), default="digits_cnn")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.workers < 2 or args.steps <= UNTIMED + 1:
        parser.error(f"--workers must be at least 2 and --steps more than {UNTIMED + 1}")
    if "RANK" not in os.environ:  # loopback: spawn the ranks here
        results = run_ranks(_spawned, args.workers, (args.model, args.steps))
        report([results[r] for r in range(args.workers)], args.model)
        return
    torch.set_num_threads(1)  # a launcher's worker (python -m bunsan.bench.netns ...)
    import bunsan

    bunsan.init()
    mine = train(args.model, args.steps)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        report(every, args.model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
