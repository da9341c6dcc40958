"""The gradient exchange of DataParallelSGD: bucket hooks during backward, launches in order, completion.

Gradients are packed into buckets (:mod:`~bunsan.algorithms.data_parallel.buckets`);
a bucket's all-reduce (or its quantized stripes,
:mod:`~bunsan.algorithms.data_parallel.quantized`) starts as soon as its last gradient
is ready, buckets leave strictly in index order on every rank, and a callback queued
on the autograd engine completes the round before ``loss.backward()`` returns. The
invariants are listed in :mod:`bunsan.algorithms.data_parallel`.
"""

from __future__ import annotations

import time
from typing import cast

import torch
from torch import Tensor
from torch.distributed.algorithms.join import Joinable

from bunsan.algorithms.base import Observer
from bunsan.algorithms.data_parallel.buckets import Bucket
from bunsan.algorithms.data_parallel.momentum import LocalMomentum, Piece
from bunsan.algorithms.data_parallel.quantized import QuantizedExchange
from bunsan.comm import all_reduce, get_rank, wait
from bunsan.comm.join import notify_join_context

__all__ = ["COMPRESSIONS", "BucketExchange"]

COMPRESSIONS = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


# Up to this many gradients in a bucket, each is divided into it in one pass; above, two batched calls.
_FEW_TENSORS = 8


