"""``bunsan bench peers``: bunsan's DDP hooks and averagers side by side with torch's, in one harness.

Every setting (:mod:`bunsan.bench.peers_spec`) trains the same model on the same data from the same seeds
with plain ``DistributedDataParallel`` (:mod:`bunsan.bench.peers_job`): exact all-reduce, torch's fp16 hook,
PowerSGD (one DDP bucket: on Gloo it aborts or hangs with DDP's default buckets at ranks 1 and 4), post-local
SGD with torch's averager, bunsan's N-bit hook and bunsan's model-averaging and BMUF averagers::

    bunsan bench peers --model mnist1d_cnn --dataset mnist1d -np 4 --seeds 0,1,2 --epochs 20 \\
        --networks loopback rate=1gbit rate=100mbit \\
        --settings exact fp16 powersgd:rank=1 powersgd:rank=4,batched postlocal:period=4 bunsan:bits=1

Each (network x seed x setting) is one job, one after another, each with a timeout; a job that fails or
times out is a ``failed`` run with its stderr kept, and the others go on. ``loopback`` runs under
``bunsan run``; ``rate=...`` in network namespaces on links shaped to that rate (:mod:`bunsan.bench.netns`,
root only). The table (:mod:`bunsan.bench.peers_table`) has per network and setting: bytes sent per step
and worker (counted), the median step time, the final test error (mean over seeds), the training time to
the target error (exact's mean final error + ``--points``; median over seeds) and its ratio to PowerSGD's
best rank. This module imports no torch at the top.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bunsan._table import format_table
from bunsan.bench import _common
from bunsan.bench.peers_spec import PeerSetting, parse_seeds, parse_setting
from bunsan.bench.peers_table import COLUMNS, RIGHT, summarize, table_cells

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "main", "run"]

PROG = "bunsan bench peers"
JOB_MODULE = "bunsan.bench.peers_job"
LOOPBACK = "loopback"
DEFAULT_SETTINGS = ("exact", "fp16", "powersgd:rank=1", "postlocal:period=4", "bunsan:bits=1")

DESCRIPTION = """\
Train one model with plain DistributedDataParallel under each communication
setting, seed and network, one job each, one after another, and print per
network and setting: bytes sent per step and worker, median step time, final
test error (mean over seeds), training time to the target error (exact's mean
final error + --points; median over seeds) and its ratio to PowerSGD's best rank.

Settings: exact, fp16, powersgd:rank=R[,batched][,start=S],
postlocal:period=K[,warmup=S], bunsan:bits=B[,warmup=S],
bunsan-ma:period=K[,warmup=S], bunsan-bmuf:period=K[,warmup=S,...].
PowerSGD runs with one DDP bucket: on Gloo with DDP's default 25 MB buckets it
aborts with a collective mismatch or hangs at ranks 1 and 4.
--batch is the GLOBAL minibatch, split evenly over the workers. Networks:
loopback, or rate=RATE (network namespaces on shaped links; needs root)."""

EPILOG = """\
examples:
  bunsan bench peers -np 2 --epochs 2 --settings exact fp16 powersgd:rank=1 bunsan:bits=1
  bunsan bench peers -np 4 --seeds 0,1,2 --networks loopback rate=1gbit rate=100mbit"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``bunsan bench peers`` to ``parser``."""
    parser.add_argument("--model", default="mnist1d_cnn", help="model name (bunsan.models); default %(default)s")
    parser.add_argument("--dataset", default="mnist1d", help="data set name (bunsan.datasets); default %(default)s")
    parser.add_argument(
        "--settings",
        nargs="+",
        default=list(DEFAULT_SETTINGS),
        metavar="SETTING",
        help=f"communication settings (above); default {' '.join(DEFAULT_SETTINGS)}",
    )
    parser.add_argument("-np", "--np", dest="workers", type=int, default=4, help="workers; default %(default)s")
    parser.add_argument("--seeds", default="0", metavar="S,S,...", help="seeds, comma-separated; default %(default)s")
    parser.add_argument(
        "--networks",
        nargs="+",
        default=[LOOPBACK],
        metavar="NETWORK",
        help="loopback, or rate=RATE[,burst=SIZE] (shaped links, root only); default %(default)s",
    )
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run; default %(default)s")
    parser.add_argument("--batch", type=int, default=128, help="GLOBAL minibatch; default %(default)s")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate; default %(default)s")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum; default %(default)s")
    parser.add_argument(
        "--recompute-bn", action="store_true", help="evaluate with batch-norm statistics recomputed over the train set"
    )
    parser.add_argument(
        "--points", type=float, default=1.0, help="target = exact's mean final error + POINTS; default %(default)s"
    )
    _common.add_job_arguments(parser, "peers", timeout_s=1800.0)
    parser.add_argument("--dry-run", action="store_true", help="check the input and print the jobs, start nothing")


