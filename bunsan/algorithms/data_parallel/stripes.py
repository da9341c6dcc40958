"""The buffers of the quantized exchange by stripes: a pure plan of which rank owns which chunks.

Rank ``r`` owns stripe ``r`` of every bucket (:func:`plan_stripes`); the exchange itself
is in :mod:`bunsan.algorithms.data_parallel.quantized`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bunsan.algorithms.data_parallel.buckets import Bucket
from bunsan.algorithms.data_parallel.graphs import CapturedCalls, graphs_enabled, run_call
from bunsan.compression import Quantizer
from bunsan.compression.rotation import RotatedQuantizer
from bunsan.compression.segments import SegmentCodec, batches

__all__ = ["Segment", "Stripes", "build_stripes", "coded_per_bucket", "plan_stripes"]

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
class Stripes:
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
    params_index: Tensor  # int64: the bytes of ``send`` that hold the chunks' parameters (float32)
    work: Any = None
    quantizer: Quantizer | RotatedQuantizer | None = None  # set where the codec runs one call per bucket
    graphs: CapturedCalls | None = None  # set where those calls are replayed as CUDA graphs
    _codecs: dict[int | None, SegmentCodec] = field(default_factory=dict)

    @property
    def batched(self) -> bool:
        """Whether this bucket is coded in one call per phase (:class:`SegmentCodec`), not per segment."""
        return self.quantizer is not None

    def codec(self, stripe: int | None) -> SegmentCodec:
        """The one-call codec of stripe ``stripe`` (payload offsets within one stripe's payload), or of
        every stripe (``None``: offsets within ``send``, ``gathered``); built on first use."""
        if stripe not in self._codecs:
            assert self.quantizer is not None
            if stripe is None:
                segments = [(lo, n, j * self.payload + at) for j, s in enumerate(self.segments) for lo, n, at in s]
            else:
                segments = list(self.segments[stripe])
            self._codecs[stripe] = SegmentCodec(self.quantizer, segments, self.residual.device)
        return self._codecs[stripe]

    def run(self, site: Hashable, call: Callable[[], object], *tensors: Tensor | None) -> None:
        """Do a codec ``call`` that works in ``tensors`` only: as a CUDA graph where :attr:`graphs`
        is set (:class:`bunsan.algorithms.data_parallel.graphs.CapturedCalls`), else now."""
        run_call(self.graphs, site, call, *tensors)

    def sent_finite(self) -> Tensor:
        """Whether every chunk parameter this rank encoded into ``send`` is finite (a 0-d bool tensor).

        An inf or NaN anywhere in a chunk makes its two means non-finite, so reading the
        parameters (about 1/64 of the payload) finds it without a pass over the values.
        """
        return torch.isfinite(self.send[self.params_index].view(torch.float32)).all()


def coded_per_bucket(quantizer: Quantizer | RotatedQuantizer, device: torch.device) -> bool:
    """Whether the striped exchange codes a bucket in one call per phase (:class:`SegmentCodec`) rather
    than one per segment: on a GPU, where every call costs its kernel launches (0.18-0.9 ms on an
    H200, whatever its size), for the codecs :func:`bunsan.compression.segments.batches` takes. On CPU
    the per-segment calls run the C kernels in cache. ``BUNSAN_CODEC_CALLS=bucket`` or ``segment``
    overrides the choice (the tests use it to run the one-call codec on CPU)."""
    forced = os.environ.get("BUNSAN_CODEC_CALLS", "")
    if forced not in ("", "bucket", "segment"):
        raise ValueError(f"BUNSAN_CODEC_CALLS must be bucket or segment, got {forced!r}")
    if not batches(quantizer):
        return False
    return forced == "bucket" if forced else device.type != "cpu"


def build_stripes(bucket: Bucket, quantizer: Quantizer | RotatedQuantizer, world_size: int) -> Stripes:
    """Allocate ``bucket``'s exchange buffers once, for ``world_size`` ranks."""
    if bucket.buffer.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"bits={quantizer.bits} quantizes floating-point gradients only; {bucket.names[0]} is {bucket.buffer.dtype}"
        )
    n, device = world_size, bucket.buffer.device
    plan = plan_stripes([p.numel() for p in bucket.params], quantizer.chunk_size, n)
    segments: list[list[Segment]] = []
    for stripe in plan:
        position, placed = 0, []
        for lo, length in stripe:
            placed.append((lo, length, position))
            position += quantizer.payload_bytes(length)
        segments.append(placed)
    payload = max(
        max((pos + quantizer.payload_bytes(length) for _, length, pos in stripe), default=0) for stripe in segments
    )
    longest = max((sum(length for _, length, _ in stripe) for stripe in segments), default=0)
    numel = bucket.buffer.numel()

    def floats(k: int) -> Tensor:
        return torch.zeros(k, dtype=torch.float32, device=device)

    def octets(k: int) -> Tensor:
        return torch.zeros(k, dtype=torch.uint8, device=device)

    index = [
        torch.arange(j * payload + at, j * payload + at + quantizer.params_bytes(length), dtype=torch.int64)
        for j, stripe in enumerate(segments)
        for _, length, at in stripe
    ]
    params_index = (torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)).to(device)
    batched = coded_per_bucket(quantizer, device)

    return Stripes(
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
        params_index,
        quantizer=quantizer if batched else None,
        graphs=CapturedCalls(device) if batched and graphs_enabled(device) else None,
    )
