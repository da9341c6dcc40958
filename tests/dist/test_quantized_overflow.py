"""Quantized exchange and GradScaler: an overflow step on one rank is skipped everywhere and leaves no trace.

With local momentum the workers' momentum and the error-feedback residuals are updated
during backward, before GradScaler's ``step`` looks at the gradients; a rank whose
gradient overflowed would otherwise keep an inf or NaN in them for good.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bunsan
from bunsan.algorithms.data_parallel import DataParallelSGD


def _body_overflow_on_one_rank(rank, world_size, bits, rotate, adam=False, overflow_step=3, steps=7):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if adam:  # 1-bit Adam: one exact step (16 samples) first, then the frozen-variance momentum
        algorithm = DataParallelSGD(bits=bits, rotate=rotate, warm_start=16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        algorithm = DataParallelSGD(bits=bits, rotate=rotate)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = bunsan.distribute(model, optimizer, algorithm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    g = torch.Generator().manual_seed(rank)
    observed = {}
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if step == overflow_step and rank == world_size - 1:
            loss = loss * float("inf")  # this rank's gradients overflow
        if step == overflow_step:
            params = [p.detach().clone() for p in model.parameters()]
            momentum = {k: v.clone() for k, v in algorithm._momentum.items()}
            scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == overflow_step:
            observed["params_kept"] = all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
            observed["momentum_kept"] = bool(momentum) and momentum.keys() == algorithm._momentum.keys()
            observed["momentum_kept"] &= all(torch.equal(momentum[k], algorithm._momentum[k]) for k in momentum)
            observed["scale_halved"] = scaler.get_scale() == scale / 2
    residuals = [t for kind in algorithm.residuals().values() for t in kind.values()]
    observed["finite"] = all(
        bool(torch.isfinite(t).all()) for t in [*model.parameters(), *algorithm._momentum.values(), *residuals]
    )
    observed["moved_after"] = not all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    observed["digest"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    return observed


@pytest.mark.parametrize(
    ("bits", "rotate", "adam"), [(1, False, False), (1, True, False), (4, False, False), (1, None, True)]
)
def test_overflow_on_one_rank_is_skipped_everywhere_and_forgotten(workers, bits, rotate, adam):
    results = workers.run(f"{__name__}:_body_overflow_on_one_rank", bits=bits, rotate=rotate, adam=adam)
    for r in results:
        assert r["params_kept"] and r["momentum_kept"] and r["scale_halved"], r
        assert r["finite"] and r["moved_after"], r
    assert results[0]["digest"] == results[1]["digest"]  # the replicas still agree


def test_overflow_with_four_workers_two_stage_exchange(workers4):
    """Stripe owners re-quantize the sum: their residuals must forget the overflow too."""
    results = workers4.run(f"{__name__}:_body_overflow_on_one_rank", bits=1, rotate=False)
    for r in results:
        assert r["params_kept"] and r["momentum_kept"] and r["scale_halved"] and r["finite"], r
    assert len({r["digest"] for r in results}) == 1
