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
* The exchange completes before ``loss.backward()`` returns: the first gradient
  hook of a backward queues a callback on the autograd engine, which launches
  the buckets still waiting (parameters this backward did not reach), waits for
  every bucket and sets ``p.grad`` to the average. Code between backward and
  ``optimizer.step()`` (clipping, ``GradScaler``) sees the global gradient, as
  with DDP.
* Unused parameters need no flag: a parameter without a gradient on a rank
  contributes zeros and a flag 0; the flags are summed with the gradients. A
  parameter no rank used keeps ``grad = None`` (so momentum and weight decay do
  not move it, as in one process); one used by some ranks gets the average over
  all ranks, as DDP does.
* Every step also sums ``(samples, active ranks, gradient flags, buffer flags)``:
  slots at the end of the last bucket (or a separate float64 all-reduce when that
  bucket is compressed). The global sample count is exact, and a rank that has
  run out of data (:meth:`join`) contributes zeros without biasing the average,
  which is taken over the active ranks only. Buffers that changed on any rank
  (BatchNorm statistics) are then averaged (:mod:`bunsan.algorithms.buffers`).
* After the step a parameter's ``.grad`` is a view of its bucket: the reduced
  gradient is not copied back, and the next backward's gradient is copied in
  with the division by the world size fused into the copy.
* Gradients are divided by the world size before the sum, so a half-precision
  sum cannot overflow where the mean would not.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_choice, check_int, check_number, check_type
from bunsan.algorithms.base import Algorithm
from bunsan.algorithms.onebit_adam import FrozenVarianceAdam, is_adam, warm_up_steps
from bunsan.comm import all_gather_into, all_reduce, all_to_all, broadcast_tensors, get_rank, global_rank, wait
from bunsan.comm.layout import FlatGroup
from bunsan.compression import DEFAULT_CHUNK_SIZE, Quantizer
from bunsan.compression.rotation import ROTATED_CHUNK_SIZE, RotatedQuantizer

__all__ = ["DataParallelSGD", "plan_stripes"]

_COMPRESSIONS = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}
_FIRST_BUCKET_MB = 1.0  # a small first bucket starts communication early in backward
# SGD momentum from which 1-bit training is warned about (docs/design-notes.md, "1 bit and
# heavy momentum"): measured on MNIST-1D at 4 workers with a warm start, 0.5 stayed within
# 2 points of exact SGD at 3 seeds, 0.7 at 2 of 3 (3.2 points at the third), 0.9 at none.
HEAVY_MOMENTUM_1BIT = 0.7
# The SGD momentum the workers apply while exchanging 1-bit gradients, at most (the step
# lr / (1 - momentum) is kept): error feedback delays part of every update, and delay acts as
# extra momentum (Mitliagkas et al. 2016); docs/design-notes.md, "1-bit defaults".
QUANTIZED_MOMENTUM_1BIT = 0.5


@dataclass
class _Bucket(FlatGroup):
    index: int
    buffer: Tensor  # flat gradients of ``params``, in this order
    ready: set[int] = field(default_factory=set)  # positions whose gradient hook fired in this round
    filled: bool = False  # every position's gradient (divided by the world size) is in ``buffer``
    work: Any = None
    wire: Tensor | None = None  # what travels (a half-precision copy, or ``buffer`` itself)
    with_meta: Tensor | None = None  # ``buffer`` plus the metadata slots, one allocation
    meta: Tensor | None = None  # the slots: samples, active ranks, gradient flags, buffer flags
    slots: list[Tensor] = field(default_factory=list)  # each parameter's gradient slot in ``buffer``
    indices: list[int] = field(default_factory=list)  # each parameter's position in the gradient flags


Segment = tuple[int, int, int]  # (offset in the bucket, length, offset in the stripe's payload)


