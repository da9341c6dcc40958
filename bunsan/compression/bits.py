"""Dense bit packing of small non-negative integer codes, 1 to 16 bits each.

Layout. The codes form one little-endian bit stream: code ``j`` occupies stream
bits ``[j * bits, (j + 1) * bits)``, its least significant bit first, and
stream bit ``p`` is bit ``p % 8`` (value ``2 ** (p % 8)``) of byte ``p // 8``.
The packed size is exactly ``ceil(numel * bits / 8)`` bytes; unused high bits
of the last byte are zero. For ``bits=8`` the stream is the codes as uint8,
for ``bits=16`` it is the codes as little-endian uint16, whatever the machine.

Method. ``G = 8 / gcd(bits, 8)`` consecutive codes fill exactly
``B = bits / gcd(bits, 8)`` bytes (8 one-bit codes in 1 byte, 8 three-bit
codes in 3 bytes, 2 twelve-bit codes in 3 bytes), so the stream is a
``(groups, G)`` matrix of codes next to a ``(groups, B)`` matrix of bytes. The
only Python loops run over the at most 8 + 15 (code, byte) overlaps of one
group; each step shifts and ORs a whole column of the matrix, so the work is
vectorized and the same code runs on CPU and CUDA tensors. Faster special
cases, same layout: 8 and 16 bits are plain copies; packing 1, 2 and 4 bits
shifts codes together within 64-bit words; unpacking them looks each byte up
in a 256-entry table. Codes of more than 8 bits are handled as two uint8
planes (bits 0-7 and 8-15), so every shift is a uint8 shift.

Codes of 9 to 15 bits have no fast path and are several times slower than the
others (figures in docs/experiments/design-notes.md, "Compression: measurements moved from
docstrings").

Pure tensor code, no state.
"""

from __future__ import annotations

import functools
import math
import sys

import torch
from torch import Tensor

from bunsan._validate import check_int

__all__ = ["MAX_BITS", "code_dtype", "pack_bits", "packed_size", "unpack_bits"]

MAX_BITS = 16

# Tensor.view(dtype) reinterprets memory in the machine's byte order.
_LITTLE_ENDIAN = sys.byteorder == "little"

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)


def _check_bits(bits: int) -> None:
    check_int("bits", bits, minimum=1, maximum=MAX_BITS)


def packed_size(numel: int, bits: int) -> int:
    """Return the bytes that ``numel`` codes of ``bits`` bits take: ``ceil(numel * bits / 8)``.

    Args:
        numel: Number of codes; must be >= 0.
        bits: Bits per code, 1..16.

    Raises:
        ValueError: If ``numel`` is negative or ``bits`` is out of range.
    """
    _check_bits(bits)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return (numel * bits + 7) // 8


def code_dtype(bits: int) -> torch.dtype:
    """Return the dtype :func:`unpack_bits` returns: uint8 up to 8 bits, int32 above."""
    _check_bits(bits)
    return torch.uint8 if bits <= 8 else torch.int32


@functools.cache
def _layout(bits: int) -> tuple[int, int, tuple[tuple[tuple[int, int, int, int, int], ...], ...]]:
    """Return ``(G, B, overlaps)`` for one group of G codes in B bytes.

    A code is held as one uint8 plane (bits 0..7) or two (bits 8..15 in
    plane 1), so every shift below is a uint8 shift. ``overlaps[k]`` lists,
    for byte ``k`` of the group, one ``(plane, i, q, w, a)`` per piece of a
    code in it: bits ``q .. q + w - 1`` of plane ``plane`` of code ``i`` sit
    at bits ``a .. a + w - 1`` of the byte.
    """
    shared = math.gcd(bits, 8)
    group_codes, group_bytes = 8 // shared, bits // shared
    overlaps = []
    for k in range(group_bytes):
        pieces = []
        for i in range(group_codes):
            lo, hi = max(8 * k, i * bits), min(8 * k + 8, (i + 1) * bits)  # stream bits of code i in byte k
            for plane in (0, 1):
                # The part of [lo, hi) that falls in this plane: code bits 8*plane .. 8*plane + 7.
                start, stop = max(lo, i * bits + 8 * plane), min(hi, i * bits + 8 * plane + 8)
                if start < stop:
                    pieces.append((plane, i, start - i * bits - 8 * plane, stop - start, start - 8 * k))
        overlaps.append(tuple(pieces))
    return group_codes, group_bytes, tuple(overlaps)


