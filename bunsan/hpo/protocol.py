"""The pure parts of a distributed search: its messages, the verdict read from them, the argument checks.

:mod:`bunsan.hpo.search` describes the protocol; this module holds its data: what one rank
sends in one exchange (:class:`_Message`), how a trial ended (:class:`_Outcome`), and the
pure function :func:`_resolve` that every rank applies to the same gathered messages, so
that every rank reaches the same verdict without another exchange; and :func:`_check_args`,
which refuses bad arguments of :func:`bunsan.hpo.optimize` on every rank before any exchange.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from bunsan._validate import check_choice, check_int, check_number

__all__: list[str] = []  # private to bunsan.hpo: the public names are in bunsan.hpo.search

Values = float | list[float]
_COMBINE = ("rank0", "mean")


@dataclass(frozen=True)
class _Message:
    """What one rank sends in one exchange.

    ``kind`` is ``"trial" | "wait" | "stop" | "abort"`` in a header and
    ``"suggest" | "prune" | "end"`` inside a trial. For ``"end"``: ``status`` is
    ``"ok"`` (``value`` holds the objective's value), ``"pruned"`` or
    ``"failed"`` (``error`` holds the traceback; ``caught`` says whether its type
    is one of ``optimize``'s ``catch``).
    """

    kind: str
    name: str = ""
    value: Any = None
    status: str = ""
    error: str | None = None
    caught: bool = True

    def where(self) -> str:
        """Where in the objective the sender stood, for messages about diverged ranks."""
        if self.kind == "suggest":
            return f"suggest {self.name!r}"
        if self.kind == "prune":
            return "should_prune()"
        if self.kind == "end":
            return {"ok": "returned a value", "pruned": "pruned the trial"}.get(self.status, "raised")
        return self.kind


@dataclass(frozen=True)
class _Outcome:
    """How a trial ended, the same on every rank.

    ``state`` is ``"complete"`` (``values`` holds the combined value),
    ``"pruned"`` or ``"failed"`` (``message`` says why; ``caught`` is False
    when the search must stop; ``failed_ranks`` raised).
    """

    state: str
    values: Values | None = None
    message: str = ""
    caught: bool = True
    failed_ranks: tuple[int, ...] = ()


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _combine(values: Sequence[Values], combine: str | Callable[[list[Values]], Values]) -> Values:
    """The value told to the study from every rank's value. Pure.

    Raises:
        ValueError: values of different lengths cannot be averaged.
    """
    if callable(combine):
        return _as_values(combine(list(values)))
    if combine == "rank0":
        return values[0]
    lengths = {len(v) if isinstance(v, list) else None for v in values}
    if len(lengths) != 1:
        raise ValueError(f"cannot average values of different shapes across ranks: {list(values)}")
    if isinstance(values[0], list):
        return [math.fsum(column) / len(values) for column in zip(*values, strict=True)]
    return math.fsum(cast(Sequence[float], values)) / len(values)  # one shape, and not a list: floats


def _resolve(
    messages: Sequence[_Message], combine: str | Callable[[list[Values]], Values] = "rank0"
) -> _Outcome | None:
    """Read one exchange of a trial: ``None`` to go on, else how the trial ended. Pure.

    Every rank calls it with the same gathered ``messages`` (one per rank, in
    rank order), so every rank reaches the same verdict. The trial goes on when
    every rank sent the same ``"suggest"`` (same name) or ``"prune"``. It ends
    when any rank sent ``"end"``:

    * a rank raised: failed, with the first failed rank's traceback;
    * every rank returned a value: complete, with the values combined;
    * every rank pruned: pruned;
    * otherwise the ranks diverged (some returned or pruned while others still
      asked for parameters, or they asked for different ones): failed.
    """
    first = messages[0]
    if first.kind in ("suggest", "prune") and all(m.kind == first.kind and m.name == first.name for m in messages):
        return None
    failed = [r for r, m in enumerate(messages) if m.kind == "end" and m.status == "failed"]
    if failed:
        others = "".join(
            f"\n(rank {r} raised too: {(messages[r].error or '').strip().splitlines()[-1]})" for r in failed[1:]
        )
        return _Outcome(
            "failed",
            message=f"the objective raised on {_ranks(failed)}:\n{(messages[failed[0]].error or '').rstrip()}{others}",
            caught=all(messages[r].caught for r in failed),
            failed_ranks=tuple(failed),
        )
    statuses = {m.status if m.kind == "end" else m.kind for m in messages}
    if statuses == {"pruned"}:
        return _Outcome("pruned")
    if statuses == {"ok"}:
        try:
            return _Outcome("complete", values=_combine([m.value for m in messages], combine))
        except Exception as error:
            return _Outcome(
                "failed",
                message=f"could not combine the ranks' values {[m.value for m in messages]}: "
                f"{type(error).__name__}: {error}",
            )
    where = "; ".join(f"rank {r} {m.where()}" for r, m in enumerate(messages))
    return _Outcome(
        "failed",
        message=(
            f"the ranks diverged ({where}): every rank must call suggest_* and should_prune() in the same order "
            "and end the trial alike; prune with trial.should_prune(), which rank 0 decides for every rank"
        ),
    )


def _as_float(value: Any) -> float | None:
    """A number, a 0-d tensor or a 0-d array as a float; ``None`` for anything else. Pure."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return _as_float(value.item())
    return None


def _as_values(value: Any) -> Values:
    """The objective's value as a float, or a list of floats (several directions). Pure.

    Raises:
        TypeError: ``value`` is neither a number (0-d tensors and arrays
            included) nor a non-empty sequence of numbers.
    """
    single = _as_float(value)
    if single is not None:
        return single
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and value:
        several = [number for number in map(_as_float, value) if number is not None]
        if len(several) == len(value):
            return several
    raise TypeError(
        f"the objective returned {value!r} ({type(value).__name__}); return a float, "
        "or a sequence of floats for a study with several directions"
    )


def _check_args(
    n_trials: Any,
    timeout: Any,
    catch: Any,
    combine: Any,
    study: Any,
    storage: Any,
    study_name: Any,
    direction: Any,
    directions: Any,
    sampler: Any,
    pruner: Any,
) -> tuple[type[BaseException], ...]:
    """Validate :func:`optimize`'s arguments on every rank alike, before any exchange. Pure."""
    check_int("n_trials", n_trials, minimum=1, allow_none=True, hint="None runs until timeout or study.stop()")
    check_number("timeout", timeout, minimum=0, min_inclusive=False, allow_none=True, hint="seconds")
    catches = tuple(catch) if isinstance(catch, (tuple, list)) else (catch,)
    if not all(isinstance(c, type) and issubclass(c, Exception) for c in catches):
        raise ValueError(f"catch must be an Exception class or a tuple of them, e.g. (ValueError,), got {catch!r}")
    if not callable(combine):
        check_choice("combine", combine, _COMBINE, hint="or a function of the ranks' values")
    if direction is not None and directions is not None:
        raise ValueError("give direction or directions, not both")
    for d in [direction] if directions is None else list(directions):
        if d is not None and str(getattr(d, "name", d)).lower() not in ("minimize", "maximize"):
            raise ValueError(f"direction must be 'minimize' or 'maximize', got {d!r}")
    if study is not None:
        given = [
            n
            for n, v in (
                ("storage", storage),
                ("study_name", study_name),
                ("direction", direction),
                ("directions", directions),
                ("sampler", sampler),
                ("pruner", pruner),
            )
            if v is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} describe(s) a study for optimize() to create, but study= is given; "
                "pass either an existing study or the settings of a new one"
            )
    elif storage is not None and study_name is None:
        warnings.warn(
            "storage is given without study_name: Optuna names the study at random, so a later run cannot "
            "resume it; pass study_name=... too",
            stacklevel=3,
        )
    return catches
