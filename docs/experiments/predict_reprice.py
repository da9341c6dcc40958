"""Re-price the rows of a ``bunsan bench predict`` run offline, from the profiles it recorded.

A run takes 47 minutes on the 2-core machine of the docs; a change to the cost model can be judged
first on a recorded run's own measurements: every job writes each model's whole profile and its
network beside its rows (``profiles`` in ``predict.json``, since the bench recorded them), and this
script rebuilds them, prices every row again with :func:`bunsan.algorithms.cost_model.predict` and
counts the rows within 20%: as recorded, as re-priced (the same unless the model changed since the
run), and under each variant named with ``--variant``::

    python docs/experiments/predict_reprice.py docs/experiments/predict/predict-21.json --variant synced-exact

Variants (what they change, for the rows they touch):

* ``synced``: every row priced with the straggler of compute steps started together
  (``synced_straggler_s``) instead of run free (``straggler_s``).
* ``synced-exact``: that wait for exact's rows only (one collective after the compute), the
  free-running one elsewhere.
* ``core-copy``: async's passes at the copy of one rank per core (``Profile.core_copy_s_per_element``,
  timed by the bench since 50c38a9); for a record before it, the same run's copy of that model in
  its job of one rank a core on the same link (every rank copying at once there: one per core).
* ``pooled``: every row priced once with its job's profile pooled over the rounds (the bench's
  prediction before each round was priced with its own compute slice, fixed costs and codec:
  ``bunsan.bench.predict.round_profiles``; a record without the rounds is priced so anyway).

It also prints, for async rows, each rank's measured median step against the model's rank 0 and
remote worker (``rank_steps_s``; the model's remote step is ``predicted_compute_s +
communication_s``, its rank 0's from the job step, each with its side's fixed cost; both from the
pooled profile).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.network_model import Network
from bunsan.bench.predict import paired_prediction, round_profiles

VARIANTS = ("synced", "synced-exact", "pooled", "core-copy")


def profile_of(record: dict[str, Any]) -> cm.Profile:
    """A :class:`~bunsan.algorithms.cost_model.Profile` from its recorded ``asdict`` (JSON lists back to tuples)."""
    fields = {k: v for k, v in record.items() if k in cm.Profile.__dataclass_fields__}
    fields["codecs"] = tuple(tuple(entry) for entry in fields.get("codecs", ()))
    fields["fixed_s"] = tuple((str(label), float(s)) for label, s in fields.get("fixed_s", ()))
    return cm.Profile(**fields)


def reprice(
    row: dict[str, Any],
    job: dict[str, Any],
    block_size: int,
    variant: str | None = None,
    core_copy: float | None = None,
) -> float:
    """The row's step priced again from its job's recorded profile, under ``variant`` (None: the model as
    is); ``core_copy`` (variant ``core-copy``): the ``core_copy_s_per_element`` to price it with."""
    record = job["models"][row["model"]]
    profile = profile_of(record)
    if variant == "core-copy" and core_copy is not None and profile.ranks_per_core > 1:
        profile = replace(profile, core_copy_s_per_element=core_copy)
    network = Network(**job["network"])
    candidate = next(c for c in cm.default_candidates(block_size) if c.label == row["label"])
    if variant == "synced" or (variant == "synced-exact" and row["label"] == "exact"):
        profile = replace(profile, straggler_s=record["synced_straggler_s"])
    n = row["workers"]

    def step(p: cm.Profile) -> float:
        return cm.predict(p, network, candidate, n, overlap=row["overlap"], spare_core=row["spare_core"]).step_s

    if variant == "pooled" or "compute_rounds_s" not in row or "fixed_rounds" not in record:
        return step(profile)
    codec_rounds = [(c["codec"], c["codecs"]) for c in record["codec_rounds"]]
    rounds = round_profiles(profile, row["compute_rounds_s"], record["fixed_rounds"], codec_rounds)
    return paired_prediction(step, rounds)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", help="predict.json of a bunsan bench predict run")
    parser.add_argument("--variant", action="append", default=[], choices=VARIANTS)
    args = parser.parse_args(argv)
    try:
        data = json.loads(Path(args.json).read_text())
        rows = data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"predict_reprice: {args.json} is not a bunsan bench predict record ({err})", file=sys.stderr)
        return 2
    profiles = data.get("profiles")  # absent from a run before 9b4a67c: the recorded columns only
    block_size = int(data["arguments"]["block_size"])

    def slug(row: dict[str, Any]) -> str:
        network = row["network"]
        name = "loopback" if network == "loopback" else network.replace("=", "_").replace(",", "_")
        return f"{name}-np{row['workers']}"

    def within(priced: list[float]) -> int:
        return sum(abs(p / r["measured_s"] - 1) <= 0.20 for p, r in zip(priced, rows, strict=True))

    def core_copy(row: dict[str, Any]) -> float | None:
        # a run before core_copy_s_per_element: the same model's copy in the run's job of one rank a core
        job = profiles[slug(row)] if profiles is not None else None
        if job is None:
            return None
        timed = job["models"][row["model"]].get("core_copy_s_per_element", 0.0)
        if timed:
            return float(timed)
        for other in profiles.values():
            found = other["models"].get(row["model"])
            same_link = other["network"].get("burst_bytes") == job["network"].get("burst_bytes")
            if found and found.get("ranks_per_core", 1.0) <= 1.0 and same_link:
                return float(found["copy_s_per_element"])
        return None

    def priced_as(row: dict[str, Any], variant: str | None) -> float:
        if profiles is not None:
            return reprice(row, profiles[slug(row)], block_size, variant, core_copy(row))
        if variant is None:
            return float(row["predicted_s"])
        # without profiles, a wait variant from the row priced with the synced wait as the bench recorded it
        synced = variant == "synced" or (variant == "synced-exact" and row["label"] == "exact")
        return float(row["predicted_synced_straggler_s" if synced else "predicted_s"])

    recorded = [r["predicted_s"] for r in rows]
    print(f"as recorded: {within(recorded)} of {len(rows)} within 20%")
    if profiles is not None:
        again = [priced_as(r, None) for r in rows]
        moved = sum(abs(a / b - 1) > 1e-9 for a, b in zip(again, recorded, strict=True))
        print(f"re-priced with the model at this checkout: {within(again)} ({moved} rows priced differently)")
    else:
        print("no profiles recorded (a run before 9b4a67c): variants from the recorded columns")
    for variant in args.variant:
        priced = [priced_as(r, variant) for r in rows]
        print(f"variant {variant}: {within(priced)} of {len(rows)}")
        for row, p in zip(rows, priced, strict=True):
            before, after = row["predicted_s"] / row["measured_s"] - 1, p / row["measured_s"] - 1
            if (abs(before) <= 0.2) != (abs(after) <= 0.2):
                print(
                    f"  {row['network']:>12} -np {row['workers']} {row['model']:<11} {row['label']:<20} "
                    f"{100 * before:+4.0f}% -> {100 * after:+4.0f}%"
                )
    for row in rows:
        if row["label"] != "async" or "rank_steps_s" not in row:
            continue
        n = row["workers"]
        remote = row["predicted_compute_s"] + row["communication_s"]
        # each side holds its own fixed cost since 249ce39: the job's step is N / (1 / own + (N - 1) / remote)
        own = 1 / (n / row.get("predicted_pooled_s", row["predicted_s"]) - (n - 1) / remote)
        ranks = " ".join(f"{1e3 * s:.1f}" for s in row["rank_steps_s"])
        print(
            f"async {row['network']:>12} -np {n} {row['model']:<11} ranks {ranks} ms; "
            f"model rank 0 {1e3 * own:.1f}, remote {1e3 * remote:.1f} ms ({100 * row['error']:+.0f}%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
