"""Auto's fixed-cost probe: what it costs and how much its result spreads, two settings side by side.

Runs the probes of ``Auto(risk="high")`` under SGD momentum 0.9 (exact, fp16, rotated
1 bit, block momentum) with :func:`bunsan.algorithms.measure.measure_fixed_costs`,
``--trials`` times per setting, alternating the settings so that both see the same load:

* ``until 6bc61fb``: runs of 6 steps warmed up by one whole run (24 steps per candidate);
* ``now``: Auto's ``PROBE_STEPS``, ``PROBE_WARMUP`` and ``PROBE_REPEATS``.

Prints, per worker count, the seconds of the whole probe (median, min-max) and each
candidate's fixed cost in ms (median, min-max over the trials), and the load average.
The network is given (latency 0.1 ms, 4 Gbit/s): the probe's cost and spread do not
depend on it beyond the predicted part it subtracts::

    OMP_NUM_THREADS=1 .venv/bin/python docs/experiments/probe_cost.py --workers 2 4 --trials 6
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _body(rank: int, n: int, port: int, trials: int, results: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(n),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(n),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    import bunsan.optim  # noqa: F401  (registers bunsan.distribute for the probe)
    from bunsan.algorithms import auto, measure
    from bunsan.algorithms import cost_model as cm

    network = cm.Network(latency_s=1e-4, bandwidth=5e8)
    probes, _ = auto.probes_for("high", momentum=0.9)  # as Auto's under SGD momentum 0.9
    settings = {
        "until 6bc61fb": {"steps": 6, "repeats": 3, "warmup": None},
        "now": {
            "steps": auto.DEFAULT_POLICY.probe_steps,
            "repeats": auto.DEFAULT_POLICY.probe_repeats,
            "warmup": auto.DEFAULT_POLICY.probe_warmup,
        },
    }
    out: dict[str, list] = {name: [] for name in settings}
    for _ in range(trials):
        for name, kwargs in settings.items():
            dist.barrier()
            start = time.perf_counter()
            fixed = measure.measure_fixed_costs(probes, network, **kwargs)
            out[name].append((time.perf_counter() - start, dict(fixed)))
    if rank == 0:
        results[n] = out
    dist.destroy_process_group()


def _span(values: list[float], scale: float, fmt: str) -> str:
    return f"{statistics.median(values) * scale:{fmt}} ({min(values) * scale:{fmt}}-{max(values) * scale:{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--trials", type=int, default=6)
    args = parser.parse_args()
    manager = mp.Manager()
    results = manager.dict()
    for n in args.workers:
        mp.spawn(_body, args=(n, _free_port(), args.trials, results), nprocs=n)
    print(f"load average before the table: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for n in args.workers:
        print(f"\n{n} workers, {args.trials} trials: probe seconds and fixed cost (ms, per block for block momentum)")
        for name, rows in results[n].items():
            labels = list(rows[0][1])
            cells = [f"{name:<15} {_span([r[0] for r in rows], 1, '.2f')} s"]
            cells += [f"{label} {_span([r[1][label] for r in rows], 1e3, '.1f')}" for label in labels]
            print("  " + "; ".join(cells))


if __name__ == "__main__":
    main()
