"""Step time of a small CNN: one process vs data, channel and spatial parallelism on 2 workers.

Run::

    bunsan run -np 2 python -m bunsan.bench.model_parallel
    torchrun --nproc-per-node 2 -m bunsan.bench.model_parallel

Every variant trains the same CNN (conv 3x3 - ReLU - max-pool 2 - conv 3x3 - ReLU -
max-pool 2 - linear) on the same *global* batch per step, with plain SGD:

* ``single``: the whole model and the whole batch in one process. Every rank runs
  it at the same time on its own copy, so the other cores are as busy as in the
  parallel variants (one thread per rank); that is the time of one process on a
  machine whose other workers' cores are in use, the fair reference here.
* ``data``: :class:`bunsan.DataParallelSGD`, each rank half the batch.
* ``channel``: both convolutions :class:`bunsan.nn.ChannelParallelConv2d`, each rank
  half the filters, the batch replicated.
* ``spatial``: :func:`bunsan.nn.split_height`, :class:`bunsan.nn.SpatialParallelConv2d`
  and pooling on bands of rows, :func:`bunsan.nn.gather_height` before the linear
  layer, the batch replicated.

Rounds alternate between the variants (single, data, channel, spatial, single, ...)
so that whatever else the machine does slows all of them alike. Each round times
``--steps`` steps after a barrier; a round's time is the slowest rank's. The table
gives the median over rounds, the ratio to ``single`` (speed-up = 1 / ratio) and
the bytes each rank sent per step, counted by bunsan's communication layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import bunsan
from bunsan.bench import write_json
from bunsan.bench._common import Column, format_records
from bunsan.comm import Traffic, all_reduce, barrier
from bunsan.nn import (
    ChannelParallelConv2d,
    SpatialParallelConv2d,
    SpatialParallelMaxPool2d,
    gather_height,
    split_height,
)

__all__ = ["main", "measure"]

VARIANTS = ("single", "data", "channel", "spatial")


class SmallCNN(nn.Module):
    """conv-relu-pool-conv-relu-pool-linear on ``(N, 3, size, size)``."""

    def __init__(self, channels: int, size: int, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.fc = nn.Linear(channels * (size // 4) ** 2, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class ChannelCNN(nn.Module):
    """``SmallCNN`` with both convolutions split by output channels."""

    def __init__(self, twin: SmallCNN, traffic: Traffic) -> None:
        super().__init__()
        self.conv1 = ChannelParallelConv2d.from_conv(twin.conv1, traffic=traffic)
        self.conv2 = ChannelParallelConv2d.from_conv(twin.conv2, traffic=traffic)
        self.fc = twin.fc

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class SpatialCNN(nn.Module):
    """``SmallCNN`` on bands of rows: halo exchange before each convolution."""

    def __init__(self, twin: SmallCNN, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic
        self.conv1 = SpatialParallelConv2d.from_conv(twin.conv1, traffic=traffic)
        self.conv2 = SpatialParallelConv2d.from_conv(twin.conv2, traffic=traffic)
        self.pool = SpatialParallelMaxPool2d(2)
        self.fc = twin.fc

    def forward(self, x: Tensor) -> Tensor:
        height = x.shape[2]
        x = self.pool(F.relu(self.conv1(split_height(x, traffic=self.traffic))))
        x = self.pool(F.relu(self.conv2(x)))
        x = gather_height(x, height=height // 4, traffic=self.traffic)
        return self.fc(x.flatten(1))


def _copy(model: SmallCNN, channels: int, size: int) -> SmallCNN:
    twin = SmallCNN(channels, size)
    twin.load_state_dict(model.state_dict())
    return twin


def measure(batch: int, channels: int, size: int, steps: int, rounds: int) -> list[dict[str, float | str]]:
    """Median step time and bytes per step of every variant. Collective.

    Args:
        batch: Global batch per step (every variant trains on this many samples).
        channels: Channels of both convolutions.
        size: Image height and width; a multiple of 4 x workers.
        steps: Steps per round.
        rounds: Alternating rounds per variant.
    """
    rank, world = bunsan.rank(), bunsan.size()
    if size % (4 * world):
        raise ValueError(f"--size must be a multiple of 4 x workers = {4 * world} (two pools on bands), got {size}")
    if batch % world:
        raise ValueError(f"--batch must be divisible by the {world} workers, got {batch}")
    torch.manual_seed(0)  # the same weights on every rank
    base = SmallCNN(channels, size)
    traffic = {"channel": Traffic(), "spatial": Traffic()}
    models: dict[str, nn.Module] = {
        "single": _copy(base, channels, size),
        "data": _copy(base, channels, size),
        "channel": ChannelCNN(_copy(base, channels, size), traffic["channel"]),
        "spatial": SpatialCNN(_copy(base, channels, size), traffic["spatial"]),
    }
    optimizers: dict[str, torch.optim.Optimizer] = {
        name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()
    }
    models["data"], data_optimizer = bunsan.distribute(models["data"], optimizers["data"], bunsan.DataParallelSGD())
    optimizers["data"] = data_optimizer
    g = torch.Generator().manual_seed(1)  # the same global batches on every rank
    batches = [
        (torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(steps)
    ]

    def run(name: str, count: int) -> float:
        model, optimizer = models[name], optimizers[name]
        barrier()
        start = time.perf_counter()
        for x, y in batches[:count]:
            if name == "data":
                x, y = x[rank::world], y[rank::world]
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        elapsed = torch.tensor([(time.perf_counter() - start) / count])
        all_reduce(elapsed, op="max")  # a step is done when the slowest rank is done
        return elapsed.item()

    for name in VARIANTS:  # warm up: first steps allocate
        run(name, min(3, steps))
    for t in traffic.values():
        t.reset()
    data_traffic = data_optimizer.algorithm.traffic
    data_sent_before = data_traffic.sent
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            times[name].append(run(name, steps))
    measured_steps = rounds * steps
    sent = {
        "single": 0.0,
        "data": (data_traffic.sent - data_sent_before) / measured_steps,
        "channel": traffic["channel"].sent / measured_steps,
        "spatial": traffic["spatial"].sent / measured_steps,
    }
    reference = statistics.median(times["single"])
    return [
        {
            "variant": name,
            "ms_per_step": statistics.median(times[name]) * 1e3,
            "ratio": statistics.median(times[name]) / reference,
            "speedup": reference / statistics.median(times[name]),
            "bytes_sent_per_step": sent[name],
        }
        for name in VARIANTS
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.model_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="global batch per step")
    parser.add_argument("--channels", type=int, default=32, help="channels of both convolutions")
    parser.add_argument("--size", type=int, default=32, help="image height and width")
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per variant")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    args = parser.parse_args(argv)
    bunsan.init()
    results = measure(args.batch, args.channels, args.size, args.steps, args.rounds)
    if bunsan.is_main():
        print(
            f"small CNN 3x{args.size}x{args.size}, {args.channels} channels, global batch {args.batch}, "
            f"{bunsan.size()} workers x {torch.get_num_threads()} thread(s), median of {args.rounds} "
            f"alternating rounds x {args.steps} steps"
        )
        columns: list[Column] = [("variant", "{variant}"), ("ms/step", "{ms_per_step:.2f}"), ("ratio", "{ratio:.2f}")]
        columns += [
            ("speed-up", "{speedup:.2f}"),
            ("KiB sent/step", lambda r: f"{r['bytes_sent_per_step'] / 1024:.1f}"),
        ]
        print(format_records(results, columns))
        if args.json:
            write_json(args.json, {"workers": bunsan.size(), "args": vars(args), "results": results})
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
