"""PNG plots of a study: optimization history, parameter importances, slices, intermediate values.

Optuna's own matplotlib plots (``optuna.visualization.matplotlib``) are used when
they can be imported; otherwise, or with ``renderer="matplotlib"``, bunsan draws
equivalents itself with matplotlib's object API on the Agg canvas (no pyplot,
no global backend, no window), as :mod:`bunsan.bench.plots` does.

Not collective: call it on one rank (rank 0, which holds the study). Needs Optuna
and matplotlib, both installed by the ``hpo`` extra (``pip install 'bunsan[hpo]'``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bunsan import _extras
from bunsan.hpo.search import _import_optuna

if TYPE_CHECKING:
    import optuna

__all__ = ["PLOTS", "save_plots"]

PLOTS = ("optimization_history", "param_importances", "slice", "intermediate_values")
_RENDERERS = ("auto", "optuna", "matplotlib")


def save_plots(
    study: optuna.Study, directory: str | Path, *, plots: Sequence[str] = PLOTS, renderer: str = "auto"
) -> dict[str, Path]:
    """Write the study's plots as ``<directory>/<plot>.png``. Not collective.

    Plots (see :data:`PLOTS`): ``optimization_history`` (each complete trial's
    value and the best so far), ``param_importances`` (fANOVA, as Optuna
    computes it; needs two complete trials, a parameter that varies and
    scikit-learn, from ``bunsan[data]``),
    ``slice`` (value against each parameter) and ``intermediate_values`` (the
    values reported for pruning, per trial). A plot the study has no data for
    is left out.

    Args:
        study: A single-objective study.
        directory: Created if missing.
        plots: Which of :data:`PLOTS` to draw (the importances take a second or
            two the first time: fANOVA imports scikit-learn).
        renderer: ``"auto"`` (Optuna's plots where they work, else bunsan's),
            ``"optuna"`` (Optuna's only) or ``"matplotlib"`` (bunsan's only).

    Returns:
        The written files by plot name.

    Raises:
        ValueError: ``renderer`` or a plot is unknown, or the study has several directions.
        MissingExtraError: matplotlib or Optuna is not installed (an ImportError naming the ``hpo`` extra).
        ImportError: ``renderer="optuna"`` and Optuna's matplotlib plots cannot be imported.
    """
    _extras.check("bunsan.hpo.save_plots()", ["optuna", "matplotlib"], "hpo")
    if renderer not in _RENDERERS:
        raise ValueError(f"renderer must be one of {_RENDERERS}, got {renderer!r}")
    unknown = [name for name in plots if name not in PLOTS]
    if unknown or isinstance(plots, str):
        raise ValueError(f"plots must be a sequence of names among {PLOTS}, got {plots!r}")
    if len(study.directions) != 1:
        raise ValueError(f"save_plots draws single-objective studies; this one has {len(study.directions)} directions")
    optuna_ = _import_optuna()
    ours: dict[str, Callable[[Any], Any]] = {
        "optimization_history": _history,
        "param_importances": _importances,
        "slice": _slice,
        "intermediate_values": _intermediate,
    }
    theirs = _optuna_plots(renderer)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    complete = study.get_trials(deepcopy=False, states=(optuna_.trial.TrialState.COMPLETE,))
    written: dict[str, Path] = {}
    for name in (name for name in PLOTS if name in plots):
        if not complete or (name == "intermediate_values" and not any(t.intermediate_values for t in study.trials)):
            continue
        path = out / f"{name}.png"
        if theirs is not None and _save_optuna(theirs[name], study, path):
            written[name] = path
        elif renderer != "optuna":
            figure = ours[name](study)
            if figure is not None:
                figure.savefig(path, dpi=110)
                written[name] = path
    return written


def _optuna_plots(renderer: str) -> dict[str, Callable[..., Any]] | None:
    if renderer == "matplotlib":
        return None
    try:
        from optuna.visualization import matplotlib as vis

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ExperimentalWarning
            available = vis.is_available()
        if not available:
            raise ImportError("optuna.visualization.matplotlib is not available (matplotlib missing?)")
    except ImportError:
        if renderer == "optuna":
            raise
        return None
    return {
        "optimization_history": vis.plot_optimization_history,
        "param_importances": vis.plot_param_importances,
        "slice": vis.plot_slice,
        "intermediate_values": vis.plot_intermediate_values,
    }


def _save_optuna(plot: Callable[..., Any], study: optuna.Study, path: Path) -> bool:
    """Draw one of Optuna's plots into ``path``; False when Optuna cannot draw it for this study."""
    import matplotlib
    import matplotlib.pyplot as plt  # Optuna's plots draw through pyplot

    # rc_context: Optuna's plots switch pyplot to the "ggplot" style; the caller's settings come back after.
    with matplotlib.rc_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ExperimentalWarning of the matplotlib backend
        try:
            axes = plot(study)
        except (ValueError, RuntimeError, ImportError):
            return False  # e.g. importances of a study whose parameters never vary
        first = axes.flat[0] if hasattr(axes, "flat") else axes
        figure = first.figure
        try:
            figure.savefig(path, dpi=110, bbox_inches="tight")
        finally:
            plt.close(figure)
    return True


