"""The Markdown tables of the documents, rendered from the JSON records the benchmarks write.

Each ``render_*`` function reads the records a :class:`bunsan.bench.report.Block`'s
commands wrote under ``out`` and returns the table that goes between its markers;
:func:`job_table` picks columns of the text table that ``compare``, ``throughput``
or ``comm`` stored in its record. Pure but for reading the records; no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bunsan.bench.comm_bench import COLUMNS as COMM_COLUMNS

__all__ = [
    "ACCURACY_ORDER",
    "ACCURACY_RUNS",
    "COMM_COLUMNS",
    "COMM_NETWORK_COLUMNS",
    "COMPARE_COLUMNS",
    "DEFAULTS_SEEDS",
    "DEFAULTS_SETTINGS",
    "THROUGHPUT_COLUMNS",
    "THROUGHPUT_NETWORK_COLUMNS",
    "accuracy_commands",
    "accuracy_label",
    "defaults_commands",
    "job_table",
    "markdown_table",
    "render_accuracy",
    "render_async",
    "render_compare",
    "render_ddp",
    "render_defaults",
    "render_quantized",
    "stack_tables",
]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table. Pure."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _load(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def job_table(
    path: Path,
    columns: Sequence[str],
    keep: Callable[[list[str], dict[str, str]], bool] | None = None,
    prefix: Sequence[tuple[str, str]] = (),
) -> tuple[list[str], list[list[str]]]:
    """Chosen ``columns`` of the table that ``compare``, ``throughput`` or ``comm`` stored in its JSON record.

    ``keep(row, cells_by_column)`` filters rows; ``prefix`` adds constant leading columns ``(name, value)``.
    """
    doc = _load(path)
    index = {name: i for i, name in enumerate(doc["columns"])}
    missing = [c for c in columns if c not in index]
    if missing:
        raise ValueError(f"{path} has no columns {missing}; it has {doc['columns']}")
    rows = []
    for row in doc["table"]:
        by_name = {name: row[i] for name, i in index.items()}
        if keep is None or keep(row, by_name):
            # The text tables print "mean +- spread"; Markdown gets the sign.
            rows.append([value for _, value in prefix] + [by_name[c].replace(" +- ", " ± ") for c in columns])
    return [name for name, _ in prefix] + list(columns), rows


def stack_tables(parts: Sequence[tuple[list[str], list[list[str]]]]) -> str:
    """One Markdown table of the rows of several :func:`job_table` parts, under the first part's header."""
    header = parts[0][0]
    return markdown_table(header, [row for _, rows in parts for row in rows])


COMPARE_COLUMNS = ("workers", "algorithm", "time (s)", "speed", "vs first", "error (%)", "bytes/sample", "samples/s")
THROUGHPUT_COLUMNS = (
    "workers",
    "algorithm",
    "per worker (img/s)",
    "total (img/s)",
    "efficiency",
    "step (ms)",
    "bytes/step",
    "note",
)
THROUGHPUT_NETWORK_COLUMNS = (
    "workers",
    "algorithm",
    "total (img/s)",
    "efficiency",
    "vs first",
    "step (ms)",
    "bytes/step",
)
COMM_NETWORK_COLUMNS = ("size", "op", "bunsan (ms)", "bunsan busbw (GB/s)", "torch (ms)", "torch busbw (GB/s)")


def render_compare(name: str) -> Callable[[Path], str]:
    return lambda out: stack_tables([job_table(out / name / "compare.json", COMPARE_COLUMNS)])


def render_ddp(out: Path) -> str:
    doc = _load(out / "ddp_overhead.json")
    rows = [
        [
            r["model"],
            r["tensors"],
            r["batch"],
            f"{r['ddp_ms']:.3f}",
            f"{r['bunsan_ms']:.3f}",
            f"{r['ratio']:.3f}",
            f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}",
            f"{r['max_param_diff']:.2g}",
            f"{r['ddp_faults']:.0f} / {r['bunsan_faults']:.0f}" if "ddp_faults" in r else "-",
        ]
        for r in doc["results"]
    ]
    return markdown_table(
        [
            "model",
            "tensors",
            "batch/worker",
            "DDP ms/step",
            "bunsan ms/step",
            "ratio",
            "ratio min-max",
            "parameter difference",
            "page faults/step DDP / bunsan",
        ],
        rows,
    )


