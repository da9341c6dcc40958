"""What async SGD's exchange costs each worker in memory: the in-process passes over the model.

Trains ``mlp_10m`` (10.5M parameters, the model of ``tools/predict.py``) with
``AsyncSGD`` (a push and pull after every step) on a fixed synthetic batch and prints, per
rank, the median step and the seconds per push and pull (``sync_s / pushes``: on rank 0 the
in-process exchange with the server, on a remote worker its round trip), then on rank 0 the
time of one float32 copy of the model (what ``measure_codec`` reports as
``copy_s_per_element``, times the parameters) and of the six passes of rank 0's exchange
done alone on the model's own tensors (docs/experiments/plan.md, "The model")::

    OMP_NUM_THREADS=1 bunsan run -np 1 docs/experiments/async_exchange.py
    OMP_NUM_THREADS=1 bunsan run -np 2 docs/experiments/async_exchange.py
    OMP_NUM_THREADS=1 python -m bunsan.bench.netns --network rate=1gbit -np 2 -- \\
        .venv/bin/python docs/experiments/async_exchange.py       # root: a shaped link
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import bunsan
from bunsan import models
from bunsan.algorithms.measure import median_time


def median_ms(fn, repeats: int = 9) -> float:
    fn()  # warm up
    return median_time(fn, repeats) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    bunsan.init()
    torch.manual_seed(0)
    model = models.create("mlp_10m")
    g = torch.Generator().manual_seed(bunsan.rank())
    x, y = torch.randn(32, 1, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3 / bunsan.size())
    model, optimizer = bunsan.distribute(model, optimizer, "async")
    algorithm = optimizer.algorithm

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    sync_s, pushes = algorithm.sync_s, algorithm.pushes
    times = []
    for _ in range(16):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    exchange_ms = (algorithm.sync_s - sync_s) / (algorithm.pushes - pushes) * 1e3
    print(
        f"rank {bunsan.rank()} of {bunsan.size()}: step {statistics.median(times) * 1e3:.1f} ms, "
        f"push and pull {exchange_ms:.1f} ms",
        flush=True,
    )
    optimizer.join()
    if bunsan.rank() == 0:
        params = [p.detach() for p in model.parameters()]
        numel = sum(p.numel() for p in params)
        flat, base, server = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)

        def pack() -> None:
            offset = 0
            for p in params:
                flat[offset : offset + p.numel()].copy_(p.reshape(-1))
                offset += p.numel()

        def unpack() -> None:
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

        passes = {
            "pack": pack,
            "subtract the base": lambda: flat.sub_(base),
            "server adds": lambda: server.add_(flat),
            "server copies into the reply": lambda: flat.copy_(server),
            "unpack": unpack,
            "copy into the base": lambda: base.copy_(flat),
        }
        timed = {name: median_ms(fn) for name, fn in passes.items()}
        print(
            f"rank 0 alone, {numel:,} parameters: one float32 copy {median_ms(lambda: base.copy_(server)):.2f} ms; "
            f"the 6 passes {sum(timed.values()):.1f} ms ("
            + ", ".join(f"{name} {ms:.2f}" for name, ms in timed.items())
            + ")",
            flush=True,
        )
    bunsan.finalize()


if __name__ == "__main__":
    main()
