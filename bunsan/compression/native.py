"""The 1-bit codec's CPU kernels (``onebit.c``), compiled on first use and called through ctypes.

torch executes one elementwise operation per pass over memory; a 1-bit encode with
error feedback takes about ten such passes (add, compare, sums, reconstruct, subtract,
pack), a decode three. The C kernels read each chunk from memory once, do the rest in
L1, and write the packed bits once, which is what brings the codec near the speed of a
memory copy (numbers in :mod:`bunsan.bench.quantized`, column "copy ms").

The source is compiled with the system's C compiler (``$CC``, else ``cc``) into
``$BUNSAN_CACHE_DIR`` (default ``~/.cache/bunsan``), named by a hash of the source,
the flags and the machine, once per machine; several processes compiling at once is
safe (each writes its own file, then an atomic rename). Without a compiler, or with
``BUNSAN_NATIVE=0``, :func:`available` is False and the codec uses torch operations:
the same payload format, decoding bit for bit the same, encoding the same up to the
last bit of a chunk mean (float sums in a different order).

Pure functions on contiguous CPU float32 / uint8 tensors; no state but the loaded
library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "available",
    "axpby",
    "onebit_decode",
    "onebit_decode_rotated",
    "onebit_decode_rotated_sum",
    "onebit_decode_sum_then",
    "onebit_encode",
    "onebit_encode_rotated",
]

_SOURCE = Path(__file__).with_name("onebit.c")
# No -march=native: the library may sit in a home directory shared by machines of
# different CPUs. SSE2 (every x86-64) is the baseline; where /proc/cpuinfo lists AVX2 and FMA
# a second build with -mavx2 -mfma (its own file) runs the rotation's wide butterfly levels 8
# floats at a time. The codec does the same IEEE operations in both, so they give the same
# bits; the local momentum's axpby fuses its multiply-add only in the second, as torch's own
# kernels do on such a CPU (onebit.c), so that each build gives the bits of torch's operations.
_FLAGS = ["-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off"]
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_reason = ""


def _cache_dir() -> Path:
    return Path(os.environ.get("BUNSAN_CACHE_DIR") or Path.home() / ".cache" / "bunsan")


def _has_avx2() -> bool:
    """Whether this CPU runs AVX2 and FMA (Linux: /proc/cpuinfo), as torch's AVX2 kernels require; the
    AVX2 build is chosen only then."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line and " fma" in line for line in f)
    except OSError:
        return False


def _compile() -> ctypes.CDLL:
    if platform.machine() in ("x86_64", "AMD64") and _has_avx2():
        try:
            return _compile_with(["-mavx2", "-mfma"])
        except (OSError, subprocess.SubprocessError):
            pass  # an old compiler: the SSE2 build does the same arithmetic
    return _compile_with([])


def _compile_with(extra: list[str]) -> ctypes.CDLL:
    source = _SOURCE.read_bytes()
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    flags = [*_FLAGS, *extra]
    key = hashlib.sha256(source + " ".join([compiler, *flags, platform.machine()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"bunsan_onebit_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *flags, str(_SOURCE), "-o", partial], check=True, capture_output=True, timeout=120
            )
            os.replace(partial, target)  # atomic: a concurrent loader sees the old state or the whole file
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    library = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.bunsan_onebit_encode.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr]
    library.bunsan_onebit_encode.restype = None
    library.bunsan_onebit_decode.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    library.bunsan_onebit_decode.restype = None
    library.bunsan_onebit_encode_rotated.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
    library.bunsan_onebit_encode_rotated.restype = None
    library.bunsan_onebit_decode_rotated.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    library.bunsan_onebit_decode_rotated.restype = None
    library.bunsan_onebit_decode_rotated_sum.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr]
    library.bunsan_onebit_decode_rotated_sum.restype = None
    library.bunsan_onebit_decode_sum_then.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr]
    library.bunsan_onebit_decode_sum_then.argtypes += [ctypes.c_int, ptr, ptr, ptr, ptr, ptr]
    library.bunsan_onebit_decode_sum_then.restype = None
    f32 = ctypes.c_float
    library.bunsan_axpby.argtypes = [ptr, f32, ptr, f32, ptr, ptr, f32, i64]
    library.bunsan_axpby.restype = None
    return library


def _load() -> ctypes.CDLL | None:
    global _library, _tried, _reason
    if _tried:
        return _library
    with _lock:
        if not _tried:
            if os.environ.get("BUNSAN_NATIVE", "1") == "0":
                _reason = "disabled by BUNSAN_NATIVE=0"
            else:
                try:
                    _library = _compile()
                except (OSError, subprocess.SubprocessError) as e:
                    _reason = f"could not build {_SOURCE.name}: {e}"
            _tried = True
    return _library


def available() -> bool:
    """True when the C kernels are loaded (compiling them on the first call)."""
    return _load() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    _load()
    return _reason


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def onebit_encode(
    values: Tensor, addend: Tensor | None, chunk_size: int, offsets: Tensor, steps: Tensor, packed: Tensor
) -> None:
    """1-bit encode ``values`` in place of ``offsets``, ``steps``, ``packed``.

    With ``addend`` (error feedback) ``values`` is the residual and becomes
    ``values + addend - decode``; without it ``values`` is only read.
    ``chunk_size`` must be a multiple of 8. The caller checks shapes, dtypes,
    devices and contiguity.
    """
    library = _load()
    assert library is not None and chunk_size % 8 == 0
    library.bunsan_onebit_encode(
        _ptr(values), _ptr(addend), values.numel(), chunk_size, _ptr(offsets), _ptr(steps), _ptr(packed)
    )


