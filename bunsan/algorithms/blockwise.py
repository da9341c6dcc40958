"""Local training in blocks, then a filtered average of the block's model changes: the shared machinery.

:class:`BlockwiseSGD` holds the communication of
:class:`bunsan.algorithms.block_momentum.BlockMomentumSGD` and
:class:`bunsan.algorithms.model_averaging.ModelAveragingSGD` (``bm = 0``,
``zeta = 1``); the arithmetic is :mod:`bunsan.algorithms.bmuf`.

Distributed invariants kept here:

* A *round* is one all-reduce per (dtype, device) group of parameters plus one
  float64 all-reduce of ``(block samples, contributes, still active)``. Every
  rank runs the same sequence of rounds: a rank that has joined answers each of
  the others' rounds with zeros until a round reports no active rank.
* The phase (warm start or blocks) is decided from ``samples``, the global
  sample count that every rank learns from the same all-reduces, so the switch
  to block mode happens after the same round on every rank.
* Contributions are divided by the world size before the sum (a half-precision
  sum must not overflow where the mean would not); the average is then rescaled
  to the contributing ranks only, so a joined rank's stale model adds nothing.
* ``W``, ``D`` and ``W_start`` are updated from all-reduced values only, so they
  stay identical on every rank, joined ranks included, and every round leaves
  every replica at ``W_start``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_int, check_type
from bunsan.algorithms.base import Algorithm, RoundReport
from bunsan.algorithms.bmuf import reset_momentum_buffers, update_block_start_, update_global_model_
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.comm import all_reduce, broadcast_tensors, get_rank, global_rank, wait
from bunsan.comm.layout import FlatGroup, group_by_kind
from bunsan.errors import CheckpointError

__all__ = ["BlockwiseSGD"]


def _empty() -> Tensor:
    return torch.empty(0)


@dataclass
class _Flat(FlatGroup):
    """The parameters of one (dtype, device) and their block state as flat tensors."""

    # Empty until blocks begin (_begin_blocks), except ``buffer``.
    buffer: Tensor = field(default_factory=_empty)  # what travels: the block's model change
    global_model: Tensor = field(default_factory=_empty)  # W
    momentum: Tensor = field(default_factory=_empty)  # D
    start: Tensor = field(default_factory=_empty)  # W_start: the model the current block started from


def _group_params(named_params: Sequence[tuple[str, Tensor]]) -> list[_Flat]:
    flats = []
    for members in group_by_kind(named_params):  # one order on every rank: the all-reduces match
        flat = _Flat(**FlatGroup.fields_of(members))
        flat.buffer = flat.zeros()
        flats.append(flat)
    return flats


class BlockwiseSGD(Algorithm):
    """Local training in blocks, then a filtered average of the block's model changes. Shared machinery.

    Subclasses choose the filter (:meth:`filter_coefficients`): block momentum for
    :class:`BlockMomentumSGD`, ``bm = 0, zeta = 1`` for model averaging. See the
    module docstring for the equations, units and invariants.

    Phases of training, on every rank alike:

    1. *Warm start* (while ``samples < warm_start``, global count): exact
       synchronous SGD by an inner ``DataParallelSGD()``: gradients averaged over
       the ranks still training, the exchange completed before ``backward()``
       returns and overlapped with it, unused parameters and buffers handled alike.
    2. *Blocks*: the model at the switch is ``W`` (with ``D = 0``); every worker
       trains locally and synchronizes once it has trained ``block_size``
       samples since its last synchronization.
    3. *End*: :meth:`join` finishes the last partial block and answers the other
       ranks' rounds until all have joined; then every replica holds the same model.

    Between ``backward()`` and ``step()`` during blocks, ``p.grad`` is this
    worker's own gradient: clipping, ``GradScaler`` and gradient edits act on the
    local step, as the local optimizer does (the model change, not the gradient,
    is what the block averages). Buffers (BatchNorm statistics) are averaged at
    every block synchronization.

    ``samples`` (the global count) grows at every exchange: every step during the
    warm start, at every synchronization afterwards; ``local_samples`` every step.
    ``stats()["blocks"]`` counts the synchronizations that applied an update.

    Args:
        block_size: samples per worker in one block.
        nesterov: start the next block from ``W + bm * D`` instead of ``W``.
        reset_local_momentum: drop the local optimizer's momentum buffers after
            each synchronization (needs :meth:`attach_optimizer`, which
            :func:`bunsan.distribute` calls).
        warm_start: samples, all workers together, of exact gradient averaging first.
        group: process group; ``None`` means every rank.
    """

    def __init__(
        self,
        block_size: int,
        *,
        nesterov: bool,
        reset_local_momentum: bool,
        warm_start: int = 0,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(group=group)
        self.block_size: int = check_int(
            "block_size",
            block_size,
            minimum=1,
            hint="samples per worker; e.g. block_size=8 * batch_size synchronizes every 8 minibatches",
        )
        self.warm_start: int = check_int(
            "warm_start", warm_start, minimum=0, hint="samples, all workers together; 0 starts block training at once"
        )
        self.nesterov = bool(nesterov)
        self.reset_local_momentum = bool(reset_local_momentum)
        self.optimizer: torch.optim.Optimizer | None = getattr(self, "optimizer", None)  # set by attach_optimizer()
        self.block_samples = 0  # local samples trained in the current block
        self.block_steps = 0  # local steps in the current block
        self.blocks = 0  # block synchronizations that applied an update
        self._flats: list[_Flat] = []
        self._warm: DataParallelSGD | None = None  # the exact exchange of the warm start
        self._warm_seen = (0, 0)  # (samples, local_samples) of the warm engine already counted here
        self._blocks_started = False
        self._ended_warm_start = False  # this step's round was the last of the warm start
        self._fresh = True  # this rank's model is the others' (False: joined and missed warm steps)
        self._checked_first_step = False

    # -- the filter, chosen by subclasses -----------------------------------------
    def filter_coefficients(self, samples_per_worker: float) -> tuple[float, float]:
        """``(bm, zeta)`` for a block that held ``samples_per_worker`` samples per worker."""
        raise NotImplementedError

    @property
    def lookahead_momentum(self) -> float:
        """The ``bm`` of the Nesterov look-ahead ``W + bm * D`` (0 without momentum)."""
        return 0.0

    # -- set-up -----------------------------------------------------------------
    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        super().setup(named_params)
        self._flats = _group_params(self.named_params)
        self._blocks_started = False
        if self._warm is not None:
            self._warm.remove_hooks()
            self._warm = None
        if self.in_warm_start:
            self._warm = DataParallelSGD(group=self.group)
            self._warm.traffic = self.traffic
            self._warm.setup(self.named_params)
            if self.buffer_sync is not None:
                self._warm.setup_buffers(self.buffer_sync.modules)
            self._sync_warm_counts()

    def setup_buffers(self, modules: Sequence[tuple[str, Any, list[str]]]) -> None:
        super().setup_buffers(modules)
        if self._warm is not None:
            self._warm.setup_buffers(modules)

    def count_samples(self, n: int) -> None:
        if self._warm is not None:
            self._warm.count_samples(n)  # the warm exchange reports them
        else:
            super().count_samples(n)

    def begin_accumulation(self) -> None:
        if self._warm is not None:
            self._warm.begin_accumulation()

    def end_accumulation(self) -> None:
        if self._warm is not None:
            self._warm.end_accumulation()

    def _sync_warm_counts(self) -> None:
        """Start the warm engine's counters from this algorithm's."""
        assert self._warm is not None
        self._warm.samples, self._warm.local_samples = self.samples, self.local_samples
        self._warm_seen = (self.samples, self.local_samples)

    def _take_warm_counts(self) -> int:
        """Add what the warm engine counted since last time; return the local samples among it."""
        assert self._warm is not None
        samples, local = self._warm.samples, self._warm.local_samples
        new_local = local - self._warm_seen[1]
        self.samples += samples - self._warm_seen[0]
        self.local_samples += new_local
        self._warm_seen = (samples, local)
        return new_local

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called by :func:`bunsan.distribute` with the user's optimizer, whose momentum is reset after syncs."""
        self.optimizer = check_type("optimizer", optimizer, torch.optim.Optimizer, hint="torch.optim.Optimizer")

    @property
    def in_warm_start(self) -> bool:
        """Whether the next step is still exact gradient averaging (same answer on every rank)."""
        return self.samples < self.warm_start

    # -- collective hooks -----------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Collective. Warm start: the gradients were averaged in backward. Blocks: count the step's samples."""
        if self.in_warm_start:
            assert self._warm is not None
            self._warm.reduce_gradients()  # completes the exchange if no backward did
            n = self._take_warm_counts()
            if not self._checked_first_step:
                self._check_first_step(n)
            # The global count just grew identically on every rank: so does this decision.
            self._ended_warm_start = not self.in_warm_start
            return
        n = self._take_local_samples()
        if not self._checked_first_step:
            self._check_first_step(n)
        if not self._blocks_started:
            self._begin_blocks()  # warm_start=0: the block starts from the broadcast model
        self.block_samples += n
        self.block_steps += 1

    def complete_exchange(self) -> None:
        if self.in_warm_start and self._warm is not None:
            self._warm.complete_exchange()

    def after_step(self) -> None:
        """Collective. Switch to blocks after the warm start; synchronize at the end of a block."""
        if self._ended_warm_start:
            # After optimizer.step(): W is the model the last exact step produced.
            self._ended_warm_start = False
            self._end_warm_start()
            return
        if self._blocks_started and self.block_samples >= self.block_size:
            self._block_round(contribute=True, still_active=True)

    def join(self) -> None:
        """Collective. This rank has no more data: finish its block, answer the others' rounds until all join.

        When it returns on every rank, every replica holds the same model.
        """
        # 1. Warm start: mirror the active ranks' gradient all-reduces with zeros.
        while self.in_warm_start:
            assert self._warm is not None
            active = self._warm._exchange(active=False)
            self._warm._exchanged = False
            self._take_warm_counts()
            if active > 0:
                self._fresh = False  # the active ranks take a step this rank does not
            if active == 0:
                # Every rank has joined during the warm start; ranks that joined early
                # missed the last exact steps and take the model of one that did not.
                self._equalize()
                return
            if not self.in_warm_start:
                self._end_warm_start()  # the active ranks do the same in after_step()
        # 2. Blocks: contribute the partial block once, then weight 0 until nobody is active.
        if not self._blocks_started:
            self._begin_blocks()
        contribute = self.block_steps > 0
        while self._block_round(contribute=contribute, still_active=False) > 0:
            contribute = False

    def sync_replicas(self) -> None:
        """Collective. Finish the current partial block now: every active replica gets ``W_start``.

        During the warm start the replicas are already equal and nothing is sent.
        """
        if self.in_warm_start:
            return
        if not self._blocks_started:
            self._begin_blocks()
        # a round between steps (an evaluation's copy, bunsan.bench's curves) carries no report and acts
        # on none: what it changes is put back, and a report must not be spent there
        self._block_round(contribute=self.block_steps > 0, still_active=True, report=False)

    # -- rounds -----------------------------------------------------------------
    def _meta(self, samples: int, contributes: bool, still_active: bool, report: bool, width: int) -> Tensor:
        device = self._flats[0].buffer.device if self._flats else "cpu"
        changed = []
        if self.buffer_sync is not None:
            changed = self.buffer_sync.changed() if contributes else [0.0] * len(self.buffer_sync)
        # float64: sample counts stay exact up to 2**53.
        # The observer's report rides on the count all-reduce (Auto times its first blocks with it): zeros
        # from a rank with nothing to report or that does not contribute, and a flag first, summed: the
        # round acts on the report only where it is n (no rank made its round from sync_replicas(), whose
        # rounds between steps carry zeros; a joined rank's round may meet the others' sync).
        reported: list[float] = []
        if width:
            mine = self.observer.report_values() if self.observer is not None and report and contributes else None
            reported = [float(v) for v in mine] if mine is not None else [0.0] * width
            if len(reported) != width:
                raise ValueError(f"the observer reported {len(reported)} values; its report_width is {width}")
            reported.insert(0, 1.0 if report else 0.0)
        values = [float(samples), float(contributes), float(still_active), *changed, *reported]
        return torch.tensor(values, dtype=torch.float64, device=device)

    def _exchange(self, meta: Tensor, what: str) -> tuple[int, int, int, list[float]]:
        """All-reduce every flat buffer and ``meta`` (in this order on every rank); return ``meta``'s sums."""
        works = [all_reduce(f.buffer, group=self.group, async_op=True, traffic=self.traffic) for f in self._flats]
        meta_work = all_reduce(meta, group=self.group, async_op=True, traffic=self.traffic)
        for work in works:
            wait(work, what)
        wait(meta_work, "sample count all-reduce")
        sums = meta.tolist()
        total, contributors, active = (int(v) for v in sums[:3])
        self.samples += total
        return total, contributors, active, sums[3:]

    @torch.no_grad()
    def _block_round(self, *, contribute: bool, still_active: bool, report: bool = True) -> int:
        """One block synchronization; returns the number of ranks still training after it. ``report=False``:
        this rank sends zeros in the report's place, and no rank acts on this round's report."""
        n = self.world_size
        began = time.perf_counter()
        # 1. Every rank sends its block's model change (or zeros) and its counts.
        for f in self._flats:
            if contribute:
                f.pack(f.buffer)
                f.buffer.sub_(f.start).div_(n)  # w_i - W_start, divided before the sum
            else:
                f.buffer.zero_()
        samples = self.block_samples if contribute else 0
        # the same on every rank
        width = self.observer.report_width() if self.observer is not None else 0
        extra = width + 1 if width else 0  # the acting flag, then the report
        total, contributors, active, changed = self._exchange(
            self._meta(samples, contribute, still_active, report, width), "block all-reduce"
        )
        extras = changed[len(changed) - extra :] if extra else []
        changed = changed[: len(changed) - extra]
        # 2. Filter the average change of the contributing ranks into W and D (identical on all ranks).
        if contributors > 0:
            per_worker = total / contributors if total > 0 else float(self.block_size)
            bm, gain = self.filter_coefficients(per_worker)
            for f in self._flats:
                if contributors != n:
                    f.buffer.mul_(n / contributors)
                update_global_model_(f.global_model, f.momentum, f.buffer, bm, gain)
                update_block_start_(f.start, f.global_model, f.momentum, self.lookahead_momentum, self.nesterov)
            self.blocks += 1
        # 3. Every replica, joined ones included, starts over from W_start, with the mean buffers.
        for f in self._flats:
            f.unpack(f.start)
        if self.buffer_sync is not None:
            self.buffer_sync.average(changed, contribute=contribute, contributors=contributors)
        self.block_samples = self.block_steps = 0
        if contributors > 0 and self.reset_local_momentum and self.optimizer is not None:
            reset_momentum_buffers(self.optimizer)
        if self.observer is not None:  # may change block_size and the report itself, alike on every rank
            acting = bool(extras) and extras[0] == n  # no rank's round was a sync_replicas()
            sums = tuple(extras[1:]) if acting else None
            self.observer.after_round(RoundReport(time.perf_counter() - began, active, sums))
        return active

    def _end_warm_start(self) -> None:
        """Collective. Make every replica equal, then start block 1 from the current model."""
        if self._warm is not None:
            self._take_warm_counts()
            self._pending_samples += self._warm._pending_samples  # counted after the last warm exchange
            self._warm.remove_hooks()
            self._warm = None
        self._equalize()
        self._begin_blocks()

    @torch.no_grad()
    def _equalize(self) -> None:
        """Collective. Ranks that joined and missed exact steps take the model of the lowest up-to-date rank."""
        n = self.world_size
        device = self._flats[0].buffer.device if self._flats else "cpu"
        mine = [float(get_rank(self.group) if self._fresh else n), 1.0 if self._fresh else 0.0]
        flags = torch.tensor(mine, dtype=torch.float64, device=device)
        all_reduce(flags, op="min", group=self.group, traffic=self.traffic)
        if flags[1].item() == 0.0:  # someone is stale; the decision is the same on every rank
            src = int(flags[0].item())  # < n: the ranks of the last exact step are up to date
            broadcast_tensors(self.params, src=global_rank(self.group, src), group=self.group, traffic=self.traffic)
        self._fresh = True

    @torch.no_grad()
    def _begin_blocks(self) -> None:
        """Local. ``W = W_start =`` the current model, ``D = 0``, an empty block."""
        for f in self._flats:
            f.pack(f.buffer)
            f.global_model = f.buffer.clone()
            f.start = f.buffer.clone()
            f.momentum = torch.zeros_like(f.buffer)
        self.block_samples = self.block_steps = 0
        self._blocks_started = True

    def _check_first_step(self, n: int) -> None:
        self._checked_first_step = True
        if self.reset_local_momentum and self.optimizer is None:
            # Raised on every rank alike, before any collective of this step.
            raise RuntimeError(
                f"{type(self).__name__}(reset_local_momentum=True) needs the local optimizer: build it with "
                "bunsan.distribute(model, optimizer, algorithm), or call algorithm.attach_optimizer(optimizer)"
            )
        if n == 0:
            warnings.warn(
                "no training samples were counted in this step, but blocks end after block_size samples: "
                "use bunsan.distribute() (it counts the model's inputs) or call algorithm.count_samples(n)",
                stacklevel=3,
            )
        elif self.block_size % n:
            steps = -(-self.block_size // n)  # a block ends at the first step that reaches block_size
            exact = f"block_size={steps * n}" + (f" or {(steps - 1) * n}" if steps > 1 else "")
            warnings.warn(
                f"block_size={self.block_size} is not a multiple of this worker's minibatch of {n} samples: "
                f"a block ends after {steps} minibatches ({steps * n} samples) and its block momentum is "
                f"scaled to that size; choose {exact} to make it exact",
                stacklevel=3,
            )

    # -- measurement and state ------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """The base counters and ``blocks``, the block synchronizations completed."""
        out = super().stats()
        out["blocks"] = self.blocks
        return out

    def _named_flat(self, attr: str) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for f in self._flats:
            out.update(f.named(getattr(f, attr)))
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the counts, and ``W``, ``D`` and ``W_start`` by parameter name once blocks began."""
        state = super().state_dict()
        state.update(
            block_size=self.block_size,
            warm_start=self.warm_start,
            block_samples=self.block_samples,
            block_steps=self.block_steps,
            blocks=self.blocks,
            blocks_started=self._blocks_started,
        )
        if self._blocks_started:
            state.update(
                global_model=self._named_flat("global_model"),
                block_momentum_buffer=self._named_flat("momentum"),
                block_start=self._named_flat("start"),
            )
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.block_samples = int(state["block_samples"])
        self.block_steps = int(state["block_steps"])
        self.blocks = int(state["blocks"])
        self._ended_warm_start = False
        self._fresh = True
        if self._warm is not None:
            if self.in_warm_start:
                self._sync_warm_counts()
            else:
                self._warm.remove_hooks()
                self._warm = None
        if not state["blocks_started"]:
            self._blocks_started = False
            return
        if not self._flats:
            raise CheckpointError("load the algorithm's state after bunsan.distribute() has set it up")
        for f in self._flats:
            for attr, key in (
                ("global_model", "global_model"),
                ("momentum", "block_momentum_buffer"),
                ("start", "block_start"),
            ):
                flat = torch.zeros_like(f.buffer)
                f.load_named(flat, state[key], key)
                setattr(f, attr, flat)
        self._blocks_started = True
