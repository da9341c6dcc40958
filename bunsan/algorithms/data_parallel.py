"""Synchronous data-parallel SGD: gradients averaged over all workers every step.

``bits=32`` is exact synchronous SGD (Dean et al. 2012's synchronous baseline;
the same arithmetic as PyTorch's DistributedDataParallel). Gradients are packed
into buckets of about ``bucket_size_mb``; a bucket's all-reduce starts during
``loss.backward()`` as soon as its last gradient is ready, so communication
overlaps the rest of the backward pass (as in Horovod, Sergeev & Del Balso 2018,
and DDP, Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training").

Distributed invariants kept here:

* Buckets are launched strictly in index order on every rank (a bucket whose
  gradients are ready waits for its predecessors), so the ranks' collectives
  match even when gradients become ready in different orders.
* A parameter that got no gradient in a step contributes zeros.
* Every step also sums ``(samples, active ranks)``: two slots at the end of the
  last bucket (or a separate float64 all-reduce when that bucket is compressed).
  The global sample count is exact, and a rank that has run out of data
  (:meth:`join`) contributes zeros without biasing the average, which is taken
  over the active ranks only.
* After the step a parameter's ``.grad`` is a view of its bucket: the reduced
  gradient is not copied back, and the next backward's gradient is copied in
  with the division by the world size fused into the copy.
* Gradients are divided by the world size before the sum, so a half-precision
  sum cannot overflow where the mean would not.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan.algorithms.base import Algorithm
from bunsan.comm import all_reduce, wait

__all__ = ["DataParallelSGD"]

_COMPRESSIONS = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}
_FIRST_BUCKET_MB = 1.0  # a small first bucket starts communication early in backward


@dataclass
class _Bucket:
    index: int
    names: list[str]
    params: list[Tensor]
    offsets: list[int]
    buffer: Tensor  # flat gradients of ``params``, in this order
    ready: set[int] = field(default_factory=set)  # positions whose gradient is in ``buffer``
    work: Any = None
    wire: Tensor | None = None  # what travels (a half-precision copy, or ``buffer`` itself)
    with_meta: Tensor | None = None  # ``buffer`` plus two trailing slots, one allocation
    meta: Tensor | None = None  # the two slots: (samples, active ranks)


def _build_buckets(named_params: Sequence[tuple[str, Tensor]], cap_bytes: int) -> list[_Bucket]:
    """Group parameters into buckets, last layers first (their gradients are ready first)."""
    buckets: list[_Bucket] = []
    current: dict[tuple[torch.dtype, torch.device], list[tuple[str, Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}

    def close(key: tuple[torch.dtype, torch.device]) -> None:
        members = current.pop(key, [])
        sizes.pop(key, None)
        if not members:
            return
        offsets, total = [], 0
        for _, p in members:
            offsets.append(total)
            total += p.numel()
        storage = torch.zeros(total + 2, dtype=key[0], device=key[1])
        buckets.append(_Bucket(len(buckets), [n for n, _ in members], [p for _, p in members], offsets,
                               storage[:total], with_meta=storage, meta=storage[total:]))

    for name, p in reversed(list(named_params)):
        key = (p.dtype, p.device)
        current.setdefault(key, []).append((name, p))
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        limit = _FIRST_BUCKET_MB * 2**20 if not buckets else cap_bytes
        if sizes[key] >= limit:
            close(key)
    for key in list(current):
        close(key)
    return buckets


class DataParallelSGD(Algorithm):
    """Synchronous data-parallel SGD, exact (``bits=32``) or with compressed traffic.

    Args:
        bits: 32 for exact full-precision averaging.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: gradients travel in half
            precision (half the bytes; the average is rounded to that precision).
        warm_start: samples (global count) trained with exact averaging before a
            lossy exchange starts; only meaningful with ``bits < 32``.
        bucket_size_mb: approximate size of one all-reduce message.
        group: process group; ``None`` means every rank.

    Example:
        >>> model, optimizer = bunsan.distribute(model, optimizer, bunsan.DataParallelSGD())
    """

    name = "data_parallel"

    def __init__(
        self,
        bits: int = 32,
        *,
        compression: str | None = None,
        warm_start: int = 0,
        bucket_size_mb: float = 25.0,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(group=group)
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise TypeError(f"bits must be an int (32, or 1..16), got {bits!r}")
        if bits != 32:
            raise ValueError(f"bits must be 32 (exact averaging), got {bits}")
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
        if warm_start < 0:
            raise ValueError(f"warm_start is a number of samples >= 0, got {warm_start}")
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self.bits = bits
        self.compression = compression
        self.warm_start = int(warm_start)
        self.bucket_size_mb = float(bucket_size_mb)
        self._buckets: list[_Bucket] = []
        self._where: dict[Tensor, tuple[_Bucket, int]] = {}
        self._next_launch = 0
        self._accumulating = False
        self._reduce_again = False  # a gradient changed after its bucket had left
        self._warned_double_backward = False
        self._hook_handles: list[Any] = []
        self._round: tuple[int, float] | None = None  # (samples, active) of a round started in step()
        self._separate_meta: Tensor | None = None

    def __repr__(self) -> str:
        return f"DataParallelSGD(bits={self.bits}, compression={self.compression!r}, warm_start={self.warm_start})"

    # -- set-up -----------------------------------------------------------------
    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        super().setup(named_params)
        for handle in self._hook_handles:
            handle.remove()
        self._buckets = _build_buckets(self.named_params, int(self.bucket_size_mb * 2**20))
        # The per-step (samples, active ranks) count rides in the last bucket when that
        # bucket travels uncompressed in float32/64 (exact for counts below 2**24);
        # otherwise it is a separate small float64 all-reduce.
        last = self._buckets[-1] if self._buckets else None
        rides = last is not None and self.compression is None and last.buffer.dtype in (torch.float32, torch.float64)
        for bucket in self._buckets:
            if bucket is not last or not rides:
                bucket.with_meta = bucket.meta = None
        device = last.buffer.device if last is not None else torch.device("cpu")
        self._separate_meta = None if rides else torch.zeros(2, dtype=torch.float64, device=device)
        self._where = {p: (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def begin_accumulation(self) -> None:
        self._accumulating = True

    def end_accumulation(self) -> None:
        self._accumulating = False

    # -- during backward ----------------------------------------------------------
    def _on_grad_ready(self, p: Tensor) -> None:
        if self._accumulating or p not in self._where:
            return
        bucket, i = self._where[p]
        if bucket.work is not None:  # a second backward without no_sync(): reduce again in step()
            if self._is_view(bucket, i, p.grad):
                raise RuntimeError(
                    "a gradient was accumulated into a buffer that was being all-reduced: run all but the "
                    "last backward pass of a step inside `with optimizer.no_sync():`"
                )
            self._reduce_again = True
            return
        self._copy_in(bucket, i)
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            self._launch_in_order()

    @staticmethod
    def _view(bucket: _Bucket, i: int) -> Tensor:
        p, offset = bucket.params[i], bucket.offsets[i]
        return bucket.buffer[offset : offset + p.numel()].view_as(p)

    def _is_view(self, bucket: _Bucket, i: int, grad: Tensor | None) -> bool:
        return grad is not None and grad.data_ptr() == self._view(bucket, i).data_ptr()

    def _copy_in(self, bucket: _Bucket, i: int) -> None:
        """Put this rank's gradient, divided by the world size, into the bucket.

        Dividing before the sum keeps a half-precision sum from overflowing where
        the mean would not; fused with the copy it costs no extra pass.
        """
        grad, view = bucket.params[i].grad, self._view(bucket, i)
        if grad is None:
            view.zero_()  # an unused parameter contributes zeros on this rank
        elif self._is_view(bucket, i, grad):
            view.div_(self.world_size)  # the gradient already lives in the bucket
        else:
            torch.div(grad, self.world_size, out=view)

    def _launch_in_order(self) -> None:
        # Same order on every rank: bucket k leaves only after buckets 0..k-1.
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        dtype = _COMPRESSIONS[self.compression]
        if dtype is None:
            bucket.wire = bucket.buffer if bucket.meta is None else bucket.with_meta
        else:
            bucket.wire = bucket.buffer.to(dtype)
        if bucket.meta is not None:
            samples, active = self._round if self._round is not None else (self._pending_samples, 1.0)
            bucket.meta[0], bucket.meta[1] = float(samples), float(active)
        bucket.work = all_reduce(bucket.wire, group=self.group, async_op=True, traffic=self.traffic)

    # -- in optimizer.step() ------------------------------------------------------
    def _exchange(self, local_samples: int, active: bool) -> int:
        """One synchronization round: all buckets and the (samples, active ranks) count."""
        self._round = (local_samples, 1.0 if active else 0.0)
        for bucket in self._buckets[self._next_launch :]:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    if active:
                        self._copy_in(bucket, i)
                    else:
                        self._view(bucket, i).zero_()
            bucket.ready = set(range(len(bucket.params)))
        self._launch_in_order()
        meta_work = None
        if self._separate_meta is not None:
            self._separate_meta.copy_(torch.tensor(self._round, dtype=torch.float64))
            meta_work = all_reduce(self._separate_meta, group=self.group, async_op=True, traffic=self.traffic)
        for bucket in self._buckets:
            wait(bucket.work, "gradient all-reduce")
        wait(meta_work, "sample count all-reduce")
        self._round = None
        meta = self._separate_meta if self._separate_meta is not None else self._buckets[-1].meta
        assert meta is not None
        self.samples += int(round(meta[0].item()))
        n_active = int(round(meta[1].item()))
        if active:
            scale = self.world_size / n_active if n_active != self.world_size else None
            for bucket in self._buckets:
                if bucket.wire is not bucket.buffer and bucket.wire is not bucket.with_meta:
                    bucket.buffer.copy_(bucket.wire)
                if scale is not None:
                    bucket.buffer.mul_(scale)
                for i, p in enumerate(bucket.params):
                    p.grad = self._view(bucket, i)  # no copy back: the gradient is the reduced buffer
        for bucket in self._buckets:
            bucket.ready, bucket.work, bucket.wire = set(), None, None
        self._next_launch = 0
        return n_active

    def reduce_gradients(self) -> None:
        if self._reduce_again:
            # Gradients were accumulated over several backward passes after their
            # buckets had left: discard the early all-reduces and send the sums.
            for bucket in self._buckets:
                wait(bucket.work, "gradient all-reduce")
                bucket.ready, bucket.work, bucket.wire = set(), None, None
            self._next_launch = 0
            self._reduce_again = False
            if not self._warned_double_backward:
                self._warned_double_backward = True
                warnings.warn(
                    "several backward passes before one optimizer step: gradients were sent twice. "
                    "Run all but the last backward inside `with optimizer.no_sync():`",
                    stacklevel=3,
                )
        self._exchange(self._take_local_samples(), active=True)

    def join(self) -> None:
        """Collective. Answer the other ranks' gradient exchanges with zeros until all have joined."""
        while self._exchange(0, active=False) > 0:
            pass

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(bits=self.bits, compression=self.compression)
        return state
