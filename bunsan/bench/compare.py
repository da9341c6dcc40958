"""``bunsan bench compare``: train every algorithm setting at every worker count, one table.

The shape of the CNTK 2.2 distributed-training benchmark: for 1, 2, 4 workers
and each parallel SGD algorithm (exact, 1-bit, warm-started, block momentum,
model averaging), the wall time, the speed ratio to one worker and the test
error after the same number of epochs; plus sweeps of the warm-start size and
the block size. One invocation runs them all, side by side on one machine, so
the ratios are measured under the same conditions::

    bunsan bench compare --model mnist1d_cnn --dataset mnist1d \\
        --algorithms data_parallel "block_momentum:block_size=1024" "model_averaging:block_size=1024" \\
        -np 1,2,4 --epochs 20 --batch 64 --lr 0.05 --momentum 0.9 --out runs/compare

Each (setting x worker count) is one ``bunsan run -np N`` job of
:mod:`bunsan.bench.job`, started from this Python, one after another (jobs
running at once would share the cores and spoil each other's times), each
with a timeout. A job that fails or times out is a ``failed`` row with its
stderr kept; the others go on.

What is held fixed across worker counts, so that the rows compare:

* ``--batch`` is the GLOBAL minibatch. Each of N workers takes ``batch / N``
  samples per step (an indivisible batch is refused before anything starts),
  so every worker count takes the same optimizer steps per epoch. This is the
  framing of exact ``data_parallel``'s defaults: the same global minibatch, the
  same learning rate, the same arithmetic at every N.
* ``--batch-per-worker`` takes the other common framing: ``--batch`` is each
  worker's minibatch, equal to a single-process script's (as when a script's
  ``batch_size=32`` is left as it is under ``bunsan run``), so N workers train
  ``N x batch`` samples per step and take N times fewer steps per epoch. This
  is the framing of ``block_momentum``'s CNTK defaults (block learning rate
  about N through ``block_momentum = 1 - 1/N``): each worker runs the
  single-process recipe and the block update adds the workers' progress.
* The learning rate, momentum, epochs and seed are the same for every row.
  No rescaling with N: the global minibatch does not change.
* At 1 worker there is nobody to exchange with: exact ``data_parallel``,
  ``model_averaging`` and ``block_momentum`` with ``reset_local_momentum=false``
  and ``block_learning_rate=1`` are plain SGD with the same local optimizer
  (equal up to rounding; only the counted bytes differ), while default
  ``block_momentum`` and a quantized ``data_parallel`` differ from plain SGD
  even alone. The 1-worker rows are the reference of the speed ratio.

Columns: ``time`` is the training wall time (from a barrier after start-up to
a barrier after ``optimizer.join()``); ``speed`` is ``time(1 worker) /
time(N)`` of the same setting (or relative to the first worker count given,
when 1 is not among them); ``error`` is the final model's test error;
``bytes/sample`` is what one worker sent per sample it trained, as counted by
the algorithm itself (``algorithm.stats()``); ``samples/s`` is training
throughput of all workers together. The JSON record also holds the
per-epoch curves, the start-up and total times and the machine.

This module imports no torch at the top: ``bunsan`` builds
its command-line parser from it without importing torch.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bunsan._table import format_table, format_transposed
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
    run_job,
    run_jobs,
    run_recorded_job,
    say_jobs,
    write_record,
)
from bunsan.bench.compare_table import COLUMNS, RIGHT, speed_ratios, speedups_vs_first, table_rows
from bunsan.bench.specs import (
    AlgorithmSetting,
    Sweep,
    apply_sweeps,
    check_setting,
    format_value,
    parse_algorithm_spec,
    parse_sweep,
    parse_value,
    parse_workers,
    per_worker_batch,
    reference_workers,
)

# The parsing (bunsan.bench.specs), the job running (bunsan.bench._common) and the table
# formatter (bunsan._table) were this module's; their names stay importable from here.
__all__ = [
    "COLUMNS",
    "DESCRIPTION",
    "EPILOG",
    "AlgorithmSetting",
    "Sweep",
    "add_arguments",
    "apply_sweeps",
    "check_setting",
    "format_table",
    "format_transposed",
    "format_value",
    "global_batch",
    "main",
    "parse_algorithm_spec",
    "parse_sweep",
    "parse_value",
    "parse_workers",
    "per_worker_batch",
    "record_document",
    "reference_workers",
    "report_failures",
    "run",
    "run_job",
    "run_recorded_job",
    "speed_ratios",
    "speedups_vs_first",
    "table_rows",
]

PROG = "bunsan bench compare"
JOB_MODULE = "bunsan.bench.job"  # what every worker of a job runs

DESCRIPTION = """\
Train every algorithm setting at every worker count, one `bunsan run -np N`
job each, one after another, and print the table of the CNTK benchmark:
workers, algorithm, bits, warm start, block size, epochs, wall time, speed
ratio to 1 worker, test error, bytes/sample, samples/s. Also writes a JSON
record and PNG plots.

