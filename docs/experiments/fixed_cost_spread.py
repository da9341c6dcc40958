"""How much of the fixed costs' move from round to round is their own timing's noise: few runs against many.

``tools/predict.py`` times every candidate's fixed cost (:func:`bunsan.algorithms.measure.
measure_fixed_costs`: the tiny model's step less the local step and the model's price, the median
of ``repeats`` runs of whole blocks) once in every round, and prices that round with it. On the
small CNNs, whose rows are half fixed cost, a row's price moves from round to round more than its
measured step does (predict_reprice's round noise), and one row's three rounds of a fixed cost
can differ three-fold (MNIST-1D's block momentum at 1 Gbit/s and 2 workers in predict-37: 6.4, 1.6
and 4.3 ms a block). If that spread is the timing's own noise, more runs a round shrink it as one
over their square root; if it is the machine's state (which the bench pairs with each round on
purpose), they do not.

This calls ``measure_fixed_costs`` on ``--workers`` local ranks over loopback (Gloo, one thread
each) on the bench's default candidates and their own probe, ``--calls`` times, alternating the
bench's 3 runs a call with ``--many`` runs, and prints for each candidate the median and the
spread (sd) of its fixed cost over the calls at each setting, in ms (a block algorithm's per
block), and the ratio of the spreads. The overlap and spare-core rules are
``measure_fixed_costs``' own defaults for local ranks, which the bench also takes on loopback::

    OMP_NUM_THREADS=1 .venv/bin/python docs/experiments/fixed_cost_spread.py --workers 2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exchange_wait import local_rank, run_ranks

FEW = 3  # measure_fixed_costs' repeats, as the bench calls it


def _body(rank: int, n: int, port: int, calls: int, many: int, queue: Any) -> None:
    local_rank(rank, n, port)
    import bunsan
    from bunsan.algorithms import async_model as am
    from bunsan.algorithms import cost_model as cm
    from bunsan.algorithms.measure import measure_fixed_costs, measure_network

    bunsan.init()
    candidates = am.default_candidates(256)
    network = measure_network()
    block = cm.block_steps(256, 32)  # the bench's tiny runs hold whole blocks: 8 steps of 32 samples
    found: dict[tuple[str, int], list[float]] = {}
    for _ in range(calls):
        for repeats in (FEW, many):
            costs = measure_fixed_costs(
                candidates, network, distribute=bunsan.distribute, steps=2 * block, warmup=block, repeats=repeats
            )
            for label, value in costs:
                found.setdefault((label, repeats), []).append(value)
    queue.put((rank, found))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=8, help="calls at each setting, alternating")
    parser.add_argument("--many", type=int, default=15, help="runs a call against the bench's 3")
    args = parser.parse_args()
    if args.workers < 2 or args.calls < 3 or args.many <= FEW:
        parser.error(f"--workers at least 2, --calls at least 3, --many above {FEW}")
    found = run_ranks(_body, args.workers, (args.calls, args.many))[0]
    print(
        f"{args.workers} ranks on loopback, {args.calls} calls of {FEW} and of {args.many} runs, alternating; "
        f"load average {os.getloadavg()[0]:.2f} after"
    )
    labels = list(dict.fromkeys(label for label, _ in found))
    for label in labels:
        few, many = found[(label, FEW)], found[(label, args.many)]
        sd_few, sd_many = statistics.stdev(few), statistics.stdev(many)
        print(
            f"{label:22s} {FEW:2d} runs: median {1e3 * statistics.median(few):6.2f} ms, sd {1e3 * sd_few:5.2f} | "
            f"{args.many:2d} runs: median {1e3 * statistics.median(many):6.2f} ms, sd {1e3 * sd_many:5.2f} | "
            f"sd ratio {sd_many / sd_few if sd_few else math.nan:4.2f} "
            f"(timing noise alone: {math.sqrt(FEW / args.many):.2f})"
        )


if __name__ == "__main__":
    main()
