"""Distributed trials: rank 0 drives an Optuna study, every trial trains on all ranks.

Every rank calls :func:`optimize` with the same objective. Rank 0 runs the
study's own loop (``study.optimize``: samplers, pruners, ``n_trials``,
``timeout``, callbacks and storages are Optuna's); for each trial every rank
runs the objective with a :class:`DistributedTrial`, so the objective may train
with bunsan's collectives as any training script does.

The protocol. Every message of a search is one :func:`bunsan.comm.all_gather_object`
of a small :class:`_Message`, and the ranks exchange them at the same points:

1. *Header* (one per trial, and one at the end): rank 0 sends the trial's
   number, or "stop" with the finished trials, or "abort" with the reason;
   the other ranks send "wait".
2. *Suggest* (one per ``suggest_*`` call): rank 0 asks its Optuna trial and
   sends the value; the others send the parameter's name only.
3. *Prune* (one per :meth:`DistributedTrial.should_prune`): rank 0 asks the
   pruner and sends its decision.
4. *End* (one per trial): every rank sends its outcome (a value, pruned, or a
   traceback).

Because every exchange is the same collective, a rank that left the objective
early (it raised) meets the others' next suggest or prune exchange with its end
message instead of hanging: each rank sees the same gathered list and reaches
the same verdict with the pure function :func:`_resolve` (the trial failed, and
why), the ranks still inside the objective get a ``_TrialClosed`` from that
call, and all ranks go on to the next trial together.

What is supported, and what is not: an exception raised on every rank alike
(bad hyper-parameters, a loss that every rank sees diverge after an
all-reduce), and an exception raised on some ranks only where the other ranks'
next collective is one of this module's (a ``suggest_*``, ``should_prune`` or
the end of the objective). An exception on one rank in the middle of training
leaves the other ranks waiting in a *training* collective that the failed rank
never joins: the process group cannot recover from that, and the job ends with
a :class:`~bunsan.errors.CommunicationError` after the process group's timeout.
Checking a rank-local condition on an all-reduced value makes every rank raise
alike.
"""

from __future__ import annotations

import math
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bunsan import _extras, comm
from bunsan.errors import CommunicationError, WorkerFailedError
from bunsan.hpo.protocol import Values, _as_values, _check_args, _Message, _Outcome, _resolve
from bunsan.hpo.trial import DistributedTrial, _CaughtFailure, _TrialClosed

if TYPE_CHECKING:  # optuna is an optional extra: imported when a search starts
    import optuna
    from torch.distributed import ProcessGroup

__all__ = ["INSTALL_HINT", "DistributedTrial", "optimize"]

INSTALL_HINT = "pip install 'bunsan[hpo]'"


def _import_optuna() -> Any:
    """Optuna, or a :class:`~bunsan._extras.MissingExtraError` (an ImportError) that names the extra to install."""
    return _extras.require("optuna", "bunsan.hpo (on every worker)", "hpo")


# -- the search loop -----------------------------------------------------------------------------


