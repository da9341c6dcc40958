"""Step time of DataParallelSGD against raw torch DistributedDataParallel.

Run on 2 workers::

    bunsan run -np 2 python -m bunsan.bench.ddp_overhead
    torchrun --nproc-per-node 2 -m bunsan.bench.ddp_overhead
    bunsan run -np 2 python -m bunsan.bench.ddp_overhead --models many-small --profile 20   # where the time goes

Both trainers live in the same processes, start from the same weights and take
the same batches. They alternate step by step, and the one that goes first
alternates too (DDP, bunsan, then bunsan, DDP, ...), so that whatever else the
machine is doing slows both alike (alternating whole rounds of steps lets a
burst of load fall on one trainer only: per-round ratios of 0.81-1.35 on the
digits CNN in one run on this shared 2-core machine); a round times ``--steps``
steps of each. Printed
per model: the median step time of each, ``ratio`` = the median over rounds of
the paired ratio bunsan/DDP (with its minimum and maximum), and the largest
difference between the two models' parameters at the end (0 when both did the
same arithmetic), and rank 0's minor page faults per step of each (memory the
allocator took afresh from the kernel: :mod:`bunsan._allocator`). The ratio is the claim; absolute times depend on the
machine's load.

Models: two small ones (``digits-cnn``, ``mlp-1m``), ResNet-20 for CIFAR
(272,474 parameters in 65 tensors, BatchNorm) and ``many-small``: 100 linear
layers of 32x32, 200 parameter tensors of 4 KB or less, where per-tensor
overheads (hooks, copies into buckets) dominate the step.

``--profile N`` then runs N steps of each trainer under cProfile on rank 0 and
prints the functions with the most own time: what makes one slower.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import bunsan
from bunsan._validate import check_int
from bunsan.bench import write_json
from bunsan.bench._common import format_records
from bunsan.bench.synthetic import time_steps

__all__ = ["ModelCase", "cases", "main", "measure", "profile"]


@dataclass(frozen=True)
class ModelCase:
    """A model of the benchmark: how to build it, its input shape, classes and default batch and steps."""

    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    classes: int
    batch: int
    steps: int


def _many_small(layers: int = 100, width: int = 32) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers - 1):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def cases() -> dict[str, ModelCase]:
    from bunsan.models import DigitsCNN, ResNet20

    def mlp() -> nn.Module:
        return nn.Sequential(
            nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)
        )

    return {
        "digits-cnn": ModelCase(DigitsCNN, (1, 8, 8), 10, 64, 20),
        "mlp-1m": ModelCase(mlp, (1, 28, 28), 10, 64, 20),
        "resnet20": ModelCase(ResNet20, (3, 32, 32), 10, 32, 5),
        "many-small": ModelCase(_many_small, (32,), 10, 64, 20),
    }


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _pair(
    name: str, batch: int | None, steps: int | None
) -> tuple[
    nn.parallel.DistributedDataParallel, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer, Batches, ModelCase
]:
    case = cases()[name]
    batch = batch or case.batch
    steps = steps or case.steps
    torch.manual_seed(0)
    ddp_model = case.build()
    ours = case.build()
    ours.load_state_dict(ddp_model.state_dict())
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    ours, our_opt = bunsan.distribute(ours, torch.optim.SGD(ours.parameters(), lr=0.01, momentum=0.9))
    g = torch.Generator().manual_seed(bunsan.rank())
    batches = [
        (torch.randn(batch, *case.input_shape, generator=g), torch.randint(0, case.classes, (batch,), generator=g))
        for _ in range(steps)
    ]
    return ddp, ddp_opt, ours, our_opt, batches, case


def measure(name: str, batch: int | None, steps: int | None, rounds: int) -> dict[str, float | int | str]:
    """Step times of DDP and of bunsan's DataParallelSGD on model ``name``, alternating. Collective."""
    ddp, ddp_opt, ours, our_opt, batches, _ = _pair(name, batch, steps)
    time_steps(ddp, ddp_opt, batches[:3])  # warm up both: first steps allocate
    time_steps(ours, our_opt, batches[:3])
    ddp_times, our_times = [], []
    faults = {"ddp": 0, "bunsan": 0}

    def timed(label: str, model: Any, optimizer: Any, pair: tuple[torch.Tensor, torch.Tensor]) -> float:
        before = _minor_faults()
        seconds = time_steps(model, optimizer, [pair])
        faults[label] += _minor_faults() - before
        return seconds

    for _ in range(rounds):
        ddp_s = our_s = 0.0
        for i, pair in enumerate(batches):  # step by step, the first of each pair alternating
            if i % 2 == 0:
                ddp_s += timed("ddp", ddp, ddp_opt, pair)
                our_s += timed("bunsan", ours, our_opt, pair)
            else:
                our_s += timed("bunsan", ours, our_opt, pair)
                ddp_s += timed("ddp", ddp, ddp_opt, pair)
        ddp_times.append(ddp_s / len(batches))
        our_times.append(our_s / len(batches))
    ratios = [o / d for o, d in zip(our_times, ddp_times, strict=True)]
    with torch.no_grad():
        pairs = zip(ddp.module.parameters(), ours.parameters(), strict=True)
        diff = max(float((p - q).abs().max()) for p, q in pairs)
    return {
        "model": name,
        "tensors": sum(1 for _ in ours.parameters()),
        "parameters": sum(p.numel() for p in ours.parameters()),
        "batch": len(batches[0][1]),
        "steps": len(batches),
        "rounds": rounds,
        "ddp_ms": statistics.median(ddp_times) * 1e3,
        "bunsan_ms": statistics.median(our_times) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "max_param_diff": diff,
        "ddp_faults": faults["ddp"] / (rounds * len(batches)),
        "bunsan_faults": faults["bunsan"] / (rounds * len(batches)),
    }


