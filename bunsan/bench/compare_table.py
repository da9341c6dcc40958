"""The table of ``bunsan bench compare``: its columns, speed ratios and cells. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["COLUMNS", "RIGHT", "speed_ratios", "speedups_vs_first", "table_rows"]


def speed_ratios(rows: Sequence[tuple[str, int, float | None]], reference: int) -> list[float | None]:
    """``time(reference workers) / time(N)`` of the same setting, for each ``(label, workers, wall_s)``.

    ``None`` where this row or its reference has no time (failed).
    """
    base = {label: wall for label, workers, wall in rows if workers == reference and wall}
    return [base[label] / wall if wall and label in base else None for label, _, wall in rows]


def speedups_vs_first(rows: Sequence[tuple[str, int, float | None]], first: str) -> list[float | None]:
    """Algorithm speed-up ``time(first setting) / time(this setting)`` at the same worker count.

    For each ``(label, workers, wall_s)``; ``None`` where either time is missing.
    """
    base = {workers: wall for label, workers, wall in rows if label == first and wall}
    return [base[workers] / wall if wall and workers in base else None for _, workers, wall in rows]


# -- the table -------------------------------------------------------------------------
# "speed": time(reference worker count) / time(N), same setting (CNTK's 速度比);
# "vs first": time(first setting) / time(this setting), same worker count (the algorithm's speed-up).
COLUMNS = (
    "workers",
    "algorithm",
    "bits",
    "warm start",
    "block size",
    "epochs",
    "time (s)",
    "speed",
    "vs first",
    "error (%)",
    "bytes/sample",
    "samples/s",
)
RIGHT = set(COLUMNS) - {"algorithm"}


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _bits_cell(record: dict[str, Any]) -> str:
    if record.get("compression"):
        return str(record["compression"])
    return "-" if record.get("bits") is None else str(record["bits"])


def _count_cell(value: Any) -> str:
    return "-" if value is None else str(value)


def table_rows(records: Iterable[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one row per configuration record (see :func:`run` for the record's keys)."""
    rows = []
    for r in records:
        ok = r.get("status") == "ok"
        time_cell = _number(r.get("wall_s"), 1) if ok else str(r.get("status", "failed"))
        error = r.get("test_error")
        rows.append(
            [
                str(r["workers"]),
                r["label"],
                _bits_cell(r),
                _count_cell(r.get("warm_start")),
                _count_cell(r.get("block_size")),
                str(r["epochs"]),
                time_cell,
                _number(r.get("speed_ratio"), 2) if ok else "-",
                _number(r.get("speedup_vs_first"), 2) if ok else "-",
                _number(None if error is None else 100 * error, 2) if ok else "-",
                _number(r.get("bytes_sent_per_sample"), 1) if ok else "-",
                _number(r.get("samples_per_s"), 0) if ok else "-",
            ]
        )
    return rows