--batch is the GLOBAL minibatch: each of N workers takes batch/N (it must
divide evenly), and lr, momentum, epochs and seed are the same for every row.
With --batch-per-worker, --batch is each worker's minibatch instead (a
single-process script's), and N workers train N x batch samples per step.
At 1 worker exact data_parallel and model_averaging are plain SGD (only the
counted bytes differ; block_momentum resets the local momentum after each
block, quantized data_parallel still quantizes); the 1-worker row is the
reference of the speed ratio of its setting.

An algorithm setting is NAME[:KEY=VALUE,...]; values are read as int, float,
true/false, none, or else a string. block_size is in samples PER WORKER;
warm_start in samples of all workers together."""

EPILOG = """\
examples:
  bunsan bench compare --model mnist1d_cnn --dataset mnist1d -np 1,2,4 --epochs 20 --batch 64 \\
      --algorithms data_parallel "data_parallel:compression=fp16" "block_momentum:block_size=1024"
  bunsan bench compare --algorithms "block_momentum:block_size=256" -np 4 --sweep block_size=256,1024,4096
  bunsan bench compare --algorithms "model_averaging:block_size=512" -np 4 \\
      --sweep model_averaging:warm_start=0,2000,8000 --json warm.json --plots plots/"""


# -- validation and the jobs -----------------------------------------------------------
# -- the command -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``bunsan bench compare`` to ``parser``."""
    parser.add_argument(
        "--model", default="mnist1d_cnn", help="model name (bunsan.models.names()); default %(default)s"
    )
    parser.add_argument(
        "--dataset", default="mnist1d", help="data set name (bunsan.datasets.names()); default %(default)s"
    )
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["data_parallel"],
        metavar="SPEC",
        help="algorithm settings NAME[:KEY=VALUE,...]; default data_parallel",
    )
    parser.add_argument(
        "-np",
        "--np",
        dest="workers",
        default="1,2,4",
        metavar="N,N,...",
        help="worker counts, comma-separated; default %(default)s",
    )
    parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="[ALGO:]KEY=V1,V2,...",
        help="one setting per value (e.g. warm_start=0,2000,8000); ALGO limits it to one "
        "algorithm; repeat to cross several",
    )
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run; default %(default)s")
    parser.add_argument(
        "--batch", type=int, default=64, help="GLOBAL minibatch, split evenly over the workers; default %(default)s"
    )
    parser.add_argument(
        "--batch-per-worker",
        action="store_true",
        help="--batch is each worker's minibatch (a single-process script's), not the global one: "
        "N workers train N x batch samples per step",
    )
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate, the same for all; default %(default)s")
    parser.add_argument("--momentum", type=float, default=0.9, help="local SGD momentum; default %(default)s")
    parser.add_argument("--nesterov", action="store_true", help="Nesterov momentum (torch.optim.SGD(nesterov=True))")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="local SGD weight decay; default %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="initial model and data order; default %(default)s")
    add_job_arguments(parser, "compare", timeout_s=1800.0)
    parser.add_argument("--no-curves", action="store_true", help="skip per-epoch test errors (no model copies)")
    parser.add_argument(
        "--recompute-bn",
        action="store_true",
        help="evaluate every setting's models with batch-norm statistics recomputed over the training set "
        "(the running statistics of small local batches lag the weights); default: the running statistics",
    )
    parser.add_argument(
        "--layout",
        choices=("rows", "columns", "both"),
        default="rows",
        help="rows: one row per run; columns: one column per run, as in the CNTK article",
    )
    parser.add_argument("--dry-run", action="store_true", help="check the input and print the jobs, start nothing")


