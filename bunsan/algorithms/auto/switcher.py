"""``Auto``: exact SGD while measuring, then every rank switches to the algorithm predicted fastest.

Auto is a state machine over the algorithms' public lifecycle (:class:`~bunsan.algorithms.base.Observer`,
:meth:`~bunsan.algorithms.base.Algorithm.hand_over`); the wrapped algorithm (``inner``) does the work::

    MEASURING --decision--> DECIDED | TIMING | TRIAL
    TIMING --block check--> DECIDED          (bunsan.algorithms.auto.blocks)
    TRIAL  --verdict------> DECIDED          (kept, or back to exact)

In ``MEASURING`` the inner algorithm is exact :class:`~bunsan.algorithms.data_parallel.DataParallelSGD`
and every step is timed end to end, with this rank's wait in the exchange apart (its compute outside
the exchange). A decision point (:mod:`bunsan.algorithms.auto.deciding`) comes, on every rank at the
same step:

* at the end of the first step's backward, before its exchange (the observer holds it): the first
  step's time is an upper bound of the compute, and where it settles a block algorithm the exchange is
  never sent and the backward's gradients become the decided algorithm's first local step; the second
  step likewise, its time taken at ``second_step_margin`` times as a bound;
* after ``min_timed`` timed steps, deciding only where the choice is the same at their fastest and
  slowest (the span check);
* once the slowest rank's timed steps add up to ``measure_budget_s`` (after ``min_timed``, or
  ``min_agreeing`` that agree within ``min_gain``), or after ``measure_steps``.

Every decision is a record (:mod:`bunsan.algorithms.auto.record`) kept in ``state_dict()``; loading it
builds the decided algorithm directly, unless asked to decide again (``on_resume="decide"``) or the
state was saved by a job of another number of ranks. Every rank must take at least ``measure_steps + 1``
steps: a rank that has already joined does not take part in a decision.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan import comm
from bunsan._validate import check_choice, check_int, check_number, check_type
from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.auto import measuring
from bunsan.algorithms.auto.blocks import BlockTiming, Phase
from bunsan.algorithms.auto.deciding import Deciding, Point
from bunsan.algorithms.auto.decision import RISKS
from bunsan.algorithms.auto.measuring import Measured
from bunsan.algorithms.auto.policy import DEFAULT_POLICY, AutoPolicy
from bunsan.algorithms.auto.record import record_line
from bunsan.algorithms.base import Algorithm, Observer
from bunsan.algorithms.block_momentum import BlockMomentumSGD
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.algorithms.data_parallel.stripes import coded_per_bucket
from bunsan.algorithms.measure import synchronize
from bunsan.algorithms.model_averaging import ModelAveragingSGD
from bunsan.compression import Quantizer
from bunsan.errors import CheckpointError

__all__ = ["CHOICES", "Auto", "Phase"]

ON_RESUME = ("keep", "decide")  # Auto(on_resume=...): keep a saved decision, or measure and decide again
# What a decision may build, by registry name. Imported directly, not through the registry in
# bunsan.algorithms, which imports this module (no import cycle).
CHOICES: dict[str, type[Algorithm]] = {cls.name: cls for cls in (DataParallelSGD, BlockMomentumSGD, ModelAveragingSGD)}


def _delegated(name: str) -> Any:
    """A property that reads and writes ``self.inner.<name>``: the counters live in the inner algorithm."""

    def fget(self: Auto) -> Any:
        return getattr(self.inner, name)

    def fset(self: Auto, value: Any) -> None:
        setattr(self.inner, name, value)

    return property(fget, fset)


class Auto(Deciding, BlockTiming, Observer, Algorithm):
    """Exact SGD while measuring, then the algorithm the cost model predicts fastest, on every rank.

    Args:
        measure_steps: exact steps timed before deciding (the first is not timed).
        measure_budget_s: decide sooner, once the slowest rank's timed steps add up to this
            many seconds (after at least 3 timed steps, or 2 that agree within ``min_gain``), or
            after 3 where the choice is the same at their fastest and slowest;
            ``None`` always takes ``measure_steps``.
        risk: which candidates are allowed: ``"low"`` exact and fp16 traffic; ``"medium"``
            (default) also 8- and 2-bit quantized gradients with error feedback; ``"high"`` also
            1 bit, block momentum and model averaging (docs/how-to/choose-algorithm.md).
        min_gain: a candidate replaces exact SGD only when predicted at least this much faster.
        warm_start: samples (global) trained exactly before compression or blocks start, counted
            from the beginning of training; the measuring steps count towards it.
        network: a known :class:`~bunsan.algorithms.cost_model.Network` instead of measuring it.
        fixed_costs: measure every candidate's fixed cost per step on a tiny model first
            (:func:`bunsan.algorithms.measure.measure_fixed_costs`, collective: a few tenths
            of a second), only those that can change the decision
            (:func:`~bunsan.algorithms.auto.probes_needed`); ``False`` counts exact's
            fixed cost in every candidate's compute instead.
        verbose: rank 0 prints the decision table.
        on_resume: what loading a saved state does with its decision. ``"keep"`` (default): the
            resumed run builds the saved choice without measuring again, unless the state was saved
            by a job of another number of ranks, whose network and worker count the decision was
            predicted for: then it measures and decides again (with a warning naming the old
            choice). ``"decide"``: measure and decide again in any case (a job moved to another
            cluster, or a resume that should re-check); the counters (steps, samples) go on.
        record: a file to which rank 0 appends every record (the decision, the block check, a trial's
            verdict: :attr:`records`) as one JSON line; ``bunsan plan --job FILE`` replays the last.
        policy: the tuned numbers of the rules (:class:`~bunsan.algorithms.auto.AutoPolicy`; each
            names the docs section that justifies it); the default is bunsan's.
        group: process group; ``None`` means every rank of the job.
    """

    name = "auto"

    def __init__(
        self,
        *,
        measure_steps: int = 10,
        measure_budget_s: float | None = 0.1,
        risk: str = "medium",
        min_gain: float = 0.1,
        warm_start: int = 0,
        network: cm.Network | None = None,
        fixed_costs: bool = True,
        verbose: bool = True,
        on_resume: str = "keep",
        record: str | os.PathLike[str] | None = None,
        policy: AutoPolicy | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        self.inner: Algorithm = DataParallelSGD(group=group)
        super().__init__(group=group)
        self.inner.observer = self
        self.measure_steps: int = check_int(
            "measure_steps", measure_steps, minimum=2, hint="exact steps timed before deciding"
        )
        if measure_budget_s is not None:
            measure_budget_s = check_number(
                "measure_budget_s", measure_budget_s, minimum=0.0, hint="seconds of timed steps, or None"
            )
        self.measure_budget_s: float | None = measure_budget_s
        self.risk: str = check_choice("risk", risk, RISKS)
        self.min_gain: float = check_number("min_gain", min_gain, minimum=0.0, hint="0.1 asks for 10% faster")
        self.warm_start: int = check_int("warm_start", warm_start, minimum=0, hint="global samples")
        if network is not None:
            check_type("network", network, cm.Network, hint="or None to measure it")
        self.network = network
        self.fixed_costs = check_type("fixed_costs", fixed_costs, bool)
        self.verbose = verbose
        self.on_resume: str = check_choice("on_resume", on_resume, ON_RESUME)
        self.policy: AutoPolicy = check_type("policy", policy if policy is not None else DEFAULT_POLICY, AutoPolicy)
        if record is not None:
            check_type("record", record, (str, os.PathLike), hint="a file path, or None")
        self.record = record
        self.decision: dict[str, Any] | None = None
        # the decision after each transition (its "event": decision, block_check, trial), in order (record.py)
        self.records: list[dict[str, Any]] = []
        self.phase = Phase.MEASURING
        self._reset_measuring()
        self._started: float | None = None  # perf_counter when distribute() attached the optimizer (step 0's start)
        self._holding = False  # the coming exchange waits for before_exchange (the first and second step)
        self._first_checked = False  # the first step was weighed at the end of its backward
        # the TIMING and TRIAL phases (blocks.py): the first block's local steps, the report, the last round
        self._block_steps_s: list[float] = []
        self._report: list[float] | None = None
        self._round_s = 0.0

    def _reset_measuring(self) -> None:
        self._durations: list[float] = []  # seconds of timed steps, end to end, this rank
        self._locals: list[float] = []  # the same steps less this rank's wait in their exchange (its compute)
        self._waited = 0.0  # seconds this rank spent completing the current step's exchange
        self._measured = 0  # steps completed while measuring (kept across a resume)
        self._last_end: float | None = None  # perf_counter at the end of the last step, this process
        self._early: Measured | None = None  # what a decision point measured without deciding, for the next

    # -- the counters live in the inner algorithm ---------------------------------------------------
    step = _delegated("step")
    samples = _delegated("samples")
    local_samples = _delegated("local_samples")
    traffic = _delegated("traffic")
    buffer_sync = _delegated("buffer_sync")

    def __getattr__(self, name: str) -> Any:  # public attributes of the chosen algorithm (bits, block_size, ...)
        if name.startswith("_") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    @property
    def measured_steps(self) -> int:
        """Steps completed while measuring (the step a decision is taken at)."""
        return self._measured

    # -- delegation ----------------------------------------------------------------------------------
    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        self.named_params = list(named_params)
        self.inner.setup(named_params)

    def setup_buffers(self, modules: Sequence[tuple[str, Any, list[str]]]) -> None:
        self._buffer_modules = list(modules)
        self.inner.setup_buffers(modules)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.inner.attach_optimizer(optimizer)
        # the first step is weighed at the end of its backward (a user's warm start asks for exact steps first)
        self._holding = self.measure_budget_s is not None and self.warm_start == 0 and self.world_size > 1
        self._started = time.perf_counter()  # distribute()'s last act: the first step starts after it

    def count_samples(self, n: int) -> None:
        self.inner.count_samples(n)

    def note_forward(self, n: int) -> None:
        self.inner.note_forward(n)

    def confirm_forward(self, n: int) -> None:
        self.inner.confirm_forward(n)

    def reduce_gradients(self) -> None:
        inner = self.inner
        inner.reduce_gradients()
        if self.inner is not inner:  # replaced at its first exchange, which ran here (no backward reached it)
            self.inner.reduce_gradients()

    def complete_exchange(self) -> None:
        self.inner.complete_exchange()

    def join(self) -> None:
        self.inner.join()

    def sync_replicas(self) -> None:
        self.inner.sync_replicas()

    def begin_accumulation(self) -> None:
        self.inner.begin_accumulation()

    def end_accumulation(self) -> None:
        self.inner.end_accumulation()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    # -- Observer: the exact algorithm's exchange ------------------------------------------------------
    def holds_exchange(self) -> bool:
        return self._holding and self.phase is Phase.MEASURING

    def before_exchange(self) -> bool:
        self._holding = False
        return self._before_exchange_check()

    def after_exchange(self, seconds: float) -> None:
        self._holding = False  # an exchange that ran without before_exchange drops the hold
        self._waited += seconds

    # -- MEASURING -------------------------------------------------------------------------------------
    def after_step(self) -> None:
        if self.phase in (Phase.TIMING, Phase.TRIAL):
            self._time_block_step()
            return
        self.inner.after_step()
        if self.phase is not Phase.MEASURING:
            return
        synchronize(self._device())  # on a GPU: the step's kernels and exchange, not their launches
        now = time.perf_counter()
        waited, self._waited = self._waited, 0.0
        if self._last_end is not None:
            self._durations.append(now - self._last_end)
            self._locals.append(max(0.0, now - self._last_end - waited))
        self._last_end = now
        first = self._measured == 0 and self._started is not None  # step 0 of a fresh run
        self._measured += 1
        # The same count on every rank: after measure_steps + 1 steps (counted from the start of training),
        # or sooner where the timed steps are slow enough (_budget_spent), or after min_timed of them where
        # the choice is the same at their fastest and slowest, or right after a first step that settles it.
        if (self._measured > self.measure_steps and self._durations) or self._budget_spent():
            self._decide()
        elif (
            self.measure_budget_s is not None and len(self._durations) == self.policy.min_timed and self.world_size > 1
        ):
            self._decide(Point(span=True))
        elif first and (first_s := self._first_step_s(now)) is not None:
            self._decide(Point(first_step_s=first_s))
        if first and self.phase is Phase.MEASURING and self._first_checked and self._early is not None:
            # the same on every rank: the first step's check measured the network and left the choice open
            self._holding = self.policy.second_step_check
        if self.phase in (Phase.MEASURING, Phase.TIMING, Phase.TRIAL):
            self._last_end = time.perf_counter()  # the decision point's collectives not counted in the next step

    def _before_exchange_check(self) -> bool:
        """Every rank, at the end of the first (or second) backward of a fresh run, before its exchange: a
        decision point at the step's time so far (the slowest rank's; an upper bound of the compute for the
        first step, ``second_step_margin`` times the second's). Where it decides, the decided algorithm
        takes this backward's gradients as its first local step and the exact exchange is never sent;
        otherwise this measuring is left out of the step's time. True where the algorithm was replaced."""
        step = self._measured
        if self.phase is not Phase.MEASURING or self._started is None or self.world_size < 2 or step > 1:
            return False
        if step == 1 and (self._early is None or self._last_end is None):
            return False
        self._first_checked = True
        synchronize(self._device())
        began = time.perf_counter()
        since = self._started if step == 0 else self._last_end
        assert since is not None
        seconds = measuring.slowest([began - since], self.group)[0]
        if step == 0:
            self._decide(Point(first_step_s=seconds, before_exchange=True))
        else:
            margin = self.policy.second_step_margin
            self._decide(Point(first_step_s=margin * seconds, before_exchange=True, second_step_s=seconds))
        if self.phase is not Phase.MEASURING:
            return True
        if step == 0:  # the step's time leaves this measuring out
            self._started += time.perf_counter() - began
        else:
            self._last_end = since + (time.perf_counter() - began)
        return False

    def _first_step_s(self, now: float) -> float | None:
        """Collective: the slowest rank's first step, from distribute() on, where it was not weighed at the
        end of its backward already; else ``None`` (the same on every rank, without a collective)."""
        if self.measure_budget_s is None or self._started is None or self.world_size < 2 or self._first_checked:
            return None
        return measuring.slowest([now - self._started], self.group)[0]

    def _budget_spent(self) -> bool:
        """Whether the slowest rank's timed steps add up to ``measure_budget_s`` (collective from the
        ``min_agreeing``-th timed step on: every rank has timed as many steps, and all stop together). At
        ``min_agreeing`` steps only if the slowest rank's time of each agrees within ``min_gain``; from
        ``min_timed`` on, their median rejects one outlier."""
        count, policy = len(self._durations), self.policy
        if self.measure_budget_s is None or count < policy.min_agreeing:
            return False
        figures = measuring.slowest([sum(self._durations), *self._durations[: policy.min_agreeing]], self.group)
        spent, first = figures[0], figures[1:]
        spread = max(first) / max(min(first), 1e-12) if count < policy.min_timed else 1.0
        return spent >= self.measure_budget_s and spread <= 1 + self.min_gain

    # -- what the decision reads of the job -----------------------------------------------------------
    def _device(self) -> torch.device:
        """Where the model's parameters are: where its steps, its exchange and its codec run."""
        return self.named_params[0][1].device if self.named_params else torch.device("cpu")

    def _momentum(self) -> float:
        groups = self.optimizer.param_groups if isinstance(self.optimizer, torch.optim.SGD) else []
        return max((float(g.get("momentum", 0.0)) for g in groups), default=0.0)

    def _profile(self, compute_s: float) -> cm.Profile:
        params = [p for _, p in self.named_params]
        batch = max(1, round(self.inner.local_samples / max(self.inner.step + 1, 1)))
        numel = sum(p.numel() for p in params)
        return cm.Profile(
            compute_s=compute_s,
            params=numel,
            batch=batch,
            # the gradients' bytes per dtype: every exchange travels in the parameters' own dtypes
            bytes_per_element=sum(p.numel() * p.element_size() for p in params) / numel if numel else 4,
            tensors=len(params),
            chunks=sum(-(-p.numel() // cm.DEFAULT_CHUNK_SIZE) for p in params),
            codec_per_bucket=coded_per_bucket(Quantizer(1), self._device()),
        )

    # -- transitions -----------------------------------------------------------------------------------
    def apply_decision(self, decision: dict[str, Any], *, mid_step: bool = False) -> None:
        """Every rank, at the same step: leave ``MEASURING`` for ``decision`` (a record of
        :mod:`bunsan.algorithms.auto.record`, or a hand-made ``{"algorithm", "options", "label", "step"}``),
        building the decided algorithm with the counters kept; ``mid_step``: at the end of a backward whose
        exchange has not run (its gradients become the new algorithm's first local step)."""
        self._apply(decision, mid_step=mid_step)
        self._note("decision")

    def _note(self, event: str) -> None:
        """Every rank: the decision as it is now becomes a record; rank 0 appends it to ``record``."""
        assert self.decision is not None
        snapshot = {"event": event, **copy.deepcopy(self.decision)}
        self.records.append(snapshot)
        if self.record is not None and comm.get_rank(self.group) == 0:
            with open(self.record, "a", encoding="utf-8") as file:
                file.write(record_line(snapshot) + "\n")

    def _apply(self, decision: dict[str, Any], *, mid_step: bool = False) -> None:
        self.decision = decision
        exact = decision["algorithm"] == "data_parallel" and not decision["options"]
        inner = self.inner
        if not (exact and isinstance(inner, DataParallelSGD) and inner.bits == 32 and not inner.compression):
            self._build(decision["algorithm"], decision["options"], mid_step=mid_step)
        self._arm_block_timing()

    def _build(
        self, algorithm: str, options: dict[str, Any], *, mid_step: bool = False, average_optimizer_state: bool = False
    ) -> None:
        """Every rank: the inner algorithm becomes ``algorithm(**options)``, by the lifecycle's hand-over."""
        old, new = self.inner, CHOICES[algorithm](group=self.group, **options)
        old.hand_over(new, mid_step=mid_step, average_optimizer_state=average_optimizer_state)
        new.observer = self
        new.setup(self.named_params)
        new.setup_buffers(getattr(self, "_buffer_modules", []))
        if self.optimizer is not None:
            new.attach_optimizer(self.optimizer)
        self.inner = new

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.name,
            "world_size": self.world_size,
            # a copy: a trial's verdict and the block check change the live decision after a checkpoint
            "decision": copy.deepcopy(self.decision),
            "records": copy.deepcopy(self.records),
            "measured_steps": self._measured,
            "durations": list(self._durations),
            "locals": list(self._locals),
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state_is_mine(state)
        saved_size = int(state.get("world_size", self.world_size))
        if self.on_resume == "keep" and saved_size == self.world_size:
            if state["decision"] is not None:
                self._apply(state["decision"])  # the same choice as before, without measuring again
            self.records = copy.deepcopy(state.get("records", self.records))
            self.inner.load_state_dict(state["inner"])
            # An undecided run goes on measuring and decides at the same step as it would have.
            self._measured = int(state.get("measured_steps", 0))
            self._durations = [float(d) for d in state.get("durations", [])]
            self._locals = [float(d) for d in state.get("locals", [])]
            self._last_end = None
            return
        self._decide_again(state, saved_size)

    def _decide_again(self, state: dict[str, Any], saved_size: int) -> None:
        """Measure and decide again from here, with exact SGD, as a fresh Auto does; the counters go on."""
        if saved_size != self.world_size and self.on_resume == "keep":
            what = f"its decision ({state['decision']['label']})" if state["decision"] else "its measuring"
            warnings.warn(
                f"Auto's state was saved by a job of {saved_size} ranks and this job has {self.world_size}: "
                f"{what} was for that job's worker count and network; it measures and decides again",
                stacklevel=3,
            )
        inner = self.inner
        if self.decision is not None or not isinstance(inner, DataParallelSGD) or inner.bits != 32:
            raise CheckpointError(
                "load Auto's state before its first step (into a fresh Auto, as distribute() builds it)"
            )
        saved = state["inner"]
        # a saved exact algorithm's own state (its local momentum, residuals) fits the exact one measuring now
        if saved.get("algorithm") == DataParallelSGD.name and not (state["decision"] or {}).get("options"):
            inner.load_state_dict(saved)
        else:  # another algorithm's state (a block's momentum, a quantized exchange's residuals): only the counters
            inner.step, inner.samples, inner.local_samples = (
                int(saved["step"]),
                int(saved["samples"]),
                int(saved["local_samples"]),
            )
        self._reset_measuring()
        self.phase = Phase.MEASURING

    def __repr__(self) -> str:
        chosen = f", chosen={self.decision['label']!r}" if self.decision else ""
        return f"Auto(risk={self.risk!r}, measure_steps={self.measure_steps}{chosen})"
