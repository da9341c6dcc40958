"""How much of auto's time to accuracy is its own measuring, per `bunsan bench compare` record.

For every record (one model, network and seed; `docs/experiments/tta_campaign.sh` writes
them) and worker count, prints auto's time to the target (exact's final test error plus
``--points``), the best fixed setting's at the same seed, their ratio, what rank 0 printed
as Auto's measuring and deciding time, how much longer auto's first epoch was than the best
setting's (the exact measuring steps, the network and codec measurements and the fixed-cost
probes all fall in it), and the ratio with that excess taken out of auto's time. Then the
median of each over the seeds, per model, network and worker count.

``--against LABEL`` compares auto with that setting instead of the best, and says whether
their test-error curves are the same (e.g. the fixed setting Auto chose, with a warm start
of the samples Auto trained exactly while measuring: a switch that changed nothing else
gives the same curve).

  python docs/experiments/tta_overhead.py 'runs/tta10/*/compare.json'
  python docs/experiments/tta_overhead.py 'runs/twin-s*/compare.json' \
      --against model_averaging:block_size=1024,warm_start=1408
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
from pathlib import Path

from bunsan.bench.tta import tta_rows

DECIDED = re.compile(r"measured and decided in ([0-9.]+) s")


def measuring_s(run_dir: Path) -> float | None:
    """Auto's 'measured and decided in X s' from rank 0's stdout, if printed."""
    try:
        match = DECIDED.search((run_dir / "stdout.txt").read_text(errors="replace"))
    except OSError:
        return None
    return float(match.group(1)) if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", help="compare.json files or glob patterns")
    parser.add_argument("--reference", default="data_parallel")
    parser.add_argument("--points", type=float, default=1.0)
    parser.add_argument("--against", help="the setting to compare auto with (default: the best fixed one)")
    args = parser.parse_args()
    paths = sorted({p for pattern in args.records for p in glob.glob(pattern)})
    if not paths:
        parser.error("no record matches")
    print(f"auto against: {args.against or 'the best fixed setting of the same record'}")
    header = f"{'record':30s} {'np':>2s} {'auto (s)':>8s} {'best (s)':>8s} {'ratio':>5s} {'decide (s)':>10s} {'1st-epoch excess (s)':>20s} {'ratio without it':>16s} {'epochs':>7s} {'same curve':>10s}"
    print(header)
    print("-" * len(header))
    groups: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    for path in paths:
        document = json.loads(Path(path).read_text())
        arguments = document.get("arguments", {})
        try:
            rows = tta_rows(document["configs"], args.reference, args.points)
        except ValueError as error:
            parser.error(f"{path}: {error}")
        if args.against and all(c["label"] != args.against for c in document["configs"]):
            parser.error(f"{path} has no setting {args.against!r}")
        for workers in sorted({r["workers"] for r in rows}):
            here = [r for r in rows if r["workers"] == workers]
            auto = next((r for r in here if r["label"].startswith("auto")), None)
            fixed = [r for r in here if not r["label"].startswith("auto") and r["tta_s"] is not None]
            if args.against:
                fixed = [r for r in fixed if r["label"] == args.against]
            if auto is None or auto["tta_s"] is None or not fixed:
                continue
            best = min(fixed, key=lambda r: r["tta_s"])
            configs = {c["label"]: c for c in document["configs"] if c["workers"] == workers}
            auto_config, best_config = configs[auto["label"]], configs[best["label"]]
            same = auto_config["test_error_curve"] == best_config["test_error_curve"]
            excess = auto_config["epoch_end_s"][0] - best_config["epoch_end_s"][0]
            run_dir = Path(auto_config.get("dir", ""))
            if not run_dir.is_dir():
                run_dir = Path(path).parent / run_dir.name
            decide = measuring_s(run_dir)
            ratio, without = auto["tta_s"] / best["tta_s"], (auto["tta_s"] - excess) / best["tta_s"]
            print(
                f"{Path(path).parent.name:30s} {workers:2d} {auto['tta_s']:8.2f} {best['tta_s']:8.2f} {ratio:5.2f} "
                f"{'-' if decide is None else f'{decide:.2f}':>10s} {excess:20.2f} {without:16.2f} "
                f"{str(auto['epoch']) + '/' + str(best['epoch']):>7s} {'yes' if same else 'no':>10s}"
            )
            key = (arguments.get("model", "?"), arguments.get("network") or "loopback", workers)
            groups.setdefault(key, []).append((ratio, excess, without))
    print()
    print(
        f"{'model':12s} {'network':12s} {'np':>2s} {'seeds':>5s} {'ratio':>5s} {'1st-epoch excess (s)':>20s} {'ratio without it':>16s}  (medians)"
    )
    for (model, network, workers), values in sorted(groups.items()):
        ratio, excess, without = (statistics.median(v[i] for v in values) for i in range(3))
        print(f"{model:12s} {network:12s} {workers:2d} {len(values):5d} {ratio:5.2f} {excess:20.2f} {without:16.2f}")


if __name__ == "__main__":
    main()
