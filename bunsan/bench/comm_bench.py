"""``bunsan bench comm``: bus bandwidth of all-reduce and all-gather over message sizes.

One ``bunsan run -np N`` job times, for each message size, each collective
two ways, side by side in the same processes:

* ``bunsan``: :func:`bunsan.comm.all_reduce` and :func:`bunsan.comm.all_gather_into`,
  the wrappers the algorithms use (traffic counting, error translation);
* ``torch``: ``torch.distributed.all_reduce`` and the single-tensor all-gather
  called directly (:mod:`bunsan.comm.bench_raw`);

and, as the physical ceiling of this machine, a local ``tensor.copy_`` of the
same size on one thread (rank 0, while the others wait)::

    bunsan bench comm -np 2 --sizes 1KB..64MB

Bandwidths follow nccl-tests' definitions, so that the numbers compare with
theirs: for a collective of ``size`` bytes that took ``t`` seconds,
``algbw = size / t``, and the bus bandwidth, the rate each link must carry in
an optimal ring algorithm, is

* all-reduce: ``busbw = algbw x 2 (n - 1) / n``;
* all-gather: ``busbw = algbw x (n - 1) / n``, where ``size`` is the gathered
  OUTPUT (each rank contributes ``size / n``).

GB/s means 10^9 bytes per second. The copy's figure is ``size / t`` of
``dst.copy_(src)`` (it reads and writes ``size`` bytes each).

Timing: after ``--warmup`` calls, a barrier, then ``iters`` calls back to back;
a rank's time per call is its elapsed time / ``iters``, and the slowest rank's
is reported (as nccl-tests does). ``iters`` is ``--iters``, fewer for large
messages so that one measurement moves at most about 256 MB. The two paths
alternate for ``--rounds`` rounds and each reports its median round, so that
the machine's noise hits both alike.

This module imports no torch at the top; it is also the job
every worker runs (``python -m bunsan.bench.comm_bench --worker SPEC``).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bunsan._table import format_table
from bunsan._validate import check_choice, check_int, check_number
from bunsan.bench import netns
from bunsan.bench._common import (
    add_job_arguments,
    check_at_least,
    check_positive,
    command_main,
    job_command,
    job_environment,
    load_average,
    record_header,
    refuse,
    report_failures,
    run_recorded_job,
    write_record,
)

__all__ = [
    "COLUMNS",
    "DESCRIPTION",
    "EPILOG",
    "OPS",
    "add_arguments",
    "bus_bandwidth",
    "format_size",
    "iterations_for",
    "main",
    "parse_size",
    "parse_sizes",
    "plot_comm",
    "run",
    "table_rows",
]

PROG = "bunsan bench comm"
WORKER_MODULE = "bunsan.bench.comm_bench"  # this module is also the job every worker runs
OPS = ("all_reduce", "all_gather")
BYTES_PER_MEASUREMENT = 256 * 2**20  # fewer iterations for large messages: one measurement moves <= ~256 MB
FLOAT_BYTES = 4

DESCRIPTION = """\
Bus bandwidth of all-reduce and all-gather (float32) over message sizes, for
bunsan's wrappers (bunsan.comm) and raw torch.distributed side by side in one
`bunsan run -np N` job, and the local tensor.copy_ bandwidth as the physical
ceiling. busbw as nccl-tests defines it: all-reduce algbw x 2(n-1)/n,
all-gather algbw x (n-1)/n with size = the gathered output. GB/s = 1e9 B/s.
Writes a JSON record and a PNG plot. With --network the workers run in
network namespaces on links shaped to a rate (root only)."""

EPILOG = """\
examples:
  bunsan bench comm -np 2 --sizes 1KB..64MB
  bunsan bench comm -np 4 --sizes 64KB..16MB --factor 2 --ops all_reduce
  bunsan bench comm -np 2 --sizes 1MB,16MB --network rate=1gbit"""

_SIZE = re.compile(r"(?P<number>\d+)\s*(?P<prefix>[kmg]?)(?:i?b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}


# -- pure ----------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"64MB"`` -> 67108864. Units B, KB, MB, GB (also K, M, G, KiB, ...) are powers of 1024.

    Raises:
        ValueError: not a whole number with one of those units, or below 4 bytes.
    """
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"size {text!r} is not a whole number with a unit B, KB, MB or GB, e.g. 64KB")
    size = int(match["number"]) * _SIZE_UNITS[match["prefix"].lower()]
    if size < FLOAT_BYTES:
        raise ValueError(f"size {text!r} is less than one float32 ({FLOAT_BYTES} bytes)")
    return size


