"""Four gloo ranks: a 2 x 2 hybrid (model parallel x data parallel) run equals one process.

This module owns the repository's 4-rank pool for issue 6, so the other 4-rank
claims of the model-parallel layers (bodies defined next to their 2-rank tests)
run here too: one pool start instead of four.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bunsan
from bunsan.comm import all_reduce
from bunsan.nn import ChannelParallelConv2d
from bunsan.parallel import hybrid_groups

SYNC_BN = "tests.dist.test_sync_batchnorm"
MODEL_PARALLEL = "tests.dist.test_model_parallel"
PIPELINE = "tests.dist.test_pipeline"


def _body_groups(rank: int, world_size: int) -> tuple[float, float, list[int], list[int]]:
    mp_group, dp_group = hybrid_groups(2)
    mp_sum, dp_sum = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    all_reduce(mp_sum, group=mp_group)
    all_reduce(dp_sum, group=dp_group)
    return mp_sum.item(), dp_sum.item(), dist.get_process_group_ranks(mp_group), dist.get_process_group_ranks(dp_group)


def test_hybrid_groups_layout(workers4):
    results = workers4.run(f"{__name__}:_body_groups")
    # model parallel [0, 1] [2, 3]: rank sums 1, 1, 5, 5; data parallel [0, 2] [1, 3]: 2, 4, 2, 4
    assert [r[0] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r[1] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert [r[2] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[3] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, 5, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 6 * 6, 3))


def _body_hybrid_equals_one_process(rank: int, world_size: int, steps: int, compression: str | None) -> list[float]:
    mp_group, dp_group = hybrid_groups(2)
    mp_size = dist.get_world_size(mp_group)
    replica = rank // mp_size  # which data-parallel replica (model-parallel group) this rank is in
    replicas = world_size // mp_size
    reference = _net()  # the pool seeds every rank alike: the same weights everywhere
    model = nn.Sequential(
        ChannelParallelConv2d.from_conv(reference[0], group=mp_group), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 6 * 6, 3)
    )
    model[3].load_state_dict(reference[3].state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # distribute() checks and broadcasts over the data-parallel group only: the
    # channel slices differ inside a model-parallel group, not across replicas.
    model, optimizer = bunsan.distribute(
        model, optimizer, bunsan.DataParallelSGD(compression=compression, group=dp_group)
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        optimizer.zero_grad()
        # Both ranks of a model-parallel group read the same share of the global batch.
        F.cross_entropy(model(x[replica::replicas]), y[replica::replicas]).backward()
        optimizer.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    conv = model[0]
    start, count = conv.channel_start, conv.weight.shape[0]
    mine = [conv.weight, conv.bias, model[3].weight, model[3].bias]
    theirs = [
        reference[0].weight[start : start + count],
        reference[0].bias[start : start + count],
        reference[3].weight,
        reference[3].bias,
    ]
    return [(p - q).abs().max().item() for p, q in zip(mine, theirs)]


def test_two_by_two_hybrid_equals_one_process(workers4):
    for diffs in workers4.run(f"{__name__}:_body_hybrid_equals_one_process", steps=3, compression=None):
        assert max(diffs) <= 1e-5, diffs


def test_two_by_two_hybrid_with_fp16_gradients(workers4):
    # fp16 keeps ~11 significant bits of each averaged gradient.
    for diffs in workers4.run(f"{__name__}:_body_hybrid_equals_one_process", steps=3, compression="fp16"):
        assert max(diffs) <= 1e-3, diffs


# -- the layers at four ranks ---------------------------------------------------------------


def test_sync_batchnorm_four_workers_unequal_shares(workers4):
    workers4.run(f"{SYNC_BN}:_body_matches_full_batch", sizes=[1, 3, 0, 4], shape=(3, 3, 3), momentum=0.1)


def test_channel_parallel_four_workers(workers4):
    # 6 channels over 4 ranks: 2, 2, 1, 1
    sizes = workers4.run(f"{MODEL_PARALLEL}:_body_channel_parallel", out_channels=6, stride=1, padding=1)
    assert sizes[0] == [2, 2, 1, 1]


def test_spatial_cnn_four_workers(workers4):
    params = workers4.run(f"{MODEL_PARALLEL}:_body_spatial_cnn", height=16, steps=1)
    assert all(p == params[0] for p in params)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_four_stages(workers4, schedule):
    losses = workers4.run(f"{PIPELINE}:_body_pipeline_equals_full_batch", schedule=schedule, microbatches=4, steps=1)
    assert losses[:3] == [None, None, None] and losses[3] is not None