def plan_stripes(numels: Sequence[int], chunk: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Cut a bucket of parameters into ``world_size`` stripes of whole quantization chunks.

    Each parameter is cut into chunks of ``chunk`` elements, its last chunk shorter;
    the chunks, in bucket order, are dealt out in contiguous runs, as evenly as the
    chunk count allows. A stripe is a list of ``(offset, length)`` segments of the
    flat bucket, each inside one parameter and ending on a chunk boundary or at the
    parameter's end, so every segment can be encoded as a vector of its own and no
    chunk mixes two parameters or contains padding. (A zero-padded chunk would be
    wrong at 1 bit: the padding would dilute the non-negative mean, and positive
    gradients of a small parameter would never be applied.)

    Returns:
        ``world_size`` lists of segments; a stripe may be empty when there are fewer
        chunks than ranks.
    """
    chunks: list[tuple[int, int, int]] = []  # (parameter, offset in bucket, length)
    offset = 0
    for index, numel in enumerate(numels):
        for lo in range(0, numel, chunk):
            chunks.append((index, offset + lo, min(chunk, numel - lo)))
        offset += numel
    stripes: list[list[tuple[int, int]]] = []
    for r in range(world_size):
        mine = chunks[r * len(chunks) // world_size : (r + 1) * len(chunks) // world_size]
        segments: list[tuple[int, int]] = []
        last_param = -1
        for param, lo, length in mine:
            if segments and param == last_param and segments[-1][0] + segments[-1][1] == lo:
                segments[-1] = (segments[-1][0], segments[-1][1] + length)
            else:
                segments.append((lo, length))
            last_param = param
        stripes.append(segments)
    return stripes


@dataclass
class _Stripes:
    """Buffers of one bucket's quantized exchange, allocated once.

    Rank ``r`` owns stripe ``r`` (see :func:`plan_stripes`). Every stripe's payload
    is padded to the largest, ``payload`` bytes, so the exchange has equal slices.
    """

    segments: list[list[Segment]]  # per stripe: (offset in bucket, length, offset in payload)
    payload: int  # bytes of one stripe's payload (the largest; the others are padded)
    residual: Tensor  # float32, bucket-sized: what this rank's encoding dropped
    owner_residual: Tensor  # float32, bucket-sized: nonzero only in the owned stripe
    send: Tensor  # uint8 [world_size x payload]
    received: Tensor  # uint8 [world_size x payload]
    summed: Tensor  # float32 [largest stripe]
    scratch: Tensor  # float32 [largest stripe]
    own_payload: Tensor  # uint8 [payload]
    gathered: Tensor  # uint8 [world_size x payload]
    work: Any = None


def _build_buckets(named_params: Sequence[tuple[str, Tensor]], cap_bytes: int, meta_slots: int = 2) -> list[_Bucket]:
    """Group parameters into buckets, last layers first (their gradients are ready first).

    Every bucket's storage has ``meta_slots`` trailing elements; only the last
    bucket's are used (see :meth:`DataParallelSGD.setup`).
    """
    buckets: list[_Bucket] = []
    current: dict[tuple[torch.dtype, torch.device], list[tuple[str, Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}

    def close(key: tuple[torch.dtype, torch.device]) -> None:
        members = current.pop(key, [])
        sizes.pop(key, None)
        if not members:
            return
        fields = FlatGroup.fields_of(members)
        storage = torch.zeros(fields["numel"] + meta_slots, dtype=key[0], device=key[1])
        buckets.append(
            _Bucket(
                **fields,
                index=len(buckets),
                buffer=storage[: fields["numel"]],
                with_meta=storage,
                meta=storage[fields["numel"] :],
            )
        )

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

    With ``bits`` in 1..16 each gradient plus its residual is quantized per chunk
    (1 bit: a sign and two reconstruction values per chunk, the means of the
    non-negative and of the negative entries, Seide et al. 2014, "1-Bit Stochastic
    Gradient Descent and its Application to Data-Parallel Distributed Training of
    Speech DNNs"; more bits: levels over the chunk, see :mod:`bunsan.compression`).
    What quantization drops is kept as a residual and added to the next step's
    gradient (error feedback), so nothing is lost, only delayed. The exchange is by
    stripes, so the bytes each rank sends stay flat as ranks are added:

    1. each rank quantizes stripe ``j`` of its gradient (with its residual) and
       sends it to rank ``j`` (all-to-all);
    2. rank ``j`` decodes and sums its stripe from every rank, divides by the
       number of active ranks, and quantizes the mean with a second residual of its
       own;
    3. the owners' stripes are all-gathered and decoded on every rank, so every
       replica applies the same gradient.

    Args:
        bits: 32 for exact full-precision averaging, or 1..16 for quantized gradients.
        compression: with ``bits=32`` only: ``None``, ``"fp16"`` or ``"bf16"``;
            gradients travel in half precision (half the bytes).
        warm_start: samples (global count, all ranks together) trained with exact
            averaging before quantization starts (CNTK's ``distributed_after``); rank 0
            prints the switch.
        error_feedback: keep the residuals (the default). ``False`` drops what
            quantization loses; it exists for tests and research.
        local_momentum: with ``bits < 32`` and a ``torch.optim.SGD`` optimizer that
            has momentum or weight decay, take the momentum step on each worker
            *before* compression and hand the optimizer the averaged result with its
            momentum and weight decay set to zero for that step (Zheng et al. 2019,
            "Communication-Efficient Distributed Blockwise Momentum SGD with
            Error-Feedback"). Without compression this is exactly momentum SGD
            (averaging commutes with the momentum recursion); with it, the error
            feedback corrects the transmitted momentum itself instead of having its
            delays amplified by the momentum afterwards. Measured on MNIST-1D, 4
            workers, momentum 0.9: with the momentum after decompression 1-bit
            training diverged to chance; see docs/design-notes.md. Default True.
        chunk_size: elements per quantization chunk (default: 1024 when rotating, else
            the codec's 512).
        rotate: quantize every chunk after a fixed random rotation (random signs, then
            Walsh-Hadamard; DRIVE, Vargaftik et al. 2021), with the residual kept in
            the original coordinates (:mod:`bunsan.compression.rotation`). Default
            (None): on for ``bits=1``, off otherwise. Same bytes;
            heavy-tailed chunks lose far less, which is what 1 bit with SGD momentum
            0.9 needs (docs/design-notes.md). Costs ``log2(chunk_size)`` butterfly
            passes each way; ``chunk_size`` must be a power of two.
        quantized_momentum: with SGD momentum ``beta`` and local momentum, the momentum the
            workers apply while quantizing, at most; the gradient is scaled by
            ``(1 - applied) / (1 - beta)`` so that the step ``lr / (1 - beta)`` is kept.
            ``"auto"`` (default): 0.5 for ``bits=1``, None (the optimizer's) otherwise;
            measured in docs/design-notes.md, "1-bit defaults".
        bucket_size_mb: approximate size of one message.
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
        error_feedback: bool = True,
        local_momentum: bool = True,
        chunk_size: int | None = None,
        rotate: bool | None = None,
        quantized_momentum: float | str | None = "auto",
        bucket_size_mb: float = 25.0,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(group=group)
        check_int("bits", bits, hint="32 is exact, 1..16 quantize")
        if bits != 32 and not 1 <= bits <= 16:
            raise ValueError(f"bits must be 32 (exact) or 1..16 (quantized), got {bits}")
        check_choice("compression", compression, _COMPRESSIONS, hint="half-precision traffic with bits=32")
        if compression is not None and bits != 32:
            raise ValueError(f"compression={compression!r} applies to bits=32 only; bits={bits} quantizes already")
        check_int("warm_start", warm_start, minimum=0, hint="samples, all workers together, before quantizing")
        if warm_start and bits == 32:
            warnings.warn("warm_start has no effect with bits=32 (the exchange is exact anyway)", stacklevel=2)
        check_number("bucket_size_mb", bucket_size_mb, minimum=0.0, min_inclusive=False, hint="MiB per message")
        check_int("chunk_size", chunk_size, minimum=1, allow_none=True, hint="elements per quantization chunk")
        if rotate is not None:
            check_type("rotate", rotate, bool, hint="or None for the default")
        self.bits = bits
        self.compression = compression
        self.warm_start = int(warm_start)
        self.error_feedback = bool(error_feedback)
        self.local_momentum = bool(local_momentum)
        self._momentum: dict[str, Tensor] = {}  # this worker's momentum buffers (quantized steps)
        self._name_of: dict[Tensor, str] = {}
        self._group_of: dict[Tensor, dict[str, Any]] = {}
        self._held: list[tuple[dict[str, Any], dict[str, Any]]] = []  # param groups whose momentum we hold
        self._adam: FrozenVarianceAdam | None = None  # quantized steps of an Adam/AdamW optimizer (1-bit Adam)
        self._adam_warm_steps: int | None = None  # warm_start=0 with Adam: this many exact steps first
        self.bucket_size_mb = float(bucket_size_mb)
        if rotate and bits == 32:
            raise ValueError("rotate=True applies to quantized gradients (bits 1..16)")
        self.rotate = bits == 1 if rotate is None else bool(rotate)  # docs/design-notes.md, "1-bit defaults"
        if quantized_momentum == "auto":
            quantized_momentum = QUANTIZED_MOMENTUM_1BIT if bits == 1 else None
        hint = "'auto', None, or a momentum in [0, 1)"
        if isinstance(quantized_momentum, str):
            check_choice("quantized_momentum", quantized_momentum, ("auto",), hint=hint)
        check_number(
            "quantized_momentum",
            quantized_momentum,
            minimum=0.0,
            maximum=1.0,
            max_inclusive=False,
            allow_none=True,
            hint=hint,
        )
        self.quantized_momentum = None if quantized_momentum is None else float(quantized_momentum)
        codec = RotatedQuantizer if self.rotate else Quantizer
        if chunk_size is None:
            chunk_size = ROTATED_CHUNK_SIZE if self.rotate else DEFAULT_CHUNK_SIZE
        self._quantizer = None if bits == 32 else codec(bits, chunk_size)
        self.quantizing = False  # this step's exchange is quantized (decided identically on every rank)
        self._stripes: dict[int, _Stripes] = {}
        self._loaded_residuals: dict[str, dict[str, Tensor]] | None = None
        self._merge_owner_residuals = False
        self._encode_s = self._decode_s = 0.0
        self._exact_bytes = 0  # what the quantized steps would have sent at 32 bits
        self._quantized_bytes = 0
        self._buckets: list[_Bucket] = []
        self._next_launch = 0
        self._accumulating = False
        self._hook_handles: list[Any] = []
        self._round: tuple[int, float] | None = None  # (samples, active) of the round under way
        self._separate_meta: Tensor | None = None
        self._index: dict[Tensor, int] = {}  # parameter -> its gradient flag's position
        self._has_grad: list[float] = []  # this round: 1.0 where this rank sends a gradient
        self._callback_queued = False  # the current backward will complete the exchange
        self._exchanged = False  # an exchange completed since the last optimizer step
        self._last_quantized = False  # that exchange was quantized (momentum already applied)

    def __repr__(self) -> str:
        rotate = ", rotate=True" if self.rotate else ""
        return (
            f"DataParallelSGD(bits={self.bits}, compression={self.compression!r}, warm_start={self.warm_start}{rotate})"
        )

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().attach_optimizer(optimizer)
        self._group_of = {}
        self._adam = None
        if self.bits == 32:
            return
        if is_adam(optimizer) and self.local_momentum:
            # 1-bit Adam (bunsan.algorithms.onebit_adam): exact warm-up, then frozen variance.
            self._adam = FrozenVarianceAdam(optimizer)
            if self.warm_start == 0:
                self._adam_warm_steps = warm_up_steps(optimizer)
                self.warm_start = 2**62  # set in samples after the first step (after_step)
                self._update_mode()
                if get_rank(self.group) == 0:
                    warnings.warn(
                        f"DataParallelSGD(bits={self.bits}) with {type(optimizer).__name__} and warm_start=0: Adam's "
                        f"variance must be estimated from exact gradients before it is frozen (1-bit Adam, Tang et "
                        f"al. 2021), so the first {self._adam_warm_steps} steps (1 / (1 - beta2)) average exactly. "
                        "Pass warm_start=<samples> to choose, e.g. the samples of the learning-rate warm-up "
                        "(0/1 Adam, Lu et al. 2022)",
                        stacklevel=3,
                    )
            return
        if not isinstance(optimizer, torch.optim.SGD):
            if get_rank(self.group) == 0:
                why = (
                    "local_momentum=False: it"
                    if is_adam(optimizer)
                    else "it is neither torch.optim.SGD (momentum taken per worker before compression) nor Adam/AdamW "
                    "(frozen variance, 1-bit Adam), so it"
                )
                warnings.warn(
                    f"DataParallelSGD(bits={self.bits}) with {type(optimizer).__name__}, {why} gets the decoded "
                    "average gradient, and an optimizer with per-coordinate statistics (Adam, Adagrad, RMSprop, ...) "
                    "folds the quantization error into them and loses accuracy (Tang et al. 2021). Use bits=32 (or "
                    "compression='bf16') for it",
                    stacklevel=3,
                )
            return
        if self.bits != 1 or self.rotate:
            return
        heavy = max((g["momentum"] for g in optimizer.param_groups), default=0.0)
        if heavy >= HEAVY_MOMENTUM_1BIT and get_rank(self.group) == 0:
            warnings.warn(
                f"DataParallelSGD(bits=1) with SGD momentum {heavy}: 1-bit error feedback delays part of "
                f"every gradient by several steps, and momentum >= {HEAVY_MOMENTUM_1BIT} leaves too little "
                "damping for such delays (MNIST-1D, 4 workers, momentum 0.9, 40,000-sample warm start, "
                "3 seeds: exact 9.0-11.2% test error, 1 bit 19.4-42.5%, 1 bit with rotate=True 9.5-12.3%). "
                "Use bits=2, or rotate=True (same bytes, more CPU), or momentum <= 0.5 with lr scaled to "
                "keep lr / (1 - momentum); see docs/design-notes.md",
                stacklevel=3,
            )

    def _update_mode(self) -> None:
        was = self.quantizing
        self.quantizing = self._quantizer is not None and self.samples >= self.warm_start
        if self.quantizing and not was and self.warm_start and get_rank(self.group) == 0:
            print(
                f"[bunsan] DataParallelSGD: {self.samples} samples trained (warm start {self.warm_start}); "
                f"switching to {self.bits}-bit gradients",
                flush=True,
            )

    # -- set-up -----------------------------------------------------------------
    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        super().setup(named_params)
        for handle in self._hook_handles:
            handle.remove()
        self._buckets = _build_buckets(self.named_params, int(self.bucket_size_mb * 2**20), self._meta_slots())
        # The per-step metadata (samples, active ranks, flags) rides in the last bucket when
        # that bucket travels uncompressed in float32/64 (exact for counts below 2**24);
        # otherwise it is a separate small float64 all-reduce.
        last = self._buckets[-1] if self._buckets else None
        rides = (
            last is not None
            and self.compression is None
            and self._quantizer is None
            and last.buffer.dtype in (torch.float32, torch.float64)
        )
        for bucket in self._buckets:
            if bucket is not last or not rides:
                bucket.with_meta = bucket.meta = None
        device = last.buffer.device if last is not None else torch.device("cpu")
        self._separate_meta = None if rides else torch.zeros(self._meta_slots(), dtype=torch.float64, device=device)
        self._index = {p: k for k, (_, p) in enumerate(self.named_params)}
        self._has_grad = [0.0] * len(self.named_params)
        self._n = self.world_size
        for b in self._buckets:
            b.slots = b.views(b.buffer)
            b.indices = [self._index[p] for p in b.params]
        self._name_of = {p: n for n, p in self.named_params}
        # Each hook knows its bucket and slot: no dictionary lookup per gradient.
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b, i))
            for b in self._buckets
            for i, p in enumerate(b.params)
        ]
        if self._quantizer is not None:
            self._stripes = {b.index: self._build_stripes(b) for b in self._buckets}
            if self._loaded_residuals is not None:
                self._apply_loaded_residuals()
        self._update_mode()

    def remove_hooks(self) -> None:
        """Stop exchanging gradients in backward (the block algorithms' warm start has ended)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def setup_buffers(self, modules: Sequence[tuple[str, Any, list[str]]]) -> None:
        super().setup_buffers(modules)
        if self._buckets:  # the metadata slots depend on the number of buffer modules
            self.setup(self.named_params)

    def _meta_slots(self) -> int:
        return 2 + len(self.named_params) + (len(self.buffer_sync) if self.buffer_sync is not None else 0)

    def _build_stripes(self, bucket: _Bucket) -> _Stripes:
        assert self._quantizer is not None
        if bucket.buffer.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(
                f"bits={self.bits} quantizes floating-point gradients only; {bucket.names[0]} is {bucket.buffer.dtype}"
            )
        n, device = self.world_size, bucket.buffer.device
        plan = plan_stripes([p.numel() for p in bucket.params], self._quantizer.chunk_size, n)
        segments: list[list[Segment]] = []
        for stripe in plan:
            position, placed = 0, []
            for lo, length in stripe:
                placed.append((lo, length, position))
                position += self._quantizer.payload_bytes(length)
            segments.append(placed)
        payload = max(
            max((pos + self._quantizer.payload_bytes(length) for _, length, pos in stripe), default=0)
            for stripe in segments
        )
        longest = max((sum(length for _, length, _ in stripe) for stripe in segments), default=0)
        numel = bucket.buffer.numel()

        def floats(k: int) -> Tensor:
            return torch.zeros(k, dtype=torch.float32, device=device)

        def octets(k: int) -> Tensor:
            return torch.zeros(k, dtype=torch.uint8, device=device)

        return _Stripes(
            segments,
            payload,
            floats(numel),
            floats(numel),
            octets(n * payload),
            octets(n * payload),
            floats(longest),
            floats(longest),
            octets(payload),
            octets(n * payload),
        )

    def begin_accumulation(self) -> None:
        self._accumulating = True

    def end_accumulation(self) -> None:
        self._accumulating = False

    # -- during backward ----------------------------------------------------------
    def _on_grad_ready(self, bucket: _Bucket, i: int, p: Tensor) -> None:
        if self._accumulating:
            return
        if not self._callback_queued:
            # The first gradient of this backward: finish the exchange when the
            # engine is done, before loss.backward() returns (as DDP does).
            self._callback_queued = True
            self._round = (self._take_local_samples(), 1.0)
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if self.quantizing:  # per-worker momentum and residuals: one parameter at a time
            self._copy_in(bucket, i)
            bucket.ready.add(i)
            if len(bucket.ready) == len(bucket.params):
                bucket.filled = True
                self._launch_in_order()
            return
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            self._fill(bucket)
            self._launch_in_order()

    def _fill(self, bucket: _Bucket) -> None:
        """Copy a complete bucket's gradients in with two fused calls, then divide it once.

        Every parameter of the bucket has a gradient (its hook fired), so the
        per-parameter work of the hook is one set insertion: the copies are one
        ``_foreach_copy_`` over the bucket and the division one ``div_`` (a gradient
        that already lives in the bucket is copied onto itself).
        """
        torch._foreach_copy_(bucket.slots, [p.grad for p in bucket.params])
        bucket.buffer.div_(self._n)
        for index in bucket.indices:
            self._has_grad[index] = 1.0
        bucket.filled = True

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self._exchange(active=True)

    def _copy_in(self, bucket: _Bucket, i: int) -> None:
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
            torch.div(self._momentum_step(p, grad, group), self._n, out=view)
        elif grad.data_ptr() == view.data_ptr():
            view.div_(self._n)  # the gradient already lives in the bucket
        else:
            torch.div(grad, self._n, out=view)

    def _momentum_group(self, p: Tensor) -> dict[str, Any] | None:
        """The SGD param group whose momentum this worker applies before compression, if any."""
        if not (self.quantizing and self.local_momentum):
            return None
        if self._adam is None and not isinstance(self.optimizer, torch.optim.SGD):
            return None
        if not self._group_of:
            self._group_of = {q: g for g in self.optimizer.param_groups for q in g["params"]}
        group = self._group_of.get(p)
        if group is None or (self._adam is None and group["momentum"] == 0 and group["weight_decay"] == 0):
            return None
        return group

    def _momentum_step(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> Tensor:
        """torch.optim.SGD's (or Adam's) momentum arithmetic, on this worker's own gradient."""
        if self._adam is not None:
            return self._adam.momentum_step(
                self._momentum, self._name_of[p], p, grad, group, cap=self.quantized_momentum
            )
        d = -grad if group.get("maximize") else grad
        if group["weight_decay"]:
            d = d.add(p.detach(), alpha=group["weight_decay"])
        beta = group["momentum"]
        if beta == 0:
            return d
        # While quantizing, the workers' momentum may be lower than the optimizer's (see
        # quantized_momentum), with the gradient scaled by keep = (1 - applied) / (1 - beta)
        # so that the steady step lr / (1 - beta) is the same. keep = 1 when they agree.
        applied = beta if self.quantized_momentum is None else min(beta, self.quantized_momentum)
        keep = (1 - applied) / (1 - beta)
        name = self._name_of[p]
        buf = self._momentum.get(name)
        if buf is None:
            # At the switch from exact averaging the optimizer's buffer is the global
            # momentum, equal on every rank: continue from it, so the mean of the
            # workers' buffers follows the same recursion. Else start as torch does.
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            held = state.get("momentum_buffer")
            if held is not None:
                buf = held.detach().clone().mul_(applied).add_(d, alpha=keep * (1 - group["dampening"]))
            else:
                buf = d.detach().clone().mul_(keep)
            self._momentum[name] = buf
        else:
            buf.mul_(applied).add_(d, alpha=keep * (1 - group["dampening"]))
        return d.mul(keep).add_(buf, alpha=applied) if group["nesterov"] else buf

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

    def after_step(self) -> None:
        for group, saved in self._held:
            group.update(saved)
        self._held = []
        if self._adam is not None:
            self._adam.apply()
            if self._adam_warm_steps is not None and self.samples > 0:
                # The default warm-up was in steps: now that a step's samples are known, in samples.
                self.warm_start = self._adam_warm_steps * self.samples // (self.step + 1)
                self._adam_warm_steps = None
                self._update_mode()

    def _launch_in_order(self) -> None:
        # Same order on every rank: bucket k leaves only after buckets 0..k-1.
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        if self.quantizing:
            self._launch_stripes(bucket)
            return
        dtype = _COMPRESSIONS[self.compression]
        if dtype is None:
            bucket.wire = bucket.buffer if bucket.meta is None else bucket.with_meta
        else:
            bucket.wire = bucket.buffer.to(dtype)
        if bucket.meta is not None:
            self._fill_meta(bucket.meta)
        bucket.work = all_reduce(bucket.wire, group=self.group, async_op=True, traffic=self.traffic)

    def _fill_meta(self, meta: Tensor) -> None:
        """This rank's (samples, active, gradient flags, buffer flags), in ``meta``'s dtype."""
        assert self._round is not None
        samples, active = self._round
        values = [float(samples), float(active), *self._has_grad]
        if self.buffer_sync is not None:
            values += self.buffer_sync.changed() if active else [0.0] * len(self.buffer_sync)
        meta.copy_(torch.tensor(values, dtype=meta.dtype))

    def _launch_stripes(self, bucket: _Bucket) -> None:
        """Phase 1: quantize every stripe (with this rank's residual) and send it to its owner."""
        assert self._quantizer is not None
        quantizer, q = self._quantizer, self._stripes[bucket.index]
        active = self._round is None or self._round[1] > 0
        values = bucket.buffer if bucket.buffer.dtype == torch.float32 else bucket.buffer.float()
        start = time.perf_counter()
        for j, stripe in enumerate(q.segments):
            base = j * q.payload
            for lo, length, at in stripe:
                out = q.send[base + at : base + at + quantizer.payload_bytes(length)]
                if active and self.error_feedback:
                    quantizer.encode_with_feedback(values[lo : lo + length], q.residual[lo : lo + length], out=out)
                else:  # a joined rank sends zeros and keeps its residual for nobody
                    quantizer.encode(values[lo : lo + length], out=out)
        self._encode_s += time.perf_counter() - start
        q.work = all_to_all(q.received, q.send, group=self.group, traffic=self.traffic, async_op=True)
        bucket.work = q.work

    def _finish_stripes(self, n_active: int) -> None:
        """Phases 2 and 3: owners sum, re-quantize and share their stripes; all decode."""
        assert self._quantizer is not None
        quantizer, n, me = self._quantizer, self.world_size, get_rank(self.group)
        for bucket in self._buckets:
            wait(self._stripes[bucket.index].work, "quantized gradient exchange")
        if n_active == 0:  # every rank has joined: the round carried nothing (same on every rank)
            return
        if self._merge_owner_residuals:
            self._merge_loaded_owner_residuals()
        if n == 2:
            self._finish_two_ranks(n_active)
            return
        for bucket in self._buckets:
            q = self._stripes[bucket.index]
            start = time.perf_counter()
            position = 0
            for lo, length, at in q.segments[me]:
                summed = q.summed[position : position + length]
                size = quantizer.payload_bytes(length)
                # rank order: the same sum on whichever rank owns the stripe
                quantizer.decode_sum([q.received[i * q.payload + at :][:size] for i in range(n)], length, summed)
                if n_active != n:  # gradients were divided by n before sending; the mean is over active ranks
                    summed.mul_(n / n_active)
                out = q.own_payload[at : at + quantizer.payload_bytes(length)]
                if self.error_feedback:
                    quantizer.encode_with_feedback(summed, q.owner_residual[lo : lo + length], out=out)
                else:
                    quantizer.encode(summed, out=out)
                position += length
            self._decode_s += time.perf_counter() - start
            q.work = all_gather_into(q.gathered, q.own_payload, group=self.group, traffic=self.traffic, async_op=True)
        for bucket in self._buckets:
            q = self._stripes[bucket.index]
            wait(q.work, "quantized gradient gather")
            start = time.perf_counter()
            decoded = bucket.buffer if bucket.buffer.dtype == torch.float32 else None
            for j, stripe in enumerate(q.segments):
                for lo, length, at in stripe:
                    base = j * q.payload + at
                    payload = q.gathered[base : base + quantizer.payload_bytes(length)]
                    if decoded is not None:
                        quantizer.decode(payload, length, out=decoded[lo : lo + length])
                    else:
                        bucket.buffer[lo : lo + length].copy_(quantizer.decode(payload, length))
            self._decode_s += time.perf_counter() - start
            q.work = None
            self._exact_bytes += int(2 * (n - 1) / n * bucket.buffer.numel() * 4)

    def _finish_two_ranks(self, n_active: int) -> None:
        """Phases 2 and 3 for 2 ranks: no second quantization, at the same bytes.

        Each rank sends its own first-stage payload of the stripe it owns, instead of
        the owner's re-quantized sum: with 2 ranks that is as many bytes (half a
        payload each way in each phase), and every rank then holds both ranks'
        payloads of both stripes and decodes their sum in rank order, so the replicas
        agree bit for bit. What the owner's second quantization dropped (as much again
        as the first, and the larger part of 1 bit's loss of accuracy with heavy
        momentum: docs/design-notes.md) is not dropped at all; the owners' residuals
        stay zero.
        """
        assert self._quantizer is not None
        quantizer, me = self._quantizer, get_rank(self.group)
        other = 1 - me
        for bucket in self._buckets:
            q = self._stripes[bucket.index]
            q.work = all_gather_into(
                q.gathered,
                q.send[me * q.payload : (me + 1) * q.payload],
                group=self.group,
                traffic=self.traffic,
                async_op=True,
            )
        for bucket in self._buckets:
            q = self._stripes[bucket.index]
            wait(q.work, "quantized gradient gather")
            start = time.perf_counter()
            for j, stripe in enumerate(q.segments):
                # Stripe j's first-stage payloads: mine is in send; the other rank's came in phase 1
                # (j == me, in received) or now (j == other, in gathered, which it owns).
                theirs = q.received[other * q.payload :] if j == me else q.gathered[j * q.payload :]
                sources = {me: q.send[j * q.payload :], other: theirs}
                direct = bucket.buffer.dtype == torch.float32
                for lo, length, at in stripe:
                    size = quantizer.payload_bytes(length)
                    summed = bucket.buffer[lo : lo + length] if direct else q.scratch[:length]
                    # rank order: the same sum on both ranks
                    quantizer.decode_sum([sources[r][at : at + size] for r in (0, 1)], length, summed)
                    if n_active != 2:  # gradients were divided by 2 before sending; the mean is over active ranks
                        summed.mul_(2 / n_active)
                    if not direct:
                        bucket.buffer[lo : lo + length].copy_(summed)
            self._decode_s += time.perf_counter() - start
            q.work = None
            self._exact_bytes += int(bucket.buffer.numel() * 4)  # 2 * (n - 1) / n * numel * 4 at n = 2

    # -- in optimizer.step() ------------------------------------------------------
    def _exchange(self, *, active: bool) -> int:
        """Complete one synchronization round: all buckets and the metadata.

        Started by the gradient hooks during backward (``self._round`` is set) or,
        when no backward reached a parameter on this rank, here. Returns the number
        of ranks that trained in this round.
        """
        if self._round is None:
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
        self._launch_in_order()
        meta_work = None
        if self._separate_meta is not None:
            self._fill_meta(self._separate_meta)
            meta_work = all_reduce(self._separate_meta, group=self.group, async_op=True, traffic=self.traffic)
        if self.buffer_sync is not None:
            self.buffer_sync.launch_riding(contribute=active)  # beside the gradients: no extra wait
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
        self.samples += int(round(sums[0]))
        n_active = int(round(sums[1]))
        n_params = len(self.named_params)
        used = sums[2 : 2 + n_params]
        if quantized:
            self._finish_stripes(n_active)  # also does the scaling to the active ranks
            self._quantized_bytes += self.traffic.sent - sent_before
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
        if self.buffer_sync is not None:
            self.buffer_sync.finish_riding(n_active)
            self.buffer_sync.average(sums[2 + n_params :], contribute=active, contributors=n_active, ride=True)
        for bucket in self._buckets:
            bucket.ready, bucket.work, bucket.wire, bucket.filled = set(), None, None, False
        self._next_launch = 0
        self._exchanged = True
        self._last_quantized = quantized and active
        self._update_mode()  # the same global count on every rank: the same decision
        return n_active

    def complete_exchange(self) -> None:
        """Collective. Run this step's exchange now if no backward has completed one."""
        if not self._exchanged:
            if self._callback_queued:
                raise RuntimeError("optimizer.synchronize() was called during backward")
            self._exchange(active=True)

    def reduce_gradients(self) -> None:
        """Collective (in ``optimizer.step()``). The exchange normally completed in backward already."""
        self.complete_exchange()
        self._exchanged = False
        if self._last_quantized:
            self._hold_momentum()  # the workers applied momentum before compression

    def join(self) -> None:
        """Collective. Answer the other ranks' gradient exchanges with zeros until all have joined.

        A rank that joined early missed the steps the others took after it: when
        every rank has joined, the model (parameters and buffers) of the rank that
        trained longest is broadcast to all, so every replica ends equal (DDP's join
        does the same). With even data nothing is sent.
        """
        while self._exchange(active=False) > 0:
            self._exchanged = False
        self._exchanged = False
        self._equalize_after_join()

    @torch.no_grad()
    def _equalize_after_join(self) -> None:
        n, me = self._n, get_rank(self.group)
        if n == 1 or not self.named_params:
            return
        device = self._buckets[0].buffer.device if self._buckets else torch.device("cpu")
        # Highest step count wins, the lowest rank among equals; and the lowest step count.
        votes = torch.tensor(
            [float(self.step * n + (n - 1 - me)), float(-self.step)], dtype=torch.float64, device=device
        )
        all_reduce(votes, op="max", group=self.group, traffic=self.traffic)
        most, fewest = int(votes[0].item()), -int(votes[1].item())
        if most // n == fewest:
            return  # every rank took the same steps: the replicas are equal already
        src = n - 1 - most % n
        tensors = [p.detach() for p in self.params]
        if self.buffer_sync is not None:
            tensors += [b for i in range(len(self.buffer_sync)) for b in self.buffer_sync._buffers(i)]
        broadcast_tensors(tensors, src=global_rank(self.group, src), group=self.group, traffic=self.traffic)

    # -- measurement and state ------------------------------------------------------
    def stats(self) -> dict[str, float]:
        stats = super().stats()
        if self._quantizer is not None:
            stats["compression_ratio"] = self._exact_bytes / self._quantized_bytes if self._quantized_bytes else 1.0
            stats["encode_s"] = self._encode_s
            stats["decode_s"] = self._decode_s
        return stats

    def _residual_views(self, which: str) -> dict[str, Tensor]:
        """Per-parameter views of a residual buffer: residuals are keyed by name."""
        views = {}
        for bucket in self._buckets:
            views.update(zip(bucket.names, bucket.views(getattr(self._stripes[bucket.index], which))))
        return views

    def residuals(self) -> dict[str, dict[str, Tensor]]:
        """This rank's residuals by parameter name: ``{"residual": ..., "owner_residual": ...}``."""
        if self._quantizer is None or not self._stripes:
            return {"residual": {}, "owner_residual": {}}
        return {which: self._residual_views(which) for which in ("residual", "owner_residual")}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(bits=self.bits, compression=self.compression, warm_start=self.warm_start)
        state["residuals"] = {
            which: {k: v.clone() for k, v in views.items()} for which, views in self.residuals().items()
        }
        state["local_momentum"] = {k: v.clone() for k, v in self._momentum.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._momentum = {k: v.clone() for k, v in (state.get("local_momentum") or {}).items()}
        saved = state.get("residuals") or {"residual": {}, "owner_residual": {}}
        if self._quantizer is None or not any(saved.values()):
            self._update_mode()
            return
        if int(state.get("world_size", self.world_size)) != self.world_size:
            # A residual is what one rank's quantization dropped from its own share of
            # the data, and the owner's residual belongs to a stripe whose owner is set
            # by the world size: neither has a meaning in a job of another size.
            warnings.warn(
                f"quantization residuals were saved by a job of {state['world_size']} ranks and this job has "
                f"{self.world_size}: they are reset (at most one step's quantization error is lost)",
                stacklevel=2,
            )
            self._update_mode()
            return
        self._loaded_residuals = saved
        if self._stripes:
            self._apply_loaded_residuals()
        self._update_mode()

    def _apply_loaded_residuals(self) -> None:
        assert self._loaded_residuals is not None
        for which in ("residual", "owner_residual"):
            saved = self._loaded_residuals.get(which, {})
            for bucket in self._buckets:
                # Lenient: a parameter saved with another shape (or not at all) starts from a zero residual.
                bucket.load_named(getattr(self._stripes[bucket.index], which), saved, which, strict=False)
        # The owners' residuals were saved by stripe owners; if the buckets changed since,
        # stripe ownership did too. They are summed over the ranks (each entry is nonzero
        # on one rank only, so the sum is exact) at the next quantized exchange.
        self._merge_owner_residuals = True
        self._loaded_residuals = None

    def _merge_loaded_owner_residuals(self) -> None:
        """Collective: give each owner the whole of the loaded owner residuals of its stripe."""
        me = get_rank(self.group)
        for bucket in self._buckets:
            q = self._stripes[bucket.index]
            all_reduce(q.owner_residual, group=self.group, traffic=self.traffic)
            merged = q.owner_residual.clone()
            q.owner_residual.zero_()
            for lo, length, _ in q.segments[me]:
                q.owner_residual[lo : lo + length].copy_(merged[lo : lo + length])
        self._merge_owner_residuals = False
