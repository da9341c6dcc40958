"""Algorithm settings and worker counts as every benchmark reads them from its command line.

``NAME[:KEY=VALUE,...]`` names a registered algorithm and its constructor options
(:func:`parse_algorithm_spec`); ``--sweep [NAME:]KEY=V1,V2,...`` expands settings
(:func:`apply_sweeps`); ``-np 1,2,4`` lists worker counts (:func:`parse_workers`).
The parsing is pure; :func:`check_setting` builds the algorithm (no process group
needed) so that a bad option is refused before any job starts.

This module imports no torch at the top: ``bunsan`` builds its
command-line parser from the benchmarks without importing torch.
"""

from __future__ import annotations

import inspect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AlgorithmSetting",
    "Sweep",
    "apply_sweeps",
    "check_setting",
    "format_value",
    "parse_algorithm_spec",
    "parse_sweep",
    "parse_value",
    "parse_workers",
    "per_worker_batch",
    "reference_workers",
]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT = re.compile(r"[+-]?\d+")


def parse_value(text: str) -> Any:
    """Read an option value: int, float, bool (``true``/``false``), ``None`` (``none``/``null``), else a string.

    Quotes around a string are dropped, so ``"'32'"`` stays the string ``'32'``.
    """
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    if _INT.fullmatch(stripped):
        return int(stripped)
    try:
        return float(stripped)
    except ValueError:
        pass
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    return stripped


def format_value(value: Any) -> str:
    """The inverse of :func:`parse_value` for the values it returns."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and parse_value(value) != value:
        return repr(value)  # a string that would read back as a number, a bool or None
    return str(value)


@dataclass(frozen=True)
class AlgorithmSetting:
    """An algorithm name and its constructor options, as written ``NAME[:KEY=VALUE,...]``."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The spec written back, options in their given order: ``block_momentum:block_size=1024``."""
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={format_value(v)}" for k, v in self.options.items())

    def __hash__(self) -> int:
        return hash(self.label)


def parse_algorithm_spec(text: str) -> AlgorithmSetting:
    """Parse ``NAME[:KEY=VALUE,...]`` (e.g. ``data_parallel:bits=1,warm_start=8000``).

    Only the syntax is checked here; whether the algorithm exists and takes
    these options is for :func:`check_setting`.

    Raises:
        ValueError: one sentence naming the spec and what is wrong with it.
    """
    name, colon, rest = text.strip().partition(":")
    name = name.strip()
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"algorithm spec {text!r} does not start with an algorithm name; "
            "write NAME or NAME:KEY=VALUE,..., e.g. block_momentum:block_size=1024"
        )
    options: dict[str, Any] = {}
    if colon and not rest.strip():
        raise ValueError(f"algorithm spec {text!r} has nothing after ':'; drop the ':' or add KEY=VALUE")
    for item in rest.split(",") if colon else []:
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or not _NAME.fullmatch(key) or not value.strip():
            raise ValueError(
                f"option {item.strip()!r} of algorithm spec {text!r} is not KEY=VALUE; "
                "separate options with commas, e.g. data_parallel:bits=1,warm_start=8000"
            )
        if key in options:
            raise ValueError(f"algorithm spec {text!r} sets {key!r} twice")
        options[key] = parse_value(value)
    return AlgorithmSetting(name, options)


@dataclass(frozen=True)
class Sweep:
    """``--sweep [NAME:]KEY=V1,V2,...``: one setting per value; ``target`` limits it to one algorithm name."""

    key: str
    values: tuple[Any, ...]
    target: str | None = None


def parse_sweep(text: str) -> Sweep:
    """Parse ``[NAME:]KEY=V1,V2,...`` (e.g. ``warm_start=0,2000,8000``).

    Raises:
        ValueError: one sentence naming the sweep and what is wrong with it.
    """
    head, equals, values = text.partition("=")
    prefix, colon, key = head.rpartition(":")
    key, target = key.strip(), prefix.strip() if colon else None
    if not equals or not _NAME.fullmatch(key) or (target is not None and not _NAME.fullmatch(target)):
        raise ValueError(f"--sweep {text!r} is not [ALGORITHM:]KEY=V1,V2,...; e.g. --sweep warm_start=0,2000,8000")
    items = [v.strip() for v in values.split(",")]
    if not all(items):
        raise ValueError(f"--sweep {text!r} has an empty value; separate the values with single commas")
    parsed = tuple(parse_value(v) for v in items)
    if len(set(map(format_value, parsed))) != len(parsed):
        raise ValueError(f"--sweep {text!r} lists a value twice")
    return Sweep(key, parsed, target)


