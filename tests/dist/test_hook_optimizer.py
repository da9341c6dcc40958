"""HookOptimizer: DataParallelSGD's local momentum and 1-bit Adam with quantized_hook in plain DDP (2 gloo ranks)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import bunsan
from bunsan.algorithms import DataParallelSGD, HookOptimizer, QuantizedHookState, quantized_hook
from tests.dist.test_ddp_hook import SMALL_BUCKETS_MB, _data, _flat, _mlp

BATCH = 16  # per rank (tests.dist.test_ddp_hook._data)

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "sgd_wd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01}),
}


def _make(name, params):
    cls, kw = OPTIMIZERS[name]
    return cls(params, **kw)


def _train_hooked(rank, world_size, steps, *, bits, warmup_steps, opt, rotate=False, wrap=True, start=None):
    """DDP + quantized_hook (+ HookOptimizer); ``start``: a checkpoint to resume from (model, hook, optimizer)."""
    module = _mlp()
    if start is not None:
        module.load_state_dict(start["model"])
    model = DDP(module, bucket_cap_mb=SMALL_BUCKETS_MB)
    state = None
    optimizer = _make(opt, model.parameters())
    if bits is not None:
        state = QuantizedHookState(model, bits=bits, warmup_steps=warmup_steps, rotate=rotate)
        if start is not None:
            state.load_state_dict(start["hook"])
        model.register_comm_hook(state, quantized_hook)
        if wrap:
            optimizer = HookOptimizer(optimizer, state)
    if start is not None:
        optimizer.load_state_dict(start["optimizer"])
    x, y = _data(world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
    return model, state, optimizer


def _train_dpsgd(rank, world_size, steps, *, bits, warmup_steps, opt, rotate=False):
    model = _mlp()
    algorithm = DataParallelSGD(
        bits=bits, warm_start=warmup_steps * BATCH * world_size, bucket_size_mb=SMALL_BUCKETS_MB, rotate=rotate
    )
    model, optimizer = bunsan.distribute(model, _make(opt, model.parameters()), algorithm)
    x, y = _data(world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
    return model, algorithm


def _body_equals_dpsgd(rank, world_size, bits, opt, warmup_steps, rotate=False, steps=8):
    hooked, state, optimizer = _train_hooked(
        rank, world_size, steps, bits=bits, warmup_steps=warmup_steps, opt=opt, rotate=rotate
    )
    assert state.quantized_steps == steps - warmup_steps
    reference, algorithm = _train_dpsgd(
        rank, world_size, steps, bits=bits, warmup_steps=warmup_steps, opt=opt, rotate=rotate
    )
    assert algorithm.rotate == rotate
    plain, _, _ = _train_hooked(rank, world_size, steps, bits=bits, warmup_steps=warmup_steps, opt=opt, wrap=False)
    mine = optimizer._local._momentum
    theirs = algorithm._momentum
    assert sorted(mine) == sorted(theirs)
    return (
        _flat(hooked).tolist(),
        _flat(reference).tolist(),
        _flat(plain).tolist(),
        max(float((mine[k] - theirs[k]).abs().max()) for k in mine),
        optimizer.quantized_momentum,
    )


@pytest.mark.parametrize(
    ("bits", "opt", "warmup_steps"),
    [(1, "sgd", 2), (1, "sgd_wd", 0), (1, "nesterov", 2), (4, "sgd_wd", 0), (4, "nesterov", 0)],
)
def test_local_momentum_equals_data_parallel_sgd(workers, bits, opt, warmup_steps):
    results = workers.run(f"{__name__}:_body_equals_dpsgd", bits=bits, opt=opt, warmup_steps=warmup_steps)
    hooked, reference, plain = (torch.tensor(v) for v in results[0][:3])
    assert results[0][4] == (0.8 if bits == 1 else None)  # DataParallelSGD's cap at 2 ranks
    assert results[0][0] == results[1][0]  # every replica the same
    assert hooked.equal(reference), float((hooked - reference).abs().max())
    assert results[0][3] == 0.0 and results[1][3] == 0.0  # the workers' momentum too
    assert (hooked - plain).abs().max() > 1e-4  # the wrapper changed what the hook alone does
