"""ModelAverager, BlockMomentumAverager and AveragingOptimizer in one process: argument checks, the
BMUF equations at one worker, state dicts. The multi-rank behaviour is tests/dist/test_averagers.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bunsan.algorithms import AveragingOptimizer, BlockMomentumAverager, ModelAverager
from bunsan.algorithms.averagers import _resolve_defaults
from bunsan.errors import CheckpointError


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"period": 0}, ValueError, "period"),
        ({"period": 2.0}, TypeError, "period"),
        ({"period": True}, TypeError, "period"),
        ({"period": 2, "warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"period": 2, "process_group": "world"}, TypeError, "process_group"),
    ],
)
def test_model_averager_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelAverager(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block_momentum": 1.0}, ValueError, "block_momentum"),
        ({"block_momentum": -0.1}, ValueError, "block_momentum"),
        ({"block_momentum": "0.9"}, TypeError, "block_momentum"),
        ({"block_learning_rate": 0.0}, ValueError, "block_learning_rate"),
        ({"nesterov": 1}, TypeError, "nesterov"),
        ({"period": 0}, ValueError, "period"),
    ],
)
def test_block_momentum_averager_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        BlockMomentumAverager(**{"period": 2, **kwargs})


def test_defaults_resolve_through_one_function():
    assert _resolve_defaults(4) == (0.75, 0.5)
    averager = BlockMomentumAverager(2)
    assert (averager.block_momentum, averager.block_learning_rate) == _resolve_defaults(1)  # no process group: N=1


def test_bad_params_and_wrapper_arguments():
    averager = ModelAverager(1)
    with pytest.raises(TypeError, match="params"):
        averager.average_parameters(torch.zeros(3))  # a tensor, not an iterable of them
    with pytest.raises(TypeError, match="element of type int"):
        averager.average_parameters([1, 2])
    with pytest.raises(ValueError, match="params is empty"):
        averager.average_parameters([])
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="averager"):
        AveragingOptimizer(optimizer, "averager")
    with pytest.raises(TypeError, match="optimizer"):
        AveragingOptimizer(object(), averager)
    with pytest.raises(TypeError, match="reset_local_momentum"):
        AveragingOptimizer(optimizer, averager, reset_local_momentum=1)


def test_params_must_stay_the_same():
    averager = ModelAverager(1)
    model = nn.Linear(2, 1)
    averager.average_parameters(model.parameters())
    with pytest.raises(ValueError, match="params changed"):
        averager.average_parameters(nn.Linear(2, 1).parameters())


def _train(optimizer: torch.optim.Optimizer, model: nn.Module, steps: int) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 2, generator=g)).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("nesterov", [True, False])
def test_one_worker_follows_the_bmuf_equations(nesterov):
    """N=1: G = w - W_start, D = bm D + zeta G, W = W + D, the next block from W + bm D or W."""
    torch.manual_seed(0)
    model, reference = nn.Linear(2, 1), nn.Linear(2, 1)
    reference.load_state_dict(model.state_dict())
    bm, blr, period = 0.6, 0.9, 2
    wrapped = AveragingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        BlockMomentumAverager(period, block_momentum=bm, block_learning_rate=blr, nesterov=nesterov),
    )
    _train(wrapped, model, 6)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    w = torch.nn.utils.parameters_to_vector(reference.parameters()).detach().clone()
    d, start, zeta = torch.zeros_like(w), w.clone(), (1 - bm) * 1 * blr
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        opt.zero_grad()
        reference(torch.randn(4, 2, generator=g)).square().mean().backward()
        opt.step()
        if (step + 1) % period == 0:
            local = torch.nn.utils.parameters_to_vector(reference.parameters()).detach()
            d = bm * d + zeta * (local - start)
            w = w + d
            start = w + bm * d if nesterov else w.clone()
            torch.nn.utils.vector_to_parameters(start.clone(), reference.parameters())
    final = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    torch.testing.assert_close(final, start, rtol=0, atol=1e-6)
    assert wrapped.averager.rounds == 3 and wrapped.averager.step == 6


def test_model_averaging_at_one_worker_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    plain, averaged = nn.Linear(2, 1), model
    plain.load_state_dict(model.state_dict())
    _train(AveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ModelAverager(2)), averaged, 5)
    _train(torch.optim.SGD(plain.parameters(), lr=0.1), plain, 5)
    torch.testing.assert_close(list(averaged.parameters()), list(plain.parameters()), rtol=0, atol=1e-7)


def test_momentum_reset_follows_the_averager_default():
    model = nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped = AveragingOptimizer(sgd, BlockMomentumAverager(2))
    assert wrapped.reset_local_momentum
    _train(wrapped, model, 2)  # a round at step 2 drops the buffers
    assert all("momentum_buffer" not in s for s in sgd.state.values())
    kept = AveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ModelAverager(2))
    assert not kept.reset_local_momentum


def test_state_dict_round_trip_before_the_first_call():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    wrapped = AveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), BlockMomentumAverager(3))
    _train(wrapped, model, 4)
    state = wrapped.state_dict()
    assert state["averager"]["step"] == 4 and set(state["averager"]["block_start"]) == {"0", "1"}
    fresh = BlockMomentumAverager(3)
    resumed = AveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), fresh)
    resumed.load_state_dict(state)
    assert fresh.step == 4 and fresh.block_steps == 1 and not fresh._started  # waits for the parameters
    start = {k: v.clone() for k, v in state["averager"]["block_start"].items()}
    resumed.averager.begin(model.parameters())  # what resumed.step() does first: the saved start, not the model
    assert fresh._started
    torch.testing.assert_close(fresh.state_dict()["block_start"], start)
    with pytest.raises(CheckpointError, match="ModelAverager"):
        ModelAverager(3).load_state_dict(state["averager"])
    with pytest.warns(UserWarning, match="no 'averager' entry"):
        resumed.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())


def test_grad_scaler_steps_equal_the_plain_optimizers():
    """The wrapper unscales the gradients itself (GradScaler hands it the scale): the same steps as plain SGD."""
    torch.manual_seed(0)
    models = [nn.Linear(2, 1), nn.Linear(2, 1)]
    models[1].load_state_dict(models[0].state_dict())
    plain = torch.optim.SGD(models[0].parameters(), lr=0.1)
    wrapped = AveragingOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1), ModelAverager(2))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in models]
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(4, 2, generator=g)
        for model, optimizer, scaler in zip(models, (plain, wrapped), scalers):
            optimizer.zero_grad()
            loss = model(x).square().mean() * (float("inf") if step == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    torch.testing.assert_close(list(models[1].parameters()), list(models[0].parameters()), rtol=0, atol=0)
    assert wrapped.skipped_steps == 1 and wrapped.averager.step == 3
