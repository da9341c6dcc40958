"""DataParallelSGD(bits<32) with Adam/AdamW: exact warm-up, then frozen variance (1-bit Adam)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import bunsan
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.algorithms.onebit_adam import CORRECTION_KEY, warm_up_steps


def _batch(k: int, world_size: int) -> torch.Tensor:
    return torch.randn(8 * world_size, 12, generator=torch.Generator().manual_seed(k))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 9), nn.Tanh(), nn.Linear(9, 3))


def _adam(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    return torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)


def _reference(kind: str, world_size: int, warm_steps: int, steps: int) -> list[float]:
    """One process, full batch: Adam for ``warm_steps``, then the variance frozen (written out by hand)."""
    model = _model()
    optimizer = _adam(kind, model.parameters())
    frozen: dict[nn.Parameter, torch.Tensor] = {}
    momentum: dict[nn.Parameter, torch.Tensor] = {}
    for k in range(steps):
        optimizer.zero_grad()
        _loss(model, _batch(k, world_size)).backward()
        if k < warm_steps:
            optimizer.step()
            continue
        group = optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            for p in model.parameters():
                state = optimizer.state[p]
                t0 = float(state["step"])
                if p not in frozen:
                    frozen[p] = (state["exp_avg_sq"] / (1 - beta2**t0)).sqrt() + group["eps"]
                    momentum[p] = state["exp_avg"].clone()
                t = k + 1
                d = p.grad if kind == "adamw" else p.grad + group["weight_decay"] * p
                momentum[p].mul_(beta1).add_(d, alpha=1 - beta1)
                if kind == "adamw":
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(momentum[p], frozen[p], value=-group["lr"] / (1 - beta1**t))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _body_train(rank, world_size, kind, bits, warm_steps, steps):
    model = _model()
    algorithm = DataParallelSGD(bits=bits, warm_start=warm_steps * 8 * world_size) if bits < 32 else DataParallelSGD()
    model, optimizer = bunsan.distribute(model, _adam(kind, model.parameters()), algorithm)
    for k in range(steps):
        optimizer.zero_grad()
        _loss(model, _batch(k, world_size)[rank::world_size]).backward()
        optimizer.step()
    state = optimizer.state[next(model.parameters())]
    return (
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
        int(state["step"]),
        state.get(CORRECTION_KEY),
    )


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_quantized_adam_is_adam_with_the_variance_frozen_after_the_warm_up(workers, kind):
    warm, steps = 3, 9
    (params, step, correction), other = workers.run(
        f"{__name__}:_body_train", kind=kind, bits=16, warm_steps=warm, steps=steps
    )
    assert params == other[0]  # every replica applies the same update
    assert step == steps  # the optimizer's step count goes on through the compressed stage
    assert correction == pytest.approx(1 - 0.99**warm)  # frozen at the end of the warm-up
    reference = torch.tensor(_reference(kind, 2, warm, steps))
    # 16 bits: the exchange is exact to ~1e-5 relative; a wrong bias correction, a doubled
    # weight decay or a variance still moving would be off by far more.
    assert (torch.tensor(params) - reference).abs().max() < 2e-4
    exact = torch.tensor(workers.run(f"{__name__}:_body_train", kind=kind, bits=32, warm_steps=0, steps=steps)[0][0])
    assert (exact - reference).abs().max() > 1e-3  # the freeze is visible: plain Adam ends elsewhere


def test_one_bit_adam_learns_and_replicas_agree(workers):
    (params, _, _), other = workers.run(f"{__name__}:_body_train", kind="adamw", bits=1, warm_steps=3, steps=12)
    assert params == other[0]
    assert all(math.isfinite(v) for v in params)


def _body_default_warm_up(rank, world_size):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.75))  # 1 / (1 - 0.75) = 4 steps
    algorithm = DataParallelSGD(bits=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = bunsan.distribute(model, optimizer, algorithm)
    modes = []
    for k in range(6):
        modes.append(algorithm.quantizing)
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(k))).sum().backward()
        optimizer.step()
    return modes, algorithm.warm_start, [str(w.message) for w in caught]


def test_adam_without_warm_start_gets_the_variance_time_constant_and_is_told(workers):
    (modes, warm_start, said), (_, _, quiet) = workers.run(f"{__name__}:_body_default_warm_up")
    assert warm_up_steps(torch.optim.Adam([nn.Parameter(torch.zeros(1))], betas=(0.9, 0.75))) == 4
    assert modes == [False, False, False, False, True, True]
    assert warm_start == 4 * 5 * 2  # 4 steps of 5 samples on 2 ranks
    assert len(said) == 1 and "first 4 steps" in said[0] and "warm_start" in said[0] and quiet == []


def _body_unserved_optimizer(rank, world_size, bits):
    model = nn.Linear(4, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bunsan.distribute(model, torch.optim.RMSprop(model.parameters()), DataParallelSGD(bits=bits))
    return [str(w.message) for w in caught]


def test_an_optimizer_the_method_cannot_serve_is_named_in_a_warning(workers):
    said, quiet = workers.run(f"{__name__}:_body_unserved_optimizer", bits=2)
    assert len(said) == 1 and "RMSprop" in said[0] and "bits=32" in said[0] and quiet == []
    assert workers.run(f"{__name__}:_body_unserved_optimizer", bits=32) == [[], []]
