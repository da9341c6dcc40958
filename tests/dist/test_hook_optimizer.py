"""HookOptimizer: DataParallelSGD's local momentum and 1-bit Adam with quantized_hook in plain DDP (2 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import bunsan
from bunsan.algorithms import DataParallelSGD, HookOptimizer, QuantizedHookState, quantized_hook
from bunsan.compression.rotation import RotatedQuantizer
from tests.dist.test_ddp_hook import SMALL_BUCKETS_MB, _data, _flat, _grads, _mlp, _Probe

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


def _train_hooked(rank, world_size, steps, *, bits, warmup_steps, opt, rotate=False, wrap=True, start=None, clip=None):
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
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model, state, optimizer


def _train_dpsgd(rank, world_size, steps, *, bits, warmup_steps, opt, rotate=False, clip=None):
    model = _mlp()
    algorithm = DataParallelSGD(
        bits=bits, warm_start=warmup_steps * BATCH * world_size, bucket_size_mb=SMALL_BUCKETS_MB, rotate=rotate
    )
    model, optimizer = bunsan.distribute(model, _make(opt, model.parameters()), algorithm)
    x, y = _data(world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model, algorithm


def _body_equals_dpsgd(rank, world_size, bits, opt, warmup_steps, rotate=False, clip=None, steps=8):
    hooked, state, optimizer = _train_hooked(
        rank, world_size, steps, bits=bits, warmup_steps=warmup_steps, opt=opt, rotate=rotate, clip=clip
    )
    assert state.quantized_steps == steps - warmup_steps
    reference, algorithm = _train_dpsgd(
        rank, world_size, steps, bits=bits, warmup_steps=warmup_steps, opt=opt, rotate=rotate, clip=clip
    )
    assert algorithm.rotate == (rotate if rotate is not None else opt != "sgd" and bits == 1)
    assert isinstance(state._quantizer, RotatedQuantizer) == algorithm.rotate
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
    # bit for bit: the same momentum arithmetic (LocalMomentum's) on the same gradients, the same codec per
    # chunk, and at 2 ranks every sum is of two terms (a + b == b + a), whatever DDP's bucket layout
    results = workers.run(f"{__name__}:_body_equals_dpsgd", bits=bits, opt=opt, warmup_steps=warmup_steps)
    hooked, reference, plain = (torch.tensor(v) for v in results[0][:3])
    assert results[0][4] == (0.8 if bits == 1 else None)  # DataParallelSGD's cap at 2 ranks
    assert results[0][0] == results[1][0]  # every replica the same
    assert hooked.equal(reference), float((hooked - reference).abs().max())
    assert results[0][3] == 0.0 and results[1][3] == 0.0  # the workers' momentum too
    assert (hooked - plain).abs().max() > 1e-4  # the wrapper changed what the hook alone does


def test_clipping_between_backward_and_step_equals_data_parallel_sgd(workers):
    # p.grad shows the mean gradient, not the momentum, and the workers' momentum follows the clipping
    results = workers.run(f"{__name__}:_body_equals_dpsgd", bits=1, opt="sgd_wd", warmup_steps=1, clip=0.05)
    hooked, reference, plain = (torch.tensor(v) for v in results[0][:3])
    assert results[0][0] == results[1][0]
    assert hooked.equal(reference), float((hooked - reference).abs().max())
    assert results[0][3] == 0.0 and results[1][3] == 0.0


@pytest.mark.parametrize("rotate", [True, None])
def test_one_bit_adam_equals_data_parallel_sgd(workers, rotate):
    # DataParallelSGD rotates for Adam at 1 bit by default; so does the wrapper with the state's default (None)
    for opt in ("adam", "adamw"):
        results = workers.run(f"{__name__}:_body_equals_dpsgd", bits=1, opt=opt, warmup_steps=3, rotate=rotate)
        hooked, reference, plain = (torch.tensor(v) for v in results[0][:3])
        assert results[0][4] == 0.5  # 1-bit Adam's cap
        assert results[0][0] == results[1][0]
        assert hooked.equal(reference), float((hooked - reference).abs().max())
        assert results[0][3] == 0.0 and results[1][3] == 0.0
        assert (hooked - plain).abs().max() > 1e-4


def _body_warm_up_equals_ddp(rank, world_size, opt, steps=4):
    default, _, plain_opt = _train_hooked(rank, world_size, steps, bits=None, warmup_steps=0, opt=opt)
    hooked, state, optimizer = _train_hooked(rank, world_size, steps, bits=1, warmup_steps=steps, opt=opt)
    assert state.step == steps and state.quantized_steps == 0 and not optimizer._local._momentum
    same_state = all(
        torch.equal(a, b)
        for p, q in zip(default.parameters(), hooked.parameters())
        for a, b in zip(plain_opt.state[p].values(), optimizer.state[q].values())
        if isinstance(a, torch.Tensor)
    )
    return torch.equal(_flat(default), _flat(hooked)) and same_state


@pytest.mark.parametrize("opt", ["nesterov", "adamw"])
def test_warm_up_equals_ddp_default_bit_for_bit(workers, opt):
    assert workers.run(f"{__name__}:_body_warm_up_equals_ddp", opt=opt) == [True, True]


def _body_round_trip(rank, world_size, opt, warmup_steps, rotate=False, steps=7, cut=4):
    kw = {"bits": 1, "warmup_steps": warmup_steps, "opt": opt, "rotate": rotate}
    straight, _, _ = _train_hooked(rank, world_size, steps, **kw)
    model, state, optimizer = _train_hooked(rank, world_size, cut, **kw)
    saved = copy.deepcopy(
        {"model": model.module.state_dict(), "hook": state.state_dict(), "optimizer": optimizer.state_dict()}
    )
    assert saved["optimizer"]["local_momentum"]  # the workers' buffers travel with the optimizer's state
    resumed, fresh, _ = _train_hooked(rank, world_size, steps - cut, start=saved, **kw)
    assert fresh.step == steps
    return torch.equal(_flat(straight), _flat(resumed))


@pytest.mark.parametrize(("opt", "warmup_steps", "rotate"), [("sgd_wd", 2, False), ("adam", 2, True)])
def test_state_dict_round_trip_resumes_bit_for_bit(workers, opt, warmup_steps, rotate):
    results = workers.run(f"{__name__}:_body_round_trip", opt=opt, warmup_steps=warmup_steps, rotate=rotate)
    assert results == [True, True]


def _body_grad_scaler(rank, world_size, opt, bad_step=3, steps=6):
    """An inf on rank 1 only: every rank skips the step; residuals and the workers' momentum are untouched."""
    model = DDP(_Probe(), bucket_cap_mb=SMALL_BUCKETS_MB)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1000)
    state = QuantizedHookState(model, bits=1, warmup_steps=1, grad_scaler=scaler)
    model.register_comm_hook(state, quantized_hook)
    optimizer = HookOptimizer(_make(opt, model.parameters()), state)
    for step in range(steps):
        grads = _grads(step, rank)
        if step == bad_step:
            if rank == 1:
                grads[2][5] = float("inf")
            residuals = copy.deepcopy(state.residuals())
            momentum = copy.deepcopy(optimizer._local._momentum)
            params = _flat(model).clone()
            optimizer_state = copy.deepcopy(optimizer.optimizer.state_dict())
        optimizer.zero_grad()
        scaler.scale(model(grads)).backward()
        scaler.step(optimizer)
        scaler.update()
        if step == bad_step:
            after = state.residuals()
            assert all(torch.equal(after[w][n], residuals[w][n]) for w in after for n in after[w])
            assert momentum and all(torch.equal(optimizer._local._momentum[n], momentum[n]) for n in momentum)
            assert torch.equal(_flat(model), params)
            assert str(optimizer.optimizer.state_dict()) == str(optimizer_state)
            assert scaler.get_scale() == 2.0**3
    assert state.skipped_steps == 1 and state.quantized_steps == steps - 2
    assert torch.isfinite(_flat(model)).all()
    return _flat(model).tolist()


@pytest.mark.parametrize("opt", ["sgd_wd", "adam"])
def test_grad_scaler_overflow_on_one_rank_leaves_momentum_untouched(workers, opt):
    results = workers.run(f"{__name__}:_body_grad_scaler", opt=opt)
    assert results[0] == results[1]


def _body_errors(rank, world_size):
    model = DDP(_mlp())
    state = QuantizedHookState(model, bits=1, warmup_steps=0)
    HookOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state)
    with pytest.raises(ValueError, match="has a HookOptimizer already"):
        HookOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state)
    with pytest.raises(ValueError, match="warm-up"):
        HookOptimizer(torch.optim.Adam(model.parameters()), QuantizedHookState(model, bits=1, warmup_steps=0))
    return True


def test_errors_with_a_process_group(workers):
    assert workers.run(f"{__name__}:_body_errors") == [True, True]
