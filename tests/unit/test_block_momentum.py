"""Block momentum's pure arithmetic and argument checks: no processes."""

from __future__ import annotations

import math

import pytest
import torch

from bunsan.algorithms.block_momentum import (
    BlockMomentumSGD,
    block_gain,
    default_block_momentum,
    momentum_to_time_constant,
    reset_momentum_buffers,
    scaled_block_momentum,
    time_constant_to_momentum,
    update_block_start_,
    update_global_model_,
)
from bunsan.algorithms.model_averaging import ModelAveragingSGD


@pytest.mark.parametrize(("world_size", "expected"), [(1, 0.0), (2, 0.5), (4, 0.75), (64, 1 - 1 / 64)])
def test_default_block_momentum_is_one_minus_one_over_n(world_size, expected):
    assert default_block_momentum(world_size) == pytest.approx(expected)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("block_learning_rate", [1.0, 0.7])
def test_default_gain_equals_block_learning_rate(world_size, block_learning_rate):
    bm = default_block_momentum(world_size)
    assert block_gain(bm, world_size, block_learning_rate) == pytest.approx(block_learning_rate)


def test_gain_follows_cntk_parameterization():
    # zeta = (1 - bm) * N * blr
    assert block_gain(0.9, 4, 0.5) == pytest.approx(0.1 * 4 * 0.5)
    assert block_gain(0.0, 2, 0.5) == 1.0  # bm = 0, blr = 1/N: exactly model averaging


@pytest.mark.parametrize("bm", [0.5, 0.9, 0.999])
@pytest.mark.parametrize("block_size", [1, 64, 1000])
def test_time_constant_round_trips(bm, block_size):
    tau = momentum_to_time_constant(bm, block_size)
    assert tau > 0
    assert time_constant_to_momentum(tau, block_size) == pytest.approx(bm, rel=1e-12)
    # CNTK: bm = exp(-block_size / tau)
    assert math.exp(-block_size / tau) == pytest.approx(bm, rel=1e-12)


def test_zero_momentum_has_zero_time_constant():
    assert momentum_to_time_constant(0.0, 100) == 0.0
    assert time_constant_to_momentum(0.0, 50) == 0.0
    assert scaled_block_momentum(0.0, 100, 37) == 0.0


@pytest.mark.parametrize("samples", [1, 32, 64, 100, 128])
def test_scaled_block_momentum_is_the_time_constant_form(samples):
    bm, block_size = 0.75, 64
    expected = time_constant_to_momentum(momentum_to_time_constant(bm, block_size), samples)
    assert scaled_block_momentum(bm, block_size, samples) == pytest.approx(expected, rel=1e-12)
    assert scaled_block_momentum(bm, block_size, samples) == pytest.approx(bm ** (samples / block_size), rel=1e-12)


def test_scaled_block_momentum_by_hand():
    assert scaled_block_momentum(0.81, 10, 10) == pytest.approx(0.81)  # a full block: bm itself
    assert scaled_block_momentum(0.81, 10, 5) == pytest.approx(0.9)  # half a block: sqrt(bm)
    assert scaled_block_momentum(0.9, 10, 20) == pytest.approx(0.81)  # two blocks' worth: bm ** 2
    with pytest.raises(ValueError, match="samples must be a number > 0"):
        scaled_block_momentum(0.5, 10, 0)


def test_momentum_to_time_constant_rejects_out_of_range():
    for bm in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"block_momentum must be a (finite )?number >= 0.0 and < 1.0"):
            momentum_to_time_constant(bm, 10)


def _equations(w_locals, w, d, start, bm, zeta, lookahead, nesterov):
    """DESIGN.md's equations, written out on plain tensors."""
    g = torch.stack(w_locals).mean(0) - start
    d = bm * d + zeta * g
    w = w + d
    return w, d, (w + lookahead * d if nesterov else w.clone())


