"""AsyncSGD vs DataParallelSGD vs BlockMomentumSGD on MNIST-1D, with and without a straggler.

Run on 4 workers::

    bunsan run -np 4 python -m bunsan.bench.async_bench
    bunsan run -np 4 python -m bunsan.bench.async_bench --epochs 20 --json async.json

One job trains every setting one after another on the same workers, so the
times compare under the same conditions: the small MNIST-1D CNN
(:class:`bunsan.models.MNIST1DCNN`), the same seed (initial model and data
order), the same global minibatch ``--batch`` (each of N workers takes
``batch / N``) and the same number of epochs, in two situations:

* ``even``: every worker at its own speed;
* ``straggler``: the last rank is made ``--slow`` times slower: before each step
  it sleeps ``(slow - 1)`` times the compute time (forward and backward) of its
  previous step.

"The same epochs" means the same number of training samples, all workers
together: ``epochs x len(train set)``. The synchronous algorithms get there by
each worker running ``epochs`` passes over its partition. AsyncSGD's workers do
not wait for each other, so each trains until the server has counted
``epochs x len(train set)`` samples (the overshoot is at most one
``sync_period`` per worker); a fast worker contributes more samples than a slow
one, which is the point of asynchronous SGD. So that a fast worker does not
overfit a partition of its own, each AsyncSGD worker draws its minibatches from
the whole training set, in its own order.

Learning rates: DataParallelSGD and BlockMomentumSGD use ``--lr``; AsyncSGD uses
``--lr x --async-lr-scale`` (default ``1/N``: every worker's update is applied in
full, see :mod:`bunsan.algorithms.async_sgd`) and pushes after every step
(``--sync-period``, default one local batch).

On a machine with fewer cores than workers, rank 0's worker trains faster than
the others: its pushes are in-process calls, while the others wait for the
server's threads to be scheduled beside four busy processes (the
``samples per worker`` column shows it).

Columns: ``time`` from a barrier after set-up to a barrier after
``optimizer.join()``; ``speed`` = time of DataParallelSGD in the same situation
/ time; ``acc`` = test accuracy of the final model (every replica is equal
after ``join()``); ``bytes/sample`` = bytes sent by all ranks together (as
counted by each algorithm's ``stats()``, the server's replies included) / samples
trained; ``samples`` = samples trained by all workers.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import bunsan
from bunsan import _table, comm, datasets
from bunsan.algorithms import Algorithm, BlockMomentumSGD, DataParallelSGD
from bunsan.algorithms.async_sgd import AsyncSGD
from bunsan.models import MNIST1DCNN

__all__ = ["COLUMNS", "format_table", "main", "train_one"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.async_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global minibatch, split evenly over the workers")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", type=float, default=3.0, help="the straggler's slow-down factor")
    parser.add_argument(
        "--sync-period",
        type=int,
        default=None,
        help="AsyncSGD samples per worker between pushes (default: one local batch, a push every step)",
    )
    parser.add_argument("--async-lr-scale", type=float, default=None, help="AsyncSGD's lr = lr x this (default 1/N)")
    parser.add_argument(
        "--async-momentum", type=float, default=None, help="AsyncSGD's local momentum (default: --momentum)"
    )
    parser.add_argument("--lr-warmup", type=int, default=0, help="AsyncSGD's ramp, global samples")
    parser.add_argument("--staleness-aware", action="store_true")
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="BlockMomentumSGD samples per worker per block (default: 4 local batches)",
    )
    parser.add_argument(
        "--algorithms",
        default="data_parallel,block_momentum,async",
        help="comma-separated subset of data_parallel, block_momentum, async",
    )
    parser.add_argument("--situations", default="even,straggler", help="comma-separated subset of even, straggler")
    parser.add_argument("--json", default=None, help="write the rows as JSON here (rank 0)")
    return parser.parse_args(argv)


def _make(name: str, args: argparse.Namespace, local_batch: int, world_size: int) -> tuple[Algorithm, float, float]:
    """The algorithm and the local learning rate and momentum it trains with."""
    if name == "data_parallel":
        return DataParallelSGD(), args.lr, args.momentum
    if name == "block_momentum":
        return BlockMomentumSGD(block_size=args.block_size or 4 * local_batch), args.lr, args.momentum
    if name == "async":
        scale = args.async_lr_scale if args.async_lr_scale is not None else 1.0 / world_size
        algorithm = AsyncSGD(
            sync_period=args.sync_period or local_batch, lr_warmup=args.lr_warmup, staleness_aware=args.staleness_aware
        )
        momentum = args.momentum if args.async_momentum is None else args.async_momentum
        return algorithm, args.lr * scale, momentum
    raise ValueError(f"unknown algorithm {name!r}; choose data_parallel, block_momentum or async")


@torch.no_grad()
def _accuracy(model: nn.Module, dataset: Any) -> float:
    model.eval()
    x, y = dataset[:]
    correct = int((model(x).argmax(dim=1) == y).sum())
    model.train()
    return correct / len(y)


def train_one(name: str, situation: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one setting on every rank. Collective; the row is complete on rank 0."""
    world_size, rank = bunsan.size(), bunsan.rank()
    if args.batch % world_size:
        raise ValueError(f"--batch {args.batch} does not split evenly over {world_size} workers")
    local_batch = args.batch // world_size
    train_set, test_set = datasets.load("mnist1d", "train"), datasets.load("mnist1d", "test")
    torch.manual_seed(args.seed)
    model: nn.Module = MNIST1DCNN()
    algorithm, lr, momentum = _make(name, args, local_batch, world_size)
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model, optimizer = bunsan.distribute(model, sgd, algorithm)
    budget = args.epochs * len(train_set)  # samples, all workers together
    straggler = situation == "straggler" and rank == world_size - 1
    is_async = isinstance(algorithm, AsyncSGD)
    if is_async:
        # Workers run at different speeds: each draws from the whole training set in its own
        # order, so that a fast worker does not overfit a partition of its own.
        loader = bunsan.data.loader(
            train_set, batch_size=local_batch, shuffle=True, seed=args.seed + 7919 * rank, rank=0, world_size=1
        )
    else:
        loader = bunsan.data.loader(train_set, batch_size=local_batch, shuffle=True, seed=args.seed)

    comm.barrier()
    start = time.perf_counter()
    compute_s = 0.0
    epoch = 0
    while True:
        for x, y in loader:
            if straggler and compute_s:
                time.sleep((args.slow - 1.0) * compute_s)
            began = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            compute_s = time.perf_counter() - began
            optimizer.step()
            if is_async and algorithm.samples >= budget:
                break
        else:
            epoch += 1
            if is_async or epoch < args.epochs:
                continue
        break
    optimizer.join()
    comm.barrier()
    wall_s = time.perf_counter() - start

    stats = comm.all_gather_object(algorithm.stats())
    if rank != 0:
        return {}
    samples = sum(int(s["local_samples"]) for s in stats)
    row = {
        "situation": situation,
        "algorithm": name,
        "repr": repr(algorithm),
        "lr": lr,
        "momentum": momentum,
        "time_s": wall_s,
        "accuracy": _accuracy(model, test_set),
        "samples": samples,
        "samples_per_worker": [int(s["local_samples"]) for s in stats],
        "bytes_per_sample": sum(float(s["bytes_sent"]) for s in stats) / max(samples, 1),
    }
    if is_async:
        row.update(
            mean_staleness=stats[0]["mean_staleness"],
            pushes=stats[0]["server_updates"],
            ms_per_push=[1000 * s["sync_s"] / max(s["pushes"], 1) for s in stats],
        )
    return row