class _Search:
    """One :func:`optimize` call on one rank: the exchanges and the per-trial runner."""

    def __init__(
        self,
        objective: Callable[[DistributedTrial], Any],
        catch: tuple[type[BaseException], ...],
        combine: str | Callable[[list[Values]], Values],
        group: ProcessGroup | None,
    ) -> None:
        self.objective = objective
        self.catch = catch
        self.combine = combine
        self.group = group
        self.rank = comm.get_rank(group)
        self.world_size = comm.get_world_size(group)
        self.phase = "idle"  # "trial" between a header and the end of its trial; "left" when all ranks stopped
        self.warned_values = False
        self.last_outcome: _Outcome | None = None

    def exchange(self, message: _Message) -> list[_Message]:
        """Collective: every rank's message, in rank order."""
        return comm.all_gather_object(message, group=self.group)

    def run_trial(self, number: int, optuna_trial: optuna.Trial | None) -> _Outcome:
        """Run the objective on this rank and agree on the outcome with the others. Collective.

        Returns:
            The outcome, the same on every rank (for a failure that lets the
            search go on too).

        Raises:
            WorkerFailedError: the trial failed with an exception that is not
                in ``catch`` on another rank (this rank's own such exception
                is re-raised as it is): the search stops on every rank.
        """
        optuna = _import_optuna()
        trial = DistributedTrial(self, number, optuna_trial)
        local_error: BaseException | None = None
        message: _Message | None = None
        try:
            result = self.objective(trial)
        except _TrialClosed:
            pass  # an exchange ended the trial: trial._outcome says how
        except CommunicationError:
            raise  # the process group is broken: no exchange can follow
        except optuna.TrialPruned:
            message = _Message("end", status="pruned")
        except Exception as error:
            local_error = error
            message = _Message(
                "end", status="failed", error=traceback.format_exc(), caught=isinstance(error, self.catch)
            )
        else:
            try:
                message = _Message("end", status="ok", value=_as_values(result))
            except TypeError:  # a bad return value fails the trial, as in Optuna, and the search goes on
                message = _Message("end", status="failed", error=traceback.format_exc(limit=0), caught=True)
        # An objective that swallowed _TrialClosed and returned: the trial already ended.
        outcome = trial._outcome
        if outcome is None:
            assert message is not None, "the trial closed without an outcome"
            messages = self.exchange(message)
            outcome = _resolve(messages, self.combine)
            assert outcome is not None, "an exchange of end messages always ends the trial"
            if outcome.state == "complete" and self.combine == "rank0":
                self._warn_if_values_differ([m.value for m in messages])
        self.phase = "idle"  # every rank agreed on the outcome: back between trials
        self.last_outcome = outcome
        if outcome.state != "failed" or outcome.caught:
            return outcome
        self.phase = "left"  # every rank stops here, without another header
        if local_error is not None:
            raise local_error
        raise WorkerFailedError(f"trial {number} ended the search: {outcome.message}")

    def _warn_if_values_differ(self, values: list[Values]) -> None:
        if self.warned_values or self.rank != 0 or all(_close(v, values[0]) for v in values):
            return
        self.warned_values = True
        warnings.warn(
            f"the objective returned different values on the ranks ({values}); rank 0's is told to the study. "
            "Return an all-reduced value, or pass combine='mean' to optimize()",
            stacklevel=4,
        )

    def follow(self) -> tuple[str, list[Any], list[optuna.trial.FrozenTrial]]:
        """Ranks other than 0: run the trials rank 0 announces until it says stop. Collective.

        Returns:
            The study's name, directions and trials, as rank 0 sent them at the end.
        """
        while True:
            header = self.exchange(_Message("wait"))[0]
            if header.kind == "stop":
                return header.value
            if header.kind == "abort":
                raise WorkerFailedError(f"rank 0 stopped the search: {header.error}")
            assert header.kind == "trial", f"unexpected header {header.kind!r} from rank 0"
            self.run_trial(int(header.value), None)

    def lead(self, study: optuna.Study, run: Callable[[Callable[[optuna.Trial], Any]], None]) -> None:
        """Rank 0: run Optuna's loop, each trial on every rank; then tell the others to stop. Collective.

        ``run(func)`` calls ``study.optimize(func, ...)``.
        """
        optuna_module = _import_optuna()

        def func(optuna_trial: optuna.Trial) -> Values | None:
            self.phase = "trial"  # run_trial sets "idle" (or "left") once the ranks agree on the outcome
            self.exchange(_Message("trial", value=optuna_trial.number))
            try:
                outcome = self.run_trial(optuna_trial.number, optuna_trial)
            except BaseException:
                if self.phase == "left" and self.last_outcome is not None:  # not in catch: the search stops
                    _record_failure(optuna_trial, self.last_outcome.message, self.last_outcome.failed_ranks)
                raise
            if outcome.state == "complete":
                return outcome.values
            if outcome.state == "pruned":
                raise optuna_module.TrialPruned()
            _record_failure(optuna_trial, outcome.message, outcome.failed_ranks)
            raise _CaughtFailure(f"trial {optuna_trial.number}: {outcome.message}")

        try:
            run(func)
        except BaseException as error:
            # Between trials (a sampler, the storage or a callback raised): the others wait
            # for a header, so tell them. Inside a trial the process group is broken (or
            # Ctrl-C): nothing more can be exchanged. "left": they stopped already.
            if self.phase == "idle":
                self.abort(f"{type(error).__name__}: {error}")
            self.phase = "left"
            raise
        self.phase = "left"
        # The finished trials ride on the last header: the other ranks return a copy of the study.
        trials = study.get_trials(deepcopy=False)
        self.exchange(_Message("stop", value=(study.study_name, list(study.directions), trials)))

    def abort(self, reason: str) -> None:
        """Rank 0: make the other ranks' :meth:`follow` raise. Collective."""
        self.exchange(_Message("abort", error=reason[:2000]))


