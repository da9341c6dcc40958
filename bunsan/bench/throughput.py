"""``bunsan bench throughput``: images per second on synthetic data, and the scaling efficiency.

The measurement of Horovod's synthetic benchmark, for any registered model and
algorithm: every worker trains the model on one fixed random batch of its own
(so no data loading is measured), first ``--warmup`` steps untimed, then
``--iters`` timed iterations of ``--batches-per-iter`` steps each::

    bunsan bench throughput --model resnet20 -np 1,2,4 --algorithm data_parallel \\
        --batch 32 --warmup 5 --iters 20

Each worker count is one ``bunsan run -np N`` job, one after another (jobs
running at once would share the cores), with a timeout; a job that fails is a
``failed`` row with its stderr kept and the others go on.

For every timed iteration ``i`` and worker ``r``, ``batch x batches-per-iter /
time(i, r)`` is that worker's images/s; ``per worker`` is their mean over the
workers and ``total`` their sum. The table shows the mean over iterations
+- 1.96 standard deviations (the spread of one iteration, Horovod's "+-1.96
sigma"; not a confidence interval of the mean). Then

* ``efficiency`` = total(N) / (N x total(1)) of the same algorithm setting
  (relative to the first worker count given when 1 is not among them:
  total(N) / (N / N0 x total(N0))), DESIGN.md's scaling efficiency;
* ``vs first``: total(N) of this setting / total(N) of the first ``--algorithm``
  setting, with several settings;
* ``bytes/step``: bytes one worker sent per optimizer step in the timed
  iterations, as counted by the algorithm itself (``algorithm.stats()``).

``--batch`` is PER WORKER here (Horovod's convention: the global batch grows
with N), unlike ``bunsan bench compare``, whose ``--batch`` is global. The
learning rate does not matter for speed; the data are random.

This module imports no torch at the top: ``bunsan`` builds
its command-line parser from it without importing torch. The same module is
the job every worker runs (``python -m bunsan.bench.throughput --worker SPEC``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bunsan._table import format_table
from bunsan.bench import netns
from bunsan.bench._common import (
    Refused,
    add_job_arguments,
    check_at_least,
    check_positive,
    command_main,
    job_command,
    job_directory,
    job_environment,
    load_average,
    record_document,
    refuse,
    report_failures,
    run_jobs,
    say_jobs,
    usable_cores,
    write_record,
)
from bunsan.bench.specs import AlgorithmSetting, check_setting, parse_algorithm_spec, parse_workers, reference_workers
from bunsan.bench.synthetic import model_inputs, train_timed

__all__ = [
    "COLUMNS",
    "DESCRIPTION",
    "EPILOG",
    "add_arguments",
    "main",
    "model_inputs",
    "oversubscribed",
    "plot_throughput",
    "run",
    "scaling_efficiency",
    "summarize",
    "table_rows",
    "throughputs",
]

PROG = "bunsan bench throughput"
WORKER_MODULE = "bunsan.bench.throughput"  # this module is also the job every worker runs

DESCRIPTION = """\
Horovod-style synthetic benchmark: train MODEL on a fixed random batch per
worker and report images/s per worker and in total (mean +- 1.96 sigma over the
timed iterations, after warm-up), the scaling efficiency
total(N) / (N x total(1)), and the bytes each worker sent per step as counted by
the algorithm (algorithm.stats()). Each worker count is one `bunsan run -np N`
job, one after another. --batch is PER WORKER. Writes a JSON record and a PNG
plot (throughput and efficiency against workers). With --network the workers
run in network namespaces on links shaped to a rate (root only)."""

EPILOG = """\
examples:
  bunsan bench throughput --model resnet20 -np 1,2,4 --batch 32 --warmup 5 --iters 20
  bunsan bench throughput --model cifar_convnet -np 1,2 --algorithm data_parallel data_parallel:bits=1
  bunsan bench throughput --model cifar_convnet -np 1,2 --network rate=100mbit \\
      --algorithm data_parallel data_parallel:bits=1"""


# -- pure ----------------------------------------------------------------------------------
def summarize(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, 1.96 x standard deviation)`` of ``values`` (population deviation, as Horovod's numpy)."""
    if not values:
        raise ValueError("nothing to summarize: no timed iterations")
    return statistics.fmean(values), 1.96 * statistics.pstdev(values)