# Integer dtypes by size in bytes.
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.cache
def _lookup_table(bits: int, device: torch.device) -> Tensor:
    """(256, 8 // bits) uint8 on ``device``: the codes each byte value holds (bits 1, 2, 4). A constant."""
    per_byte = 8 // bits
    values = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    return ((values >> shifts) & ((1 << bits) - 1)).to(device=device, dtype=torch.uint8)


def _unpack_by_table(rows: Tensor, bits: int, target: Tensor) -> None:
    """Unpack one byte per row of ``rows`` into ``target`` (groups, 8 // bits) uint8, in place.

    Gathering one word per byte is ~2x faster than gathering a row of bytes;
    the word view needs ``target`` aligned to the word size, else rows it is.
    """
    table = _lookup_table(bits, rows.device)
    index = rows[:, 0].int()
    word = _WORD_DTYPES[target.shape[1]]
    if target.storage_offset() % target.shape[1] == 0:
        torch.index_select(table.view(word).view(-1), 0, index, out=target.view(word).view(-1))
    else:
        torch.index_select(table, 0, index, out=target)


def _pack_groups(planes: list[Tensor], bits: int, out: Tensor) -> None:
    """Pack uint8 code planes, each (groups, G), into ``out`` (groups, B) uint8, in place.

    No masks are needed: a piece ends at the end of its byte, whose higher
    bits the uint8 left shift drops, or at the end of its code's plane.
    """
    _, _, overlaps = _layout(bits)
    for k, pieces in enumerate(overlaps):
        target = out[:, k]
        first = True
        for plane, i, q, _, a in pieces:
            piece = planes[plane][:, i]
            if q:
                piece = piece >> q
            if first:
                torch.bitwise_left_shift(piece, a, out=target)
                first = False
            else:
                target |= piece << a if a else piece


