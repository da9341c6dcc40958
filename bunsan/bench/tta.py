"""``bunsan bench tta``: time-to-accuracy of every setting of a ``bunsan bench compare`` record, and auto against the best.

The target is the reference setting's final test error (exact ``data_parallel`` by
default) plus ``--points``; a setting's time-to-accuracy is the training time at
the end of the first epoch whose test error is at or below it (the per-epoch
curves of the record). At each worker count and network the table shows every
setting's time, and the ``auto`` settings' ratio to the best other setting::

    bunsan bench compare --model mnist1d_cnn --dataset mnist1d -np 2,4 --epochs 20 --batch 128 \\
        --lr 0.5 --momentum 0 --algorithms data_parallel data_parallel:compression=fp16 \\
        data_parallel:bits=2 "block_momentum:block_size=1024,block_learning_rate=0.5" auto:risk=high \\
        --out runs/tta
    bunsan bench tta runs/tta/compare.json

A campaign of several records (``docs/experiments/tta_campaign.sh``) is summarized by
``tools/tta_campaign.py``, campaign tooling outside the installed package.

This module imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bunsan._table import format_table

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "add_arguments",
    "add_target_arguments",
    "epochs_to_error",
    "run",
    "time_to_error",
    "tta_rows",
    "without_target",
]

PROG = "bunsan bench tta"
DESCRIPTION = """\
Read a `bunsan bench compare` JSON record and print each setting's
time-to-accuracy (training seconds until the test error is within --points of
the reference setting's final error), and for `auto` settings the ratio to the
best other setting at the same worker count. Needs the per-epoch curves (run
compare without --no-curves). A campaign of several records is summarized by
tools/tta_campaign.py in a checkout of the repository."""
EPILOG = """\
examples:
  bunsan bench tta runs/tta/compare.json
  bunsan bench tta runs/tta/compare.json --reference data_parallel --points 1"""


def time_to_error(curve: Sequence[float], epoch_end_s: Sequence[float], target: float) -> float | None:
    """Seconds at the end of the first epoch whose error is ``<= target``; ``None`` if none reaches it."""
    epoch = epochs_to_error(curve, target)
    return None if epoch is None else epoch_end_s[epoch - 1]


def epochs_to_error(curve: Sequence[float], target: float) -> int | None:
    """The first epoch (counted from 1) whose error is ``<= target``; ``None`` if none reaches it."""
    return next((i + 1 for i, error in enumerate(curve) if error <= target), None)


def tta_rows(configs: Sequence[dict[str, Any]], reference: str, points: float) -> list[dict[str, Any]]:
    """One row per successful config: ``label, workers, target, tta_s, epoch`` (the epoch it is reached in),
    ``run_s`` (the whole run's training time) and, for auto settings, ``vs_best``.

    A worker count whose reference run did not succeed has no target and no rows
    (:func:`without_target` names it): the others keep theirs.

    Raises:
        ValueError: no worker count with a successful reference run, or configs without curves.
    """
    ok = [c for c in configs if c.get("status") == "ok"]
    counts = sorted({c["workers"] for c in ok})
    usable = [w for w in counts if any(c["label"] == reference and c["workers"] == w for c in ok)]
    if counts and not usable:
        raise ValueError(f"no successful {reference!r} run at any worker count to take the target from")
    rows = []
    for workers in usable:
        here = [c for c in ok if c["workers"] == workers]
        base = next(c for c in here if c["label"] == reference)
        if any(not c.get("test_error_curve") or not c.get("epoch_end_s") for c in here):
            raise ValueError("the record has no per-epoch curves; run bunsan bench compare without --no-curves")
        target = base["test_error"] + points / 100
        times = {c["label"]: time_to_error(c["test_error_curve"], c["epoch_end_s"], target) for c in here}
        others = [t for label, t in times.items() if not label.startswith("auto") and t is not None]
        best = min(others) if others else None
        for c in here:
            t = times[c["label"]]
            vs_best = t / best if c["label"].startswith("auto") and t is not None and best else None
            rows.append(
                {
                    "label": c["label"],
                    "workers": workers,
                    "target": target,
                    "tta_s": t,
                    "epoch": epochs_to_error(c["test_error_curve"], target),
                    "run_s": c["epoch_end_s"][-1],
                    "vs_best": vs_best,
                }
            )
    return rows


def without_target(configs: Sequence[dict[str, Any]], reference: str) -> list[str]:
    """Worker counts that have runs but no target, each as a sentence: the reference setting's run
    there failed or timed out (e.g. exact SGD of the 10.5M MLP at 4 workers on 100 Mbit/s links
    ran past bench compare's 30-minute job timeout), or is missing."""
    notes = []
    for workers in sorted({c["workers"] for c in configs}):
        base = next((c for c in configs if c["label"] == reference and c["workers"] == workers), None)
        if base is not None and base.get("status") == "ok":
            continue
        why = f"its {reference} run ended {base.get('status')}" if base else f"it has no {reference} run"
        notes.append(f"no target at {workers} workers: {why}, so its settings are not compared")
    return notes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("record", help="the JSON record of bunsan bench compare")
    add_target_arguments(parser)


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """``--reference`` and ``--points``: the target every setting's time to accuracy is measured to."""
    parser.add_argument(
        "--reference",
        default="data_parallel",
        help="the setting whose final error sets the target; default %(default)s",
    )
    parser.add_argument(
        "--points",
        type=float,
        default=1.0,
        help="percentage points above the reference's final error; default %(default)s",
    )


def run(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """Print the table; 0 on success, 2 on bad input."""
    record = args.record
    try:
        document = json.loads(Path(record).read_text())
        rows = tta_rows(document["configs"], args.reference, args.points)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as err:
        print(f"{PROG}: error: cannot use {record!r}: {err}", file=sys.stderr)
        return 2
    header = ("workers", "algorithm", "target error (%)", "time to target (s)", "auto vs best")
    cells = [
        [
            str(r["workers"]),
            r["label"],
            f"{100 * r['target']:.2f}",
            "-" if r["tta_s"] is None else f"{r['tta_s']:.2f}",
            "" if r["vs_best"] is None else f"{r['vs_best']:.2f}",
        ]
        for r in rows
    ]
    say(format_table(header, cells, right={"workers", "target error (%)", "time to target (s)", "auto vs best"}))
    for note in without_target(document["configs"], args.reference):
        say(note)
    return 0
