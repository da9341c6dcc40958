"""Optional dependencies: which extra of bunsan installs each one, and the one-sentence error when it is missing.

Training needs torch and numpy only. The rest is optional, grouped in the extras
of ``pyproject.toml`` (:data:`EXTRAS` mirrors them)::

    pip install 'bunsan[data]'         # scikit-learn, mnist1d: bunsan.datasets.digits / digits32 / mnist1d
    pip install 'bunsan[bench]'        # data + matplotlib: `bunsan bench ...`, `bunsan plan`, their plots
    pip install 'bunsan[hpo]'          # optuna + matplotlib: bunsan.hpo (search and plots)
    pip install 'bunsan[progress]'     # tqdm: the progress bar of TrainingSession
    pip install 'bunsan[tensorboard]'  # tensorboard: TrainingSession(tensorboard=...)
    pip install 'bunsan[elastic]'      # torchft: elastic jobs, bunsan run --min-np (bunsan.elastic)
    pip install 'bunsan[all]'          # all of the above

and the trainers that bunsan's DDP communication hook integrates with (:data:`FRAMEWORKS`, not
in ``all``: a framework the user brings, not a feature of bunsan)::

    pip install 'bunsan[lightning]'     # bunsan.integrations.lightning
    pip install 'bunsan[accelerate]'    # tested with the hook, nothing of bunsan imports it
    pip install 'bunsan[transformers]'  # bunsan.integrations.transformers

Code that needs one of these imports it through :func:`require` (or checks with
:func:`check` without importing), so a missing package fails with
:class:`MissingExtraError`, one sentence that names the extra, e.g.
``bunsan.datasets.digits() needs scikit-learn, which is not installed: pip install 'bunsan[data]'``.
This module imports only the standard library.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

from bunsan.errors import MissingExtraError

__all__ = [
    "COMMANDS",
    "EXTRAS",
    "FRAMEWORKS",
    "MissingExtraError",
    "available",
    "check",
    "check_command",
    "find_spec",
    "install_hint",
    "require",
]

# extra -> the distributions it installs, as pyproject.toml's [project.optional-dependencies] lists them
EXTRAS: dict[str, tuple[str, ...]] = {
    "data": ("scikit-learn", "mnist1d"),
    "bench": ("matplotlib", "scikit-learn", "mnist1d"),
    "hpo": ("optuna", "matplotlib"),
    "progress": ("tqdm",),
    "tensorboard": ("tensorboard",),
    "elastic": ("torchft",),
}

# the trainers' extras (pyproject.toml lists them apart from `all`): extra -> the distributions it installs
FRAMEWORKS: dict[str, tuple[str, ...]] = {
    "lightning": ("lightning",),
    "accelerate": ("accelerate",),
    "transformers": ("transformers",),
}

# top-level module -> the distribution that provides it (where the names differ, and the others for completeness)
_DISTRIBUTIONS: dict[str, str] = {
    "sklearn": "scikit-learn",
    "mnist1d": "mnist1d",
    "matplotlib": "matplotlib",
    "optuna": "optuna",
    "tqdm": "tqdm",
    "tensorboard": "tensorboard",
    "torchft": "torchft",
    "lightning": "lightning",
    "accelerate": "accelerate",
    "transformers": "transformers",
}


# `bunsan` subcommand -> (the modules it needs beyond torch and numpy, the extra that installs them); checked by
# bunsan.cli before the subcommand starts, so that a benchmark does not fail at its end, when it draws its plots
COMMANDS: dict[str, tuple[tuple[str, ...], str]] = {
    "bench": (("matplotlib", "sklearn", "mnist1d"), "bench"),  # the bundled data sets, the PNG plots
}


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: ``pip install 'bunsan[EXTRA]'``."""
    if extra not in EXTRAS and extra not in FRAMEWORKS:
        raise ValueError(f"unknown extra {extra!r}; choose one of: {', '.join(sorted({*EXTRAS, *FRAMEWORKS}))}")
    return f"pip install 'bunsan[{extra}]'"


def _distribution(module: str) -> str:
    top = module.partition(".")[0]
    return _DISTRIBUTIONS.get(top, top)


def _message(what: str, modules: Sequence[str], extra: str) -> str:
    names = list(dict.fromkeys(_distribution(m) for m in modules))
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    which = "which is" if len(names) == 1 else "which are"
    return f"{what} needs {listed}, {which} not installed: {install_hint(extra)}"


def available(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (its parent packages are imported).

    A ``sys.modules`` entry of ``None`` (how a test hides a package), for it or a parent package, counts as missing.
    """
    parts = module.split(".")
    for prefix in (".".join(parts[: i + 1]) for i in range(len(parts))):
        if prefix in sys.modules and sys.modules[prefix] is None:  # the module or a parent package hidden
            return False
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or hidden
        return False


def check(what: str, modules: Sequence[str], extra: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` unless every one of ``modules`` can be imported.

    Nothing is imported: for checking up front, before a long job that would need them at its end.

    Args:
        what: Who needs them, as the sentence starts: ``"bunsan bench"``, ``"bunsan.datasets.digits()"``.
        modules: Importable module names, e.g. ``("matplotlib", "sklearn")``.
        extra: The extra that installs them, e.g. ``"bench"``.
    """
    absent = [m for m in modules if not available(m)]
    if absent:
        raise MissingExtraError(_message(what, absent, extra), name=absent[0])


def find_spec(module: str, what: str, extra: str) -> ModuleSpec:
    """The import spec of ``module`` (found, not imported), or :class:`MissingExtraError` naming ``extra``."""
    check(what, [module], extra)
    spec = importlib.util.find_spec(module)
    if spec is None:  # pragma: no cover - check() has just found it
        raise MissingExtraError(_message(what, [module], extra), name=module)
    return spec


def require(module: str, what: str, extra: str) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError`: ``<what> needs <package> ...: pip install 'bunsan[<extra>]'``.

    Only a missing ``module`` (or a missing parent package of it) becomes that sentence: an
    ImportError raised inside an installed package (a broken install) propagates as it is.

    Args:
        module: The module to import, e.g. ``"tqdm.auto"``.
        what: Who needs it, as the sentence starts.
        extra: The extra that installs it.

    Returns:
        The imported module.
    """
    if not available(module):
        raise MissingExtraError(_message(what, [module], extra), name=module)
    return importlib.import_module(module)


def check_command(subcommand: str | None) -> None:
    """Raise :class:`MissingExtraError` if ``bunsan <subcommand>`` needs an extra that is not installed."""
    needed = COMMANDS.get(subcommand or "")
    if needed is not None:
        modules, extra = needed
        check(f"bunsan {subcommand}", modules, extra)
