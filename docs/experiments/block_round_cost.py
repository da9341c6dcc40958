"""Where a block algorithm's round goes on a large model: its passes over the parameters, its
all-reduce, and the wait for the slower rank, timed apart on each rank, against the cost model.

For a model of :mod:`bunsan.models` on random inputs, ``--workers`` Gloo ranks on this machine
(one thread each) train block momentum and model averaging with blocks of ``--block-steps`` steps,
``--blocks`` blocks each (the first untimed). Each round is timed whole on every rank, its
all-reduce apart (``BlockwiseSGD._exchange``), and a barrier just before the round (``--barrier``)
takes out the wait for the slower rank, which the all-reduce otherwise absorbs. The round less its
all-reduce is the block's own work on the parameters (pack, the change, the block filter, the next
start, unpack, the optimizer's momentum reset). Printed beside: what the job measures for the cost
model (``measure_network``: the ring all-reduce of the parameters' bytes; ``measure_codec``:
``copy_s_per_element``, one pass over the parameters in memory, timed on every rank at once),
the round's own work as the model counts it (``cost_model.block_round_passes`` copies), and the
same operations timed on their own, every rank at once (``time_block_round``)::

    OMP_NUM_THREADS=1 .venv/bin/python docs/experiments/block_round_cost.py --workers 2 \
        --model mlp_10m --batch 32 --block-steps 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bunsan.algorithms.bmuf import update_block_start_, update_global_model_
from bunsan.algorithms.measure import CODEC_NUMEL_CAP, median_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exchange_wait import run_ranks

SHAPES = {"mnist1d_cnn": (1, 40), "digits_cnn": (1, 8, 8), "resnet20": (3, 32, 32), "mlp_10m": (1, 32, 32)}


def time_block_round(numel: int, workers: int, repeats: int = 3) -> float:
    """Collective: seconds per element of a block round's own work beside its all-reduce, timed on
    every rank at once (the slowest rank's figure): the same operations as
    ``BlockwiseSGD._block_round`` (pack, the change divided by the workers, the block filter, a
    Nesterov start, unpack) on tensors of ``numel`` elements (at most 4M: past the last-level
    cache), the median of ``repeats``. The cost model counts these passes instead
    (``cost_model.block_round_passes``, at ``copy_s_per_element`` each); this checks that count."""
    numel = max(1, min(numel, CODEC_NUMEL_CAP))
    # past the CPU's last-level cache (32 MB on the 2-core machine of the docs: 1M elements' five tensors
    # fit in it and ran 3 times faster than 4M's); their values do not matter to the passes' speed
    params = torch.full((numel,), 0.5)
    flat, start, global_model, momentum = (params.clone() for _ in range(4))

    def one_round() -> None:
        flat.copy_(params)
        flat.sub_(start).div_(workers)
        update_global_model_(global_model, momentum, flat, 0.9, 1.0)
        update_block_start_(start, global_model, momentum, 0.9, True)
        params.copy_(start)

    one_round()  # warm up: the first touch of each page costs a fault
    dist.barrier()
    slowest = torch.tensor([median_time(one_round, repeats) / numel], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _body(
    rank: int, n: int, port: int, model_name: str, batch: int, block_steps: int, blocks: int, barrier: bool, queue: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    import bunsan
    from bunsan import models
    from bunsan.algorithms import cost_model as cm
    from bunsan.algorithms.measure import measure_codec, measure_network

    x = torch.randn(batch, *SHAPES[model_name], generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(rank))
    found: dict[str, Any] = {}
    for name in ("block_momentum", "model_averaging"):
        torch.manual_seed(0)
        model = models.create(model_name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model, optimizer = bunsan.distribute(model, optimizer, name, block_size=block_steps * batch)
        inner = optimizer.algorithm
        rounds: list[dict[str, float]] = []
        current: dict[str, float] = {}
        exchange, block_round = inner._exchange, inner._block_round

        def timed_exchange(*a: Any, exchange: Any = exchange, current: dict[str, float] = current, **k: Any) -> Any:
            began = time.perf_counter()
            out = exchange(*a, **k)
            current["exchange"] = time.perf_counter() - began
            return out

        def timed_round(
            *a: Any,
            block_round: Any = block_round,
            current: dict[str, float] = current,
            rounds: list[dict[str, float]] = rounds,
            **k: Any,
        ) -> Any:
            began = time.perf_counter()
            if barrier:
                dist.barrier()
            current["wait"] = time.perf_counter() - began
            began = time.perf_counter()
            out = block_round(*a, **k)
            current["round"] = time.perf_counter() - began
            rounds.append(dict(current))
            return out

        inner._exchange, inner._block_round = timed_exchange, timed_round
        local: list[float] = []
        dist.barrier()
        for _ in range(blocks * block_steps):
            began = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            local.append(time.perf_counter() - began)
        optimizer.join()
        found[name] = {"rounds": rounds[1:], "steps": local[block_steps:]}
    network = measure_network()
    params = sum(p.numel() for p in model.parameters())
    codec = measure_codec(params, 1, collective=True)
    found["model"] = {
        "params": params,
        "allreduce_s": cm.ring_allreduce_time(params * 4, n, network),
        "copy_s": codec["copy_s_per_element"] * params,
        "round_s": time_block_round(params, n) * params,
        "counted_s": cm.block_round_passes(cm.Candidate("block_momentum")) * codec["copy_s_per_element"] * params,
    }
    queue.put((rank, found))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", choices=sorted(SHAPES), default="mlp_10m")
    parser.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    parser.add_argument("--block-steps", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--barrier", action="store_true", help="a barrier before each round: its wait apart")
    args = parser.parse_args()
    if args.workers < 2 or args.batch < 1 or args.block_steps < 1 or args.blocks < 2:
        parser.error("--workers at least 2, --batch and --block-steps at least 1, --blocks at least 2")
    results = run_ranks(_body, args.workers, (args.model, args.batch, args.block_steps, args.blocks, args.barrier))
    med = statistics.median
    model = results[0]["model"]
    print(
        f"{args.model}, {model['params']:,} parameters, {args.workers} workers, {args.batch} samples per worker, "
        f"blocks of {args.block_steps} steps; load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"the cost model's inputs: ring all-reduce of the parameters {model['allreduce_s'] * 1e3:.1f} ms; "
        f"one pass over them {model['copy_s'] * 1e3:.1f} ms (copy_s_per_element), a round's own work counted "
        f"{model['counted_s'] * 1e3:.1f} ms (block momentum's passes at a copy's cost), timed alone "
        f"{model['round_s'] * 1e3:.1f} ms (both every rank at once)"
    )
    for name in ("block_momentum", "model_averaging"):
        for rank in sorted(results):
            rounds = results[rank][name]["rounds"]
            total = med(r["round"] for r in rounds)
            exchange = med(r["exchange"] for r in rounds)
            local = med(r["round"] - r["exchange"] for r in rounds)
            wait = med(r["wait"] for r in rounds)
            print(
                f"{name:16s} rank {rank}: round {total * 1e3:6.1f} ms = all-reduce {exchange * 1e3:6.1f} + own work "
                f"{local * 1e3:5.1f} ({local / model['copy_s']:.1f} passes); barrier before it {wait * 1e3:5.1f} ms; "
                f"{len(rounds)} rounds"
            )


if __name__ == "__main__":
    main()
