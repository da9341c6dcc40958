"""AsyncSGD in one process: the pure rules, argument checks, the ramp, state. No process group."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from bunsan import algorithms
from bunsan.algorithms.async_sgd import AsyncSGD, lr_warmup_factor, may_proceed, scaled_lr, staleness_scale
from bunsan.algorithms.block_momentum import BlockMomentumSGD
from bunsan.errors import CheckpointError
from bunsan.optim import DistributedOptimizer


def _lone(algorithm: AsyncSGD, model: nn.Module, lr: float = 0.1, momentum: float = 0.0) -> DistributedOptimizer:
    """What bunsan.distribute does, minus the process group."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    algorithm.setup(list(model.named_parameters()))
    algorithm.attach_optimizer(optimizer)
    return DistributedOptimizer(optimizer, algorithm)


def _train(model: nn.Module, optimizer: DistributedOptimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        optimizer.algorithm.count_samples(len(x))
        F.mse_loss(model(x), y).backward()
        optimizer.step()


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


# -- pure rules ---------------------------------------------------------------------------
def test_lr_warmup_ramps_linearly_from_start_to_one():
    assert lr_warmup_factor(0, 100, 0.1) == pytest.approx(0.1)
    assert lr_warmup_factor(50, 100, 0.1) == pytest.approx(0.55)
    assert lr_warmup_factor(100, 100, 0.1) == 1.0
    assert lr_warmup_factor(10_000, 100, 0.1) == 1.0
    assert lr_warmup_factor(0, 0, 0.1) == 1.0  # no ramp


def test_staleness_scale_divides_by_staleness():
    assert [staleness_scale(s) for s in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]


def test_may_proceed_bounds_the_lead_over_the_slowest_active_worker():
    pushes = {0: 5, 1: 3, 2: 4}
    assert may_proceed(0, pushes, set(), None)
    assert may_proceed(0, pushes, set(), 2) and not may_proceed(0, pushes, set(), 1)
    assert may_proceed(1, pushes, set(), 0)  # the slowest always proceeds
    assert may_proceed(0, pushes, {1}, 1)  # a finished worker holds nobody back
    assert may_proceed(0, {0: 9}, {0}, 0)


def test_scaled_lr_divides_by_the_workers():
    assert scaled_lr(0.4, 4) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="world_size"):
        scaled_lr(0.1, 0)


