"""DataParallelSGD(bits=1) defaults: plain chunks of 512 with SGD (rotated 1024 with Adam), capped workers' momentum
with the step kept."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import bunsan
from bunsan.algorithms.data_parallel import QUANTIZED_MOMENTUM_1BIT, DataParallelSGD
from bunsan.algorithms.data_parallel.momentum import QUANTIZED_MOMENTUM_1BIT_TWO_RANKS, default_quantized_momentum


def test_one_bit_defaults_and_bad_values():
    one = DataParallelSGD(bits=1)
    assert not one.rotate and one._quantizer.chunk_size == 512 and one.quantized_momentum == QUANTIZED_MOMENTUM_1BIT
    two = DataParallelSGD(bits=2)
    assert not two.rotate and two._quantizer.chunk_size == 512 and two.quantized_momentum is None
    assert not DataParallelSGD(bits=1, rotate=False).rotate
    assert DataParallelSGD(bits=1, rotate=True)._quantizer.chunk_size == 1024
    with pytest.raises(ValueError, match="quantized_momentum"):
        DataParallelSGD(bits=1, quantized_momentum=1.0)


def _body_constant_gradient(rank, world_size, bits, quantized_momentum, nesterov, steps=60):
    model = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(model.weight)
    direction = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    algorithm = DataParallelSGD(bits=bits, quantized_momentum=quantized_momentum) if bits < 32 else DataParallelSGD()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=nesterov)
    model, optimizer = bunsan.distribute(model, optimizer, algorithm)
    previous = model.weight.detach().clone()
    for _ in range(steps):
        optimizer.zero_grad()
        (model.weight * direction).sum().backward()  # the same gradient every step
        optimizer.step()
        change = model.weight.detach() - previous
        previous = model.weight.detach().clone()
    return change.reshape(-1).tolist()


@pytest.mark.parametrize("nesterov", [False, True])
def test_capped_momentum_keeps_the_steady_step(workers, nesterov):
    exact = torch.tensor(
        workers.run(f"{__name__}:_body_constant_gradient", bits=32, quantized_momentum=None, nesterov=nesterov)[0]
    )
    capped = torch.tensor(
        workers.run(f"{__name__}:_body_constant_gradient", bits=16, quantized_momentum=0.5, nesterov=nesterov)[0]
    )
    # Steady state of momentum 0.9: every step moves by lr * g / (1 - 0.9), for the capped run too.
    steady = -0.01 * torch.tensor([1.0, -2.0, 0.5, 3.0]) / 0.1
    torch.testing.assert_close(exact, steady, rtol=1e-2, atol=0)
    torch.testing.assert_close(capped, steady, rtol=1e-3, atol=0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_capped_momentum_is_applied_early(workers, nesterov):
    capped = torch.tensor(
        workers.run(f"{__name__}:_body_constant_gradient", bits=16, quantized_momentum=0.5, nesterov=nesterov, steps=3)[
            0
        ]
    )
    # Momentum 0.5 with the gradient scaled by 0.5 / 0.1: step k moves lr * g / 0.1 * (1 - 0.5^k)
    # (Nesterov: 1 - 0.5^(k+1)); momentum 0.9 would give 1 - 0.9^k, a third of it at k = 3.
    k = 4 if nesterov else 3
    expected = -0.01 * torch.tensor([1.0, -2.0, 0.5, 3.0]) / 0.1 * (1 - 0.5**k)
    torch.testing.assert_close(capped, expected, rtol=1e-3, atol=0)


def _body_rotation_follows_the_optimizer(rank, world_size, optimizer, rotate, chunk_size):
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "adamw": lambda p: torch.optim.AdamW(p)}
    algorithm = DataParallelSGD(bits=1, warm_start=10**6, rotate=rotate, chunk_size=chunk_size)
    model, opt = bunsan.distribute(model, make[optimizer](model.parameters()), algorithm)
    for _ in range(2):  # the exchange runs with the stripes planned for the codec chosen
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    return type(algorithm._quantizer).__name__, algorithm.rotate, algorithm._quantizer.chunk_size


@pytest.mark.parametrize(
    ("optimizer", "rotate", "chunk_size", "expected"),
    [
        ("sgd", None, None, ("Quantizer", False, 512)),
        ("adamw", None, None, ("RotatedQuantizer", True, 1024)),
        ("adamw", None, 256, ("RotatedQuantizer", True, 256)),
        ("adamw", False, None, ("Quantizer", False, 512)),
        ("sgd", True, None, ("RotatedQuantizer", True, 1024)),
    ],
)
def test_rotation_default_follows_the_optimizer(workers, optimizer, rotate, chunk_size, expected):
    """rotate=None: plain chunks for SGD, rotated for 1-bit Adam; an explicit choice is kept."""
    results = workers.run(
        f"{__name__}:_body_rotation_follows_the_optimizer",
        optimizer=optimizer,
        rotate=rotate,
        chunk_size=chunk_size,
    )
    assert [tuple(r) for r in results] == [expected, expected]


def _body_momentum_cap_default(rank, world_size, optimizer, quantized_momentum):
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), "adamw": lambda p: torch.optim.AdamW(p)}
    algorithm = DataParallelSGD(bits=1, warm_start=64, quantized_momentum=quantized_momentum)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bunsan.distribute(model, make[optimizer](model.parameters()), algorithm)
    return algorithm.quantized_momentum, [str(w.message) for w in caught if "SGD momentum" in str(w.message)]


def test_default_quantized_momentum_follows_the_stages():
    assert default_quantized_momentum(1, 2, adam=False) == QUANTIZED_MOMENTUM_1BIT_TWO_RANKS == 0.8
    assert default_quantized_momentum(1, 1, adam=False) == QUANTIZED_MOMENTUM_1BIT == 0.5
    assert default_quantized_momentum(1, 4, adam=False) == QUANTIZED_MOMENTUM_1BIT
    assert default_quantized_momentum(1, 2, adam=True) == QUANTIZED_MOMENTUM_1BIT  # 1-bit Adam: not measured higher
    assert default_quantized_momentum(2, 2, adam=False) is None


@pytest.mark.parametrize(
    ("optimizer", "quantized_momentum", "expected"),
    [("sgd", "auto", 0.8), ("adamw", "auto", 0.5), ("sgd", 0.5, 0.5), ("sgd", None, None)],
)
def test_two_ranks_keep_more_momentum_with_sgd(workers, optimizer, quantized_momentum, expected):
    """At 2 ranks (one quantization stage) the workers keep 0.8 of SGD's 0.9, without the heavy-momentum warning."""
    results = workers.run(
        f"{__name__}:_body_momentum_cap_default", optimizer=optimizer, quantized_momentum=quantized_momentum
    )
    assert [r[0] for r in results] == [expected, expected]
    warned = any(r[1] for r in results)  # uncapped 0.9 is still warned about (rank 0)
    assert warned == (expected is None)


def test_one_process_keeps_the_two_stage_cap():
    """One process quantizes in two stages (it owns the only stripe): the cap stays 0.5."""
    result = _body_momentum_cap_default(rank=0, world_size=1, optimizer="sgd", quantized_momentum="auto")
    assert result == (QUANTIZED_MOMENTUM_1BIT, [])
