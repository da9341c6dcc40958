"""Pure tensor codecs for gradient exchange: no communication, no state between calls.

* :mod:`~bunsan.compression.bits`: dense packing of 1..16-bit integer codes.
* :mod:`~bunsan.compression.quantize`: :class:`Quantizer`, chunked 1-bit
  (Seide et al., 2014) and 2..16-bit quantization into one uint8 payload of a
  size known in advance, with error feedback into a caller-owned residual.
* :mod:`~bunsan.compression.rotation`: :class:`RotatedQuantizer`, the same
  codec applied to chunks rotated by random signs and a Walsh-Hadamard
  transform (same bytes, less error on heavy-tailed chunks).
* :mod:`~bunsan.compression.native`: the 1-bit codec (plain and rotated) on CPU
  as C kernels compiled on first use (``onebit.c``), about the speed of a
  memory copy; the torch operations run where no compiler is found.
"""

from __future__ import annotations

from bunsan.compression.bits import MAX_BITS, code_dtype, pack_bits, packed_size, unpack_bits
from bunsan.compression.quantize import CLIP_ALPHA, DEFAULT_CHUNK_SIZE, Quantizer
from bunsan.compression.rotation import RotatedQuantizer, hadamard

__all__ = [
    "CLIP_ALPHA",
    "DEFAULT_CHUNK_SIZE",
    "MAX_BITS",
    "Quantizer",
    "RotatedQuantizer",
    "code_dtype",
    "hadamard",
    "pack_bits",
    "packed_size",
    "unpack_bits",
]
