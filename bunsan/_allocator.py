"""Keep freed CPU memory for the next step instead of handing it back to the kernel (glibc malloc).

A training step allocates and frees the same large tensors every time (activations,
their gradients, the exchange's buffers). glibc's malloc serves blocks above its
``M_MMAP_THRESHOLD`` with fresh ``mmap`` calls and gives the free top of its heap back
to the kernel once it exceeds ``M_TRIM_THRESHOLD``; both thresholds move with the sizes
freed so far, so whether a step's memory comes back warm or as fresh pages depends on
the order in which earlier steps freed it. Fresh pages cost a page fault each on first
touch. Measured on ResNet-20 (batch 32, 2 workers, docs/experiments/design-notes.md, "Page faults"):
the forward pass of bunsan's trainer took about 3,700 minor page faults per step against
340 for DDP's in the same process, mostly because bunsan frees the autograd-allocated
gradients at the end of backward (their values live in the exchange's buckets) where DDP
frees them at the next ``zero_grad`` (holding them as DDP does: 870); with both thresholds
fixed, neither takes any.

:func:`tune` fixes them (``mallopt``) at 32 MiB (glibc's largest mmap threshold on
64-bit: larger blocks are still mapped afresh) and 1 GiB. Memory freed by a step stays
in the process for the next one, as the CUDA caching allocator keeps GPU memory. Set
``BUNSAN_MALLOC_TUNING=0`` to leave malloc alone. Only on Linux with glibc; elsewhere
nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune", "tuned"]

MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TRIM_THRESHOLD = 2**30
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
_tuned = False


def tune() -> bool:
    """Fix glibc malloc's mmap and trim thresholds for this process (see the module docstring).

    Returns whether they are set (also when an earlier call set them). Idempotent.
    """
    global _tuned
    if _tuned:
        return True
    if os.environ.get("BUNSAN_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt may mean something else
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _tuned


def tuned() -> bool:
    """Whether :func:`tune` has set the thresholds in this process."""
    return _tuned
