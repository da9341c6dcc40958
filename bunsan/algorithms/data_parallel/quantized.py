"""The quantized exchange by stripes, with error feedback (Seide et al. 2014; Strom 2015).

Three phases per bucket (:class:`bunsan.algorithms.data_parallel.DataParallelSGD`):
each rank quantizes stripe ``j`` of its gradient with its residual and sends it to rank
``j`` (all-to-all); the owner decodes and sums its stripe in rank order, divides by the
active ranks and re-quantizes the mean with an owner's residual of its own; the owners'
stripes are all-gathered and decoded on every rank, so every replica applies the same
gradient. Residuals are kept by parameter name, so they survive bucket rebuilds and go
into checkpoints.

Each segment of a stripe (inside one parameter) is coded by a call of its own on CPU, where
the C kernels run it in cache; on a GPU, where a call costs its kernel launches, each phase
codes a whole bucket in one call (:class:`bunsan.compression.segments.SegmentCodec`,
:func:`bunsan.algorithms.data_parallel.stripes.coded_per_bucket`), in the same payload layout.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan.algorithms.base import Algorithm
from bunsan.algorithms.data_parallel.buckets import Bucket
from bunsan.algorithms.data_parallel.momentum import Piece
from bunsan.algorithms.data_parallel.stripes import Stripes
from bunsan.comm import Traffic, all_gather_into, all_reduce, all_to_all, get_rank, wait
from bunsan.compression import Quantizer
from bunsan.compression.rotation import RotatedQuantizer

__all__ = [
    "QuantizedExchange",
    "decode_pair",
    "decode_stripes",
    "encode_stripes",
    "merge_owner_residual",
    "reduce_owned_stripe",
]


def _within(pieces: list[Piece], lo: int, length: int) -> list[Piece]:
    """The parts of ``pieces`` (over a bucket's buffer) that fall in ``[lo, lo + length)``, relative to ``lo``."""
    inside = []
    for start, end, b, a, divisor in pieces:
        first, last = max(start, lo), min(end, lo + length)
        if first < last:
            inside.append((first - lo, last - lo, b.reshape(-1)[first - start : last - start], a, divisor))
    return inside


def _take_out(out: Tensor, pieces: list[Piece]) -> None:
    """``out[lo:hi] = (out[lo:hi] - a * b) / divisor`` for each piece, rounded as ``decode_sum``'s ``then``."""
    for start, end, b, a, divisor in pieces:
        out[start:end].sub_(b.reshape(-1), alpha=a).div_(divisor)


def _one(source: tuple[Tensor, int]) -> tuple[Tensor, tuple[int]]:
    return source[0], (source[1],)


def _pair_batched(q: Stripes, me: int, n_active: int, out: Tensor) -> None:
    """Two ranks: the sum of both ranks' first-stage payloads of both stripes, into ``out`` (a GPU)."""
    other = 1 - me
    for j in (0, 1):
        found = {me: (q.send, j * q.payload)}
        found[other] = (q.received, other * q.payload) if j == me else (q.gathered, j * q.payload)
        codec = q.codec(j)
        # rank order: the same sum on both ranks
        rows = codec.decode_rows(*_one(found[0]))[0].add_(codec.decode_rows(*_one(found[1]))[0])
        if n_active != 2:
            rows.mul_(2 / n_active)
        codec.scatter(rows, out)


# -- one bucket's phases, local work only (shared with bunsan.algorithms.data_parallel.ddp_hook) --------


def encode_stripes(quantizer: Quantizer | RotatedQuantizer, q: Stripes, buffer: Tensor, *, feedback: bool) -> None:
    """Phase 1's local half: quantize every stripe of ``buffer`` into ``q.send``, in place.

    With ``feedback`` the residual ``q.residual`` is added before quantizing and keeps what
    the quantization dropped; without it the residual is neither read nor written.
    """
    if q.batched:  # one call for every stripe of the bucket (a GPU: stripes.coded_per_bucket)
        residual = q.residual if feedback else None
        codec = q.codec(None)  # it reads half types as float32
        q.run("encode", partial(codec.encode, buffer, q.send, residual), buffer, q.send, residual)
        return
    values = buffer if buffer.dtype == torch.float32 else buffer.float()
    for j, stripe in enumerate(q.segments):
        base = j * q.payload
        for lo, length, at in stripe:
            out = q.send[base + at : base + at + quantizer.payload_bytes(length)]
            if feedback:
                quantizer.encode_with_feedback(values[lo : lo + length], q.residual[lo : lo + length], out=out)
            else:
                quantizer.encode(values[lo : lo + length], out=out)


def _owner_batched(q: Stripes, me: int, n: int, n_active: int, owner_residual: Tensor | None) -> None:
    """The owner's sum of its stripe and its re-quantization, one call each (a GPU)."""
    owned = q.codec(me)
    # the owner alone sums its stripe: one reduction over the ranks' payloads
    rows = owned.decode_sum_rows(q.received, [i * q.payload for i in range(n)])
    if n_active != n:
        rows.mul_(n / n_active)
    owned.encode_gathered(rows, q.own_payload, owner_residual)


def reduce_owned_stripe(
    quantizer: Quantizer | RotatedQuantizer, q: Stripes, me: int, n: int, n_active: int, *, feedback: bool
) -> None:
    """Phase 2's local half (3+ ranks): the owner ``me`` sums its stripe from ``q.received`` and
    re-quantizes the mean into ``q.own_payload``, with ``q.owner_residual`` where ``feedback``."""
    if q.batched:
        owner_residual = q.owner_residual if feedback else None
        q.run(
            ("owner", me, n, n_active),
            partial(_owner_batched, q, me, n, n_active, owner_residual),
            q.received,
            q.own_payload,
            owner_residual,
        )
        return
    position = 0
    for lo, length, at in q.segments[me]:
        summed = q.summed[position : position + length]
        size = quantizer.payload_bytes(length)
        # rank order: the same sum on whichever rank owns the stripe
        quantizer.decode_sum([q.received[i * q.payload + at :][:size] for i in range(n)], length, summed)
        if n_active != n:  # gradients were divided by n before sending; the mean is over active ranks
            summed.mul_(n / n_active)
        out = q.own_payload[at : at + quantizer.payload_bytes(length)]
        if feedback:
            quantizer.encode_with_feedback(summed, q.owner_residual[lo : lo + length], out=out)
        else:
            quantizer.encode(summed, out=out)
        position += length


def decode_stripes(
    quantizer: Quantizer | RotatedQuantizer, q: Stripes, buffer: Tensor, mine: list[Piece] | None = None
) -> None:
    """Phase 3's local half (3+ ranks): decode every owner's stripe from ``q.gathered`` into ``buffer``.

    ``mine``: what the decode also takes out of momentum units in its pass (float32 buffers).
    """
    mine = mine or []
    decoded = buffer if buffer.dtype == torch.float32 else None
    if q.batched:
        codec = q.codec(None)
        q.run("decode", partial(codec.decode, q.gathered, buffer), q.gathered, buffer)
        if decoded is not None:
            _take_out(decoded, mine)
        return
    for j, stripe in enumerate(q.segments):
        for lo, length, at in stripe:
            base = j * q.payload + at
            payload = q.gathered[base : base + quantizer.payload_bytes(length)]
            if decoded is not None:
                then = _within(mine, lo, length)
                if then:
                    quantizer.decode_sum([payload], length, decoded[lo : lo + length], then=then)
                else:
                    quantizer.decode(payload, length, out=decoded[lo : lo + length])
            else:
                buffer[lo : lo + length].copy_(quantizer.decode(payload, length))


def decode_pair(
    quantizer: Quantizer | RotatedQuantizer,
    q: Stripes,
    me: int,
    n_active: int,
    buffer: Tensor,
    mine: list[Piece] | None = None,
) -> None:
    """Phase 3's local half at 2 ranks: the sum of both ranks' first-stage payloads of every stripe
    (``q.send``, ``q.received``, and ``q.gathered`` after the owners' all-gather) into ``buffer``,
    in rank order, so both ranks decode the same sum bit for bit."""
    mine = mine or []
    other = 1 - me
    if q.batched:
        q.run(
            ("pair", me, n_active),
            partial(_pair_batched, q, me, n_active, buffer),
            q.send,
            q.received,
            q.gathered,
            buffer,
        )
        if buffer.dtype == torch.float32:
            _take_out(buffer, mine)
        return
    direct = buffer.dtype == torch.float32
    for j, stripe in enumerate(q.segments):
        # Stripe j's first-stage payloads: mine is in send; the other rank's came in phase 1
        # (j == me, in received) or now (j == other, in gathered, which it owns).
        theirs = q.received[other * q.payload :] if j == me else q.gathered[j * q.payload :]
        sources = {me: q.send[j * q.payload :], other: theirs}
        for lo, length, at in stripe:
            size = quantizer.payload_bytes(length)
            summed = buffer[lo : lo + length] if direct else q.scratch[:length]
            # rank order: the same sum on both ranks
            then = _within(mine, lo, length) if direct else []
            quantizer.decode_sum([sources[r][at : at + size] for r in (0, 1)], length, summed, then=then)
            if n_active != 2:  # gradients were divided by 2 before sending; the mean is over active ranks
                summed.mul_(2 / n_active)
            if not direct:
                buffer[lo : lo + length].copy_(summed)


def merge_owner_residual(q: Stripes, me: int, *, group: ProcessGroup | None, traffic: Traffic | None) -> None:
    """Collective: give the owner ``me`` of a stripe the whole of its owner residual, in place.

    After a load or a change of buckets, owner residuals sit with the ranks that owned
    each stripe before; each entry is nonzero on one rank only, so their sum is exact.
    """
    all_reduce(q.owner_residual, group=group, traffic=traffic)
    merged = q.owner_residual.clone()
    q.owner_residual.zero_()
    for lo, length, _ in q.segments[me]:
        q.owner_residual[lo : lo + length].copy_(merged[lo : lo + length])


class QuantizedExchange(Algorithm):
    """The quantized half of :class:`~bunsan.algorithms.data_parallel.DataParallelSGD` (a mixin of it)."""

    # Set by DataParallelSGD.__init__ and setup().
    error_feedback: bool
    _quantizer: Quantizer | RotatedQuantizer | None
    _buckets: list[Bucket]
    _stripes: dict[int, Stripes]
    _round: tuple[int, float] | None
    _loaded_residuals: dict[str, dict[str, Tensor]] | None
    _merge_owner_residuals: bool
    _encode_s: float
    _decode_s: float
    _exact_bytes: int
    _sent_finite: list[Tensor]  # this round: per bucket, whether what this rank encoded is finite

    def _launch_stripes(self, bucket: Bucket) -> None:
        """Phase 1: quantize every stripe (with this rank's residual) and send it to its owner."""
        assert self._quantizer is not None
        quantizer, q = self._quantizer, self._stripes[bucket.index]
        active = self._round is None or self._round[1] > 0
        start = time.perf_counter()
        # a joined rank sends zeros and keeps its residual for nobody
        encode_stripes(quantizer, q, bucket.buffer, feedback=active and self.error_feedback)
        self._encode_s += time.perf_counter() - start
        if active:
            self._sent_finite.append(q.sent_finite())
        q.work = all_to_all(q.received, q.send, group=self.group, traffic=self.traffic, async_op=True)
        bucket.work = q.work

    def _finish_stripes(self, n_active: int, pieces: dict[int, list[Piece]] | None = None) -> None:
        """Phases 2 and 3: owners sum, re-quantize and share their stripes; all decode.

        ``pieces``: per bucket, what the decode also takes out of momentum units in its pass
        (:meth:`LocalMomentum._to_gradient_units`); only when every rank was active.
        """
        assert self._quantizer is not None
        quantizer, n, me = self._quantizer, self.world_size, get_rank(self.group)
        for bucket in self._buckets:
            wait(self._stripes[bucket.index].work, "quantized gradient exchange")
        if n_active == 0:  # every rank has joined: the round carried nothing (same on every rank)
            return
        if self._merge_owner_residuals:
            self._merge_loaded_owner_residuals()
        if n == 2:
            self._finish_two_ranks(n_active, pieces)
            return
        for bucket in self._buckets:
            q = self._stripes[bucket.index]
            start = time.perf_counter()
            reduce_owned_stripe(quantizer, q, me, n, n_active, feedback=self.error_feedback)
            self._decode_s += time.perf_counter() - start
            q.work = all_gather_into(q.gathered, q.own_payload, group=self.group, traffic=self.traffic, async_op=True)
        for bucket in self._buckets:
            q = self._stripes[bucket.index]
            wait(q.work, "quantized gradient gather")
            start = time.perf_counter()
            mine = pieces.get(bucket.index, []) if pieces is not None else []
            decode_stripes(quantizer, q, bucket.buffer, mine)
            self._decode_s += time.perf_counter() - start
            q.work = None
            self._exact_bytes += int(2 * (n - 1) / n * bucket.buffer.numel() * 4)

    def _finish_two_ranks(self, n_active: int, pieces: dict[int, list[Piece]] | None = None) -> None:
        """Phases 2 and 3 for 2 ranks: no second quantization, at the same bytes.

        Each rank sends its own first-stage payload of the stripe it owns, instead of
        the owner's re-quantized sum: with 2 ranks that is as many bytes (half a
        payload each way in each phase), and every rank then holds both ranks'
        payloads of both stripes and decodes their sum in rank order, so the replicas
        agree bit for bit. What the owner's second quantization dropped (as much again
        as the first, and the larger part of 1 bit's loss of accuracy with heavy
        momentum: docs/experiments/design-notes.md) is not dropped at all; the owners' residuals
        stay zero.
        """
        assert self._quantizer is not None
        quantizer, me = self._quantizer, get_rank(self.group)
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
            mine = pieces.get(bucket.index, []) if pieces is not None else []
            decode_pair(quantizer, q, me, n_active, bucket.buffer, mine)
            self._decode_s += time.perf_counter() - start
            q.work = None
            self._exact_bytes += int(bucket.buffer.numel() * 4)  # 2 * (n - 1) / n * numel * 4 at n = 2

    def _local_nonfinite(self) -> float:
        """1.0 if this rank encoded an inf or NaN in this round (its slot in the metadata), else 0.0."""
        checks, self._sent_finite = self._sent_finite, []
        return 0.0 if all(bool(c) for c in checks) else 1.0

    def _drop_residuals(self) -> None:
        """A round that carried an inf or NaN (every rank knows it from the metadata): restart error feedback.

        The rank that sent it has a non-finite residual, and what the others kept would be
        fed back against a step the optimizer skips (``GradScaler``), so every rank starts
        again from zero; the quantization error of one step is lost, nothing else.
        """
        for q in self._stripes.values():
            q.residual.zero_()
            q.owner_residual.zero_()

    def _merge_loaded_owner_residuals(self) -> None:
        """Collective: give each owner the whole of the loaded owner residuals of its stripe."""
        me = get_rank(self.group)
        for bucket in self._buckets:
            merge_owner_residual(self._stripes[bucket.index], me, group=self.group, traffic=self.traffic)
        self._merge_owner_residuals = False

    def _residual_views(self, which: str) -> dict[str, Tensor]:
        """Per-parameter views of a residual buffer: residuals are keyed by name."""
        views: dict[str, Tensor] = {}
        for bucket in self._buckets:
            views.update(zip(bucket.names, bucket.views(getattr(self._stripes[bucket.index], which))))
        return views

    def residuals(self) -> dict[str, dict[str, Tensor]]:
        """This rank's residuals by parameter name: ``{"residual": ..., "owner_residual": ...}``."""
        if self._quantizer is None or not self._stripes:
            return {"residual": {}, "owner_residual": {}}
        return {which: self._residual_views(which) for which in ("residual", "owner_residual")}

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
