"""DataParallelSGD on 2 gloo ranks: equivalence with single-process large-batch SGD."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bunsan
from bunsan.errors import ModelMismatchError


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def _data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, 1, 6, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)
    ]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _body_equivalence(rank, world_size, steps, batch, compression, bucket_size_mb):
    """world_size workers x batch B equal one process x batch world_size*B."""
    torch.manual_seed(rank)  # different initial weights per rank: distribute() must broadcast rank 0's
    model = _net()
    torch.manual_seed(0)
    reference = _net()
    if rank == 0:
        model.load_state_dict(reference.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = bunsan.distribute(
        model, optimizer, bunsan.DataParallelSGD(compression=compression, bucket_size_mb=bucket_size_mb)
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in _data(steps, batch * world_size):
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    stats = optimizer.algorithm.stats()
    return (_flat(model) - _flat(reference)).abs().max().item(), _flat(model).tolist(), stats


@pytest.mark.parametrize("bucket_size_mb", [25.0, 0.0005])  # one bucket; a bucket per parameter
def test_two_workers_equal_one_process_with_double_batch(workers, bucket_size_mb):
    results = workers.run(
        f"{__name__}:_body_equivalence", steps=6, batch=4, compression=None, bucket_size_mb=bucket_size_mb
    )
    for diff, _, _ in results:
        assert diff <= 1e-5
    assert results[0][1] == results[1][1]  # replicas bit-identical


def test_fp16_compression_close_to_exact(workers):
    # fp16 keeps ~11 significant bits: after 6 momentum steps at lr 0.1 the
    # parameters stay within 1e-3 of exact SGD (measured: ~1e-4).
    results = workers.run(f"{__name__}:_body_equivalence", steps=6, batch=4, compression="fp16", bucket_size_mb=25.0)
    for diff, _, _ in results:
        assert diff <= 1e-3
    assert results[0][1] == results[1][1]


def test_stats_count_bytes_and_samples(workers):
    n_params = sum(p.numel() for p in _net().parameters())
    n_tensors = len(list(_net().parameters()))
    # A ring all-reduce over 2 ranks sends the message once. The metadata (samples, active
    # ranks, one gradient flag per parameter tensor) rides as float32 slots in an
    # uncompressed bucket, else as float64 values of its own.
    meta = 2 + n_tensors
    for compression, per_step in ((None, (n_params + meta) * 4), ("fp16", n_params * 2 + meta * 8)):
        results = workers.run(
            f"{__name__}:_body_equivalence", steps=5, batch=4, compression=compression, bucket_size_mb=25.0
        )
        for _, _, stats in results:
            assert stats["bytes_sent_per_step"] == per_step
            assert stats["samples"] == 5 * 8 and stats["local_samples"] == 5 * 4
            assert stats["bytes_sent_per_sample"] == pytest.approx(per_step / 4)


def _body_mismatch(rank, world_size, kind):
    model = _net()
    if rank == 1 and kind == "extra":
        model.add_module("extra", nn.Linear(2, 2))
    if rank == 1 and kind == "shape":
        model[3] = nn.Linear(4 * 6 * 6, 17)
    try:
        bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ModelMismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    ("kind", "words"), [("extra", ["rank 1", "extra.weight"]), ("shape", ["rank 1", "3.weight", "17"])]
)
def test_model_mismatch_named_on_every_rank(workers, kind, words):
    messages = workers.run(f"{__name__}:_body_mismatch", kind=kind)
    assert messages[0] is not None and messages[0] == messages[1]
    for word in words:
        assert word in messages[0]


def _body_no_sync_accumulation(rank, world_size):
    """Two micro-batches, the first inside no_sync(), equal one batch of both."""
    model = _net()
    reference = _net()
    reference.load_state_dict(model.state_dict())
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in _data(3, 8 * world_size):
        xs, ys = x[rank::world_size], y[rank::world_size]
        optimizer.zero_grad()
        with optimizer.no_sync():
            (F.cross_entropy(model(xs[:4]), ys[:4], reduction="sum") / 8).backward()
        (F.cross_entropy(model(xs[4:]), ys[4:], reduction="sum") / 8).backward()
        optimizer.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    return (_flat(model) - _flat(reference)).abs().max().item()


def test_no_sync_accumulation_equals_large_batch(workers):
    assert max(workers.run(f"{__name__}:_body_no_sync_accumulation")) <= 1e-5


def _body_uneven_join(rank, world_size):
    """Rank 1 has 2 batches fewer: it joins, and rank 0's last steps average over itself only."""
    model = _net()
    reference = _net()
    reference.load_state_dict(model.state_dict())
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = _data(5, 8)
    mine = data if rank == 0 else data[:3]
    for x, y in mine:
        optimizer.zero_grad()
        F.cross_entropy(model(x[:4] if rank == 0 else x[4:]), y[:4] if rank == 0 else y[4:]).backward()
        optimizer.step()
    optimizer.join()
    for i, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        if i < 3:
            F.cross_entropy(reference(x), y).backward()  # both halves: the mean of the two ranks
        else:
            F.cross_entropy(reference(x[:4]), y[:4]).backward()  # rank 0 alone
        ref_opt.step()
    return (
        (_flat(model) - _flat(reference)).abs().max().item(),
        optimizer.algorithm.stats()["steps"],
        _flat(model).tolist(),
    )


def test_uneven_data_join_does_not_hang_and_averages_active_ranks(workers):
    (diff0, steps0, params0), (diff1, steps1, params1) = workers.run(f"{__name__}:_body_uneven_join")
    assert diff0 <= 1e-5 and diff1 <= 1e-5  # rank 1 ends with rank 0's model, which trained longest
    assert (steps0, steps1) == (5, 3)
    assert params0 == params1


def _body_lr_scheduler(rank, world_size):
    model = _net()
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for x, y in _data(2, 4):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


def test_lr_scheduler_accepts_distributed_optimizer(workers):
    assert workers.run(f"{__name__}:_body_lr_scheduler") == [0.025, 0.025]