def _plan(args: argparse.Namespace) -> tuple[list[tuple[AlgorithmSetting, dict[str, Any]]], list[int]]:
    """The checked settings (with what the table shows of each) and the worker counts; Refused on bad input."""
    try:
        workers = parse_workers(args.workers)
        settings = apply_sweeps(
            [parse_algorithm_spec(s) for s in args.algorithms], [parse_sweep(s) for s in args.sweep]
        )
        check_at_least(("--batch", args.batch, 1))
        uneven = [] if getattr(args, "batch_per_worker", False) else [n for n in workers if args.batch % n]
        if uneven:
            raise ValueError(
                f"the global minibatch --batch {args.batch} does not split evenly over {uneven[0]} workers; "
                f"choose a multiple of {math.lcm(*workers)} for -np {args.workers}"
            )
        check_at_least(("--epochs", args.epochs, 1), ("--threads", args.threads, 1))
        check_positive("--lr", args.lr)
        check_positive("--timeout-s", args.timeout_s)
        return [(setting, check_setting(setting)) for setting in settings], workers
    except (TypeError, ValueError) as err:
        raise Refused(str(err)) from None


def global_batch(batch: int, workers: int, batch_per_worker: bool) -> int:
    """The minibatch of all ``workers`` together: ``batch``, or ``workers x batch`` when it is per worker."""
    return batch * workers if batch_per_worker else batch


def _job_spec(args: argparse.Namespace, setting: AlgorithmSetting, out: Path, workers: int) -> dict[str, Any]:
    batch = global_batch(args.batch, workers, getattr(args, "batch_per_worker", False))
    return {
        "model": args.model,
        "dataset": args.dataset,
        "algorithm": setting.name,
        "options": dict(setting.options),
        "epochs": args.epochs,
        "batch": batch,
        "lr": args.lr,
        "momentum": args.momentum,
        "nesterov": getattr(args, "nesterov", False),
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "out": str(out),
        "curves": not args.no_curves,
        "recompute_bn": bool(getattr(args, "recompute_bn", False)),
    }


def _record(
    setting: AlgorithmSetting, described: dict[str, Any], workers: int, args: argparse.Namespace, directory: Path
) -> dict[str, Any]:
    batch = global_batch(args.batch, workers, getattr(args, "batch_per_worker", False))
    return {
        "label": setting.label,
        "workers": workers,
        "epochs": args.epochs,
        "batch": batch,
        "per_worker_batch": batch // workers,
        "dir": str(directory),
        **described,
    }


def _command(workers: int, spec: dict[str, Any], network: str | None = None) -> list[str]:
    return job_command(JOB_MODULE, "--spec", spec, workers, network)


def _setting_command(
    args: argparse.Namespace, setting: AlgorithmSetting, n: int, network: str | None, result: Path
) -> list[str]:
    return _command(n, _job_spec(args, setting, result, n), network)


# what the table and the plots take from a job's result file
_RESULT_KEYS = (
    "wall_s",
    "startup_s",
    "test_error",
    "test_loss",
    "train_loss",
    "test_error_curve",
    "epoch_end_s",
    "samples",
    "samples_per_s",
    "steps",
    "bytes_sent_per_sample",
    "bytes_sent_per_step",
    "replicas_equal",
    "threads",
    "stats",
)


# kept where the job wrote them: Auto's decision record (measurements, predictions, why)
_OPTIONAL_RESULT_KEYS = ("auto_decision",)


