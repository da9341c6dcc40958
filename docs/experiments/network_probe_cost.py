"""Auto's network probe on a shaped link: its cost and its fit, with and without fewer repeats for long sizes.

Run once per worker count under the shaped-network launcher (root), e.g.::

    OMP_NUM_THREADS=1 .venv/bin/python -m bunsan.bench.netns --network rate=100mbit -np 2 -- \\
        .venv/bin/python docs/experiments/network_probe_cost.py --gradient-bytes 605224 --trials 6

It calls :func:`bunsan.algorithms.measure.measure_network` with Auto's arguments (the
sizes Auto picks for ``--gradient-bytes``, the digits CNN's by default; 3 repeats;
``enough_s`` = Auto's ``ENOUGH_S``), alternating two settings ``--trials`` times each so
that both see the same load:

* ``3 repeats``: every size timed 3 times (``LONG_REPEATS`` set to 3: as before it existed);
* ``now``: a size whose untimed first all-reduce already took ``enough_s`` is timed
  ``LONG_REPEATS`` times.

With ``--compare own-size`` the two settings are instead:

* ``to 1 MiB``: Auto's sizes up to the gradient or 1 MiB, stopping at ``enough_s`` only (as
  before ``enough_bytes``);
* ``own size``: the gradient's own size among them, and the probe stops there once its
  all-reduce took ``GROWTH`` times the 4-byte one's (``measure_network(enough_bytes=...)``).

Rank 0 prints, per setting, the seconds of the probe and the fitted all-reduce, all-gather
and float16 bandwidths and latency (median and min-max over the trials), and the load
average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import bunsan
from bunsan import comm
from bunsan.algorithms import auto, measure


def _spread(values: list[float], scale: float, digits: int) -> str:
    return f"{statistics.median(values) * scale:.{digits}f} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gradient-bytes", type=int, default=605_224, help="the job's gradient bytes (digits CNN)")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--compare", choices=("repeats", "own-size"), default="repeats")
    args = parser.parse_args()
    bunsan.init()
    rank, n = comm.get_rank(), comm.get_world_size()
    gradient = args.gradient_bytes
    sizes = [s for s in (4, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024) if s <= max(gradient, 2**20)]
    own = sorted({*sizes, gradient} if gradient < sizes[-1] else sizes)
    long_repeats = measure.LONG_REPEATS
    # name: (LONG_REPEATS, sizes, enough_bytes)
    settings: dict[str, tuple[int, list[int], int | None]] = (
        {"3 repeats": (3, sizes, None), "now": (long_repeats, sizes, None)}
        if args.compare == "repeats"
        else {"to 1 MiB": (long_repeats, sizes, None), "own size": (long_repeats, own, gradient)}
    )
    found: dict[str, dict[str, list[float]]] = {name: {} for name in settings}
    measure.measure_network(None, sizes=sizes[:2], repeats=1)  # untimed: the first connections and buffers
    load = os.getloadavg()[0]
    for _ in range(args.trials):
        for name, (repeats_long, probed, enough_bytes) in settings.items():
            measure.LONG_REPEATS = repeats_long
            comm.barrier()
            started = time.perf_counter()
            network = measure.measure_network(
                None, sizes=probed, repeats=3, enough_s=auto.DEFAULT_POLICY.enough_s, enough_bytes=enough_bytes
            )
            elapsed = time.perf_counter() - started
            record = found[name]
            for key, value in (
                ("probe_s", elapsed),
                ("bandwidth", network.bandwidth),
                ("gather_bandwidth", network.gather_bandwidth or 0.0),
                ("half_bandwidth", network.half_bandwidth or 0.0),
                ("latency_s", network.latency_s),
            ):
                record.setdefault(key, []).append(value)
    if rank == 0:
        shown = sizes if args.compare == "repeats" else f"{sizes} / {own}"
        print(f"{n} workers, gradient {gradient} bytes, sizes {shown}, {args.trials} trials per setting")
        print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
        header = f"{'setting':10s} {'probe s':>20s} {'Gbit/s all-reduce':>22s} {'Gbit/s all-gather':>22s} {'Gbit/s float16':>22s} {'latency us':>16s}"
        print(header)
        print("-" * len(header))
        for name, record in found.items():
            gbit = 8 / 1e9
            print(
                f"{name:10s} {_spread(record['probe_s'], 1, 3):>20s} {_spread(record['bandwidth'], gbit, 3):>22s} "
                f"{_spread(record['gather_bandwidth'], gbit, 3):>22s} {_spread(record['half_bandwidth'], gbit, 3):>22s} "
                f"{_spread(record['latency_s'], 1e6, 0):>16s}"
            )


if __name__ == "__main__":
    main()
