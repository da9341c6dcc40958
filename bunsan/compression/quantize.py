"""Chunked 1..16-bit quantization of gradients, with error feedback.

This is the codec behind ``DataParallelSGD(bits=b)``. A flat tensor is cut
into chunks of ``chunk_size`` elements (the last one may be shorter) and every
element becomes a ``bits``-bit code. Each chunk carries two float32 numbers,
``offset`` and ``step``, and every bit width decodes the same way::

    value = offset + code * step

1 bit (Seide et al., 2014, "1-Bit Stochastic Gradient Descent and its
Application to Data-Parallel Distributed Training of Speech DNNs"): the code is
1 where the entry is >= 0. The two reconstruction values are the mean of the
chunk's non-negative entries and the mean of its negative entries (0 for an
empty side): ``offset`` is the negative mean and ``offset + step`` the
non-negative one. Error feedback, also from that paper, keeps what the
quantization dropped as a residual that the caller adds to the next step's
gradient (:meth:`Quantizer.encode_with_feedback`), so nothing is lost, only
delayed.

2..16 bits: ``2 ** bits`` evenly spaced levels from ``offset`` with spacing
``step``, round to nearest. Baseline range is the chunk's ``[min, max]``. For 2
to 4 bits a second range is tried, ``mean +- alpha * std`` clipped to
``[min, max]`` (clipping a Gaussian's tails pays at few levels; cf. Banner et
al., 2019, "Post training 4-bit quantization of convolutional networks for
rapid-deployment", ACIQ), and each chunk keeps whichever of the two ranges
gives the lower squared error on that chunk, so no chunk is ever worse than
``[min, max]``. Clipped tails are not lost either: they go to the residual.

Symmetric levels scaled by the max-abs (one parameter per chunk) are not used: they
were worse than min-max at every width measured. The clipped range is not tried from
5 bits up, where it gains little or equals ``[min, max]``.

Chunk size. The default of 512 costs 2 float32 per 512 elements, 0.125 bit per
element (a 1-bit payload is 1.125 bits per element, 28.4x smaller than float32), and
512 is a multiple of 8, so every chunk's codes start on a byte boundary whatever
``bits`` is. A chunk should not span parts of a tensor with different scales; an
algorithm that knows its layout (rows of a weight matrix, as CNTK quantized per
column) can pass a matching ``chunk_size``.

At 1 bit on CPU (chunk sizes that are multiples of 8) the C kernels of
:mod:`bunsan.compression.native` replace the torch passes: the same payload, decoding
bit for bit the same. On CPU the work runs in blocks of 128 K elements, so that each
pass reads the cache, not memory; on a GPU it is one block.

The measurements behind these choices (error per bit width and range, the chunk-size
trade-off, speed per bit width) are in docs/experiments/design-notes.md, "Compression:
measurements moved from docstrings"; ``python -m bunsan.bench.quantized --codec-only``
measures the codec again.

Payload layout (one flat uint8 tensor, :meth:`Quantizer.payload_bytes` long)::

    [ offset[0..m-1] | step[0..m-1] ]   2 * m float32, machine byte order (little-endian)
    [ packed codes ]                     ceil(numel * bits / 8) bytes, see bunsan.compression.bits

where ``m = ceil(numel / chunk_size)``. The parameters come first so that a
payload at a 4-byte aligned address has its floats aligned; no header: the
receiver knows ``numel`` and the quantizer's settings.

Pure tensor code, no communication and no state between calls: the caller
owns the residual buffers. Computation is float32; inputs may be float32,
float16 or bfloat16. Non-finite inputs give unspecified codes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from bunsan._validate import check_int
from bunsan.compression import native
from bunsan.compression.bits import MAX_BITS, _check_out, code_dtype, pack_bits, packed_size, unpack_bits

__all__ = ["CLIP_ALPHA", "DEFAULT_CHUNK_SIZE", "Quantizer"]

DEFAULT_CHUNK_SIZE = 512

# Half-width of the clipped range in standard deviations, per bit width: the MSE optimum
# on Gaussian chunks of 512 (docs/experiments/design-notes.md, "Compression: measurements moved from docstrings").
CLIP_ALPHA: dict[int, float] = {2: 1.50, 3: 2.05, 4: 2.50}

_PARAMS_PER_CHUNK = 2
# (lo, hi, b, a, divisor): out[lo:hi] = (out[lo:hi] - a * b) / divisor after a decode_sum.
_Piece = tuple[int, int, Tensor, float, float]
# Elements per block of chunks on CPU: 128 K floats (512 KiB) per buffer stay in a 2 MiB L2.
_CPU_BLOCK_ELEMENTS = 1 << 17
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Quantizer:
    """Encode float tensors into one uint8 payload of ``bits``-bit codes, chunk by chunk.

    The payload size depends only on ``numel`` (:meth:`payload_bytes`), so a
    receiver can allocate it before any message arrives.

    Args:
        bits: Bits per element, 1..16. 1 is Seide et al.'s 1-bit SGD.
        chunk_size: Elements per chunk, each with its own ``offset`` and
            ``step``; must be >= 1. The default, 512, is discussed in the
            module docstring.

    Raises:
        ValueError: If ``bits`` or ``chunk_size`` is out of range.

    Example::

        quantizer = Quantizer(bits=1)
        residual = torch.zeros_like(grad, dtype=torch.float32)
        payload = quantizer.encode_with_feedback(grad, residual)  # residual updated in place
        decoded = quantizer.decode(payload, grad.numel()).view_as(grad)
    """

    def __init__(self, bits: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        check_int("bits", bits, minimum=1, maximum=MAX_BITS, hint="use bits=32 for no quantization")
        check_int("chunk_size", chunk_size, minimum=1, hint=f"the default is {DEFAULT_CHUNK_SIZE}")
        self.bits = bits
        self.chunk_size = chunk_size

    def __repr__(self) -> str:
        return f"Quantizer(bits={self.bits}, chunk_size={self.chunk_size})"

    def num_chunks(self, numel: int) -> int:
        """Return the number of chunks of a ``numel``-element tensor: ``ceil(numel / chunk_size)``."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return -(-numel // self.chunk_size)

    def payload_bytes(self, numel: int) -> int:
        """Return the exact size in bytes of the payload of a ``numel``-element tensor."""
        return 4 * _PARAMS_PER_CHUNK * self.num_chunks(numel) + packed_size(numel, self.bits)

    def encode(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """Quantize ``x`` into one flat uint8 payload (layout in the module docstring).

        Args:
            x: Floating tensor (float32, float16 or bfloat16) of any shape,
                read in flattened order.
            out: Optional contiguous uint8 tensor of ``payload_bytes(x.numel())``
                elements on ``x``'s device, written in place.

        Returns:
            The payload (a flat view of ``out`` when given).

        Raises:
            ValueError: If ``x`` is not floating point or ``out`` is unsuitable.
        """
        values = _as_flat_float32(x, "x")
        payload = self._payload_buffer(values.numel(), values.device, out)
        if values.numel():
            self._encode_into(values, payload)
        return payload

    def encode_with_feedback(self, x: Tensor, residual: Tensor, out: Tensor | None = None) -> Tensor:
        """Quantize ``x + residual`` and keep what quantization dropped in ``residual``.

        Computes ``v = x + residual``, returns ``payload = encode(v)`` and
        sets ``residual = v - decode(payload)`` in place (Seide et al., 2014),
        bit for bit what :meth:`decode` returns on this device. Over steps,
        the decoded payloads plus the final residual add up to the sum of the
        inputs: nothing is lost, only delayed. A non-finite ``x`` poisons the
        residual for good: skip or reset on overflow (as a GradScaler would).

        Args:
            x: Floating tensor (float32, float16 or bfloat16), e.g. a gradient.
            residual: Contiguous float32 tensor with as many elements as ``x``,
                on its device; zeros at the first step. Updated in place.
            out: Optional payload buffer, as in :meth:`encode`.

        Returns:
            The payload of ``x + residual``.

        Raises:
            ValueError: If ``x`` is not floating point, ``residual`` does not
                match it, or ``out`` is unsuitable.
        """
        check_residual(x, residual)
        values = residual.view(-1)
        payload = self._payload_buffer(values.numel(), values.device, out)
        if values.numel():
            self._encode_into(values, payload, addend=x.reshape(-1))
        return payload

    def decode(self, payload: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
        """Return the float32 values that ``payload`` encodes.

        Args:
            payload: uint8 tensor of exactly ``payload_bytes(numel)`` elements,
                as made by :meth:`encode` with the same ``bits`` and ``chunk_size``.
            numel: Number of encoded elements.
            out: Optional contiguous float32 tensor of ``numel`` elements on
                the payload's device, written in place.

        Returns:
            Flat float32 values (a flat view of ``out`` when given).

        Raises:
            ValueError: If the payload size does not match ``numel`` or ``out``
                is unsuitable.
        """
        payload = self._check_payload(payload, numel)
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        else:
            out = _check_out(out, numel, torch.float32, payload.device, "out")
        if numel == 0:
            return out
        if self._native(out):
            self.decode_native(payload, numel, out)
            return out
        params = self._read_params(payload, numel)
        packed = payload[self.params_bytes(numel) :]
        if (self.chunk_size * self.bits) % 8:  # chunks do not start on byte boundaries
            return self._reconstruct(unpack_bits(packed, self.bits, numel), params, out)
        # Unpack block by block, so that the codes are still in cache when they are scaled.
        blocks = self._blocks(numel, _block_chunks(self.chunk_size, out.device))
        block_numel = max(count * length for _, count, length in blocks)
        codes = torch.empty(block_numel, dtype=code_dtype(self.bits), device=out.device)
        for first, count, length in blocks:
            start, size = first * self.chunk_size, count * length
            block_codes = unpack_bits(packed[start * self.bits // 8 :], self.bits, size, out=codes[:size])
            _reconstruct_block(
                block_codes.view(count, length),
                params[0, first : first + count],
                params[1, first : first + count],
                out[start : start + size].view(count, length),
            )
        return out

    def chunk_params(self, payload: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        """Return ``(offset, step)``, float32 tensors of one entry per chunk, from a payload.

        Chunk ``j`` decodes code ``c`` to ``offset[j] + c * step[j]``; for 1 bit,
        ``offset`` is the mean of the negative entries and ``offset + step``
        the mean of the non-negative ones.
        """
        payload = self._check_payload(payload, numel)
        params = self._read_params(payload, numel)
        return params[0], params[1]

    # Internals. ``values`` is always a flat contiguous float32 tensor.

    def params_bytes(self, numel: int) -> int:
        """Bytes at the start of a payload of ``numel`` elements that hold the chunks' float32 parameters."""
        return 4 * _PARAMS_PER_CHUNK * self.num_chunks(numel)

    def _payload_buffer(self, numel: int, device: torch.device, out: Tensor | None) -> Tensor:
        nbytes = self.payload_bytes(numel)
        if out is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return _check_out(out, nbytes, torch.uint8, device, "out")

    def _check_payload(self, payload: Tensor, numel: int) -> Tensor:
        if payload.dtype != torch.uint8:
            raise ValueError(f"payload must be uint8, got {payload.dtype}")
        expected = self.payload_bytes(numel)
        if payload.numel() != expected:
            raise ValueError(
                f"payload has {payload.numel()} bytes but {self!r} encodes {numel} elements in {expected}; "
                "check numel, bits and chunk_size against the sender's"
            )
        return payload.reshape(-1)

    def _read_params(self, payload: Tensor, numel: int) -> Tensor:
        """(2, chunks) float32 view of the payload's parameters (a copy if misaligned)."""
        raw = payload[: self.params_bytes(numel)]
        if raw.storage_offset() % 4:
            raw = raw.clone()
        return raw.view(torch.float32).view(_PARAMS_PER_CHUNK, -1)

    def _blocks(self, numel: int, block_chunks: int | None = None) -> list[tuple[int, int, int]]:
        """Return ``(first chunk, chunks, chunk length)`` for runs of full chunks and the short last one.

        Full chunks come in runs of at most ``block_chunks`` (all of them in one run when None).
        """
        full = numel // self.chunk_size
        step = block_chunks or max(full, 1)
        blocks = [(first, min(step, full - first), self.chunk_size) for first in range(0, full, step)]
        if numel > full * self.chunk_size:
            blocks.append((full, 1, numel - full * self.chunk_size))
        return blocks

    def _native(self, values: Tensor) -> bool:
        """Whether the C kernels (:mod:`bunsan.compression.native`) serve this call."""
        return self.bits == 1 and self.chunk_size % 8 == 0 and values.device.type == "cpu" and native.available()

    def decode_native(self, payload: Tensor, numel: int, out: Tensor, accumulate: bool = False) -> None:
        """1 bit on CPU: decode into ``out`` (or add to it), in place; the caller checked the sizes."""
        params = self._read_params(payload, numel)
        native.onebit_decode(
            params[0], params[1], payload[self.params_bytes(numel) :], numel, self.chunk_size, out, accumulate
        )

    def decode_add(self, payload: Tensor, numel: int, out: Tensor) -> Tensor:
        """``out += decode(payload)`` in place, rounded as that sum would be, without a temporary."""
        payload = self._check_payload(payload, numel)
        out = _check_out(out, numel, torch.float32, payload.device, "out")
        if numel and self._native(out):
            self.decode_native(payload, numel, out, accumulate=True)
        elif numel:
            out.add_(self.decode(payload, numel))
        return out

    def decode_sum(self, payloads: list[Tensor], numel: int, out: Tensor, then: Sequence[_Piece] = ()) -> Tensor:
        """``out = decode(payloads[0]) + decode(payloads[1]) + ...`` in place, added in that order.

        ``then``: pieces ``(lo, hi, b, a, divisor)``, sorted and disjoint, applied to the
        sum: ``out[lo:hi] = (out[lo:hi] - a * b) / divisor`` (``b``: ``hi - lo`` float32
        values). At 1 bit on CPU all of it is one pass over ``out`` (the C kernel decodes
        a chunk's payloads while it is in cache); elsewhere the first payload is decoded
        into ``out``, the others added to it, then the pieces, with torch operations.
        """
        if not payloads:
            raise ValueError("decode_sum needs at least one payload")
        fits = all(
            b.dtype == torch.float32 and b.device.type == "cpu" and b.numel() == hi - lo for lo, hi, b, *_ in then
        )
        if numel and fits and self._native(out) and out.dtype == torch.float32 and out.is_contiguous():
            payloads = [self._check_payload(payload, numel) for payload in payloads]
            out = _check_out(out, numel, torch.float32, payloads[0].device, "out")
            params = [self._read_params(payload, numel) for payload in payloads]
            start = self.params_bytes(numel)
            native.onebit_decode_sum_then(
                [(q[0], q[1], payload[start:]) for q, payload in zip(params, payloads, strict=True)],
                numel,
                self.chunk_size,
                out,
                [(lo, hi, b.reshape(-1), a, divisor) for lo, hi, b, a, divisor in then],
            )
            return out
        self.decode(payloads[0], numel, out=out)
        for payload in payloads[1:]:
            self.decode_add(payload, numel, out)
        for lo, hi, b, a, divisor in then:
            out[lo:hi].sub_(b.reshape(-1), alpha=a).div_(divisor)  # rounded as the C kernel
        return out

    def _encode_into(self, values: Tensor, payload: Tensor, addend: Tensor | None = None) -> None:
        """Encode ``values`` into ``payload``, in place.

        With an ``addend`` (error feedback), ``values`` is the residual: it becomes
        ``v = values + addend``, ``v`` is encoded, and ``values = v - decoded``.
        """
        numel = values.numel()
        if self._native(values):
            if addend is not None:  # values is the residual, contiguous
                addend = addend.contiguous() if addend.dtype == torch.float32 else addend.float().contiguous()
            else:  # read only
                values = values.contiguous()
            params_bytes = self.params_bytes(numel)
            raw = payload[:params_bytes]
            aligned = raw.storage_offset() % 4 == 0
            params = raw.view(torch.float32) if aligned else torch.empty(params_bytes // 4, dtype=torch.float32)
            chunks = params.numel() // 2
            native.onebit_encode(
                values, addend, self.chunk_size, params[:chunks], params[chunks:], payload[params_bytes:]
            )
            if not aligned:
                raw.copy_(params.view(torch.uint8))
            return
        device = values.device
        params = torch.empty(_PARAMS_PER_CHUNK, self.num_chunks(numel), dtype=torch.float32, device=device)
        params_bytes = 4 * params.numel()
        packed = payload[params_bytes:]
        # On CPU, blocks of chunks small enough to stay in cache make every pass below
        # read from cache rather than memory; on GPUs one block keeps kernels few.
        blocks = self._blocks(numel, _block_chunks(self.chunk_size, device))
        block_numel = max(count * length for _, count, length in blocks)
        aligned = (self.chunk_size * self.bits) % 8 == 0  # codes of each block start on a byte
        codes = torch.empty(block_numel if aligned else numel, dtype=code_dtype(self.bits), device=device)
        scratch = torch.empty(block_numel, dtype=torch.float32, device=device)
        for first, count, length in blocks:
            start, size = first * self.chunk_size, count * length
            block_values = values[start : start + size].view(count, length)
            if addend is not None:
                block_values.add_(addend[start : start + size].view(count, length))  # v = x + residual
            block_codes = (codes[:size] if aligned else codes[start : start + size]).view(count, length)
            block_scratch = scratch[:size].view(count, length)
            offset, step = params[0, first : first + count], params[1, first : first + count]
            if self.bits == 1:
                _encode_block_1bit(block_values, block_codes, block_scratch, offset, step)
            else:
                _encode_block_levels(block_values, block_codes, block_scratch, offset, step, self.bits)
            if addend is not None:
                # residual = v - decode(payload): the same arithmetic as decode(), element by element.
                block_values.sub_(_reconstruct_block(block_codes, offset, step, block_scratch))
            if aligned:
                first_byte = start * self.bits // 8
                pack_bits(block_codes, self.bits, out=packed[first_byte : first_byte + packed_size(size, self.bits)])
        if not aligned:
            pack_bits(codes, self.bits, out=packed)
        payload[:params_bytes].copy_(params.view(-1).view(torch.uint8))

    def _reconstruct(self, codes: Tensor, params: Tensor, out: Tensor) -> Tensor:
        """Write ``offset + code * step`` into ``out`` (flat float32); return it."""
        for first, count, length in self._blocks(out.numel(), _block_chunks(self.chunk_size, out.device)):
            start = first * self.chunk_size
            _reconstruct_block(
                codes[start : start + count * length].view(count, length),
                params[0, first : first + count],
                params[1, first : first + count],
                out[start : start + count * length].view(count, length),
            )
        return out


def _block_chunks(chunk_size: int, device: torch.device) -> int | None:
    """Chunks per block: ~128 K elements on CPU, all of them (None) elsewhere."""
    return max(1, _CPU_BLOCK_ELEMENTS // chunk_size) if device.type == "cpu" else None


def _reconstruct_block(codes: Tensor, offset: Tensor, step: Tensor, out: Tensor) -> Tensor:
    """``offset + code * step`` per chunk into ``out``: two roundings, the same on every path."""
    out.copy_(codes)
    return out.mul_(step[:, None]).add_(offset[:, None])


def _encode_block_1bit(values: Tensor, codes: Tensor, scratch: Tensor, offset: Tensor, step: Tensor) -> None:
    """Seide et al.'s 1-bit quantization of ``values`` (chunks, length); results in place.

    Every pass below is a same-dtype elementwise op or a last-dimension
    reduction: on CPU these are several times faster than a masked sum or a
    broadcasting ``torch.where``.
    """
    length = values.shape[1]
    torch.ge(values, 0, out=codes.view(torch.bool))
    scratch.copy_(codes)  # 1.0 where non-negative, else 0.0
    count_pos = scratch.sum(1)
    scratch.mul_(values)  # the non-negative entries, 0 elsewhere
    sum_pos = scratch.sum(1)
    torch.sub(values, scratch, out=scratch)  # the negative entries, exactly, 0 elsewhere
    sum_neg = scratch.sum(1)
    count_neg = length - count_pos
    zero = torch.zeros_like(sum_pos)
    mean_pos = torch.where(count_pos > 0, sum_pos / count_pos.clamp(min=1), zero)
    mean_neg = torch.where(count_neg > 0, sum_neg / count_neg.clamp(min=1), zero)
    # A rounded sum / count can miss a constant chunk's value; take it exactly.
    low, high = values.amin(1), values.amax(1)
    constant = low == high
    mean_pos = torch.where(constant, high.clamp(min=0), mean_pos)
    mean_neg = torch.where(constant, low.clamp(max=0), mean_neg)
    offset.copy_(mean_neg)
    torch.sub(mean_pos, mean_neg, out=step)


def _inverse(step: Tensor) -> Tensor:
    """``1 / step``, with 0 where that is not finite (a constant chunk: every code is 0)."""
    inverse = step.reciprocal()
    return torch.where(torch.isfinite(inverse), inverse, torch.zeros_like(inverse))


def _scaled(values: Tensor, low: Tensor, inverse: Tensor, out: Tensor) -> Tensor:
    """``(values - low) * inverse`` per chunk, into ``out``: positions in units of ``step``."""
    torch.sub(values, low[:, None], out=out)
    return out.mul_(inverse[:, None])


def _encode_block_levels(
    values: Tensor, codes: Tensor, scratch: Tensor, offset: Tensor, step: Tensor, bits: int
) -> None:
    """Uniform ``2 ** bits``-level quantization of ``values`` (chunks, length); results in place."""
    top = float(2**bits - 1)
    low, high = values.amin(1), values.amax(1)
    chunk_step = (high - low) / top
    clipped = bits in CLIP_ALPHA
    if clipped:
        # Statistics of the positions (values - low) / step in [0, top]: no cancellation
        # however far the chunk sits from 0, unlike E[v^2] - E[v]^2 on the values.
        positions = _scaled(values, low, _inverse(chunk_step), scratch)
        length = values.shape[1]
        mean = positions.sum(1) / length
        spread = (torch.linalg.vector_norm(positions, dim=1).square_() / length - mean * mean).clamp_(min=0).sqrt_()
        spread *= CLIP_ALPHA[bits]
        clip_low = low + (mean - spread).clamp(min=0) * chunk_step
        clip_step = ((mean + spread).clamp(max=top) - (mean - spread).clamp(min=0)) * (chunk_step / top)
        error = _squared_error(values, low, chunk_step, top, scratch, positions_ready=True)
        clip_error = _squared_error(values, clip_low, clip_step, top, scratch)
        use_clip = clip_error < error  # ties (constant chunks) keep [min, max]
        low = torch.where(use_clip, clip_low, low)
        chunk_step = torch.where(use_clip, clip_step, chunk_step)
    _scaled(values, low, _inverse(chunk_step), scratch).add_(0.5)
    if clipped:
        scratch.clamp_(0, top)
    codes.copy_(scratch)  # float -> int truncates: floor(t + 0.5) for t >= 0, round to nearest
    offset.copy_(low)
    step.copy_(chunk_step)


def _squared_error(
    values: Tensor, low: Tensor, step: Tensor, top: float, scratch: Tensor, positions_ready: bool = False
) -> Tensor:
    """Per chunk, the squared error of quantizing with ``(low, step)``, clipping included.

    Measured on the reconstruction ``low + code * step`` itself, so it is right
    even where ``step`` is 0 or too small to invert. ``positions_ready``:
    ``scratch`` already holds :func:`_scaled` of this range.
    """
    if not positions_ready:
        _scaled(values, low, _inverse(step), scratch)
    scratch.add_(0.5).floor_().clamp_(0, top)
    scratch.mul_(step[:, None]).add_(low[:, None]).sub_(values)
    return torch.linalg.vector_norm(scratch, dim=1).square_()


def check_residual(x: Tensor, residual: Tensor) -> None:
    """Raise ValueError unless ``x`` is floating and ``residual`` is a matching float32 buffer."""
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if residual.dtype != torch.float32 or not residual.is_contiguous():
        raise ValueError(
            f"residual must be a contiguous float32 tensor, got dtype {residual.dtype} "
            f"(contiguous={residual.is_contiguous()}); create it with torch.zeros(numel, dtype=torch.float32)"
        )
    if residual.numel() != x.numel() or residual.device != x.device:
        raise ValueError(
            f"residual must match x: {x.numel()} elements on {x.device}, got {residual.numel()} on {residual.device}"
        )


def _as_flat_float32(x: Tensor, name: str) -> Tensor:
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    flat = x.reshape(-1)
    return flat if flat.dtype == torch.float32 else flat.float()