def _take_result(record: dict[str, Any], result: dict[str, Any]) -> None:
    record.update({key: result.get(key) for key in _RESULT_KEYS})
    record.update({key: result[key] for key in _OPTIONAL_RESULT_KEYS if key in result})


def _progress(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return (
            f"{record['status'].upper()} after {record['total_s']:.1f} s (exit {record.get('exit_code')}); "
            f"see {record['dir']}/stderr.txt"
        )
    equal = "" if record.get("replicas_equal", True) else "  WARNING: replicas differ after join()"
    return (
        f"{record['wall_s']:.1f} s training ({record['total_s']:.1f} s in all), "
        f"test error {100 * record['test_error']:.2f}%{equal}"
    )


def run(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """``bunsan bench compare``: check everything, run the jobs, print the table, write JSON and plots.

    Returns 0 when every job succeeded, 1 when some failed (their rows say so),
    2 for bad input (one sentence on stderr, no job started).
    """
    started = time.time()
    if getattr(args, "network", None) is not None:
        from bunsan.bench import netns

        refusal = netns.check_network_argument(args)
        if refusal is not None:
            return refuse(PROG, refusal)
    try:
        settings, workers = _plan(args)
        from bunsan.bench.job import check_model_and_data

        check_model_and_data(args.model, args.dataset)
    except ValueError as err:  # Refused, or a model the data set cannot feed
        return refuse(PROG, err)
    out = Path(args.out)
    network = getattr(args, "network", None)
    jobs = [
        (
            _record(setting, described, n, args, job_directory(out, n, setting.label)),
            partial(_setting_command, args, setting, n, network),
        )
        for n in workers  # all settings at N, then the next N
        for setting, described in settings
    ]
    if args.dry_run:
        return say_jobs(jobs, say)

    load_before = load_average()
    records, interrupted = run_jobs(
        jobs, args.timeout_s, job_environment(args.threads), on_result=_take_result, progress=_progress, say=say
    )

    reference = reference_workers(workers)
    ratios = speed_ratios([(r["label"], r["workers"], r.get("wall_s")) for r in records], reference)
    speedups = speedups_vs_first([(r["label"], r["workers"], r.get("wall_s")) for r in records], settings[0][0].label)
    for record, ratio, speedup in zip(records, ratios, speedups):
        record["speed_ratio"] = ratio
        record["speedup_vs_first"] = speedup
        # scaling efficiency = throughput(N) / (N / N_ref x throughput(N_ref)) = speed ratio / (N / N_ref)
        record["scaling_efficiency"] = None if ratio is None else ratio * reference / record["workers"]

    rows = table_rows(records)
    say("")
    framing = (
        f"batch {args.batch} per worker (N x {args.batch} per step)"
        if getattr(args, "batch_per_worker", False)
        else f"global batch {args.batch}"
    )
    say(
        f"{args.model} on {args.dataset}, {args.epochs} epochs, {framing}, lr {args.lr}, "
        f"momentum {args.momentum}, seed {args.seed}, {args.threads} thread(s) per worker; "
        f"speed = time({reference} worker{'s' if reference > 1 else ''}) / time(N) of the same setting; "
        f"vs first = time({settings[0][0].label}) / time(setting) at the same N"
    )
    if args.layout in ("rows", "both"):
        say(format_table(COLUMNS, rows, right=RIGHT))
    if args.layout in ("columns", "both"):
        say(format_transposed(COLUMNS, rows))
    failed = report_failures(records, say)

    write_record(
        args, out, record_document("compare", args, reference, load_before, started, COLUMNS, rows, records), say
    )
    if not args.no_plots:
        from bunsan.bench import plots

        written = plots.plot_compare(records, Path(args.plots) if args.plots else out / "plots")
        if written:
            say("plots: " + ", ".join(str(p) for p in written))
    if interrupted:
        return 130
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bunsan.bench.compare``: the same as ``bunsan bench compare``."""
    return command_main(argv, PROG, DESCRIPTION, EPILOG, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
