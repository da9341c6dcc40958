"""After a decision on a block algorithm: time its first block, then lengthen it or end its trial.

Where the decision is a block algorithm at the cap (phase ``TIMING``) or on trial (phase ``TRIAL``),
Auto times the first block's local steps (median, end to end: it leaves out a step that an evaluation
lengthened) and the round that ends it (its all-reduces, waits included, and its passes over the
parameters). The next round carries both, summed over the ranks, on the block algorithm's own count
all-reduce (:meth:`~bunsan.algorithms.base.Observer.report_values`): no collective of its own, so a rank
that has joined takes part alike, and every rank acts on the same sums (:meth:`Observer.after_round`):

* ``TIMING``: the block is lengthened past the cap by :func:`~.decision.lengthened_block` (or, after a
  decision at the first step that put it under the cap, set by :func:`~.decision.block_from_timed`);
* ``TRIAL``: :func:`~.decision.trial_verdict` keeps the block algorithm at its block, or every rank
  returns to exact, the optimizers' states averaged as the round averaged the models (a rank that has
  joined keeps the block: the hand-over needs every rank).

Both end in phase ``DECIDED``, and the outcome goes into the decision's record. Rounds made by
``sync_replicas()`` carry no report: a loop that calls it every step never reaches either.
"""

from __future__ import annotations

import enum
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from bunsan import comm
from bunsan.algorithms.auto.decision import block_from_timed, lengthened_block, trial_verdict
from bunsan.algorithms.auto.policy import AutoPolicy
from bunsan.algorithms.base import Algorithm, RoundReport
from bunsan.algorithms.blockwise import BlockwiseSGD
from bunsan.algorithms.measure import synchronize

__all__ = ["BlockTiming", "Phase"]

REPORT_WIDTH = 3  # (reporting ranks, their median local step, their round)


class Phase(enum.Enum):
    """Auto's states: ``MEASURING`` -> ``DECIDED``, ``TIMING`` or ``TRIAL`` at a decision;
    ``TIMING`` and ``TRIAL`` -> ``DECIDED`` at the round that carries their timings."""

    MEASURING = "measuring"  # exact SGD, its steps timed
    TIMING = "timing"  # a block algorithm at the cap: its first block timed, to lengthen it
    TRIAL = "trial"  # a block algorithm on trial: its first block timed, to keep it or return to exact
    DECIDED = "decided"


