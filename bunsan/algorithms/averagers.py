"""Model averaging and block momentum (BMUF) for plain DDP and Lightning: torch's averager call shape.

:class:`ModelAverager` and :class:`BlockMomentumAverager` are called as torch's ``PeriodicModelAverager``
is, ``averager.average_parameters(params)`` after every ``optimizer.step()``; :class:`AveragingOptimizer`
wraps an optimizer as torch's ``PostLocalSGDOptimizer`` does. The arithmetic is that of ``ModelAveragingSGD``
and ``BlockMomentumSGD`` (Chen & Huo 2016; :mod:`bunsan.algorithms.bmuf`), counted in optimizer steps
instead of samples: ``period`` steps per block is ``block_size = period * batch`` samples per worker, and
``warmup_steps`` steps is ``warm_start = warmup_steps * batch * world_size`` samples.

Distributed invariants (those of :mod:`bunsan.algorithms.blockwise`): a *round* is one all-reduce
per (dtype, device) group of parameters plus one float64 all-reduce of ``(block steps, contributes,
still active)``; every rank runs the same rounds (the step count advances alike on every rank, a
skipped GradScaler step is skipped on every rank, and a joined rank answers the others' rounds with
zeros until a round reports no active rank). Contributions are divided by the world size before the
sum, then rescaled to the contributing ranks. ``W``, ``D`` and ``W_start`` come from all-reduced
values only: identical on every rank, and every round leaves every replica at ``W_start``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_int, check_number, check_type
from bunsan.algorithms.blockwise import _Flat  # the same flat block state as BlockMomentumSGD
from bunsan.algorithms.bmuf import (
    block_gain,
    default_block_learning_rate,
    default_block_momentum,
    reset_momentum_buffers,
    scaled_block_momentum,
    update_block_start_,
    update_global_model_,
)
from bunsan.comm import Traffic, all_reduce, get_world_size, wait
from bunsan.comm.layout import FlatGroup, group_by_kind
from bunsan.errors import CheckpointError

__all__ = ["AveragingOptimizer", "BlockMomentumAverager", "ModelAverager"]

_TENSOR_KEYS = (("global_model", "global_model"), ("momentum", "block_momentum_buffer"), ("start", "block_start"))


def _resolve_defaults(world_size: int) -> tuple[float, float]:
    """``(block_momentum, block_learning_rate)`` for ``None``: ``BlockMomentumSGD``'s, ``(1 - 1/N, 1/sqrt(N))``."""
    return default_block_momentum(world_size), default_block_learning_rate(world_size)


def _param_list(params: Any) -> list[Tensor]:
    """The tensors of ``params``: an iterable of tensors or of param-group dicts (``optimizer.param_groups``)."""
    expected = "params must be an iterable of parameters or of param-group dicts (optimizer.param_groups), got"
    if isinstance(params, Tensor) or not isinstance(params, Iterable):
        raise TypeError(f"{expected} {type(params).__name__}")
    out: list[Tensor] = []
    for item in params:
        for p in item.get("params", []) if isinstance(item, dict) else [item]:
            if not isinstance(p, Tensor):
                raise TypeError(f"{expected} an element of type {type(p).__name__}")
            out.append(p)
    if not out:
        raise ValueError("params is empty: pass the model's parameters or the optimizer's param_groups")
    return out


