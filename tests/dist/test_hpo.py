"""bunsan.hpo on 2 gloo ranks: every trial on every rank, failures and pruning agreed by all ranks.

Bodies are module-level functions ``_body_x(rank, world_size, ...)`` run by the
warm pool. Each objective all-reduces something in every trial, so a search
that left the ranks out of step would fail (or hang) the next trial.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from bunsan import comm
from bunsan.errors import WorkerFailedError

import optuna  # noqa: E402 - in the `test` extra: a missing optuna must fail here, not skip the suite

from bunsan import hpo  # noqa: E402


def _quiet() -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # rank 0 would log every trial


def _trials(study: optuna.Study) -> list[tuple]:
    return [(t.number, t.state.name, t.params, t.value) for t in study.trials]


def _mean_over_ranks(x: float, world_size: int) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    comm.all_reduce(t)  # a training-like collective inside every trial
    return float(t.item()) / world_size


def _body_identical_params(rank: int, world_size: int, n_trials: int) -> dict:
    _quiet()
    seen = []

    def objective(trial):
        x = trial.suggest_float("x", -1.0, 1.0)
        n = trial.suggest_int("n", 1, 64, log=True)
        c = trial.suggest_categorical("c", ["a", "b", None])
        algorithm = hpo.suggest_algorithm(trial, bits=(1, 8, 32), warm_start=(0, 100), block_size=(8, 64))
        seen.append((trial.number, dict(trial.params), str(algorithm)))
        # Equal to x only when every rank got the same x.
        return _mean_over_ranks(x, world_size) + n * 0 + (c is None) * 0

    study = hpo.optimize(objective, n_trials, sampler=optuna.samplers.RandomSampler(seed=1))
    return {"seen": seen, "trials": _trials(study), "type": type(study).__name__}


def test_every_rank_gets_the_same_parameters_and_the_study_has_every_trial(workers):
    results = workers.run(f"{__name__}:_body_identical_params", n_trials=4)
    assert results[0]["seen"] == results[1]["seen"]
    assert [number for number, _, _ in results[0]["seen"]] == [0, 1, 2, 3]
    trials = results[0]["trials"]
    assert [(number, state) for number, state, _, _ in trials] == [(i, "COMPLETE") for i in range(4)]
    for (_, _, params, value), (_, seen_params, _) in zip(trials, results[0]["seen"], strict=True):
        assert params == seen_params
        assert value == pytest.approx(params["x"], rel=1e-12)
    # The other rank returns a copy of the study with the same trials.
    assert results[1]["type"] == "Study" and results[1]["trials"] == trials


def _fails(where: str, rank: int, trial_number: int, point: str) -> bool:
    if trial_number != 1:
        return False
    who, _, at = where.partition(":")
    return at == point and (who == "every" or who == f"rank{rank}")


def _body_failure(rank: int, world_size: int, where: str) -> dict:
    _quiet()
    seen = []

    def objective(trial):
        seen.append(trial.number)
        if _fails(where, rank, trial.number, "before_suggest"):
            raise ValueError(f"bad hyper-parameters on rank {rank}")
        name = "y" if _fails(where, rank, trial.number, "other_name") else "x"
        x = trial.suggest_float(name, 0.0, 1.0)
        value = _mean_over_ranks(x, world_size)
        if _fails(where, rank, trial.number, "after_collective"):
            raise ValueError(f"rank-local failure on rank {rank}")
        trial.report(value, 0)
        trial.should_prune()
        if _fails(where, rank, trial.number, "at_return"):
            raise ValueError(f"rank-local failure at return on rank {rank}")
        return value

    study = hpo.optimize(objective, 4, sampler=optuna.samplers.RandomSampler(seed=0))
    failed = study.trials[1]
    return {"seen": seen, "states": [t.state.name for t in study.trials], "attrs": failed.user_attrs}


@pytest.mark.parametrize(
    ("where", "failed_ranks"),
    [
        ("every:before_suggest", [0, 1]),
        ("rank1:before_suggest", [1]),  # rank 0 is then in suggest_float: it learns there
        ("rank0:before_suggest", [0]),
        ("rank1:after_collective", [1]),  # rank 0 is then in should_prune()
        ("rank1:at_return", [1]),  # rank 0 is then at the end of the trial
        ("rank1:other_name", []),  # the ranks diverged: no rank raised
    ],
)
def test_a_failed_trial_is_recorded_and_the_search_goes_on_on_every_rank(workers, where, failed_ranks):
    results = workers.run(f"{__name__}:_body_failure", where=where)
    for result in results:
        assert result["seen"] == [0, 1, 2, 3]
        assert result["states"] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    attrs = results[0]["attrs"]
    assert attrs["bunsan_failed_ranks"] == failed_ranks
    assert ("diverged" if not failed_ranks else "ValueError") in attrs["bunsan_failure"]


def _body_not_caught(rank: int, world_size: int) -> dict:
    _quiet()

    def objective(trial):
        value = _mean_over_ranks(trial.suggest_float("x", 0.0, 1.0), world_size)
        if trial.number == 1 and rank == 1:
            raise ValueError("not in catch")  # after the collective: rank 0 is at the end of the trial
        return value

    try:
        hpo.optimize(objective, 4, catch=(KeyError,))
    except (ValueError, WorkerFailedError) as error:
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None}


def test_an_exception_not_in_catch_stops_the_search_on_every_rank(workers):
    results = workers.run(f"{__name__}:_body_not_caught")
    assert results[1]["raised"] == "ValueError"  # the rank that raised: its own exception
    assert results[0]["raised"] == "WorkerFailedError" and "rank 1" in results[0]["message"]


def _body_pruning(rank: int, world_size: int) -> dict:
    _quiet()
    decisions = []

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        for step in range(2):
            # Rank 1 reports values that would never prune: rank 0's report decides.
            trial.report(x + step if rank == 0 else -1.0, step)
            prune = trial.should_prune()
            decisions.append((trial.number, step, prune))
            if prune:
                raise optuna.TrialPruned()
        return _mean_over_ranks(x, world_size)

    study = hpo.optimize(
        objective,
        4,
        sampler=optuna.samplers.RandomSampler(seed=1),  # x: .42 .72 .00 .30
        pruner=optuna.pruners.ThresholdPruner(upper=1.5),
    )
    return {"decisions": decisions, "trials": [(t.state.name, t.params["x"]) for t in study.trials]}


def test_pruning_is_decided_by_rank_0_for_every_rank(workers):
    results = workers.run(f"{__name__}:_body_pruning")
    assert results[0]["decisions"] == results[1]["decisions"]
    # ThresholdPruner prunes when rank 0's value exceeds 1.5: x + 1 at step 1, so when x > 0.5.
    states = [state for state, _ in results[0]["trials"]]
    assert states == ["PRUNED" if x > 0.5 else "COMPLETE" for _, x in results[0]["trials"]]
    assert {"PRUNED", "COMPLETE"} <= set(states)
    pruned = [number for number, step, prune in results[0]["decisions"] if prune]
    assert pruned == [n for n, state in enumerate(states) if state == "PRUNED"]


def _body_sqlite_resume(rank: int, world_size: int, url: str) -> list:
    _quiet()

    def objective(trial):
        return _mean_over_ranks(trial.suggest_float("x", 0.0, 1.0), world_size)

    counts = []
    for _ in range(2):  # a second run with the same storage and name continues the study
        study = hpo.optimize(objective, 2, storage=url, study_name="resume")
        counts.append([t.number for t in study.trials])
    return counts


def test_a_search_with_sqlite_storage_resumes(workers, tmp_path):
    results = workers.run(f"{__name__}:_body_sqlite_resume", url=f"sqlite:///{tmp_path / 'hpo.db'}")
    assert results[0] == results[1] == [[0, 1], [0, 1, 2, 3]]


def _body_combine(rank: int, world_size: int) -> dict:
    _quiet()

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        return x + rank  # a rank-local value, on purpose

    mean = hpo.optimize(objective, 2, combine="mean")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = hpo.optimize(objective, 2)
    return {
        "mean": [(t.value, t.params["x"]) for t in mean.trials],
        "rank0": [(t.value, t.params["x"]) for t in first.trials],
        "warnings": [str(w.message) for w in caught if "different values" in str(w.message)],
    }


def test_values_of_the_ranks_are_combined_as_asked(workers):
    results = workers.run(f"{__name__}:_body_combine")
    for value, x in results[0]["mean"]:
        assert value == pytest.approx(x + 0.5)
    for value, x in results[0]["rank0"]:
        assert value == pytest.approx(x)
    assert len(results[0]["warnings"]) == 1  # once per search, on rank 0
    assert results[1]["warnings"] == []


def _body_callbacks(rank: int, world_size: int) -> dict:
    _quiet()

    def objective(trial):
        return _mean_over_ranks(trial.suggest_float("x", 0.0, 1.0), world_size)

    def stop_after_two(study, trial):
        if trial.number == 1:
            study.stop()

    def fail_after_one(study, trial):
        raise RuntimeError("callback failed")

    stopped = hpo.optimize(objective, 10, callbacks=[stop_after_two])
    try:
        hpo.optimize(objective, 10, callbacks=[fail_after_one])
        raised = None
    except (RuntimeError, WorkerFailedError) as error:
        raised = type(error).__name__
    return {"stopped": len(stopped.trials), "raised": raised}


def test_callbacks_on_rank_0_stop_or_end_the_search_on_every_rank(workers):
    results = workers.run(f"{__name__}:_body_callbacks")
    assert [r["stopped"] for r in results] == [2, 2]
    assert [r["raised"] for r in results] == ["RuntimeError", "WorkerFailedError"]