# -- bunsan's own drawings -------------------------------------------------------------------


def _figure(panels: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(panels, 4)
    rows = math.ceil(panels / columns)
    figure = Figure(figsize=(4.2 * columns + 1.0, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).flat
    return figure, list(axes)


def _complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    optuna_ = _import_optuna()
    return study.get_trials(deepcopy=False, states=(optuna_.trial.TrialState.COMPLETE,))


def _maximize(study: optuna.Study) -> bool:
    return study.direction.name == "MAXIMIZE"


def _history(study: optuna.Study) -> Any:
    trials = _complete(study)
    figure, (axes,) = _figure()
    numbers_ = [t.number for t in trials]
    values = [t.value for t in trials if t.value is not None]  # complete trials: every one has a value
    best = max if _maximize(study) else min
    running = [best(values[: i + 1]) for i in range(len(values))]
    axes.scatter(numbers_, values, label="objective value", color="tab:blue")
    axes.step(numbers_, running, where="post", label="best value", color="tab:red")
    axes.set(title="Optimization history", xlabel="trial", ylabel="objective value")
    axes.legend()
    return figure


def _importances(study: optuna.Study) -> Any:
    optuna_ = _import_optuna()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importances = optuna_.importance.get_param_importances(study)
    except (ValueError, RuntimeError, ImportError):
        return None
    if not importances:
        return None
    figure, (axes,) = _figure()
    names = list(importances)[::-1]  # most important on top
    axes.barh(names, [importances[n] for n in names], color="tab:blue")
    axes.set(title="Hyper-parameter importances", xlabel="importance (fANOVA)")
    return figure


def _slice(study: optuna.Study) -> Any:
    trials = _complete(study)
    names = sorted({name for t in trials for name in t.params})
    if not names:
        return None
    figure, axes = _figure(len(names))
    for panel, name in zip(axes, names, strict=False):  # spare panels hidden below
        points = [(t.params[name], t.value, t.number) for t in trials if name in t.params]
        raw = [p[0] for p in points]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw)
        if numeric:
            x = [float(v) for v in raw]
            distribution = trials[-1].distributions.get(name) if name in trials[-1].distributions else None
            if getattr(distribution, "log", False):
                panel.set_xscale("log")
        else:
            labels = sorted({str(v) for v in raw})
            x = [labels.index(str(v)) for v in raw]
            panel.set_xticks(range(len(labels)), labels, rotation=20)
        scatter = panel.scatter(x, [p[1] for p in points], c=[p[2] for p in points], cmap="Blues", edgecolors="grey")
        panel.set(xlabel=name, ylabel="objective value" if panel is axes[0] else "")
    for panel in axes[len(names) :]:
        panel.set_visible(False)
    figure.colorbar(scatter, ax=axes[: len(names)], label="trial")
    figure.suptitle("Slice plot")
    return figure


def _intermediate(study: optuna.Study) -> Any:
    optuna_ = _import_optuna()
    trials = [t for t in study.get_trials(deepcopy=False) if t.intermediate_values]
    if not trials:
        return None
    figure, (axes,) = _figure()
    for t in trials:
        steps = sorted(t.intermediate_values)
        pruned = t.state == optuna_.trial.TrialState.PRUNED
        axes.plot(
            steps,
            [t.intermediate_values[s] for s in steps],
            marker="o",
            markersize=3,
            linestyle="--" if pruned else "-",
            label=f"trial {t.number}" + (" (pruned)" if pruned else ""),
        )
    axes.set(title="Intermediate values", xlabel="step", ylabel="reported value")
    if len(trials) <= 12:
        axes.legend(fontsize="small")
    return figure
