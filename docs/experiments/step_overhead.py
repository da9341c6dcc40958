"""What a bunsan step costs over the plain local step: a real small model against the tiny one of the fixed costs.

``bunsan.algorithms.measure.measure_fixed_costs`` prices what a step costs beyond the cost
model's arithmetic on a tiny model (a linear layer of 4 to 2, two tensors) and the bench adds
that to every model's row. At 2 workers the small CNNs' rows lean low in every run of
``tools/predict.py`` (MNIST-1D's exact, fp16 and async 13-17% on ten runs' means;
docs/experiments/plan.md, "predict-33"). This times, on 2 local ranks over loopback (Gloo, one thread
each), the plain step (forward, backward, SGD update), model averaging's (a block of 256
samples, 8 steps) and exact data parallel's, for:

* ``mnist1d``: the MNIST-1D CNN of ``bunsan.models`` (8 tensors, 8,010 parameters);
* ``tiny``: the fixed costs' linear layer;
* ``tiny8``: four linear layers of 4 (8 tensors, as the CNN): whether the count of tensors
  (one hook each) is what the tiny model misses;
* ``tiny+filler``: the tiny model with a backward of a separate MNIST-1D CNN before every step,
  in the plain step as in bunsan's: whether a real compute between steps (caches, the scheduler)
  is.

Each case is timed ``--repeats`` times over ``--steps`` steps (16 untimed first), the slowest
rank's mean step each time; it prints the median and each step's excess over its plain step, and
for exact the part of the step spent in its exchange (``exchange_s``: from the end of backward to
the reduced gradients, the wait for the other rank included; the ranks' mean)::

    OMP_NUM_THREADS=1 .venv/bin/python docs/experiments/step_overhead.py
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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exchange_wait import local_rank, run_ranks

CASES = ("mnist1d", "tiny", "tiny8", "tiny+filler")
ALGORITHMS = (("plain", {}), ("model_averaging", {"block_size": 256}), ("data_parallel", {}))


def _body(rank: int, n: int, port: int, steps: int, repeats: int, queue: Any) -> None:
    local_rank(rank, n, port)
    torch.set_num_threads(1)
    import bunsan
    from bunsan import models

    bunsan.init()
    makers = {
        "mnist1d": (lambda: models.create("mnist1d_cnn"), (32, 1, 40), 10),
        "tiny": (lambda: nn.Linear(4, 2), (32, 4), 2),
        "tiny8": (
            lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)),
            (32, 4),
            2,
        ),
        "tiny+filler": (lambda: nn.Linear(4, 2), (32, 4), 2),
    }
    filler = models.create("mnist1d_cnn")
    fx, fy = torch.randn(32, 1, 40), torch.randint(0, 10, (32,))
    found: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name in CASES:
            make, shape, classes = makers[name]
            g = torch.Generator().manual_seed(rank)
            x, y = torch.randn(*shape, generator=g), torch.randint(0, classes, (32,), generator=g)
            for algorithm, options in ALGORITHMS:
                torch.manual_seed(0)
                model = make()
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
                if algorithm != "plain":
                    model, optimizer = bunsan.distribute(model, optimizer, algorithm, **options)
                fill = name == "tiny+filler"

                def run(
                    count: int,
                    model: Any = model,
                    optimizer: Any = optimizer,
                    fill: bool = fill,
                    x: Any = x,
                    y: Any = y,
                ) -> None:
                    for _ in range(count):
                        if fill:
                            filler.zero_grad(set_to_none=True)
                            F.cross_entropy(filler(fx), fy).backward()
                        optimizer.zero_grad()
                        F.cross_entropy(model(x), y).backward()
                        optimizer.step()

                run(16)
                exact = algorithm == "data_parallel"
                if exact:  # its wait in the exchange: from the end of backward to the reduced gradients
                    optimizer.algorithm.exchange_s = 0.0
                dist.barrier()
                start = time.perf_counter()
                run(steps)
                step = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
                wait = torch.tensor([optimizer.algorithm.exchange_s / steps if exact else 0.0], dtype=torch.float64)
                if algorithm != "plain":
                    optimizer.join()
                dist.all_reduce(step, op=dist.ReduceOp.MAX)
                dist.all_reduce(wait)  # the ranks' mean, below
                found.setdefault((name, algorithm), []).append(float(step[0]))
                found.setdefault((name, algorithm + "/wait"), []).append(float(wait[0]) / n)
    queue.put((rank, found))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=256, help="timed steps a run (a multiple of 8: whole blocks)")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    if args.steps < 8 or args.steps % 8 or args.repeats < 1:
        parser.error("--steps must be a positive multiple of 8 and --repeats at least 1")
    found = run_ranks(_body, 2, (args.steps, args.repeats))[0]
    print(f"2 ranks on loopback, {args.steps} steps x {args.repeats}; load average {os.getloadavg()[0]:.2f} after")
    for name in CASES:
        plain = statistics.median(found[(name, "plain")])
        for algorithm, _ in ALGORITHMS:
            runs = found[(name, algorithm)]
            step = statistics.median(runs)
            wait = statistics.median(found[(name, algorithm + "/wait")])
            print(
                f"{name:12s} {algorithm:16s} {1e3 * step:6.3f} ms, over the plain step {1e3 * (step - plain):+6.3f} ms"
                + (f", of it in the exchange {1e3 * wait:5.3f} ms" if algorithm == "data_parallel" else "")
                + f" (runs {' '.join(f'{1e3 * v:.2f}' for v in runs)})"
            )


if __name__ == "__main__":
    main()
