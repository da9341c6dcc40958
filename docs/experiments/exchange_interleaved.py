"""Exact SGD's steps against model averaging's local steps, interleaved in one pair of processes.

``exchange_wait.py`` runs exact SGD and model averaging one after the other, so a change in the
machine's speed between the runs (on the 2-core machine of the docs the same step moves by 30%
within a minute) reads as a difference between the algorithms. Here every rank builds both, on
two copies of one model, and alternates ``--chunk`` steps of exact SGD with ``--chunk`` steps of
model averaging (blocks of 32 steps), ``--pairs`` times; each chunk's first step is untimed. Per
pair it prints the slowest rank's median exact step, the ranks' mean time of it outside the
exchange (``Auto``'s measure of the local compute), and the slowest rank's median local step of
model averaging (the steps that end a block, with their exchange, left out), then the medians
over the pairs of the ratios local / exact and local / outside. A ratio local / outside under 1
means an exact step's compute runs slower than the same compute without an exchange beside it.
A third copy runs exact SGD with each step's exchange held until backward ends ("held": no
bucket leaves during backward; the same gradients), whose time outside the exchange is the
compute with no exchange beside it; and every kind's main-thread CPU time per step
(``time.thread_time``, the ranks' mean of their medians) tells work from waiting for a core, and
the CPU time of the process's other threads per step (``time.process_time`` less the main
thread's: Gloo's threads, where the exchange's copies and sums run) what the exchange takes
from the cores the compute runs on. A fourth copy runs model averaging's local steps in lock-step
("locked": a barrier after every step, its wait left out): no gradient leaves, but every rank
starts each step with the others, as exact SGD's exchange makes them; local / locked under 1 means
the lock-step itself slows the compute (the ranks' heavy phases coincide on shared cores). Each
kind's minor page faults per step (the main thread's) show memory taken afresh from the kernel:
``bunsan.distribute`` fixes malloc's thresholds in these processes (:mod:`bunsan._allocator`), and
``BUNSAN_MALLOC_TUNING=0`` runs them as a script's own group did before it did::

    OMP_NUM_THREADS=1 .venv/bin/python docs/experiments/exchange_interleaved.py --workers 2 \\
        --model resnet20 --batch 32 --chunk 20 --pairs 8
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from exchange_wait import finish_rank, rank_parser, run_ranks, start_rank

BLOCK_STEPS = 32


def _hold() -> bool:
    return False  # the exchange goes on, from the end of backward


def _body(rank: int, n: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    block = {"block_size": BLOCK_STEPS * args.batch}
    kinds = (
        ("exact", "data_parallel", {}),
        ("held", "data_parallel", {}),
        ("local", "model_averaging", block),
        ("locked", "model_averaging", block),
    )
    x, y, built = start_rank(rank, n, port, args.model, args.batch, kinds)
    pairs: list[dict[str, list[float]]] = []
    steps_of = {"local": 0, "locked": 0}
    for _ in range(args.pairs):
        found: dict[str, list[float]] = {
            "exact": [],
            "outside": [],
            "held": [],
            "local": [],
            "locked": [],
            "cpu exact": [],
            "cpu held": [],
            "cpu local": [],
            "cpu locked": [],
            "others exact": [],
            "others held": [],
            "others local": [],
            "others locked": [],
            "faults exact": [],
            "faults held": [],
            "faults local": [],
            "faults locked": [],
        }
        for name in ("exact", "held", "local", "locked"):
            model, optimizer = built[name]
            inner = optimizer.algorithm
            dist.barrier()
            last, last_cpu, last_all = time.perf_counter(), time.thread_time(), time.process_time()
            last_faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            for i in range(args.chunk):
                optimizer.zero_grad()
                if name == "held":  # no bucket leaves before backward ends (Auto's measuring steps on CPU)
                    inner.before_exchange = _hold
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                waited = 0.0
                if name == "locked":  # local steps in lock-step: every rank starts the next one together
                    began = time.perf_counter()
                    dist.barrier()
                    waited = time.perf_counter() - began
                now, cpu, every = time.perf_counter(), time.thread_time(), time.process_time()
                faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                if i > 0:
                    found[f"cpu {name}"].append(cpu - last_cpu)
                    found[f"faults {name}"].append(faults - last_faults)
                    found[f"others {name}"].append((every - last_all) - (cpu - last_cpu))
                last_cpu, last_all, last_faults = cpu, every, faults
                if name in ("local", "locked"):
                    steps_of[name] += 1
                    if i > 0 and steps_of[name] % BLOCK_STEPS:  # not a step that ended a block
                        found[name].append(now - last - waited)
                else:
                    waited = inner.exchange_s
                    inner.exchange_s = 0.0
                    if i > 0 and name == "held":
                        found["held"].append(now - last - waited)
                    elif i > 0:
                        found["exact"].append(now - last)
                        found["outside"].append(now - last - waited)
                last = now
        pairs.append(found)
    finish_rank((optimizer for _, optimizer in built.values()), rank, pairs, queue)


def main() -> None:
    parser = rank_parser(__doc__.split("\n")[0], workers=2, model="resnet20")
    parser.add_argument("--chunk", type=int, default=20, help="steps of each algorithm in a row")
    parser.add_argument("--pairs", type=int, default=8, help="chunks of each")
    args = parser.parse_args()
    if args.chunk < 3 or args.pairs < 1 or args.workers < 1 or args.batch < 1:
        parser.error("--chunk must be at least 3, and --pairs, --workers and --batch at least 1")
    results = run_ranks(_body, args.workers, (args,))
    med = statistics.median
    print(
        f"{args.model}, {args.workers} workers, {args.batch} samples per worker, chunks of {args.chunk} steps; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "pair  exact step (ms)  outside its exchange (ms)  held, outside (ms)  MA local step (ms)  "
        "locked, outside (ms)  local/exact  local/outside  local/held  local/locked"
    )
    by_exact, by_outside, by_held, by_locked = [], [], [], []
    for k in range(args.pairs):
        ranks = [results[r][k] for r in range(args.workers)]
        exact = max(med(found["exact"]) for found in ranks)
        outside = sum(med(found["outside"]) for found in ranks) / args.workers
        held = sum(med(found["held"]) for found in ranks) / args.workers
        local = max(med(found["local"]) for found in ranks)
        locked = sum(med(found["locked"]) for found in ranks) / args.workers
        by_exact.append(local / exact)
        by_outside.append(local / outside)
        by_held.append(local / held)
        by_locked.append(local / locked)
        print(
            f"{k + 1:4d}  {exact * 1e3:15.1f}  {outside * 1e3:25.1f}  {held * 1e3:18.1f}  {local * 1e3:18.1f}  "
            f"{locked * 1e3:20.1f}  {by_exact[-1]:11.2f}  {by_outside[-1]:13.2f}  {by_held[-1]:10.2f}  "
            f"{by_locked[-1]:12.2f}"
        )
    for name in ("exact", "held", "local", "locked"):
        cpu = [
            sum(med(results[r][k][f"cpu {name}"]) for r in range(args.workers)) / args.workers
            for k in range(args.pairs)
        ]
        print(f"main-thread CPU per {name} step (ms), by pair: " + " ".join(f"{c * 1e3:.1f}" for c in cpu))
    for name in ("exact", "held", "local", "locked"):  # Gloo's and torch's own threads: the exchange's CPU work, mostly
        others = [
            sum(med(results[r][k][f"others {name}"]) for r in range(args.workers)) / args.workers
            for k in range(args.pairs)
        ]
        print(f"other threads' CPU per {name} step (ms), by pair: " + " ".join(f"{c * 1e3:.1f}" for c in others))
    for name in ("exact", "held", "local", "locked"):  # the main thread's minor page faults (fresh memory)
        faults = [
            sum(med(results[r][k][f"faults {name}"]) for r in range(args.workers)) / args.workers
            for k in range(args.pairs)
        ]
        print(f"minor page faults per {name} step (main thread), by pair: " + " ".join(f"{f:.0f}" for f in faults))
    print(
        f"median over pairs: local/exact {med(by_exact):.2f} ({min(by_exact):.2f}-{max(by_exact):.2f}), "
        f"local/outside {med(by_outside):.2f} ({min(by_outside):.2f}-{max(by_outside):.2f}), "
        f"local/held {med(by_held):.2f} ({min(by_held):.2f}-{max(by_held):.2f}), "
        f"local/locked {med(by_locked):.2f} ({min(by_locked):.2f}-{max(by_locked):.2f})"
    )


if __name__ == "__main__":
    main()