@pytest.mark.parametrize("nesterov", [True, False])
def test_update_matches_the_equations(nesterov):
    gen = torch.Generator().manual_seed(3)
    w, d = torch.randn(10, generator=gen, dtype=torch.float64), torch.randn(10, generator=gen, dtype=torch.float64)
    start = w + 0.5 * d
    w_locals = [start + 0.1 * torch.randn(10, generator=gen, dtype=torch.float64) for _ in range(3)]
    bm, zeta = 0.6, block_gain(0.6, 3, 1.0)
    expected = _equations(w_locals, w, d, start, bm, zeta, 0.5, nesterov)

    w2, d2, start2 = w.clone(), d.clone(), torch.empty_like(w)
    block_change = torch.stack(w_locals).mean(0) - start
    update_global_model_(w2, d2, block_change, bm, zeta)
    update_block_start_(start2, w2, d2, 0.5, nesterov)
    for got, want in zip((w2, d2, start2), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_update_by_hand():
    # W = 1, D = 2, G = mean(4, 6) - 3 = 2; bm = 0.5, zeta = 1: D = 1 + 2 = 3, W = 4, start = 4 + 0.5 * 3
    w, d, start = torch.tensor([1.0]), torch.tensor([2.0]), torch.empty(1)
    update_global_model_(w, d, torch.tensor([2.0]), 0.5, 1.0)
    update_block_start_(start, w, d, 0.5, nesterov=True)
    assert (w.item(), d.item(), start.item()) == (4.0, 3.0, 5.5)
    update_block_start_(start, w, d, 0.5, nesterov=False)
    assert start.item() == 4.0


def test_zero_momentum_unit_gain_is_model_averaging():
    gen = torch.Generator().manual_seed(0)
    w, d = torch.randn(6, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    w_locals = [w + torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(4)]
    update_global_model_(w, d, torch.stack(w_locals).mean(0) - w, 0.0, 1.0)
    torch.testing.assert_close(w, torch.stack(w_locals).mean(0), rtol=0, atol=1e-12)


def test_reset_momentum_buffers_drops_sgd_momentum_only():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    adam = torch.optim.Adam([b], lr=0.1)
    for opt, p in ((sgd, a), (adam, b)):
        p.grad = torch.ones(2)
        opt.step()
    assert reset_momentum_buffers(sgd) == 1
    assert "momentum_buffer" not in sgd.state[a]
    assert reset_momentum_buffers(adam) == 0
    assert set(adam.state[b]) >= {"exp_avg", "exp_avg_sq", "step"}
    # after the reset the next step starts momentum afresh: buf = grad
    a.grad = torch.full((2,), 2.0)
    sgd.step()
    torch.testing.assert_close(sgd.state[a]["momentum_buffer"], torch.full((2,), 2.0))


# -- argument checks -------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"block_size": 0}, ValueError, ["block_size must be an int >= 1", "got 0", "block_size=8 * batch_size"]),
        ({"block_size": -5}, ValueError, ["block_size must be an int >= 1", "got -5"]),
        ({"block_size": 1.5}, TypeError, ["block_size must be an int", "1.5"]),
        ({"block_size": True}, TypeError, ["block_size must be an int"]),
        (
            {"block_size": 8, "block_momentum": 1.0},
            ValueError,
            ["block_momentum must be a number >= 0.0 and < 1.0", "got 1.0", "None means 1 - 1/world_size"],
        ),
        (
            {"block_size": 8, "block_momentum": -0.1},
            ValueError,
            ["block_momentum must be a number >= 0.0 and < 1.0", "got -0.1"],
        ),
        (
            {"block_size": 8, "block_momentum": float("nan")},
            ValueError,
            ["block_momentum must be a finite number", "nan"],
        ),
        ({"block_size": 8, "block_learning_rate": 0.0}, ValueError, ["block_learning_rate must be", "> 0", "got 0.0"]),
        ({"block_size": 8, "block_learning_rate": -1.0}, ValueError, ["block_learning_rate", "got -1.0"]),
        ({"block_size": 8, "block_learning_rate": float("inf")}, ValueError, ["block_learning_rate must be a finite"]),
        (
            {"block_size": 8, "warm_start": -1},
            ValueError,
            ["warm_start must be an int >= 0", "got -1", "all workers together"],
        ),
        ({"block_size": 8, "warm_start": 2.5}, TypeError, ["warm_start must be an int"]),
        ({"block_size": 8, "block_momentum": "0.9"}, TypeError, ["block_momentum must be a number"]),
    ],
)
def test_block_momentum_argument_errors_name_argument_value_and_fix(kwargs, error, words):
    with pytest.raises(error) as info:
        BlockMomentumSGD(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"block_size": 0}, ValueError, ["block_size must be an int >= 1", "got 0"]),
        ({"block_size": "64"}, TypeError, ["block_size must be an int", "'64'"]),
        ({"block_size": 8, "warm_start": -3}, ValueError, ["warm_start must be an int >= 0", "got -3"]),
    ],
)
def test_model_averaging_argument_errors(kwargs, error, words):
    with pytest.raises(error) as info:
        ModelAveragingSGD(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_valid_arguments_and_names():
    bm = BlockMomentumSGD(64, block_momentum=0.0, block_learning_rate=0.5, nesterov=False, warm_start=128)
    assert (bm.block_size, bm.block_momentum, bm.block_learning_rate, bm.nesterov, bm.warm_start) == (
        64,
        0.0,
        0.5,
        False,
        128,
    )
    assert BlockMomentumSGD.name == "block_momentum" and ModelAveragingSGD.name == "model_averaging"
    assert "block_size=64" in repr(bm)
    ma = ModelAveragingSGD(32, warm_start=64)
    assert repr(ma) == "ModelAveragingSGD(block_size=32, warm_start=64)"
    assert ma.filter_coefficients(7.0) == (0.0, 1.0)
    assert not ma.nesterov and not ma.reset_local_momentum


def test_filter_coefficients_scale_with_actual_block():
    algo = BlockMomentumSGD(100, block_momentum=0.81, block_learning_rate=1.0)  # world size 1 without a process group
    bm, zeta = algo.filter_coefficients(100.0)
    assert bm == pytest.approx(0.81) and zeta == pytest.approx(0.19)
    bm, zeta = algo.filter_coefficients(50.0)
    assert bm == pytest.approx(0.9) and zeta == pytest.approx(0.1)
    assert algo.time_constant == pytest.approx(-100 / math.log(0.81))
