"""PNG plots of ``bunsan bench compare`` records, and the figure helpers of every benchmark's plots.

* ``scaling.png``: wall time and test error against the worker count, one
  line per algorithm setting (when a setting ran at two or more counts).
* ``sweep_warm_start.png``, ``sweep_block_size.png``: test error and wall time
  against the warm-start size or the block size, one line per algorithm and
  worker count (when two or more values of it ran with everything else equal).
* ``curves.png``: test error after each epoch, one panel per worker count.

Figures are drawn with matplotlib's object API on the Agg canvas, without
pyplot: no global backend is chosen and no window opens, so this runs on a
machine without a display and inside any process. matplotlib comes with the
``bench`` extra (``pip install 'bunsan[bench]'``); without it a plot raises
:class:`bunsan._extras.MissingExtraError`, one sentence naming the extra.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bunsan import _extras

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "SWEPT_KEYS",
    "new_figure",
    "plot_compare",
    "plot_curves",
    "plot_scaling",
    "plot_sweep",
    "save_figure",
    "sweep_groups",
]

SWEPT_KEYS = ("warm_start", "block_size")  # record keys that have a sweep plot


def _ok(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status") == "ok" and r.get("wall_s") is not None]


def new_figure(panels: int, size: tuple[float, float] | None = None) -> tuple[Figure, list[Any]]:
    """A figure of ``panels`` axes side by side (5.5 x 4.2 inches each unless ``size`` is given), on the Agg canvas."""
    _extras.check("a benchmark plot", ["matplotlib"], "bench")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size or (5.5 * panels, 4.2), layout="constrained")
    FigureCanvasAgg(figure)  # the PNG renderer, attached to this figure only
    axes = figure.subplots(1, panels, squeeze=False)[0]
    return figure, list(axes)


def save_figure(figure: Figure, path: Path) -> Path:
    """Write ``figure`` as a PNG to ``path`` (creating its directory); return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def plot_scaling(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Wall time and test error against workers, per setting; ``None`` if no setting ran at two counts."""
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in _ok(records):
        by_label[r["label"]].append(r)
    lines = {label: sorted(rs, key=lambda r: r["workers"]) for label, rs in by_label.items() if len(rs) >= 2}
    if not lines:
        return None
    figure, (time_axes, error_axes) = new_figure(2)
    counts = sorted({r["workers"] for rs in lines.values() for r in rs})
    for label, rs in lines.items():
        x = [r["workers"] for r in rs]
        time_axes.plot(x, [r["wall_s"] for r in rs], marker="o", label=label)
        error_axes.plot(x, [100 * r["test_error"] for r in rs], marker="o", label=label)
    for axes, ylabel in ((time_axes, "training wall time (s)"), (error_axes, "test error (%)")):
        axes.set_xlabel("workers")
        axes.set_ylabel(ylabel)
        axes.set_xticks(counts)
        axes.grid(alpha=0.3)
    time_axes.set_ylim(bottom=0)
    error_axes.legend(fontsize="small")
    figure.suptitle("time and error against the number of workers")
    return save_figure(figure, path)


def sweep_groups(records: Sequence[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    """Successful records that differ only in ``key``, grouped, each group sorted by it.

    Records are alike when they share the algorithm, the worker count and every
    option other than ``key``; only groups with two or more values of ``key``
    are returned, under a legend label such as ``block_momentum -np 4``.
    """
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in _ok(records):
        if r.get(key) is None:
            continue
        others = tuple(sorted((k, repr(v)) for k, v in (r.get("options") or {}).items() if k != key))
        groups[(r["algorithm"], r["workers"], others)].append(r)
    out = {}
    for (algorithm, workers, others), rs in groups.items():
        if len({r[key] for r in rs}) < 2:
            continue
        extra = ",".join(f"{k}={v}" for k, v in others)
        out[f"{algorithm}{':' + extra if extra else ''} -np {workers}"] = sorted(rs, key=lambda r: r[key])
    return out


def plot_sweep(records: Sequence[dict[str, Any]], key: str, path: Path) -> Path | None:
    """Test error and wall time against ``key`` (e.g. ``block_size``); ``None`` if nothing was swept."""
    groups = sweep_groups(records, key)
    if not groups:
        return None
    figure, (error_axes, time_axes) = new_figure(2)
    values = sorted({r[key] for rs in groups.values() for r in rs})
    for label, rs in groups.items():
        x = [r[key] for r in rs]
        error_axes.plot(x, [100 * r["test_error"] for r in rs], marker="o", label=label)
        time_axes.plot(x, [r["wall_s"] for r in rs], marker="o", label=label)
    # Sizes usually grow geometrically (256, 1024, 4096); a zero (no warm start) needs a linear part.
    positive = [v for v in values if v > 0]
    scale: dict[str, Any] = {"value": "linear"}
    if positive and max(positive) / min(positive) >= 8:
        scale = (
            {"value": "log", "base": 2}
            if len(positive) == len(values)
            else {"value": "symlog", "base": 2, "linthresh": min(positive)}
        )
    unit = "samples per worker" if key == "block_size" else "samples, all workers"
    for axes, ylabel in ((error_axes, "test error (%)"), (time_axes, "training wall time (s)")):
        axes.set_xscale(**scale)
        axes.set_xticks(values, [str(v) for v in values])
        axes.set_xlabel(f"{key.replace('_', ' ')} ({unit})")
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
    time_axes.set_ylim(bottom=0)
    error_axes.legend(fontsize="small")
    figure.suptitle(f"test error and time against the {key.replace('_', ' ')}")
    return save_figure(figure, path)


def plot_curves(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Test error after each epoch, one panel per worker count; ``None`` without curves."""
    with_curves = [r for r in _ok(records) if r.get("test_error_curve")]
    if not with_curves:
        return None
    counts = sorted({r["workers"] for r in with_curves})
    figure, panels = new_figure(len(counts))
    for axes, n in zip(panels, counts):
        for r in (r for r in with_curves if r["workers"] == n):
            curve = r["test_error_curve"]
            axes.plot(range(1, len(curve) + 1), [100 * e for e in curve], label=r["label"])
        axes.set_title(f"{n} worker{'s' if n > 1 else ''}")
        axes.set_xlabel("epoch")
        axes.set_ylabel("test error (%) if stopped there")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return save_figure(figure, path)


def plot_compare(records: Sequence[dict[str, Any]], directory: Path) -> list[Path]:
    """Write every plot the records support into ``directory``; return the files written."""
    directory = Path(directory)
    written = [plot_scaling(records, directory / "scaling.png")]
    written += [plot_sweep(records, key, directory / f"sweep_{key}.png") for key in SWEPT_KEYS]
    written.append(plot_curves(records, directory / "curves.png"))
    return [p for p in written if p is not None]
