"""Every tuned number of ``algorithm="auto"`` in one frozen dataclass, :class:`AutoPolicy`.

Each field names the section of the documentation that gives its rule and its reason
(docs/explanation/auto.md, docs/how-to/choose-algorithm.md). The numbers are data, not code: a
job that wants another one passes ``bunsan.Auto(policy=AutoPolicy(block_budget=0.1))``, and
:mod:`bunsan.algorithms.auto.decision` reads nothing else. The arguments of
:class:`~bunsan.algorithms.auto.Auto` itself (``risk``, ``min_gain``, ``measure_budget_s``)
are the choices a user makes; the policy is how Auto carries them out.

The style follows torch's PowerSGD state (each knob documented with how to tune it) and
Horovod's autotuner (what it may tune is fixed, what it measured is logged, not coded).
"""

from __future__ import annotations

from dataclasses import dataclass

from bunsan._validate import check_int, check_number, check_type

__all__ = ["DEFAULT_POLICY", "AutoPolicy"]

_AUTO_MD = "docs/explanation/auto.md"


@dataclass(frozen=True)
class AutoPolicy:
    """The rules' numbers; the defaults are bunsan's. Sections are of docs/explanation/auto.md unless named."""

    # -- candidates and the choice ("Ties, and a trial near the bar") ------------------------------------
    block_momentum_below: float = 0.5  # optimizer momentum under which a block tie goes to block momentum
    block_tie: float = 0.01  # block algorithms predicted within this share of each other are a tie
    # -- the block ("How long a block is") -------------------------------------------------------------
    block_steps: tuple[int, ...] = (2, 4, 8, 16, 32)  # local steps per block at decision time; the last is the cap
    block_budget: float = 0.05  # a block's amortized exchange may cost this share of the compute
    max_block_steps: int = 256  # the longest block the lengthening rule builds
    growth_block_momentum: float = 14 / 9  # most a doubling past the cap cost block momentum in epochs
    growth_model_averaging: float = 15 / 13  # ... and model averaging
    # -- the trial ("Ties, and a trial near the bar") --------------------------------------------------
    trial_window: float = 0.1  # a block algorithm this far under min_gain still goes on trial
    trial_steps: int = 8  # local steps per block during a trial
    # -- measuring ("How long to measure", "The first step decides where it settles the choice") -------
    min_timed: int = 3  # the fewest timed steps an early end of measuring rests on ...
    min_agreeing: int = 2  # ... or these many, where they agree within min_gain
    second_step_margin: float = 2.0  # the second step's time counts as a bound at this multiple
    second_step_check: bool = True  # weigh the second step before its exchange where the first left it open
    # -- probes ("The probes") -------------------------------------------------------------------------
    network_sizes: tuple[int, ...] = (4, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # bytes per all-reduce
    network_repeats: int = 3  # timings per size (their median)
    enough_s: float = 0.02  # an all-reduce this long is far past the latency: no larger size is timed
    retry_sizes: tuple[int, ...] = (4, 1024 * 1024, 4 * 1024 * 1024)  # once more where no growth with size was seen
    retry_repeats: int = 7
    codec_repeats: int = 2  # timings of the codec and of a copy (their median)
    probe_steps: int = 4  # the fixed-cost probe: steps per timed run ...
    probe_warmup: int = 2  # ... untimed steps first ...
    probe_repeats: int = 3  # ... and timed runs (their median)
    compute_floor: float = 0.05  # an inferred compute is at least this share of the step ("What algorithm="auto" does")

    def __post_init__(self) -> None:
        for name in ("block_momentum_below", "block_tie", "block_budget", "compute_floor"):
            check_number(name, getattr(self, name), minimum=0.0, maximum=1.0, hint=f"a share; {_AUTO_MD}")
        check_number("trial_window", self.trial_window, minimum=0.0, hint=f"a share under min_gain; {_AUTO_MD}")
        for name in ("growth_block_momentum", "growth_model_averaging", "second_step_margin"):
            check_number(name, getattr(self, name), minimum=1.0, hint=f"a factor; {_AUTO_MD}")
        check_number("enough_s", self.enough_s, minimum=0.0, hint="seconds")
        for name in ("trial_steps", "min_agreeing", "network_repeats", "retry_repeats", "codec_repeats"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("probe_steps", "probe_repeats"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("probe_warmup", self.probe_warmup, minimum=0)
        check_int("min_timed", self.min_timed, minimum=max(2, self.min_agreeing), hint="at least min_agreeing")
        check_type("second_step_check", self.second_step_check, bool)
        for name in ("block_steps", "network_sizes", "retry_sizes"):
            values = check_type(name, getattr(self, name), tuple)
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {values!r}")
            if list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be increasing, got {values!r}")
        check_int("max_block_steps", self.max_block_steps, minimum=self.block_cap, hint="at least the cap")

    @property
    def block_cap(self) -> int:
        """The longest block at decision time (the last of :attr:`block_steps`)."""
        return self.block_steps[-1]

    def growth(self, algorithm: str) -> float:
        """The most a doubling of the block past the cap costs ``algorithm`` in epochs to target."""
        if algorithm == "block_momentum":
            return self.growth_block_momentum
        if algorithm == "model_averaging":
            return self.growth_model_averaging
        raise ValueError(f"no block growth for {algorithm!r}: block_momentum or model_averaging")


DEFAULT_POLICY = AutoPolicy()
