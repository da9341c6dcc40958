"""Every decision of Auto is a record: a JSON-able dict of the measured inputs, each candidate's
prediction, the choice and the reason, kept in :attr:`Auto.decision` and in ``state_dict()`` (so in
every checkpoint), and appended to :attr:`Auto.records` with each later transition (the block check,
a trial's verdict). ``bunsan plan --job`` reads it back from a checkpoint or from a JSON-lines file of
:func:`record_line` (the last decision in it) and predicts the same job at other worker counts and
networks. Rank 0 prints :func:`format_decision`, one short table whose first line reads on its own.

As Horovod's autotuner logs every trial it timed to a file, the record holds what Auto measured and
predicted, not what some run once showed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.auto.policy import AutoPolicy

__all__ = ["format_decision", "inconclusive_record", "measured_record", "record_line", "trial_record"]


def record_line(record: dict[str, Any]) -> str:
    """One JSON line of ``record`` (a decision or a later transition), keys sorted."""
    return json.dumps(record, sort_keys=True, default=float)


def inconclusive_record(step: int, workers: int, step_s: float) -> dict[str, Any]:
    """The decision where there is no network to predict on: exact kept."""
    return {
        "algorithm": "data_parallel",
        "options": {},
        "label": "exact",
        "step": step,
        "workers": workers,
        "why": (
            "the network measurement was inconclusive (times did not grow with size): exact kept"
            if workers > 1
            else "one worker: nothing to exchange, exact kept"
        ),
        "measured": {"exact_step_s": step_s},
        "predictions": [],
    }


def measured_record(
    *,
    step_s: float,
    how: dict[str, Any],
    compute_s: float,
    local_s: float | None,
    profile: cm.Profile,
    network: cm.Network,
    codec: dict[str, float],
    codecs: Sequence[Sequence[int | float]],
    codec_deferred: bool,
    overlap: bool,
    candidates: Sequence[cm.Candidate],
) -> dict[str, Any]:
    """The record's ``measured`` inputs: the exact step (and ``how`` it was timed), the profile, the
    network, the codec, the overlap rule and each candidate's fixed cost; with the rest of the profile,
    so that ``bunsan plan --job`` predicts other worker counts alike."""
    return {
        "exact_step_s": step_s,
        **how,
        "compute_s": compute_s,
        **({"local_step_s": local_s} if local_s is not None else {}),
        "straggler_s": profile.straggler_s,
        "latency_s": network.latency_s,
        "bandwidth": network.bandwidth,
        "gather_bandwidth": network.gather_bandwidth,
        "half_bandwidth": network.half_bandwidth,
        **codec,
        "codecs": [list(c) for c in codecs],
        **({"codec_measured": False} if codec_deferred else {}),
        "overlap": overlap,
        "fixed_s": {c.label: profile.fixed(c.label) for c in candidates},
        "params": profile.params,
        "batch": profile.batch,
        "bytes_per_element": profile.bytes_per_element,
        "tensors": profile.tensors,
        "chunks": profile.chunks,
        "codec_per_bucket": profile.codec_per_bucket,
    }


def trial_record(
    decision: dict[str, Any],
    candidate: cm.Candidate,
    predictions: Sequence[cm.Prediction],
    index: int,
    policy: AutoPolicy,
) -> None:
    """Turn a decision that keeps exact into a trial of ``candidate`` in blocks of ``policy.trial_steps``
    steps; the candidate and its predicted gain go into ``decision["trial"]`` (in place)."""
    steps = policy.trial_steps
    size = steps * int(decision["measured"]["batch"])
    gain = predictions[0].step_s / predictions[index].step_s - 1
    decision["trial"] = {
        "of": candidate.label,
        "predicted_gain": gain,
        "steps": steps,
        "exact_step_s": decision["measured"]["exact_step_s"],
    }
    decision["why"] = (
        f"{decision['why']}; a trial: {candidate.label} predicted {100 * gain:.1f}% faster, within "
        f"{100 * policy.trial_window:.0f} points under min_gain: blocks of {steps} steps, whose timed local "
        "steps and round keep it or return to exact"
    )
    decision.update(
        algorithm=candidate.algorithm,
        options={**candidate.options, "block_size": size},
        label=f"{candidate.algorithm}:{size}",
    )


def _headline(decision: dict[str, Any]) -> str:
    m = decision["measured"]
    if "first_step_before_exchange_s" in m:
        timed = (
            f"first step before its exchange {m['first_step_before_exchange_s'] * 1e3:.2f} ms (from distribute() on), "
            f"as an exact step {m['exact_step_s'] * 1e3:.2f} ms"
        )
    elif "second_step_before_exchange_s" in m:
        timed = (
            f"second step before its exchange {m['second_step_before_exchange_s'] * 1e3:.2f} ms, taken at "
            f"{m['bound_margin']:g} times as a bound, as an exact step {m['exact_step_s'] * 1e3:.2f} ms"
        )
    else:
        which = "first step (from distribute() on)" if m.get("first_step") else "exact step"
        timed = f"{which} {m['exact_step_s'] * 1e3:.2f} ms"
    waiting = m.get("straggler_s", 0.0) > 0
    return (
        f"[bunsan] Auto at step {decision['step']}, {decision['workers']} workers: {timed}"
        + f" (compute {m['compute_s'] * 1e3:.2f} ms"
        + (f", waiting for the slowest rank {m['straggler_s'] * 1e3:.2f} ms" if waiting else "")
        + "), network "
        f"{m['bandwidth'] * 8 / 1e9:.3f} Gbit/s, latency {m['latency_s'] * 1e6:.1f} us; measured and "
        f"decided in {m['decide_s']:.2f} s"
        + (
            f" (network {m['network_s']:.2f} s, fixed-cost probes {m['fixed_probe_s']:.2f} s)"
            if "network_s" in m
            else ""
        )
    )


def format_decision(decision: dict[str, Any]) -> str:
    """Rank 0's short table: candidates, predicted ms per step, the choice and why."""
    lines = [_headline(decision)]
    for p in decision["predictions"]:
        mark = "  <- chosen" if p["label"] == decision["label"] else ""
        lines.append(f"[bunsan]   {p['label']:<28} {p['step_s'] * 1e3:9.2f} ms/step predicted{mark}")
    lines.append(f"[bunsan]   chosen: {decision['label']}: {decision['why']}")
    m = decision["measured"]
    if "probes" in m:  # which probes ran and why: the record then says what Auto's time went on
        mode = m["probes"][0]
        older = {"all": "every family", "blocks": "exact and block momentum only"}  # records before 'exact+block'
        which = older.get(mode) or ("none" if mode == "none" else ", ".join(mode.split("+")))
        lines.append(f"[bunsan]   fixed-cost probes: {which}: {m['probes'][1]}")
    return "\n".join(lines)
