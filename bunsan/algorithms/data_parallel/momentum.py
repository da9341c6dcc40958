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

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from bunsan.algorithms.base import Algorithm
from bunsan.algorithms.data_parallel.buckets import Bucket
from bunsan.algorithms.onebit_adam import FrozenVarianceAdam, is_adam
from bunsan.compression import Quantizer, native
from bunsan.compression.rotation import RotatedQuantizer

# Values of each converted gradient kept to recognise a rescaling by the user (_rebase_workers).
_SAMPLES = 16

# A part of a bucket's buffer to take out of momentum units as it is decoded:
# (lo, hi, previous momentum B, a, divisor), U[lo:hi] = (U[lo:hi] - a * B) / divisor.
Piece = tuple[int, int, Tensor, float, float]

__all__ = [
    "HEAVY_MOMENTUM_1BIT",
    "QUANTIZED_MOMENTUM_1BIT",
    "QUANTIZED_MOMENTUM_1BIT_TWO_RANKS",
    "LocalMomentum",
    "default_quantized_momentum",
    "lincomb",
    "optimizer_warning",
]

# SGD momentum from which 1-bit training without rotation is warned about; measured in
# docs/experiments/design-notes.md, "1 bit and heavy momentum".
HEAVY_MOMENTUM_1BIT = 0.7
# The SGD momentum the workers apply while exchanging 1-bit gradients, at most (the step
# lr / (1 - momentum) is kept): error feedback delays part of every update, and delay acts as
# extra momentum (Mitliagkas et al. 2016); docs/experiments/design-notes.md, "1-bit defaults".
QUANTIZED_MOMENTUM_1BIT = 0.5
# The same at 2 ranks with SGD, where the exchange quantizes once instead of twice (quantized.py,
# _finish_two_ranks): less delay to absorb, so the workers keep more momentum, and the update's noise
# per step at the same lr / (1 - momentum) shrinks (variance ~ (1 - a) / (1 + a) at momentum a);
# docs/experiments/design-notes.md, "1 bit at 2 workers".
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


def _fits_native(*tensors: Tensor | None) -> bool:
    """Whether the one-pass C kernel takes these: contiguous CPU float32 of one size."""
    present = [t for t in tensors if t is not None]
    numel = present[0].numel()
    return (
        all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.numel() == numel
            for t in present
        )
        and native.available()
    )


def lincomb(
    x: Tensor | None, a: float, y: Tensor, b: float, out: Tensor, scaled: Tensor | None = None, divisor: float = 1.0
) -> None:
    """``out = a * x + b * y`` (``x`` None: ``b * y``), and with ``scaled`` also ``scaled = out / divisor``.

    The local momentum's arithmetic, each a single pass over memory with the C kernel
    (:func:`bunsan.compression.native.axpby`); torch operations (up to three passes)
    where it is not available or the tensors do not fit it. ``x``, ``y``, ``out`` and
    ``scaled`` may be the same tensor. Both round as torch's ``mul`` then ``add_(y, alpha=b)``
    (one fused multiply-add where torch's kernels use one), so the kernel gives the bits of
    the torch operations it replaces.
    """
    if _fits_native(x, y, out, scaled):
        native.axpby(x, a, y, b, out, scaled, divisor)
        return
    if x is None:
        torch.mul(y, b, out=out)
    else:
        if y.data_ptr() == out.data_ptr() and x.data_ptr() != out.data_ptr():
            y = y.clone()  # out = a * x would overwrite y before it is read
        torch.mul(x, a, out=out).add_(y, alpha=b)
    if scaled is not None:
        torch.div(out, divisor, out=scaled)


