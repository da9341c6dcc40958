"""The trial an objective sees on every rank of a distributed search (see :mod:`bunsan.hpo.search`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from bunsan.hpo.protocol import Values, _Message, _Outcome, _resolve

if TYPE_CHECKING:  # optuna is an optional extra: imported when a search starts
    import optuna

__all__ = ["DistributedTrial"]


class _Exchanger(Protocol):
    """What a trial needs of its search (``bunsan.hpo.search._Search``): one exchange per call."""

    rank: int
    world_size: int
    combine: str | Callable[[list[Values]], Values]

    def exchange(self, message: _Message) -> list[_Message]: ...


class _TrialClosed(BaseException):
    """Raised inside the objective of a rank when an exchange ended the trial.

    A BaseException, so that an objective's ``except Exception`` does not
    swallow it and carry on into exchanges that are no longer answered.
    """


class _CaughtFailure(Exception):
    """Rank 0's report to Optuna of a failed trial that does not stop the search.

    ``str()`` is the whole story (the failed rank's traceback); ``repr()``, which
    Optuna puts in its one-line log of the failure, is its last line.
    """

    def __repr__(self) -> str:
        lines = str(self).strip().splitlines()
        return f"{lines[0]} {lines[-1]}" if len(lines) > 1 else (lines[0] if lines else "failed")


class DistributedTrial:
    """The trial an objective sees on every rank. ``suggest_*`` and :meth:`should_prune` are collective.

    On rank 0 each ``suggest_*`` asks the real Optuna trial; the value is sent
    to every rank, so every rank gets the same parameters provided that every
    rank calls the same ``suggest_*`` in the same order (as an objective that
    runs the same code on every rank does). :meth:`report` and
    :meth:`set_user_attr` are not collective: rank 0's calls reach the study,
    the others' are kept locally. :meth:`should_prune` asks rank 0's pruner and
    returns its decision on every rank, so every rank raises
    ``optuna.TrialPruned`` alike.

    Attributes:
        number: The trial's number in the study, the same on every rank.
        rank: This process's rank in the search's group.
        world_size: Ranks in the search's group.
        params: The parameters suggested so far (the same on every rank).
        intermediate_values: This rank's :meth:`report` calls, step -> value.
        user_attrs: This rank's :meth:`set_user_attr` calls.
    """

    def __init__(self, search: _Exchanger, number: int, optuna_trial: optuna.Trial | None) -> None:
        self._search = search
        self._optuna_trial = optuna_trial
        self.number = number
        self.rank = search.rank
        self.world_size = search.world_size
        self.params: dict[str, Any] = {}
        self.intermediate_values: dict[int, float] = {}
        self.user_attrs: dict[str, Any] = {}
        self._outcome: _Outcome | None = None  # set when an exchange ended the trial

    def __repr__(self) -> str:
        return f"DistributedTrial(number={self.number}, rank={self.rank}, params={self.params})"

    @property
    def optuna_trial(self) -> optuna.Trial | None:
        """The real Optuna trial on rank 0; ``None`` on the other ranks."""
        return self._optuna_trial

    @property
    def study(self) -> optuna.Study | None:
        """The study on rank 0; ``None`` on the other ranks."""
        return None if self._optuna_trial is None else self._optuna_trial.study

    def _exchange(self, message: _Message) -> Any:
        if self._outcome is not None:
            raise _TrialClosed(self._outcome.message)
        messages = self._search.exchange(message)
        outcome = _resolve(messages, self._search.combine)
        if outcome is not None:
            self._outcome = outcome
            raise _TrialClosed(outcome.message)
        return messages[0].value  # rank 0's

    def _suggest(self, name: str, ask: Callable[[optuna.Trial], Any]) -> Any:
        # Rank 0 asks Optuna before the exchange. If Optuna refuses (low > high, ...), rank 0
        # leaves with the error and the others learn it from the same exchange.
        value = ask(self._optuna_trial) if self._optuna_trial is not None else None
        value = self._exchange(_Message("suggest", name=name, value=value))
        self.params[name] = value
        return value

    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False
    ) -> float:
        """Rank 0's ``optuna.Trial.suggest_float``, on every rank. Collective."""
        return self._suggest(name, lambda t: t.suggest_float(name, low, high, step=step, log=log))

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        """Rank 0's ``optuna.Trial.suggest_int``, on every rank. Collective."""
        return self._suggest(name, lambda t: t.suggest_int(name, low, high, step=step, log=log))

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        """Rank 0's ``optuna.Trial.suggest_categorical``, on every rank. Collective."""
        return self._suggest(name, lambda t: t.suggest_categorical(name, choices))

    def report(self, value: float, step: int) -> None:
        """Report an intermediate value for pruning: rank 0's reaches the study. Not collective.

        Report a value that is the same on every rank (an all-reduced error,
        as :class:`bunsan.train.TrainingSession` computes), so that the
        pruner's decision means the same to every rank.
        """
        value = float(value)
        if self._optuna_trial is not None:
            self._optuna_trial.report(value, step)
        self.intermediate_values[int(step)] = value

    def should_prune(self) -> bool:
        """Rank 0's pruner decision, on every rank. Collective."""
        decision = bool(self._optuna_trial.should_prune()) if self._optuna_trial is not None else None
        return bool(self._exchange(_Message("prune", value=decision)))

    def set_user_attr(self, key: str, value: Any) -> None:
        """Attach ``value`` to the trial: rank 0's call reaches the study. Not collective."""
        if self._optuna_trial is not None:
            self._optuna_trial.set_user_attr(key, value)
        self.user_attrs[key] = value
