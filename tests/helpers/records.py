"""Hand-made `bunsan bench compare` records for the tests of the scripts that read them."""

from __future__ import annotations

from pathlib import Path


def compare_config(label: str, curve: list[float], ends: list[float], run_dir: Path, workers: int = 2) -> dict:
    """One setting's entry of a compare record: its test-error curve and epoch end times, run in ``run_dir``."""
    return {
        "label": label,
        "workers": workers,
        "status": "ok",
        "test_error": curve[-1],
        "test_error_curve": curve,
        "epoch_end_s": ends,
        "dir": str(run_dir),
    }
