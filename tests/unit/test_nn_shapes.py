"""Single-process checks of bunsan.nn, bunsan.parallel and the differentiable comm helpers.

A world of one rank (no process group, or a one-rank Gloo group) where every
collective is the identity: shapes, argument checks, the pure math, and equality
with the plain torch layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bunsan.comm.autograd import gather_from_group, halo_exchange, scatter_to_group, split_sizes
from bunsan.comm.groups import new_groups, rank_grid
from bunsan.nn import (
    ChannelParallelConv2d,
    SpatialParallelAvgPool2d,
    SpatialParallelConv2d,
    SpatialParallelMaxPool2d,
    SyncBatchNorm,
    convert_sync_batchnorm,
    gather_height,
    split_height,
)
from bunsan.nn.sync_batchnorm import global_moments, local_moments
from bunsan.parallel import hybrid_groups, pipeline

# -- pure helpers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "parts", "expected"),
    [(10, 4, [3, 3, 2, 2]), (8, 2, [4, 4]), (5, 5, [1, 1, 1, 1, 1]), (3, 4, [1, 1, 1, 0]), (0, 2, [0, 0])],
)
def test_split_sizes(total, parts, expected):
    assert split_sizes(total, parts) == expected


def test_split_sizes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="parts"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="total"):
        split_sizes(-1, 2)


def test_rank_grid():
    assert rank_grid(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert rank_grid(6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    assert rank_grid(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert rank_grid(4, 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"does not divide the world size 4; choose one of \[1, 2, 4\]"):
        rank_grid(4, 3)
    with pytest.raises(ValueError, match="group_size"):
        rank_grid(4, 0)
    with pytest.raises(TypeError, match="group_size must be an int"):
        rank_grid(4, 2.0)


def test_groups_without_process_group_are_the_world():
    assert new_groups(1) == (None, None)
    assert tuple(hybrid_groups(1)) == (None, None)


@pytest.mark.parametrize("sizes", [[5, 7], [1, 11], [0, 12], [4, 4, 4], [3, 0, 9]])
def test_moments_of_parts_combine_to_the_whole(sizes):
    x = torch.randn(12, 3, 5) * 2 + 50  # a large mean: the naive formula would lose digits
    parts = x.split(sizes)
    mean, var, count = global_moments(sum(local_moments(p) for p in parts), 3)
    x64 = x.double()
    assert count.item() == 60
    torch.testing.assert_close(mean, x64.mean((0, 2)), rtol=2e-7, atol=0)  # float32 local means
    torch.testing.assert_close(var, x64.var((0, 2), unbiased=False), rtol=1e-6, atol=1e-7)


# -- SyncBatchNorm without a process group equals BatchNorm -----------------------------


@pytest.mark.parametrize(
    ("shape", "reference"), [((6, 3), nn.BatchNorm1d), ((6, 3, 5), nn.BatchNorm1d), ((4, 3, 5, 5), nn.BatchNorm2d)]
)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batchnorm_alone_equals_batchnorm(shape, reference, momentum):
    ours, ref = SyncBatchNorm(3, momentum=momentum), reference(3, momentum=momentum)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    ours.load_state_dict(ref.state_dict())
    for _ in range(2):  # two steps: running statistics with momentum or cumulative
        x = torch.randn(shape, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        w = torch.randn(shape)
        (ours(x) * w).sum().backward()
        (ref(xr) * w).sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)
    ours.eval(), ref.eval()
    x = torch.randn(shape)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)


def test_sync_batchnorm_without_affine_or_running_stats():
    ours, ref = (
        SyncBatchNorm(4, affine=False, track_running_stats=False),
        nn.BatchNorm2d(4, affine=False, track_running_stats=False),
    )
    assert ours.weight is None and ours.running_mean is None
    x = torch.randn(3, 4, 2, 2)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)
    ours.eval(), ref.eval()  # eval without running statistics: this batch's statistics
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)


def test_sync_batchnorm_half_input_is_normalized_in_float32():
    bn = SyncBatchNorm(2)
    x = (torch.randn(8, 2, 3) * 3 + 100).half()
    y = bn(x)
    assert y.dtype == torch.float16
    expected = F.batch_norm(x.float(), None, None, training=True, eps=bn.eps)
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=2e-3)  # float16 rounding of the output only
    assert bn.running_mean.dtype == torch.float32


def test_sync_batchnorm_rejects_bad_input():
    with pytest.raises(ValueError, match="num_features"):
        SyncBatchNorm(0)
    with pytest.raises(ValueError, match="momentum"):
        SyncBatchNorm(3, momentum=1.5)
    with pytest.raises(TypeError, match="num_features must be an int"):
        SyncBatchNorm(3.0)
    bn = SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"num_features=3 channels but the input has 4"):
        bn(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"\(N, C, \.\.\.\)"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.randn(1, 3))


def test_convert_sync_batchnorm_keeps_parameters_and_statistics():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(8)))
    model(torch.randn(4, 1, 4, 4))  # move the running statistics away from their defaults
    model.eval()
    bn_weight, bn_mean = model[1].weight, model[1].running_mean.clone()
    converted = convert_sync_batchnorm(model)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][1], SyncBatchNorm)
    assert model[1].weight is bn_weight  # the optimizer's parameter objects stay valid
    torch.testing.assert_close(model[1].running_mean, bn_mean)
    assert not model[1].training
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm1d(3)), SyncBatchNorm)


# -- model-parallel layers in a world of one -----------------------------------------


def test_channel_parallel_conv_alone_equals_conv():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1)
    torch.manual_seed(0)
    ours = ChannelParallelConv2d(3, 5, 3, stride=2, padding=1)  # same seed: same initialization
    torch.testing.assert_close(ours.weight, conv.weight)
    x = torch.randn(2, 3, 7, 7)
    torch.testing.assert_close(ours(x), conv(x))
    assert ChannelParallelConv2d.from_conv(conv)(x).shape == (2, 5, 4, 4)
    assert ours.channel_sizes == [5]


def test_channel_parallel_conv_rejects_unsupported():
    with pytest.raises(ValueError, match="groups=1 only"):
        ChannelParallelConv2d(4, 4, 3, groups=2)
    with pytest.raises(ValueError, match="padding_mode='zeros' only"):
        ChannelParallelConv2d(4, 4, 3, padding_mode="reflect")
    with pytest.raises(TypeError, match=r"nn\.Conv2d"):
        ChannelParallelConv2d.from_conv(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"expects \(N, 4, H, W\)"):
        ChannelParallelConv2d(4, 4, 3)(torch.randn(1, 3, 5, 5))


@pytest.mark.parametrize(("kernel_size", "dilation"), [(3, 1), (5, 1), (3, 2), ((3, 5), 1)])
def test_spatial_parallel_conv_alone_equals_same_conv(kernel_size, dilation):
    conv = nn.Conv2d(2, 3, kernel_size, padding="same", dilation=dilation)
    ours = SpatialParallelConv2d.from_conv(conv)
    x = torch.randn(2, 2, 6, 5)
    torch.testing.assert_close(ours(x), conv(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kernel_size": 3, "stride": 2}, "stride=1 only"),
        ({"kernel_size": 2}, "odd kernel_size"),
        ({"kernel_size": 3, "padding": 0}, "'same' padding only"),
        ({"kernel_size": 3, "padding_mode": "circular"}, "padding_mode='zeros' only"),
    ],
)
def test_spatial_parallel_conv_rejects_unsupported(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpatialParallelConv2d(2, 2, **kwargs)


def test_spatial_pools_need_even_bands():
    x = torch.randn(1, 2, 4, 6)
    torch.testing.assert_close(SpatialParallelMaxPool2d(2)(x), F.max_pool2d(x, 2))
    torch.testing.assert_close(SpatialParallelAvgPool2d(2, 2)(x), F.avg_pool2d(x, 2))
    with pytest.raises(ValueError, match="even number of rows in every band, this band has 3"):
        SpatialParallelMaxPool2d()(torch.randn(1, 2, 3, 6))
    with pytest.raises(ValueError, match="kernel_size=2 and stride=2"):
        SpatialParallelAvgPool2d(3)


def test_split_and_gather_alone_are_identity():
    x = torch.randn(2, 3, 5, 4)
    assert split_height(x) is x
    assert gather_height(x) is x
    assert gather_height(x, height=5) is x
    with pytest.raises(ValueError, match=r"expects \(N, C, H, W\), got shape \(3, 4\)"):
        split_height(torch.randn(3, 4))


def test_comm_helpers_alone():
    x = torch.randn(2, 3, 4)
    assert scatter_to_group(x, 1, [3]) is x
    assert gather_from_group(x, -1, [4]) is x
    with pytest.raises(ValueError, match="one size per rank"):
        gather_from_group(x, 1, [1, 2])
    with pytest.raises(ValueError, match="sum of sizes"):
        scatter_to_group(x, 1, [2])
    padded = halo_exchange(x, 1, 2)
    assert padded.shape == (2, 7, 4)
    assert padded[:, :2].abs().sum() == 0 and padded[:, -2:].abs().sum() == 0
    with pytest.raises(ValueError, match="fewer than the halo of 4"):
        halo_exchange(x, 1, 4)


# -- pipeline in a world of one ------------------------------------------------------


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_alone_equals_full_batch(schedule):
    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    pipe = pipeline([model], microbatches=4, schedule=schedule)
    loss = pipe.step(x, y, F.cross_entropy)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_pipeline_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stages has 2 modules but the group has 1 ranks"):
        pipeline([_mlp(), _mlp()], microbatches=2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline([_mlp()], microbatches=2, schedule="zero-bubble")
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        pipeline([_mlp()], microbatches=0)
    with pytest.raises(TypeError, match="microbatches must be an int >= 1"):
        pipeline([_mlp()], microbatches=2.0)
    pipe = pipeline([_mlp()], microbatches=3)
    with pytest.raises(ValueError, match="no loss function"):
        pipe.step(torch.randn(6, 4), torch.randint(0, 3, (6,)))
    with pytest.raises(ValueError, match="not divisible into microbatches=3"):
        pipe.step(torch.randn(4, 4), torch.randint(0, 3, (4,)), F.cross_entropy)


def test_one_rank_gloo_group(tmp_path):
    """The torch.distributed code paths in a one-rank Gloo world: pipelining, groups, SyncBatchNorm."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    mp_group, dp_group = hybrid_groups(1)
    assert dist.get_world_size(mp_group) == 1 and dist.get_world_size(dp_group) == 1
    # The groups are the named dimensions of a torch DeviceMesh: a dimension spanning the whole
    # world is the default group itself under the pinned torch 2.13, a new group of the same
    # ranks under 2.11 (the H200 machine's; docs/experiments/plan.md). bunsan relies on the ranks only.
    assert dist.get_process_group_ranks(dp_group) == [0] and dist.get_process_group_ranks(mp_group) == [0]
    if torch.__version__.startswith("2.13"):
        assert dp_group is dist.group.WORLD
    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    loss = pipeline([model], microbatches=3, schedule="1f1b", group=mp_group).step(x, y, F.cross_entropy)
    F.cross_entropy(ref(x), y).backward()
    assert loss is not None
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    bn, ref_bn = SyncBatchNorm(3, group=dp_group), nn.BatchNorm1d(3)
    x = torch.randn(5, 3)
    torch.testing.assert_close(bn(x), ref_bn(x), rtol=1e-5, atol=1e-6)
