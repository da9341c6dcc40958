"""One codec call for many segments: the striped exchange's codec on a GPU.

The striped exchange (:mod:`bunsan.algorithms.data_parallel.quantized`) codes every
segment of a bucket on its own, as :meth:`Quantizer.encode` needs one flat vector per
call: a segment lies inside one parameter, so that no chunk mixes two parameters'
scales. On CPU that costs little (the C kernels of :mod:`bunsan.compression.native`
run a segment in microseconds). On a GPU every call launches some twenty kernels
whatever its size: 0.18-0.9 ms per call on an H200 (docs/experiments/plan.md, "On a GPU"), and a
bucket at 256 workers has about a thousand segments, so the exchange was all launches.

:class:`SegmentCodec` codes all the segments of a plan at once. It lays their chunks out
as the rows of one ``(rows, chunk_size)`` matrix, gathered by index (full chunks first,
then the short last chunk of each segment, zero-padded and masked), runs the chunk
arithmetic of :class:`~bunsan.compression.quantize.Quantizer` on the whole matrix, and
writes every segment's payload where the per-segment call would: the same layout byte
for byte (per segment ``[offset | step | packed codes]``), so either side may decode it
with the other. The codes are the same; a short chunk's two parameters come from a
masked reduction over the padded row, which may round differently in the last bit from
the per-segment call's reduction over the chunk alone; error feedback is exact either
way (the residual is ``v - decode(payload)`` of this payload). A sum of several
payloads (the owner's sum of every rank's stripe) is one decode of all of them and one
reduction over the ranks.

Every bit width, with chunk sizes whose codes start on a byte (512, 1024, any multiple of
8), plain or rotated (:class:`~bunsan.compression.rotation.RotatedQuantizer`): there the
full chunks are rotated as one matrix, and each segment's short last chunk, padded to a
power of two as the per-segment codec pads it, with the rows of the same padded length; a
sum of payloads is summed in rotated coordinates and rotated back once, as
:meth:`RotatedQuantizer.decode_sum` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from bunsan.compression.bits import code_dtype, pack_bits, unpack_bits
from bunsan.compression.quantize import CLIP_ALPHA, Quantizer, _inverse
from bunsan.compression.rotation import RotatedQuantizer, hadamard

__all__ = ["SegmentCodec", "batches"]

Segment = tuple[int, int, int]  # (offset in the values, length, offset in the payload)


def batches(quantizer: object) -> bool:
    """Whether :class:`SegmentCodec` can code for ``quantizer``: a :class:`Quantizer` or a
    :class:`RotatedQuantizer` whose chunks' codes start on a byte (``chunk_size * bits`` a
    multiple of 8)."""
    if isinstance(quantizer, RotatedQuantizer):
        quantizer = quantizer.inner
    elif type(quantizer) is not Quantizer:
        return False
    assert isinstance(quantizer, Quantizer)
    return (quantizer.chunk_size * quantizer.bits) % 8 == 0


class SegmentCodec:
    """Encode and decode a fixed list of segments of a flat buffer in one call each.

    Args:
        quantizer: the codec's settings (:func:`batches` must accept it).
        segments: ``(offset in the values, length, offset in the payload)`` per segment,
            as :class:`~bunsan.algorithms.data_parallel.stripes.Stripes` places them; each
            segment's payload is ``quantizer.payload_bytes(length)`` bytes.
        device: where the buffers are.
    """

    def __init__(
        self, quantizer: Quantizer | RotatedQuantizer, segments: Sequence[Segment], device: torch.device | str
    ) -> None:
        if not batches(quantizer):
            raise ValueError(f"{quantizer!r} codes one segment per call (chunk codes must start on a byte)")
        self.quantizer, self.device = quantizer, torch.device(device)
        self.rotated = isinstance(quantizer, RotatedQuantizer)
        inner = quantizer.inner if isinstance(quantizer, RotatedQuantizer) else quantizer
        chunk, bits = quantizer.chunk_size, quantizer.bits
        self.numel = sum(length for _, length, _ in segments)
        full: list[tuple[int, int, int, int]] = []  # value offset, offset's byte, step's byte, codes' byte
        short: list[tuple[int, int, int, int, int, int]] = []  # the same, the values' length, the coded one
        for lo, length, at in segments:
            whole, tail = divmod(length, chunk)
            # the elements coded: a rotated codec pads the tail to a power of two (RotatedQuantizer.padded_numel)
            coded_tail = (1 << (tail - 1).bit_length() if self.rotated else tail) if tail else 0
            coded = whole * chunk + coded_tail
            chunks = inner.num_chunks(coded)
            codes_at = at + inner.params_bytes(coded)
            for j in range(chunks):
                row = (lo + j * chunk, at + 4 * j, at + 4 * (chunks + j), codes_at + j * chunk * bits // 8)
                if j < whole:
                    full.append(row)
                else:
                    short.append((*row, tail, coded_tail))
        self.full_rows, self.rows = len(full), len(full) + len(short)
        table = torch.tensor([r[:4] for r in full] + [r[:4] for r in short], dtype=torch.int64).reshape(-1, 4)
        self._starts, self._offset_at, self._step_at, self._codes_at = table.to(self.device).unbind(1)
        lengths = [chunk] * len(full) + [r[5] for r in short]
        self._lengths = torch.tensor(lengths, dtype=torch.float32, device=self.device)
        columns = torch.arange(chunk, device=self.device)
        self._columns = columns
        self._bytes = torch.arange(chunk * bits // 8, device=self.device)
        self._four = torch.arange(4, device=self.device)
        # the short rows: which cells hold values, which are coded, and which packed bytes are sent
        short_lengths = torch.tensor([r[4] for r in short], dtype=torch.int64, device=self.device)
        coded_lengths = torch.tensor([r[5] for r in short], dtype=torch.int64, device=self.device)
        self._values_mask = columns[None, :] < short_lengths[:, None]  # (short rows, chunk)
        self._mask = torch.ones(self.rows, chunk, dtype=torch.bool, device=self.device)
        self._mask[self.full_rows :] = columns[None, :] < coded_lengths[:, None]
        cell = self._values_mask.reshape(-1).nonzero().squeeze(1)
        self._short_cell = cell  # flat index into the short rows' matrix
        self._short_dst = self._starts[self.full_rows :][cell // chunk] + cell % chunk
        # rotated: the short rows by their padded length, each group one transform of that length
        self._by_width: list[tuple[int, Tensor]] = []
        if self.rotated:
            for width in sorted({r[5] for r in short}):
                rows = [self.full_rows + i for i, r in enumerate(short) if r[5] == width]
                self._by_width.append((width, torch.tensor(rows, dtype=torch.int64, device=self.device)))
            assert isinstance(quantizer, RotatedQuantizer)
            self._signs = quantizer._signs_on(self.device)
        sent = self._bytes[None, :] < ((coded_lengths * bits + 7) // 8)[:, None]
        self._sent = sent  # (short rows, bytes of a full chunk's codes)
        byte = sent.reshape(-1).nonzero().squeeze(1)
        self._short_byte = byte  # flat index into the short rows' packed bytes
        self._short_byte_dst = (
            self._codes_at[self.full_rows :][byte // self._bytes.numel()] + byte % self._bytes.numel()
        )
        self._shifts: dict[tuple[int, ...], Tensor] = {}  # _moved's cache
        self._index: Tensor | None = None  # _codes_index's

    def _rotate(self, rows: Tensor, inverse: bool) -> Tensor:
        """Rows (any leading dimensions) into rotated coordinates, or back (a rotated codec); in place."""
        if not self.rotated or not self.rows:
            return rows
        flat = rows.view(-1, self.rows, rows.shape[-1])
        side = {"post": self._signs} if inverse else {"pre": self._signs}
        if self.full_rows:
            full = flat[:, : self.full_rows].reshape(-1, rows.shape[-1])
            flat[:, : self.full_rows] = hadamard(full, **side).view(flat.shape[0], self.full_rows, -1)
        for width, index in self._by_width:
            part = flat[:, index, :width].reshape(-1, width)
            signs = {k: v[:width] for k, v in side.items()}
            flat[:, index, :width] = hadamard(part.contiguous(), **signs).view(flat.shape[0], -1, width)
        return rows

    def __repr__(self) -> str:
        return f"SegmentCodec({self.quantizer!r}, {self.rows} chunks, {self.numel} elements)"

    # -- values <-> rows ------------------------------------------------------------------------
    def _full_index(self) -> Tensor:
        return self._starts[: self.full_rows, None] + self._columns[None, :]

    def gather(self, values: Tensor) -> Tensor:
        """The segments of flat ``values`` as float32 rows ``(rows, chunk_size)``, short ones zero-padded."""
        flat = values.reshape(-1)
        rows = torch.zeros(self.rows, self.quantizer.chunk_size, dtype=torch.float32, device=self.device)
        rows[: self.full_rows] = flat[self._full_index()]
        rows[self.full_rows :].view(-1)[self._short_cell] = flat[self._short_dst].float()
        return rows

    def scatter(self, rows: Tensor, out: Tensor) -> Tensor:
        """Write the elements of ``rows`` (padding left out) into flat ``out`` at the segments' offsets."""
        flat = out.view(-1)
        flat[self._full_index().reshape(-1)] = rows[: self.full_rows].reshape(-1).to(flat.dtype)
        flat[self._short_dst] = rows[self.full_rows :].reshape(-1)[self._short_cell].to(flat.dtype)
        return out

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, values: Tensor, payload: Tensor, residual: Tensor | None = None, shift: int = 0) -> None:
        """Encode the segments of ``values`` into ``payload`` (at the segments' payload offsets plus
        ``shift``); with ``residual`` (float32, indexed as ``values``), error feedback as
        :meth:`Quantizer.encode_with_feedback`: ``v = values + residual`` is encoded and the residual
        becomes ``v - decode``."""
        self.encode_gathered(self.gather(values), payload, residual, shift)

    def encode_gathered(self, rows: Tensor, payload: Tensor, residual: Tensor | None = None, shift: int = 0) -> None:
        """:meth:`encode` of values already laid out as rows (:meth:`gather`); ``rows`` is overwritten."""
        if self.rows > self.full_rows:  # a short chunk's padding holds zeros, as the per-segment codec pads it
            rows[self.full_rows :] *= self._values_mask
        if residual is None:
            self.encode_rows(self._rotate(rows, inverse=False), payload, shift)
            return
        rows.add_(self.gather(residual))  # v = x + residual, as the per-segment call adds it
        coded = self._rotate(rows.clone() if self.rotated else rows, inverse=False)
        decoded = self.encode_rows(coded, payload, shift, reconstruct=True)
        assert decoded is not None
        self.scatter(rows.sub_(self._rotate(decoded, inverse=True)), residual)  # residual = v - decode(payload)

    def encode_rows(self, rows: Tensor, payload: Tensor, shift: int = 0, reconstruct: bool = False) -> Tensor | None:
        """Encode float32 ``rows`` (laid out as :meth:`gather` does, in rotated coordinates for a rotated
        codec) into ``payload``; ``rows`` is read only.

        ``reconstruct``: also return what the payload decodes to, in the same coordinates."""
        q = self.quantizer
        if not self.rows:
            return rows if reconstruct else None
        mask = self._mask
        if q.bits == 1:
            codes, offset, step = _encode_1bit(rows, mask, self._lengths)
        else:
            codes, offset, step = _encode_levels(rows, mask, self._lengths, q.bits)
        codes.mul_(mask.to(codes.dtype))  # the padding's codes are 0: the last byte's unused bits are zero
        packed = pack_bits(codes, q.bits).view(self.rows, -1)
        self._put_params(payload, offset, self._offset_at + shift)
        self._put_params(payload, step, self._step_at + shift)
        flat = payload.view(-1)
        flat[self._codes_at[: self.full_rows, None] + shift + self._bytes[None, :]] = packed[: self.full_rows]
        flat[self._short_byte_dst + shift] = packed[self.full_rows :].reshape(-1)[self._short_byte]
        if not reconstruct:
            return None
        return codes.to(torch.float32).mul_(step[:, None]).add_(offset[:, None])

    def _put_params(self, payload: Tensor, values: Tensor, at: Tensor) -> None:
        payload.view(-1)[at[:, None] + self._four[None, :]] = values.contiguous().view(torch.uint8).view(-1, 4)

    # -- decoding -------------------------------------------------------------------------------
    def decode_rows(self, payload: Tensor, shifts: Sequence[int]) -> Tensor:
        """Decode the plan's payloads found at each of ``shifts`` in ``payload``: float32
        ``(len(shifts), rows, chunk_size)``, each ``offset + code * step`` as :meth:`Quantizer.decode`
        rounds it, rotated back for a rotated codec (padding decodes to junk; :meth:`scatter` leaves
        it out)."""
        return self._rotate(self._decode_coded(payload, shifts), inverse=True)

    def _decode_coded(self, payload: Tensor, shifts: Sequence[int]) -> Tensor:
        """:meth:`decode_rows` before the inverse rotation."""
        q, flat = self.quantizer, payload.view(-1)
        if not self.rows:
            return torch.zeros(len(shifts), 0, q.chunk_size, device=self.device)
        moved = self._moved(shifts)
        offset = self._get_params(flat, self._offset_at[None, :, None] + moved)
        step = self._get_params(flat, self._step_at[None, :, None] + moved)
        packed = flat[self._codes_index() + moved]  # (k, rows, bytes of a full chunk's codes)
        k = len(shifts)
        codes = unpack_bits(packed.reshape(-1), q.bits, k * self.rows * q.chunk_size).view(k, self.rows, -1)
        out = codes.to(torch.float32)
        return out.mul_(step[..., None]).add_(offset[..., None])

    def _moved(self, shifts: Sequence[int]) -> Tensor:
        """``shifts`` as a ``(k, 1, 1)`` index on the device, made once per tuple: a copy from the host
        is a synchronizing transfer, which a CUDA graph of the exchange's calls cannot hold."""
        key = tuple(shifts)
        if key not in self._shifts:
            self._shifts[key] = torch.tensor(key, dtype=torch.int64, device=self.device)[:, None, None]
        return self._shifts[key]

    def _codes_index(self) -> Tensor:
        """``(1, rows, bytes of a full chunk's codes)``: where each row's packed codes lie in a payload."""
        if self._index is None:
            index = self._codes_at[:, None] + self._bytes[None, :]
            # a short chunk's bytes past its codes belong to the next field, or lie past the payload:
            # read its first byte again there (those codes fall in the padding, which scatter leaves out)
            index[self.full_rows :] = torch.where(
                self._sent, index[self.full_rows :], self._codes_at[self.full_rows :, None]
            )
            self._index = index[None]
        return self._index

    def _get_params(self, flat: Tensor, at: Tensor) -> Tensor:
        return flat[at + self._four].contiguous().view(torch.float32).squeeze(-1)

    def decode(self, payload: Tensor, out: Tensor, shift: int = 0) -> Tensor:
        """Decode the plan's payloads (at ``shift``) into flat ``out`` at the segments' offsets."""
        return self.scatter(self.decode_rows(payload, (shift,))[0], out)

    def decode_sum_rows(self, payload: Tensor, shifts: Sequence[int]) -> Tensor:
        """The sum of the payloads at ``shifts`` as rows: the first plus the second plus ... in
        that order for two (both ranks of a pair compute it); one reduction over them from three."""
        decoded = self._decode_coded(payload, shifts)  # summed where coded, rotated back once (linear)
        if len(shifts) <= 2:
            total = decoded[0]
            for more in decoded[1:]:
                total = total.add_(more)
        else:
            total = decoded.sum(0)
        return self._rotate(total, inverse=True)


