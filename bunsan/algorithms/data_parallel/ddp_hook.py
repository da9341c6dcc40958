"""DataParallelSGD's quantized exchange as a communication hook for plain DistributedDataParallel.

For users who train through ``torch.nn.parallel.DistributedDataParallel`` (directly, or
through Lightning or Accelerate) rather than :func:`bunsan.distribute`::

    state = QuantizedHookState(ddp_model, bits=1, total_steps=steps)
    ddp_model.register_comm_hook(state, quantized_hook)

The hook does what ``DataParallelSGD(bits=b, local_momentum=False)`` does to each bucket,
with the same functions (:mod:`bunsan.algorithms.data_parallel.quantized`): N-bit
quantization with error feedback (Seide et al. 2014, "1-Bit Stochastic Gradient Descent
and its Application to Data-Parallel Distributed Training of Speech DNNs") and the
exchange by stripes: all-to-all of quantized stripes, each owner sums its stripe and
re-quantizes it with a residual of its own (at 2 ranks each sends its own first-stage
payload instead, the same bytes and one quantization), all-gather.

Distributed invariants kept here:

* Every collective is issued from the hook body itself, never from a future's ``.then``
  callback: DDP calls the hook bucket by bucket in index order on every rank, so the
  ranks' collectives match. (Collectives launched from callbacks, as torch's PowerSGD
  hook does, run in different orders on different ranks once there are 2+ buckets, and
  Gloo aborts with a collective mismatch.) A quantized bucket's hook starts its all-to-all
  (which overlaps the rest of backward); the last bucket's hook completes every bucket in
  index order, then their futures.
* Whether a step quantizes is decided at its first bucket from the step count, the same
  on every rank.
* Residuals are kept by parameter name, not by bucket: when DDP rebuilds its buckets
  after the first iteration (or a checkpoint is loaded into another layout), each
  parameter's residual moves to its new place.
* A non-finite value on any rank (``GradScaler``'s overflow steps) makes every rank
  restore its residuals from before the step and hand DDP a NaN, so every rank's
  ``GradScaler`` skips the step and the residuals are untouched.
* Gradients are divided by the world size before the sum, as DDP's own all-reduce does.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import GradBucket, ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from bunsan._validate import check_int, check_type
from bunsan.algorithms.data_parallel.buckets import Bucket
from bunsan.algorithms.data_parallel.quantized import (
    decode_pair,
    decode_stripes,
    encode_stripes,
    merge_owner_residual,
    reduce_owned_stripe,
)
from bunsan.algorithms.data_parallel.stripes import Stripes, build_stripes
from bunsan.comm import Traffic, all_gather_into, all_reduce, all_to_all, get_rank, get_world_size, wait
from bunsan.comm.layout import FlatGroup
from bunsan.compression import DEFAULT_CHUNK_SIZE, Quantizer
from bunsan.compression.rotation import ROTATED_CHUNK_SIZE, RotatedQuantizer
from bunsan.errors import CheckpointError

__all__ = ["QuantizedHookState", "quantized_hook"]

_WHICH = ("residual", "owner_residual")


class _Layout:
    """One DDP bucket as the striped exchange sees it: its parameters, buffers and a backup."""

    __slots__ = ("backup", "bucket", "merge", "owner_backup", "params", "stripes")

    def __init__(self, params: list[Tensor], bucket: Bucket, stripes: Stripes, merge: bool) -> None:
        self.params = params
        self.bucket = bucket
        self.stripes = stripes
        self.backup = torch.empty_like(stripes.residual)  # the residuals before this step (GradScaler)
        self.owner_backup = torch.empty_like(stripes.owner_residual)
        self.merge = merge  # owner residuals to hand to this layout's stripe owners (3+ ranks)

    def matches(self, params: list[Tensor], buffer: Tensor) -> bool:
        return (
            len(params) == len(self.params)
            and all(a is b for a, b in zip(params, self.params))
            and buffer.dtype == self.bucket.buffer.dtype
        )


class _Pending(NamedTuple):
    """A quantized bucket between its hook (phase 1 started) and the last bucket's (phases 2 and 3)."""

    layout: _Layout
    buffer: Tensor
    work: Any
    future: torch.futures.Future[Tensor]