def onebit_decode(
    offsets: Tensor, steps: Tensor, packed: Tensor, numel: int, chunk_size: int, out: Tensor, accumulate: bool = False
) -> None:
    """Write (or with ``accumulate``, add) the ``numel`` decoded values into ``out``, in place."""
    library = _load()
    assert library is not None and chunk_size % 8 == 0
    library.bunsan_onebit_decode(
        _ptr(offsets), _ptr(steps), _ptr(packed), numel, chunk_size, _ptr(out), int(accumulate)
    )


@functools.cache
def _scales(chunk_size: int) -> Tensor:
    """float32 ``2 ** (-k / 2)`` for k = 0..log2(chunk_size): the Hadamard scale of each row length,
    rounded as torch rounds ``tensor * n ** -0.5`` (the Python float cast to float32)."""
    return torch.tensor([(1 << k) ** -0.5 for k in range(chunk_size.bit_length())], dtype=torch.float32)


def _rotated_call(chunk_size: int) -> tuple[ctypes.CDLL, Tensor, Tensor]:
    """The library, a work row and the scales that every rotated kernel takes (``chunk_size`` a multiple of 8)."""
    library = _load()
    assert library is not None and chunk_size % 8 == 0
    return library, torch.empty(chunk_size, dtype=torch.float32), _scales(chunk_size)


def onebit_encode_rotated(
    values: Tensor,
    addend: Tensor | None,
    chunk_size: int,
    signs: Tensor,
    offsets: Tensor,
    steps: Tensor,
    packed: Tensor,
) -> None:
    """As :func:`onebit_encode` on chunks rotated as :class:`~bunsan.compression.RotatedQuantizer` rotates
    them (``signs``: float32 ``chunk_size``, CPU); the residual stays in the original coordinates."""
    library, work, scales = _rotated_call(chunk_size)  # work and scales stay alive during the call
    library.bunsan_onebit_encode_rotated(
        _ptr(values),
        _ptr(addend),
        values.numel(),
        chunk_size,
        _ptr(signs),
        _ptr(scales),
        _ptr(work),
        _ptr(offsets),
        _ptr(steps),
        _ptr(packed),
    )


def onebit_decode_rotated(
    offsets: Tensor,
    steps: Tensor,
    packed: Tensor,
    numel: int,
    chunk_size: int,
    signs: Tensor,
    out: Tensor,
    accumulate: bool = False,
) -> None:
    """As :func:`onebit_decode` for :func:`onebit_encode_rotated`'s payloads; ``numel`` unpadded."""
    library, work, scales = _rotated_call(chunk_size)  # work and scales stay alive during the call
    library.bunsan_onebit_decode_rotated(
        _ptr(offsets),
        _ptr(steps),
        _ptr(packed),
        numel,
        chunk_size,
        _ptr(signs),
        _ptr(scales),
        _ptr(work),
        _ptr(out),
        int(accumulate),
    )


def onebit_decode_rotated_sum(
    params: list[tuple[Tensor, Tensor, Tensor]], numel: int, chunk_size: int, signs: Tensor, out: Tensor
) -> None:
    """The sum of several rotated payloads ``(offsets, steps, packed)``, decoded into ``out``: summed in
    rotated coordinates in the given order, then rotated back once."""
    assert params
    library, work, scales = _rotated_call(chunk_size)  # work and scales stay alive during the call
    k = len(params)
    pointers = [(ctypes.c_void_p * k)(*(_ptr(t[i]) for t in params)) for i in range(3)]
    library.bunsan_onebit_decode_rotated_sum(
        k, pointers[0], pointers[1], pointers[2], numel, chunk_size, _ptr(signs), _ptr(scales), _ptr(work), _ptr(out)
    )


def axpby(
    x: Tensor | None, a: float, y: Tensor, b: float, out: Tensor, scaled: Tensor | None = None, divisor: float = 1.0
) -> None:
    """``out = a * x + b * y`` (``x`` None: ``b * y``) and, with ``scaled``, ``scaled = out / divisor``, in one
    pass. Float32 arithmetic with one rounding per operation (no fused multiply-add); the arrays may be the
    same. The caller checks that all are contiguous CPU float32 of ``y``'s number of elements."""
    library = _load()
    assert library is not None
    library.bunsan_axpby(_ptr(x), a, _ptr(y), b, _ptr(out), _ptr(scaled), divisor, y.numel())


def onebit_decode_sum_then(
    params: list[tuple[Tensor, Tensor, Tensor]],
    numel: int,
    chunk_size: int,
    out: Tensor,
    pieces: list[tuple[int, int, Tensor, float, float]],
) -> None:
    """The sum of several plain payloads ``(offsets, steps, packed)`` decoded into ``out`` in the given order,
    then for each piece ``(lo, hi, prev, a, divisor)``: ``out[lo:hi] = (out[lo:hi] - a * prev) / divisor``, all
    in one pass over ``out``. Pieces sorted and disjoint; ``prev``: contiguous float32 of ``hi - lo``."""
    library = _load()
    assert library is not None and params and chunk_size % 8 == 0
    k, m = len(params), len(pieces)
    pointers = [(ctypes.c_void_p * k)(*(_ptr(t[i]) for t in params)) for i in range(3)]
    lo = (ctypes.c_int64 * m)(*(piece[0] for piece in pieces))
    hi = (ctypes.c_int64 * m)(*(piece[1] for piece in pieces))
    prev = (ctypes.c_void_p * m)(*(_ptr(piece[2]) for piece in pieces))
    a = (ctypes.c_float * m)(*(piece[3] for piece in pieces))
    divisor = (ctypes.c_float * m)(*(piece[4] for piece in pieces))
    library.bunsan_onebit_decode_sum_then(
        k, pointers[0], pointers[1], pointers[2], numel, chunk_size, _ptr(out), m, lo, hi, prev, a, divisor
    )
