"""DataParallelSGD: the algorithm, its set-up, gradient hooks, exact exchange, join and state."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.join import Joinable, JoinHook

from bunsan._validate import check_choice, check_int, check_number, check_type
from bunsan.algorithms.data_parallel.buckets import Bucket, build_buckets
from bunsan.algorithms.data_parallel.exchange import COMPRESSIONS, BucketExchange
from bunsan.algorithms.data_parallel.momentum import (
    QUANTIZED_MOMENTUM_1BIT,
    default_quantized_momentum,
    optimizer_warning,
)
from bunsan.algorithms.data_parallel.stripes import Stripes, build_stripes
from bunsan.algorithms.onebit_adam import FrozenVarianceAdam, is_adam, warm_up_steps
from bunsan.comm import all_reduce, broadcast_tensors, get_rank, global_rank
from bunsan.comm.join import join_group
from bunsan.compression import DEFAULT_CHUNK_SIZE, Quantizer
from bunsan.compression.rotation import ROTATED_CHUNK_SIZE, RotatedQuantizer

__all__ = ["DataParallelSGD"]


class DataParallelSGD(BucketExchange):
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
            delays amplified by the momentum afterwards (docs/explanation/quantized.md).
            Default True.
        chunk_size: elements per quantization chunk (default: 1024 when rotating, else
            the codec's 512).
        rotate: quantize every chunk after a fixed random rotation (random signs, then
            Walsh-Hadamard; DRIVE, Vargaftik et al. 2021), with the residual kept in
            the original coordinates (:mod:`bunsan.compression.rotation`). The same
            bytes for ``log2(chunk_size)`` more passes of the codec each way, so
            ``chunk_size`` must be a power of two. Default (None): decided when the
            optimizer is attached: on for ``bits=1`` with Adam/AdamW (1-bit Adam needs
            it), off otherwise (with SGD the capped ``quantized_momentum`` keeps 1 bit
            as accurate as exact SGD without it; docs/explanation/quantized.md).
        quantized_momentum: with SGD momentum ``beta`` and local momentum, the momentum the
            workers apply while quantizing, at most; the gradient is scaled by
            ``(1 - applied) / (1 - beta)`` so that the step ``lr / (1 - beta)`` is kept.
            ``"auto"`` (default): for ``bits=1`` 0.8 with SGD at 2 ranks (one quantization
            stage) and 0.5 otherwise, None (the optimizer's) above 1 bit
            (docs/explanation/quantized.md).
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
        Joinable.__init__(self)  # torch's join protocol: disabled until a Join context enables it
        check_int("bits", bits, hint="32 is exact, 1..16 quantize")
        if bits != 32 and not 1 <= bits <= 16:
            raise ValueError(f"bits must be 32 (exact) or 1..16 (quantized), got {bits}")
        check_choice("compression", compression, COMPRESSIONS, hint="half-precision traffic with bits=32")
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
        self._momentum_pending: dict[str, Tensor] = {}  # this step's, committed once the exchange is finite
        self._momentum_spare: dict[str, Tensor] = {}
        self._sent_finite: list[Tensor] = []
        self._in_gradient_units: list[tuple[Tensor, tuple[float, float, float, Tensor | None]]] = []
        self._shown: list[tuple[Tensor, Tensor]] = []
        self._unit_samples: tuple[Tensor, list[int]] | None = None
        self._warned_rebase = False
        self._name_of: dict[Tensor, str] = {}
        self._group_of: dict[Tensor, dict[str, Any]] = {}
        self._held: list[tuple[dict[str, Any], dict[str, Any]]] = []  # param groups whose momentum we hold
        self._adam: FrozenVarianceAdam | None = None  # quantized steps of an Adam/AdamW optimizer (1-bit Adam)
        self._adam_warm_steps: int | None = None  # warm_start=0 with Adam: this many exact steps first
        self.bucket_size_mb = float(bucket_size_mb)
        if rotate and bits == 32:
            raise ValueError("rotate=True applies to quantized gradients (bits 1..16)")
        # rotate=None: decided by the optimizer at attach_optimizer() (rotated chunks for 1-bit Adam,
        # plain two-means chunks for SGD); measured in docs/experiments/design-notes.md, "1-bit defaults".
        self._rotate_default = rotate is None
        self._chunk_default = chunk_size is None
        self.rotate = bool(rotate)
        # "auto": decided again at attach_optimizer(), when the world size and optimizer are known.
        self._momentum_default = quantized_momentum == "auto"
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
        self._quantizer = None if bits == 32 else self._make_quantizer(chunk_size)
        self.quantizing = False  # this step's exchange is quantized (decided identically on every rank)
        self._stripes: dict[int, Stripes] = {}
        self._loaded_residuals: dict[str, dict[str, Tensor]] | None = None
        self._merge_owner_residuals = False
        self._encode_s = self._decode_s = 0.0
        self._exact_bytes = 0  # what the quantized steps would have sent at 32 bits
        self._quantized_bytes = 0
        self._buckets: list[Bucket] = []
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
        # this round's exchange waits for the end of backward, where the observer's before_exchange runs
        # before any collective of the round (Observer.holds_exchange, asked at the round's first gradient)
        self._round_held = False

    def __repr__(self) -> str:
        rotate = ", rotate=True" if self.rotate else ""
        return (
            f"DataParallelSGD(bits={self.bits}, compression={self.compression!r}, warm_start={self.warm_start}{rotate})"
        )

    def _make_quantizer(self, chunk_size: int | None) -> Quantizer | RotatedQuantizer:
        codec = RotatedQuantizer if self.rotate else Quantizer
        if chunk_size is None:
            chunk_size = ROTATED_CHUNK_SIZE if self.rotate else DEFAULT_CHUNK_SIZE
        return codec(self.bits, chunk_size)

    def _choose_rotation(self, optimizer: torch.optim.Optimizer) -> None:
        """``rotate=None`` at 1 bit: rotated chunks for Adam's preconditioned momentum, plain for SGD.

        Measured (docs/experiments/design-notes.md, "1-bit defaults"): with SGD momentum capped while
        quantizing, plain two-means chunks of 512 matched exact SGD at 2 and 4 workers and
        encode at about the speed of a memory copy; 1-bit Adam without rotation ended
        several times further from the task's best than exact training, with it within 1.1x.
        """
        rotate = self.bits == 1 and self.local_momentum and is_adam(optimizer)
        if not self._rotate_default or rotate == self.rotate:
            return
        self.rotate = rotate
        chunk = None if self._chunk_default else self._quantizer.chunk_size if self._quantizer else None
        self._quantizer = self._make_quantizer(chunk)
        if self._buckets:  # stripes follow the chunk size: plan them again
            self.setup(self.named_params)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().attach_optimizer(optimizer)
        self._group_of = {}
        self._adam = None
        if self.bits == 32:
            return
        self._choose_rotation(optimizer)
        if self._momentum_default:
            self.quantized_momentum = default_quantized_momentum(self.bits, self.world_size, adam=is_adam(optimizer))
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
        warning = optimizer_warning(
            optimizer,
            self.bits,
            rotate=self.rotate,
            cap=self.quantized_momentum if self.local_momentum else None,
            two_ranks=self.world_size == 2,
        )
        if warning is not None and get_rank(self.group) == 0:
            warnings.warn(warning, stacklevel=3)

    # -- set-up -----------------------------------------------------------------
    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        super().setup(named_params)
        for handle in self._hook_handles:
            handle.remove()
        self._buckets = build_buckets(self.named_params, int(self.bucket_size_mb * 2**20), self._meta_slots())
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
            self._stripes = {b.index: build_stripes(b, self._quantizer, self.world_size) for b in self._buckets}
            if self._loaded_residuals is not None:
                self._apply_loaded_residuals()
        self._update_mode()

    def remove_hooks(self) -> None:
        """Stop exchanging gradients in backward (the block algorithms' warm start has ended)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def release(self) -> None:
        self.remove_hooks()  # a successor takes over: these gradient hooks must stop firing

    def _take_back_round(self) -> int:
        taken = self._round[0] if self._round is not None else 0  # taken by this backward's first gradient hook
        self._round = None
        return taken

    def setup_buffers(self, modules: Sequence[tuple[str, Any, list[str]]]) -> None:
        super().setup_buffers(modules)
        if self._buckets:  # the metadata slots depend on the number of buffer modules
            self.setup(self.named_params)

    def _meta_slots(self) -> int:
        buffers = len(self.buffer_sync) if self.buffer_sync is not None else 0
        return 2 + len(self.named_params) + buffers + (self._quantizer is not None)

    def begin_accumulation(self) -> None:
        self._accumulating = True

    def end_accumulation(self) -> None:
        self._accumulating = False

    def after_step(self) -> None:
        self._release_momentum()
        if self._adam is not None:
            self._adam.apply()
            if self._adam_warm_steps is not None and self.samples > 0:
                # The default warm-up was in steps: now that a step's samples are known, in samples.
                self.warm_start = self._adam_warm_steps * self.samples // (self.step + 1)
                self._adam_warm_steps = None
                self._update_mode()

    def reduce_gradients(self) -> None:
        """Collective (in ``optimizer.step()``). The exchange normally completed in backward already."""
        self.complete_exchange()
        self._exchanged = False
        if self._last_quantized:
            self._from_gradient_units()  # after the user's clipping or unscaling
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

    # -- torch's join protocol ------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For ``with torch.distributed.algorithms.join.Join([optimizer]):``, what a joined rank runs.

        Its main hook answers one exchange of the ranks still training with zeros (as
        :meth:`join` does in a loop); its post-hook equalizes the replicas. The
        ``Join`` context decides when all have joined, so this composes with other
        joinables (a DDP model, ZeroRedundancyOptimizer) in the same context.
        """
        return _ShadowExchange(self)

    @property
    def join_device(self) -> torch.device:
        return self._buckets[0].buffer.device if self._buckets else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return join_group(self.group)

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
        """The base counters; while quantizing also ``compression_ratio`` (exact bytes over sent
        bytes), ``encode_s`` and ``decode_s`` (seconds spent in the codec)."""
        stats = super().stats()
        if self._quantizer is not None:
            stats["compression_ratio"] = self._exact_bytes / self._quantized_bytes if self._quantized_bytes else 1.0
            stats["encode_s"] = self._encode_s
            stats["decode_s"] = self._decode_s
        return stats

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
        self._momentum_pending.clear()
        self._momentum_spare.clear()
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


class _ShadowExchange(JoinHook):
    """DataParallelSGD's part in torch's join protocol, on a rank that has joined."""

    def __init__(self, algorithm: DataParallelSGD) -> None:
        self.algorithm = algorithm

    def main_hook(self) -> None:
        """Answer one exchange of the ranks still training, with zeros and weight 0."""
        self.algorithm._exchange(active=False)
        self.algorithm._exchanged = False

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: the replicas take the model of the rank that trained longest."""
        self.algorithm._equalize_after_join()