class QuantizedHookState:
    """The state of :func:`quantized_hook`: bits, warm-up, residuals by parameter, counters.

    How to tune (as for ``DataParallelSGD(bits=...)``, docs/how-to/choose-algorithm.md):
    ``bits=1`` sends about a 32nd of the bytes of DDP's all-reduce; give it a warm-up of
    exact steps of about a third of training with SGD (the default when ``total_steps``
    is given), which keeps 1 bit's accuracy close to exact training. More bits (4, 8)
    lose less per step and need little or no warm-up (the default is none). Local
    momentum and its momentum cap (DataParallelSGD's ``local_momentum``), and 1-bit
    Adam, need the optimizer: wrap it in
    :class:`~bunsan.algorithms.data_parallel.hook_optimizer.HookOptimizer` with this state.

    Checkpoints: residuals differ by rank, so every rank saves and loads its own
    :meth:`state_dict`.

    Args:
        module: the model (the DDP-wrapped one or the module inside it); its parameter
            names key the residuals in :meth:`state_dict`.
        bits: 1..16 to quantize, or 32 for DDP's exact all-reduce (the same arithmetic as
            torch's ``allreduce_hook``).
        warmup_steps: optimizer steps (synchronized backward passes) averaged exactly
            before quantization starts, as PowerSGD's ``start_powerSGD_iter``. DDP does
            not tell a hook the batch size, so the count is in steps: DataParallelSGD's
            ``warm_start`` samples divided by the global batch. Default: a third of
            ``total_steps`` at 1 bit, 0 above.
        total_steps: the steps of the whole training, for the default warm-up.
        rotate: quantize each chunk after a fixed random rotation
            (:class:`bunsan.compression.RotatedQuantizer`). Default (None): as DataParallelSGD
            chooses, off, and on at 1 bit once a :class:`HookOptimizer` wraps Adam/AdamW
            (1-bit Adam needs it). The codec runs one call per segment on CPU and one per
            bucket on a GPU, as in DataParallelSGD.
        chunk_size: elements per quantization chunk (default 512, or 1024 rotated).
        grad_scaler: the ``torch.amp.GradScaler`` of the training, if any. Residuals are kept
            in the units of the scaled gradient the hook sees; when the scale changes (it
            halves after an overflow, doubles after a run of good steps) they are rescaled
            with it (a power of two: exact). Without it, a changing scale feeds residuals
            back at the wrong scale.
        group: process group of the DDP model; ``None`` means the world.

    Raises:
        ValueError: bad ``bits``, or ``bits=1`` with neither ``warmup_steps`` nor
            ``total_steps``.
    """

    __slots__ = (
        "_codec_default",
        "_decode_s",
        "_encode_s",
        "_exact_bytes",
        "_in_step",
        "_layouts",
        "_momentum",
        "_names",
        "_pending",
        "_quantized_bytes",
        "_quantizer",
        "_quantizing",
        "_scale",
        "_sent_finite",
        "_touched",
        "_views",
        "bits",
        "grad_scaler",
        "group",
        "quantized_steps",
        "skipped_steps",
        "step",
        "traffic",
        "warmup_steps",
    )

    def __init__(
        self,
        module: nn.Module,
        bits: int = 1,
        *,
        warmup_steps: int | None = None,
        total_steps: int | None = None,
        rotate: bool | None = None,
        chunk_size: int | None = None,
        grad_scaler: Any = None,
        group: ProcessGroup | None = None,
    ) -> None:
        check_type("module", module, nn.Module, hint="pass the model whose gradients the hook exchanges")
        check_int("bits", bits, hint="32 is exact, 1..16 quantize")
        if bits != 32 and not 1 <= bits <= 16:
            raise ValueError(f"bits must be 32 (exact) or 1..16 (quantized), got {bits}")
        check_int("warmup_steps", warmup_steps, minimum=0, allow_none=True, hint="exact steps before quantizing")
        check_int("total_steps", total_steps, minimum=1, allow_none=True, hint="the steps of the whole training")
        if rotate is not None:
            check_type("rotate", rotate, bool, hint="or None for the default")
        check_int("chunk_size", chunk_size, minimum=1, allow_none=True, hint="elements per quantization chunk")
        if warmup_steps is None:
            if total_steps is not None and bits == 1:
                warmup_steps = total_steps // 3
            elif bits == 1:
                raise ValueError(
                    "QuantizedHookState(bits=1) needs total_steps= (a third of training then averages exactly "
                    "first, as the docs recommend) or warmup_steps= (0 quantizes from the first step)"
                )
            else:
                warmup_steps = 0
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        self._names: dict[Tensor, str] = {p: name for name, p in inner.named_parameters()}
        self.bits = bits
        self.warmup_steps = int(warmup_steps)
        self.group = group
        self.grad_scaler = grad_scaler
        self._scale: float | None = None  # the gradient scale the residuals are in
        self.step = 0  # synchronized backward passes completed (DDP calls the hook in each)
        self.quantized_steps = 0
        self.skipped_steps = 0  # quantized steps that carried an inf or NaN on some rank
        self.traffic = Traffic()
        self._quantizer: Quantizer | RotatedQuantizer | None = None
        self._codec_default = rotate is None and chunk_size is None  # a HookOptimizer with Adam may rotate
        if bits != 32:
            codec = RotatedQuantizer if rotate else Quantizer
            default = ROTATED_CHUNK_SIZE if rotate else DEFAULT_CHUNK_SIZE
            self._quantizer = codec(bits, chunk_size if chunk_size is not None else default)
        self._layouts: dict[int, _Layout] = {}  # by DDP bucket index
        # per parameter name: its residual (a view of a bucket's, or a loaded tensor not yet placed)
        self._views: dict[str, dict[str, Tensor]] = {which: {} for which in _WHICH}
        self._in_step = False
        self._quantizing = False
        self._touched: list[_Layout] = []
        self._pending: list[_Pending] = []  # this step's quantized buckets, phase 1 under way
        self._sent_finite: list[Tensor] = []
        self._encode_s = self._decode_s = 0.0
        self._exact_bytes = self._quantized_bytes = 0
        self._momentum: Any = None  # a HookOptimizer's per-worker momentum (hook_optimizer.py), if attached

    def __repr__(self) -> str:
        return f"QuantizedHookState(bits={self.bits}, warmup_steps={self.warmup_steps}, step={self.step})"

    # -- per step --------------------------------------------------------------------
    def _begin_step(self) -> None:
        self._in_step = True
        self._quantizing = self._quantizer is not None and self.step >= self.warmup_steps
        self._touched = []
        self._sent_finite = []
        scaler = self.grad_scaler
        if self._quantizing and scaler is not None and scaler.is_enabled():
            scale = float(scaler.get_scale())
            if self._scale is not None and scale != self._scale:
                for which in _WHICH:  # one tensor per parameter: no element twice
                    for residual in self._views[which].values():
                        residual.mul_(scale / self._scale)
            self._scale = scale

    def _end_step(self, index: int, last: Tensor) -> None:
        """At the last bucket: agree on finiteness (collective), then commit or restore the residuals."""
        for stale in [i for i in self._layouts if i > index]:  # DDP rebuilt into fewer buckets
            del self._layouts[stale]
        if self._quantizing:
            local = 0.0 if all(bool(c) for c in self._sent_finite) else 1.0
            flag = torch.tensor([local], dtype=torch.float32, device=last.device)
            all_reduce(flag, group=self.group, traffic=self.traffic)  # same bucket, same order: every rank
            if self._momentum is not None:  # a HookOptimizer: commit (finite) or drop this step's momentum
                self._momentum.after_exchange(flag.item() == 0)
            if flag.item() > 0:
                for layout in self._touched:
                    layout.stripes.residual.copy_(layout.backup)
                    layout.stripes.owner_residual.copy_(layout.owner_backup)
                last.fill_(float("nan"))  # every rank's GradScaler sees it and skips the step
                self.skipped_steps += 1
            else:
                self.quantized_steps += 1
        self.step += 1
        self._in_step = False
        self._touched, self._sent_finite = [], []

    def _layout(self, index: int, params: list[Tensor], buffer: Tensor) -> _Layout:
        """The layout of DDP's bucket ``index``, built again (residuals carried by name) when DDP rebuilt it."""
        layout = self._layouts.get(index)
        if layout is not None and layout.matches(params, buffer):
            return layout
        assert self._quantizer is not None
        try:
            names = [self._names[p] for p in params]
        except KeyError:
            raise ValueError(
                "DDP's bucket holds a parameter that the module given to QuantizedHookState does not have: "
                "pass the model that DDP wraps"
            ) from None
        fields = FlatGroup.fields_of(list(zip(names, params)))
        if fields["numel"] != buffer.numel():
            raise ValueError(
                f"DDP's bucket {index} has {buffer.numel()} elements for parameters of {fields['numel']}: "
                "quantized_hook needs dense gradients"
            )
        bucket = Bucket(**fields, index=index, buffer=buffer)
        stripes = build_stripes(bucket, self._quantizer, get_world_size(self.group))
        for which in _WHICH:
            for name, view in zip(names, bucket.views(getattr(stripes, which))):
                old = self._views[which].get(name)
                if old is not None and old.shape == view.shape:
                    view.copy_(old)
                self._views[which][name] = view
        layout = _Layout(params, bucket, stripes, merge=get_world_size(self.group) > 2)
        self._layouts[index] = layout
        return layout

    # -- measurement and state --------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """This rank's counters: steps, bytes sent and received, collectives; ``compression_ratio``
        (what the quantized steps would have sent at 32 bits over what they sent), ``encode_s`` and
        ``decode_s`` (seconds in the codec), ``quantized_steps`` and ``skipped_steps``."""
        steps = max(self.step, 1)
        return {
            "steps": self.step,
            "quantized_steps": self.quantized_steps,
            "skipped_steps": self.skipped_steps,
            "bytes_sent": self.traffic.sent,
            "bytes_received": self.traffic.received,
            "bytes_sent_per_step": self.traffic.sent / steps,
            "collectives": self.traffic.calls,
            "compression_ratio": self._exact_bytes / self._quantized_bytes if self._quantized_bytes else 1.0,
            "encode_s": self._encode_s,
            "decode_s": self._decode_s,
        }

    def residuals(self) -> dict[str, dict[str, Tensor]]:
        """This rank's residuals by parameter name: ``{"residual": ..., "owner_residual": ...}`` (views)."""
        return {which: dict(self._views[which]) for which in _WHICH}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state for a checkpoint: step counters and residuals by parameter name (copies)."""
        return {
            "bits": self.bits,
            "world_size": get_world_size(self.group),
            "step": self.step,
            "quantized_steps": self.quantized_steps,
            "skipped_steps": self.skipped_steps,
            "scale": self._scale,
            "residuals": {which: {k: v.detach().clone() for k, v in self._views[which].items()} for which in _WHICH},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (this rank's), before or after the first step.

        Raises:
            CheckpointError: the checkpoint is for other bits or another number of ranks.
        """
        if int(state["bits"]) != self.bits:
            raise CheckpointError(f"the checkpoint's hook state has bits={state['bits']}, this one bits={self.bits}")
        if int(state["world_size"]) != get_world_size(self.group):
            raise CheckpointError(
                f"the checkpoint's hook state is from {state['world_size']} ranks, this group has "
                f"{get_world_size(self.group)}: residuals are per rank"
            )
        self.step = int(state["step"])
        self.quantized_steps = int(state.get("quantized_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._scale = state.get("scale")
        for which in _WHICH:
            saved = state["residuals"].get(which, {})
            live = self._views[which]
            for name, value in saved.items():
                view = live.get(name)
                if view is not None and view.shape == value.shape and view._base is not None:
                    view.copy_(value)  # in place: a view of a bucket's residual
                else:
                    live[name] = value.detach().clone()  # placed when its bucket is built
            for name in set(live) - set(saved):
                live[name].zero_()
        # the owner residuals were saved by the ranks that owned each stripe then
        for layout in self._layouts.values():
            layout.merge = get_world_size(self.group) > 2


def _completed(tensor: Tensor) -> torch.futures.Future[Tensor]:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def _exact(state: QuantizedHookState, buffer: Tensor) -> torch.futures.Future[Tensor]:
    """DDP's own all-reduce: divide by the world size, then sum (torch's ``allreduce_hook``)."""
    buffer.div_(get_world_size(state.group))
    work = all_reduce(buffer, group=state.group, async_op=True, traffic=state.traffic)
    if work is None:  # a group of one
        return _completed(buffer)
    return work.get_future().then(lambda future: future.value()[0])


def _launch(state: QuantizedHookState, index: int, params: list[Tensor], buffer: Tensor) -> _Pending:
    """Phase 1 of DataParallelSGD's striped exchange for one bucket: quantize, start the all-to-all."""
    quantizer = state._quantizer
    assert quantizer is not None
    group, traffic = state.group, state.traffic
    n, me = get_world_size(group), get_rank(group)
    layout = state._layout(index, params, buffer)
    q = layout.stripes
    if layout.merge:  # every rank rebuilt or loaded alike: the same collective everywhere
        merge_owner_residual(q, me, group=group, traffic=traffic)
        layout.merge = False
    layout.backup.copy_(q.residual)
    if n > 2:
        layout.owner_backup.copy_(q.owner_residual)
    else:
        layout.owner_backup.zero_()
    state._touched.append(layout)
    if state._momentum is not None:  # a HookOptimizer: this worker's momentum step, divided by n, in place
        state._momentum.before_encode(layout.bucket, buffer, n)
    else:
        buffer.div_(n)  # as DataParallelSGD copies a gradient in: divided before the sum
    start = time.perf_counter()
    # 1. quantize every stripe with this rank's residual; send stripe j to rank j (overlaps backward)
    encode_stripes(quantizer, q, buffer, feedback=True)
    state._encode_s += time.perf_counter() - start
    state._sent_finite.append(q.sent_finite())
    sent_before = traffic.sent
    work = all_to_all(q.received, q.send, group=group, traffic=traffic, async_op=True)
    state._quantized_bytes += traffic.sent - sent_before
    return _Pending(layout, buffer, work, torch.futures.Future())


def _finish(state: QuantizedHookState, pending: _Pending) -> None:
    """Phases 2 and 3 for one bucket whose all-to-all was started: the gradient into its buffer."""
    quantizer = state._quantizer
    assert quantizer is not None
    group, traffic = state.group, state.traffic
    n, me = get_world_size(group), get_rank(group)
    q, buffer = pending.layout.stripes, pending.buffer
    wait(pending.work, "quantized gradient exchange")
    sent_before = traffic.sent
    start = time.perf_counter()
    if n == 2:
        # 2-3. each rank shares its own payload of the stripe it owns; both decode the sum in rank order
        all_gather_into(q.gathered, q.send[me * q.payload : (me + 1) * q.payload], group=group, traffic=traffic)
        decode_pair(quantizer, q, me, n, buffer)
        state._exact_bytes += buffer.numel() * 4
    else:
        # 2. the owner sums its stripe and re-quantizes the mean with its own residual
        reduce_owned_stripe(quantizer, q, me, n, n, feedback=True)
        # 3. the owners' stripes to everyone, decoded alike on every rank
        all_gather_into(q.gathered, q.own_payload, group=group, traffic=traffic)
        decode_stripes(quantizer, q, buffer)
        state._exact_bytes += int(2 * (n - 1) / n * buffer.numel() * 4)
    state._decode_s += time.perf_counter() - start
    state._quantized_bytes += traffic.sent - sent_before


def quantized_hook(state: QuantizedHookState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: DataParallelSGD's N-bit exchange with error feedback, by stripes. Collective.

    Register it with ``ddp_model.register_comm_hook(state, quantized_hook)``; see
    :class:`QuantizedHookState` and docs/how-to/ddp-hooks.md. During the warm-up (and with
    ``bits=32``) it is DDP's exact all-reduce. A quantized bucket's all-to-all starts in its
    own hook and overlaps the rest of backward; the last bucket's hook completes every bucket
    in index order (phases 2 and 3), agrees on finiteness and completes their futures.
    """
    buffer = bucket.buffer()
    if not state._in_step:
        state._begin_step()
    if state._quantizing:
        launched = _launch(state, bucket.index(), bucket.parameters(), buffer)
        state._pending.append(launched)
        future = launched.future
    else:
        future = _exact(state, buffer)
    if bucket.is_last():
        pending, state._pending = state._pending, []
        try:
            for each in pending:  # bucket order, the same on every rank: the collectives match
                _finish(state, each)
            state._end_step(bucket.index(), buffer)
        except Exception as e:  # DDP waits on every future: none may stay pending
            for each in pending:
                each.future.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as the result
            raise
        for each in pending:
            each.future.set_result(each.buffer)
    return future


# DDP's register_comm_hook compares the annotations with the real types, and this module's
# (``from __future__ import annotations``) are strings.
quantized_hook.__annotations__.update({"bucket": GradBucket, "return": torch.futures.Future[Tensor]})