def _minor_faults() -> int:
    """This process's minor page faults so far (0 where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def profile(name: str, batch: int | None, steps: int, top: int = 25) -> str:
    """cProfile of ``steps`` steps of each trainer (rank 0's view), most own time first. Collective."""
    ddp, ddp_opt, ours, our_opt, batches, _ = _pair(name, batch, steps)
    time_steps(ddp, ddp_opt, batches[:3])
    time_steps(ours, our_opt, batches[:3])
    report = io.StringIO()
    for label, model, optimizer in (("DDP", ddp, ddp_opt), ("bunsan", ours, our_opt)):
        profiler = cProfile.Profile()
        profiler.enable()
        seconds = time_steps(model, optimizer, batches)
        profiler.disable()
        report.write(
            f"\n=== {label} on {name}: {seconds * 1e3:.3f} ms/step over {len(batches)} steps (under the profiler) ===\n"
        )
        pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(top)
    return report.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.ddp_overhead", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="digits-cnn,mlp-1m,resnet20,many-small", help="comma-separated: " + ",".join(cases())
    )
    parser.add_argument("--batch", type=int, help="per-worker batch (default: the model's, 32 for resnet20, else 64)")
    parser.add_argument("--steps", type=int, help="steps per round (default: the model's, 5 for resnet20, else 20)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=60,
        help="rounds of --steps steps of each trainer (per-round ratios scatter by about +-15%% on a shared machine; 60 rounds steady their median)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="then profile N steps of each trainer with cProfile and print where the time goes",
    )
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = sorted(set(names) - set(cases()))
    if unknown:
        parser.error(f"unknown models {unknown}; choose among {sorted(cases())}")
    try:
        check_int("--rounds", args.rounds, minimum=1)
        check_int("--batch", args.batch, minimum=1, allow_none=True)
        check_int("--steps", args.steps, minimum=1, allow_none=True)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    bunsan.init()
    results = [measure(m, args.batch, args.steps, args.rounds) for m in names]
    if bunsan.is_main():
        print(
            f"DataParallelSGD vs DistributedDataParallel, {bunsan.size()} workers, {torch.get_num_threads()} "
            f"thread(s) each, {args.rounds} rounds of steps alternating one by one; ratio = median of bunsan/DDP per round"
        )
        columns = [("model", "{model}"), ("tensors", "{tensors}"), ("batch", "{batch}")]
        columns += [("DDP ms/step", "{ddp_ms:.3f}"), ("bunsan ms/step", "{bunsan_ms:.3f}"), ("ratio", "{ratio:.3f}")]
        columns += [("min", "{ratio_min:.3f}"), ("max", "{ratio_max:.3f}"), ("param diff", "{max_param_diff:.2g}")]
        columns += [("faults/step DDP", "{ddp_faults:.0f}"), ("bunsan", "{bunsan_faults:.0f}")]
        print(format_records(results, columns))
        if args.json:
            write_json(args.json, {"workers": bunsan.size(), "threads": torch.get_num_threads(), "results": results})
    for name in names if args.profile else ():
        text = profile(name, args.batch, args.profile)
        if bunsan.is_main():
            print(text)
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
