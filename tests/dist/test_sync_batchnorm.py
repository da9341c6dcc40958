"""SyncBatchNorm on 2 gloo ranks (4 ranks: tests/dist/test_hybrid.py): N workers x b samples equal BatchNorm over the N*b samples.

Every body computes the single-process reference on the whole batch in the same
worker (the pool seeds every rank alike, so all ranks draw the same batch) and
checks this rank's share against it: outputs, input gradients, weight and bias
gradients (summed over ranks, which is what data-parallel averaging of equal
shares applies up to the factor 1/N), and running statistics.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bunsan
from bunsan.comm import all_reduce
from bunsan.nn import SyncBatchNorm, convert_sync_batchnorm

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _reference(shape: tuple[int, ...]) -> nn.Module:
    return nn.BatchNorm1d(shape[1]) if len(shape) <= 3 else nn.BatchNorm2d(shape[1])


def _body_matches_full_batch(
    rank: int,
    world_size: int,
    sizes: list[int],
    shape: tuple[int, ...],
    momentum: float | None,
    device: str = "cpu",
) -> float:
    """Rank r holds sizes[r] samples; two training steps, then eval."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    c = shape[0]
    ref = _reference((1, *shape)).to(dev)
    ref.momentum = momentum
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    ours = SyncBatchNorm(c, momentum=momentum).to(dev)
    ours.load_state_dict(ref.state_dict())
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    worst = 0.0
    for _ in range(2):
        x = (torch.randn(sum(sizes), *shape) * 3 + 2).to(dev)  # same on every rank (same seed)
        w = torch.randn(x.shape).to(dev)  # a loss that weighs every output differently
        xr = x.clone().requires_grad_()
        (ref(xr) * w).sum().backward()
        mine = x[start:stop].clone().requires_grad_()
        out = ours(mine)
        (out * w[start:stop]).sum().backward()  # this rank's share of the summed loss
        with torch.no_grad():
            ref_out = F.batch_norm(x, None, None, ref.weight, ref.bias, True, 0.0, ref.eps)
        torch.testing.assert_close(out, ref_out[start:stop], **TOL)
        torch.testing.assert_close(mine.grad, xr.grad[start:stop], **TOL)
        worst = max(worst, (out - ref_out[start:stop]).abs().max().item() if out.numel() else 0.0)
    for p in (ours.weight, ours.bias):  # each rank holds its share's gradient: sum the shares
        all_reduce(p.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **TOL)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **TOL)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, **TOL)
    torch.testing.assert_close(ours.running_var, ref.running_var, **TOL)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 2
    ours.eval(), ref.eval()
    x = torch.randn(3, *shape).to(dev)  # eval: running statistics, no communication, any batch
    torch.testing.assert_close(ours(x), ref(x), **TOL)
    return worst


@pytest.mark.parametrize(
    ("sizes", "shape", "momentum"),
    [
        ([4, 4], (3, 5, 5), 0.1),  # 2-D input, equal shares
        ([3, 6], (3, 4, 4), 0.1),  # unequal shares
        ([2, 5], (4,), None),  # (N, C) input, cumulative average
        ([4, 3], (2, 6), 0.3),  # (N, C, L) input
        ([0, 6], (3, 2, 2), 0.1),  # one rank without samples still takes part
    ],
)
def test_two_workers_equal_batchnorm_over_both_batches(workers, sizes, shape, momentum):
    workers.run(f"{__name__}:_body_matches_full_batch", sizes=sizes, shape=shape, momentum=momentum)


def _body_running_stats_identical(rank: int, world_size: int) -> list[float]:
    bn = SyncBatchNorm(3)
    for step in range(3):
        torch.manual_seed(100 * rank + step)  # different data on every rank
        bn(torch.randn(2 + rank, 3, 2, 2) * (rank + 1))
    return torch.cat([bn.running_mean, bn.running_var]).tolist()


def test_running_stats_identical_on_every_rank(workers):
    first, second = workers.run(f"{__name__}:_body_running_stats_identical")
    assert first == second  # bit for bit: computed from the same all-reduced sums


def _body_rejects_one_value_per_channel(rank: int, world_size: int) -> str:
    bn = SyncBatchNorm(2)
    bn(torch.randn(2 - rank, 2))  # 2 values per channel in the group: fine
    try:
        bn(torch.randn(1 - rank, 2))  # 1 value in the whole group: every rank must refuse
    except ValueError as e:
        return str(e)
    return "no error"


def test_one_value_per_channel_in_the_group_is_refused_on_every_rank(workers):
    for message in workers.run(f"{__name__}:_body_rejects_one_value_per_channel"):
        assert "more than 1 value per channel" in message


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)
    )


def _body_data_parallel_training(rank: int, world_size: int, steps: int) -> list[float]:
    """convert_sync_batchnorm + distribute(DataParallelSGD) equals one process with the whole batch."""
    reference = _cnn()
    model = convert_sync_batchnorm(_cnn())
    model.load_state_dict(reference.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = bunsan.distribute(model, optimizer, bunsan.DataParallelSGD())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(mine, theirs, **TOL, msg=name)
    return [p.item() for p in model[1].running_var]


def test_data_parallel_training_equals_full_batch(workers):
    first, second = workers.run(f"{__name__}:_body_data_parallel_training", steps=3)
    assert first == second


# -- GPU: NCCL, one process per device ----------------------------------------------


def _nccl_worker(rank: int, world_size: int, store_path: str, target: str, kwargs: dict[str, Any], errors: Any) -> None:
    import importlib
    import traceback

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl",
            store=dist.FileStore(store_path, world_size),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        module, _, name = target.partition(":")
        torch.manual_seed(0)
        getattr(importlib.import_module(module), name)(rank=rank, world_size=world_size, **kwargs)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report it to the parent
        errors.put((rank, traceback.format_exc()))


def run_on_gpus(tmp_path: Any, target: str, world_size: int = 2, **kwargs: Any) -> None:
    """Run body ``target`` on ``world_size`` NCCL ranks, one GPU each (spawned for the test)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_nccl_worker, args=(r, world_size, str(tmp_path / "nccl-store"), target, kwargs, errors))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_two_gpus_equal_batchnorm_over_both_batches(tmp_path):
    run_on_gpus(
        tmp_path, f"{__name__}:_body_matches_full_batch", sizes=[3, 5], shape=(3, 4, 4), momentum=0.1, device="cuda"
    )


def _body_half_precision(rank: int, world_size: int, device: str = "cpu") -> None:
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    bn = SyncBatchNorm(3).to(dev)
    x = (torch.randn(8, 3, 4, 4) * 2 + 100).to(dev)  # same on every rank
    mine = x[rank::world_size].half()
    out = bn(mine)
    assert out.dtype == torch.float16
    expected = F.batch_norm(x.half().float(), None, None, training=True, eps=bn.eps)[rank::world_size]
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=5e-3)


def test_half_input_normalized_in_float32(workers):
    workers.run(f"{__name__}:_body_half_precision")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_half_input(tmp_path):
    run_on_gpus(tmp_path, f"{__name__}:_body_half_precision", device="cuda")