class ModelAverager:
    """Average the replicas' parameters at the end of every ``period`` optimizer steps.

    Called as torch's ``PeriodicModelAverager``: ``average_parameters(params)`` after every
    ``optimizer.step()`` on every rank, with the same tensors in the same order (parameters or
    ``param_groups``). The first ``warmup_steps`` steps are DDP's (``post_localSGD_hook`` with
    ``start_localSGD_iter=warmup_steps``); then every ``period`` local steps the parameters become
    their mean over the ranks: ModelAveragingSGD's arithmetic, ``block_size = period * batch``.
    Torch's averager also averages after the first step past the warm-up; this one first after
    ``period`` local steps (as torch's ``PeriodicModelAverager(period, warmup_steps + period - 1)``).
    Call :meth:`join` on every rank after the loop (uneven data; equal replicas after it).

    Args:
        period: optimizer steps (not samples) per block, ``>= 1``.
        warmup_steps: steps of exact DDP training before the first block.
        process_group: the group to average over; ``None`` means every rank.

    Raises:
        TypeError, ValueError: a wrong type, ``period < 1`` or ``warmup_steps < 0`` (the message names it).
    """

    resets_local_momentum = False  # AveragingOptimizer's default reset_local_momentum
    nesterov = False

    def __init__(self, period: int, warmup_steps: int = 0, process_group: ProcessGroup | None = None) -> None:
        self.period: int = check_int("period", period, minimum=1, hint="optimizer steps between two averages")
        self.warmup_steps: int = check_int(
            "warmup_steps", warmup_steps, minimum=0, hint="steps of exact DDP training; 0 averages from the start"
        )
        if process_group is not None:
            check_type("process_group", process_group, ProcessGroup, hint="or None for every rank")
        self.process_group = process_group
        self.step = 0  # optimizer steps counted (torch's name)
        self.block_steps = 0  # local steps since the current block began
        self.rounds = 0  # rounds that applied an update
        self.traffic = Traffic()  # bytes this rank sent and received in its all-reduces
        self._flats: list[_Flat] = []
        self._params: list[Tensor] = []
        self._started = False  # W, D and W_start are known
        self._pending: dict[str, Any] | None = None  # a loaded state waiting for the parameters
        self._round_callbacks: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(period={self.period}, warmup_steps={self.warmup_steps})"

    # -- the filter ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return get_world_size(self.process_group)

    def filter_coefficients(self, steps_per_worker: float) -> tuple[float, float]:
        """``(bm, zeta)`` for a block of ``steps_per_worker`` steps: no filter, the plain average."""
        return 0.0, 1.0

    @property
    def lookahead_momentum(self) -> float:
        return 0.0

    # -- the calls of a training loop ----------------------------------------------------
    @torch.no_grad()
    def begin(self, params: Any) -> None:
        """Local. Record the model the first block starts from, before the first local step (needed with
        ``warmup_steps=0``; :class:`AveragingOptimizer` calls it). Without it the first block's start is
        unknown and its round is a plain average; block momentum applies from the second block."""
        self._bind(params)
        if not self._started and self.step >= self.warmup_steps:
            self._begin_blocks()

    @torch.no_grad()
    def average_parameters(self, params: Any) -> bool:
        """Count one optimizer step; at the end of a block, average (collective then, on every rank).
        Returns whether a round ran (torch's averager returns None; Lightning ignores the value)."""
        self.step += 1
        if self.step < self.warmup_steps:
            return False
        if self.step == self.warmup_steps:  # the last exact step: blocks begin from one model
            self._bind(params)
            self._equalize()
            self._begin_blocks()
            return False
        self.block_steps += 1
        if self.block_steps < self.period:
            return False
        self._bind(params)
        self._round(contribute=True, still_active=True)
        return True

    @torch.no_grad()
    def join(self, params: Any = None) -> None:
        """Collective. This rank has no more data: average its partial block, answer the others' rounds.

        Call it on every rank after its loop: it contributes this rank's partial block once, then
        answers the other ranks' rounds with weight 0 until all have joined; then every replica is the
        same. ``params``: only on a rank that never passed them. Uneven data during the warm-up needs
        DDP's own ``join()``: DDP averages the gradients then.
        """
        if params is not None:
            self._bind(params)
        if not self._flats:
            raise ValueError("join() needs params on a rank that has not passed its parameters yet")
        contribute = self.block_steps > 0
        while self._round(contribute=contribute, still_active=False) > 0:
            contribute = False

    # -- rounds ------------------------------------------------------------------------
    def _bind(self, params: Any) -> None:
        tensors = _param_list(params)
        if not self._params:
            self._params = tensors
            for members in group_by_kind([(str(i), p) for i, p in enumerate(tensors)]):  # one order on every rank
                flat = _Flat(**FlatGroup.fields_of(members))
                flat.buffer = flat.zeros()
                self._flats.append(flat)
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._load_tensors(pending)
            return
        if len(tensors) != len(self._params) or any(a is not b for a, b in zip(tensors, self._params)):
            raise ValueError(
                f"params changed: {len(tensors)} tensors now, {len(self._params)} before; pass the same "
                "parameters, in the same order, at every call (the averager keeps W, D and W_start for them)"
            )

    def _equalize(self) -> None:
        """Collective. Average the replicas if they differ, e.g. DDP's hook, which counts backward passes,
        ended its warm-up before this count did (a GradScaler skipped a warm-up step). Equal replicas stay
        bit for bit (a mean of equal values may round)."""
        for f in self._flats:
            f.pack(f.buffer)
            spread = torch.cat([f.buffer, -f.buffer])
            all_reduce(
                spread, op="max", group=self.process_group, traffic=self.traffic
            )  # max and -min of every element
            if not torch.equal(spread[: f.numel], -spread[f.numel :]):  # the same answer on every rank
                all_reduce(f.buffer.div_(self.world_size), group=self.process_group, traffic=self.traffic)
                f.unpack(f.buffer)

    def _begin_blocks(self) -> None:
        """Local. ``W = W_start =`` the current model, ``D = 0``, an empty block."""
        for f in self._flats:
            f.pack(f.buffer)
            f.global_model, f.start, f.momentum = f.buffer.clone(), f.buffer.clone(), torch.zeros_like(f.buffer)
        self.block_steps = 0
        self._started = True

    def _exchange(self, meta: Tensor) -> tuple[int, int, int]:
        """All-reduce every flat buffer and ``meta`` (in this order on every rank); return ``meta``'s sums."""
        works = [
            all_reduce(f.buffer, group=self.process_group, async_op=True, traffic=self.traffic) for f in self._flats
        ]
        meta_work = all_reduce(meta, group=self.process_group, async_op=True, traffic=self.traffic)
        for work in works:
            wait(work, "model averaging all-reduce")
        wait(meta_work, "model averaging count all-reduce")
        total, contributors, active = (int(v) for v in meta.tolist())
        return total, contributors, active

    def _round(self, *, contribute: bool, still_active: bool) -> int:
        """One block synchronization; returns the number of ranks still training after it."""
        n = self.world_size
        for f in self._flats:  # w_i - W_start (w_i before the first start is known), divided before the sum
            if contribute:
                f.pack(f.buffer)
                if self._started:
                    f.buffer.sub_(f.start)
                f.buffer.div_(n)
            else:
                f.buffer.zero_()
        steps = self.block_steps if contribute else 0
        device = self._flats[0].buffer.device
        meta = torch.tensor([float(steps), float(contribute), float(still_active)], dtype=torch.float64, device=device)
        total, contributors, active = self._exchange(meta)
        if contributors > 0:
            for f in self._flats:
                if contributors != n:
                    f.buffer.mul_(n / contributors)  # the mean over the ranks that trained
            if self._started:
                bm, gain = self.filter_coefficients(total / contributors if total > 0 else float(self.period))
                for f in self._flats:
                    update_global_model_(f.global_model, f.momentum, f.buffer, bm, gain)
                    update_block_start_(f.start, f.global_model, f.momentum, self.lookahead_momentum, self.nesterov)
            else:  # the first block's start was unknown: its round is the plain average
                for f in self._flats:
                    f.global_model, f.start = f.buffer.clone(), f.buffer.clone()
                    f.momentum = torch.zeros_like(f.buffer)
                self._started = True
            self.rounds += 1
        if self._started:
            for f in self._flats:
                f.unpack(f.start)
        self.block_steps = 0
        if contributors > 0:
            for callback in self._round_callbacks:
                callback()
        return active

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counts, and ``W``, ``D`` and ``W_start`` keyed by parameter index once blocks began."""
        state: dict[str, Any] = dict(kind=type(self).__name__, period=self.period, warmup_steps=self.warmup_steps)
        state.update(step=self.step, block_steps=self.block_steps, rounds=self.rounds, started=self._started)
        if self._started:
            for attr, key in _TENSOR_KEYS:
                state[key] = {k: v for f in self._flats for k, v in f.named(getattr(f, attr)).items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; before the first call it waits for the parameters.

        Raises:
            CheckpointError: the state is from another kind of averager or another model.
        """
        check_type("state", state, dict)
        if state.get("kind") != type(self).__name__:
            raise CheckpointError(f"the state is from a {state.get('kind')!r}, not a {type(self).__name__}")
        self.step, self.block_steps, self.rounds = (int(state[k]) for k in ("step", "block_steps", "rounds"))
        self._started = False
        if not state["started"]:
            return
        self._pending = state  # applied now, or by the first call that passes the parameters
        if self._flats:
            self._pending = None
            self._load_tensors(state)

    @torch.no_grad()
    def _load_tensors(self, state: dict[str, Any]) -> None:
        for f in self._flats:
            for attr, key in _TENSOR_KEYS:
                flat = torch.zeros_like(f.buffer)
                f.load_named(flat, state[key], key)
                setattr(f, attr, flat)
        self._started = True