def render_quantized(out: Path) -> str:
    """Step time (every model) and bytes (the MLP) as ratios to bits=32, one column per bit width."""
    rows: list[list[str]] = []
    header: list[str] = []
    for workers in (2, 4):
        by_model: dict[str, list[dict[str, Any]]] = {}
        for r in _load(out / f"quantized_np{workers}.json")["rows"]:
            by_model.setdefault(r["model"], []).append(r)
        for model, entries in by_model.items():
            header = ["model", "workers", *[e["bits"] for e in entries]]
            rows.append([f"{model} time", str(workers), *[f"{e['time_ratio']:.3f}" for e in entries]])
            if model.startswith("mlp"):
                cells = [f"{e['bytes_ratio']:.3f}" for e in entries]
                if entries[0]["bits"] == "32":
                    cells[0] = f"1.000 ({entries[0]['bytes_per_step'] / 1e6:.1f} MB)"
                rows.append([f"{model} bytes", str(workers), *cells])
    return markdown_table(header, rows)


def render_async(out: Path) -> str:
    doc = _load(out / "async_bench.json")
    rows = [
        [
            r["situation"],
            r["algorithm"],
            f"{r['lr']:g}",
            f"{r['time_s']:.1f} s",
            f"{100 * r['accuracy']:.1f}%",
            f"{r['bytes_per_sample']:.0f}",
        ]
        for r in doc["rows"]
    ]
    return markdown_table(["case", "algorithm", "lr", "time", "test accuracy", "bytes/sample"], rows)


# The accuracy table of the README: (run directory, algorithm label) in the order shown.
ACCURACY_RUNS = {
    "acc-m09": (
        "0.05",
        "0.9",
        [
            "data_parallel",
            "block_momentum:block_size=256,block_learning_rate=0.5",
            "block_momentum:block_size=1024,block_learning_rate=0.5",
            "block_momentum:block_size=4096,block_learning_rate=0.5",
            "block_momentum:block_size=1024",
            "model_averaging:block_size=1024",
            "data_parallel:bits=1,warm_start=40000",
            "data_parallel:bits=2,warm_start=40000",
            "data_parallel:bits=8",
        ],
    ),
    "acc-m09-1bit": ("0.05", "0.9", ["data_parallel:bits=1"]),
    "acc-m09-rotate": (
        "0.05",
        "0.9",
        ["data_parallel:bits=1,rotate=true", "data_parallel:bits=1,rotate=true,warm_start=40000"],
    ),
    "acc-m0": (
        "0.5",
        "0",
        [
            "data_parallel",
            "data_parallel:bits=1",
            "data_parallel:bits=1,warm_start=40000",
            "data_parallel:bits=1,warm_start=80000",
        ],
    ),
    "acc-m05": ("0.25", "0.5", ["data_parallel", "data_parallel:bits=1", "data_parallel:bits=1,warm_start=40000"]),
}
ACCURACY_ORDER = [
    ("acc-m09", 0),
    ("acc-m09", 1),
    ("acc-m09", 2),
    ("acc-m09", 3),
    ("acc-m09", 4),
    ("acc-m09", 5),
    ("acc-m0", 0),
    ("acc-m0", 1),
    ("acc-m0", 2),
    ("acc-m0", 3),
    ("acc-m05", 0),
    ("acc-m05", 1),
    ("acc-m05", 2),
    ("acc-m09-1bit", 0),
    ("acc-m09", 6),
    ("acc-m09", 7),
    ("acc-m09", 8),
    ("acc-m09-rotate", 0),
    ("acc-m09-rotate", 1),
]


def accuracy_commands(compare: str) -> tuple[str, ...]:
    """One ``compare`` run per entry of :data:`ACCURACY_RUNS`; ``compare`` holds every other argument."""
    return tuple(
        f"{compare} --lr {lr} --momentum {momentum} --algorithms {' '.join(labels)} --out {{out}}/{run}"
        for run, (lr, momentum, labels) in ACCURACY_RUNS.items()
    )


