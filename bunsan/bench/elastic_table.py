"""The elastic block of docs/benchmarks.md: a worker killed at a random step, elastic against a restart.

Its commands run ``tools/elastic_runs.py`` (4 workers, the MNIST-1D CNN, 30 epochs) five ways: uninterrupted
at seeds 0, 1, 2; one worker killed with ``kill -9`` (slots in turn, rank 0 among them); a second worker
killed while the others recover; the killed slot restarted (``--max-restarts 1``) and joining; and the same
kill in a fixed group that restarts every worker from a checkpoint written every epoch. The table sets the
outcomes side by side: jobs that ended with exit 0, equal replicas and no process left; seconds from the kill
to the next committed step; steps trained twice; the final test error. Pure; no torch.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bunsan.bench.doc_tables import markdown_table

__all__ = ["ELASTIC_COMMANDS", "ELASTIC_ESTIMATE_S", "render_elastic"]

_RUNS = "python tools/elastic_runs.py --out {out}/elastic"
ELASTIC_COMMANDS = (
    f"{_RUNS} --jobs 3 --kill none",
    f"{_RUNS} --jobs 20 --kill one",
    f"{_RUNS} --jobs 10 --kill second",
    f"{_RUNS} --jobs 5 --kill rejoin",
    f"{_RUNS} --jobs 5 --kill restart --checkpoint",
)
ELASTIC_ESTIMATE_S = 43 * 35  # 43 jobs of about 35 s on 2 cores

_ROWS = (
    ("none", "uninterrupted (seeds 0, 1, 2)"),
    ("one", "elastic: one worker killed"),
    ("second", "elastic: a second worker killed during the recovery"),
    ("rejoin", "elastic: the killed worker restarted, joins"),
    ("restart", "fixed group: --max-restarts 1, checkpoint every epoch"),
)


def _spread(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} / {max(values):{fmt}}"


def _row(label: str, records: list[dict[str, Any]]) -> list[str]:
    ok = sum(r["code"] == 0 and r["replicas_equal"] and r["left"] == 0 for r in records)
    errors = [100 * r["test_error"] for r in records if r.get("test_error") is not None]
    error = f"{statistics.mean(errors):.2f} ({min(errors):.2f}-{max(errors):.2f})" if errors else "-"
    return [
        label,
        str(len(records)),
        f"{ok} of {len(records)}",
        _spread([r["recovery_s"] for r in records if r.get("recovery_s") is not None], ".2f"),
        _spread([r["rejoined_s"] for r in records if r.get("rejoined_s") is not None], ".2f"),
        _spread([float(r["redone_steps"]) for r in records], ".0f"),
        error,
        f"{statistics.median(r['wall_s'] for r in records):.1f}",
    ]


def render_elastic(out: Path) -> str:
    """The table from the records ``tools/elastic_runs.py`` wrote under ``out/elastic``."""
    rows = []
    for kill, label in _ROWS:
        path = out / "elastic" / f"{kill}.json"
        rows.append(_row(label, json.loads(path.read_text())))
    header = [
        "setting",
        "jobs",
        "exit 0, equal replicas, nothing left",
        "kill to next committed step, s (median / max)",
        "restarted worker's start to a full group, s (median / max)",
        "steps trained twice (median / max)",
        "final test error, % (mean, range)",
        "job wall time, s (median)",
    ]
    return markdown_table(header, rows)
