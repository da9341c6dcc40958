"""Benchmarks: ratios measured side by side in one run (this machine is shared and noisy)."""

from __future__ import annotations

__all__: list[str] = []
