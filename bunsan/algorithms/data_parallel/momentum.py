"""Local momentum: the momentum step taken per worker before compression (Zheng et al. 2019).

With ``bits < 32`` and a ``torch.optim.SGD`` optimizer that has momentum or weight
decay, each worker applies torch's momentum arithmetic to its own gradient, the
result is quantized and averaged, and the optimizer applies it with momentum and
weight decay set to zero for that step ("Communication-Efficient Distributed
Blockwise Momentum SGD with Error-Feedback"). Without compression this is exactly
momentum SGD; with it, error feedback corrects the transmitted momentum itself.
With Adam, :mod:`bunsan.algorithms.onebit_adam` takes the step instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from bunsan.algorithms.base import Algorithm
from bunsan.algorithms.data_parallel.buckets import Bucket
from bunsan.algorithms.onebit_adam import FrozenVarianceAdam, is_adam

__all__ = [
    "HEAVY_MOMENTUM_1BIT",
    "QUANTIZED_MOMENTUM_1BIT",
    "QUANTIZED_MOMENTUM_1BIT_TWO_RANKS",
    "LocalMomentum",
    "default_quantized_momentum",
    "optimizer_warning",
]

# SGD momentum from which 1-bit training without rotation is warned about; measured in
# docs/design-notes.md, "1 bit and heavy momentum".
HEAVY_MOMENTUM_1BIT = 0.7
# The SGD momentum the workers apply while exchanging 1-bit gradients, at most (the step
# lr / (1 - momentum) is kept): error feedback delays part of every update, and delay acts as
# extra momentum (Mitliagkas et al. 2016); docs/design-notes.md, "1-bit defaults".
QUANTIZED_MOMENTUM_1BIT = 0.5
# The same at 2 ranks with SGD, where the exchange quantizes once instead of twice (quantized.py,
# _finish_two_ranks): less delay to absorb, so the workers keep more momentum, and the update's noise
# per step at the same lr / (1 - momentum) shrinks (variance ~ (1 - a) / (1 + a) at momentum a);
# docs/design-notes.md, "1 bit at 2 workers".
QUANTIZED_MOMENTUM_1BIT_TWO_RANKS = 0.8


def default_quantized_momentum(bits: int, world_size: int, *, adam: bool) -> float | None:
    """``quantized_momentum="auto"``: the momentum the workers apply at most while quantizing, or None.

    None (the optimizer's own) above 1 bit; at 1 bit :data:`QUANTIZED_MOMENTUM_1BIT_TWO_RANKS`
    for SGD at 2 ranks (one quantization stage), else :data:`QUANTIZED_MOMENTUM_1BIT` (two
    stages, and 1-bit Adam's first moment at any size).
    """
    if bits != 1:
        return None
    return QUANTIZED_MOMENTUM_1BIT_TWO_RANKS if world_size == 2 and not adam else QUANTIZED_MOMENTUM_1BIT


def optimizer_warning(
    optimizer: torch.optim.Optimizer, bits: int, *, rotate: bool, cap: float | None = None, two_ranks: bool = False
) -> str | None:
    """What to warn about quantized gradients (``bits < 32``) with ``optimizer`` (not Adam), or None.

    An optimizer that is neither SGD (momentum taken per worker before compression) nor
    Adam with local momentum folds the quantization error into its per-coordinate
    statistics; 1 bit without rotation and SGD momentum >= :data:`HEAVY_MOMENTUM_1BIT`
    applied by the workers (``cap``: the ``quantized_momentum`` they apply at most) was
    measured far off exact SGD (docs/design-notes.md, "1 bit and heavy momentum"); at 2 ranks
    (``two_ranks``: one quantization stage) up to :data:`QUANTIZED_MOMENTUM_1BIT_TWO_RANKS` is not
    warned about (docs/design-notes.md, "1 bit at 2 workers").
    """
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.SGD):
        why = (
            "local_momentum=False: it"
            if is_adam(optimizer)
            else "it is neither torch.optim.SGD (momentum taken per worker before compression) nor Adam/AdamW "
            "(frozen variance, 1-bit Adam), so it"
        )
        return (
            f"DataParallelSGD(bits={bits}) with {name}, {why} gets the decoded average gradient, and an optimizer "
            "with per-coordinate statistics (Adam, Adagrad, RMSprop, ...) folds the quantization error into them "
            "and loses accuracy (Tang et al. 2021). Use bits=32 (or compression='bf16') for it"
        )
    if bits != 1 or rotate:
        return None
    heavy = max((g["momentum"] for g in optimizer.param_groups), default=0.0)
    if cap is not None:  # the workers apply at most `cap` while quantizing (quantized_momentum)
        heavy = min(heavy, cap)
    if heavy < HEAVY_MOMENTUM_1BIT or (two_ranks and heavy <= QUANTIZED_MOMENTUM_1BIT_TWO_RANKS):
        return None
    return (
        f"DataParallelSGD(bits=1) with SGD momentum {heavy}: 1-bit error feedback delays part of every gradient "
        f"by several steps, and momentum >= {HEAVY_MOMENTUM_1BIT} leaves too little damping for such delays "
        '(measured in docs/design-notes.md, "1 bit and heavy momentum"). Use bits=2, or rotate=True (same '
        "bytes, more CPU), or momentum <= 0.5 with lr scaled to keep lr / (1 - momentum)"
    )


class LocalMomentum(Algorithm):
    """The local-momentum half of :class:`~bunsan.algorithms.data_parallel.DataParallelSGD` (a mixin of it)."""

    # Set by DataParallelSGD.__init__, setup() and attach_optimizer().
    quantizing: bool
    local_momentum: bool
    quantized_momentum: float | None
    _adam: FrozenVarianceAdam | None
    _momentum: dict[str, Tensor]  # committed: the workers' momentum after the last finite step
    _momentum_pending: dict[str, Tensor]  # this step's, until the exchange is known finite
    _momentum_spare: dict[str, Tensor]  # the other buffer of each pair, reused every step
    _in_gradient_units: list[tuple[Tensor, tuple[float, float, float, Tensor | None]]]  # until step()
    _buckets: list[Bucket]
    _name_of: dict[Tensor, str]
    _group_of: dict[Tensor, dict[str, Any]]
    _held: list[tuple[dict[str, Any], dict[str, Any]]]

    def _momentum_group(self, p: Tensor) -> dict[str, Any] | None:
        """The SGD param group whose momentum this worker applies before compression, if any."""
        if not (self.quantizing and self.local_momentum):
            return None
        if self.optimizer is None or (self._adam is None and not isinstance(self.optimizer, torch.optim.SGD)):
            return None
        if not self._group_of:
            self._group_of = {q: g for g in self.optimizer.param_groups for q in g["params"]}
        group = self._group_of.get(p)
        if group is None or (self._adam is None and group["momentum"] == 0 and group["weight_decay"] == 0):
            return None
        return group

    def _momentum_step(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> Tensor:
        """torch.optim.SGD's (or Adam's) momentum arithmetic, on this worker's own gradient.

        The new buffer is written into a spare one and only committed by
        :meth:`_settle_momentum` once the step's exchange came out finite on every rank:
        a step that ``GradScaler`` skips (an inf or NaN on any rank) leaves every
        worker's momentum as it was, as it leaves the optimizer's (the arithmetic is
        that of the in-place update, so the bits are the same).
        """
        name = self._name_of[p]
        buf = self._momentum.get(name)
        out = self._momentum_spare.pop(name, None)
        if out is None:
            out = torch.empty_like(p, dtype=torch.float32) if self._adam is not None else torch.empty_like(grad)
        self._momentum_pending[name] = out
        if self._adam is not None:
            return self._adam.momentum_step(buf, out, p, grad, group, cap=self.quantized_momentum)
        d = -grad if group.get("maximize") else grad
        if group["weight_decay"]:
            d = d.add(p.detach(), alpha=group["weight_decay"])
        beta = group["momentum"]
        if beta == 0:
            del self._momentum_pending[name]
            self._momentum_spare[name] = out
            return d
        # While quantizing, the workers' momentum may be lower than the optimizer's (see
        # quantized_momentum), with the gradient scaled by keep = (1 - applied) / (1 - beta)
        # so that the steady step lr / (1 - beta) is the same. keep = 1 when they agree.
        applied = beta if self.quantized_momentum is None else min(beta, self.quantized_momentum)
        keep = (1 - applied) / (1 - beta)
        if buf is None:
            # At the switch from exact averaging the optimizer's buffer is the global
            # momentum, equal on every rank: continue from it, so the mean of the
            # workers' buffers follows the same recursion. Else start as torch does.
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            held = state.get("momentum_buffer")
            if held is not None:
                torch.mul(held.detach(), applied, out=out).add_(d, alpha=keep * (1 - group["dampening"]))
            else:
                torch.mul(d.detach(), keep, out=out)
        else:
            torch.mul(buf, applied, out=out).add_(d, alpha=keep * (1 - group["dampening"]))
        return d.mul(keep).add_(out, alpha=applied) if group["nesterov"] else out

    def _settle_momentum(self, finite: bool) -> None:
        """After a quantized exchange: commit this step's momentum buffers, or drop them.

        ``finite`` is the same on every rank (it comes from the exchange's metadata).
        """
        for name, new in self._momentum_pending.items():
            spare: Tensor | None = new
            if finite:
                spare = self._momentum.get(name)
                self._momentum[name] = new
            if spare is not None:
                self._momentum_spare[name] = spare
        self._momentum_pending.clear()

    def _to_gradient_units(self, used: Sequence[float]) -> None:
        """After a finite quantized exchange: ``p.grad`` shows the mean gradient the update came from.

        Between backward and ``step()`` users clip (``clip_grad_norm_``), unscale
        (``GradScaler``) and log gradients. With local momentum what was exchanged is a
        momentum (SGD: ``lr / (1 - beta)`` times a gradient at rest; 1-bit Adam: the
        preconditioned first moment, of order one per coordinate); shown as it is,
        clipping at a gradient's norm shrinks every step (measured: 6.7x exact training's
        excess loss on the transformer of docs/experiments). So the decoded mean update
        ``U`` is inverted through the momentum recursion, with the optimizer's own
        (global, equal on every rank) momentum state as the previous value ``B``:

        * SGD: ``U = a * B + k * g`` gives ``g = (U - a * B) / k``; Nesterov's
          ``U = keep * (1 + a) * g + a * a * B`` gives ``g = (U - a * a * B) / (keep * (1 + a))``
          (``a``: the momentum the workers applied, ``k = keep * (1 - dampening)``);
        * Adam: ``m = a * m_prev + (1 - a) * g`` with ``m = U * denominator`` and ``m_prev``
          the optimizer's ``exp_avg``.

        :meth:`_from_gradient_units` runs the recursion forward on whatever the user left
        in ``p.grad`` (clipped, unscaled) and updates that state, so an untouched gradient
        gives back ``U`` and a clipped one the update one process would take from the
        clipped gradient. The workers' own buffers do not see the clipping: what it removed
        comes back once, times ``a``, in the next step's gradient (docs/design-notes.md).
        """
        self._in_gradient_units = []
        for bucket in self._buckets:
            for p, slot, index in zip(bucket.params, bucket.slots, bucket.indices, strict=True):
                if not used[index]:  # no rank used p this round: it keeps grad None and its state
                    continue
                group = self._momentum_group(p)
                if group is None:
                    continue
                if self._adam is not None:
                    a = float(group["betas"][0])
                    a = a if self.quantized_momentum is None else min(a, self.quantized_momentum)
                    denominator = self._adam.denominator(p, group)
                    previous = self.optimizer.state[p]["exp_avg"] if self.optimizer is not None else None
                    slot.mul_(denominator)
                    if previous is not None:
                        slot.sub_(previous, alpha=a)
                    slot.div_(1 - a)
                    self._in_gradient_units.append((p, (a, 1 - a, 0.0, denominator)))
                    continue
                beta = float(group["momentum"])
                if beta == 0:
                    continue  # weight decay alone: the update is a gradient already
                a = beta if self.quantized_momentum is None else min(beta, self.quantized_momentum)
                keep = (1 - a) / (1 - beta)
                state = self.optimizer.state[p] if self.optimizer is not None else {}
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(slot)
                previous = state["momentum_buffer"]
                if group["nesterov"]:
                    slot.sub_(previous, alpha=a * a).div_(keep * (1 + a))
                    self._in_gradient_units.append((p, (a, keep, 1.0, None)))
                else:
                    k = keep * (1 - group["dampening"])
                    slot.sub_(previous, alpha=a).div_(k)
                    self._in_gradient_units.append((p, (a, k, 0.0, None)))

    def _from_gradient_units(self) -> None:
        """In ``step()``: the (possibly clipped or unscaled) gradient in ``p.grad`` back into the update."""
        for p, (a, k, nesterov, denominator) in self._in_gradient_units:
            grad = p.grad
            if grad is None or self.optimizer is None:
                continue
            state = self.optimizer.state[p]
            if denominator is not None:  # Adam: the mean first moment, then the preconditioned update
                grad.mul_(k).add_(state["exp_avg"], alpha=a).div_(denominator)
                continue
            buffer = state["momentum_buffer"].mul_(a).add_(grad, alpha=k)
            if nesterov:  # keep * g + a * B_new (k is keep: Nesterov has no dampening)
                grad.mul_(k).add_(buffer, alpha=a)
            else:
                grad.copy_(buffer)
        self._in_gradient_units = []

    def _hold_momentum(self) -> None:
        """For this (quantized) step the optimizer must not apply momentum or weight decay again."""
        if self._adam is not None:
            self._adam.hide(self.params)  # the frozen-variance update runs in after_step instead
            return
        if not self.local_momentum or not isinstance(self.optimizer, torch.optim.SGD):
            return
        for group in self.optimizer.param_groups:
            if group["momentum"] or group["weight_decay"]:
                saved = {k: group[k] for k in ("momentum", "weight_decay", "nesterov", "dampening")}
                self._held.append((group, saved))
                group.update(momentum=0.0, weight_decay=0.0, nesterov=False, dampening=0.0)

    def _release_momentum(self) -> None:
        """After the optimizer's step: give the param groups their momentum and weight decay back."""
        for group, saved in self._held:
            group.update(saved)
        self._held = []
