"""A small training job for the edge-case tests (tests/launch/test_edges.py) and scripts/edges_repeat.py.

Started as one process per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set
(a plain launch, no ``bunsan run``). Each rank trains a tiny linear model on
synthetic data and, at the end, writes its flat parameters to
``<out>/rank<r>.pt`` so that the parent can compare the replicas.

Options:
    --algorithm  data_parallel | block_momentum | model_averaging | async
    --batches N  batches every rank trains
    --extra R:K  rank R trains K more batches (uneven data)
    --skip R:S   rank R skips optimizer.step() at its step S (as a GradScaler inf check would)
    --log-loss   every step, all-reduce the loss for logging (a collective that join() does not answer)
    --barrier R:S  rank R calls an extra barrier() before its step S (a collective the others do not make)
    --pause R:S  rank R spends --pause-s seconds "in checkpoint save" before its step S
    --join       call optimizer.join() after the loop (the documented way)
    --finalize   call bunsan.finalize() at the end (otherwise interpreter exit does it)
    --seconds T  train for T seconds instead of a number of batches (memory measurements)
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time

import torch
import torch.nn.functional as F

import bunsan
from bunsan.comm import all_reduce, barrier, inspector


def _pair(text: str) -> tuple[int, int]:
    rank, _, value = text.partition(":")
    return int(rank), int(value)


def _save(model_box: list, out: str) -> None:
    if model_box:
        rank, model = model_box[0]
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.save(flat, os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    model_box: list = []
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithm", default="data_parallel")
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--extra", type=_pair, default=None)
    parser.add_argument("--skip", type=_pair, default=None)
    parser.add_argument("--log-loss", action="store_true")
    parser.add_argument("--barrier", type=_pair, default=None)
    parser.add_argument("--pause", type=_pair, default=None)
    parser.add_argument("--pause-s", type=float, default=4.0)
    parser.add_argument("--join", action="store_true")
    parser.add_argument("--finalize", action="store_true")
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--collective-timeout", type=float, default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    if args.out:
        # Registered before bunsan.init(), so it runs after bunsan's own exit handler
        # (atexit is last-in first-out): the replicas as the job leaves them.
        atexit.register(_save, model_box, args.out)
    bunsan.init(timeout_s=args.collective_timeout)
    rank = bunsan.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    algorithm = {
        "data_parallel": lambda: bunsan.DataParallelSGD(),
        "block_momentum": lambda: bunsan.BlockMomentumSGD(block_size=12),
        "model_averaging": lambda: bunsan.ModelAveragingSGD(block_size=12),
        "async": lambda: bunsan.AsyncSGD(),
    }[args.algorithm]()
    model, optimizer = bunsan.distribute(model, optimizer, algorithm)
    model_box.append((rank, model))

    batches = args.batches
    if args.extra is not None and args.extra[0] == rank:
        batches += args.extra[1]
    # The parent measures how long the job lasted after training began (start-up excluded).
    print(f"edges: training starts at {time.time():.3f}", file=sys.stderr, flush=True)
    generator = torch.Generator().manual_seed(100 + rank)
    start = time.monotonic()
    step = 0
    while (time.monotonic() - start < args.seconds) if args.seconds else (step < batches):
        if args.barrier is not None and args.barrier == (rank, step):
            barrier()
        if args.pause is not None and args.pause == (rank, step):
            with inspector.activity("in checkpoint save"):
                time.sleep(args.pause_s)
        x = torch.randn(4, 8, generator=generator)
        y = torch.randn(4, 2, generator=generator)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if args.skip is not None and args.skip == (rank, step):
            step += 1
            continue  # as `if not torch.isfinite(loss): continue` would
        optimizer.step()
        if args.log_loss:
            all_reduce(loss.detach().clone())
        step += 1

    if args.join:
        optimizer.join()
    if args.finalize:
        bunsan.finalize()
    print(f"rank {rank} trained {step} batches", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