# -- arguments --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"sync_period": 0}, ValueError, "sync_period must be an int >= 1"),
        ({"sync_period": 2.5}, TypeError, "sync_period must be an int"),
        ({"sync_period": True}, TypeError, "sync_period must be an int"),
        ({"staleness_bound": -1}, ValueError, "staleness_bound must be an int >= 0"),
        ({"lr_warmup": -5}, ValueError, "lr_warmup must be an int >= 0"),
        ({"lr_warmup_start": 0.0}, ValueError, "lr_warmup_start must be a number > 0.0 and <= 1.0"),
        ({"lr_warmup_start": 1.5}, ValueError, "lr_warmup_start must be a number > 0.0 and <= 1.0"),
        ({"server": "dedicated"}, ValueError, "server must be one of 'rank0'"),
        ({"timeout_s": 0}, ValueError, "timeout_s must be"),
        ({"timeout_s": float("inf")}, ValueError, "timeout_s must be"),
        ({"staleness_aware": "yes"}, TypeError, "staleness_aware"),
        ({"lr_warmup_start": "0.5"}, TypeError, "lr_warmup_start must be a number"),
        ({"timeout_s": "60"}, TypeError, "timeout_s must be a number"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(options, error, match):
    with pytest.raises(error, match=match):
        AsyncSGD(**options)


def test_builds_without_a_process_group_and_names_itself():
    algorithm = AsyncSGD(sync_period=64, staleness_bound=2, lr_warmup=1000)
    assert algorithm.name == "async"
    assert repr(algorithm).startswith("AsyncSGD(sync_period=64, staleness_bound=2")


def test_registered_as_async():
    assert "async" in algorithms.names()
    assert isinstance(algorithms.create("async", sync_period=32), AsyncSGD)
    from bunsan.bench.compare import AlgorithmSetting, check_setting

    assert check_setting(AlgorithmSetting("async", {"sync_period": 32}))["algorithm"] == "async"


def test_untrained_algorithm_needs_setup():
    with pytest.raises(RuntimeError, match="not set up"):
        AsyncSGD().join()


# -- one worker -------------------------------------------------------------------------
def test_one_worker_is_local_sgd():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    reference = copy.deepcopy(model)
    optimizer = _lone(AsyncSGD(sync_period=8), model, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    batches = _batches(6)
    _train(model, optimizer, batches)
    for x, y in batches:
        ref_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
    optimizer.join()
    torch.testing.assert_close(parameters_to_vector(model.parameters()), parameters_to_vector(reference.parameters()))
    stats = optimizer.algorithm.stats()
    assert stats["server_samples"] == stats["samples"] == 24
    assert stats["pushes"] == 3 + 1  # every 2 steps, plus join's
    assert stats["bytes_sent"] == 0  # rank 0's own worker talks to the server in-process


def test_lr_warmup_scales_the_step_and_restores_the_rate():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    algorithm = AsyncSGD(sync_period=4, lr_warmup=40, lr_warmup_start=0.25)
    optimizer = _lone(algorithm, model, lr=0.1)
    x, y = _batches(1)[0]
    before = parameters_to_vector(model.parameters()).detach().clone()
    optimizer.zero_grad()
    algorithm.count_samples(len(x))
    F.mse_loss(model(x), y).backward()
    grad = parameters_to_vector([p.grad for p in model.parameters()]).clone()
    optimizer.step()
    after = parameters_to_vector(model.parameters()).detach()
    torch.testing.assert_close(after, before - 0.1 * 0.25 * grad)  # the first step at 25% of the rate
    assert optimizer.param_groups[0]["lr"] == 0.1  # a scheduler sees the rate it set
    _train(model, optimizer, _batches(12))
    assert algorithm.lr_scale == 1.0


def test_lr_warmup_needs_the_optimizer():
    model = nn.Linear(3, 2)
    algorithm = AsyncSGD(lr_warmup=10)
    algorithm.setup(list(model.named_parameters()))
    with pytest.raises(RuntimeError, match="learning rate"):
        algorithm.reduce_gradients()


def test_no_training_after_join():
    model = nn.Linear(3, 2)
    optimizer = _lone(AsyncSGD(sync_period=4), model)
    optimizer.join()
    with pytest.raises(RuntimeError, match="joined"):
        _train(model, optimizer, _batches(1))


# -- state ------------------------------------------------------------------------------
def _run(resume_at: int | None, steps: int = 7) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = _lone(AsyncSGD(sync_period=12), model, momentum=0.9)  # a push every 3 steps
    batches = _batches(steps, seed=1)
    if resume_at is None:
        _train(model, optimizer, batches)
    else:
        _train(model, optimizer, batches[:resume_at])
        model_state, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
        torch.manual_seed(123)
        model = nn.Linear(3, 2)  # a fresh process: other initial weights, restored below
        optimizer = _lone(AsyncSGD(sync_period=12), model, momentum=0.9)
        model.load_state_dict(model_state)
        optimizer.load_state_dict(state)
        _train(model, optimizer, batches[resume_at:])
    optimizer.join()
    return parameters_to_vector(model.parameters()).detach()


@pytest.mark.parametrize("resume_at", [2, 3, 4])
def test_resumed_run_equals_uninterrupted_bit_for_bit(resume_at):
    assert torch.equal(_run(resume_at), _run(None))


def test_state_holds_the_server_and_the_counts():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = _lone(AsyncSGD(sync_period=8), model)
    _train(model, optimizer, _batches(3))
    state = optimizer.algorithm.state_dict()
    assert state["algorithm"] == "async" and state["pushes"] == 1 and state["sync_samples"] == 4
    assert state["server"]["version"] == 1 and state["server"]["samples"] == 8
    assert set(state["server"]["model"]) == {"weight", "bias"} == set(state["base"])


def test_state_from_another_model_or_algorithm_is_refused():
    model = nn.Linear(3, 2)
    optimizer = _lone(AsyncSGD(sync_period=8), model)
    _train(model, optimizer, _batches(1))
    state = optimizer.algorithm.state_dict()
    other = AsyncSGD(sync_period=8)
    other.setup(list(nn.Linear(5, 2).named_parameters()))
    with pytest.raises(CheckpointError, match="another model"):
        other.load_state_dict(state)
    with pytest.raises(CheckpointError, match="algorithm"):
        BlockMomentumSGD(block_size=8).load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"after bunsan\.distribute"):
        AsyncSGD(sync_period=8).load_state_dict(state)
