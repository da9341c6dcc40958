"""Benchmarks: ratios measured side by side in one run (this machine is shared and noisy)."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["write_json"]


def write_json(path: str, record: Any) -> None:
    """Write a benchmark's JSON record, creating the directory it goes in (what JSON cannot hold is written as text)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
