"""quantized_hook: DataParallelSGD's quantized exchange inside plain DistributedDataParallel (2 gloo ranks)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bunsan
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.algorithms.data_parallel.ddp_hook import QuantizedHookState, quantized_hook

SMALL_BUCKETS_MB = 0.0002  # about 50 floats: several DDP buckets for the small models here


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 37), nn.Tanh(), nn.Linear(37, 11), nn.Tanh(), nn.Linear(11, 3))


def _data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(16 * world_size, 20, generator=g), torch.randn(16 * world_size, 3, generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_ddp(rank, world_size, steps, *, bits=None, warmup_steps=0, bucket_cap_mb=SMALL_BUCKETS_MB, **ddp):
    """DDP with the hook (``bits``) or DDP's default all-reduce (``bits=None``); plain SGD."""
    model = DDP(_mlp(), bucket_cap_mb=bucket_cap_mb, **ddp)
    state = None
    if bits is not None:
        state = QuantizedHookState(model, bits=bits, warmup_steps=warmup_steps)
        model.register_comm_hook(state, quantized_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
    return model, state


def _body_exact(rank, world_size, bits, warmup_steps, steps=4):
    default, _ = _train_ddp(rank, world_size, steps)
    hooked, state = _train_ddp(rank, world_size, steps, bits=bits, warmup_steps=warmup_steps)
    assert state.step == steps and state.quantized_steps == 0
    return torch.equal(_flat(default), _flat(hooked))


@pytest.mark.parametrize(("bits", "warmup_steps"), [(32, 0), (1, 4), (4, 100)])
def test_exact_and_warm_up_equal_ddp_default_bit_for_bit(workers, bits, warmup_steps):
    assert workers.run(f"{__name__}:_body_exact", bits=bits, warmup_steps=warmup_steps) == [True, True]


class _Probe(nn.Module):
    """Parameters whose gradient is whatever tensor the forward is given: ``d(sum p * g)/dp = g``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(37, 11))  # odd sizes: padded stripes, partial chunks
        self.b = nn.Parameter(torch.zeros(11))
        self.c = nn.Parameter(torch.zeros(600))  # longer than one chunk

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.parameters(), grads))


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(p.shape, generator=g) for p in _Probe().parameters()]


def _body_error_feedback_identity(rank, world_size, bits, steps, rotate=False):
    """Sum of applied gradients + outstanding residuals == sum of true mean gradients."""
    model = DDP(_Probe(), bucket_cap_mb=SMALL_BUCKETS_MB)
    state = QuantizedHookState(model, bits=bits, warmup_steps=0, rotate=rotate)
    model.register_comm_hook(state, quantized_hook)
    params = list(model.parameters())
    applied = [torch.zeros_like(p) for p in params]
    true = [torch.zeros_like(p) for p in params]
    for k in range(steps):
        for p in params:
            p.grad = None
        model(_grads(k, rank)).backward()
        for a, p in zip(applied, params):
            a += p.grad
        for r in range(world_size):
            for t, g in zip(true, _grads(k, r)):
                t += g / world_size
    residuals = state.residuals()
    names = [n for n, _ in model.module.named_parameters()]
    return (
        [a.tolist() for a in applied],
        [t.tolist() for t in true],
        [(residuals["residual"][n] + residuals["owner_residual"][n]).tolist() for n in names],
        state.stats(),
        [layout.stripes.batched for layout in state._layouts.values()],
    )


def _check_identity(results, world_size):
    for i in range(3):  # per parameter
        applied = torch.tensor(results[0][0][i])
        true = torch.tensor(results[0][1][i])
        residual_sum = sum(torch.tensor(r[2][i]) for r in results)
        torch.testing.assert_close(applied + residual_sum, true, rtol=0, atol=2e-5)
        assert (applied - true).abs().max() > 1e-4  # quantization did drop something along the way
        for r in range(1, world_size):
            assert results[r][0][i] == results[0][0][i]  # every replica applies the same gradient


@pytest.mark.parametrize(("bits", "rotate"), [(1, False), (2, False), (8, False), (1, True)])
def test_error_feedback_loses_nothing(workers, bits, rotate):
    results = workers.run(f"{__name__}:_body_error_feedback_identity", bits=bits, steps=10, rotate=rotate)
    _check_identity(results, 2)
    stats = results[0][3]
    # small parameters: padded stripes and chunk means weigh more than in a real model
    assert stats["quantized_steps"] == 10 and stats["compression_ratio"] > (8 if bits == 1 else 2)


def test_error_feedback_loses_nothing_with_4_ranks(workers4):
    # 3+ ranks: the owners re-quantize their stripes with residuals of their own
    _check_identity(workers4.run(f"{__name__}:_body_error_feedback_identity", bits=1, steps=6), 4)


def _body_equals_data_parallel_sgd(rank, world_size, bits, steps=6):
    hooked, state = _train_ddp(rank, world_size, steps, bits=bits)
    model = _mlp()
    algorithm = DataParallelSGD(bits=bits, local_momentum=False, bucket_size_mb=SMALL_BUCKETS_MB)
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm)
    x, y = _data(world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
    assert state.quantized_steps == steps
    exact, _ = _train_ddp(rank, world_size, steps)
    return _flat(hooked).tolist(), _flat(model).tolist(), _flat(exact).tolist()


@pytest.mark.parametrize("bits", [1, 4])
def test_hook_equals_data_parallel_sgd(workers, bits):
    results = workers.run(f"{__name__}:_body_equals_data_parallel_sgd", bits=bits)
    hooked, algorithm, exact = (torch.tensor(v) for v in results[0])
    torch.testing.assert_close(hooked, algorithm, rtol=0, atol=1e-6)
    assert (hooked - exact).abs().max() > 1e-5  # it did quantize
    assert results[0][0] == results[1][0]


def _body_one_call_codec(rank, world_size, bits):
    """The codec in one call per bucket and phase, as on a GPU (stripes.coded_per_bucket), here on CPU."""
    os.environ["BUNSAN_CODEC_CALLS"] = "bucket"
    try:
        identity = _body_error_feedback_identity(rank, world_size, bits, steps=6)
        equal = _body_equals_data_parallel_sgd(rank, world_size, bits)
    finally:
        del os.environ["BUNSAN_CODEC_CALLS"]
    return identity, equal


def test_one_call_codec_of_a_gpu(workers):
    results = workers.run(f"{__name__}:_body_one_call_codec", bits=2)
    assert all(results[0][0][4]) and results[0][0][4]  # the one-call codec ran
    _check_identity([r[0] for r in results], 2)
    hooked, algorithm, _ = (torch.tensor(v) for v in results[0][1])
    torch.testing.assert_close(hooked, algorithm, rtol=0, atol=1e-6)


def _body_bucket_layouts(rank, world_size, bits, steps=6):
    small, s1 = _train_ddp(rank, world_size, steps, bits=bits, bucket_cap_mb=SMALL_BUCKETS_MB)
    one, s2 = _train_ddp(rank, world_size, steps, bits=bits, bucket_cap_mb=25)
    res_small, res_one = s1.residuals()["residual"], s2.residuals()["residual"]
    assert sorted(res_small) == sorted(res_one) == sorted(n for n, _ in small.module.named_parameters())
    assert all(torch.equal(res_small[n], res_one[n]) for n in res_small)
    return torch.equal(_flat(small), _flat(one))


def test_residuals_follow_parameters_across_bucket_layouts(workers):
    # DDP rebuilds its buckets after the first step; 2 ranks quantize per parameter chunk, so any layout
    # gives the same result bit for bit if no residual is lost in a rebuild
    assert workers.run(f"{__name__}:_body_bucket_layouts", bits=2) == [True, True]


def _body_state_round_trip(rank, world_size, bits, warmup_steps, steps=6, cut=3):
    straight, _ = _train_ddp(rank, world_size, steps, bits=bits, warmup_steps=warmup_steps)
    model, state = _train_ddp(rank, world_size, cut, bits=bits, warmup_steps=warmup_steps)
    x, y = _data(world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = copy.deepcopy({"model": model.module.state_dict(), "hook": state.state_dict()})
    # resume in a fresh DDP model (its first buckets, rebuilt after one step) and a fresh state
    resumed_module = _mlp()
    resumed_module.load_state_dict(saved["model"])
    resumed = DDP(resumed_module, bucket_cap_mb=SMALL_BUCKETS_MB)
    fresh = QuantizedHookState(resumed, bits=bits, warmup_steps=warmup_steps)
    fresh.load_state_dict(saved["hook"])
    resumed.register_comm_hook(fresh, quantized_hook)
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    for _ in range(steps - cut):
        optimizer.zero_grad()
        F.mse_loss(resumed(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
    assert fresh.step == steps
    return torch.equal(_flat(straight), _flat(resumed))


@pytest.mark.parametrize(("bits", "warmup_steps"), [(1, 0), (4, 2)])
def test_state_dict_round_trip_resumes_bit_for_bit(workers, bits, warmup_steps):
    assert workers.run(f"{__name__}:_body_state_round_trip", bits=bits, warmup_steps=warmup_steps) == [True, True]


def test_state_dict_round_trip_with_4_ranks(workers4):
    # 3+ ranks: the owners' residuals were saved by the owners of the layout at the cut, and the
    # resumed model's first layout has other owners; they are merged at the first quantized step
    assert workers4.run(f"{__name__}:_body_state_round_trip", bits=1, warmup_steps=0) == [True] * 4


def _body_no_sync(rank, world_size, bits, micro=3, steps=3):
    """Accumulation over ``micro`` batches with no_sync(): one exchange per step."""
    results = []
    for use_bits in (None, 32, bits):
        model = DDP(_mlp(), bucket_cap_mb=SMALL_BUCKETS_MB)
        state = None
        if use_bits is not None:
            state = QuantizedHookState(model, bits=use_bits, warmup_steps=0)
            model.register_comm_hook(state, quantized_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _data(world_size * micro)
        mine_x, mine_y = x[rank::world_size], y[rank::world_size]
        for _ in range(steps):
            optimizer.zero_grad()
            with model.no_sync():
                for m in range(micro - 1):
                    F.mse_loss(model(mine_x[m::micro]), mine_y[m::micro]).backward()
            F.mse_loss(model(mine_x[micro - 1 :: micro]), mine_y[micro - 1 :: micro]).backward()
            optimizer.step()
        if state is not None:
            assert state.step == steps
        results.append(_flat(model))
    default, exact, quantized = results
    assert torch.equal(default, exact)
    assert not torch.equal(default, quantized)
    return quantized.tolist()


def test_no_sync_accumulates_and_exchanges_once_per_step(workers):
    results = workers.run(f"{__name__}:_body_no_sync", bits=2)
    assert results[0] == results[1]


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.unused = nn.Linear(5, 5)  # never in the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _body_ddp_options(rank, world_size, bits, steps=5):
    reference, _ = _train_ddp(rank, world_size, steps, bits=bits)
    static, state = _train_ddp(rank, world_size, steps, bits=bits, static_graph=True)
    assert state.step == steps
    torch.manual_seed(0)
    model = DDP(_WithUnused(), bucket_cap_mb=SMALL_BUCKETS_MB, find_unused_parameters=True)
    model.module.body.load_state_dict(_mlp().state_dict())
    unused_before = _flat(model.module.unused)
    state = QuantizedHookState(model, bits=bits, warmup_steps=0)
    model.register_comm_hook(state, quantized_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
    assert state.step == steps
    assert torch.equal(_flat(model.module.unused), unused_before)
    return torch.equal(_flat(reference), _flat(static)), torch.equal(_flat(reference), _flat(model.module.body))


def test_static_graph_and_find_unused_parameters(workers):
    assert workers.run(f"{__name__}:_body_ddp_options", bits=2) == [(True, True), (True, True)]


def _body_fp16_wrapper(rank, world_size, bits, steps=4, warmup_steps=2):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

    sent = []
    params = []
    for wrap in (False, True):
        model = DDP(_mlp(), bucket_cap_mb=SMALL_BUCKETS_MB)
        state = QuantizedHookState(model, bits=bits, warmup_steps=warmup_steps)
        model.register_comm_hook(state, fp16_compress_wrapper(quantized_hook) if wrap else quantized_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _data(world_size)
        for k in range(steps):
            optimizer.zero_grad()
            F.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
            optimizer.step()
            if k == warmup_steps - 1:
                sent.append(state.traffic.sent)
        params.append(_flat(model))
    assert sent[1] * 2 == sent[0]  # the exact warm-up travels in half precision
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-2)
    return params[1].tolist()


def test_composes_with_torch_fp16_wrapper(workers):
    results = workers.run(f"{__name__}:_body_fp16_wrapper", bits=2)
    assert results[0] == results[1]


def _body_grad_scaler(rank, world_size, bits, bad_step, steps=6):
    """A step with an inf on rank 1 only: skipped on every rank, residuals untouched.

    The run with the bad step equals, bit for bit, the run without it: the residuals come
    back as they were, and are rescaled with GradScaler's halved scale (a power of two).
    """
    finals = []
    for with_bad in (True, False):
        model = DDP(_Probe(), bucket_cap_mb=SMALL_BUCKETS_MB)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1000)
        state = QuantizedHookState(model, bits=bits, warmup_steps=0, grad_scaler=scaler)
        model.register_comm_hook(state, quantized_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = None
        k = 0
        for step in range(steps):
            grads = _grads(k, rank)
            if step == bad_step:
                if not with_bad:
                    continue
                if rank == 1:
                    grads[2][5] = float("inf")
                before = {n: v.clone() for n, v in state.residuals()["residual"].items()}
            else:
                k += 1
            optimizer.zero_grad()
            scaler.scale(model(grads)).backward()
            scaler.step(optimizer)
            scaler.update()
            if step == bad_step:
                after = state.residuals()["residual"]
                assert all(torch.equal(after[n], before[n]) for n in before)
                assert scaler.get_scale() == 2.0**3
        assert state.skipped_steps == (1 if with_bad else 0)
        finals.append(_flat(model))
    assert torch.isfinite(finals[0]).all()
    return torch.equal(finals[0], finals[1])


@pytest.mark.parametrize("bits", [1, 4])
def test_grad_scaler_overflow_on_one_rank_skips_everywhere_residuals_untouched(workers, bits):
    assert workers.run(f"{__name__}:_body_grad_scaler", bits=bits, bad_step=2) == [True, True]


def test_bad_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bits must be 32"):
        QuantizedHookState(model, bits=17, warmup_steps=0)
    with pytest.raises(ValueError, match="total_steps"):
        QuantizedHookState(model, bits=1)
    with pytest.raises(TypeError, match="module"):
        QuantizedHookState("model", bits=1, warmup_steps=0)  # type: ignore[arg-type]
    assert QuantizedHookState(model, bits=1, total_steps=30).warmup_steps == 10
    assert QuantizedHookState(model, bits=4).warmup_steps == 0


def test_hook_optimizer_local_momentum_with_4_ranks(workers4):
    # HookOptimizer (tests/dist/test_hook_optimizer.py) at 4 ranks, here to share this module's 4-rank pool.
    # 3+ ranks: the owners re-quantize their stripes with residuals of their own; the cap is 0.5
    for warmup_steps in (0, 2):
        results = workers4.run(
            "tests.dist.test_hook_optimizer:_body_equals_dpsgd", bits=1, opt="sgd_wd", warmup_steps=warmup_steps
        )
        hooked, reference, plain = (torch.tensor(v) for v in results[0][:3])
        assert results[0][4] == 0.5
        assert all(r[0] == results[0][0] for r in results)
        assert (hooked - plain).abs().max() > 1e-4
        if warmup_steps == 0:
            assert hooked.equal(reference) and all(r[3] == 0.0 for r in results)
        else:
            # the exact warm-up: Gloo's ring all-reduce sums 4 ranks' values in an order that depends on the
            # element's place in its bucket, and DDP's buckets are not DataParallelSGD's (2 ranks: a + b)
            torch.testing.assert_close(hooked, reference, rtol=0, atol=1e-6)