def optimizer_warning(
    optimizer: torch.optim.Optimizer, bits: int, *, rotate: bool, cap: float | None = None, two_ranks: bool = False
) -> str | None:
    """What to warn about quantized gradients (``bits < 32``) with ``optimizer`` (not Adam), or None.

    An optimizer that is neither SGD (momentum taken per worker before compression) nor
    Adam with local momentum folds the quantization error into its per-coordinate
    statistics; 1 bit without rotation and SGD momentum >= :data:`HEAVY_MOMENTUM_1BIT`
    applied by the workers (``cap``: the ``quantized_momentum`` they apply at most) was
    measured far off exact SGD (docs/experiments/design-notes.md, "1 bit and heavy momentum"); at 2 ranks
    (``two_ranks``: one quantization stage) up to :data:`QUANTIZED_MOMENTUM_1BIT_TWO_RANKS` is not
    warned about (docs/experiments/design-notes.md, "1 bit at 2 workers").
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
        '(measured in docs/experiments/design-notes.md, "1 bit and heavy momentum"). Use bits=2, or rotate=True (same '
        "bytes, more CPU), or momentum <= 0.5 with lr scaled to keep lr / (1 - momentum)"
    )


class LocalMomentum(Algorithm):
    """The local-momentum half of :class:`~bunsan.algorithms.data_parallel.DataParallelSGD` (a mixin of it)."""

    # Set by DataParallelSGD.__init__, setup() and attach_optimizer().
    quantizing: bool
    local_momentum: bool
    quantized_momentum: float | None
    _adam: FrozenVarianceAdam | None
    _quantizer: Quantizer | RotatedQuantizer | None
    _momentum: dict[str, Tensor]  # committed: the workers' momentum after the last finite step
    _momentum_pending: dict[str, Tensor]  # this step's, until the exchange is known finite
    _momentum_spare: dict[str, Tensor]  # the other buffer of each pair, reused every step
    _in_gradient_units: list[tuple[Tensor, tuple[float, float, float, Tensor | None]]]  # until step()
    _shown: list[tuple[Tensor, Tensor]]  # (p, its gradient) while the optimizer steps along the momentum
    _unit_samples: tuple[Tensor, list[int]] | None  # the first values of each converted gradient, and how many
    _warned_rebase: bool
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

    def _momentum_step(self, p: Tensor, grad: Tensor, group: dict[str, Any], scaled: Tensor, n: float) -> None:
        """torch.optim.SGD's (or Adam's) momentum arithmetic, on this worker's own gradient.

        The new buffer is written into a spare one and only committed by
        :meth:`_settle_momentum` once the step's exchange came out finite on every rank:
        a step that ``GradScaler`` skips (an inf or NaN on any rank) leaves every
        worker's momentum as it was, as it leaves the optimizer's. What is exchanged,
        the momentum (or the gradient, with weight decay alone) divided by ``n``, is
        written into ``scaled``: with plain momentum in the same pass (:func:`lincomb`).
        """
        name = self._name_of[p]
        buf = self._momentum.get(name)
        out = self._momentum_spare.pop(name, None)
        if out is None:
            out = torch.empty_like(p, dtype=torch.float32) if self._adam is not None else torch.empty_like(grad)
        self._momentum_pending[name] = out
        if self._adam is not None:
            torch.div(self._adam.momentum_step(buf, out, p, grad, group, cap=self.quantized_momentum), n, out=scaled)
            return
        d = -grad if group.get("maximize") else grad
        if group["weight_decay"]:
            d = d.add(p.detach(), alpha=group["weight_decay"])
        beta = group["momentum"]
        if beta == 0:
            del self._momentum_pending[name]
            self._momentum_spare[name] = out
            torch.div(d, n, out=scaled)
            return
        # While quantizing, the workers' momentum may be lower than the optimizer's (see
        # quantized_momentum), with the gradient scaled by keep = (1 - applied) / (1 - beta)
        # so that the steady step lr / (1 - beta) is the same. keep = 1 when they agree.
        applied = beta if self.quantized_momentum is None else min(beta, self.quantized_momentum)
        keep = (1 - applied) / (1 - beta)
        into = None if group["nesterov"] else scaled  # Nesterov sends keep * d + applied * out (below)
        if buf is None:
            # At the switch from exact averaging the optimizer's buffer is the global
            # momentum, equal on every rank: continue from it, so the mean of the
            # workers' buffers follows the same recursion. Else start as torch does.
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            buf = state.get("momentum_buffer")
            if buf is None:
                lincomb(None, 0.0, d.detach(), keep, out, into, n)
            else:
                lincomb(buf.detach(), applied, d, keep * (1 - group["dampening"]), out, into, n)
        else:
            lincomb(buf, applied, d, keep * (1 - group["dampening"]), out, into, n)
        if group["nesterov"]:
            torch.div(d.mul(keep).add_(out, alpha=applied), n, out=scaled)

    def _fuses_gradient_units(self) -> bool:
        """Whether the decode can take SGD's updates out of momentum units in its own pass (plain chunks,
        float32 buckets; :meth:`_to_gradient_units` with ``pieces``)."""
        return (
            self._adam is None
            and type(self._quantizer) is Quantizer
            and all(bucket.buffer.dtype == torch.float32 for bucket in self._buckets)
        )

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

    def _to_gradient_units(self, used: Sequence[float], *, pieces: dict[int, list[Piece]] | None = None) -> None:
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
        clipped gradient; :meth:`_rebase_workers` brings the workers' own buffers in line with
        it (docs/experiments/design-notes.md).

        With ``pieces`` (called before the exchange is decoded, SGD only) the SGD
        inversions are not done here but listed per bucket as ``(lo, hi, B, a, divisor)``
        over the bucket's buffer, ``U = (U - a * B) / divisor``, for the decode to apply
        in its own pass (:meth:`~bunsan.compression.Quantizer.decode_sum`).
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
                if group["nesterov"]:  # U = keep * (1 + a) * g + a * a * B
                    scale, divisor = a * a, keep * (1 + a)
                    self._in_gradient_units.append((p, (a, keep, 1.0, None)))
                else:  # U = a * B + k * g
                    scale = a
                    divisor = k = keep * (1 - group["dampening"])
                    self._in_gradient_units.append((p, (a, k, 0.0, None)))
                if pieces is None:
                    lincomb(slot, 1.0, previous, -scale, slot, slot, divisor)  # (U - scale * B) / divisor, one pass
                else:
                    lo = int(slot.storage_offset() - bucket.buffer.storage_offset())
                    pieces.setdefault(bucket.index, []).append((lo, lo + int(slot.numel()), previous, scale, divisor))

    def _sample_gradient_units(self, grads: Sequence[Tensor | None] | None = None) -> None:
        """After the exchange: remember a few values of each converted ``p.grad``, to tell in ``step()``
        whether and by how much the user rescaled it (:meth:`_rebase_workers`). One small copy per step.

        ``grads``: what ``p.grad`` will hold, one per entry of ``_in_gradient_units``, where it is not set
        yet (a DDP communication hook: DDP copies its bucket into ``p.grad`` after the hook).
        """
        if grads is None:
            grads = [p.grad for p, _ in self._in_gradient_units]
        if any(g is None for g in grads):
            self._unit_samples = None
            return
        parts = [g.detach().reshape(-1)[:_SAMPLES].float() for g in grads if g is not None]
        self._unit_samples = (torch.cat(parts), [t.numel() for t in parts])

    def _rebase_workers(self) -> None:
        """Keep the mean of the workers' momentum equal to the optimizer's after the user changed ``p.grad``.

        The workers' momentum ``m_i`` went into the exchange before the user saw the gradient;
        what the optimizer's momentum receives is the gradient the user left (unscaled by
        ``GradScaler``, clipped). Without a correction the difference ``k * (g_user - g)``
        would stay in the workers' momentum: clipped amounts come back in later steps, and
        under ``GradScaler`` the scaled gradient (``2 ** 16`` times the true one) would be
        taken as momentum. Both ``unscale_`` and ``clip_grad_norm_`` multiply a tensor by
        one factor ``c``, found from the sampled values (``g = g_user / c``), so every
        worker adds ``k * (1 - 1 / c) * g_user`` to its own momentum: their mean is then the
        optimizer's, exactly for such a rescaling. Any other change (``clip_grad_value_``)
        is taken as its least-squares factor, and warned about once.
        """
        if self._unit_samples is None or len(self._unit_samples[1]) != len(self._in_gradient_units):
            return
        before, sizes = self._unit_samples
        grads = [p.grad for p, _ in self._in_gradient_units if p.grad is not None]
        if len(grads) != len(sizes):
            return  # a gradient was taken away (set to None): nothing to compare
        now = torch.cat([g.detach().reshape(-1)[:n].float() for g, n in zip(grads, sizes, strict=True)])
        if torch.equal(now, before):
            return  # untouched: the workers' momentum already averages to the optimizer's
        for (p, (_, k, _, _)), grad, x, y in zip(
            self._in_gradient_units, grads, before.split(sizes), now.split(sizes), strict=True
        ):
            norm = float(x.dot(x))
            if norm == 0.0 or torch.equal(x, y):
                continue
            c = float(y.dot(x)) / norm
            if c == 0.0:
                continue  # zeroed: nothing to learn the factor from
            if not self._warned_rebase and float((y - c * x).abs().max()) > 1e-4 * float(x.abs().max()) * abs(c):
                self._warned_rebase = True
                warnings.warn(
                    "p.grad was changed between backward() and step() other than by one factor per tensor (as "
                    "GradScaler.unscale_ and clip_grad_norm_ do); with quantized gradients and local momentum "
                    "the workers' momentum follows it only approximately",
                    stacklevel=5,
                )
            momentum = self._momentum.get(self._name_of[p])
            if momentum is not None:
                momentum.add_(grad.to(momentum.dtype), alpha=k * (1 - 1 / c))

    def _from_gradient_units(self) -> None:
        """In ``step()``: the (possibly clipped or unscaled) gradient in ``p.grad`` back into the update."""
        self._rebase_workers()  # before p.grad is turned back into the update
        for p, (a, k, nesterov, denominator) in self._in_gradient_units:
            grad = p.grad
            if grad is None or self.optimizer is None:
                continue
            state = self.optimizer.state[p]
            if denominator is not None:  # Adam: the mean first moment, then the preconditioned update
                grad.mul_(k).add_(state["exp_avg"], alpha=a).div_(denominator)
                continue
            buffer = state["momentum_buffer"]
            if nesterov:  # keep * g + a * B_new (k is keep: Nesterov has no dampening)
                lincomb(buffer, a, grad, k, buffer)
                lincomb(grad, k, buffer, a, grad)  # as grad.mul_(k).add_(buffer, alpha=a)
            else:  # B = a * B + k * g, and the optimizer steps along B: one pass, B written only
                lincomb(buffer, a, grad, k, buffer)
                self._shown.append((p, grad))
                p.grad = buffer  # until after_step; then p.grad is the gradient again, as in one process
        self._in_gradient_units = []
        self._unit_samples = None

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
        """After the optimizer's step: give the param groups their momentum and weight decay back, and
        ``p.grad`` the gradient it showed before ``step()``."""
        for group, saved in self._held:
            group.update(saved)
        self._held = []
        for p, grad in self._shown:
            p.grad = grad
        self._shown = []