def format_size(size: int) -> str:
    """67108864 -> ``"64MB"``; sizes that are not whole KB/MB/GB stay in bytes."""
    for unit, factor in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


def parse_sizes(text: str, factor: int = 4) -> list[int]:
    """``"1KB..64MB"`` -> 1 KB, 4 KB, ..., 64 MB (each ``factor`` times the last); ``"1MB,16MB"`` -> those.

    Raises:
        TypeError: ``factor`` is not an int.
        ValueError: a bad size, an empty range, or ``factor < 2``.
    """
    check_int("--factor", factor, minimum=2)
    if ".." in text:
        low_text, _, high_text = text.partition("..")
        low, high = parse_size(low_text), parse_size(high_text)
        if low > high:
            raise ValueError(f"--sizes {text!r}: the first size is larger than the last")
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= factor
        return sizes
    sizes = [parse_size(item) for item in text.split(",")]
    return list(dict.fromkeys(sizes))


def bus_bandwidth(op: str, size_bytes: int, time_s: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s of one ``op`` of ``size_bytes`` that took ``time_s`` on ``world_size`` ranks.

    nccl-tests' definitions: all-reduce busbw = algbw x 2(n-1)/n; all-gather
    busbw = algbw x (n-1)/n with ``size_bytes`` the gathered output. On one
    rank nothing crosses a link: busbw is 0.

    Raises:
        TypeError: ``time_s`` is not a number or ``world_size`` not an int.
        ValueError: an unknown ``op``, ``time_s <= 0`` or ``world_size < 1``.
    """
    check_choice("op", op, OPS)
    check_number("time_s", time_s, minimum=0, min_inclusive=False)
    check_int("world_size", world_size, minimum=1)
    algbw = size_bytes / time_s
    n = world_size
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return algbw, algbw * factor


def iterations_for(size_bytes: int, iters: int) -> int:
    """Timed calls for one measurement: ``iters``, fewer for large messages (at least 2)."""
    return max(2, min(iters, BYTES_PER_MEASUREMENT // size_bytes))


def _elements(op: str, size_bytes: int, world_size: int) -> int:
    """float32 elements per rank's input: the whole message for all-reduce, a 1/n share of the output for all-gather."""
    count = max(size_bytes // FLOAT_BYTES, 1)
    return count if op == "all_reduce" else max(count // world_size, 1)


# -- the job on every worker ---------------------------------------------------------------
def _worker(spec: dict[str, Any]) -> int:
    """Time every size, op and path; rank 0 writes the result to ``spec["out"]``. Collective."""
    import torch

    import bunsan
    from bunsan import comm
    from bunsan.comm import bench_raw

    bunsan.init()
    n, rank = bunsan.size(), bunsan.rank()
    slowest = torch.zeros(1, dtype=torch.float64)

    def measure(call: Callable[[], object], iters: int, barrier: Callable[[], None]) -> float:
        """Seconds per call on the slowest rank. Collective."""
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        elapsed = time.perf_counter() - start
        slowest.fill_(elapsed / iters)
        comm.all_reduce(slowest, op="max")  # not timed
        return float(slowest)

    rows = []
    for size in spec["sizes"]:
        iters = iterations_for(size, spec["iters"])
        for op in spec["ops"]:
            count = _elements(op, size, n)
            tensor = torch.full((count,), float(rank + 1))
            output = torch.empty(count * n if op == "all_gather" else 0)
            paths: dict[str, Callable[[], object]] = (
                {"bunsan": partial(comm.all_reduce, tensor), "torch": partial(bench_raw.raw_all_reduce, tensor)}
                if op == "all_reduce"
                else {
                    "bunsan": partial(comm.all_gather_into, output, tensor),
                    "torch": partial(bench_raw.raw_all_gather_into, output, tensor),
                }
            )
            barriers = {"bunsan": comm.barrier, "torch": bench_raw.raw_barrier}
            for call in paths.values():
                for _ in range(spec["warmup"]):
                    call()
            rounds: dict[str, list[float]] = {path: [] for path in paths}
            for _ in range(spec["rounds"]):  # alternate, so that noise hits both paths alike
                for path, call in paths.items():
                    rounds[path].append(measure(call, iters, barriers[path]))
            if op == "all_gather":  # a check that it gathered what it should, outside the clock
                expected = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(count)
                if not torch.equal(output, expected):
                    raise RuntimeError(f"all_gather of {size} bytes gathered wrong values")
            actual = count * FLOAT_BYTES * (1 if op == "all_reduce" else n)
            rows.append(
                {
                    "size_bytes": actual,
                    "requested_bytes": size,
                    "op": op,
                    "iters": iters,
                    **{f"{path}_s": statistics.median(rounds[path]) for path in paths},
                    **{f"{path}_rounds_s": rounds[path] for path in paths},
                }
            )
            del tensor, output

    copies = []
    comm.barrier()
    if rank == 0:  # the others wait in the barrier below: the copy has the machine to itself
        for size in spec["sizes"]:
            count = max(size // FLOAT_BYTES, 1)
            src, dst = torch.randn(count), torch.empty(count)
            iters = iterations_for(size, spec["iters"])
            for _ in range(spec["warmup"]):
                dst.copy_(src)
            timings = []
            for _ in range(spec["rounds"]):
                start = time.perf_counter()
                for _ in range(iters):
                    dst.copy_(src)
                timings.append((time.perf_counter() - start) / iters)
            copies.append({"size_bytes": count * FLOAT_BYTES, "copy_s": statistics.median(timings)})
    comm.barrier()
    if rank == 0:
        Path(spec["out"]).write_text(
            json.dumps(
                {
                    "workers": n,
                    "rows": rows,
                    "copies": copies,
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                },
                indent=1,
            )
        )
    bunsan.finalize()
    return 0


# -- the table -----------------------------------------------------------------------------
COLUMNS = (
    "size",
    "op",
    "iters",
    "bunsan (ms)",
    "bunsan busbw (GB/s)",
    "torch (ms)",
    "torch busbw (GB/s)",
    "bunsan/torch",
    "copy (GB/s)",
)
_RIGHT = set(COLUMNS) - {"op"}


def _rows_with_bandwidth(result: dict[str, Any]) -> list[dict[str, Any]]:
    n = result["workers"]
    copies = {c["size_bytes"]: c["size_bytes"] / c["copy_s"] for c in result.get("copies", [])}
    rows = []
    for row in result["rows"]:
        row = dict(row)
        for path in ("bunsan", "torch"):
            row[f"{path}_algbw"], row[f"{path}_busbw"] = bus_bandwidth(
                row["op"], row["size_bytes"], row[f"{path}_s"], n
            )
        row["time_ratio"] = row["bunsan_s"] / row["torch_s"]
        row["copy_bandwidth"] = copies.get(row["requested_bytes"]) or copies.get(row["size_bytes"])
        rows.append(row)
    return rows


def table_rows(rows: Iterable[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one row per (size, op), from rows with bandwidths (GB/s = 1e9 B/s)."""
    cells = []
    for r in rows:
        copy = r.get("copy_bandwidth")
        cells.append(
            [
                format_size(r["requested_bytes"]),
                r["op"],
                str(r["iters"]),
                f"{1000 * r['bunsan_s']:.3f}",
                f"{r['bunsan_busbw'] / 1e9:.3f}",
                f"{1000 * r['torch_s']:.3f}",
                f"{r['torch_busbw'] / 1e9:.3f}",
                f"{r['time_ratio']:.2f}",
                "-" if copy is None else f"{copy / 1e9:.2f}",
            ]
        )
    return cells


def plot_comm(rows: Sequence[dict[str, Any]], path: Path, workers: int, network: str) -> Path | None:
    """``comm.png``: busbw against message size for each op and path, with the copy bandwidth as the ceiling."""
    from bunsan.bench import plots

    if not rows:
        return None
    figure, (axes,) = plots.new_figure(1)
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        if not mine:
            continue
        for way, style in (("bunsan", "-"), ("torch", "--")):
            axes.plot(
                [r["requested_bytes"] for r in mine],
                [r[f"{way}_busbw"] / 1e9 for r in mine],
                linestyle=style,
                marker="o",
                markersize=3,
                label=f"{op}, {way}",
            )
    copies = sorted({(r["requested_bytes"], r["copy_bandwidth"]) for r in rows if r.get("copy_bandwidth")})
    if copies:
        axes.plot(
            [c[0] for c in copies],
            [c[1] / 1e9 for c in copies],
            color="black",
            linestyle=":",
            label="tensor.copy_ (1 thread)",
        )
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    sizes = sorted({r["requested_bytes"] for r in rows})
    axes.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45, fontsize="small")
    axes.set_xlabel("message size (all-gather: the gathered output)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize="small")
    figure.suptitle(f"collectives on {workers} workers, {network}")
    return plots.save_figure(figure, path)


# -- the command ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``bunsan bench comm`` to ``parser``."""
    parser.add_argument("-np", "--np", dest="workers", type=int, default=2, help="workers; default %(default)s")
    parser.add_argument(
        "--sizes",
        default="1KB..64MB",
        help="LOW..HIGH (each --factor times the last) or a comma list; default %(default)s",
    )
    parser.add_argument("--factor", type=int, default=4, help="step of a LOW..HIGH range; default %(default)s")
    parser.add_argument("--ops", default="all_reduce,all_gather", help="comma list; default %(default)s")
    parser.add_argument(
        "--iters",
        type=int,
        default=50,
        help="timed calls per measurement (fewer above 256MB/iters); default %(default)s",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first; default %(default)s")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds per path, median reported; default %(default)s"
    )
    add_job_arguments(parser, "comm", timeout_s=600.0, one_job=True)
    parser.add_argument("--dry-run", action="store_true", help="check the input and print the job, start nothing")
    netns.add_arguments(parser)


def _spec(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"--ops {args.ops!r}: choose from {', '.join(OPS)}")
    check_int("-np", args.workers, minimum=2, hint="a collective needs two workers")
    check_at_least(
        ("--iters", args.iters, 1),
        ("--warmup", args.warmup, 0),
        ("--rounds", args.rounds, 1),
        ("--threads", args.threads, 1),
    )
    check_positive("--timeout-s", args.timeout_s)
    refusal = netns.check_network_argument(args)
    if refusal is not None:
        raise ValueError(refusal)
    return {
        "sizes": parse_sizes(args.sizes, args.factor),
        "ops": list(dict.fromkeys(ops)),
        "iters": args.iters,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "out": str(out),
    }


def run(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """``bunsan bench comm``: run the job, print the table, write JSON and the plot.

    Returns 0 on success, 1 when the job failed, 2 for bad input (no job started).
    """
    started = time.time()
    out = Path(args.out)
    result_path = out / "result.json"
    try:
        spec = _spec(args, result_path.resolve())
    except (TypeError, ValueError) as err:
        return refuse(PROG, err)
    command = job_command(WORKER_MODULE, "--worker", spec, args.workers, args.network)
    if args.dry_run:
        say(shlex.join(command))
        return 0
    result_path.unlink(missing_ok=True)
    load_before = load_average()
    job: dict[str, Any] = {"label": PROG, "workers": args.workers, "dir": str(out)}
    try:
        result = run_recorded_job(command, out, result_path, job, args.timeout_s, job_environment(args.threads))
    except KeyboardInterrupt:
        say("interrupted; the job was stopped")
        return 130
    if result is None:
        report_failures([job], say)
        return 1
    total_s = job["total_s"]

    rows = _rows_with_bandwidth(result)
    network = f"links shaped to {netns.parse_network(args.network).label}" if args.network else "Gloo over loopback"
    say(
        f"{args.workers} workers, float32, {network}, {args.threads} thread(s) per worker; median of {args.rounds} "
        f"alternating rounds; busbw as nccl-tests (all-reduce x 2(n-1)/n, all-gather x (n-1)/n of the output size); "
        f"copy = local tensor.copy_ on rank 0; job {total_s:.1f} s"
    )
    cells = table_rows(rows)
    say(format_table(COLUMNS, cells, right=_RIGHT))
    document = {
        **record_header("comm", args, load_before, started),
        "workers": result["workers"],
        "network": args.network,
        "columns": list(COLUMNS),
        "table": cells,
        "rows": rows,
        "copies": result.get("copies", []),
    }
    write_record(args, out, document, say)
    if not args.no_plots:
        path = plot_comm(rows, (Path(args.plots) if args.plots else out / "plots") / "comm.png", args.workers, network)
        if path is not None:
            say(f"plot: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bunsan.bench.comm_bench``: the same as ``bunsan bench comm``; ``--worker SPEC`` runs a worker."""
    return command_main(argv, PROG, DESCRIPTION, EPILOG, add_arguments, run, worker=_worker)


if __name__ == "__main__":
    sys.exit(main())
