"""The table of ``bunsan bench peers`` and its block of docs/benchmarks.md. Pure; no torch.

One row per network and setting, over the seeds: bytes per step (mean), median step time (median of the
runs' medians), final test error (mean), time to the target error (median over the seeds, a seed that never
reaches it counting as infinitely late), and that time over PowerSGD's best rank's on the same network.
The target is exact's mean final error on that network plus ``points`` percentage points; time to it is
the training time at the end of the first epoch at or below it (:func:`bunsan.bench.tta.time_to_error`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bunsan.bench.tta import time_to_error

__all__ = [
    "COLUMNS",
    "DOC_RUNS",
    "PEERS_ESTIMATE_S",
    "RIGHT",
    "peers_command",
    "render_peers",
    "summarize",
    "table_cells",
]

COLUMNS = (
    "network",
    "setting",
    "runs",
    "bytes/step",
    "step (ms)",
    "error (%)",
    "time to target (s)",
    "vs PowerSGD best",
)
RIGHT = set(COLUMNS) - {"network", "setting"}

# the block's runs of docs/benchmarks.md: output directory -> the command's arguments (one model each)
_SETTINGS = (
    "exact fp16 powersgd:rank=1 powersgd:rank=2 powersgd:rank=4 postlocal:period=4 postlocal:period=32 "
    "bunsan:bits=1 bunsan:bits=4 bunsan:bits=8 bunsan-ma:period=32 bunsan-bmuf:period=32"
)
_COMMON = f"-np 4 --seeds 0,1,2 --networks loopback rate=1gbit rate=100mbit --settings {_SETTINGS}"
DOC_RUNS = {
    "peers-mnist1d": f"--model mnist1d_cnn --dataset mnist1d --epochs 20 --batch 128 --lr 0.05 {_COMMON}",
    "peers-resnet20": f"--model resnet20 --dataset digits32 --epochs 6 --batch 64 --lr 0.05 --recompute-bn {_COMMON}",
}


# each run's duration on 2 cores: 108 jobs of about 18 s (MNIST-1D) and 40 s (ResNet-20) each
PEERS_ESTIMATE_S = {"peers-mnist1d": 2100, "peers-resnet20": 4800}


def _median_or_none(values: Sequence[float]) -> float | None:
    value = statistics.median(values) if values else math.inf
    return None if math.isinf(value) else value


def _reached(record: dict[str, Any], target: float | None) -> float:
    if target is None or record.get("status") != "ok" or not record.get("test_error_curve"):
        return math.inf
    seconds = time_to_error(record["test_error_curve"], record["epoch_end_s"], target)
    return math.inf if seconds is None else seconds


def summarize(records: Sequence[dict[str, Any]], points: float) -> list[dict[str, Any]]:
    """One row per ``(network, setting)`` of the job records (``network``, ``label``, ``status`` and the
    job's result keys), in their first appearance's order (module docstring)."""
    keys = list(dict.fromkeys((r["network"], r["label"]) for r in records))
    rows = []
    for network in dict.fromkeys(n for n, _ in keys):
        exact = [r["test_error"] for r in records if (r["network"], r["label"]) == (network, "exact") and _ok(r)]
        target = statistics.mean(exact) + points / 100 if exact else None
        here = [row for row in keys if row[0] == network]
        for _, label in here:
            runs = [r for r in records if (r["network"], r["label"]) == (network, label)]
            ok = [r for r in runs if _ok(r)]
            rows.append(
                {
                    "network": network,
                    "label": label,
                    "runs": len(runs),
                    "ok": len(ok),
                    "target": target,
                    "bytes_per_step": statistics.mean(r["bytes_sent_per_step"] for r in ok) if ok else None,
                    "step_ms": statistics.median(r["step_ms_median"] for r in ok) if ok else None,
                    "error": statistics.mean(r["test_error"] for r in ok) if ok else None,
                    "tta_s": _median_or_none([_reached(r, target) for r in runs]),
                }
            )
        powersgd = [r["tta_s"] for r in rows if r["network"] == network and r["label"].startswith("powersgd")]
        best = min((t for t in powersgd if t is not None), default=None)
        for row in rows:
            if row["network"] == network:
                row["vs_powersgd"] = row["tta_s"] / best if best and row["tta_s"] is not None else None
    return rows


def _ok(record: dict[str, Any]) -> bool:
    return record.get("status") == "ok"


def _cell(value: float | None, template: str) -> str:
    return "-" if value is None else template.format(value)


def table_cells(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The table's cells (:data:`COLUMNS`) of :func:`summarize`'s rows."""
    return [
        [
            r["network"],
            r["label"],
            f"{r['ok']}/{r['runs']}",
            _cell(r["bytes_per_step"], "{:.0f}"),
            _cell(r["step_ms"], "{:.1f}"),
            _cell(None if r["error"] is None else 100 * r["error"], "{:.2f}"),
            "not reached" if r["tta_s"] is None and r["target"] is not None else _cell(r["tta_s"], "{:.1f}"),
            _cell(r["vs_powersgd"], "{:.2f}"),
        ]
        for r in rows
    ]


def render_peers(run: str) -> Callable[[Path], str]:
    """The renderer of the block ``run`` of docs/benchmarks.md (a key of :data:`DOC_RUNS`): its table."""
    from bunsan.bench.doc_tables import markdown_table

    def render(out: Path) -> str:
        document = json.loads((out / run / "peers.json").read_text())
        return markdown_table(document["columns"], document["table"])

    return render


def peers_command(run: str) -> str:
    """The command of the block ``run`` of docs/benchmarks.md, ``{out}`` for bench-docs' output directory."""
    return f"bunsan bench peers {DOC_RUNS[run]} --out {{out}}/{run}"