COLUMNS = ("situation", "algorithm", "lr", "time s", "speed", "acc %", "bytes/sample", "samples", "samples per worker")


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a text table, with each time's speed relative to DataParallelSGD in its situation."""
    reference = {r["situation"]: r["time_s"] for r in rows if r["algorithm"] == "data_parallel"}
    cells = [
        [
            r["situation"],
            r["algorithm"],
            f"{r['lr']:.4f}",
            f"{r['time_s']:.1f}",
            f"{reference[r['situation']] / r['time_s']:.2f}" if reference.get(r["situation"]) else "-",
            f"{100 * r['accuracy']:.1f}",
            f"{r['bytes_per_sample']:.0f}",
            str(r["samples"]),
            str(r["samples_per_worker"]),
        ]
        for r in rows
    ]
    return _table.format_table(COLUMNS, cells, right=COLUMNS[2:8])


def _warm_up() -> None:
    """One throw-away step: the first optimizer of a process imports ~800 modules."""
    model = MNIST1DCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    F.cross_entropy(model(torch.zeros(2, 1, 40)), torch.zeros(2, dtype=torch.long)).backward()
    optimizer.step()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    bunsan.init()
    _warm_up()
    rows = []
    for situation in args.situations.split(","):
        for name in args.algorithms.split(","):
            row = train_one(name.strip(), situation.strip(), args)
            if bunsan.rank() == 0:
                rows.append(row)
                extra = ""
                if "mean_staleness" in row:
                    extra = (
                        f", mean staleness {row['mean_staleness']:.1f}, ms per push/pull by rank "
                        f"{[round(t, 2) for t in row['ms_per_push']]}"
                    )
                print(
                    f"[async_bench] {situation} {name}: {row['time_s']:.1f} s, "
                    f"accuracy {100 * row['accuracy']:.1f} %{extra}",
                    flush=True,
                )
    if bunsan.rank() == 0:
        print(
            f"\nMNIST-1D CNN, {bunsan.size()} workers, global batch {args.batch}, {args.epochs} epochs, "
            f"momentum {args.momentum}, straggler = rank {bunsan.size() - 1} x{args.slow}"
        )
        print(format_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
