"""Auto's time to accuracy over a campaign: the summary of several ``bunsan bench compare`` records.

Campaign tooling, run from a checkout (not part of the installed package; ``bunsan bench tta``
reads one record). The target and each setting's time to it are ``bunsan bench tta``'s
(:mod:`bunsan.bench.tta`).

Given the ``bunsan bench compare`` records of a campaign (``docs/experiments/tta_campaign.sh``),
it prints one row per model, network and worker count: what auto chose (read from its
run's stdout), its time to target, the best fixed setting's, their ratio, and how
many rows are within ``--within`` (1.10); then the epochs in which the two reach the
target and the ratio of their whole runs (the same epochs), which tell a slower
choice (whole run over 1.10) from a target crossed in an earlier epoch by the other
setting's trajectory (the ratio to target well above the whole run's). Records that
differ only in their seed make one row of medians over the seeds, and there a last column
compares auto, seed by seed, with the setting the other seeds pick (no selection bias)::

    python tools/tta_campaign.py runs/tta/*/compare.json

This script imports no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's bunsan

from bunsan._table import format_table  # noqa: E402
from bunsan.bench._common import command_main  # noqa: E402
from bunsan.bench.tta import add_target_arguments, tta_rows, without_target  # noqa: E402

__all__ = ["auto_choice", "campaign_rows", "held_out_ratios", "main", "run"]

PROG = "tools/tta_campaign.py"
DESCRIPTION = """\
Summarize the `bunsan bench compare` records of a time-to-accuracy campaign: one
row per model, network and worker count: auto's choice, its time, the best fixed
setting's, their ratio, the count within --within, the epochs in which each
reached the target and the ratio of their whole runs; over several seeds, auto
against the setting picked on the other seeds."""
EPILOG = """\
examples:
  python tools/tta_campaign.py runs/tta/*/compare.json
  python tools/tta_campaign.py runs/tta/*/compare.json --within 1.2"""


def auto_choice(stdout: Path) -> str:
    """What an auto run chose, from the table rank 0 printed to ``stdout`` ("?" if it is not there)."""
    try:
        lines = stdout.read_text(errors="replace").splitlines()
    except OSError:
        return "?"
    chosen = "?"
    for line in lines:
        if "network measurement was inconclusive" in line:
            return "exact (network inconclusive)"
        if line.rstrip().endswith("<- chosen"):
            chosen = line.removeprefix("[bunsan]").split()[0]
        elif "Auto's trial after block" in line:  # exact kept, a block algorithm tried: the trial's outcome
            outcome = line.rsplit(" ms: ", 1)[-1]
            chosen = "exact (after a trial)" if outcome.startswith("back to exact") else f"{outcome.split()[0]} (trial)"
    return chosen


def _median(values: Sequence[float | None]) -> float | None:
    """The median, a missed target (``None``) counting as later than any time: ``None`` when half the
    values or more are ``None``."""
    value = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(value) else value


def held_out_ratios(per_seed: Sequence[dict[str, float | None]], auto_label: str) -> list[float | None]:
    """Auto's time to target over that of the fixed setting picked on the other seeds, at each seed.

    ``per_seed``: one ``label -> time to target`` (``None``: never reached) per seed. At each seed the
    fixed setting with the smallest median time over the *other* seeds is picked (a setting that missed
    at half of them or more is not a candidate), and auto's time at this seed is divided by the picked
    setting's at this seed (``None`` where auto missed the target there, ``inf`` where only the picked
    setting did). Picking the best on the same runs it is measured on takes the luckiest draw of several
    noisy settings (a minimum sits below what the setting gives on average); picking it on other seeds
    removes that selection bias (leave-one-out cross-validation). Empty below two seeds.
    """
    if len(per_seed) < 2:
        return []
    found: list[float | None] = []
    for i, here in enumerate(per_seed):
        others = [seed for j, seed in enumerate(per_seed) if j != i]
        labels = sorted({label for seed in others for label in seed if not label.startswith("auto")})
        medians = [(_median([seed.get(label) for seed in others]), label) for label in labels]
        candidates = [(m, label) for m, label in medians if m is not None]
        if not candidates:
            continue
        picked = here.get(min(candidates)[1])
        auto = here.get(auto_label)
        if auto is None:
            found.append(None)
        else:
            found.append(auto / picked if picked else math.inf)
    return found


def campaign_rows(
    records: Sequence[tuple[Path, dict[str, Any]]], reference: str, points: float
) -> list[dict[str, Any]]:
    """One row per model, data set, network and worker count that has an auto setting: ``model, dataset,
    network, workers, seeds, chose, auto_s, best_label, best_s, ratio`` (``auto_s``/``best_s``/``ratio`` None where never
    reached), ``auto_epoch``/``best_epoch`` (the epochs they reach the target in) and ``run_ratio``
    (auto's whole run's training time over the best's: below ``ratio`` where the best reached the target
    in an earlier epoch, not by faster steps); ``seed_ratios``, auto's time over the best setting's at
    each seed where both reached the target (sorted), and ``best_spread``, the best setting's slowest
    seed's time over its fastest (``None`` below two seeds that reached it): how far one trajectory
    moves the time to target, the resolution of ``ratio``; ``held_out_ratios`` (:func:`held_out_ratios`)
    and their median ``held_out_ratio`` (``None`` below two seeds, or where auto missed at half of them):
    auto against the setting the other seeds pick, without the selection bias of ``ratio``.

    Records of the same model, data set and network at several seeds are one row: each setting's time to
    its seed's target, epoch and whole run are medians over the seeds (a setting that missed the
    target at half of them or more counts as never reaching it), and the best fixed setting is
    the one with the smallest median time. An auto run's directory is looked up as recorded,
    else beside the record."""
    # (model, data set, network, workers) -> label -> one (tta_s, epoch, run_s) per seed; and auto's choices
    runs: dict[tuple[str, str, str, int], dict[str, list[tuple[float | None, int | None, float]]]] = {}
    seeds: dict[tuple[str, str, str, int], list[Any]] = {}
    choices: dict[tuple[str, str, str, int], list[str]] = {}
    per_seed: dict[tuple[str, str, str, int], list[dict[str, float | None]]] = {}  # label -> tta_s, by seed
    for path, document in records:
        arguments = document.get("arguments", {})
        network = arguments.get("network") or "loopback"
        rows = tta_rows(document["configs"], reference, points)
        for config in document["configs"]:
            if not config["label"].startswith("auto") or config.get("status") != "ok":
                continue
            key = (arguments.get("model", "?"), arguments.get("dataset") or "?", network, config["workers"])
            seeds.setdefault(key, []).append(arguments.get("seed", 0))
            here = [r for r in rows if r["workers"] == config["workers"]]
            for r in here:
                runs.setdefault(key, {}).setdefault(r["label"], []).append((r["tta_s"], r["epoch"], r["run_s"]))
            per_seed.setdefault(key, []).append({r["label"]: r["tta_s"] for r in here})
            run_dir = Path(config.get("dir", ""))
            if not run_dir.is_dir():
                run_dir = path.parent / run_dir.name
            choices.setdefault(key, []).append(auto_choice(run_dir / "stdout.txt"))
    found = []
    for key, by_label in runs.items():
        medians = {
            label: (
                _median([t for t, _, _ in values]),
                _median([e for _, e, _ in values]),
                statistics.median(r for _, _, r in values),
            )
            for label, values in by_label.items()
        }
        auto_label = next(label for label in by_label if label.startswith("auto"))
        auto_s, auto_epoch, auto_run = medians[auto_label]
        fixed = [(m[0], label) for label, m in medians.items() if not label.startswith("auto") and m[0] is not None]
        best_label = min(fixed)[1] if fixed else None
        best = medians[best_label] if best_label else None
        model, dataset, network, workers = key
        pairs = [(seed.get(auto_label), seed.get(best_label)) for seed in per_seed[key]] if best_label else []
        seed_ratios = sorted(a / b for a, b in pairs if a is not None and b)
        best_times = [b for _, b in pairs if b is not None]
        best_spread = max(best_times) / min(best_times) if len(best_times) > 1 and min(best_times) > 0 else None
        held_out = held_out_ratios(per_seed[key], auto_label)
        found.append(
            {
                "model": model,
                "dataset": dataset,
                "network": network,
                "workers": workers,
                "seeds": len(seeds[key]),
                "chose": " / ".join(dict.fromkeys(choices[key])),
                "auto_s": auto_s,
                "best_label": best_label,
                "best_s": best[0] if best else None,
                "ratio": auto_s / best[0] if best and best[0] and auto_s is not None else None,
                "auto_epoch": auto_epoch,
                "best_epoch": best[1] if best else None,
                "run_ratio": auto_run / best[2] if best else None,
                "seed_ratios": seed_ratios,
                "best_spread": best_spread,
                "held_out_ratios": held_out,
                "held_out_ratio": _median(held_out) if held_out else None,
            }
        )
    return found


def run(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """Print the campaign's summary; 0 on success, 2 on bad input."""
    records = []
    try:
        for name in args.record:
            records.append((Path(name), json.loads(Path(name).read_text())))
        rows = campaign_rows(records, args.reference, args.points)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as err:
        print(f"{PROG}: error: cannot use the records: {err}", file=sys.stderr)
        return 2

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    def held_out(row: dict[str, Any]) -> str:  # "-" below two seeds; "never" where auto missed at half
        if not row["held_out_ratios"]:
            return "-"
        return "never" if row["held_out_ratio"] is None else f"{row['held_out_ratio']:.2f}"

    def epoch(value: float | None) -> str:  # a median over an even number of seeds can end in .5
        return "-" if value is None else f"{value:g}"

    header = (
        "model",
        "network",
        "workers",
        "seeds",
        "auto chose",
        "auto (s)",
        "best fixed setting",
        "best (s)",
        "auto / best",
        "epochs auto / best",
        "whole run auto / best",
        "auto / best by seed",
        "best's seeds max / min",
        "auto / held-out best",
    )
    # a model trained on more than one data set in these records is named with its data set
    sets: dict[str, set[str]] = {}
    for r in rows:
        sets.setdefault(r["model"], set()).add(r["dataset"])
    cells = [
        [
            r["model"] if len(sets[r["model"]]) == 1 else f"{r['model']} on {r['dataset']}",
            r["network"],
            str(r["workers"]),
            str(r["seeds"]),
            r["chose"],
            seconds(r["auto_s"]),
            r["best_label"] or "-",
            seconds(r["best_s"]),
            "never" if r["ratio"] is None else f"{r['ratio']:.2f}",
            f"{epoch(r['auto_epoch'])} / {epoch(r['best_epoch'])}",
            "-" if r["run_ratio"] is None else f"{r['run_ratio']:.2f}",
            "-" if len(r["seed_ratios"]) < 2 else f"{r['seed_ratios'][0]:.2f}-{r['seed_ratios'][-1]:.2f}",
            "-" if r["best_spread"] is None else f"{r['best_spread']:.2f}",
            held_out(r),
        ]
        for r in rows
    ]
    right = set(header) - {"model", "network", "auto chose", "best fixed setting"}  # the numbers
    say(format_table(header, cells, right=right))
    for path, document in records:
        for note in without_target(document["configs"], args.reference):
            say(f"{path}: {note}")
    within = sum(1 for r in rows if r["ratio"] is not None and r["ratio"] <= args.within)
    say(f"auto within {args.within:.2f}x of the best fixed setting's time to target: {within} of {len(rows)}")
    runs = sum(1 for r in rows if r["run_ratio"] is not None and r["run_ratio"] <= args.within)
    say(
        f"auto's whole run within {args.within:.2f}x of that setting's whole run (the same epochs): "
        f"{runs} of {len(rows)}"
    )
    several = [r for r in rows if r["held_out_ratios"]]
    if several:
        held = sum(1 for r in several if r["held_out_ratio"] is not None and r["held_out_ratio"] <= args.within)
        say(
            f"auto within {args.within:.2f}x of the setting picked on the other seeds (held out, median over "
            f"the seeds): {held} of {len(several)} rows with two seeds or more"
        )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("record", nargs="+", help="the JSON records of bunsan bench compare, one per run")
    add_target_arguments(parser)
    parser.add_argument(
        "--within",
        type=float,
        default=1.10,
        help="count auto's rows at or below this ratio to the best; default %(default)s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python tools/tta_campaign.py RECORD [RECORD ...]``."""
    return command_main(argv, PROG, DESCRIPTION, EPILOG, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
