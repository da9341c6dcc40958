"""Seed statistics of `bunsan bench compare --json` records: is a setting within a point of exact SGD?

The final-epoch test error of one run on MNIST-1D at lr 0.05, momentum 0.9 is a chaotic
function of the arithmetic (docs/experiments/design-notes.md, "1-bit defaults"), so a 3-seed mean
resolves about a point. This script reads one JSON record per seed (each with the exact
``data_parallel`` row and the settings to judge, all at the same worker count) and prints,
per worker count and setting:

* the final-epoch test error of every seed, its mean and standard deviation;
* the paired difference to exact data parallel at the same seed: mean, standard error;
* the same for the mean of the last 6 epochs' test errors (less noisy than the last epoch);
* the mean absolute change of the test error between consecutive epochs over the last 8
  epochs (how much a run still wobbles at the end);
* how often a 3-seed mean would land more than a point above exact's, estimated as a normal
  tail from the paired differences' spread (the issue's acceptance takes 3 seeds).

Records come from, e.g. (one per seed S):

  bunsan bench compare --model mnist1d_cnn --dataset mnist1d -np 2 --epochs 30 --batch 128 \\
      --lr 0.05 --momentum 0.9 --seed S --no-plots --json runs/np2_sS.json \\
      --algorithms data_parallel data_parallel:bits=1,warm_start=40000

  python docs/experiments/seed_spread.py 'runs/*.json'
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
from collections import defaultdict

EXACT = "data_parallel"


def load(patterns: list[str]) -> dict[tuple[int, str], dict[int, list[float]]]:
    """``{(workers, label): {seed: test-error curve in %, last entry the final error}}``."""
    runs: dict[tuple[int, str], dict[int, list[float]]] = defaultdict(dict)
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            with open(path) as f:
                record = json.load(f)
            seed = int(record["arguments"]["seed"])
            for config in record["configs"]:
                if config.get("status") != "ok":
                    continue
                curve = [100 * e for e in config["test_error_curve"]]
                curve[-1] = 100 * config["test_error"]
                runs[(int(config["workers"]), config["label"])][seed] = curve
    return runs


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.mean(values), se


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("patterns", nargs="+", help="JSON records of `bunsan bench compare --json` (globs)")
    ap.add_argument("--per-seed", action="store_true", help="print every seed's final error")
    a = ap.parse_args()
    runs = load(a.patterns)
    for (workers, label), curves in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] != EXACT, kv[0][1])):
        exact = runs.get((workers, EXACT), {})
        seeds = sorted(curves)
        final = [curves[s][-1] for s in seeds]
        wobble = statistics.mean(
            statistics.mean(abs(c[i] - c[i - 1]) for i in range(len(c) - 8, len(c))) for c in curves.values()
        )
        line = (
            f"{workers} workers  {label}: {len(seeds)} seeds, final {statistics.mean(final):.2f}%"
            f" (sd {statistics.stdev(final) if len(final) > 1 else float('nan'):.2f}),"
            f" last-6 {statistics.mean(statistics.mean(curves[s][-6:]) for s in seeds):.2f}%,"
            f" end wobble {wobble:.2f}"
        )
        paired = [s for s in seeds if s in exact]
        if label != EXACT and paired:
            diff = [curves[s][-1] - exact[s][-1] for s in paired]
            diff6 = [statistics.mean(curves[s][-6:]) - statistics.mean(exact[s][-6:]) for s in paired]
            d, se = mean_se(diff)
            d6, se6 = mean_se(diff6)
            line += f"; vs exact ({len(paired)} paired): final {d:+.2f} +- {se:.2f}, last-6 {d6:+.2f} +- {se6:.2f}"
            if len(diff) > 2:
                sd3 = statistics.stdev(diff) / math.sqrt(3)
                tail = 0.5 * math.erfc((1.0 - d) / (sd3 * math.sqrt(2)))
                line += f", P(3-seed mean > exact + 1) ~ {tail:.2f}"
        print(line)
        if a.per_seed:
            print("    " + "  ".join(f"{s}:{curves[s][-1]:.1f}" for s in seeds))


if __name__ == "__main__":
    main()