class BucketExchange(LocalMomentum, QuantizedExchange, Joinable):
    """The per-step exchange of :class:`~bunsan.algorithms.data_parallel.DataParallelSGD` (a base of it).

    A :class:`~torch.distributed.algorithms.join.Joinable`: every round begins by
    notifying an enclosing ``Join`` (the hooks are DataParallelSGD's).
    """

    # Set by DataParallelSGD.__init__ and setup().
    bits: int
    compression: str | None
    warm_start: int
    _n: int
    _next_launch: int
    _accumulating: bool
    _separate_meta: Tensor | None
    _has_grad: list[float]
    _callback_queued: bool
    _exchanged: bool
    _last_quantized: bool
    _quantized_bytes: int
    _round_held: bool
    observer: Observer | None

    def _update_mode(self) -> None:
        """Whether this step's exchange is quantized: from the global sample count, the same on every rank."""
        was = self.quantizing
        self.quantizing = self._quantizer is not None and self.samples >= self.warm_start
        if self.quantizing and not was and self.warm_start and get_rank(self.group) == 0:
            print(
                f"[bunsan] DataParallelSGD: {self.samples} samples trained (warm start {self.warm_start}); "
                f"switching to {self.bits}-bit gradients",
                flush=True,
            )

    # -- during backward ----------------------------------------------------------
    def _on_grad_ready(self, bucket: Bucket, i: int, p: Tensor) -> None:
        if self._accumulating:
            return
        if not self._callback_queued:
            # The first gradient of this backward: finish the exchange when the
            # engine is done, before loss.backward() returns (as DDP does).
            self._callback_queued = True
            notify_join_context(self)  # inside a torch Join: before this round's collectives
            self._round = (self._take_local_samples(), 1.0)
            self._round_held = self.observer is not None and self.observer.holds_exchange()
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            if self.buffer_sync is not None and not self._round_held:
                self.buffer_sync.launch_riding(contribute=True)  # final since the forward: overlap with backward
        if self.quantizing:  # per-worker momentum and residuals: one parameter at a time
            self._copy_in(bucket, i)
            bucket.ready.add(i)
            if len(bucket.ready) == len(bucket.params):
                bucket.filled = True
                self._launch_in_order()
            return
        bucket.ready.add(i)
        # Under a held exchange nothing leaves before before_exchange has run, nor is filled: a gradient that is
        # a bucket's view (the reduced buffer of the last round, kept by zero_grad(set_to_none=False))
        # would be divided in place, and an algorithm that replaces this one there takes p.grad as it is.
        # The exchange fills what the hold leaves to it.
        if len(bucket.ready) == len(bucket.params) and not self._round_held:
            self._fill(bucket)
            self._launch_in_order()

    def _fill(self, bucket: Bucket) -> None:
        """Copy a complete bucket's gradients in, divided by the world size.

        Every parameter of the bucket has a gradient (its hook fired), so the
        per-parameter work of the hook is one set insertion. A bucket of a few
        gradients takes one ``torch.div(..., out=slot)`` each: one pass, on the critical
        path of the last bucket (DDP's reducer likewise scales as it copies). One of many
        takes one ``_foreach_copy_`` and one ``div_`` over the bucket, cheaper than a call
        per tensor (a gradient that already lives in the bucket is copied onto itself).
        """
        # Every hook of the bucket fired, so every gradient is set (cast: no check per gradient).
        grads = [cast(Tensor, p.grad) for p in bucket.params]
        if len(grads) <= _FEW_TENSORS:
            for grad, slot in zip(grads, bucket.slots, strict=True):
                torch.div(grad, self._n, out=slot)
        else:
            torch._foreach_copy_(bucket.slots, grads)
            bucket.buffer.div_(self._n)
        for index in bucket.indices:
            self._has_grad[index] = 1.0
        bucket.filled = True

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        held, self._round_held = self._round_held, False
        if held and self.observer is not None and self.observer.before_exchange():
            return  # replaced by another algorithm before this round's first collective
        self._exchange(active=True)

    def _copy_in(self, bucket: Bucket, i: int) -> None:
        """Put this rank's gradient, divided by the world size, into the bucket.

        Dividing before the sum keeps a half-precision sum from overflowing where
        the mean would not; fused with the copy it costs no extra pass.
        """
        p = bucket.params[i]
        grad, view = p.grad, bucket.slots[i]
        if grad is None:
            self._has_grad[bucket.indices[i]] = 0.0
            view.zero_()  # an unused parameter contributes zeros on this rank
            return
        self._has_grad[bucket.indices[i]] = 1.0
        group = self._momentum_group(p) if self.quantizing else None
        if group is not None:
            self._momentum_step(p, grad, group, view, self._n)
        elif grad.data_ptr() == view.data_ptr():
            view.div_(self._n)  # the gradient already lives in the bucket
        else:
            torch.div(grad, self._n, out=view)

    def _launch_in_order(self) -> None:
        # Same order on every rank: bucket k leaves only after buckets 0..k-1; none while the round is
        # held for the observer's before_exchange (at the end of backward, or cleared by _exchange).
        if self._round_held:
            return
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        if self.quantizing:
            self._launch_stripes(bucket)
            return
        dtype = COMPRESSIONS[self.compression]
        if dtype is not None:
            wire = bucket.buffer.to(dtype)
        elif bucket.meta is None or bucket.with_meta is None:
            wire = bucket.buffer
        else:
            wire = bucket.with_meta
        if bucket.meta is not None:
            self._fill_meta(bucket.meta)
        bucket.wire = wire
        bucket.work = all_reduce(wire, group=self.group, async_op=True, traffic=self.traffic)

    def _fill_meta(self, meta: Tensor) -> None:
        """This rank's (samples, active, gradient flags, buffer flags), in ``meta``'s dtype."""
        assert self._round is not None
        samples, active = self._round
        values = [float(samples), float(active), *self._has_grad]
        if self.buffer_sync is not None:
            values += self.buffer_sync.changed() if active else [0.0] * len(self.buffer_sync)
        if self._quantizer is not None:  # ranks that encoded an inf or NaN (GradScaler's overflow steps)
            values.append(self._local_nonfinite())
        meta.copy_(torch.tensor(values, dtype=meta.dtype))

    # -- in optimizer.step() ------------------------------------------------------
    def _exchange(self, *, active: bool) -> int:
        """Complete one synchronization round: all buckets and the metadata.

        Started by the gradient hooks during backward (``self._round`` is set) or,
        when no backward reached a parameter on this rank, here. Returns the number
        of ranks that trained in this round.
        """
        started = time.perf_counter()
        self._round_held = False  # an exchange not started by backward's end (no gradient, join): no hold
        if self._round is None:
            if active:
                notify_join_context(self)  # inside a torch Join: before this round's collectives
            self._round = (self._take_local_samples() if active else 0, 1.0 if active else 0.0)
        for bucket in self._buckets[self._next_launch :]:
            if not bucket.filled:
                for i in range(len(bucket.params)):
                    if active:
                        if i not in bucket.ready or not self.quantizing:
                            self._copy_in(bucket, i)  # its gradient, or zeros for an unreached parameter
                    else:
                        bucket.slots[i].zero_()
                        self._has_grad[bucket.indices[i]] = 0.0
                bucket.filled = True
            bucket.ready = set(range(len(bucket.params)))
        if self.buffer_sync is not None:  # before any bucket, as the first gradient hook does it
            self.buffer_sync.launch_riding(contribute=active)
        self._launch_in_order()
        meta_work = None
        if self._separate_meta is not None:
            self._fill_meta(self._separate_meta)
            meta_work = all_reduce(self._separate_meta, group=self.group, async_op=True, traffic=self.traffic)
        quantized = self.quantizing
        sent_before = self.traffic.sent
        if not quantized:
            for bucket in self._buckets:
                wait(bucket.work, "gradient all-reduce")
        wait(meta_work, "sample count all-reduce")
        self._round = None
        meta = self._separate_meta if self._separate_meta is not None else self._buckets[-1].meta
        assert meta is not None
        sums = meta.tolist()
        self.samples += round(sums[0])
        n_active = round(sums[1])
        n_params = len(self.named_params)
        used = sums[2 : 2 + n_params]
        if quantized:
            # Any rank's inf or NaN decodes into every rank's gradient, so GradScaler skips the
            # step everywhere; the workers' momentum and residuals must not keep this round.
            finite = sums[-1] == 0
            pieces: dict[int, list[Piece]] | None = None
            if finite and active and n_active == self.world_size and self._fuses_gradient_units():
                pieces = {}  # SGD's p.grad in gradient units: done by the decode, in its pass
                self._to_gradient_units(used, pieces=pieces)
            self._finish_stripes(n_active, pieces)  # also does the scaling to the active ranks
            self._quantized_bytes += self.traffic.sent - sent_before
            self._settle_momentum(finite)
            if not finite:
                self._drop_residuals()
            elif active and pieces is None:
                self._to_gradient_units(used)
        if active:
            scale = self.world_size / n_active if n_active != self.world_size and not quantized else None
            for bucket in self._buckets:
                if bucket.wire is not None and bucket.wire is not bucket.buffer and bucket.wire is not bucket.with_meta:
                    bucket.buffer.copy_(bucket.wire)
                if scale is not None:
                    bucket.buffer.mul_(scale)
                for i, p in enumerate(bucket.params):
                    if used[bucket.indices[i]] > 0:
                        view = bucket.slots[i]
                        if p.grad is not view:
                            p.grad = view  # no copy back: the gradient is the reduced buffer
                    # else: no rank had a gradient for p; it keeps grad None, as in one process
        if self._in_gradient_units:  # to recognise what the user does to them before step()
            self._sample_gradient_units()
        if self.buffer_sync is not None:
            self.buffer_sync.finish_riding(n_active)
            flags = sums[2 + n_params : 2 + n_params + len(self.buffer_sync)]
            self.buffer_sync.average(flags, contribute=active, contributors=n_active, ride=True)
        for bucket in self._buckets:
            bucket.ready, bucket.work, bucket.wire, bucket.filled = set(), None, None, False
        self._next_launch = 0
        self._exchanged = True
        self._last_quantized = quantized and active
        self._update_mode()  # the same global count on every rank: the same decision
        if self.observer is not None:
            self.observer.after_exchange(time.perf_counter() - started)
        return n_active

    def complete_exchange(self) -> None:
        """Collective. Run this step's exchange now if no backward has completed one."""
        if not self._exchanged:
            if self._callback_queued:
                raise RuntimeError("optimizer.synchronize() was called during backward")
            # a rank whose backward reached no parameter meets the others' before_exchange here
            if self.observer is not None and self.observer.holds_exchange() and self.observer.before_exchange():
                return  # replaced: the new algorithm completes this step
            self._exchange(active=True)