def throughputs(times_s: Sequence[Sequence[float]], images_per_iter: int) -> tuple[list[float], list[float]]:
    """Per-iteration images/s, ``(per worker, total)``, from ``times_s[rank][iteration]``.

    Per worker is the mean over the workers of ``images_per_iter / time``; total is their sum.
    """
    if not times_s or any(len(t) != len(times_s[0]) for t in times_s):
        raise ValueError("every worker must report the same number of iterations")
    rates = [[images_per_iter / t for t in worker] for worker in times_s]
    totals = [sum(column) for column in zip(*rates)]
    return [total / len(rates) for total in totals], totals


def scaling_efficiency(total: float, workers: int, reference_total: float, reference_workers: int = 1) -> float:
    """``total(N) / (N / N0 x total(N0))``: 1.0 is perfect linear scaling."""
    return total / (workers / reference_workers * reference_total)


def oversubscribed(workers: int, threads: int, cores: int) -> bool:
    """Whether ``workers x threads`` intra-op threads exceed the ``cores`` this process may use."""
    return workers * threads > cores


COLUMNS = (
    "workers",
    "algorithm",
    "per worker (img/s)",
    "total (img/s)",
    "efficiency",
    "vs first",
    "step (ms)",
    "bytes/step",
    "note",
)
_RIGHT = set(COLUMNS) - {"algorithm", "note"}


