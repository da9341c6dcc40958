"""Channel- and spatial-parallel layers on gloo ranks equal their single-process twins.

Each body builds the single-process twin in the same worker (every rank draws the
same weights and data: the pool seeds each body alike), runs the split layer, and
compares outputs, input gradients and parameter gradients (max abs diff <= 1e-5).
The objective is replicated: every rank computes the same loss from the gathered
output, so every rank's gradients must equal the twin's without further averaging.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bunsan.comm import Traffic
from bunsan.comm.autograd import halo_exchange, split_sizes
from bunsan.nn import (
    ChannelParallelConv2d,
    SpatialParallelAvgPool2d,
    SpatialParallelConv2d,
    SpatialParallelMaxPool2d,
    gather_height,
    split_height,
)

TOL = {"rtol": 0.0, "atol": 1e-5}


def _device(rank: int, device: str) -> torch.device:
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def _body_channel_parallel(
    rank: int, world_size: int, out_channels: int, stride: int, padding: int, device: str = "cpu"
) -> list[int]:
    dev = _device(rank, device)
    pre = nn.Conv2d(2, 3, 3, padding=1).to(dev)  # a replicated layer before: its gradient needs the all-reduce
    conv = nn.Conv2d(3, out_channels, 3, stride=stride, padding=padding).to(dev)
    layer = ChannelParallelConv2d.from_conv(conv)
    pre_twin = nn.Conv2d(2, 3, 3, padding=1).to(dev)
    pre_twin.load_state_dict(pre.state_dict())
    x = torch.randn(2, 2, 7, 6).to(dev).requires_grad_()
    x_twin = x.detach().clone().requires_grad_()
    y = layer(pre(x))
    y_twin = conv(pre_twin(x_twin))
    torch.testing.assert_close(y, y_twin, **TOL)
    r = torch.randn(y.shape).to(dev)  # same on every rank: the same loss everywhere
    (y * r).sum().backward()
    (y_twin * r).sum().backward()
    torch.testing.assert_close(x.grad, x_twin.grad, **TOL)
    for p, q in zip(pre.parameters(), pre_twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    start, count = layer.channel_start, layer.channel_sizes[rank]
    torch.testing.assert_close(layer.weight.grad, conv.weight.grad[start : start + count], **TOL)
    torch.testing.assert_close(layer.bias.grad, conv.bias.grad[start : start + count], **TOL)
    return layer.channel_sizes


@pytest.mark.parametrize(("out_channels", "stride", "padding"), [(4, 1, 1), (5, 2, 0)])
def test_channel_parallel_conv_equals_conv(workers, out_channels, stride, padding):
    sizes = workers.run(f"{__name__}:_body_channel_parallel", out_channels=out_channels, stride=stride, padding=padding)
    assert sizes[0] == split_sizes(out_channels, 2)


def _body_channel_parallel_init(rank: int, world_size: int) -> None:
    torch.manual_seed(3)
    conv = nn.Conv2d(2, 6, 3)
    torch.manual_seed(3)
    layer = ChannelParallelConv2d(2, 6, 3)  # same seed: the slices of the same initialization
    x = torch.randn(1, 2, 5, 5)
    torch.testing.assert_close(layer(x), conv(x), **TOL)


def test_channel_parallel_init_is_a_slice_of_conv_init(workers):
    workers.run(f"{__name__}:_body_channel_parallel_init")


def _body_channel_parallel_traffic(rank: int, world_size: int) -> tuple[int, int]:
    traffic = Traffic()
    layer = ChannelParallelConv2d(3, 4, 1, traffic=traffic)
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    layer(x).sum().backward()
    return traffic.sent, traffic.calls


def test_channel_parallel_traffic(workers):
    # Forward all-gather: each rank sends its 2 x 2x5x5 float32 output slice to the other
    # (400 bytes). Backward all-reduce of dL/dx (2x3x5x5 float32 = 600 bytes): a 2-rank ring
    # sends 2 (n-1)/n x 600 = 600 bytes.
    for sent, calls in workers.run(f"{__name__}:_body_channel_parallel_traffic"):
        assert (sent, calls) == (400 + 600, 2)


def _body_halo_exchange(rank: int, world_size: int) -> None:
    # Rank r's band holds values 10 r + row; the halos are the neighbours' border rows.
    band = (10.0 * rank + torch.arange(3.0)).view(1, 3, 1).expand(2, 3, 2).clone().requires_grad_()
    out = halo_exchange(band, 1, 1)
    top = 10.0 * (rank - 1) + 2 if rank > 0 else 0.0
    bottom = 10.0 * (rank + 1) if rank < world_size - 1 else 0.0
    assert out[:, 0].eq(top).all() and out[:, -1].eq(bottom).all()
    torch.testing.assert_close(out[:, 1:-1], band)
    # Backward: a weight of 1 on every output element. My border rows were also my
    # neighbours' halos, so their gradient is 2 where a neighbour exists.
    out.sum().backward()
    expected = torch.ones(2, 3, 2)
    if rank > 0:
        expected[:, 0] += 1
    if rank < world_size - 1:
        expected[:, -1] += 1
    torch.testing.assert_close(band.grad, expected)


def test_halo_exchange_by_hand(workers):
    workers.run(f"{__name__}:_body_halo_exchange")


def _body_spatial_conv(
    rank: int, world_size: int, height: int, kernel_size: int, dilation: int, device: str = "cpu"
) -> int:
    dev = _device(rank, device)
    conv = nn.Conv2d(2, 3, kernel_size, padding="same", dilation=dilation).to(dev)
    layer = SpatialParallelConv2d.from_conv(conv)
    x = torch.randn(2, 2, height, 5).to(dev).requires_grad_()
    x_twin = x.detach().clone().requires_grad_()
    band = layer(split_height(x))
    y = gather_height(band)  # heights exchanged: unequal bands
    y_twin = conv(x_twin)
    torch.testing.assert_close(y, y_twin, **TOL)
    r = torch.randn(y.shape).to(dev)
    (y * r).sum().backward()
    (y_twin * r).sum().backward()
    torch.testing.assert_close(x.grad, x_twin.grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, conv.weight.grad, **TOL)
    torch.testing.assert_close(layer.bias.grad, conv.bias.grad, **TOL)
    return band.shape[2]


@pytest.mark.parametrize(("height", "kernel_size", "dilation"), [(8, 3, 1), (7, 3, 1), (8, 5, 1), (6, 3, 2)])
def test_spatial_parallel_conv_equals_conv(workers, height, kernel_size, dilation):
    rows = workers.run(f"{__name__}:_body_spatial_conv", height=height, kernel_size=kernel_size, dilation=dilation)
    assert rows == split_sizes(height, 2)


class _TwinCNN(nn.Module):
    """conv-relu-pool-conv-relu-linear, the single-process twin."""

    def __init__(self, height: int, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * (height // 2) * (width // 2), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return self.fc(F.relu(self.conv2(x)).flatten(1))


class _SpatialCNN(nn.Module):
    """The same network with the image split by rows across the world."""

    def __init__(self, twin: _TwinCNN, pool: type[nn.Module]) -> None:
        super().__init__()
        self.conv1 = SpatialParallelConv2d.from_conv(twin.conv1)
        self.pool = pool(2)
        self.conv2 = SpatialParallelConv2d.from_conv(twin.conv2)
        self.fc = nn.Linear(twin.fc.in_features, twin.fc.out_features)
        self.fc.load_state_dict(twin.fc.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height = x.shape[2]
        x = self.pool(F.relu(self.conv1(split_height(x))))
        x = gather_height(F.relu(self.conv2(x)), height=height // 2)
        return self.fc(x.flatten(1))


def _body_spatial_cnn(rank: int, world_size: int, height: int, steps: int) -> list[float]:
    twin = _TwinCNN(height, 6)
    model = _SpatialCNN(twin, SpatialParallelMaxPool2d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x, y = torch.randn(4, 1, height, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        twin_opt.zero_grad()
        out, out_twin = model(x), twin(x)
        torch.testing.assert_close(out, out_twin, **TOL)
        F.cross_entropy(out, y).backward()
        F.cross_entropy(out_twin, y).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
        opt.step()
        twin_opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def test_spatial_cnn_equals_twin_and_replicas_stay_equal(workers):
    first, second = workers.run(f"{__name__}:_body_spatial_cnn", height=8, steps=2)
    assert first == second


def _body_spatial_avg_pool(rank: int, world_size: int) -> None:
    x = torch.randn(2, 3, 4 * world_size, 5, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    y = gather_height(SpatialParallelAvgPool2d(2)(split_height(x)))
    y_twin = F.avg_pool2d(x_twin, 2)
    torch.testing.assert_close(y, y_twin, **TOL)
    y.sum().backward()
    y_twin.sum().backward()
    torch.testing.assert_close(x.grad, x_twin.grad, **TOL)


def test_spatial_avg_pool_equals_pool(workers):
    workers.run(f"{__name__}:_body_spatial_avg_pool")


def _body_odd_band_refused(rank: int, world_size: int) -> str:
    band = split_height(torch.randn(1, 1, 6, 4))  # 3 rows per rank
    try:
        SpatialParallelMaxPool2d(2)(band)
    except ValueError as e:
        return str(e)
    return "no error"


def test_pool_over_odd_bands_is_refused(workers):
    for message in workers.run(f"{__name__}:_body_odd_band_refused"):
        assert "even number of rows in every band, this band has 3" in message


def _body_spatial_traffic(rank: int, world_size: int) -> int:
    traffic = Traffic()
    layer = SpatialParallelConv2d(2, 2, 3, traffic=traffic)
    band = torch.randn(1, 2, 4, 5, requires_grad=True)
    layer(band).sum().backward()
    return traffic.sent


def test_spatial_traffic_is_one_border_row(workers):
    # Forward: one row of (1, 2, ., 5) float32 to the one neighbour = 40 bytes; backward: its
    # gradient back (40) and the weight and bias gradient all-reduces ((36 + 2) x 4 = 152 bytes).
    for sent in workers.run(f"{__name__}:_body_spatial_traffic"):
        assert sent == 40 + 40 + 152


# -- GPU: NCCL, one process per device ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_channel_parallel(tmp_path):
    from tests.dist.test_sync_batchnorm import run_on_gpus

    run_on_gpus(tmp_path, f"{__name__}:_body_channel_parallel", out_channels=5, stride=1, padding=1, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_spatial_parallel(tmp_path):
    from tests.dist.test_sync_batchnorm import run_on_gpus

    run_on_gpus(tmp_path, f"{__name__}:_body_spatial_conv", height=7, kernel_size=3, dilation=1, device="cuda")
