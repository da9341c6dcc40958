"""The environment a test's job starts in: the test process's, less bunsan's own settings."""

from __future__ import annotations

import os

# kept: the suite tests the Gloo path wherever it runs (tests/conftest.py); without it a job
# started on a machine with one GPU picks NCCL, which refuses two ranks on one GPU
KEPT = ("BUNSAN_BACKEND",)


def without_bunsan_settings(*prefixes: str) -> dict[str, str]:
    """``os.environ`` less ``OMP_NUM_THREADS``, every ``BUNSAN_*`` variable but :data:`KEPT`, and
    every variable starting with one of ``prefixes``."""
    return {
        k: v
        for k, v in os.environ.items()
        if k in KEPT or not (k.startswith(("BUNSAN_", *prefixes)) or k == "OMP_NUM_THREADS")
    }