@functools.cache
def _word_rounds(bits: int) -> tuple[tuple[int, int], ...]:
    """``(shift, mask)`` per round of :func:`_pack_words` for 1, 2 or 4 bits."""
    rounds = []
    spacing, width = 8, bits  # 8 fields of 8 bits, each holding one code
    while spacing < 64:
        mask = sum(((1 << 2 * width) - 1) << (2 * spacing * j) for j in range(64 // (2 * spacing)))
        rounds.append((spacing - width, mask))
        spacing, width = 2 * spacing, 2 * width
    return tuple(rounds)


def _pack_words(codes: Tensor, bits: int, out: Tensor) -> bool:
    """Pack uint8 codes (bits 1, 2 or 4) by shifts within 64-bit words; False if not applicable.

    Each int64 word holds 8 codes, one per byte (little-endian). Each of three
    rounds moves every odd field next to its even neighbour and masks, until
    the 8 codes sit in the word's low ``8 * bits`` bits: 3x faster than
    shifting strided columns. No shift overflows: codes < 2 ** bits <= 16.
    """
    word_bytes = bits  # 8 codes of ``bits`` bits
    if not (
        _LITTLE_ENDIAN
        and codes.is_contiguous()
        and codes.storage_offset() % 8 == 0
        and out.storage_offset() % word_bytes == 0
    ):
        return False
    words = codes.view(torch.int64)
    gathered, shifted = None, torch.empty_like(words)
    for shift, mask in _word_rounds(bits):
        torch.bitwise_right_shift(words if gathered is None else gathered, shift, out=shifted)
        if gathered is None:
            gathered = shifted | words
        else:
            gathered |= shifted
        gathered &= mask
    # The low 8 * bits bits are the packed bytes; integer conversion keeps them
    # (two's complement wrap-around, as on every platform torch supports).
    assert gathered is not None  # _word_rounds yields at least one round
    out.view(_WORD_DTYPES[word_bytes]).copy_(gathered)
    return True


def pack_bits(codes: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """Pack integer codes densely, ``bits`` bits each, into a flat uint8 tensor.

    See the module docstring for the layout. The codes are not range-checked
    (that would cost a pass and, on CUDA, a synchronization): a code outside
    ``0 <= code < 2 ** bits`` leaves the packed bytes undefined.

    Args:
        codes: Integer tensor of any shape and int dtype (bool for 1 bit), read
            in flattened order; every value in ``[0, 2 ** bits)``.
        bits: Bits per code, 1..16.
        out: Optional contiguous uint8 tensor of exactly
            ``packed_size(codes.numel(), bits)`` elements, on the codes' device.

    Returns:
        The packed bytes, flat uint8 (a flat view of ``out`` when given).

    Raises:
        ValueError: If ``bits`` is out of range, ``codes`` is not an integer
            tensor, or ``out`` has the wrong dtype, size, device or layout.
    """
    _check_bits(bits)
    if codes.dtype not in _INT_DTYPES:
        raise ValueError(f"codes must have an integer dtype, got {codes.dtype}; round and convert them first")
    numel = codes.numel()
    nbytes = packed_size(numel, bits)
    out = _check_out(out, nbytes, torch.uint8, codes.device, "out")
    if numel == 0:
        return out
    flat = codes.reshape(-1)
    if bits == 16 and _LITTLE_ENDIAN and out.storage_offset() % 2 == 0:
        # The layout is little-endian uint16; conversion to int16 keeps the low 16 bits.
        out.view(torch.int16).copy_(flat)
        return out
    planes = _byte_planes(flat, 1 if bits <= 8 else 2)
    if bits == 8:
        out.copy_(planes[0])
        return out
    start = 0
    if bits in (1, 2, 4) and numel >= 8:
        # Whole 64-bit words of 8 codes first, by shifts within words if that applies.
        start = numel // 8 * 8
        if not _pack_words(planes[0][:start], bits, out[: start * bits // 8]):
            start = 0
    _pack_columns([plane[start:] for plane in planes], bits, out[start * bits // 8 :])
    return out


def _pack_columns(planes: list[Tensor], bits: int, out: Tensor) -> None:
    """Pack flat uint8 code planes into ``out`` by shifting columns of code groups, in place."""
    numel = planes[0].numel()
    group_codes, group_bytes, _ = _layout(bits)
    groups = numel // group_codes
    body = groups * group_codes
    if groups:
        rows = [plane[:body].view(groups, group_codes) for plane in planes]
        _pack_groups(rows, bits, out[: groups * group_bytes].view(groups, group_bytes))
    if body < numel:
        # The last, partial group: pad its codes with zeros, keep the bytes that exist.
        tail_planes = []
        for plane in planes:
            tail_plane = plane.new_zeros(1, group_codes)
            tail_plane[0, : numel - body] = plane[body:]
            tail_planes.append(tail_plane)
        tail = out.new_empty(1, group_bytes)
        _pack_groups(tail_planes, bits, tail)
        out[groups * group_bytes :].copy_(tail[0, : out.numel() - groups * group_bytes])


def _byte_planes(flat: Tensor, count: int) -> list[Tensor]:
    """Return uint8 tensors holding byte 0 (and byte 1 when ``count`` is 2) of each value.

    On a little-endian machine these are strided views of ``flat``'s memory,
    so reading them costs nothing extra; elsewhere they are computed.
    Writing into the views writes into ``flat``.
    """
    if flat.dtype == torch.bool or (flat.element_size() == 1 and count == 2):
        flat = flat.to(torch.uint8 if count == 1 else torch.int32)
    if flat.element_size() == 1:
        return [flat.view(torch.uint8)]
    if _LITTLE_ENDIAN:
        as_bytes = flat.view(torch.uint8).view(-1, flat.element_size())
        return [as_bytes[:, plane] for plane in range(count)]
    # Conversion to uint8 keeps the low byte (C++ integer conversion is modular).
    return [flat.to(torch.uint8), (flat >> 8).to(torch.uint8)][:count]


def _unpack_groups(packed: Tensor, bits: int, planes: list[Tensor]) -> None:
    """Unpack ``packed`` (groups, B) uint8 into uint8 code planes, each (groups, G), in place."""
    _, _, overlaps = _layout(bits)
    written: set[tuple[int, int]] = set()
    for k, pieces in enumerate(overlaps):
        column = packed[:, k]
        for plane, i, q, w, a in pieces:
            piece = column
            if a:
                piece = piece >> a
            if a + w < 8:
                piece = piece & ((1 << w) - 1)
            target = planes[plane][:, i]
            if (plane, i) in written:
                target |= piece << q if q else piece
            else:
                torch.bitwise_left_shift(piece, q, out=target)
                written.add((plane, i))


def unpack_bits(packed: Tensor, bits: int, numel: int, out: Tensor | None = None) -> Tensor:
    """Unpack ``numel`` codes of ``bits`` bits from bytes made by :func:`pack_bits`.

    Args:
        packed: uint8 tensor of at least ``packed_size(numel, bits)`` elements
            (read in flattened order; extra bytes are ignored).
        bits: Bits per code, 1..16.
        numel: Number of codes to read; must be >= 0.
        out: Optional contiguous integer tensor of ``numel`` elements on
            ``packed``'s device, wide enough for ``bits``-bit values (uint8
            holds up to 8 bits, int16 up to 15, int32 and int64 all).

    Returns:
        Flat codes: a flat view of ``out`` when given, else a new tensor of
        :func:`code_dtype` (uint8 up to 8 bits, int32 above).

    Raises:
        ValueError: If ``bits`` or ``numel`` is out of range, ``packed`` is not
            uint8 or too short, or ``out`` is unsuitable.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    nbytes = packed_size(numel, bits)
    if packed.numel() < nbytes:
        raise ValueError(
            f"packed has {packed.numel()} bytes but {numel} codes of {bits} bits need {nbytes}; "
            "pass the numel that was packed"
        )
    if out is None:
        out = torch.empty(numel, dtype=code_dtype(bits), device=packed.device)
    else:
        out = _check_out(out, numel, None, packed.device, "out")
        if out.dtype not in _MAX_BITS or _MAX_BITS[out.dtype] < bits:
            raise ValueError(f"out has dtype {out.dtype}, which cannot hold {bits}-bit codes; use {code_dtype(bits)}")
    if numel == 0:
        return out
    source = packed.reshape(-1)[:nbytes]
    if bits == 8:
        out.copy_(source)
        return out
    if bits == 16 and _LITTLE_ENDIAN and source.storage_offset() % 2 == 0:
        out.copy_(source.view(torch.int16))
        out &= 0xFFFF  # int16 -> wider int sign-extended codes >= 2**15
        return out
    group_codes, group_bytes, _ = _layout(bits)
    groups = numel // group_codes
    body = groups * group_codes
    # uint8 planes of the codes, written in place: ``out`` itself when it is uint8,
    # the low two bytes of ``out`` for wide codes on little-endian machines.
    if out.dtype == torch.uint8:
        planes, result = [out], None
    elif bits > 8 and _LITTLE_ENDIAN:
        out_bytes = out.view(torch.uint8).view(numel, out.element_size())
        out_bytes[:, 2:].zero_()
        planes, result = [out_bytes[:, 0], out_bytes[:, 1]], None
    else:
        planes = [torch.empty(numel, dtype=torch.uint8, device=packed.device) for _ in range(1 + (bits > 8))]
        result = out
    if groups:
        rows = source[: groups * group_bytes].view(groups, group_bytes)
        targets = [plane[:body].view(groups, group_codes) for plane in planes]
        if group_bytes == 1 and bits < 8:  # bits 1, 2, 4: one table lookup per byte
            _unpack_by_table(rows, bits, targets[0])
        else:
            _unpack_groups(rows, bits, targets)
    if body < numel:
        tail_bytes = packed.new_zeros(1, group_bytes)
        tail_bytes[0, : nbytes - groups * group_bytes] = source[groups * group_bytes :]
        tail_planes = [packed.new_empty(1, group_codes) for _ in planes]
        _unpack_groups(tail_bytes, bits, tail_planes)
        for plane, tail_plane in zip(planes, tail_planes):
            plane[body:].copy_(tail_plane[0, : numel - body])
    if result is not None:
        result.copy_(planes[-1])
        if bits > 8:
            result <<= 8
            result |= planes[0]
    return out


_MAX_BITS = {torch.uint8: 8, torch.int8: 7, torch.int16: 15, torch.int32: 31, torch.int64: 63}


def _check_out(out: Tensor | None, numel: int, dtype: torch.dtype | None, device: torch.device, name: str) -> Tensor:
    """Return ``out`` flattened (a view), or a new flat tensor when ``out`` is None."""
    if out is None:
        assert dtype is not None
        return torch.empty(numel, dtype=dtype, device=device)
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if out.numel() != numel:
        raise ValueError(f"{name} must have exactly {numel} elements, got {out.numel()}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device} but the input is on {device}; allocate it there")
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass a fresh buffer or a contiguous slice")
    return out.view(-1)
