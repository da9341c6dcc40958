"""What a decision made without some measurement can already tell: the first-step bound and the probes worth running.

Pure functions, as in :mod:`bunsan.algorithms.auto.decision`. Two rules (docs/explanation/auto.md,
"The first step decides where it settles the choice" and "The probes"):

* A fixed-cost probe runs only where its result can change the decision predicted without it.
  Without the probes every candidate is charged exact's fixed cost; with them each its own. A block
  algorithm pays its fixed cost once a block, so the probes can only favour it; a quantized width's
  striped exchange makes two collectives per bucket where exact makes one, so its probe can only slow
  it; fp16's may come out a little under exact's, hence a margin of ``min_gain`` for it.
* The first step's time (from ``distribute()`` on) is an upper bound of the compute per step. Only
  one choice holds at every compute below a bound: a block algorithm that beats exact and fp16 by
  ``min_gain`` without the probes. As the compute shrinks its block can only lengthen, every per-step
  candidate's exposed exchange can only grow, and exact's lead over the block only grows against a
  shrinking step. ``tests/unit/test_auto.py`` checks the claim on the cost model over a grid.
"""

from __future__ import annotations

from collections.abc import Sequence

from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.auto.decision import choose, is_block, probe_family
from bunsan.algorithms.auto.policy import DEFAULT_POLICY, AutoPolicy

__all__ = ["codec_can_settle", "later_probes_needed", "probes_needed", "settled_by_first_step"]


def _close_to_fastest(
    candidates: Sequence[cm.Candidate], predictions: Sequence[cm.Prediction], min_gain: float
) -> dict[str, str]:
    """Exact and fp16 where within ``min_gain`` of the fastest prediction: their probes can lower them."""
    best = min(p.step_s for p in predictions)
    return {
        p.label: probe_family(c)
        for c, p in zip(candidates, predictions)
        if probe_family(c) in ("exact", "fp16") and p.step_s < (1 + min_gain) * best
    }