def _plan(args: argparse.Namespace) -> tuple[list[PeerSetting], list[int], list[str | None]]:
    """The settings, seeds and networks (``None``: loopback); Refused on bad input, before any job."""
    try:
        settings = [parse_setting(text) for text in args.settings]
        labels = [s.label for s in settings]
        if len(set(labels)) != len(labels):
            raise ValueError(f"--settings lists a setting twice: {labels}")
        seeds = parse_seeds(args.seeds)
        _common.check_at_least(("-np", args.workers, 1), ("--epochs", args.epochs, 1), ("--batch", args.batch, 1))
        _common.check_at_least(("--threads", args.threads, 1))
        if args.batch % args.workers:
            raise ValueError(f"the global minibatch --batch {args.batch} does not split evenly over {args.workers}")
        _common.check_positive("--lr", args.lr)
        _common.check_positive("--timeout-s", args.timeout_s)
        networks = [None if n.strip().lower() == LOOPBACK else n.strip() for n in args.networks]
        return settings, seeds, networks
    except (TypeError, ValueError) as err:
        raise _common.Refused(str(err)) from None


def _job_spec(args: argparse.Namespace, setting: PeerSetting, seed: int, out: Path) -> dict[str, Any]:
    return {
        "model": args.model,
        "dataset": args.dataset,
        "setting": setting.label,
        "epochs": args.epochs,
        "batch": args.batch,
        "lr": args.lr,
        "momentum": args.momentum,
        "seed": seed,
        "recompute_bn": bool(args.recompute_bn),
        "out": str(out),
    }


def _command(args: argparse.Namespace, setting: PeerSetting, seed: int, network: str | None, result: Path) -> list[str]:
    return _common.job_command(JOB_MODULE, "--spec", _job_spec(args, setting, seed, result), args.workers, network)


_RESULT_KEYS = (
    "wall_s",
    "startup_s",
    "epoch_end_s",
    "steps",
    "buckets",
    "step_ms_median",
    "step_ms_mean",
    "train_loss",
    "test_error",
    "test_loss",
    "test_error_curve",
    "bytes_sent_per_step",
    "bytes_sent_per_step_by_rank",
    "replicas_equal",
    "parameter_shapes",
    "start_powerSGD_iter",
    "warmup_steps",
)


def _take_result(record: dict[str, Any], result: dict[str, Any]) -> None:
    record.update({key: result[key] for key in _RESULT_KEYS if key in result})


def _progress(record: dict[str, Any]) -> str:
    where = f"{record['network']}, seed {record['seed']}"
    if record["status"] != "ok":
        return f"{where}: {record['status'].upper()} after {record['total_s']:.1f} s; see {record['dir']}/stderr.txt"
    return (
        f"{where}: {record['wall_s']:.1f} s training, test error {100 * record['test_error']:.2f}%, "
        f"{record['bytes_sent_per_step']:.0f} bytes/step"
    )


def _check_networks(networks: Sequence[str | None]) -> str | None:
    """The refusal (one sentence) of the first shaped network that cannot run here, or ``None``."""
    from bunsan.bench import netns

    for network in networks:
        if network is not None:
            refusal = netns.check_network_argument(argparse.Namespace(network=network))
            if refusal is not None:
                return f"--networks {network}: {refusal}"
    return None


def run(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """``bunsan bench peers``: check everything, run the jobs, print the table, write the JSON record.

    Returns 0 when every job succeeded, 1 when some failed (their rows say so), 2 for bad input (one
    sentence on stderr, no job started), 130 when interrupted.
    """
    started = time.time()
    try:
        settings, seeds, networks = _plan(args)
        refusal = _check_networks(networks)
        if refusal is not None:
            raise _common.Refused(refusal)
        from bunsan.bench.job import check_model_and_data

        check_model_and_data(args.model, args.dataset)
    except ValueError as err:  # Refused, or a model the data set cannot feed
        return _common.refuse(PROG, err)
    out = Path(args.out)
    jobs = []
    for network in networks:
        name = network or LOOPBACK
        for seed in seeds:
            for setting in settings:
                directory = _common.job_directory(out / _common.slug(name) / f"seed{seed}", args.workers, setting.label)
                record = {"label": setting.label, "workers": args.workers, "network": name, "seed": seed}
                record.update(epochs=args.epochs, batch=args.batch, dir=str(directory))
                jobs.append((record, partial(_command, args, setting, seed, network)))
    if args.dry_run:
        return _common.say_jobs(jobs, say)
    load_before = _common.load_average()
    records, interrupted = _common.run_jobs(
        jobs, args.timeout_s, _common.job_environment(args.threads), on_result=_take_result, progress=_progress, say=say
    )
    rows = summarize(records, args.points)
    cells = table_cells(rows)
    say("")
    say(
        f"{args.model} on {args.dataset}, {args.workers} workers, {args.epochs} epochs, global batch {args.batch}, "
        f"lr {args.lr}, momentum {args.momentum}, seeds {args.seeds}; target = exact's mean final error "
        f"+ {args.points} points; PowerSGD with one DDP bucket"
    )
    say(format_table(COLUMNS, cells, right=RIGHT))
    failed = _common.report_failures(records, say)
    document = _common.record_document("peers", args, args.workers, load_before, started, COLUMNS, cells, records)
    document["summary"] = rows
    _common.write_record(args, out, document, say)
    if interrupted:
        return 130
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bunsan.bench.peers``: the same as ``bunsan bench peers``."""
    return _common.command_main(argv, PROG, DESCRIPTION, EPILOG, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
