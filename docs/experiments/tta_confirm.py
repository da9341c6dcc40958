"""A confirmation run of one campaign row: auto and the best fixed setting again, alternately.

A campaign row (`docs/experiments/tta_campaign.sh`) compares auto's one run with the best of six
fixed settings' single runs. Where the settings are close, the best is the luckiest draw: on
this 2-core machine the same job's time moves by 20-25% from run to run (docs/experiments/plan.md), so the
minimum of six runs sits below what that setting gives on average, and auto's single run is
compared with it. Picking the best on one set of runs and measuring it on another removes that
selection bias: this script reruns the row's auto setting and its best fixed setting
``--rounds`` times each, alternating (auto first in even rounds, the best first in odd ones),
with the record's own arguments (model, data, epochs, batch, learning rate, momentum, seed,
network), and reports each run's time to the record's target (the reference setting's final
error plus ``--points``; or ``--target``), their medians and the ratio of the medians beside
the campaign's ratio.

Usage::

    python docs/experiments/tta_confirm.py runs/tta41/resnet20-loopback/compare.json --workers 2 \
        --rounds 3 --out runs/confirm-r20-lo-2w

``BUNSAN`` (environment) names the bunsan command (default ``bunsan``); shaped networks need root.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bunsan.bench.tta import epochs_to_error, time_to_error, tta_rows


def _compare_command(arguments: dict[str, Any], workers: int, spec: str, out: Path) -> list[str]:
    bunsan = shlex.split(os.environ.get("BUNSAN", "bunsan"))
    command = [*bunsan, "bench", "compare", "--model", arguments["model"], "--dataset", arguments["dataset"]]
    command += ["-np", str(workers), "--epochs", str(arguments["epochs"]), "--batch", str(arguments["batch"])]
    command += [
        "--lr",
        str(arguments["lr"]),
        "--momentum",
        str(arguments["momentum"]),
        "--seed",
        str(arguments["seed"]),
    ]
    command += [
        "--weight-decay",
        str(arguments.get("weight_decay", 0.0)),
        "--threads",
        str(arguments.get("threads", 1)),
    ]
    command += ["--timeout-s", str(arguments.get("timeout_s", 1800.0))]
    for flag in ("batch_per_worker", "nesterov", "recompute_bn"):
        if arguments.get(flag):
            command.append("--" + flag.replace("_", "-"))
    if arguments.get("network"):
        command += ["--network", arguments["network"]]
    return [*command, "--algorithms", spec, "--no-plots", "--out", str(out)]


def _median_epoch(epoch_end_s: list[float]) -> float:
    """The median epoch's seconds past the first (the first holds Auto's measuring)."""
    durations = [b - a for a, b in itertools.pairwise(epoch_end_s)]
    return statistics.median(durations) if durations else epoch_end_s[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="a campaign row's bench compare JSON record")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reference", default="data_parallel")
    parser.add_argument("--points", type=float, default=1.0)
    parser.add_argument("--target", type=float, default=None, help="test error (%%) to reach, instead of the record's")
    parser.add_argument("--best", default=None, help="the fixed setting to confirm (default: the record's best)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record = json.loads(Path(args.record).read_text())
    arguments = record["arguments"]
    here = [c for c in record["configs"] if c["workers"] == args.workers and c.get("status") == "ok"]
    auto = next((c["label"] for c in here if c["label"].startswith("auto")), None)
    if auto is None:
        parser.error(f"{args.record} has no successful auto run at {args.workers} workers")
    if args.target is not None:
        target = args.target / 100
        times = {c["label"]: time_to_error(c["test_error_curve"], c["epoch_end_s"], target) for c in here}
    else:
        rows = [r for r in tta_rows(record["configs"], args.reference, args.points) if r["workers"] == args.workers]
        target = rows[0]["target"]
        times = {r["label"]: r["tta_s"] for r in rows}
    fixed = {label: t for label, t in times.items() if not label.startswith("auto") and t is not None}
    if args.best is None and not fixed:
        parser.error(
            f"no fixed setting of {args.record} reached the target at {args.workers} workers; name one with --best"
        )
    best = args.best or min(fixed, key=fixed.__getitem__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"{arguments['model']} on {arguments['dataset']}, {args.workers} workers, network "
        f"{arguments.get('network') or 'loopback'}, seed {arguments['seed']}; target {100 * target:.2f}% test error; "
        f"campaign: {auto} {times[auto]} s, best {best} {times.get(best)} s; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for spec in (auto, best) if round_ % 2 == 0 else (best, auto):
            where = out / f"r{round_}-{'auto' if spec == auto else 'best'}"
            command = _compare_command(arguments, args.workers, spec, where)
            started = time.time()
            done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                print(f"round {round_} {spec}: bench compare failed ({done.returncode}): {done.stderr[-2000:]}")
                return 1
            config = json.loads((where / "compare.json").read_text())["configs"][0]
            tta = time_to_error(config["test_error_curve"], config["epoch_end_s"], target)
            run = {
                "round": round_,
                "label": spec,
                "tta_s": tta,
                "epoch": epochs_to_error(config["test_error_curve"], target),
                "run_s": config["epoch_end_s"][-1],
                "epoch_s": _median_epoch(config["epoch_end_s"]),
                "started_at": started,
                "auto_decision": (config.get("auto_decision") or {}).get("label"),
            }
            runs.append(run)
            print(
                f"round {round_} {spec:56s} time to target {tta if tta is None else round(tta, 2)} s"
                f" (epoch {run['epoch']}), whole run {run['run_s']:.2f} s, median epoch past the first"
                f" {run['epoch_s'] * 1e3:.0f} ms" + (f", chose {run['auto_decision']}" if run["auto_decision"] else ""),
                flush=True,
            )

    def median(label: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["label"] == label]
        return None if any(v is None for v in values) else statistics.median(values)

    a, b = median(auto, "tta_s"), median(best, "tta_s")
    ratio = a / b if a is not None and b else None
    whole = median(auto, "run_s") / median(best, "run_s")
    epochs = median(auto, "epoch_s") / median(best, "epoch_s")
    print(
        f"median time to target: {auto} {a} s, {best} {b} s: ratio {ratio if ratio is None else round(ratio, 2)}"
        + (f" (campaign {times[auto] / times[best]:.2f})" if times.get(best) and times.get(auto) else "")
        + f"; whole runs {whole:.2f}, epochs past the first {epochs:.2f}; load average {os.getloadavg()[0]:.2f}"
    )
    summary = {
        "record": args.record,
        "workers": args.workers,
        "target": target,
        "auto": auto,
        "best": best,
        "campaign": {"auto_s": times.get(auto), "best_s": times.get(best)},
        "runs": runs,
        "median_ratio": ratio,
        "whole_run_ratio": whole,
        "epoch_ratio": epochs,
        "command": " ".join(shlex.quote(a) for a in sys.argv),
    }
    (out / "confirm.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