def _pm(mean: float | None, spread: float | None) -> str:
    if mean is None:
        return "-"
    digits = 1 if mean < 100 else 0
    return f"{mean:.{digits}f} +- {spread:.{digits}f}"


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table_rows(records: Iterable[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one row per (setting, worker count) record."""
    rows = []
    for r in records:
        if r.get("status") != "ok":
            rows.append(
                [
                    str(r["workers"]),
                    r["label"],
                    str(r.get("status", "failed")),
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    r.get("note", ""),
                ]
            )
            continue
        rows.append(
            [
                str(r["workers"]),
                r["label"],
                _pm(r["per_worker_mean"], r["per_worker_spread"]),
                _pm(r["total_mean"], r["total_spread"]),
                _cell(r.get("efficiency"), ".2f"),
                _cell(r.get("vs_first"), ".2f"),
                _cell(r.get("step_ms"), ".1f"),
                _cell(r.get("bytes_sent_per_step"), ".0f"),
                r.get("note", ""),
            ]
        )
    return rows


# -- the command ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``bunsan bench throughput`` to ``parser``."""
    parser.add_argument("--model", default="resnet20", help="model name (bunsan.models.names()); default %(default)s")
    parser.add_argument(
        "-np",
        "--np",
        dest="workers",
        default="1,2",
        metavar="N,N,...",
        help="worker counts, comma-separated; default %(default)s",
    )
    parser.add_argument(
        "--algorithm",
        "--algorithms",
        dest="algorithms",
        nargs="+",
        default=["data_parallel"],
        metavar="SPEC",
        help="algorithm setting(s) NAME[:KEY=VALUE,...]; default data_parallel",
    )
    parser.add_argument("--batch", type=int, default=32, help="images per worker per step; default %(default)s")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first; default %(default)s")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations; default %(default)s")
    parser.add_argument(
        "--batches-per-iter", type=int, default=1, help="steps per timed iteration; default %(default)s"
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="side of the synthetic images; default the model's own (32 for CIFAR models)",
    )
    parser.add_argument("--num-classes", type=int, default=10, help="default %(default)s")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate; default %(default)s")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum; default %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="model and data; default %(default)s")
    add_job_arguments(parser, "throughput", timeout_s=900.0)
    parser.add_argument("--dry-run", action="store_true", help="check the input and print the jobs, start nothing")
    netns.add_arguments(parser)


def _check(args: argparse.Namespace) -> tuple[list[int], list[tuple[AlgorithmSetting, dict[str, Any]]]]:
    try:
        workers = parse_workers(args.workers)
        settings = [parse_algorithm_spec(s) for s in args.algorithms]
        if len({s.label for s in settings}) != len(settings):
            raise ValueError("an --algorithm setting is given twice")
        check_at_least(
            ("--batch", args.batch, 1),
            ("--warmup", args.warmup, 0),
            ("--iters", args.iters, 1),
            ("--batches-per-iter", args.batches_per_iter, 1),
            ("--threads", args.threads, 1),
            ("--num-classes", args.num_classes, 1),
        )
        check_positive("--timeout-s", args.timeout_s)
        from bunsan import models

        if args.model not in models.names():
            raise ValueError(f"unknown model {args.model!r}; choose one of {', '.join(models.names())}")
        model_inputs(args.model, args.image_size, args.num_classes)
        refusal = netns.check_network_argument(args)
        if refusal is not None:
            raise ValueError(refusal)
        return workers, [(setting, check_setting(setting)) for setting in settings]
    except (TypeError, ValueError) as err:
        raise Refused(str(err)) from None


def _spec(args: argparse.Namespace, setting: AlgorithmSetting, out: Path) -> dict[str, Any]:
    return {
        "model": args.model,
        "algorithm": setting.name,
        "options": dict(setting.options),
        "batch": args.batch,
        "warmup": args.warmup,
        "iters": args.iters,
        "batches_per_iter": args.batches_per_iter,
        "image_size": args.image_size,
        "num_classes": args.num_classes,
        "lr": args.lr,
        "momentum": args.momentum,
        "seed": args.seed,
        "out": str(out),
    }


def _command(args: argparse.Namespace, setting: AlgorithmSetting, n: int, result: Path) -> list[str]:
    return job_command(WORKER_MODULE, "--worker", _spec(args, setting, result), n, args.network)


def _record(
    args: argparse.Namespace, setting: AlgorithmSetting, described: dict[str, Any], n: int, out: Path, cores: int
) -> dict[str, Any]:
    directory = job_directory(out, n, setting.label)
    record = {"label": setting.label, "workers": n, "batch": args.batch, "dir": str(directory), **described}
    if oversubscribed(n, args.threads, cores):
        record["note"] = f"oversubscribed: {n} x {args.threads} threads on {cores} cores"
    return record


def _take_result(args: argparse.Namespace, record: dict[str, Any], result: dict[str, Any]) -> None:
    per_worker, total = throughputs(result["times_s"], args.batch * args.batches_per_iter)
    record["per_worker_mean"], record["per_worker_spread"] = summarize(per_worker)
    record["total_mean"], record["total_spread"] = summarize(total)
    record["step_ms"] = 1000 * statistics.fmean(t for w in result["times_s"] for t in w) / args.batches_per_iter
    record["per_worker_per_iter"], record["total_per_iter"] = per_worker, total
    for key in ("times_s", "bytes_sent_per_step", "threads", "parameters", "input_shape", "algorithm_repr"):
        record[key] = result.get(key)


def _progress(record: dict[str, Any]) -> str:
    if record["status"] == "ok":
        return f"{record['total_mean']:.1f} img/s in total ({record['total_s']:.1f} s in all)"
    return f"{record['status'].upper()}; see {record['dir']}/stderr.txt ({record['total_s']:.1f} s in all)"


def _finish(records: list[dict[str, Any]], workers: list[int], first_label: str) -> int:
    """Add efficiency and ``vs first`` to the records; return the reference worker count."""
    reference = reference_workers(workers)
    base = {r["label"]: r["total_mean"] for r in records if r["status"] == "ok" and r["workers"] == reference}
    first = {r["workers"]: r["total_mean"] for r in records if r["status"] == "ok" and r["label"] == first_label}
    for r in records:
        if r["status"] != "ok":
            continue
        if r["label"] in base:
            r["efficiency"] = scaling_efficiency(r["total_mean"], r["workers"], base[r["label"]], reference)
            r["speedup"] = r["total_mean"] / base[r["label"]]
        if len({x["label"] for x in records}) > 1 and r["workers"] in first:
            r["vs_first"] = r["total_mean"] / first[r["workers"]]
    return reference


def run(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """``bunsan bench throughput``: check, run one job per (setting, worker count), print the table, write JSON and plots.

    Returns 0 when every job succeeded, 1 when some failed, 2 for bad input (no job started).
    """
    started = time.time()
    try:
        workers, settings = _check(args)
    except Refused as err:
        return refuse(PROG, err)
    out = Path(args.out)
    cores = usable_cores()
    jobs = [
        (_record(args, setting, described, n, out, cores), partial(_command, args, setting, n))
        for setting, described in settings
        for n in workers
    ]
    if args.dry_run:
        return say_jobs(jobs, say)

    load_before = load_average()
    records, interrupted = run_jobs(
        jobs,
        args.timeout_s,
        job_environment(args.threads),
        on_result=partial(_take_result, args),
        progress=_progress,
        say=say,
    )
    reference = _finish(records, workers, settings[0][0].label)
    shape = "x".join(map(str, model_inputs(args.model, args.image_size, args.num_classes)[1]))
    network = (
        f"links shaped to {netns.parse_network(args.network).label} (network namespaces)"
        if args.network
        else "Gloo over loopback"
    )
    say("")
    say(
        f"{args.model} on synthetic {shape} inputs, batch {args.batch} per worker, {args.iters} iterations of "
        f"{args.batches_per_iter} step(s) after {args.warmup} warm-up steps, {args.threads} thread(s) per worker, "
        f"{cores} usable cores, {network}; mean +- 1.96 sigma over iterations; "
        f"efficiency = total(N) / (N / {reference} x total({reference}))"
    )
    rows = table_rows(records)
    say(format_table(COLUMNS, rows, right=_RIGHT))
    failed = report_failures(records, say)

    document = record_document("throughput", args, reference, load_before, started, COLUMNS, rows, records)
    write_record(args, out, document, say)
    if not args.no_plots:
        path = plot_throughput(records, Path(args.plots) if args.plots else out / "plots", args.model, reference)
        if path is not None:
            say(f"plot: {path}")
    if interrupted:
        return 130
    return 1 if failed else 0


def plot_throughput(records: Sequence[dict[str, Any]], directory: Path, model: str, reference: int) -> Path | None:
    """``throughput.png``: total images/s (with the +-1.96 sigma bars and ideal scaling) and efficiency against workers."""
    from bunsan.bench import plots

    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        return None
    figure, (rate_axes, efficiency_axes) = plots.new_figure(2)
    counts = sorted({r["workers"] for r in ok})
    for label in dict.fromkeys(r["label"] for r in ok):
        rs = sorted((r for r in ok if r["label"] == label), key=lambda r: r["workers"])
        x = [r["workers"] for r in rs]
        line = rate_axes.errorbar(
            x, [r["total_mean"] for r in rs], yerr=[r["total_spread"] for r in rs], marker="o", capsize=3, label=label
        )
        base = next((r["total_mean"] for r in rs if r["workers"] == reference), None)
        if base is not None:
            rate_axes.plot(
                counts,
                [n / reference * base for n in counts],
                linestyle=":",
                color=line[0].get_color(),
                label=f"{label}, linear",
            )
        with_efficiency = [r for r in rs if r.get("efficiency") is not None]
        efficiency_axes.plot(
            [r["workers"] for r in with_efficiency], [r["efficiency"] for r in with_efficiency], marker="o", label=label
        )
    rate_axes.set_ylabel("images/s, all workers")
    efficiency_axes.set_ylabel(f"scaling efficiency vs {reference} worker{'s' if reference > 1 else ''}")
    efficiency_axes.axhline(1.0, color="grey", linewidth=0.8)
    efficiency_axes.set_ylim(0, 1.15)
    for axes in (rate_axes, efficiency_axes):
        axes.set_xlabel("workers")
        axes.set_xticks(counts)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    rate_axes.set_ylim(bottom=0)
    figure.suptitle(f"{model}: synthetic-data throughput")
    return plots.save_figure(figure, Path(directory) / "throughput.png")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bunsan.bench.throughput``: the same as ``bunsan bench throughput``; ``--worker SPEC`` runs one job's worker."""
    return command_main(argv, PROG, DESCRIPTION, EPILOG, add_arguments, run, worker=train_timed)


if __name__ == "__main__":
    sys.exit(main())
