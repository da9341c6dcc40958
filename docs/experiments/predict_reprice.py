"""Re-price the rows of a ``tools/predict.py`` run offline, from the profiles it recorded.

A run takes about 80 minutes on the 2-core machine of the docs; a change to the cost model can be judged
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
* ``filled``: each round's fixed costs as timed after a step of the model's compute
  (``fixed_filled_rounds``: the bench's ``predicted_filled_s``, since it timed them, for the models
  whose step is short, ``FILLER_CAP_S`` of ``tools/predict.py``); a model without them is priced as is.
* ``own-compute``: each round priced with the row's own slice of the compute alone, timed just
  before its steps in that round (``compute_rounds_s``; the bench's price up to predict-34), instead
  of the job's compute (every slice of every round).
* ``pooled``: every row priced once with its job's profile pooled over the rounds (the bench's
  prediction before each round was priced with its own compute slice, fixed costs and codec:
  ``round_profiles`` of ``tools/predict.py``; a record without the rounds is priced so anyway).

It also prints, for async rows, each rank's measured median step against the model's rank 0 and
remote worker (``rank_steps_s``; the model's remote step is ``predicted_compute_s +
communication_s``, its rank 0's from the job step, each with its side's fixed cost; both from the
pooled profile).

Given several records (runs of the same rows), it also parts each row's error into the
model's bias and the run's noise (:func:`noise_and_bias`): the log of predicted over measured,
per row and run, priced again under the model at the checkout (and each variant; a record
before ``core_copy_s_per_element`` takes the stand-in of ``core-copy`` throughout, as the model
at the checkout needs the figure); the pooled spread of a row's runs about its own mean is the
noise, the rows' means the bias. From both it gives the rows the model is expected to leave
outside 20% in one more run, and with no bias at all (every row's mean on the measurement: the
floor the noise alone sets), and the rows most likely outside::

    python docs/experiments/predict_reprice.py docs/experiments/predict/predict-2[3-6]*.json --variant synced-exact

A change to the model is better judged by its expected misses than by one run's count, which
the noise moves by several rows. Rows are set against the mean of their rounds on both sides,
as the bench does since predict-28 (``paired_prediction`` and
``measured_step`` of ``tools/predict.py``; a record before it has each round's job step in
``rounds_s``); ``--medians`` sets each side's median over the rounds instead, the bench's
measure up to predict-27. Over several records it also prints how a round's error moves
from round to round within a run and how the mean of a run's rounds moves from run to run
(:func:`round_noise`): where the second is the first over the square root of the rounds, the
rounds are independent draws of one noise.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bunsan.algorithms import async_model as am
from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.network_model import Network

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # the harness that wrote the records
from predict import measured_step, paired_prediction, round_profiles  # noqa: E402

VARIANTS = ("synced", "synced-exact", "pooled", "core-copy", "filled", "own-compute")
ROW_PRIOR_DOF = 4  # degrees of freedom of the pooled variance in each row's own (noise_and_bias)


def profile_of(record: dict[str, Any]) -> cm.Profile:
    """A :class:`~bunsan.algorithms.cost_model.Profile` from its recorded ``asdict`` (JSON lists back to tuples)."""
    fields = {k: v for k, v in record.items() if k in cm.Profile.__dataclass_fields__}
    fields["codecs"] = tuple(tuple(entry) for entry in fields.get("codecs", ()))
    fields["fixed_s"] = tuple((str(label), float(s)) for label, s in fields.get("fixed_s", ()))
    return cm.Profile(**fields)


def network_of(fields: dict[str, Any]) -> Network:
    """A :class:`~bunsan.algorithms.network_model.Network` from its recorded fields; a field the model at this
    checkout does not take (such as predict-29-np4's ``alltoall_bandwidth`` of the reverted 921a166) is
    left out: the row is priced as this checkout prices it."""
    return Network(**{k: v for k, v in fields.items() if k in Network.__dataclass_fields__})


def reprice(
    row: dict[str, Any],
    job: dict[str, Any],
    block_size: int,
    variant: str | None = None,
    core_copy: float | None = None,
    *,
    fill_core_copy: float | None = None,
    medians: bool = False,
    own_compute: bool = False,
) -> float:
    """The row's step priced again from its job's recorded profile, under ``variant`` (None: the model as
    is); ``core_copy`` (variant ``core-copy``): the ``core_copy_s_per_element`` to price it with;
    ``fill_core_copy`` (any variant): the one to price with where the record has none timed. The mean of
    the rounds' prices (``medians``: their median). ``own_compute`` (or variant ``own-compute``): each round
    at the row's own slice of the compute, as the bench priced up to predict-34."""
    record = job["models"][row["model"]]
    profile = profile_of(record)
    if variant == "core-copy" and core_copy is not None and profile.ranks_per_core > 1:
        profile = replace(profile, core_copy_s_per_element=core_copy)
    elif fill_core_copy is not None and profile.ranks_per_core > 1 and not profile.core_copy_s_per_element:
        profile = replace(profile, core_copy_s_per_element=fill_core_copy)
    network = network_of(record.get("network", job["network"]))  # the model's median probe where recorded
    candidate = next(c for c in am.default_candidates(block_size) if c.label == row["label"])
    if variant == "synced" or (variant == "synced-exact" and row["label"] == "exact"):
        profile = replace(profile, straggler_s=record["synced_straggler_s"])
    n = row["workers"]

    def step(round_: tuple[cm.Profile, Network]) -> float:
        p, net = round_
        return am.predict(p, net, candidate, n, overlap=row["overlap"], spare_core=row["spare_core"]).step_s

    if variant == "pooled" or "compute_rounds_s" not in row or "fixed_rounds" not in record:
        return step((profile, network))
    codec_rounds = [(c["codec"], c["codecs"]) for c in record["codec_rounds"]]
    fixed_rounds = record["fixed_filled_rounds"] if variant == "filled" and "fixed_filled_rounds" in record else None
    # each round at the job's compute (the bench since predict-34), or at the row's own slice of it
    own = own_compute or variant == "own-compute"
    compute_rounds = row["compute_rounds_s"] if own else [profile.compute_s] * len(codec_rounds)
    rounds = round_profiles(profile, compute_rounds, fixed_rounds or record["fixed_rounds"], codec_rounds)
    # each round on its own probe of the link where recorded (since the probe in every round), else the job's
    networks = [network_of(net) for net in record.get("network_rounds", [])] or [network] * len(rounds)
    mean, each = paired_prediction(step, list(zip(rounds, networks, strict=True)))
    return statistics.median(each) if medians else mean


def measured_of(row: dict[str, Any], *, medians: bool = False) -> float:
    """The row's measured step: the mean of its rounds' job steps (``medians``: the ranks' medians over the
    rounds, the bench's ``measured_s`` up to predict-27, ``measured_median_s`` since)."""
    if medians:
        return float(row.get("measured_median_s", row["measured_s"]))
    return measured_step(row["rounds_s"]) if row.get("rounds_s") else float(row["measured_s"])


def recorded_price(row: dict[str, Any], *, medians: bool = False) -> float:
    """The row's recorded prediction by the measure asked: since predict-28 (the rows carry
    ``measured_median_s``) ``predicted_s`` is the rounds' mean and ``predicted_median_s`` their median;
    before, ``predicted_s`` was the median and the mean is that of ``predicted_rounds_s`` where recorded."""
    if "measured_median_s" in row:
        return float(row["predicted_median_s"] if medians else row["predicted_s"])
    if medians or not row.get("predicted_rounds_s"):
        return float(row["predicted_s"])
    return statistics.fmean(float(p) for p in row["predicted_rounds_s"])


def outside(mean: float, sd: float, bar: float = 0.20) -> float:
    """The chance that a normal of ``mean`` and ``sd`` (a log error) falls outside ``(log(1 - bar), log(1 + bar))``:
    a row predicted more than ``bar`` away from its measurement. With ``sd`` 0, 0 or 1."""
    low, high = math.log(1 - bar), math.log(1 + bar)
    if sd == 0:
        return 0.0 if low < mean < high else 1.0
    normal = statistics.NormalDist(mean, sd)
    return 1.0 - (normal.cdf(high) - normal.cdf(low))


def round_noise(records: Sequence[dict[str, Any]], bar: float = 0.20) -> dict[str, float]:
    """How the recorded rounds' errors move: ``round_sd``, the spread of a round's error (the log of its
    recorded price over its job step) about its run's mean, pooled over the rows and runs (``round_dof``);
    ``run_sd``, the spread of those means about the row's mean over the runs (``run_dof``); ``rounds``,
    the median rounds per row; ``measured_round_sd``, the spread of a round's measured job step alone (its
    log about its run's mean), which no model of the row's expected step can take away. Rows with one
    round, or fewer than two runs, add nothing. Independent rounds give ``run_sd`` = ``round_sd /
    sqrt(rounds)``.

    ``oracle_misses`` and ``oracle_p_none``: the rows outside ``bar`` in one more run, and the chance of
    none, for a predictor that knew each row's expected step in that run exactly: only the measured
    mean of the row's rounds moves, by its own rounds' spread (its squares with ``ROW_PRIOR_DOF``
    degrees of freedom of the pooled measured spread) over the square root of its rounds a run,
    rounds taken as independent. A model that prices the row's expected step does no better; one
    that follows the machine's state round by round (the bench pairs each round's price with that
    round's own fixed costs, codec and probe) could, by as much as its prices move with the rounds'
    steps: on the records so far a round's error moves more than its measured step alone."""
    means: dict[tuple[str, int, str, str], list[float]] = {}
    within, within_dof, counts = 0.0, 0, []
    measured_within = 0.0
    own: dict[tuple[str, int, str, str], list[float]] = {}  # per row: measured squares, their dof, its runs
    for data in records:
        for row in data["rows"]:
            priced, measured = row.get("predicted_rounds_s"), row.get("rounds_s")
            if not priced or not measured or len(priced) != len(measured) or len(priced) < 2:
                continue
            errors = [math.log(p / m) for p, m in zip(priced, measured, strict=True)]
            mean = statistics.fmean(errors)
            within += sum((e - mean) ** 2 for e in errors)
            steps = [math.log(m) for m in measured]
            squares = sum((t - statistics.fmean(steps)) ** 2 for t in steps)
            measured_within += squares
            found = own.setdefault(row_key(row), [0.0, 0.0, 0.0])
            found[0] += squares
            found[1] += len(steps) - 1
            found[2] += 1
            within_dof += len(errors) - 1
            counts.append(len(errors))
            means.setdefault(row_key(row), []).append(mean)
    between = sum((m - statistics.fmean(ms)) ** 2 for ms in means.values() for m in ms)
    between_dof = sum(len(ms) - 1 for ms in means.values())
    if within_dof == 0 or between_dof == 0:
        raise ValueError("need rows of two rounds or more in two runs or more")
    pooled = measured_within / within_dof
    oracle = []  # per row: the chance that its measured mean alone falls ``bar`` from the row's expected step
    for squares, dof, runs in own.values():
        variance = (squares + ROW_PRIOR_DOF * pooled) / (dof + ROW_PRIOR_DOF)
        per_run = (dof + runs) / runs  # rounds a run: each run holds its rounds less one degrees of freedom
        oracle.append(outside(0.0, math.sqrt(variance / per_run), bar))
    return {
        "round_sd": math.sqrt(within / within_dof),
        "measured_round_sd": math.sqrt(measured_within / within_dof),
        "round_dof": within_dof,
        "run_sd": math.sqrt(between / between_dof),
        "run_dof": between_dof,
        "rounds": statistics.median(counts),
        "oracle_misses": sum(oracle),
        "oracle_p_none": math.prod(1 - p for p in oracle),
    }


def noise_and_bias(errors: Mapping[Any, Sequence[float]], bar: float = 0.20) -> dict[str, Any]:
    """The model's bias and the runs' noise, from ``errors[row]``: ``log(predicted / measured)`` in each run.

    ``noise_sd``: the spread of a row's runs about the row's own mean, pooled over the rows of
    two runs or more (its degrees of freedom ``dof``, runs less one per row); ``bias[row]``: the
    row's mean; ``rms_bias`` over the rows. ``p_outside[row]``: the chance that one more run puts
    the row outside ``bar`` (predicted within ``(1 - bar, 1 + bar)`` times the measured), a normal
    of the row's mean and the pooled spread; ``expected_misses`` their sum, ``p_none`` the chance
    that no row misses (rows apart); ``floor_misses`` and ``p_none_floor`` the same with every
    row's mean at 0 (a model without bias, the runs' noise alone). A mean over ``k`` runs holds
    ``sd / sqrt(k)`` of the noise too, so on few runs the bias and the expected misses lean high.

    The rows' noise is not one: the small CNNs' short steps move more from run to run than the
    larger models' (13 runs: 3.8% to 12.8% by row). ``row_sd[row]`` is the row's own spread, its runs'
    squares about its mean with ``ROW_PRIOR_DOF`` degrees of freedom of the pooled variance added
    (so that a row of few runs is not taken as certain); ``row_expected_misses``, ``row_p_none``,
    ``row_floor_misses`` and ``row_p_none_floor`` are the four figures above with each row's own
    spread instead of the pooled one; ``rows_within``, the rows whose mean is within ``bar``.
    """
    if not errors or any(len(runs) == 0 for runs in errors.values()):
        raise ValueError("need at least one run of every row")
    dof = sum(len(runs) - 1 for runs in errors.values())
    if dof <= 0:
        raise ValueError("need two runs of at least one row to part the noise from the bias")
    bias = {row: statistics.fmean(runs) for row, runs in errors.items()}
    squares = sum((e - bias[row]) ** 2 for row, runs in errors.items() for e in runs)
    sd = math.sqrt(squares / dof)
    p_outside = {row: outside(mean, sd, bar) for row, mean in bias.items()}
    expected = sum(p_outside.values())
    floor = len(errors) * outside(0.0, sd, bar)
    # each row's own spread, its runs' variance taken with ROW_PRIOR_DOF degrees of freedom of the pooled one
    own_sd = {
        row: math.sqrt(
            (sum((e - bias[row]) ** 2 for e in runs) + ROW_PRIOR_DOF * sd * sd) / (len(runs) - 1 + ROW_PRIOR_DOF)
        )
        for row, runs in errors.items()
    }
    own_outside = {row: outside(mean, own_sd[row], bar) for row, mean in bias.items()}
    own_floor = {row: outside(0.0, own_sd[row], bar) for row in errors}
    return {
        "rows": len(errors),
        "dof": dof,
        "noise_sd": sd,
        "bias": bias,
        "rms_bias": math.sqrt(statistics.fmean(m * m for m in bias.values())),
        "p_outside": p_outside,
        "expected_misses": expected,
        "p_none": math.prod(1 - p for p in p_outside.values()),
        "floor_misses": floor,
        "p_none_floor": (1 - outside(0.0, sd, bar)) ** len(errors),
        "rows_within": sum(outside(mean, 0.0, bar) == 0.0 for mean in bias.values()),
        "row_sd": own_sd,
        "row_expected_misses": sum(own_outside.values()),
        "row_p_none": math.prod(1 - p for p in own_outside.values()),
        "row_floor_misses": sum(own_floor.values()),
        "row_p_none_floor": math.prod(1 - p for p in own_floor.values()),
    }


def core_copy_stand_in(profiles: Mapping[str, Any], slug: str, model: str) -> float | None:
    """The ``core_copy_s_per_element`` to price a row of ``profiles[slug]`` with: the job's own (timed since
    50c38a9), else the same model's copy in the run's job of one rank a core on the same link."""
    job = profiles[slug]
    timed = job["models"][model].get("core_copy_s_per_element", 0.0)
    if timed:
        return float(timed)
    for other in profiles.values():
        found = other["models"].get(model)
        same_link = other["network"].get("burst_bytes") == job["network"].get("burst_bytes")
        if found and found.get("ranks_per_core", 1.0) <= 1.0 and same_link:
            return float(found["copy_s_per_element"])
    return None


def row_slug(row: dict[str, Any]) -> str:
    """The key of the row's job in a record's ``profiles``: ``loopback-np2``, ``rate_1gbit-np4``."""
    network = row["network"]
    name = "loopback" if network == "loopback" else network.replace("=", "_").replace(",", "_")
    return f"{name}-np{row['workers']}"


def row_key(row: dict[str, Any]) -> tuple[str, int, str, str]:
    return (row["network"], int(row["workers"]), row["model"], row["label"])


def runs_together(
    records: Sequence[dict[str, Any]], variants: Sequence[str | None], top: int, *, medians: bool = False
) -> None:
    """Print :func:`noise_and_bias` of ``records`` (each with ``profiles``) under the model and each variant
    (``medians``: each side's median over the rounds), and their :func:`round_noise`."""
    for variant in variants:
        errors: dict[tuple[str, int, str, str], list[float]] = {}
        for data in records:
            profiles, block_size = data["profiles"], int(data["arguments"]["block_size"])
            for row in data["rows"]:
                slug = row_slug(row)
                stand_in = core_copy_stand_in(profiles, slug, row["model"])
                priced = reprice(
                    row, profiles[slug], block_size, variant, stand_in, fill_core_copy=stand_in, medians=medians
                )
                errors.setdefault(row_key(row), []).append(math.log(priced / measured_of(row, medians=medians)))
        found = noise_and_bias(errors)
        name = "the model at this checkout" if variant is None else f"variant {variant}"
        if medians:
            name += ", each side's median over the rounds"
        print(
            f"{len(records)} runs together, {name}: noise {100 * found['noise_sd']:.1f}% (sd of a row's log "
            f"error about its mean, {found['dof']} degrees of freedom), bias {100 * found['rms_bias']:.1f}% "
            f"(rms of the rows' means); expected rows outside 20% in one more run "
            f"{found['expected_misses']:.2f} (none: {100 * found['p_none']:.1f}%); without bias "
            f"{found['floor_misses']:.2f} (none: {100 * found['p_none_floor']:.0f}%)"
        )
        print(
            f"  with each row's own noise ({min(found['row_sd'].values()) * 100:.1f}% to "
            f"{max(found['row_sd'].values()) * 100:.1f}%): expected rows outside 20% "
            f"{found['row_expected_misses']:.2f} (none: {100 * found['row_p_none']:.1f}%); without bias "
            f"{found['row_floor_misses']:.2f} (none: {100 * found['row_p_none_floor']:.0f}%)"
        )
        print(f"  rows whose mean over the runs is within 20%: {found['rows_within']} of {found['rows']}")
        ranked = sorted(found["p_outside"].items(), key=lambda item: -item[1])[:top]
        for key, p in ranked:
            runs = " ".join(f"{100 * math.expm1(e):+.0f}%" for e in errors[key])
            print(
                f"  {p:4.2f} outside, mean {100 * math.expm1(found['bias'][key]):+4.0f}%: "
                f"{key[0]:>12} -np {key[1]} {key[2]:<11} {key[3]:<20} runs {runs}"
            )
    try:
        moved = round_noise(records)
    except ValueError:
        return  # records of one round a row: nothing to say of the rounds
    print(
        f"rounds (as recorded): a round's error moves {100 * moved['round_sd']:.1f}% about its run's mean "
        f"({moved['round_dof']} degrees of freedom), the mean of a run's {moved['rounds']:g} rounds "
        f"{100 * moved['run_sd']:.1f}% from run to run ({moved['run_dof']}); independent rounds: "
        f"{100 * moved['round_sd'] / math.sqrt(moved['rounds']):.1f}%; a round's measured step alone moves "
        f"{100 * moved['measured_round_sd']:.1f}% about its run's mean, so that a predictor of each row's "
        f"expected step without error would leave {moved['oracle_misses']:.2f} rows outside 20% in a run "
        f"(none: {100 * moved['oracle_p_none']:.0f}%)"
    )


def one_run(data: dict[str, Any], variants: Sequence[str], *, medians: bool = False) -> None:
    """Print one record's counts: as recorded, re-priced, under each variant (against the rounds' mean step;
    ``medians``: each side's median); and its async rows' ranks."""
    rows = data["rows"]
    profiles = data.get("profiles")  # absent from a run before 9b4a67c: the recorded columns only
    block_size = int(data["arguments"]["block_size"])

    def within(priced: list[float], measured: Sequence[float] | None = None) -> int:
        if measured is None:
            measured = [measured_of(r, medians=medians) for r in rows]
        return sum(abs(p / m - 1) <= 0.20 for p, m in zip(priced, measured, strict=True))

    def core_copy(row: dict[str, Any]) -> float | None:
        return core_copy_stand_in(profiles, row_slug(row), row["model"]) if profiles is not None else None

    def priced_as(row: dict[str, Any], variant: str | None) -> float:
        if profiles is not None:
            return reprice(row, profiles[row_slug(row)], block_size, variant, core_copy(row), medians=medians)
        if variant is None:
            return float(row["predicted_s"])
        # without profiles, a wait variant from the row priced with the synced wait as the bench recorded it
        synced = variant == "synced" or (variant == "synced-exact" and row["label"] == "exact")
        return float(row["predicted_synced_straggler_s" if synced else "predicted_s"])

    recorded = [r["predicted_s"] for r in rows]
    print(f"as recorded: {within(recorded, [r['measured_s'] for r in rows])} of {len(rows)} within 20%")
    if profiles is not None:
        again = [priced_as(r, None) for r in rows]
        # against the record's own price by the same measure, so that only a change of the model counts
        same_measure = [recorded_price(r, medians=medians) for r in rows]
        moved = sum(abs(a / b - 1) > 1e-9 for a, b in zip(again, same_measure, strict=True))
        measure = "each side's median over the rounds" if medians else "the rounds' mean"
        print(
            f"re-priced with the model at this checkout, against {measure}: {within(again)} "
            f"({moved} rows priced differently)"
        )
    else:
        print("no profiles recorded (a run before 9b4a67c): variants from the recorded columns")
    for variant in variants:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="+", help="predict.json of a tools/predict.py run (several: runs together)")
    parser.add_argument("--variant", action="append", default=[], choices=VARIANTS)
    parser.add_argument(
        "--medians", action="store_true", help="each side's median over the rounds (the bench's measure to predict-27)"
    )
    parser.add_argument("--top", type=int, default=10, help="rows most likely outside 20%% to list (several runs)")
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error("--top must be 0 or more")
    records = []
    for path in args.json:
        try:
            data = json.loads(Path(path).read_text())
            if (
                not isinstance(data, dict)
                or not isinstance(data.get("rows"), list)
                or "block_size" not in data["arguments"]
            ):
                raise KeyError("rows or arguments.block_size")
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"predict_reprice: {path} is not a tools/predict.py record ({err})", file=sys.stderr)
            return 2
        records.append(data)
    for path, data in zip(args.json, records, strict=True):
        if len(records) > 1:
            print(f"== {path}")
        one_run(data, args.variant, medians=args.medians)
    if len(records) > 1:
        without = [path for path, data in zip(args.json, records, strict=True) if data.get("profiles") is None]
        if without:
            print(f"predict_reprice: {', '.join(without)} holds no profiles (a run before 9b4a67c)", file=sys.stderr)
            return 2
        try:
            runs_together(records, [None, *args.variant], args.top, medians=args.medians)
        except ValueError as err:  # no row in two of the records: nothing to part the noise from
            print(f"predict_reprice: these records cannot be taken together ({err})", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
