"""TrainingSession on 2 gloo ranks: exact resume, cross-validation control, exact distributed test.

Bodies are module-level functions ``_body_x(rank, world_size, ...)`` run by the
warm pool. Sizes are odd on purpose (67 training, 23 validation, 31 test
samples), so that remainders, padding and masking are exercised.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bunsan import algorithms
from bunsan.algorithms.cost_model import Network
from bunsan.errors import CheckpointError
from bunsan.train import (
    Checkpoint,
    CrossValidation,
    Test,
    TrainingSession,
    classification_error,
    evaluate,
    schedule,
)

# Options for the algorithms that need some; block_size 24 is a multiple of the
# per-worker minibatches 8 and 12 of the schedule below.
_OPTIONS = {
    "block_momentum": {"block_size": 24},
    "model_averaging": {"block_size": 24},
    # The straight run and the interrupted one decide separately, from step times measured in
    # each: on a measured network the two can differ by timing noise alone (fp16 in one, exact in
    # the other, CI at f1ee51e). A given 10 kB/s network with no fixed-cost probes makes the
    # exchange outweigh every timing by orders of magnitude, so both decide alike (2-bit). At
    # 100 kB/s 2-bit led 8-bit by about 11 ms a step, and a loaded machine's codec timing (every
    # rank's, the slowest kept) once closed that gap (8e-4 apart, a fresh clone's CI at c602d1e).
    # Measuring takes all 10 steps (measure_budget_s=None): with the budget, the step at which
    # the slowest rank's timed steps reach 0.1 s depends on their times too, and steps of about
    # 10 ms here made one run decide at step 10, the other at 11.
    "auto": {
        "network": Network(latency_s=1e-3, bandwidth=1e4),
        "fixed_costs": False,
        "measure_budget_s": None,
        "verbose": False,
    },
}


def _algorithm_variants() -> list:
    """Every registered algorithm, plus quantized DataParallelSGD (residuals) where it exists."""
    found = set(algorithms.names())
    for module in ("block_momentum", "model_averaging"):
        try:  # included as soon as their modules exist, registered or not
            __import__(f"bunsan.algorithms.{module}")
            found.add(module)
        except ImportError:
            pass
    variants = [pytest.param(name, _OPTIONS.get(name, {}), id=name) for name in sorted(found)]
    try:
        algorithms.create("data_parallel", bits=8)
    except ValueError:
        return variants  # quantization not there yet
    variants.append(pytest.param("data_parallel", {"bits": 8, "warm_start": 32}, id="data_parallel-8bit"))
    variants.append(pytest.param("data_parallel", {"bits": 1, "warm_start": 32}, id="data_parallel-1bit"))
    return variants


def _net(hidden: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.2),  # dropout: RNG state matters
        nn.Linear(4 * 6 * 6, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 3),
    )


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class _HalveEachTime:
    """A CNTK-style control callback: halve the per-sample rate at every cross-validation."""

    def __init__(self) -> None:
        self.session: TrainingSession | None = None

    def __call__(self, index: int, error: float, samples: int, minibatches: int) -> bool:
        assert self.session is not None
        self.session.learning_rate_per_sample *= 0.5
        self.session.extra_state["calls"] = self.session.extra_state.get("calls", 0) + 1
        return True


def _session(
    directory: str, algorithm: str, hidden: int = 16, options: dict | None = None, **limits
) -> TrainingSession:
    torch.manual_seed(0)  # the same initial model in every session of a body
    model = _net(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr and momentum come from the schedules
    halve = _HalveEachTime()
    session = TrainingSession(
        model,
        F.cross_entropy,
        optimizer,
        algorithms.create(algorithm, **(options or _OPTIONS.get(algorithm, {}))),
        _data(67, seed=1),
        # The global minibatch grows from 16 to 24 after 40 samples: inside epoch 1.
        minibatch_size=schedule([16, 24], epoch_size=40),
        metrics={"error": classification_error},
        learning_rate_per_sample=schedule([0.02, 0.01], epoch_size=100),
        momentum_time_constant=schedule([0, 64], epoch_size=60),
        checkpoint=Checkpoint(Path(directory) / "run.pt", every=40, keep=2),  # also mid-epoch
        cross_validation=CrossValidation(_data(23, seed=2), every=50, callback=halve, minibatch_size=8),
        progress=False,
        **limits,
    )
    halve.session = session
    return session


def _body_exact_resume(rank, world_size, tmp, algorithm, options, stop):
    straight = _session(f"{tmp}/straight", algorithm, options=options, max_epochs=4)
    expected = straight.train()
    first = _session(f"{tmp}/resumed", algorithm, options=options, **stop)
    first.train()
    # Fresh objects, restored from the checkpoint the first session left.
    second = _session(f"{tmp}/resumed", algorithm, options=options, max_epochs=4)
    resumed = second.train()
    assert resumed.restored_from is not None and second.restored_from.endswith(f"run.{first.samples:012d}.pt")
    diff = (_flat(straight.model) - _flat(second.model)).abs().max().item()
    decisions = [getattr(s.algorithm, "decision", None) for s in (straight, first, second)]
    return {
        "diff": diff,
        "decisions": [d and (d["label"], d["step"]) for d in decisions],
        "params": _flat(second.model).tolist(),
        "epoch_losses": ([e.loss for e in expected.epochs], [e.loss for e in resumed.epochs]),
        "lr": (straight.learning_rate_per_sample, second.learning_rate_per_sample),
        "calls": (straight.extra_state, second.extra_state),
        "samples": (expected.samples, resumed.samples, expected.steps, resumed.steps),
    }


@pytest.mark.parametrize(("algorithm", "options"), _algorithm_variants())
@pytest.mark.parametrize(
    "stop",
    [{"max_epochs": 2}, {"max_samples": 90}],  # an epoch boundary; a step boundary inside epoch 2
    ids=["after-epoch-2", "inside-epoch-2"],
)
def test_resumed_run_equals_uninterrupted_run(workers, tmp_path, algorithm, options, stop):
    results = workers.run(
        f"{__name__}:_body_exact_resume", tmp=str(tmp_path), algorithm=algorithm, options=options, stop=stop
    )
    for result in results:
        if algorithm == "auto":  # decided alike in both runs (here after the restart: 10 measured steps)
            straight, first, second = result["decisions"]
            assert straight is not None and straight == second and first in (None, straight), result["decisions"]
        if algorithm != "async":
            # AsyncSGD applies updates in arrival order, which the OS scheduler decides: two
            # runs (resumed or not) of 2 asynchronous workers need not take the same path.
            # Its resume is checked by the counts and the callback state below, and by
            # tests/dist/test_async_sgd.py::test_state_round_trip.
            assert result["diff"] <= 1e-7
            straight_losses, resumed_losses = result["epoch_losses"]
            assert straight_losses == resumed_losses  # the epoch sums survive a mid-epoch restore
        assert result["lr"][0] == result["lr"][1]  # the callback's halvings were checkpointed
        assert result["calls"][0] == result["calls"][1] == {"calls": 5}
        assert result["samples"][0] == result["samples"][1] == 4 * 66
        assert result["samples"][2] == result["samples"][3]
    assert results[0]["params"] == results[1]["params"]  # after train()'s final synchronize


class _StopOnSecond:
    def __init__(self, rank: int, rank_dependent: bool) -> None:
        self.rank, self.rank_dependent = rank, rank_dependent
        self.session: TrainingSession | None = None
        self.calls: list[tuple[int, float, int, int]] = []

    def __call__(self, index, error, samples, minibatches):
        assert self.session is not None
        self.calls.append((index, error, samples, minibatches))
        if self.rank_dependent and self.rank != 0:
            self.session.learning_rate_per_sample *= 0.1  # what rank 0 does must win
            return True
        self.session.learning_rate_per_sample *= 0.5
        return index < 1  # stop after the second evaluation


def _body_cross_validation(rank, world_size, rank_dependent):
    torch.manual_seed(0)
    model = _net()
    callback = _StopOnSecond(rank, rank_dependent)
    session = TrainingSession(
        model,
        F.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.0),
        "data_parallel",
        _data(67, seed=1),
        minibatch_size=16,
        max_epochs=10,
        metrics={"error": classification_error},
        learning_rate_per_sample=0.01,
        cross_validation=CrossValidation(_data(23, seed=2), callback=callback, minibatch_size=8),
        progress=False,
    )
    callback.session = session
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = session.train()
    return {
        "stopped_by": summary.stopped_by,
        "samples": summary.samples,
        "epochs": len(summary.epochs),
        "lr_per_sample": session.learning_rate_per_sample,
        "optimizer_lr": [g["lr"] for g in session.optimizer.param_groups],
        "calls": callback.calls,
        "params": _flat(model).tolist(),
        "warned": any("decided differently" in str(w.message) for w in caught),
    }


@pytest.mark.parametrize("rank_dependent", [False, True], ids=["same-callback", "rank-dependent-callback"])
def test_cross_validation_callback_halves_rate_and_stops_on_every_rank(workers, rank_dependent):
    results = workers.run(f"{__name__}:_body_cross_validation", rank_dependent=rank_dependent)
    for result in results:
        assert result["stopped_by"] == "cross_validation"
        assert result["epochs"] == 2 and result["samples"] == 2 * 66  # evaluated after every epoch
        assert result["lr_per_sample"] == pytest.approx(0.01 * 0.25)  # halved twice, rank 0's settings
        # The optimizer's lr of the last step: 0.005 per sample times the last global minibatch (66 - 64 = 2).
        assert result["optimizer_lr"] == [pytest.approx(0.005 * 2)]
        assert [c[0] for c in result["calls"]] == [0, 1]
        assert all(c[2] == 23 for c in result["calls"])  # every validation sample once
    assert results[0]["calls"] == results[1]["calls"]  # identical reduced inputs on every rank
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["warned"] == rank_dependent and not results[1]["warned"]


def _body_test_metric(rank, world_size):
    torch.manual_seed(0)
    model = _net()
    x, y = _data(31, seed=3)
    session = TrainingSession(
        model,
        F.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.05),
        "data_parallel",
        _data(67, seed=1),
        minibatch_size=16,
        max_samples=48,
        metrics={"error": classification_error},
        test=Test((x, y), minibatch_size=8),
        progress=False,
    )
    summary = session.train()
    model.eval()
    with torch.no_grad():  # single-process reference on the same (synchronized) model
        output = model(x)
        expected = {
            "loss": F.cross_entropy(output, y).item(),
            "error": classification_error(output, y).sum().item() / len(y),
        }
    return summary.test.as_dict(), expected


def test_distributed_test_metric_equals_single_process_metric(workers):
    results = workers.run(f"{__name__}:_body_test_metric")
    for test, expected in results:
        assert test["samples"] == 31  # 2 x 16 positions, the one padding sample masked out
        assert test["minibatches"] == 4
        assert test["metrics"]["error"] == pytest.approx(expected["error"], abs=1e-12)
        assert test["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert results[0][0] == results[1][0]


def _body_evaluate_odd_sizes(rank, world_size, n, minibatch_size):
    torch.manual_seed(0)
    model = _net()
    x, y = _data(n, seed=4)
    result = evaluate(
        model, F.cross_entropy, {"error": classification_error}, torch.utils.data.TensorDataset(x, y), minibatch_size
    )
    with torch.no_grad():
        model.eval()
        output = model(x)
    return (
        result.samples,
        result.metrics["error"],
        classification_error(output, y).sum().item() / n,
        result.loss,
        F.cross_entropy(output, y).item(),
    )


@pytest.mark.parametrize(("n", "minibatch_size"), [(1, 4), (5, 2), (33, 1000)])
def test_evaluate_counts_every_sample_once(workers, n, minibatch_size):
    for samples, error, expected_error, loss, expected_loss in workers.run(
        f"{__name__}:_body_evaluate_odd_sizes", n=n, minibatch_size=minibatch_size
    ):
        assert samples == n
        assert error == pytest.approx(expected_error, abs=1e-12)
        assert loss == pytest.approx(expected_loss, rel=1e-6)


def _body_other_model(rank, world_size, tmp):
    _session(tmp, "data_parallel", max_epochs=1).train()
    try:
        _session(tmp, "data_parallel", hidden=8, max_epochs=2).train()
    except CheckpointError as error:
        return str(error)
    return None


def test_checkpoint_of_another_model_gives_one_clear_error(workers, tmp_path):
    messages = workers.run(f"{__name__}:_body_other_model", tmp=str(tmp_path))
    assert messages[0] is not None and messages[0] == messages[1]
    assert "another model" in messages[0] and "'4.weight'" in messages[0] and "[8, 144]" in messages[0]


def _body_minibatch_too_small(rank, world_size):
    model = _net()
    try:
        TrainingSession(
            model,
            F.cross_entropy,
            torch.optim.SGD(model.parameters(), lr=0.1),
            "data_parallel",
            _data(67, seed=1),
            minibatch_size=[4, 1],
            max_epochs=1,
            progress=False,
        )
    except ValueError as error:
        return str(error)
    return None


def test_global_minibatch_smaller_than_world_size_is_refused(workers):
    for message in workers.run(f"{__name__}:_body_minibatch_too_small"):
        assert message is not None and "minibatch_size=1 is smaller than the 2 workers" in message


def _body_other_world_size(rank, world_size, tmp):
    import torch.distributed as dist  # tests may; bunsan itself talks to torch.distributed only in bunsan.comm

    _session(tmp, "data_parallel", max_samples=48).train()  # 2 workers; the last checkpoint is inside epoch 1
    solo = dist.new_group([0])  # collective: every rank creates it
    if rank != 0:
        return None
    torch.manual_seed(0)
    model = _net()
    session = TrainingSession(
        model,
        F.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.0),
        algorithms.create("data_parallel", group=solo),
        _data(67, seed=1),
        minibatch_size=schedule([16, 24], epoch_size=40),
        max_epochs=1,
        metrics={"error": classification_error},
        learning_rate_per_sample=0.01,
        checkpoint=Checkpoint(Path(tmp) / "run.pt", every=40),
        progress=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = session.train()
    dist.destroy_process_group(solo)
    return [str(w.message) for w in caught], summary.epochs[0].samples, session.world_size


def test_restore_into_another_world_size_warns_and_goes_on(workers, tmp_path):
    messages, samples, world_size = workers.run(f"{__name__}:_body_other_world_size", tmp=str(tmp_path))[0]
    assert world_size == 1
    warned = [m for m in messages if "written by 2 worker(s) into 1" in m]
    assert warned and "starts afresh" in warned[0] and "data position" in warned[0]
    assert samples == 67  # 48 trained by 2 workers (their partial sums kept) + the 19 left for one worker


def _body_reporting(rank, world_size, tmp):
    import io

    from bunsan.train import ProgressPrinter

    stream = io.StringIO()
    torch.manual_seed(0)
    model = _net()
    TrainingSession(
        model,
        F.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.05),
        "data_parallel",
        _data(67, seed=1),
        minibatch_size=16,
        max_epochs=2,
        metrics={"error": classification_error},
        cross_validation=CrossValidation(_data(23, seed=2)),
        test=Test(_data(31, seed=3)),
        progress=False,
        callbacks=[ProgressPrinter(bar=False, stream=stream)],
        log_csv=f"{tmp}/log.csv",
    ).train()
    return stream.getvalue()


def test_progress_and_csv_come_from_rank_0_only(workers, tmp_path):
    text0, text1 = workers.run(f"{__name__}:_body_reporting", tmp=str(tmp_path))
    assert text1 == ""
    lines = text0.splitlines()
    assert lines[0].startswith("training on 2 worker(s)")
    assert sum(line.startswith("epoch ") for line in lines) == 2
    assert sum(line.startswith("cross-validation ") for line in lines) == 2
    assert any(line.startswith("test: loss") for line in lines)
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0] == (
        "epoch,samples,loss,error,cv_loss,cv_error,learning_rate_per_sample,minibatch_size,samples_per_s,seconds"
    )
    assert [row.split(",")[:2] for row in rows[1:]] == [["1", "66"], ["2", "132"]]
    assert all(row.split(",")[4] for row in rows[1:])  # a cross-validation every epoch


def test_tensorboard_without_the_package_names_the_extra(monkeypatch):
    import sys

    from bunsan.train import TensorBoardLogger

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ImportError, match=r"pip install 'bunsan\[tensorboard\]'"):
        TensorBoardLogger("runs/x")