def accuracy_label(label: str) -> str:
    """``block_momentum:block_size=256,block_learning_rate=0.5`` -> ``block_momentum block 256, ζ=0.5``. Pure."""
    name, _, rest = label.partition(":")
    options = dict(item.split("=", 1) for item in rest.split(",")) if rest else {}
    parts = []
    if "bits" in options:
        parts.append(f"bits={options['bits']}")
    if options.get("rotate") == "true":
        parts.append("rotate")
    if "warm_start" in options:
        parts.append(f"warm start {int(options['warm_start']):,}")
    if "block_size" in options:
        parts.append(f"block {options['block_size']}")
    if "block_learning_rate" in options:
        parts.append(f"ζ={options['block_learning_rate']}")
    elif name == "block_momentum":
        parts.append("defaults")
    if not parts:
        return name
    first, *others = parts
    return f"{name} {first}" + "".join(f", {p}" for p in others)


def render_accuracy(out: Path) -> str:
    rows = []
    for run, i in ACCURACY_ORDER:
        lr, momentum, labels = ACCURACY_RUNS[run]
        records = {r["label"]: r for r in _load(out / run / "compare.json")["configs"]}
        r = records[labels[i]]
        ok = r.get("status") == "ok"
        rows.append(
            [
                accuracy_label(labels[i]),
                f"{lr}, {momentum}",
                f"{100 * r['test_error']:.1f}%" if ok else r.get("status", "failed"),
                f"{r['bytes_sent_per_sample']:.1f}" if ok else "-",
                f"{r['wall_s']:.1f} s" if ok else "-",
            ]
        )
    return markdown_table(["algorithm", "lr, momentum", "test error", "bytes/sample", "time"], rows)


# The defaults against exact SGD over three seeds: each setting as a user gets it without arguments,
# and CNTK's block learning rate beside bunsan's default.
DEFAULTS_SEEDS = (0, 1, 2)
DEFAULTS_SETTINGS = (
    "data_parallel",
    "data_parallel:bits=1",
    "block_momentum:block_size=1024",
    "block_momentum:block_size=1024,block_learning_rate=1.0",
    "model_averaging:block_size=1024",
)


def defaults_commands(compare: str) -> tuple[str, ...]:
    """One ``compare`` run per seed of :data:`DEFAULTS_SETTINGS`; ``compare`` holds every other argument."""
    settings = " ".join(DEFAULTS_SETTINGS)
    return tuple(
        f"{compare} --seed {seed} --algorithms {settings} --out {{out}}/defaults-s{seed}" for seed in DEFAULTS_SEEDS
    )


def render_defaults(out: Path) -> str:
    """Test error per seed, the mean, and the mean minus exact SGD's mean, one row per setting."""
    errors: dict[str, list[float | None]] = {label: [] for label in DEFAULTS_SETTINGS}
    for seed in DEFAULTS_SEEDS:
        records = {r["label"]: r for r in _load(out / f"defaults-s{seed}" / "compare.json")["configs"]}
        for label in DEFAULTS_SETTINGS:
            r = records.get(label, {})
            errors[label].append(100 * r["test_error"] if r.get("status") == "ok" else None)

    def mean(values: list[float | None]) -> float | None:
        return None if None in values else sum(v for v in values if v is not None) / len(values)

    exact = mean(errors[DEFAULTS_SETTINGS[0]])
    rows = []
    for label in DEFAULTS_SETTINGS:
        m = mean(errors[label])
        rows.append(
            [
                f"`{label}`",
                " / ".join("failed" if e is None else f"{e:.1f}" for e in errors[label]),
                "-" if m is None else f"{m:.2f}%",
                "-" if m is None or exact is None or label == DEFAULTS_SETTINGS[0] else f"{m - exact:+.2f}",
            ]
        )
    seeds = " / ".join(str(seed) for seed in DEFAULTS_SEEDS)
    return markdown_table(["setting", f"test error (%), seeds {seeds}", "mean", "minus exact"], rows)
