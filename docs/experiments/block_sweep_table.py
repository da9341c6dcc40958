"""Medians over seeds of ``docs/experiments/block_sweep.sh``'s records: per model, network and
worker count, each setting's steps per block, epochs to the target, time to target, whole run,
and time to target relative to the fastest setting of its row group.

    python docs/experiments/block_sweep_table.py 'runs/sweep1/*/compare.json'
"""

from __future__ import annotations

import glob
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from bunsan._table import format_table
from bunsan.bench.tta import tta_rows


def main(pattern: str) -> None:
    groups: dict[tuple[str, str, int, str], list[dict]] = defaultdict(list)
    batches: dict[tuple[str, int], int] = {}
    for path in sorted(glob.glob(pattern)):
        record = json.loads(Path(path).read_text())
        arguments = record["arguments"]
        network = arguments.get("network") or "loopback"
        for row in tta_rows(record["configs"], "data_parallel", 1.0):
            groups[(arguments["model"], str(network), row["workers"], row["label"])].append(row)
        for config in record["configs"]:
            batches[(arguments["model"], config["workers"])] = config["per_worker_batch"]
    table = []
    best: dict[tuple[str, str, int], float] = {}
    medians = {}
    for key, rows in groups.items():
        # a missed target counts as later than any time or epoch; a median that is one prints as "-"
        median = statistics.median(math.inf if r["tta_s"] is None else r["tta_s"] for r in rows)
        medians[key] = (
            median,
            statistics.median(math.inf if r["epoch"] is None else r["epoch"] for r in rows),
            statistics.median(r["run_s"] for r in rows),
            len(rows),
        )
        best[key[:3]] = min(best.get(key[:3], math.inf), median)
    for key in sorted(medians):
        model, network, workers, label = key
        median, epoch, run_s, seeds = medians[key]
        size = re.search(r"block_size=(\d+)", label)
        steps = str(int(size.group(1)) // batches[(model, workers)]) if size else "1"
        table.append(
            [
                model,
                network,
                str(workers),
                label,
                steps,
                str(seeds),
                "-" if math.isinf(epoch) else f"{epoch:g}",
                "-" if math.isinf(median) else f"{median:.2f}",
                f"{run_s:.2f}",
                "-" if math.isinf(median) else f"{median / best[key[:3]]:.2f}",
            ]
        )
    columns = [
        "model",
        "network",
        "workers",
        "setting",
        "steps/block",
        "seeds",
        "epochs to target",
        "to target (s)",
        "whole run (s)",
        "vs fastest",
    ]
    print(format_table(columns, table))


if __name__ == "__main__":
    main(sys.argv[1])
