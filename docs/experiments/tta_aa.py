"""The floor of issue 19's time-to-accuracy bar on this machine: one fixed setting run twice in the same records.

``bunsan bench tta`` scores Auto by its time to the target over the best fixed setting's, the
fastest of several settings timed in the same compare run. Where the settings' times move from
job to job, that minimum is partly luck, and a setting measured once against it comes out slower
even where it is the best setting itself. This script measures how much: in records that ran a
setting twice (``--copy``, a second label of ``--of``: ``model_averaging:block_size=1024,warm_start=0``
trains exactly as ``model_averaging:block_size=1024``), it scores the copy as Auto is scored
(``bunsan.bench.tta.campaign_rows``: the copy over the best of the other fixed settings, medians
over seeds, and held out), beside Auto's own row over the same fixed settings (the copy left out),
and prints the copy's time over its twin's at each seed (the same setting's run-to-run spread)::

    SEEDS="0 1 2 3 4 5" NP=4 FIXED="data_parallel block_momentum:block_size=1024,block_learning_rate=0.5 \\
      model_averaging:block_size=1024 model_averaging:block_size=1024,warm_start=0" \\
      bash docs/experiments/tta_campaign.sh runs/tta72 "rate=1gbit loopback" mnist1d_cnn
    python docs/experiments/tta_aa.py --of model_averaging:block_size=1024 \\
      --copy model_averaging:block_size=1024,warm_start=0 runs/tta72/*/compare.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bunsan.bench.tta import tta_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # the campaign's summary
from tta_campaign import campaign_rows  # noqa: E402

AS_AUTO = "auto:copy"  # the label the copy is scored under (campaign_rows scores labels starting with "auto")


def views(document: dict[str, Any], of: str, twin: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Auto's view: the copy left out; the copy's view: Auto left out, the copy relabelled as an auto setting)."""
    labels = {c["label"] for c in document["configs"]}
    for label in (of, twin):
        if label not in labels:
            raise ValueError(f"the record has no {label!r} run (it has {sorted(labels)})")
    auto_view = copy.deepcopy(document)
    auto_view["configs"] = [c for c in document["configs"] if c["label"] != twin]
    copy_view = copy.deepcopy(document)
    copy_view["configs"] = [
        {**c, "label": AS_AUTO} if c["label"] == twin else c
        for c in document["configs"]
        if not c["label"].startswith("auto")
    ]
    return auto_view, copy_view


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--of", required=True, help="the fixed setting run twice, as labelled")
    parser.add_argument("--copy", required=True, help="its second label in the same records")
    parser.add_argument("--reference", default="data_parallel", help="the setting whose final error sets the target")
    parser.add_argument("--points", type=float, default=1.0, help="percentage points above the reference's final error")
    parser.add_argument("record", nargs="+")
    args = parser.parse_args(argv)
    autos, copies, twins = [], [], {}
    for name in args.record:
        path = Path(name)
        try:
            document = json.loads(path.read_text())
            auto_view, copy_view = views(document, args.of, args.copy)
        except (OSError, json.JSONDecodeError, KeyError, ValueError) as err:
            print(f"tta_aa.py: error: cannot use {name}: {err}", file=sys.stderr)
            return 2
        autos.append((path, auto_view))
        copies.append((path, copy_view))
        network = document.get("arguments", {}).get("network") or "loopback"
        times = {
            (r["label"], r["workers"]): r["tta_s"] for r in tta_rows(document["configs"], args.reference, args.points)
        }
        for (label, workers), twin_s in times.items():
            copy_s = times.get((args.copy, workers))
            if label == args.of and twin_s and copy_s:
                twins.setdefault((network, workers), []).append(copy_s / twin_s)
    by_key = {}
    for kind, records in (("auto", autos), ("copy", copies)):
        for row in campaign_rows(records, args.reference, args.points):
            by_key.setdefault((row["network"], row["workers"]), {})[kind] = row
    print(
        f"{'network':<13} {'workers':>7} {'seeds':>5}  {'best of the others':<52} {'auto/best':>9} {'held out':>8}"
        f"  {'copy/best':>9} {'held out':>8}  copy/twin by seed (median)"
    )
    for (network, workers), rows in sorted(by_key.items()):
        a, c = rows.get("auto"), rows.get("copy")
        if a is None or c is None:
            continue

        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        pairs = sorted(twins.get((network, workers), []))
        print(
            f"{network:<13} {workers:>7} {c['seeds']:>5}  {c['best_label']!s:<52} {fmt(a['ratio']):>9}"
            f" {fmt(a['held_out_ratio']):>8}  {fmt(c['ratio']):>9} {fmt(c['held_out_ratio']):>8}  "
            + ", ".join(f"{p:.2f}" for p in pairs)
            + (f" ({statistics.median(pairs):.2f})" if pairs else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