class BlockMomentumAverager(ModelAverager):
    """Blockwise model-update filtering (BMUF; Chen & Huo 2016) every ``period`` optimizer steps.

    Called as :class:`ModelAverager`. At the end of each block, with ``N`` ranks::

        G = mean_i(w_i) - W_start
        D = bm * D + zeta * G,   zeta = (1 - bm) * N * block_learning_rate
        W = W + D
        W_start = W + bm * D   (Nesterov)   or   W

    and every replica continues from ``W_start``: the arithmetic of
    :class:`~bunsan.algorithms.block_momentum.BlockMomentumSGD` with
    ``block_size = period * batch``. A partial block of ``s`` steps (the last one, in
    :meth:`join`) uses ``bm ** (s / period)``, the momentum held as a time constant.
    Use :class:`AveragingOptimizer` (it resets the local momentum after each round, and
    records the first block's start with ``warmup_steps=0``; see :meth:`begin`).

    Args:
        period: optimizer steps per block, ``>= 1``.
        block_momentum: ``bm`` of a full block, in ``[0, 1)``; ``None``: BlockMomentumSGD's default.
        block_learning_rate: scales ``zeta``, ``> 0``; ``None``: BlockMomentumSGD's default.
        nesterov: start each block from the look-ahead ``W + bm * D``.
        warmup_steps: steps of exact DDP training before the first block.
        process_group: the group to average over; ``None`` means every rank.
    """

    resets_local_momentum = True

    def __init__(
        self,
        period: int,
        block_momentum: float | None = None,
        block_learning_rate: float | None = None,
        nesterov: bool = True,
        warmup_steps: int = 0,
        process_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(period, warmup_steps, process_group)
        self.requested_block_momentum: float | None = check_number(
            "block_momentum", block_momentum, minimum=0.0, maximum=1.0, max_inclusive=False, allow_none=True,
            hint="None means BlockMomentumSGD's default, and 0 turns the filter off",
        )  # fmt: skip
        self.requested_block_learning_rate: float | None = check_number(
            "block_learning_rate", block_learning_rate, minimum=0.0, min_inclusive=False, allow_none=True,
            hint="1.0 applies the filtered block update in full",
        )  # fmt: skip
        self.nesterov = check_type("nesterov", nesterov, bool)

    def __repr__(self) -> str:
        return (
            f"BlockMomentumAverager(period={self.period}, block_momentum={self.requested_block_momentum}, "
            f"block_learning_rate={self.requested_block_learning_rate}, nesterov={self.nesterov}, "
            f"warmup_steps={self.warmup_steps})"
        )

    @property
    def block_momentum(self) -> float:
        """``bm`` of a full block, the default resolved from the world size."""
        bm = self.requested_block_momentum
        return _resolve_defaults(self.world_size)[0] if bm is None else bm

    @property
    def block_learning_rate(self) -> float:
        blr = self.requested_block_learning_rate
        return _resolve_defaults(self.world_size)[1] if blr is None else blr

    @property
    def lookahead_momentum(self) -> float:
        return self.block_momentum

    def filter_coefficients(self, steps_per_worker: float) -> tuple[float, float]:
        bm = scaled_block_momentum(self.block_momentum, self.period, steps_per_worker)
        return bm, block_gain(bm, self.world_size, self.block_learning_rate)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(block_momentum=self.block_momentum, block_learning_rate=self.block_learning_rate)
        return state


class AveragingOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step()`` runs the local step, then the averager: torch's PostLocalSGDOptimizer's shape.

    ``step()`` counts a step, and averages at the end of a block, only when the inner step
    ran. With a ``GradScaler`` (``scaler.step(optimizer)``) the scaler hands the step its
    overflow flag (``_step_supports_amp_scaling``); the wrapper unscales the gradients,
    agrees on the flag with one scalar all-reduce (after the warm-up each rank's gradients
    are its own, so an overflow on one rank is not seen by the others), and skips the inner
    step and the count on every rank when any rank overflowed.

    Args:
        optimizer: the local optimizer.
        averager: a :class:`ModelAverager` or :class:`BlockMomentumAverager`.
        reset_local_momentum: drop the local optimizer's momentum buffers after each round;
            ``None`` means the averager's default (True for BMUF, as BlockMomentumSGD; False
            for model averaging, as ModelAveragingSGD).
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() on every rank, with found_inf and grad_scale

    def __init__(
        self, optimizer: torch.optim.Optimizer, averager: ModelAverager, reset_local_momentum: bool | None = None
    ) -> None:
        # Optimizer.__init__ is not called: the param groups and state are the inner optimizer's.
        self.optimizer = check_type("optimizer", optimizer, torch.optim.Optimizer)
        self.averager = check_type("averager", averager, ModelAverager, hint="bunsan.algorithms.ModelAverager")
        reset: bool | None = check_type("reset_local_momentum", reset_local_momentum, (bool, type(None)))
        self.reset_local_momentum: bool = averager.resets_local_momentum if reset is None else reset
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups  # the same list: add_param_group() shows here
        self.skipped_steps = 0  # steps skipped on every rank because a GradScaler found inf/NaN on some rank
        averager._round_callbacks.append(self._after_round)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"AveragingOptimizer({self.optimizer!r}, {self.averager!r})"

    def _after_round(self) -> None:
        if self.reset_local_momentum:
            reset_momentum_buffers(self.optimizer)

    @torch.no_grad()
    def _overflowed(self) -> bool:
        """Collective when a GradScaler called: unscale, and whether any rank found inf/NaN."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        grad_scale = getattr(self, "grad_scale", None)  # None: scaler.unscale_() already ran
        flag = found_inf.detach().to(torch.float64).reshape(1).clone()
        all_reduce(flag, op="max", group=self.averager.process_group, traffic=self.averager.traffic)
        if flag.item() > 0:
            return True
        if grad_scale is not None:
            inv = grad_scale.double().reciprocal().float()  # a power of two: exact, as the scaler's own unscale
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv.to(p.grad.device, p.grad.dtype))
        return False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The inner step, then :meth:`ModelAverager.average_parameters`; nothing on a skipped GradScaler step."""
        if self._overflowed():
            self.skipped_steps += 1
            return None
        averager = self.averager
        if not averager._started and averager.step >= averager.warmup_steps:
            averager.begin(self.param_groups)  # the model the first block starts from
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def join(self) -> None:
        """Collective: :meth:`ModelAverager.join` with this optimizer's parameters."""
        self.averager.join(self.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict with the averager's under ``"averager"``."""
        state = self.optimizer.state_dict()
        state["averager"] = self.averager.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a plain optimizer state dict restarts the count with a warning."""
        state = dict(state_dict)
        averager_state = state.pop("averager", None)
        self.optimizer.load_state_dict(state)
        if averager_state is None:
            warnings.warn("the state dict has no 'averager' entry: the averager starts from step 0", stacklevel=2)
            return
        self.averager.load_state_dict(averager_state)
