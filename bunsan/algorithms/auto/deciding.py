"""One collective decision point of Auto: measure what the decision needs, rank 0 decides, one broadcast.

Every rank enters :meth:`Deciding._decide` at the same step and leaves it with the same decision
(or none, and measuring goes on). Inside, in the same order on every rank:

1. the job's step time, reduced once (the slowest rank's: a synchronous step ends with its slowest
   rank), and on CPU each rank's compute outside the exchange (the ranks' mean);
2. what is not measured yet: the network, then the codec (or only a copy, where the first step can
   settle the choice without it);
3. at the first or second step, whether the bound settles a block algorithm
   (:func:`~bunsan.algorithms.auto.bounds.settled_by_first_step`): rank 0 predicts, one broadcast;
4. otherwise the fixed-cost probes that can change the decision
   (:func:`~bunsan.algorithms.auto.bounds.probes_needed`): rank 0 names them, one broadcast, every
   rank probes;
5. rank 0 predicts and chooses (:mod:`bunsan.algorithms.auto.decision`), one broadcast of the
   record (:mod:`bunsan.algorithms.auto.record`), and every rank applies it.

Only rank 0 predicts, so a rank-0-only branch never runs a collective: every collective above is
outside them, and each rank-0 result reaches the others by the one broadcast that follows it.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan import comm, runtime
from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.auto import measuring
from bunsan.algorithms.auto.bounds import codec_can_settle, later_probes_needed, probes_needed, settled_by_first_step
from bunsan.algorithms.auto.decision import (
    EXACT,
    PROBE_FAMILIES,
    Plan,
    at_cap,
    choose,
    is_block,
    plan,
    probes_for,
    same_choice,
    trial_candidate,
)
from bunsan.algorithms.auto.measuring import Measured
from bunsan.algorithms.auto.policy import AutoPolicy
from bunsan.algorithms.auto.record import format_decision, inconclusive_record, measured_record, trial_record
from bunsan.algorithms.measure import can_overlap

__all__ = ["Deciding", "Point"]

Probing = tuple[str, str]  # (families that ran or "none", why)


class Point(NamedTuple):
    """Where a decision is taken: after timed steps (``span``: only where their fastest and slowest agree),
    or at the first or second step from its time (``first_step_s``, a bound; ``before_exchange``: timed at
    the end of backward, before the exchange; ``second_step_s``: the second step's own time)."""

    first_step_s: float | None = None
    span: bool = False
    before_exchange: bool = False
    second_step_s: float | None = None

    def how(self, spread: Sequence[float], floor_steps: int | None, margin: float) -> dict[str, Any]:
        """The record's fields that say how the exact step was timed."""
        first, second = self.first_step_s, self.second_step_s
        return {
            **({"first_step": True} if first is not None and second is None else {}),
            **({"second_step_before_exchange_s": second, "bound_margin": margin} if second is not None else {}),
            **({"first_step_block_steps": floor_steps} if floor_steps is not None else {}),
            **({"first_step_before_exchange_s": first} if self.before_exchange and second is None else {}),
            **({"step_span_s": list(spread)} if spread else {}),
        }


class Deciding:
    """Auto's decision point (a mixin of :class:`~bunsan.algorithms.auto.Auto`, which sets these)."""

    policy: AutoPolicy
    risk: str
    min_gain: float
    warm_start: int
    network: cm.Network | None
    fixed_costs: bool
    verbose: bool
    group: ProcessGroup | None
    named_params: list[tuple[str, Tensor]]
    decision: dict[str, Any] | None
    _durations: list[float]
    _locals: list[float]
    _measured: int
    _early: Measured | None

    world_size: int

    def _device(self) -> torch.device:
        raise NotImplementedError

    def _momentum(self) -> float:
        raise NotImplementedError

    def _profile(self, compute_s: float) -> cm.Profile:
        raise NotImplementedError

    def apply_decision(self, decision: dict[str, Any], *, mid_step: bool = False) -> None:
        raise NotImplementedError

    def _numel(self) -> int:
        return sum(p.numel() for _, p in self.named_params)

    def _plan(self, step_s: float, m: Measured, fixed: dict[str, float], local_s: float | None = None) -> Plan:
        """Rank 0: every candidate predicted at an exact step of ``step_s`` with what ``m`` holds."""
        assert m.network is not None
        return plan(
            self._profile(step_s),
            step_s,
            m.network,
            self.world_size,
            risk=self.risk,
            momentum=self._momentum(),
            warm_start=self.warm_start,
            overlap=m.overlap,
            fixed=fixed,
            codec=m.codec,
            codecs=m.codecs,
            local_s=local_s,
            policy=self.policy,
        )

    def _decide(self, point: Point | None = None) -> None:
        """Collective: measure, predict and decide on rank 0, apply everywhere (module docstring). Where it
        does not decide, what was measured is kept for the next decision point and measuring goes on."""
        started = time.perf_counter()
        point = point or Point()
        step_s, spread, local_s = self._job_step(point)
        m = self._inputs(started, point)
        if m is None:  # the span check without a network: left to the decision at the end of measuring
            return
        probing: Probing | None = None
        found: Plan | None = None
        if point.first_step_s is not None:
            settled = self._first_step_settles(m, step_s, point.before_exchange)
            if settled is None:
                self._keep(m)
                return
            probing, found, step_s = settled
        elif m.network is not None and self.fixed_costs:
            probing = self._run_probes(m, (step_s, *spread), local_s)
        decision = None
        if comm.get_rank(self.group) == 0:
            decision = self._choose(m, point, step_s, spread, local_s, found, probing)
        decision = comm.broadcast_object(decision, src=0, group=self.group)
        if decision is None:  # the span check found a choice that the step time can still change
            self._keep(m)
            return
        self.apply_decision(decision, mid_step=point.before_exchange)

    def _keep(self, m: Measured) -> None:
        """Every rank: keep what was measured for the next decision point (where there is a network)."""
        if m.network is not None:
            m.spent_s = time.perf_counter() - m.started
            self._early = m

    def _job_step(self, point: Point) -> tuple[float, tuple[float, ...], float | None]:
        """Collective: ``(step_s, spread, local_s)``: the slowest rank's median timed step (or the point's
        bound), for the span check the fastest and slowest of the slowest rank's timed steps, and each
        rank's compute outside the exchange (the ranks' mean) where the network is the job's own (with a
        given network, the difference between it and the real exchange would count as waiting)."""
        if point.first_step_s is not None:
            return point.first_step_s, (), None
        times = measuring.slowest(
            [statistics.median(self._durations), *(self._durations if point.span else ())], self.group
        )
        spread = (min(times[1:]), max(times[1:])) if point.span else ()
        local_s = None
        if self.network is None:
            local_s = measuring.local_compute(self._durations, self._locals, self._device(), self.group)
        return times[0], spread, local_s

    def _inputs(self, started: float, point: Point) -> Measured | None:
        """Collective: the network, the overlap rule and the codec, measured here or kept from an earlier
        decision point; ``None`` for a span check whose network probe was inconclusive."""
        n = self.world_size
        device = self._device()
        if self._early is not None:
            m = copy.deepcopy(self._early)
            m.started = started - m.spent_s  # the record's time to decide counts the earlier measuring too
            if m.codec_deferred and point.first_step_s is None:  # the timed steps' decision prices every candidate
                m.codec, m.codecs = measuring.job_codecs(self._numel(), self.risk, self.group, device, self.policy)
                m.codec_deferred = False
            return m
        network = self.network if n > 1 else None
        if network is None and n > 1:  # one worker exchanges nothing: exact, without probing a network
            gradient_bytes = sum(p.numel() * p.element_size() for _, p in self.named_params)
            network = measuring.job_network(self.group, gradient_bytes, self.policy)
        if point.span and network is None:
            return None
        local = runtime.local_size()  # the exchange overlaps backward only where it does not need the compute's core
        m = Measured(network, overlap=can_overlap(device, local, over_memory=local == runtime.size()), started=started)
        m.network_s = time.perf_counter() - started
        if network is not None and point.first_step_s is not None:
            # The first step can settle only a block algorithm, and the codec prices only fp16 and the
            # quantized exchange: a copy prices the block rounds' passes, the codec waits until the
            # prediction without it leaves the choice open.
            m.codec = measuring.job_copy(self._numel(), self.group, device, self.policy)
            m.codec_deferred = True
        elif network is not None:  # the same on every rank (max-reduced timings): all measure, at once
            m.codec, m.codecs = measuring.job_codecs(self._numel(), self.risk, self.group, device, self.policy)
        return m

    def _first_step_settles(
        self, m: Measured, step_s: float, before_exchange: bool
    ) -> tuple[Probing, Plan | None, float] | None:
        """Collective: ``(probing, rank 0's plan, step)`` where the bound settles a block algorithm, else
        ``None``. Before the exchange the exact step the bound stands for adds the exchange predicted on
        the network. The codec is measured only where its cost could settle what its absence leaves open."""
        deciding = comm.get_rank(self.group) == 0
        settled: Probing | None = None
        codec_matters = False
        found: Plan | None = None
        if deciding and m.network is not None:
            if before_exchange:
                profile = self._profile(step_s)
                step_s = cm.predict(profile, m.network, EXACT, self.world_size, overlap=m.overlap).step_s
            found, settled = self._settles(m, step_s)
            codec_matters = (
                settled is None
                and m.codec_deferred
                and codec_can_settle(
                    found.candidates, found.predictions, self.min_gain, found.profile.batch, policy=self.policy
                )
            )
        settled, codec_matters = comm.broadcast_object((settled, codec_matters), src=0, group=self.group)
        if settled is None and codec_matters:  # every rank: the codec may settle it
            m.codec, m.codecs = measuring.job_codecs(self._numel(), self.risk, self.group, self._device(), self.policy)
            m.codec_deferred = False
            if deciding:
                found, settled = self._settles(m, step_s)
            settled = comm.broadcast_object(settled, src=0, group=self.group)
        elif settled is not None and m.codec_deferred:
            why = f"{settled[1]}; the codec not measured: without it fp16 and the quantized exchange are still slower"
            settled = (settled[0], why)
        return None if settled is None else (settled, found, step_s)

    def _settles(self, m: Measured, step_s: float) -> tuple[Plan, Probing | None]:
        """Rank 0: the plan at the bound ``step_s``, without probes, and whether it settles the choice."""
        found = self._plan(step_s, m, {})
        batch = found.profile.batch
        return found, settled_by_first_step(
            found.candidates, found.predictions, self.min_gain, batch, policy=self.policy
        )

    def _run_probes(self, m: Measured, steps_s: Sequence[float], local_s: float | None) -> Probing:
        """Collective: rank 0 predicts without the probes at each step time and names the probe families
        that can change the decision at any of them (one broadcast); every rank runs them, exact's and the
        block probe first, fp16's and the quantized one only where those still can (a second broadcast).
        A family an earlier decision point probed is not probed again. Updates ``m.fixed``."""
        probe_started = time.perf_counter() - m.probe_s
        probing: Probing | None = None
        found: Plan | None = None
        if comm.get_rank(self.group) == 0:
            plans = [self._plan(s, m, {}, local_s) for s in steps_s]
            found = plans[0]
            needed = [probes_needed(p.candidates, p.predictions, self.min_gain, p.profile.batch) for p in plans]
            wanted = {f for families, _ in needed for f in families.split("+")} - {"none"}
            todo = [f for f in PROBE_FAMILIES if f in wanted - m.probed]
            probing = ("+".join(todo) or "none", needed[0][1])
        probing = comm.broadcast_object(probing, src=0, group=self.group)
        assert probing is not None and m.network is not None
        if probing[0] != "none":
            families = set(probing[0].split("+"))
            probes, shared = probes_for(self.risk, self._momentum())
            first = families & {"exact", "block"}
            if first:
                m.fixed.update(
                    measuring.probe_fixed_costs(probes, first, m.network, self.group, m.overlap, self.policy)
                )
            later = families - {"exact", "block"}
            ran = m.probed | first
            if later:
                skipped = self._later_probes(m, found, later, steps_s, local_s, shared)
                wanted = set(skipped[0].split("+")) - {"none"}
                if wanted:
                    m.fixed.update(
                        measuring.probe_fixed_costs(probes, wanted, m.network, self.group, m.overlap, self.policy)
                    )
                ran |= wanted
                if skipped[1]:
                    probing = (probing[0], f"{probing[1]}; {skipped[1]}")
            m.probed |= ran
            shared = {label: source for label, source in shared.items() if source in m.fixed}
            m.fixed.update({label: m.fixed[source] for label, source in shared.items()})
            if found is not None:  # rank 0: a per-step candidate whose probe did not run at exact's, under its own
                m.fixed.update(
                    {c.label: m.fixed["exact"] for c in found.candidates if not is_block(c) and c.label not in m.fixed}
                )
        if m.probed:  # the record names the probes that ran, at this decision point or an earlier one
            probing = ("+".join(f for f in PROBE_FAMILIES if f in m.probed), probing[1])
        m.probe_s = time.perf_counter() - probe_started
        return probing

    def _later_probes(
        self,
        m: Measured,
        found: Plan | None,
        later: set[str],
        steps_s: Sequence[float],
        local_s: float | None,
        shared: dict[str, str],
    ) -> Probing:
        """Collective: rank 0 names the later probe families (fp16's, the quantized one) that can still
        change the decision given exact's and the block probe's results (one broadcast)."""
        skipped: Probing | None = None
        if found is not None:  # rank 0
            fixed = m.fixed
            so_far = {**fixed, **{a: fixed[b] for a, b in shared.items() if b in fixed}}
            so_far.update(
                {c.label: fixed["exact"] for c in found.candidates if not is_block(c) and c.label not in so_far}
            )
            answers = [
                later_probes_needed(p.candidates, p.predictions, later, fixed["exact"], self.min_gain)
                for p in (self._plan(s, m, so_far, local_s) for s in steps_s)
            ]
            keep = {f for families, _ in answers for f in families.split("+")} - {"none"}
            # a family runs where any step time wants it; the median's reasons for the others
            reasons = [r for r in answers[0][1].split("; ") if r and r.split("'s probe")[0] not in keep]
            skipped = ("+".join(sorted(keep)) or "none", "; ".join(reasons))
        skipped = comm.broadcast_object(skipped, src=0, group=self.group)
        assert skipped is not None
        return skipped

    def _choose(
        self,
        m: Measured,
        point: Point,
        step_s: float,
        spread: tuple[float, ...],
        local_s: float | None,
        found: Plan | None,
        probing: Probing | None,
    ) -> dict[str, Any] | None:
        """Rank 0: the decision's record, or ``None`` where the span check finds the choice can still change."""
        n = self.world_size
        if m.network is None:
            decision = inconclusive_record(self._measured, n, step_s)
            if self.verbose:
                print(f"[bunsan] Auto at step {self._measured}: {decision['why']}", flush=True)
            return decision
        if found is None:
            found = self._plan(step_s, m, m.fixed, local_s)
        index, why = choose(found.predictions, self.min_gain, policy=self.policy)
        floor_steps: int | None = None
        cap_size = self.policy.block_cap * found.profile.batch
        if (
            point.first_step_s is not None
            and int(found.candidates[index].options.get("block_size", cap_size)) < cap_size
        ):
            # settled by a bound: a block algorithm at any shorter step, its block as long or longer: the cap
            # now, and the first block's timed steps set the length (block_from_timed)
            floor_steps = int(found.candidates[index].options["block_size"]) // found.profile.batch
            found = at_cap(found, m.network, n, m.overlap, self.policy)
            index, why = choose(found.predictions, self.min_gain, policy=self.policy)
        chosen = found.candidates[index]
        for other in spread:  # the span check: the same choice at the fastest and slowest timed step
            o = self._plan(other, m, m.fixed, local_s)
            if not same_choice(o.candidates[choose(o.predictions, self.min_gain, policy=self.policy)[0]], chosen):
                return None
        if spread:
            why = (
                f"{why}; the same at the fastest and the slowest of {len(self._durations)} timed steps "
                f"({spread[0] * 1e3:.2f}-{spread[1] * 1e3:.2f} ms)"
            )
        decision = self._record(m, point, step_s, spread, local_s, found, index, why, floor_steps)
        if probing is not None:
            decision["measured"]["probes"] = list(probing)
        tried = trial_candidate(found.candidates, found.predictions, self.min_gain, policy=self.policy)
        if tried is not None and point.first_step_s is None:
            trial_record(decision, found.candidates[tried], found.predictions, tried, self.policy)
        if self.verbose:
            print(format_decision(decision), flush=True)
        return decision

    def _record(
        self,
        m: Measured,
        point: Point,
        step_s: float,
        spread: tuple[float, ...],
        local_s: float | None,
        found: Plan,
        index: int,
        why: str,
        floor_steps: int | None,
    ) -> dict[str, Any]:
        """Rank 0: the decision's record: the choice, why, the measured inputs and every prediction."""
        assert m.network is not None
        chosen = found.candidates[index]
        measured = measured_record(
            step_s=step_s,
            how=point.how(spread, floor_steps, self.policy.second_step_margin),
            compute_s=found.compute_s,
            local_s=local_s,
            profile=found.profile,
            network=m.network,
            codec=m.codec,
            codecs=m.codecs,
            codec_deferred=m.codec_deferred,
            overlap=m.overlap,
            candidates=found.candidates,
        )
        measured.update(decide_s=time.perf_counter() - m.started, network_s=m.network_s, fixed_probe_s=m.probe_s)
        return {
            "algorithm": chosen.algorithm,
            "options": dict(chosen.options),
            "label": chosen.label,
            "why": why,
            "step": self._measured,
            "workers": self.world_size,
            "measured": measured,
            "predictions": [
                {"label": p.label, "step_s": p.step_s, "bytes_per_step": p.bytes_per_step} for p in found.predictions
            ],
        }
