"""Auto's decision as pure functions: candidates by risk, their predictions, the choice, the block rules, the trial.

Nothing here communicates or measures: every function takes what was measured and the
:class:`~bunsan.algorithms.auto.policy.AutoPolicy`, and returns a value that the tests work out
by hand. The rules (docs/explanation/auto.md gives their reasons):

* Candidates by ``risk`` (docs/how-to/choose-algorithm.md): ``"low"`` exact and fp16 traffic;
  ``"medium"`` also 8- and 2-bit gradients with error feedback; ``"high"`` also 1 bit (rotated
  under heavy SGD momentum), block momentum (BMUF, Chen and Huo 2016) and model averaging (the
  local SGD of Lin et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD").
* Prediction: the alpha-beta cost model (:mod:`bunsan.algorithms.cost_model`, after Thakur,
  Rabenseifner and Gropp 2005) at the compute measured or inferred from the exact step.
* The choice: the fastest candidate, only where it beats exact by ``min_gain`` (exact is the only
  one without an accuracy cost); block algorithms within ``block_tie`` of each other are a tie,
  which goes by the optimizer's momentum.
* The block rule: the smallest block of ``block_steps`` whose amortized exchange costs at most
  ``block_budget`` of the compute, never past the cap at decision time; past it only from timed
  blocks, doubled while a doubling saves more than the epochs it costs (``growth``).
* The first-step bound: a step's first time is an upper bound of its compute; only a block
  algorithm that wins by ``min_gain`` without the fixed-cost probes stays the choice at every
  smaller compute.
* The trial: a block algorithm predicted just under the bar runs short blocks; its timed steps keep
  it where a step at the cap beats exact's measured step by ``min_gain``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from bunsan._validate import check_choice, check_number
from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.auto.policy import DEFAULT_POLICY, AutoPolicy
from bunsan.algorithms.data_parallel import HEAVY_MOMENTUM_1BIT

__all__ = [
    "BLOCK_ALGORITHMS",
    "PROBE_FAMILIES",
    "RISKS",
    "Plan",
    "at_cap",
    "block_from_timed",
    "block_size",
    "candidates_for",
    "choose",
    "infer_compute",
    "lengthened_block",
    "plan",
    "probe_family",
    "probes_for",
    "same_choice",
    "split_compute",
    "trial_candidate",
    "trial_verdict",
]

RISKS = ("low", "medium", "high")
BLOCK_ALGORITHMS = ("block_momentum", "model_averaging")
PROBE_FAMILIES = ("exact", "fp16", "quantized", "block")  # one fixed-cost probe each
EXACT = cm.Candidate("data_parallel", {}, "exact")


def is_block(label_or_candidate: str | cm.Candidate) -> bool:
    """Whether a candidate (or a prediction's label, ``"model_averaging:512"``) is a block algorithm."""
    if isinstance(label_or_candidate, cm.Candidate):
        return label_or_candidate.algorithm in BLOCK_ALGORITHMS
    return label_or_candidate.split(":")[0] in BLOCK_ALGORITHMS


# -- the compute behind a measured step ------------------------------------------------------------------
def infer_compute(
    step_s: float,
    profile: cm.Profile,
    network: cm.Network,
    workers: int,
    *,
    overlap: bool = True,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> float:
    """The compute ``c`` with ``c + exposed exact exchange(c) = step_s`` (a few fixed-point rounds)."""
    compute = step_s
    for _ in range(20):
        trial = cm.Profile(**{**vars(profile), "compute_s": compute})
        predicted = cm.predict(trial, network, EXACT, workers, overlap=overlap)
        compute = max(step_s * policy.compute_floor, step_s - (predicted.step_s - compute))
    return compute


def split_compute(
    step_s: float,
    local_s: float | None,
    profile: cm.Profile,
    network: cm.Network,
    workers: int,
    *,
    overlap: bool = True,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> tuple[float, float]:
    """``(compute, straggler)`` of an exact step of ``step_s`` (the slowest rank's) whose ranks spent
    ``local_s`` each, on average, outside the exchange (``None``: not measured).

    Without ``local_s`` the compute is inferred (:func:`infer_compute`). Measured, the compute is
    ``local_s`` and what the step holds past the modelled exchange and fixed cost is the wait for the
    slowest rank (:attr:`bunsan.algorithms.cost_model.Profile.straggler_s`), which a block algorithm
    pays once a block; exact's prediction is still the measured step. ``local_s`` not under the
    inferred compute, or a straggler that would be negative, keeps the inferred compute, no straggler.
    """
    inferred = infer_compute(step_s, profile, network, workers, overlap=overlap, policy=policy)
    if local_s is None or not 0 < local_s < inferred:
        return inferred, 0.0
    trial = cm.Profile(**{**vars(profile), "compute_s": local_s, "straggler_s": 0.0})
    straggler = step_s - cm.predict(trial, network, EXACT, workers, overlap=overlap).step_s
    return (local_s, straggler) if straggler > 0 else (inferred, 0.0)


# -- candidates ----------------------------------------------------------------------------------------
def block_size(
    profile: cm.Profile,
    network: cm.Network,
    workers: int,
    name: str,
    overlap: bool = True,
    *,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> int:
    """Samples per block of ``name``: the smallest of ``policy.block_steps`` whose exposed exchange
    costs at most ``policy.block_budget`` of the compute, else the cap."""
    for k in policy.block_steps:
        candidate = cm.Candidate(name, {"block_size": k * profile.batch})
        exposed = cm.predict(profile, network, candidate, workers, overlap=overlap).exposed_s
        if exposed <= policy.block_budget * profile.compute_s:
            return k * profile.batch
    return policy.block_cap * profile.batch


def candidates_for(
    risk: str,
    profile: cm.Profile,
    network: cm.Network,
    workers: int,
    *,
    momentum: float = 0.0,
    warm_start: int = 0,
    overlap: bool = True,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> list[cm.Candidate]:
    """The candidates ``risk`` accepts, exact first, with their settings chosen by the rules above."""
    check_choice("risk", risk, RISKS)
    found = [EXACT, cm.Candidate("data_parallel", {"compression": "fp16"}, "fp16")]
    if risk in ("medium", "high"):
        found += [cm.Candidate("data_parallel", {"bits": b, "warm_start": warm_start}, f"{b}-bit") for b in (8, 2)]
    if risk == "high":
        rotate = momentum >= HEAVY_MOMENTUM_1BIT
        options = {"bits": 1, "warm_start": warm_start, "rotate": rotate}
        found.append(cm.Candidate("data_parallel", options, "1-bit rotated" if rotate else "1-bit"))
        # the two exchange alike and are predicted alike: a tie goes to the first listed (choose)
        order = BLOCK_ALGORITHMS if momentum < policy.block_momentum_below else BLOCK_ALGORITHMS[::-1]
        for name in order:
            size = block_size(profile, network, workers, name, overlap, policy=policy)
            found.append(cm.Candidate(name, {"block_size": size, "warm_start": warm_start}, f"{name}:{size}"))
    return found


def probes_for(risk: str, momentum: float) -> tuple[list[cm.Candidate], dict[str, str]]:
    """The fixed-cost probes of ``risk`` (no warm start) and which candidates share a probe's result:
    every bit width runs the same striped exchange (the codec's own cost per width is measured apart),
    both block algorithms the same block exchange, so one probe of each family stands for all of it."""
    probes = [EXACT, cm.Candidate("data_parallel", {"compression": "fp16"}, "fp16")]
    shared: dict[str, str] = {}
    if risk == "medium":
        probes.append(cm.Candidate("data_parallel", {"bits": 2}, "2-bit"))
        shared["8-bit"] = "2-bit"
    elif risk == "high":
        rotate = momentum >= HEAVY_MOMENTUM_1BIT
        quantized = "1-bit rotated" if rotate else "1-bit"
        probes.append(cm.Candidate("data_parallel", {"bits": 1, "rotate": rotate}, quantized))
        shared.update({"8-bit": quantized, "2-bit": quantized})
        probes.append(cm.Candidate("block_momentum", {"block_size": 64}, "block_momentum"))
        shared["model_averaging"] = "block_momentum"
    return probes, shared


def probe_family(candidate: cm.Candidate) -> str:
    """The fixed-cost probe family of a candidate: ``exact``, ``fp16`` (either half type), ``quantized``
    (every bit width: one striped exchange) or ``block`` (both block algorithms)."""
    if is_block(candidate):
        return "block"
    if "bits" in candidate.options:
        return "quantized"
    return "fp16" if candidate.options.get("compression") else "exact"


class Plan(NamedTuple):
    """Rank 0's prediction at one step time: the profile, its compute, the candidates and their predictions."""

    profile: cm.Profile
    compute_s: float
    candidates: list[cm.Candidate]
    predictions: list[cm.Prediction]


def plan(
    base: cm.Profile,
    step_s: float,
    network: cm.Network,
    workers: int,
    *,
    risk: str,
    momentum: float,
    warm_start: int,
    overlap: bool,
    fixed: dict[str, float],
    codec: dict[str, float],
    codecs: tuple[tuple[int | float, ...], ...],
    local_s: float | None = None,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> Plan:
    """Predict every candidate of ``risk`` at an exact step of ``step_s``: each candidate charged its
    probe's fixed cost (``fixed``, by label; block algorithms by name, so the block rule amortizes
    theirs), the compute split from the step (:func:`split_compute`), the codec's speeds."""
    draft = cm.Profile(**{**vars(base), "compute_s": step_s, "fixed_s": tuple(fixed.items())})
    compute, straggler = split_compute(step_s, local_s, draft, network, workers, overlap=overlap, policy=policy)
    profile = cm.Profile(**{**vars(draft), "compute_s": compute, "straggler_s": straggler, **codec, "codecs": codecs})
    candidates = candidates_for(
        risk, profile, network, workers, momentum=momentum, warm_start=warm_start, overlap=overlap, policy=policy
    )
    predictions = [cm.predict(profile, network, c, workers, overlap=overlap) for c in candidates]
    return Plan(profile, compute, candidates, predictions)


def at_cap(found: Plan, network: cm.Network, workers: int, overlap: bool, policy: AutoPolicy = DEFAULT_POLICY) -> Plan:
    """The same plan with every block algorithm's block at the cap, predicted again."""
    cap = policy.block_cap * found.profile.batch
    candidates = [
        cm.Candidate(c.algorithm, {**c.options, "block_size": cap}, f"{c.algorithm}:{cap}") if is_block(c) else c
        for c in found.candidates
    ]
    predictions = [cm.predict(found.profile, network, c, workers, overlap=overlap) for c in candidates]
    return Plan(found.profile, found.compute_s, candidates, predictions)


# -- the choice ----------------------------------------------------------------------------------------
def _tie_winner(predictions: Sequence[cm.Prediction], fastest_block: float, policy: AutoPolicy) -> int:
    """The first listed block algorithm within ``block_tie`` of the fastest one (candidates_for: by momentum)."""
    return next(
        i for i, p in enumerate(predictions) if is_block(p.label) and p.step_s <= (1 + policy.block_tie) * fastest_block
    )


def choose(
    predictions: Sequence[cm.Prediction], min_gain: float, *, policy: AutoPolicy = DEFAULT_POLICY
) -> tuple[int, str]:
    """Index of the chosen prediction (the first is exact) and why."""
    exact = predictions[0]
    best = min(range(len(predictions)), key=lambda i: predictions[i].step_s)
    if is_block(predictions[best].label):
        best = _tie_winner(predictions, predictions[best].step_s, policy)
    gain = exact.step_s / predictions[best].step_s - 1
    if best == 0:
        return 0, "exact is predicted fastest"
    if gain < min_gain:
        return 0, (
            f"{predictions[best].label} is predicted only {100 * gain:.1f}% faster than exact "
            f"(< min_gain {100 * min_gain:.0f}%): exact has no accuracy cost"
        )
    return best, f"predicted {100 * gain:.1f}% faster than exact (>= min_gain {100 * min_gain:.0f}%)"


def same_choice(a: cm.Candidate, b: cm.Candidate) -> bool:
    """The same algorithm with the same settings, whatever the length of its block: what the check after
    ``min_timed`` steps asks of the choice at their fastest and slowest step (the block comes from their
    median; below the cap the epochs to target barely move with the block)."""

    def settings(c: cm.Candidate) -> tuple[str, dict[str, Any]]:
        return c.algorithm, {k: v for k, v in c.options.items() if k != "block_size"}

    return settings(a) == settings(b)


# -- blocks past the cap -------------------------------------------------------------------------------
def lengthened_block(
    steps: int, compute_s: float, exchange_s: float, growth: float, *, policy: AutoPolicy = DEFAULT_POLICY
) -> int:
    """Steps per block past the cap, from a block of ``steps`` that ran: doubled while a doubling cuts the
    time per step (``compute_s`` a local step plus ``exchange_s`` a block amortized over its steps) by
    more than ``growth``, the most a doubling costs the algorithm in epochs to target, up to
    ``policy.max_block_steps``. With ``c`` the local step and ``e`` the exchange, a doubling pays where
    ``growth * (c + e/2) < c + e``, i.e. ``e > c (growth - 1) / (1 - growth/2)``: 2.5 c at growth 14/9,
    0.36 c at 15/13."""
    check_number("growth", growth, minimum=1.0, hint="the factor a doubling may cost in epochs to target")
    k = steps
    while k < policy.max_block_steps and growth * (compute_s + exchange_s / (2 * k)) < compute_s + exchange_s / k:
        k *= 2
    return k


def block_from_timed(
    steps: int,
    floor_steps: int,
    compute_s: float,
    exchange_s: float,
    growth: float,
    *,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> int:
    """Steps per block from a first block of ``steps`` (the cap) that ran, after a decision at the first
    step that put the block under the cap: the block rule on the timed figures (the smallest of
    ``block_steps`` whose round ``exchange_s`` amortized costs at most ``block_budget`` of a local step
    ``compute_s``), never under ``floor_steps`` (the bound's block: a shorter step only lengthens it);
    where the rule keeps the cap, past it by :func:`lengthened_block`."""
    for k in policy.block_steps:
        if floor_steps <= k < steps and exchange_s / k <= policy.block_budget * compute_s:
            return k
    return lengthened_block(steps, compute_s, exchange_s, growth, policy=policy)


# -- the trial -----------------------------------------------------------------------------------------
def trial_candidate(
    candidates: Sequence[cm.Candidate],
    predictions: Sequence[cm.Prediction],
    min_gain: float,
    *,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> int | None:
    """The block algorithm worth a trial (its index), or ``None``: where :func:`choose` keeps exact and the
    block algorithm it would take (the tie rule's) is predicted faster than exact by ``min_gain`` less
    ``trial_window`` or more. The prediction prices the block rule's block, whose exchange may still cost
    ``block_budget`` of the step, and rests on a model of the exchange and of the wait for the slowest
    rank; near the bar only timed local steps and rounds tell."""
    index, _ = choose(predictions, min_gain, policy=policy)
    blocks = [i for i, c in enumerate(candidates) if is_block(c)]
    if index != 0 or not blocks:
        return None
    fastest = min(predictions[i].step_s for i in blocks)
    best = next(i for i in blocks if predictions[i].step_s <= (1 + policy.block_tie) * fastest)
    gain = predictions[0].step_s / predictions[best].step_s - 1
    return best if min_gain - policy.trial_window <= gain < min_gain else None


def trial_verdict(
    exact_step_s: float,
    local_step_s: float,
    round_s: float,
    min_gain: float,
    growth: float,
    *,
    policy: AutoPolicy = DEFAULT_POLICY,
) -> tuple[bool, int, float, float]:
    """``(keep, steps, block_step_s, gain)`` of a trial: the block at the cap, past it where the timed
    figures lengthen it (:func:`lengthened_block`), the time of a step at that block (a local step plus
    the round amortized over the block) and its gain over exact's measured step; kept where that gain
    is at least ``min_gain``, the bar :func:`choose` sets. The cap, not the block rule's shorter block:
    a trial runs where the gain is near the bar, and a shorter block gives up to ``block_budget`` of the
    step to its exchange."""
    steps = lengthened_block(policy.block_cap, local_step_s, round_s, growth, policy=policy)
    block_step_s = local_step_s + round_s / steps
    gain = exact_step_s / max(block_step_s, 1e-12) - 1
    return gain >= min_gain, steps, block_step_s, gain