def _low_high(rows: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's least and greatest valid cell (masked fills: no scalar copied from the host, which a
    CUDA graph could not hold)."""
    outside = ~mask
    return rows.masked_fill(outside, float("inf")).amin(1), rows.masked_fill(outside, float("-inf")).amax(1)


def _encode_1bit(rows: Tensor, mask: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Seide et al.'s two means per row over its valid cells (whatever the padding holds): codes,
    offset, step."""
    codes = (rows >= 0) & mask
    positive = codes.to(torch.float32)
    count_pos = positive.sum(1)
    kept = rows * positive
    sum_pos = kept.sum(1)
    sum_neg = (rows - kept).mul_(mask).sum(1)
    count_neg = lengths - count_pos
    zero = torch.zeros_like(sum_pos)
    mean_pos = torch.where(count_pos > 0, sum_pos / count_pos.clamp(min=1), zero)
    mean_neg = torch.where(count_neg > 0, sum_neg / count_neg.clamp(min=1), zero)
    low, high = _low_high(rows, mask)
    constant = low == high  # a rounded sum / count can miss a constant chunk's value: take it exactly
    mean_pos = torch.where(constant, high.clamp(min=0), mean_pos)
    mean_neg = torch.where(constant, low.clamp(max=0), mean_neg)
    return codes.to(torch.uint8), mean_neg, mean_pos - mean_neg