def _record_failure(optuna_trial: optuna.Trial, message: str, failed_ranks: Sequence[int]) -> None:
    """Keep why a trial failed in the study, where a resumed run or a dashboard sees it."""
    lines = message.strip().splitlines() or ["unknown failure"]
    optuna_trial.set_user_attr("bunsan_failure", lines[-1][:500])
    optuna_trial.set_user_attr("bunsan_failed_ranks", list(failed_ranks))


def _close(a: Values, b: Values) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_close, a, b))
    return a == b or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _snapshot(optuna: Any, name: str, directions: list[Any], trials: list[Any]) -> optuna.Study:
    """An in-memory study holding ``trials``: what the ranks other than 0 return."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created" line from every rank
    try:
        study = optuna.create_study(study_name=name, directions=directions)
        study.add_trials(trials)
    finally:
        optuna.logging.set_verbosity(verbosity)
    return study


# -- the entry point -----------------------------------------------------------------------------


def optimize(
    objective: Callable[[DistributedTrial], Any],
    n_trials: int | None = None,
    *,
    study: optuna.Study | None = None,
    storage: str | optuna.storages.BaseStorage | None = None,
    study_name: str | None = None,
    direction: str | None = None,
    directions: Sequence[str] | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    timeout: float | None = None,
    catch: type[Exception] | tuple[type[Exception], ...] = (Exception,),
    callbacks: Sequence[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] = (),
    combine: str | Callable[[list[Values]], Values] = "rank0",
    group: ProcessGroup | None = None,
    gc_after_trial: bool = False,
) -> optuna.Study:
    """Search hyper-parameters with Optuna; every trial runs on every rank. Collective.

    Every rank calls it with the same objective. Rank 0 drives the study with
    ``study.optimize``; for each trial every rank runs ``objective(trial)``
    with a :class:`DistributedTrial` whose ``suggest_*`` return rank 0's
    values, so each trial trains distributed, as any bunsan script does. Only
    rank 0 opens the storage; the others need not reach it.

    Example::

        def objective(trial):
            lr = bunsan.hpo.suggest_learning_rate_per_sample(trial, 1e-4, 1e-2)
            ...                                   # train with bunsan on every rank
            for epoch in range(epochs):
                ...
                trial.report(validation_error, epoch)  # the same on every rank (all-reduced)
                if trial.should_prune():               # rank 0 decides for every rank
                    raise optuna.TrialPruned()
            return validation_error

        study = bunsan.hpo.optimize(objective, n_trials=20, storage="sqlite:///hpo.db", study_name="mnist1d")
        if bunsan.is_main():
            print(study.best_params)

    **The value.** Each rank's return value is gathered; with ``combine="rank0"``
    (the default) rank 0's is told to the study, and a warning says so once
    when the ranks' values differ. Return a value that is the same on every
    rank (an all-reduced loss or error) or pass ``combine="mean"`` to tell the
    mean of the ranks' values (element-wise for several directions), or a
    function of the list of values in rank order.

    **Failures.** An exception raised by the objective on any rank (or on
    every rank) marks the trial FAIL in the study with that rank's traceback,
    and every rank goes on to the next trial: this differs from
    ``optuna.Study.optimize``, whose ``catch`` is empty by default. With an
    exception type that is not in ``catch``, the trial is marked FAIL and the
    search stops on every rank: the raising rank re-raises its exception, the
    others raise :class:`~bunsan.errors.WorkerFailedError`. What a rank-local
    exception can and cannot be recovered from is in :mod:`bunsan.hpo.search`:
    in short, raise outside training collectives. A
    :class:`~bunsan.errors.CommunicationError` is never caught.

    **Pruning.** ``trial.should_prune()`` returns rank 0's pruner decision on
    every rank; raise ``optuna.TrialPruned`` on every rank when it is True. A
    trial pruned on some ranks and completed on others is marked FAIL.

    **Resuming.** With ``storage`` (an Optuna storage or URL such as
    ``"sqlite:///hpo.db"``) and ``study_name``, a later call loads the study
    and goes on counting trials. In memory (the default), pass the study that
    the first call returned as ``study=`` to go on.

    Args:
        objective: ``objective(trial) -> float`` (a sequence of floats for
            several ``directions``), run on every rank.
        n_trials: Trials to run in this call (FAIL and PRUNED ones count);
            ``None`` runs until ``timeout`` or a callback's ``study.stop()``.
        study: An Optuna study to drive, used on rank 0 only (other ranks may
            pass anything; it is not touched there).
        storage: Where rank 0 creates or loads the study: ``None`` for memory,
            an URL or an ``optuna.storages`` object.
        study_name: The study's name; with ``storage``, the study to resume.
        direction: ``"minimize"`` (Optuna's default) or ``"maximize"``.
        directions: One per value, for a multi-objective study.
        sampler: The study's sampler (Optuna's default: TPE), rank 0's is used.
        pruner: The study's pruner (Optuna's default: median), rank 0's is used.
        timeout: Seconds after which rank 0 starts no new trial.
        catch: Exception types of the objective that mark a trial failed and
            let the search go on.
        callbacks: ``callback(study, frozen_trial)`` after each trial, on rank 0
            (``study.stop()`` there ends the search on every rank).
        combine: ``"rank0"``, ``"mean"`` or ``fn(values) -> value``: the value
            told to the study from the ranks' values.
        group: Process group whose ranks run the trials; ``None`` means the world.
        gc_after_trial: Run ``gc.collect()`` after each trial on rank 0.

    Returns:
        On rank 0, the study that was driven. On the other ranks, an in-memory
        copy of it holding the same trials, made when the search ended
        (``study.best_params``, ``study.trials`` read the same on every rank;
        trials told to the copy do not reach the real study).

    Raises:
        ImportError: Optuna is not installed (``pip install 'bunsan[hpo]'``).
        ValueError: An argument is out of range (the message names it).
        WorkerFailedError: Another rank raised an exception that is not in
            ``catch``, or rank 0 could not create the study or continue it.
    """
    catches = _check_args(
        n_trials, timeout, catch, combine, study, storage, study_name, direction, directions, sampler, pruner
    )
    optuna = _import_optuna()
    search = _Search(objective, catches, combine, group)
    if search.rank != 0:
        name, study_directions, trials = search.follow()
        return _snapshot(optuna, name, study_directions, trials)

    if study is None:
        try:
            study = optuna.create_study(
                storage=storage,
                sampler=sampler,
                pruner=pruner,
                study_name=study_name,
                direction=direction,
                directions=directions,
                load_if_exists=True,
            )
        except Exception as error:
            search.abort(f"could not create or load the study: {type(error).__name__}: {error}")
            raise
    driven = study
    search.lead(
        driven,
        lambda func: driven.optimize(
            func,
            n_trials=n_trials,
            timeout=timeout,
            catch=(_CaughtFailure,),
            callbacks=list(callbacks),
            gc_after_trial=gc_after_trial,
        ),
    )
    return driven