def probes_needed(
    candidates: Sequence[cm.Candidate],
    predictions: Sequence[cm.Prediction],
    min_gain: float,
    batch: int,
    *,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> tuple[str, str]:
    """Which fixed-cost probes can change a decision predicted without them: ``(families, why)``, the
    families ``"none"`` or those of ``PROBE_FAMILIES`` joined by ``+`` (e.g. ``"exact+block"``).

    Where, without them, a block algorithm is the fastest and beats exact and fp16 by ``min_gain``:
    ``"none"`` if its block is at the cap, where it stays; else ``"exact+block"``, for the block size
    (with both known the block rule's budget shrinks and the block can only lengthen). Otherwise
    exact's probe and the block probe run, fp16's where fp16 is within ``min_gain`` of the fastest, and
    the quantized probe where a bit width is the fastest. fp16's and the quantized probe run second,
    where :func:`later_probes_needed` finds they can still change the decision.
    """
    index, _ = choose(predictions, min_gain, policy=policy)
    chosen = candidates[index]
    fastest = min(range(len(predictions)), key=lambda i: predictions[i].step_s)
    margin = f"{100 * min_gain:.0f}%"
    close = _close_to_fastest(candidates, predictions, min_gain)
    if is_block(chosen) and not close:
        lead = f"{chosen.label} is fastest and beats exact and fp16 by {margin} or more without them"
        if int(chosen.options["block_size"]) >= policy.block_cap * batch:
            return "none", f"{lead}, at the {policy.block_cap}-step cap"
        return "exact+block", f"{lead}; exact's and the block probe for its block size"
    if index == 0 and fastest == 0:
        why = "exact predicted fastest without them"
    elif index == 0:
        why = f"exact kept without them ({candidates[fastest].label} less than {margin} faster)"
    elif is_block(chosen):
        why = f"{', '.join(close)} within {margin} of {chosen.label}"
    else:
        why = f"{chosen.label} predicted fastest without them"
    families = ["exact"]
    if "fp16" in close.values():
        families.append("fp16")
    if probe_family(candidates[fastest]) == "quantized":
        families.append("quantized")
    if any(probe_family(c) == "block" for c in candidates):
        families.append("block")
    if families == ["exact"]:  # exact's probe alone moves its fixed cost out of the compute and back
        return "none", f"{why}: no probe can change the decision"
    return "+".join(families), why


def later_probes_needed(
    candidates: Sequence[cm.Candidate],
    predictions: Sequence[cm.Prediction],
    later: set[str],
    exact_fixed_s: float,
    min_gain: float,
) -> tuple[str, str]:
    """Which of the ``later`` probe families (``fp16``, ``quantized``) can still change the decision once
    exact's and the block probe have run: ``(families or "none", why they were skipped)``.

    ``predictions`` charge each candidate what the first probes found, and one whose probe did not run
    exact's fixed cost. A later family's probe is skipped where even its optimistic bound is not faster
    than the fastest other candidate: fp16 charged ``(1 - min_gain)`` of exact's fixed cost, a quantized
    width exact's (its probe can only come out above exact's).
    """
    optimistic = {"fp16": (1 - min_gain) * exact_fixed_s, "quantized": exact_fixed_s}
    keep, skipped = [], []
    for family in sorted(later):
        mine = [i for i, c in enumerate(candidates) if probe_family(c) == family]
        others = [p.step_s for i, p in enumerate(predictions) if i not in mine]
        if not mine or not others:
            continue
        # each of the family's predictions with its charged fixed cost (exact's) swapped for the bound
        bound = min(predictions[i].step_s - max(0.0, exact_fixed_s - optimistic[family]) for i in mine)
        if bound < min(others):
            keep.append(family)
        else:
            skipped.append(f"{family}'s probe skipped (at its lowest fixed cost still not the fastest)")
    return ("+".join(keep) if keep else "none"), "; ".join(skipped)


def settled_by_first_step(
    candidates: Sequence[cm.Candidate],
    predictions: Sequence[cm.Prediction],
    min_gain: float,
    batch: int,
    *,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> tuple[str, str] | None:
    """Whether predictions made from the first step's time (an upper bound of the compute) already give
    the algorithm that the true step would: ``("none", why)`` (no probe runs) where they do, else ``None``.

    Only a block algorithm that beats exact and fp16 by ``min_gain`` without the probes is settled
    (module docstring). Its length is not, where the bound puts it under the cap: Auto then decides at
    the cap and its first block's timed steps set the length (:func:`~.decision.block_from_timed`).
    """
    index, _ = choose(predictions, min_gain, policy=policy)
    families, _ = probes_needed(candidates, predictions, min_gain, batch, policy=policy)
    chosen = candidates[index]
    # probes_needed names "exact+block" for a block algorithm under the cap that beats exact and fp16
    # by min_gain (those probes could only lengthen its block), "none" for one at the cap
    if not is_block(chosen) or families not in ("none", "exact+block"):
        return None
    cap = policy.block_cap
    lead_s = predictions[0].step_s - predictions[index].step_s  # exact's excess a step over the block's
    block = (
        f"at the {cap}-step cap"
        if int(chosen.options["block_size"]) >= cap * batch
        else f"its block as long or longer (decided at the {cap}-step cap; the first block's timed steps set it)"
    )
    return "none", (
        f"{chosen.label} beats exact and fp16 by {100 * min_gain:.0f}% or more without the probes, {block}; "
        f"settled by the first step (at any shorter step a block algorithm stays the choice; exact is "
        f"{lead_s * 1e3:.0f} ms a step slower at the first step's compute)"
    )


def codec_can_settle(
    candidates: Sequence[cm.Candidate],
    predictions: Sequence[cm.Prediction],
    min_gain: float,
    batch: int,
    *,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> bool:
    """Whether measuring the codec could make a first step's predictions, made without it, settle a block
    algorithm: only where they would settle it without fp16 and the quantized exchange, the two the codec
    prices (its cost can only slow them). Where exact itself is within ``min_gain`` of the block, no codec
    cost can change that, and the codec is left to the decision that prices every candidate."""
    kept = [i for i, c in enumerate(candidates) if probe_family(c) not in ("fp16", "quantized")]
    return (
        settled_by_first_step(
            [candidates[i] for i in kept], [predictions[i] for i in kept], min_gain, batch, policy=policy
        )
        is not None
    )
