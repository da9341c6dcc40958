"""Quantization after a random rotation of each chunk.

A chunk is multiplied by fixed random signs and then by the orthonormal
Walsh-Hadamard matrix before it is quantized, and rotated back after it is
decoded. The rotation spreads every entry over the whole chunk, so the rotated
chunk is close to Gaussian whatever the gradient looked like, and the 1-bit
two-means codec of Seide et al. (2014) then keeps about ``2 / pi`` of the
chunk's energy (relative squared error ``1 - 2 / pi = 0.36``) instead of
whatever a heavy-tailed chunk allows. That is the idea of DRIVE (Vargaftik et
al., 2021, "DRIVE: One-bit Distributed Mean Estimation"), here combined with
error feedback instead of DRIVE's unbiased scaling: the residual is taken in
the original coordinates, so nothing is lost, only delayed, exactly as with
the plain codec.

Why it matters: with SGD momentum the plain 1-bit exchange drops so much per step
that the delayed remainder can destabilize training; rotated, the same bytes train
close to the exact exchange (docs/experiments/design-notes.md, "1 bit and heavy momentum").

Cost: ``log2(chunk_size)`` butterfly passes in each direction, and a chunk at the end
of a tensor is padded with zeros to the next power of two (at most doubling that one
chunk's codes). At 1 bit on CPU the C kernels of :mod:`bunsan.compression.native` do
the same arithmetic chunk by chunk in L1, with the same bits; on a GPU the torch path
runs. The error and speed measured are in docs/experiments/design-notes.md, "Compression:
measurements moved from docstrings".

The chunk size must be a power of two. Pure tensor code like
:class:`~bunsan.compression.quantize.Quantizer`, whose interface this class
repeats: ``payload_bytes``, ``encode``, ``encode_with_feedback``, ``decode``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from bunsan.compression import native
from bunsan.compression.bits import _check_out
from bunsan.compression.quantize import DEFAULT_CHUNK_SIZE, Quantizer, _as_flat_float32, check_residual

__all__ = ["ROTATED_CHUNK_SIZE", "RotatedQuantizer", "hadamard"]

# The chunk DataParallelSGD rotates by default: on MNIST-1D with SGD momentum 0.9, rotated chunks
# of 1024 lost less accuracy than chunks of 512 at every seed (docs/experiments/design-notes.md), and send
# 1.0625 bits per element instead of 1.125.
ROTATED_CHUNK_SIZE = 1024
_SIGN_SEED = 0x5EED  # the same signs in every process: a rotation is part of the format
_BLOCK_ELEMENTS = 1 << 16  # 256 KiB of float32 per buffer: two buffers stay in a 2 MiB L2


def hadamard(
    rows: Tensor, pre: Tensor | None = None, post: Tensor | float | None = None, out: Tensor | None = None
) -> Tensor:
    """Orthonormal fast Walsh-Hadamard transform of every row of a 2-D float tensor.

    Computes ``(rows * pre) @ H / sqrt(n) * post`` row by row, ``H`` the n x n
    Sylvester-Hadamard matrix (n, the row length, a power of two), by ``log2(n)``
    butterfly passes of additions and subtractions. Those are exact IEEE operations
    in a fixed order, so every process computes the same bits (a matrix product
    could sum in another order on another CPU or GPU, and replicas would drift).
    The transform is its own inverse. Rows are taken in blocks of about 64 K
    elements so that each pass reads the cache, not memory (7x faster than
    whole-tensor passes for 10 M elements on one CPU thread here).

    Args:
        rows: ``(count, n)`` tensor, read only.
        pre: optional length-``n`` factor applied before the transform.
        post: optional factor (length ``n`` or a number) applied after it.
        out: optional ``(count, n)`` result buffer.
    """
    if rows.dim() != 2:
        raise ValueError(f"hadamard transforms the rows of a 2-D tensor, got shape {tuple(rows.shape)}")
    count, n = rows.shape
    if n & (n - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two length, got {n}")
    if out is None:
        out = torch.empty_like(rows)
    scale = n**-0.5
    block = max(1, _BLOCK_ELEMENTS // n) if rows.device.type == "cpu" else count
    first = torch.empty(min(block, count) * n, dtype=rows.dtype, device=rows.device)
    second = torch.empty_like(first)
    for r0 in range(0, count, block):
        r = min(block, count - r0)
        a, b = first[: r * n].view(r, n), second[: r * n].view(r, n)
        if pre is None:
            a.copy_(rows[r0 : r0 + r])
        else:
            torch.mul(rows[r0 : r0 + r], pre, out=a)
        h = 1
        while h < n:
            pa, pb = a.view(r, n // (2 * h), 2, h), b.view(r, n // (2 * h), 2, h)
            torch.add(pa[:, :, 0], pa[:, :, 1], out=pb[:, :, 0])
            torch.sub(pa[:, :, 0], pa[:, :, 1], out=pb[:, :, 1])
            a, b = b, a
            h *= 2
        target = out[r0 : r0 + r]
        if post is None:
            torch.mul(a, scale, out=target)
        else:
            torch.mul(a, post, out=target).mul_(scale)
    return out


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class RotatedQuantizer:
    """A :class:`Quantizer` applied to randomly rotated chunks.

    Args:
        bits: Bits per element, 1..16.
        chunk_size: Elements per chunk, a power of two (default 512).
        seed: Seed of the random signs. Encoder and decoder must use the same one;
            the default is fixed, so every process agrees without a message.

    Example::

        codec = RotatedQuantizer(bits=1)
        residual = torch.zeros(grad.numel())
        payload = codec.encode_with_feedback(grad, residual)
        decoded = codec.decode(payload, grad.numel())
    """

    def __init__(self, bits: int, chunk_size: int = DEFAULT_CHUNK_SIZE, seed: int = _SIGN_SEED) -> None:
        self.inner = Quantizer(bits, chunk_size)  # checks bits and chunk_size first
        if chunk_size & (chunk_size - 1):
            raise ValueError(f"a rotated codec needs a power-of-two chunk_size, got {chunk_size}")
        self.bits, self.chunk_size = bits, chunk_size
        generator = torch.Generator().manual_seed(seed)
        self._signs_cpu = torch.randint(0, 2, (chunk_size,), generator=generator).float().mul_(2).sub_(1)
        self._signs: dict[torch.device, Tensor] = {}

    def __repr__(self) -> str:
        return f"RotatedQuantizer(bits={self.bits}, chunk_size={self.chunk_size})"

    def padded_numel(self, numel: int) -> int:
        """Elements actually encoded: whole chunks, then the tail padded to a power of two."""
        whole, tail = divmod(numel, self.chunk_size)
        return whole * self.chunk_size + (_next_power_of_two(tail) if tail else 0)

    def params_bytes(self, numel: int) -> int:
        """Bytes at the start of a payload of ``numel`` elements that hold the chunks' float32 parameters."""
        return self.inner.params_bytes(self.padded_numel(numel))

    def payload_bytes(self, numel: int) -> int:
        return self.inner.payload_bytes(self.padded_numel(numel))

    def _signs_on(self, device: torch.device) -> Tensor:
        signs = self._signs.get(device)
        if signs is None:
            signs = self._signs[device] = self._signs_cpu.to(device)
        return signs

    def _rotate(self, values: Tensor, inverse: bool) -> Tensor:
        """Rotate (or rotate back) a flat vector laid out as whole chunks plus a padded tail."""
        n, c = values.numel(), self.chunk_size
        whole = (n // c) * c  # the rest is one padded tail chunk, a power of two long
        signs = self._signs_on(values.device)
        out = torch.empty_like(values)
        for start, length, width in ((0, whole, c), (whole, n - whole, n - whole)):
            if length == 0:
                continue
            rows, target = values[start : start + length].view(-1, width), out[start : start + length].view(-1, width)
            if inverse:  # H is its own inverse; the signs come after it
                hadamard(rows, post=signs[:width], out=target)
            else:
                hadamard(rows, pre=signs[:width], out=target)
        return out

    def _forward(self, values: Tensor) -> Tensor:
        """Pad the tail to a power of two and rotate: ``padded_numel`` elements."""
        n = values.numel()
        padded = self.padded_numel(n)
        if padded != n:
            values = torch.cat((values, values.new_zeros(padded - n)))
        return self._rotate(values, inverse=False)

    def _native(self, device: torch.device) -> bool:
        """Whether the C kernels (:mod:`bunsan.compression.native`) serve this call: 1 bit on CPU."""
        return self.bits == 1 and self.chunk_size % 8 == 0 and device.type == "cpu" and native.available()

    def _native_encode(self, values: Tensor, addend: Tensor | None, out: Tensor | None) -> Tensor:
        n = values.numel()
        payload = self.inner._payload_buffer(self.padded_numel(n), values.device, out)
        if n == 0:
            return payload
        params_bytes = self.inner.params_bytes(self.padded_numel(n))
        raw = payload[:params_bytes]
        aligned = raw.storage_offset() % 4 == 0
        params = raw.view(torch.float32) if aligned else torch.empty(params_bytes // 4, dtype=torch.float32)
        chunks = params.numel() // 2
        native.onebit_encode_rotated(
            values,
            addend,
            self.chunk_size,
            self._signs_on(values.device),
            params[:chunks],
            params[chunks:],
            payload[params_bytes:],
        )
        if not aligned:
            raw.copy_(params.view(torch.uint8))
        return payload

    def encode(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        values = _as_flat_float32(x, "x")
        if self._native(values.device):
            return self._native_encode(values.contiguous(), None, out)
        return self.inner.encode(self._forward(values), out=out)

    def encode_with_feedback(self, x: Tensor, residual: Tensor, out: Tensor | None = None) -> Tensor:
        """Quantize ``x + residual`` in rotated coordinates; the residual stays in the original ones.

        ``residual`` becomes ``x + residual - decode(payload)``, bit for bit what
        :meth:`decode` returns, so the error-feedback identity holds as for
        :meth:`Quantizer.encode_with_feedback`.
        """
        check_residual(x, residual)
        values = residual.view(-1)
        if self._native(values.device):
            addend = x.reshape(-1)
            addend = addend.contiguous() if addend.dtype == torch.float32 else addend.float().contiguous()
            return self._native_encode(values, addend, out)
        values.add_(x.reshape(-1))
        payload = self.encode(values, out=out)
        values.sub_(self.decode(payload, values.numel()))
        return payload

    def decode_add(self, payload: Tensor, numel: int, out: Tensor) -> Tensor:
        """``out += decode(payload)`` in place (as :meth:`Quantizer.decode_add`)."""
        out = _check_out(out, numel, torch.float32, payload.device, "out")
        if numel and self._native(out.device):
            self._native_decode(payload, numel, out, accumulate=True)
            return out
        return out.add_(self.decode(payload, numel))

    def decode_sum(
        self,
        payloads: list[Tensor],
        numel: int,
        out: Tensor,
        then: Sequence[tuple[int, int, Tensor, float, float]] = (),
    ) -> Tensor:
        """``out`` = the sum of the payloads' values, in place: the payloads are decoded and summed
        in rotated coordinates, in the given order, and rotated back once (the rotation is linear),
        so k payloads cost one inverse transform. Bit for bit the same on the C and torch paths.
        ``then``: as :meth:`Quantizer.decode_sum`'s, applied afterwards with torch operations."""
        if not payloads:
            raise ValueError("decode_sum needs at least one payload")
        out = _check_out(out, numel, torch.float32, payloads[0].device, "out")
        if then:
            self.decode_sum(payloads, numel, out)
            for lo, hi, b, a, divisor in then:
                out[lo:hi].sub_(b.reshape(-1), alpha=a).div_(divisor)  # rounded as the C kernel
            return out
        if numel == 0:
            return out
        padded = self.padded_numel(numel)
        if self._native(out.device):
            params = []
            for payload in payloads:
                payload = self.inner._check_payload(payload, padded)
                chunk_params = self.inner._read_params(payload, padded)
                params.append((chunk_params[0], chunk_params[1], payload[self.inner.params_bytes(padded) :]))
            native.onebit_decode_rotated_sum(params, numel, self.chunk_size, self._signs_on(out.device), out)
            return out
        rotated = self.inner.decode(payloads[0], padded)
        for payload in payloads[1:]:
            self.inner.decode_add(payload, padded, rotated)
        return out.copy_(self._rotate(rotated, inverse=True)[:numel])

    def _native_decode(self, payload: Tensor, numel: int, out: Tensor, accumulate: bool) -> None:
        padded = self.padded_numel(numel)
        payload = self.inner._check_payload(payload, padded)
        params = self.inner._read_params(payload, padded)
        native.onebit_decode_rotated(
            params[0],
            params[1],
            payload[self.inner.params_bytes(padded) :],
            numel,
            self.chunk_size,
            self._signs_on(out.device),
            out,
            accumulate,
        )

    def decode(self, payload: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
        if self._native(payload.device):
            if out is None:
                out = torch.empty(numel, dtype=torch.float32, device=payload.device)
            else:
                out = _check_out(out, numel, torch.float32, payload.device, "out")
            if numel:
                self._native_decode(payload, numel, out, accumulate=False)
            else:
                self.inner._check_payload(payload, 0)
            return out
        padded = self.padded_numel(numel)
        rotated = self.inner.decode(payload, padded)
        values = self._rotate(rotated, inverse=True)[:numel]
        if out is None:
            return values
        return _check_out(out, numel, torch.float32, payload.device, "out").copy_(values)