def _encode_levels(rows: Tensor, mask: Tensor, lengths: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Uniform ``2 ** bits`` levels per row over its valid cells, with the clipped range tried at 2-4
    bits, as :class:`Quantizer` does per chunk: codes, offset, step."""
    top = float(2**bits - 1)
    low, high = _low_high(rows, mask)
    step = (high - low) / top
    valid = mask.to(torch.float32)

    def squared_error(lo: Tensor, st: Tensor) -> Tensor:
        codes = ((rows - lo[:, None]) * _inverse(st)[:, None]).add_(0.5).floor_().clamp_(0, top)
        return torch.linalg.vector_norm((codes * st[:, None] + lo[:, None] - rows) * valid, dim=1).square_()

    if bits in CLIP_ALPHA:
        positions = (rows - low[:, None]) * _inverse(step)[:, None] * valid
        mean = positions.sum(1) / lengths
        spread = (torch.linalg.vector_norm(positions, dim=1).square_() / lengths - mean * mean).clamp_(min=0).sqrt_()
        spread *= CLIP_ALPHA[bits]
        clip_low = low + (mean - spread).clamp(min=0) * step
        clip_step = ((mean + spread).clamp(max=top) - (mean - spread).clamp(min=0)) * (step / top)
        use_clip = squared_error(clip_low, clip_step) < squared_error(low, step)  # ties keep [min, max]
        low = torch.where(use_clip, clip_low, low)
        step = torch.where(use_clip, clip_step, step)
    scaled = ((rows - low[:, None]) * _inverse(step)[:, None]).add_(0.5)
    # clipped ranges clip; [min, max] changes no valid cell (it truncates to the same code), but the
    # padding may lie outside it (its codes are zeroed after)
    scaled.clamp_(0, top)
    return scaled.to(code_dtype(bits)), low, step
