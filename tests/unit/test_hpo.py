"""bunsan.hpo in one process: the verdict of an exchange, search spaces, a lone-process search, plots.

A lone process has no process group: every exchange is the identity, so
``optimize`` runs Optuna's loop with the same code path as rank 0 of a job.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings

import numpy as np
import pytest
import torch

import bunsan
from bunsan import algorithms, hpo
from bunsan.hpo.protocol import _as_values, _combine, _Message, _resolve

try:
    import optuna
except ImportError:  # the tests of pure functions and of the missing extra still run
    optuna = None

needs_optuna = pytest.mark.skipif(optuna is None, reason="Optuna is not installed: pip install 'bunsan[hpo]'")


@pytest.fixture(autouse=True)
def _quiet_optuna():
    if optuna is None:
        yield
        return
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    yield
    optuna.logging.set_verbosity(verbosity)


def _end(status: str, value=None, error=None, caught=True) -> _Message:
    return _Message("end", status=status, value=value, error=error, caught=caught)


# -- the verdict of one exchange ---------------------------------------------------------------------


def test_matching_suggest_or_prune_messages_let_the_trial_go_on():
    assert _resolve([_Message("suggest", "lr", 0.1), _Message("suggest", "lr")]) is None
    assert _resolve([_Message("prune", value=True), _Message("prune")]) is None


def test_end_messages_of_every_rank_complete_prune_or_fail_the_trial():
    assert _resolve([_end("ok", 1.0), _end("ok", 3.0)]).values == 1.0  # rank 0's by default
    assert _resolve([_end("ok", 1.0), _end("ok", 3.0)], "mean").values == 2.0
    assert _resolve([_end("pruned"), _end("pruned")]).state == "pruned"
    mixed = _resolve([_end("pruned"), _end("ok", 1.0)])
    assert mixed.state == "failed" and "diverged" in mixed.message


def test_a_failed_rank_fails_the_trial_with_its_traceback_on_every_rank():
    outcome = _resolve([_end("ok", 1.0), _end("failed", error="Traceback ...\nValueError: bad lr\n", caught=True)])
    assert outcome.state == "failed" and outcome.caught and outcome.failed_ranks == (1,)
    assert "rank 1" in outcome.message and "ValueError: bad lr" in outcome.message
    both = _resolve([_end("failed", error="KeyError: a", caught=False), _end("failed", error="KeyError: b")])
    assert both.failed_ranks == (0, 1) and not both.caught  # one rank's exception is not in catch


def test_a_rank_that_left_early_closes_the_others_exchange():
    # Rank 1 raised before suggest_float("lr") that rank 0 is in: the same verdict on both.
    outcome = _resolve([_Message("suggest", "lr", 0.1), _end("failed", error="RuntimeError: oops")])
    assert outcome.state == "failed" and outcome.failed_ranks == (1,)
    # Rank 1 returned while rank 0 still asks for a parameter: no rank raised, they diverged.
    diverged = _resolve([_Message("suggest", "lr", 0.1), _end("ok", 0.5)])
    assert diverged.state == "failed" and diverged.failed_ranks == ()
    assert "rank 0 suggest 'lr'; rank 1 returned a value" in diverged.message
    other_name = _resolve([_Message("suggest", "lr", 0.1), _Message("suggest", "momentum")])
    assert other_name.state == "failed" and "same order" in other_name.message


def test_values_are_combined_element_wise_and_by_a_function():
    assert _combine([[1.0, 2.0], [3.0, 4.0]], "mean") == [2.0, 3.0]
    assert _combine([1.0, 5.0], max) == 5.0
    with pytest.raises(ValueError, match="different shapes"):
        _combine([[1.0], 2.0], "mean")
    outcome = _resolve([_end("ok", [1.0]), _end("ok", 2.0)], "mean")
    assert outcome.state == "failed" and "combine" in outcome.message


@pytest.mark.parametrize(
    ("value", "expected"),
    [(2, 2.0), (0.5, 0.5), (np.float32(1.5), 1.5), (torch.tensor(0.25), 0.25), ((1, 2.5), [1.0, 2.5])],
)
def test_objective_values_become_floats(value, expected):
    assert _as_values(value) == expected


@pytest.mark.parametrize("value", [None, "0.5", True, torch.ones(2), [], [[1.0]], [1.0, "2"]])
def test_objective_values_that_are_not_numbers_are_refused(value):
    with pytest.raises(TypeError, match="return a float"):
        _as_values(value)


# -- a search in one process --------------------------------------------------------------------------


@needs_optuna
def test_a_lone_process_searches_and_a_failing_trial_is_recorded():
    def objective(trial):
        x = trial.suggest_float("x", -2.0, 2.0)
        if trial.number == 1:
            raise ValueError("bad hyper-parameters")
        if trial.number == 2:
            return "not a number"
        return (x - 1.0) ** 2

    study = hpo.optimize(objective, 5, sampler=optuna.samplers.RandomSampler(seed=0))
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "FAIL", "COMPLETE", "COMPLETE"]
    assert study.trials[1].user_attrs["bunsan_failure"] == "ValueError: bad hyper-parameters"
    assert study.trials[1].user_attrs["bunsan_failed_ranks"] == [0]
    assert "return a float" in study.trials[2].user_attrs["bunsan_failure"]
    # In memory, the returned study goes on when passed back.
    study = hpo.optimize(objective, 1, study=study)
    assert len(study.trials) == 6


@needs_optuna
def test_an_exception_not_in_catch_ends_the_search_as_it_is():
    def objective(trial):
        trial.suggest_float("x", 0.0, 1.0)
        raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        hpo.optimize(objective, 3, catch=(ValueError,))


@needs_optuna
def test_pruning_in_a_lone_process():
    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        trial.report(x, 0)
        if trial.should_prune():
            raise optuna.TrialPruned()
        return x

    study = hpo.optimize(
        objective, 4, sampler=optuna.samplers.RandomSampler(seed=1), pruner=optuna.pruners.ThresholdPruner(upper=0.35)
    )
    assert [t.state.name for t in study.trials] == ["PRUNED", "PRUNED", "COMPLETE", "COMPLETE"]  # x .42 .72 .00 .30


@needs_optuna
def test_a_trial_exposes_its_number_params_and_the_optuna_trial():
    seen = {}

    def objective(trial):
        trial.suggest_int("n", 1, 4)
        trial.set_user_attr("note", "hi")
        seen.update(
            number=trial.number,
            params=dict(trial.params),
            rank=trial.rank,
            world_size=trial.world_size,
            real=trial.optuna_trial is not None,
            study=trial.study is not None,
        )
        return 0.0

    study = hpo.optimize(objective, 1)
    assert seen == {
        "number": 0,
        "params": study.trials[0].params,
        "rank": 0,
        "world_size": 1,
        "real": True,
        "study": True,
    }
    assert study.trials[0].user_attrs == {"note": "hi"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_trials": 0}, "n_trials must be an int >= 1"),
        ({"timeout": -1}, r"timeout must be a number > 0 or None \(seconds\)"),
        ({"combine": "median"}, "combine must be one of .rank0., .mean."),
        ({"catch": "ValueError"}, "catch must be an Exception class"),
        ({"direction": "up"}, "direction must be 'minimize' or 'maximize'"),
        ({"direction": "minimize", "directions": ["minimize"]}, "not both"),
        ({"study": "a study", "storage": "sqlite:///x.db"}, "storage describe"),
    ],
)
def test_bad_arguments_are_refused_before_any_exchange(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hpo.optimize(lambda trial: 0.0, **{"n_trials": 1, **kwargs})


@needs_optuna
def test_storage_without_a_study_name_warns():
    with pytest.warns(UserWarning, match="study_name"):
        hpo.optimize(lambda trial: 0.0, 1, storage=optuna.storages.InMemoryStorage())


# -- search spaces -------------------------------------------------------------------------------------


@needs_optuna
def test_suggest_algorithm_gives_valid_combinations_only():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        choice = hpo.suggest_algorithm(
            trial,
            bits=(1, 8, 32),
            warm_start=(0, 1000),
            block_size=(16, 256),
            block_momentum=(0.0, 0.9),
            compression=(None, "fp16"),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. warm_start with bits=32 would warn
            algorithm = choice.create()
        assert algorithm.name == choice.name
        options = choice.options
        if choice.name == "data_parallel":
            assert ("warm_start" in options) == (options["bits"] != 32)
            assert "compression" not in options or options["bits"] == 32
            assert "block_size" not in options
        else:
            assert 16 <= options["block_size"] <= 256 and 0 <= options["warm_start"] <= 1000
            assert ("block_momentum" in options) == (choice.name == "block_momentum")
        assert set(trial.params) == {"algorithm", *options}
        study.tell(trial, 0.0)
        seen.add(choice.name)
    assert seen == set(hpo.ALGORITHMS)


@needs_optuna
def test_a_knob_with_one_value_is_fixed_not_searched():
    trial = optuna.trial.FixedTrial({"bits": 8})
    choice = hpo.suggest_algorithm(trial, ("data_parallel",), bits=(8, 32), warm_start=640)
    assert choice == ("data_parallel", {"bits": 8, "warm_start": 640})
    assert str(choice) == "data_parallel(bits=8, warm_start=640)"
    assert hpo.suggest_learning_rate_per_sample(trial, 1e-3, 1e-3) == 1e-3
    assert hpo.suggest_minibatch_size(trial, (64,)) == 64


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"choices": ("nope",)}, ValueError, "unknown algorithm 'nope'"),
        ({"choices": "data_parallel"}, TypeError, "choices must be a non-empty sequence"),
        ({"choices": ()}, ValueError, "choices must be a non-empty sequence"),
        ({"bits": (0, 32)}, ValueError, "bits must hold 32"),
        ({"bits": (8.0,)}, TypeError, "bits must hold 32"),
        ({"warm_start": (10, 5)}, ValueError, "warm_start must be an int >= 0"),
        ({"warm_start": "10"}, TypeError, "warm_start must be an int >= 0"),
        ({"block_size": 0}, ValueError, "block_size must be an int >= 1"),
        ({"block_momentum": (0.5, 1.0)}, ValueError, "block_momentum must be"),
        ({"block_momentum": "0.5"}, TypeError, "block_momentum must be"),
        ({"compression": ("int8",)}, ValueError, "compression must hold None"),
    ],
)
def test_suggest_algorithm_refuses_bad_choices(kwargs, error, match):
    # bunsan._validate's rule: the wrong type is a TypeError, a bad value of the right type a ValueError.
    with pytest.raises(error, match=match):
        hpo.suggest_algorithm(_Fixed(), **kwargs)


@needs_optuna
def test_rate_and_minibatch_suggestions():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    lr = hpo.suggest_learning_rate_per_sample(trial, 1e-5, 1e-2)
    assert 1e-5 <= lr <= 1e-2 and trial.distributions["learning_rate_per_sample"].log
    assert hpo.suggest_minibatch_size(trial, (32, 64)) in (32, 64)
    with pytest.raises(ValueError, match=r"low must be a number > 0 \(a learning rate per sample"):
        hpo.suggest_learning_rate_per_sample(trial, 0.0, 1.0)
    with pytest.raises(ValueError, match="low must be <= high"):
        hpo.suggest_learning_rate_per_sample(trial, 1e-2, 1e-3)
    with pytest.raises(
        ValueError, match=r"choices must be an int >= 4 \(global minibatch sizes >= the 4 worker\(s\).*got 2"
    ):
        hpo.suggest_minibatch_size(trial, (2, 64), world_size=4)


def test_algorithm_choices_are_registered_algorithms():
    assert set(hpo.ALGORITHMS) <= set(algorithms.names())


# -- plots ---------------------------------------------------------------------------------------------


@needs_optuna
def test_save_plots_writes_pngs_with_either_renderer(tmp_path, monkeypatch):
    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        kind = trial.suggest_categorical("kind", ["a", "b"])
        for step in range(2):
            trial.report(x + step, step)
        return x + (kind == "b")

    study = hpo.optimize(objective, 4, sampler=optuna.samplers.RandomSampler(seed=0))
    # fANOVA imports scikit-learn (1.5-3 s here): the importances come from a stand-in.
    monkeypatch.setattr(optuna.importance, "get_param_importances", lambda study, **kw: {"x": 0.8, "kind": 0.2})
    quick = ["optimization_history"]  # Optuna's own drawing: one is enough to show the path works
    for renderer, plots in (("optuna", quick), ("matplotlib", hpo.PLOTS)):
        written = hpo.save_plots(study, tmp_path / renderer, plots=plots, renderer=renderer)
        assert list(written) == list(plots)
        for path in written.values():
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="renderer must be one of"):
        hpo.save_plots(study, tmp_path, renderer="svg")
    with pytest.raises(ValueError, match="plots must be a sequence of names"):
        hpo.save_plots(study, tmp_path, plots=["contour"])
    assert hpo.save_plots(optuna.create_study(), tmp_path / "empty") == {}


# -- optuna missing ---------------------------------------------------------------------------------------


def test_without_optuna_the_package_imports_and_a_search_names_the_extra(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "optuna", None)  # `import optuna` now raises ImportError
        for name in [m for m in sys.modules if m == "bunsan.hpo" or m.startswith("bunsan.hpo.")]:
            patch.delitem(sys.modules, name)
        patch.setattr(bunsan, "hpo", hpo, raising=False)  # the import below rebinds it
        fresh = importlib.import_module("bunsan.hpo")
        assert fresh is not hpo and bunsan.hpo is fresh
        with pytest.raises(ImportError, match=r"pip install 'bunsan\[hpo\]'"):
            fresh.optimize(lambda trial: 0.0, 1)
        # The search spaces need no Optuna: they only call the trial.
        assert fresh.suggest_minibatch_size(_Fixed(), (32,)) == 32
        assert math.isclose(fresh.suggest_learning_rate_per_sample(_Fixed(), 0.1, 0.1), 0.1)
    assert sys.modules["bunsan.hpo"] is hpo and bunsan.hpo is hpo  # the other tests see the real one


class _Fixed:
    def suggest_categorical(self, name, choices):
        return choices[0]


@needs_optuna
def test_blocks_are_searched_in_whole_minibatches_when_the_minibatch_is_given():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        choice = hpo.suggest_algorithm(
            trial, ("block_momentum", "model_averaging"), block_size=(64, 1024), minibatch_size=96, world_size=2
        )
        assert choice.options["block_size"] % 48 == 0 and 96 <= choice.options["block_size"] <= 1008
        assert choice.options["block_size"] == 48 * trial.params["block_minibatches"]
        study.tell(trial, 0.0)
    one = hpo.suggest_algorithm(
        optuna.trial.FixedTrial({"algorithm": "model_averaging"}),
        block_size=(8, 16),
        warm_start=0,
        minibatch_size=256,
        world_size=2,
    )
    assert one.options["block_size"] == 128  # at least one minibatch
    with pytest.raises(ValueError, match=r"minibatch_size must be an int >= 2 \(a global minibatch >= the 2 worker"):
        hpo.suggest_algorithm(_Fixed(), minibatch_size=1, world_size=2)


@needs_optuna
def test_a_study_with_several_directions_gets_a_list_of_values():
    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        return torch.tensor(x), 1.0 - x

    study = hpo.optimize(objective, 2, directions=["minimize", "maximize"])
    for trial in study.trials:
        assert trial.values == pytest.approx([trial.params["x"], 1.0 - trial.params["x"]])