class BlockTiming:
    """The ``TIMING`` and ``TRIAL`` phases (a mixin of :class:`~bunsan.algorithms.auto.Auto`)."""

    policy: AutoPolicy
    min_gain: float
    verbose: bool
    group: ProcessGroup | None
    inner: Algorithm
    decision: dict[str, Any] | None
    phase: Phase
    world_size: int
    _last_end: float | None
    _block_steps_s: list[float]
    _report: list[float] | None
    _round_s: float

    def _device(self) -> torch.device:
        raise NotImplementedError

    def _build(self, algorithm: str, options: dict[str, Any], *, average_optimizer_state: bool = False) -> None:
        raise NotImplementedError

    def _note(self, event: str) -> None:
        raise NotImplementedError

    def _arm_block_timing(self) -> None:
        """After a decision: ``TRIAL`` for a trial under way (a resumed one starts over), ``TIMING`` for a
        block algorithm at the cap not checked yet, else ``DECIDED``."""
        decision = self.decision
        self.phase = Phase.DECIDED
        if (
            decision is None
            or "block_check" in decision
            or not isinstance(self.inner, BlockwiseSGD)
            or self.world_size < 2
        ):
            return
        if "trial" in decision:
            if "outcome" not in decision["trial"]:
                self.phase = Phase.TRIAL
        else:
            batch = int(decision.get("measured", {}).get("batch", 0))  # a decision made by hand may lack it
            if batch > 0 and int(decision["options"]["block_size"]) >= self.policy.block_cap * batch:
                self.phase = Phase.TIMING
        if self.phase is not Phase.DECIDED:
            self._block_steps_s, self._report, self._last_end = [], None, None

    # -- Observer: the report rides on the block algorithm's rounds ----------------------------------------
    def report_width(self) -> int:
        return REPORT_WIDTH if self.phase in (Phase.TIMING, Phase.TRIAL) else 0

    def report_values(self) -> Sequence[float] | None:
        return self._report

    def after_round(self, report: RoundReport) -> None:
        self._round_s = report.seconds
        if report.sums is None or report.sums[0] <= 0:  # no rank has reported yet: the next round
            return
        reporters, local_s, exchange_s = report.sums
        if self.phase is Phase.TIMING:
            self._lengthen(local_s / reporters, exchange_s / reporters)
        elif self.phase is Phase.TRIAL:
            self._end_trial(local_s / reporters, exchange_s / reporters, report.active)

    def _time_block_step(self) -> None:
        """Local, after each step of the first block: time its local steps; once a step ended the block,
        put the median and that round on the next round's report."""
        inner = self.inner
        assert isinstance(inner, BlockwiseSGD)
        blocks = inner.blocks
        inner.after_step()
        synchronize(self._device())
        now = time.perf_counter()
        if self._last_end is not None and self._report is None and self.phase is not Phase.DECIDED:
            if inner.blocks > blocks:  # this step ended the block: its round, as after_round timed it
                if self._block_steps_s:
                    self._report = [1.0, statistics.median(self._block_steps_s), self._round_s]
            elif inner.block_steps > 0:  # a local step (not the warm start's exact steps)
                self._block_steps_s.append(now - self._last_end)
        self._last_end = time.perf_counter()

    def _lengthen(self, compute_s: float, exchange_s: float) -> None:
        """Every rank: the block from the ranks' mean local step and round (the same sums everywhere)."""
        decision = self.decision
        assert isinstance(self.inner, BlockwiseSGD) and decision is not None
        batch = int(decision["measured"]["batch"])
        steps = int(decision["options"]["block_size"]) // batch
        growth = self.policy.growth(decision["algorithm"])
        longer = lengthened_block(steps, compute_s, exchange_s, growth, policy=self.policy)
        floor = decision["measured"].get("first_step_block_steps")  # decided at the first step, under the cap
        after = (
            longer
            if floor is None
            else block_from_timed(steps, int(floor), compute_s, exchange_s, growth, policy=self.policy)
        )
        self._settle()
        check = {
            "local_step_s": compute_s,
            "exchange_s": exchange_s,
            "steps": steps,
            "epoch_growth": growth,
            "lengthened_to": longer,
            **({"first_step_block_steps": int(floor), "steps_after": after} if floor is not None else {}),
            "at_block": self.inner.blocks,
        }
        decision["block_check"] = check
        if after != steps:
            self._set_block(after * batch)
        self._note("block_check")
        if self.verbose and comm.get_rank(self.group) == 0:
            change = "the exchange dominates" if after > steps else "the exchange within 5% of the compute"
            print(
                f"[bunsan] Auto after block {self.inner.blocks}: a local step {compute_s * 1e3:.2f} ms, the exchange "
                f"{exchange_s * 1e3:.1f} ms a block: "
                + (
                    f"blocks stay at {steps} steps"
                    if after == steps
                    else f"blocks of {after} steps from now on (were {steps}; {change})"
                ),
                flush=True,
            )

    def _settle(self) -> None:
        self.phase = Phase.DECIDED
        self._report = None

    def _set_block(self, size: int) -> None:
        """Every rank: the block algorithm's blocks hold ``size`` samples from now on, and the decision says so."""
        decision = self.decision
        assert isinstance(self.inner, BlockwiseSGD) and decision is not None
        self.inner.block_size = size
        decision["options"] = {**decision["options"], "block_size": size}
        decision["label"] = f"{decision['algorithm']}:{size}"

    def _end_trial(self, compute_s: float, exchange_s: float, active: int) -> None:
        """Every rank: keep the trial's block algorithm or return to exact (:func:`~.decision.trial_verdict`)."""
        inner = self.inner
        decision = self.decision
        assert isinstance(inner, BlockwiseSGD) and decision is not None and "trial" in decision
        trial = decision["trial"]
        exact_s = float(trial["exact_step_s"])
        growth = self.policy.growth(decision["algorithm"])
        keep, steps, block_step_s, gain = trial_verdict(
            exact_s, compute_s, exchange_s, self.min_gain, growth, policy=self.policy
        )
        self._settle()
        joined = not keep and active < self.world_size
        trial.update(
            local_step_s=compute_s,
            exchange_s=exchange_s,
            block_step_s=block_step_s,
            steps_after=steps,
            gain=gain,
            kept=keep or joined,
            at_block=inner.blocks,
            **({"joined": True} if joined else {}),
        )
        if keep or joined:
            self._set_block(steps * int(decision["measured"]["batch"]))
            why = "faster than exact" if keep else "faster than exact: a rank has joined"
            outcome = f"{decision['label']} kept{':' if keep else ','} {100 * gain:.1f}% {why}"
        else:
            decision.update(algorithm="data_parallel", options={}, label="exact")
            self._build("data_parallel", {}, average_optimizer_state=True)
            outcome = f"back to exact: {100 * gain:.1f}% faster than exact (< min_gain {100 * self.min_gain:.0f}%)"
        trial["outcome"] = outcome
        self._note("trial")
        if self.verbose and comm.get_rank(self.group) == 0:
            print(
                f"[bunsan] Auto's trial after block {trial['at_block']}: a local step {compute_s * 1e3:.2f} ms, "
                f"the round {exchange_s * 1e3:.1f} ms, {block_step_s * 1e3:.2f} ms a step in blocks of {steps} "
                f"against exact's {exact_s * 1e3:.2f} ms: {outcome}",
                flush=True,
            )
