"""Step time of DataParallelSGD against raw torch DistributedDataParallel.

Run on 2 workers::

    bunsan run -np 2 python -m bunsan.bench.ddp_overhead
    torchrun --nproc-per-node 2 -m bunsan.bench.ddp_overhead

Both trainers live in the same processes, start from the same weights and take
the same batches. Rounds alternate between them (DDP, bunsan, DDP, bunsan, ...)
so that whatever else the machine is doing slows both alike; each round times
``--steps`` steps, and the ratio of the medians over rounds is printed for each
model. The ratio is the claim; absolute times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import bunsan
from bunsan.bench import write_json

__all__ = ["main", "measure"]


def _models() -> dict[str, Callable[[], tuple[nn.Module, tuple[int, ...], int]]]:
    from bunsan.models import DigitsCNN

    return {
        "digits-cnn": lambda: (DigitsCNN(), (1, 8, 8), 10),
        "mlp-1m": lambda: (nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256),
                                         nn.ReLU(), nn.Linear(256, 10)), (1, 28, 28), 10),
    }


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - start) / len(batches)


def measure(name: str, batch: int, steps: int, rounds: int) -> dict[str, float]:
    """Median step time of DDP and of bunsan's DataParallelSGD on model ``name``. Collective."""
    build = _models()[name]
    torch.manual_seed(0)
    ddp_model, shape, classes = build()
    ours, _, _ = build()
    ours.load_state_dict(ddp_model.state_dict())
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    ours, our_opt = bunsan.distribute(ours, torch.optim.SGD(ours.parameters(), lr=0.01, momentum=0.9))
    g = torch.Generator().manual_seed(bunsan.rank())
    batches = [(torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(steps)]
    _train_steps(ddp, ddp_opt, batches[:3])  # warm up both: first steps allocate
    _train_steps(ours, our_opt, batches[:3])
    ddp_times, our_times = [], []
    for _ in range(rounds):
        ddp_times.append(_train_steps(ddp, ddp_opt, batches))
        our_times.append(_train_steps(ours, our_opt, batches))
    ddp_ms, our_ms = statistics.median(ddp_times) * 1e3, statistics.median(our_times) * 1e3
    return {"model": name, "batch": batch, "ddp_ms": ddp_ms, "bunsan_ms": our_ms, "ratio": our_ms / ddp_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.ddp_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits-cnn,mlp-1m", help="comma-separated: " + ",".join(_models()))
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch")
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per trainer")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    args = parser.parse_args(argv)
    bunsan.init()
    results = [measure(m, args.batch, args.steps, args.rounds) for m in args.models.split(",")]
    if bunsan.is_main():
        print(f"DataParallelSGD vs DistributedDataParallel, {bunsan.size()} workers, {torch.get_num_threads()} thread(s) each, "
              f"median of {args.rounds} alternating rounds x {args.steps} steps")
        print(f"{'model':<12} {'batch':>5} {'DDP ms/step':>12} {'bunsan ms/step':>15} {'ratio':>7}")
        for r in results:
            print(f"{r['model']:<12} {r['batch']:>5} {r['ddp_ms']:>12.3f} {r['bunsan_ms']:>15.3f} {r['ratio']:>7.3f}")
        if args.json:
            write_json(args.json, {"workers": bunsan.size(), "results": results})
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
