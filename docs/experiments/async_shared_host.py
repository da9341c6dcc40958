"""Async rows of a `tools/predict.py` record priced by the model before and after async on a
shared host (now async_model.shared_compute, 47f013b), on the same measurements: each 4-worker row's
measured step, the prediction at ``ranks_per_core`` 1 and at the recorded one, as a Markdown
table, and how many async rows each puts within 20%.

    python docs/experiments/async_shared_host.py runs/predict-16

Needs a record that holds ``ranks_per_core`` and ``copy_s_per_element`` (tools/predict.py since 47f013b).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bunsan.algorithms import async_model as am
from bunsan.algorithms import cost_model as cm


def predicted(row: dict, network: cm.Network, ranks_per_core: float) -> float:
    """The row's async step from its recorded profile, at ``ranks_per_core``."""
    profile = cm.Profile(
        compute_s=row["compute_s"],
        params=row["params"],
        copy_s_per_element=row["copy_s_per_element"],
        straggler_s=row["straggler_s"],
        fixed_s=(("async", row["fixed_s"]),),
        ranks_per_core=ranks_per_core,
    )
    candidate = cm.Candidate("async", {}, "async")
    return am.predict(
        profile, network, candidate, row["workers"], overlap=row["overlap"], spare_core=row["spare_core"]
    ).step_s


def main(run: str) -> None:
    within = {"before": 0, "shared host": 0}
    lines = ["| network | model | measured | model before | shared host |", "|---|---|---|---|---|"]
    for result in sorted(Path(run).glob("*-np*/result.json")):
        record = json.loads(result.read_text())
        net = record["network"]
        network = cm.Network(
            latency_s=net["latency_s"],
            bandwidth=net["bandwidth"],
            gather_bandwidth=net.get("gather_bandwidth"),
            half_bandwidth=net.get("half_bandwidth"),
            burst_bytes=net.get("burst_bytes") or 0.0,
        )
        for row in record["rows"]:
            if row["label"] != "async":
                continue
            if "ranks_per_core" not in row:
                sys.exit(f"{result}: recorded before tools/predict.py kept ranks_per_core (47f013b); run it again")

            measured = row["measured_s"]
            before, shared = predicted(row, network, 1.0), predicted(row, network, row["ranks_per_core"])
            within["before"] += abs(before / measured - 1) <= 0.2
            within["shared host"] += abs(shared / measured - 1) <= 0.2
            if row["workers"] == 4:
                lines.append(
                    f"| {row['network']} | {row['model']} | {measured * 1e3:.2f} | {before * 1e3:.2f} "
                    f"({before / measured - 1:+.0%}) | {shared * 1e3:.2f} ({shared / measured - 1:+.0%}) |"
                )
    print("\n".join(lines))
    print(", ".join(f"{name}: {count} async rows within 20%" for name, count in within.items()))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not any(Path(sys.argv[1]).glob("*-np*/result.json")):
        sys.exit("usage: python docs/experiments/async_shared_host.py RUN_DIR (a tools/predict.py --out directory)")
    main(sys.argv[1])
