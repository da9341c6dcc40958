"""Where an exact step's time goes on each rank, against model averaging's local steps, side by side.

For a model of :mod:`bunsan.models` on random inputs, ``--workers`` Gloo ranks on this machine
(one thread each) train exact SGD, then model averaging (blocks of 32 steps), then both again,
``--steps`` steps each (the first 3 untimed). For exact SGD it prints, per rank, the median
step, the median time outside the gradient exchange (the step less the time spent completing
the exchange, as ``Auto`` measures its local compute) and the median time in the exchange;
for model averaging the median step per rank (its local steps: one exchange in 32). Where the
ranks share cores, a synchronous step waits for the slowest rank far beyond the exchange the
cost model counts, and the time outside the exchange is the estimate of the local step that
the exact step's time is not (``bunsan.algorithms.auto.split_compute``). "exact held" holds
every bucket until backward's end (as Auto's first step does) and also gives the time from
the step's start to backward's end, with no exchange running beside the compute. ``--window W``
also prints the slowest rank's median step over every W steps of each run (a drift within a run)::

    OMP_NUM_THREADS=1 .venv/bin/python docs/experiments/exchange_wait.py --workers 4 \
        --model mnist1d_cnn --batch 32
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

SHAPES = {"mnist1d_cnn": (1, 40), "digits_cnn": (1, 8, 8), "resnet20": (3, 32, 32)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_rank(rank: int, n: int, port: int) -> None:
    """Make this process rank ``rank`` of ``n`` local ones (the variables a launcher sets), one thread."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(n),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(n),
    )
    torch.set_num_threads(1)


def _body(rank: int, n: int, port: int, model_name: str, batch: int, steps: int, queue: mp.Queue) -> None:
    local_rank(rank, n, port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    import bunsan
    from bunsan import models

    x = torch.randn(batch, *SHAPES[model_name], generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(rank))
    found: dict[str, list[dict[str, list[float]]]] = {"exact": [], "exact held": [], "model averaging": []}
    runs = [
        ("exact", "data_parallel", {}),
        ("exact held", "data_parallel", {}),
        ("model averaging", "model_averaging", {"block_size": 32 * batch}),
    ] * 2
    for name, algorithm, options in runs:
        torch.manual_seed(0)
        model = models.create(model_name)
        model, optimizer = bunsan.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), algorithm, **options
        )
        inner = optimizer.algorithm
        step_s, outside_s, inside_s, before_s = [], [], [], []
        ended: list[float] = []

        def hold(
            ended: list[float] = ended,
        ) -> bool:  # "exact held": no bucket leaves before backward's end (Auto's first step)
            ended.append(time.perf_counter())
            return False

        dist.barrier()
        last = time.perf_counter()
        for i in range(steps):
            if name == "exact held":
                inner.before_exchange = hold
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            now = time.perf_counter()
            waited = getattr(inner, "exchange_s", 0.0)
            if hasattr(inner, "exchange_s"):
                inner.exchange_s = 0.0
            if i >= 3:
                step_s.append(now - last)
                outside_s.append(now - last - waited)
                inside_s.append(waited)
                if ended:
                    before_s.append(ended[-1] - last)
            last = now
        optimizer.join()
        found[name].append({"step": step_s, "outside": outside_s, "inside": inside_s, "before": before_s})
    finish_rank((), rank, found, queue)


def rank_parser(description: str, workers: int, model: str) -> argparse.ArgumentParser:
    """The arguments every script of these ranks takes: ``--workers``, ``--model``, ``--batch``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workers", type=int, default=workers)
    parser.add_argument("--model", choices=sorted(SHAPES), default=model)
    parser.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    return parser


def start_rank(
    rank: int, n: int, port: int, model_name: str, batch: int, kinds: Iterable[tuple[str, str, dict[str, Any]]]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Join the process group (its own, made here), and for each ``(name, algorithm, options)`` of
    ``kinds`` a copy of the model (the same initial values) with its optimizer, distributed with that
    algorithm; with this rank's random inputs ``x`` and labels ``y`` of ``batch`` samples."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    import bunsan
    from bunsan import models

    x = torch.randn(batch, *SHAPES[model_name], generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(rank))
    built = {}
    for name, algorithm, options in kinds:
        torch.manual_seed(0)
        model = models.create(model_name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        built[name] = bunsan.distribute(model, optimizer, algorithm, **options)
    return x, y, built


def finish_rank(optimizers: Iterable[Any], rank: int, result: Any, queue: mp.Queue) -> None:
    """End a rank: every block algorithm's last block, the result to the parent, the process group."""
    for optimizer in optimizers:
        optimizer.join()
    queue.put((rank, result))
    dist.destroy_process_group()


def run_ranks(body: Callable[..., None], workers: int, args: tuple, timeout_s: float = 1800) -> dict[int, Any]:
    """``body(rank, workers, port, *args, queue)`` in ``workers`` spawned processes; each puts ``(rank, result)``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=body, args=(r, workers, port, *args, queue)) for r in range(workers)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = rank_parser(__doc__.split("\n")[0], workers=4, model="mnist1d_cnn")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--window", type=int, default=0, help="also print each run's median step over every WINDOW timed steps"
    )
    args = parser.parse_args()
    if args.workers < 1 or args.batch < 1 or args.steps < 4 or args.window < 0:
        parser.error("--workers and --batch must be at least 1, --steps at least 4 (3 are untimed), --window 0 or more")
    results = run_ranks(_body, args.workers, (args.model, args.batch, args.steps))
    n = args.workers
    med = statistics.median
    print(f"{args.model}, {n} workers, {args.batch} samples per worker; load average {os.getloadavg()[0]:.2f}")
    for name in ("exact", "exact held", "model averaging"):
        for trial in range(2):
            runs = [results[r][name][trial] for r in range(n)]
            steps = " ".join(f"{med(run['step']) * 1e3:7.2f}" for run in runs)
            line = f"{name:16s} #{trial + 1}  step per rank (ms) {steps}"
            if name.startswith("exact"):
                outside = [med(run["outside"]) for run in runs]
                inside = " ".join(f"{med(run['inside']) * 1e3:.2f}" for run in runs)
                line += (
                    f"; outside the exchange {' '.join(f'{o * 1e3:.2f}' for o in outside)}"
                    f" (mean {sum(outside) / n * 1e3:.2f}); in it {inside}"
                )
            if name == "exact held":
                before = [med(run["before"]) for run in runs]
                line += f"; before backward's end {' '.join(f'{b * 1e3:.2f}' for b in before)}"
            print(line)
            if args.window:  # the slowest rank's step, median per window: does the step drift within a run?
                slowest = [max(run["step"][i] for run in runs) for i in range(len(runs[0]["step"]))]
                medians = [med(slowest[i : i + args.window]) * 1e3 for i in range(0, len(slowest), args.window)]
                print(f"{'':16s}     per {args.window} steps (ms) {' '.join(f'{m:.1f}' for m in medians)}")


if __name__ == "__main__":
    main()