def apply_sweeps(settings: Sequence[AlgorithmSetting], sweeps: Sequence[Sweep]) -> list[AlgorithmSetting]:
    """Expand each setting by the sweeps that apply to it (all sweeps' values, crossed).

    A sweep without a target applies to every setting; with one, to the
    settings of that algorithm name. Settings that come out equal are kept once.

    Raises:
        ValueError: a targeted sweep matches no setting, or a setting already
            fixes the swept key.
    """
    for sweep in sweeps:
        if sweep.target is not None and not any(s.name == sweep.target for s in settings):
            raise ValueError(
                f"--sweep {sweep.target}:{sweep.key}=... names algorithm {sweep.target!r}, "
                f"which is not in --algorithms ({', '.join(s.label for s in settings)})"
            )
    expanded: list[AlgorithmSetting] = []
    for setting in settings:
        mine = [s for s in sweeps if s.target in (None, setting.name)]
        for sweep in mine:
            if sweep.key in setting.options:
                raise ValueError(
                    f"--sweep {sweep.key}=... and algorithm spec {setting.label!r} both set "
                    f"{sweep.key!r}; drop it from one of them"
                )
        if len({s.key for s in mine}) != len(mine):
            raise ValueError(f"two --sweep options vary {setting.name}'s same option; merge their values into one")
        for values in itertools.product(*(s.values for s in mine)):
            options = dict(setting.options)
            options.update({s.key: v for s, v in zip(mine, values)})
            candidate = AlgorithmSetting(setting.name, options)
            if candidate not in expanded:
                expanded.append(candidate)
    return expanded


def parse_workers(text: str) -> list[int]:
    """Parse ``-np 1,2,4`` into worker counts, in the given order, each once.

    Raises:
        ValueError: a count is not a whole number >= 1.
    """
    counts: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"-np {text!r}: {item!r} is not a worker count >= 1; write e.g. -np 1,2,4")
        if int(item) not in counts:
            counts.append(int(item))
    return counts


def per_worker_batch(batch: int, workers: int) -> int:
    """The minibatch of each of ``workers`` workers when the global minibatch is ``batch``.

    Raises:
        ValueError: ``batch`` does not divide evenly (or is smaller than ``workers``).
    """
    if batch < 1 or workers < 1:
        raise ValueError(f"need batch >= 1 and workers >= 1, got batch={batch}, workers={workers}")
    if batch % workers:
        raise ValueError(
            f"the global minibatch --batch {batch} does not split evenly over {workers} workers; "
            f"choose a multiple of {workers}"
        )
    return batch // workers


def reference_workers(workers: Sequence[int]) -> int:
    """The worker count that speed ratios are relative to: 1 if present, else the first given."""
    return 1 if 1 in workers else workers[0]


def check_setting(setting: AlgorithmSetting) -> dict[str, Any]:
    """Build the algorithm (no process group needed) and return what the table shows of it.

    Raises:
        ValueError: unknown algorithm or option, or an option out of range: one sentence.
    """
    from bunsan import algorithms

    if setting.name not in algorithms.names():
        raise ValueError(
            f"algorithm spec {setting.label!r}: unknown algorithm {setting.name!r}; "
            f"choose one of {', '.join(algorithms.names())}"
        )
    classes = [getattr(algorithms, n) for n in algorithms.__all__]
    cls = next((c for c in classes if inspect.isclass(c) and getattr(c, "name", None) == setting.name), None)
    if cls is not None:
        parameters = inspect.signature(cls).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        accepted = [n for n in parameters if n not in ("self", "group")]
        unknown = [k for k in setting.options if k not in accepted or k == "group"]
        if unknown and not takes_any:
            raise ValueError(
                f"algorithm spec {setting.label!r}: {setting.name} has no option {unknown[0]!r}; "
                f"its options are {', '.join(accepted)}"
            )
    try:
        algorithm = algorithms.create(setting.name, **setting.options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"algorithm spec {setting.label!r}: {err}") from None
    except RuntimeError as err:  # a constructor that wants a process group: a bug to report
        raise ValueError(
            f"algorithm spec {setting.label!r} cannot be checked before the jobs start, because "
            f"building {setting.name} outside a job failed: {err}"
        ) from None
    return {
        "algorithm": setting.name,
        "options": dict(setting.options),
        "algorithm_repr": repr(algorithm),
        "bits": getattr(algorithm, "bits", None),
        "compression": getattr(algorithm, "compression", None),
        "warm_start": getattr(algorithm, "warm_start", None),
        "block_size": getattr(algorithm, "block_size", None),
    }
