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
  and ``block_learning_rate=1`` are all plain SGD with the same local
  optimizer, equal up to floating-point rounding (which 30 epochs amplify to
  a few tenths of a point of test error); only the counted bytes differ.
  ``block_momentum``'s defaults still reset the local momentum after every
  block, and a quantized ``data_parallel`` still quantizes its own gradient,
  so those differ from plain SGD even alone. The 1-worker rows are run
  anyway: they are the reference of the speed ratio.

Columns: ``time`` is the training wall time (from a barrier after start-up to
a barrier after ``optimizer.join()``); ``speed`` is ``time(1 worker) /
time(N)`` of the same setting (or relative to the first worker count given,
when 1 is not among them); ``error`` is the final model's test error;
``bytes/sample`` is what one worker sent per sample it trained, as counted by
the algorithm itself (``algorithm.stats()``); ``samples/s`` is training
throughput of all workers together. The JSON record also holds the
per-epoch curves, the start-up and total times and the machine.

This module imports only the standard library at the top: ``bunsan`` builds
its command-line parser from it without importing torch.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
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
STDERR_TAIL_LINES = 30  # kept in the JSON record of a failed job
STOP_GRACE_S = 10.0  # after SIGTERM to a timed-out job's launcher, before SIGKILL

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

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT = re.compile(r"[+-]?\d+")


# -- pure parsing --------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """Read an option value: int, float, bool (``true``/``false``), ``None`` (``none``/``null``), else a string.

    Quotes around a string are dropped, so ``"'32'"`` stays the string ``'32'``.
    """
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    if _INT.fullmatch(stripped):
        return int(stripped)
    try:
        return float(stripped)
    except ValueError:
        pass
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    return stripped


def format_value(value: Any) -> str:
    """The inverse of :func:`parse_value` for the values it returns."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and parse_value(value) != value:
        return repr(value)  # a string that would read back as a number, a bool or None
    return str(value)


@dataclass(frozen=True)
class AlgorithmSetting:
    """An algorithm name and its constructor options, as written ``NAME[:KEY=VALUE,...]``."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The spec written back, options in their given order: ``block_momentum:block_size=1024``."""
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={format_value(v)}" for k, v in self.options.items())

    def __hash__(self) -> int:
        return hash(self.label)


def parse_algorithm_spec(text: str) -> AlgorithmSetting:
    """Parse ``NAME[:KEY=VALUE,...]`` (e.g. ``data_parallel:bits=1,warm_start=8000``).

    Only the syntax is checked here; whether the algorithm exists and takes
    these options is for :func:`check_setting`.

    Raises:
        ValueError: one sentence naming the spec and what is wrong with it.
    """
    name, colon, rest = text.strip().partition(":")
    name = name.strip()
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"algorithm spec {text!r} does not start with an algorithm name; "
            "write NAME or NAME:KEY=VALUE,..., e.g. block_momentum:block_size=1024"
        )
    options: dict[str, Any] = {}
    if colon and not rest.strip():
        raise ValueError(f"algorithm spec {text!r} has nothing after ':'; drop the ':' or add KEY=VALUE")
    for item in rest.split(",") if colon else []:
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or not _NAME.fullmatch(key) or not value.strip():
            raise ValueError(
                f"option {item.strip()!r} of algorithm spec {text!r} is not KEY=VALUE; "
                "separate options with commas, e.g. data_parallel:bits=1,warm_start=8000"
            )
        if key in options:
            raise ValueError(f"algorithm spec {text!r} sets {key!r} twice")
        options[key] = parse_value(value)
    return AlgorithmSetting(name, options)


@dataclass(frozen=True)
class Sweep:
    """``--sweep [NAME:]KEY=V1,V2,...``: one setting per value; ``target`` limits it to one algorithm name."""

    key: str
    values: tuple[Any, ...]
    target: str | None = None


def parse_sweep(text: str) -> Sweep:
    """Parse ``[NAME:]KEY=V1,V2,...`` (e.g. ``warm_start=0,2000,8000``).

    Raises:
        ValueError: one sentence naming the sweep and what is wrong with it.
    """
    head, equals, values = text.partition("=")
    target, colon, key = head.rpartition(":")
    key, target = key.strip(), target.strip() if colon else None
    if not equals or not _NAME.fullmatch(key) or (target is not None and not _NAME.fullmatch(target)):
        raise ValueError(f"--sweep {text!r} is not [ALGORITHM:]KEY=V1,V2,...; e.g. --sweep warm_start=0,2000,8000")
    items = [v.strip() for v in values.split(",")]
    if not all(items):
        raise ValueError(f"--sweep {text!r} has an empty value; separate the values with single commas")
    parsed = tuple(parse_value(v) for v in items)
    if len(set(map(format_value, parsed))) != len(parsed):
        raise ValueError(f"--sweep {text!r} lists a value twice")
    return Sweep(key, parsed, target)


def apply_sweeps(settings: Sequence[AlgorithmSetting], sweeps: Sequence[Sweep]) -> list[AlgorithmSetting]:
    """Expand each setting by the sweeps that apply to it (all sweeps' values, crossed).

    A sweep without a target applies to every setting; with one, to the
    settings of that algorithm name. Settings that come out equal are kept once.

    Raises:
        ValueError: a targeted sweep matches no setting, or a setting already
            fixes the swept key.
    """
    for sweep in sweeps:
        if sweep.target is not None and not any(s.name == sweep.target for s in settings):
            raise ValueError(
                f"--sweep {sweep.target}:{sweep.key}=... names algorithm {sweep.target!r}, "
                f"which is not in --algorithms ({', '.join(s.label for s in settings)})"
            )
    expanded: list[AlgorithmSetting] = []
    for setting in settings:
        mine = [s for s in sweeps if s.target in (None, setting.name)]
        for sweep in mine:
            if sweep.key in setting.options:
                raise ValueError(
                    f"--sweep {sweep.key}=... and algorithm spec {setting.label!r} both set "
                    f"{sweep.key!r}; drop it from one of them"
                )
        if len({s.key for s in mine}) != len(mine):
            raise ValueError(f"two --sweep options vary {setting.name}'s same option; merge their values into one")
        for values in itertools.product(*(s.values for s in mine)):
            options = dict(setting.options)
            options.update({s.key: v for s, v in zip(mine, values)})
            candidate = AlgorithmSetting(setting.name, options)
            if candidate not in expanded:
                expanded.append(candidate)
    return expanded


def parse_workers(text: str) -> list[int]:
    """Parse ``-np 1,2,4`` into worker counts, in the given order, each once.

    Raises:
        ValueError: a count is not a whole number >= 1.
    """
    counts: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"-np {text!r}: {item!r} is not a worker count >= 1; write e.g. -np 1,2,4")
        if int(item) not in counts:
            counts.append(int(item))
    return counts


def per_worker_batch(batch: int, workers: int) -> int:
    """The minibatch of each of ``workers`` workers when the global minibatch is ``batch``.

    Raises:
        ValueError: ``batch`` does not divide evenly (or is smaller than ``workers``).
    """
    if batch < 1 or workers < 1:
        raise ValueError(f"need batch >= 1 and workers >= 1, got batch={batch}, workers={workers}")
    if batch % workers:
        raise ValueError(
            f"the global minibatch --batch {batch} does not split evenly over {workers} workers; "
            f"choose a multiple of {workers}"
        )
    return batch // workers


def reference_workers(workers: Sequence[int]) -> int:
    """The worker count that speed ratios are relative to: 1 if present, else the first given."""
    return 1 if 1 in workers else workers[0]


def speed_ratios(rows: Sequence[tuple[str, int, float | None]], reference: int) -> list[float | None]:
    """``time(reference workers) / time(N)`` of the same setting, for each ``(label, workers, wall_s)``.

    ``None`` where this row or its reference has no time (failed).
    """
    base = {label: wall for label, workers, wall in rows if workers == reference and wall}
    return [base[label] / wall if wall and label in base else None for label, _, wall in rows]


def speedups_vs_first(rows: Sequence[tuple[str, int, float | None]], first: str) -> list[float | None]:
    """Algorithm speed-up ``time(first setting) / time(this setting)`` at the same worker count.

    For each ``(label, workers, wall_s)``; ``None`` where either time is missing.
    """
    base = {workers: wall for label, workers, wall in rows if label == first and wall}
    return [base[workers] / wall if wall and workers in base else None for _, workers, wall in rows]


# -- the table -------------------------------------------------------------------------
# "speed": time(reference worker count) / time(N), same setting (CNTK's 速度比);
# "vs first": time(first setting) / time(this setting), same worker count (the algorithm's speed-up).
COLUMNS = (
    "workers",
    "algorithm",
    "bits",
    "warm start",
    "block size",
    "epochs",
    "time (s)",
    "speed",
    "vs first",
    "error (%)",
    "bytes/sample",
    "samples/s",
)
_RIGHT = set(COLUMNS) - {"algorithm"}


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _bits_cell(record: dict[str, Any]) -> str:
    if record.get("compression"):
        return str(record["compression"])
    return "-" if record.get("bits") is None else str(record["bits"])


def _count_cell(value: Any) -> str:
    return "-" if value is None else str(value)


def table_rows(records: Iterable[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one row per configuration record (see :func:`run` for the record's keys)."""
    rows = []
    for r in records:
        ok = r.get("status") == "ok"
        time_cell = _number(r.get("wall_s"), 1) if ok else str(r.get("status", "failed"))
        error = r.get("test_error")
        rows.append(
            [
                str(r["workers"]),
                r["label"],
                _bits_cell(r),
                _count_cell(r.get("warm_start")),
                _count_cell(r.get("block_size")),
                str(r["epochs"]),
                time_cell,
                _number(r.get("speed_ratio"), 2) if ok else "-",
                _number(r.get("speedup_vs_first"), 2) if ok else "-",
                _number(None if error is None else 100 * error, 2) if ok else "-",
                _number(r.get("bytes_sent_per_sample"), 1) if ok else "-",
                _number(r.get("samples_per_s"), 0) if ok else "-",
            ]
        )
    return rows


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Iterable[str] = ()) -> str:
    """Align ``rows`` under ``header``; columns named in ``right`` are right-aligned."""
    right = set(right)
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if h in right else c.ljust(w) for c, w, h in zip(cells, widths, header)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(row) for row in rows)])


def format_transposed(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The CNTK article's layout: one column per run, one line per quantity (the first is the header)."""
    lines = [[name, *(row[i] for row in rows)] for i, name in enumerate(header)]
    return format_table(lines[0], lines[1:], right=lines[0][1:])


# -- validation and the jobs -----------------------------------------------------------
class _Refused(ValueError):
    """Bad input found before any job started."""


def check_setting(setting: AlgorithmSetting) -> dict[str, Any]:
    """Build the algorithm (no process group needed) and return what the table shows of it.

    Raises:
        ValueError: unknown algorithm or option, or an option out of range: one sentence.
    """
    from bunsan import algorithms

    if setting.name not in algorithms.names():
        raise ValueError(
            f"algorithm spec {setting.label!r}: unknown algorithm {setting.name!r}; "
            f"choose one of {', '.join(algorithms.names())}"
        )
    classes = [getattr(algorithms, n) for n in algorithms.__all__]
    cls = next((c for c in classes if inspect.isclass(c) and getattr(c, "name", None) == setting.name), None)
    if cls is not None:
        parameters = inspect.signature(cls).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        accepted = [n for n in parameters if n not in ("self", "group")]
        unknown = [k for k in setting.options if k not in accepted or k == "group"]
        if unknown and not takes_any:
            raise ValueError(
                f"algorithm spec {setting.label!r}: {setting.name} has no option {unknown[0]!r}; "
                f"its options are {', '.join(accepted)}"
            )
    try:
        algorithm = algorithms.create(setting.name, **setting.options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"algorithm spec {setting.label!r}: {err}") from None
    except RuntimeError as err:  # a constructor that wants a process group: a bug to report
        raise ValueError(
            f"algorithm spec {setting.label!r} cannot be checked before the jobs start, because "
            f"building {setting.name} outside a job failed: {err}"
        ) from None
    return {
        "algorithm": setting.name,
        "options": dict(setting.options),
        "algorithm_repr": repr(algorithm),
        "bits": getattr(algorithm, "bits", None),
        "compression": getattr(algorithm, "compression", None),
        "warm_start": getattr(algorithm, "warm_start", None),
        "block_size": getattr(algorithm, "block_size", None),
    }


def _check_model_and_data(model: str, dataset: str) -> None:
    from bunsan import datasets, models

    if dataset not in datasets.names():
        raise _Refused(f"unknown data set {dataset!r}; choose one of {', '.join(datasets.names())}")
    if model not in models.names():
        raise _Refused(f"unknown model {model!r}; choose one of {', '.join(models.names())}")
    from bunsan.bench.job import build_model

    try:
        build_model(model, datasets.info(dataset))
        # Generated once here (and cached on disk), not by every rank of the first job at once.
        datasets.load(dataset, "train")
    except (TypeError, ValueError, ImportError) as err:
        raise _Refused(f"model {model!r} on data set {dataset!r}: {err}") from None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _job_environment(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)  # one intra-op thread per worker unless told otherwise
    env["MKL_NUM_THREADS"] = str(threads)
    for name in ("BUNSAN_NPROC", "BUNSAN_HOSTS", "BUNSAN_HOSTFILE"):  # -np is ours to decide
        env.pop(name, None)
    return env


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher we started (it forwards to its workers and sweeps them), then SIGKILL."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_job(
    command: Sequence[str], directory: Path, timeout_s: float, env: dict[str, str]
) -> tuple[str, int | None, float]:
    """Run one job, output to ``directory``; return ``(status, exit code, seconds)``.

    ``status`` is ``"ok"``, ``"failed"`` or ``"timeout"``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "command.txt").write_text(shlex.join(command) + "\n")
    start = time.perf_counter()
    with open(directory / "stdout.txt", "wb") as out, open(directory / "stderr.txt", "wb") as err:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(process)
            return "timeout", None, time.perf_counter() - start
        except BaseException:  # Ctrl-C: do not leave the job behind
            _stop(process)
            raise
    return ("ok" if code == 0 else "failed"), code, time.perf_counter() - start


def _machine(threads: int) -> dict[str, Any]:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "threads_per_worker": threads,
        "cuda": torch.cuda.is_available(),
    }


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


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
    parser.add_argument("--weight-decay", type=float, default=0.0, help="local SGD weight decay; default %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="initial model and data order; default %(default)s")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per worker; default %(default)s")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per job; default %(default)s")
    parser.add_argument("--out", default="runs/compare", help="directory of the jobs' outputs; default %(default)s")
    parser.add_argument("--json", metavar="FILE", help="the JSON record; default OUT/compare.json")
    parser.add_argument("--plots", metavar="DIR", help="PNG plots; default OUT/plots")
    parser.add_argument("--no-plots", action="store_true", help="write no plots")
    parser.add_argument("--no-curves", action="store_true", help="skip per-epoch test errors (no model copies)")
    parser.add_argument(
        "--layout",
        choices=("rows", "columns", "both"),
        default="rows",
        help="rows: one row per run; columns: one column per run, as in the CNTK article",
    )
    parser.add_argument("--dry-run", action="store_true", help="check the input and print the jobs, start nothing")


@dataclass
class _Plan:
    settings: list[tuple[AlgorithmSetting, dict[str, Any]]]
    workers: list[int]


def _plan(args: argparse.Namespace) -> _Plan:
    try:
        workers = parse_workers(args.workers)
        settings = apply_sweeps(
            [parse_algorithm_spec(s) for s in args.algorithms], [parse_sweep(s) for s in args.sweep]
        )
    except ValueError as err:
        raise _Refused(str(err)) from None
    if args.batch < 1:
        raise _Refused(f"--batch must be >= 1, got {args.batch}")
    uneven = [] if getattr(args, "batch_per_worker", False) else [n for n in workers if args.batch % n]
    if uneven:
        raise _Refused(
            f"the global minibatch --batch {args.batch} does not split evenly over {uneven[0]} workers; "
            f"choose a multiple of {math.lcm(*workers)} for -np {args.workers}"
        )
    for name, value, low in (("--epochs", args.epochs, 1), ("--threads", args.threads, 1)):
        if value < low:
            raise _Refused(f"{name} must be >= {low}, got {value}")
    if not args.lr > 0:
        raise _Refused(f"--lr must be > 0, got {args.lr}")
    if not args.timeout_s > 0:
        raise _Refused(f"--timeout-s must be > 0, got {args.timeout_s}")
    checked = []
    for setting in settings:
        try:
            checked.append((setting, check_setting(setting)))
        except ValueError as err:
            raise _Refused(str(err)) from None
    return _Plan(checked, workers)


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
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "out": str(out),
        "curves": not args.no_curves,
    }


def _command(workers: int, spec: dict[str, Any], network: str | None = None) -> list[str]:
    # The launcher and the workers both run with this Python (and so this environment).
    worker = [sys.executable, "-u", "-m", "bunsan.bench.job", "--spec", json.dumps(spec)]
    if network is not None:  # workers in network namespaces joined by shaped links
        from bunsan.bench import netns

        return netns.launcher_command(network, workers, worker)
    return [sys.executable, "-m", "bunsan", "run", "-np", str(workers), "--", *worker]


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


def _progress(index: int, total: int, record: dict[str, Any]) -> str:
    head = f"[{index}/{total}] {record['label']} -np {record['workers']}:"
    if record["status"] != "ok":
        return (
            f"{head} {record['status'].upper()} after {record['total_s']:.1f} s (exit {record.get('exit_code')}); "
            f"see {record['dir']}/stderr.txt"
        )
    equal = "" if record.get("replicas_equal", True) else "  WARNING: replicas differ after join()"
    return (
        f"{head} {record['wall_s']:.1f} s training ({record['total_s']:.1f} s in all), "
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
            print(f"{PROG}: error: {refusal}", file=sys.stderr)
            return 2
    try:
        plan = _plan(args)
        _check_model_and_data(args.model, args.dataset)
    except _Refused as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    configs = [(n, s, d) for n in plan.workers for s, d in plan.settings]  # all settings at N, then the next N
    env = _job_environment(args.threads)
    if args.dry_run:
        for n, setting, _ in configs:
            spec = _job_spec(args, setting, out / f"np{n}-{_slug(setting.label)}" / "result.json", n)
            say(shlex.join(_command(n, spec, getattr(args, "network", None))))
        return 0

    load_before = _load_average()
    records: list[dict[str, Any]] = []
    interrupted = False
    for index, (n, setting, described) in enumerate(configs, start=1):
        directory = out / f"np{n}-{_slug(setting.label)}"
        result_path = directory / "result.json"
        result_path.unlink(missing_ok=True)  # never report a previous run's result
        record = _record(setting, described, n, args, directory)
        command = _command(n, _job_spec(args, setting, result_path.resolve(), n), getattr(args, "network", None))
        try:
            result = run_recorded_job(command, directory, result_path, record, args.timeout_s, env)
        except KeyboardInterrupt:  # run_job has stopped the job; report what finished
            say(f"interrupted during job {index} of {len(configs)}; the table holds the jobs that finished")
            interrupted = True
            break
        if result is not None:
            for key in (
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
            ):
                record[key] = result.get(key)
        records.append(record)
        say(_progress(index, len(configs), record))

    reference = reference_workers(plan.workers)
    ratios = speed_ratios([(r["label"], r["workers"], r.get("wall_s")) for r in records], reference)
    speedups = speedups_vs_first(
        [(r["label"], r["workers"], r.get("wall_s")) for r in records], plan.settings[0][0].label
    )
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
        f"vs first = time({plan.settings[0][0].label}) / time(setting) at the same N"
    )
    if args.layout in ("rows", "both"):
        say(format_table(COLUMNS, rows, right=_RIGHT))
    if args.layout in ("columns", "both"):
        say(format_transposed(COLUMNS, rows))
    failed = report_failures(records, say)

    json_path = Path(args.json) if args.json else out / "compare.json"
    document = record_document("compare", args, reference, load_before, started, COLUMNS, rows, records)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(document, indent=1, default=str))
    say(f"JSON: {json_path}")
    if not args.no_plots:
        from bunsan.bench import plots

        written = plots.plot_compare(records, Path(args.plots) if args.plots else out / "plots")
        if written:
            say("plots: " + ", ".join(str(p) for p in written))
    if interrupted:
        return 130
    return 1 if failed else 0


def run_recorded_job(
    command: Sequence[str],
    directory: Path,
    result_path: Path,
    record: dict[str, Any],
    timeout_s: float,
    env: dict[str, str],
) -> dict[str, Any] | None:
    """Run one benchmark job and note in ``record`` how it went.

    Returns the job's result file (written by rank 0) when the job succeeded and
    left one; otherwise None, with the status and the stderr tail in ``record``.
    KeyboardInterrupt passes through (``run_job`` has stopped the job by then).
    """
    status, code, total_s = run_job(list(command), directory, timeout_s, env)
    record.update(status=status, exit_code=code, total_s=total_s)
    result = None
    if status == "ok":
        try:
            result = json.loads(result_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            record.update(status="failed", error=f"no result file: {err}")
    if record["status"] != "ok":
        record["stderr_tail"] = _tail(directory / "stderr.txt")
    return result


def report_failures(records: Sequence[dict[str, Any]], say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Say which jobs failed, with the last lines of their stderr; return those records."""
    failed = [r for r in records if r["status"] != "ok"]
    for r in failed:
        say(f"{r['label']} -np {r['workers']} {r['status']}; last lines of {r['dir']}/stderr.txt:")
        say("\n".join("    " + line for line in (r.get("stderr_tail") or "(empty)").splitlines()[-8:]))
    return failed


def record_document(
    benchmark: str,
    args: argparse.Namespace,
    reference: int,
    load_before: Any,
    started: float,
    columns: Sequence[str],
    rows: Any,
    records: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The JSON record every job-running benchmark writes: what ran, where, when, and its table."""
    return {
        "benchmark": benchmark,
        "command": shlex.join(sys.argv),
        "arguments": {k: v for k, v in vars(args).items() if k not in ("handler", "subcommand", "benchmark")},
        "reference_workers": reference,
        "machine": {
            **_machine(args.threads),
            "load_average_before": load_before,
            "load_average_after": _load_average(),
        },
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "columns": list(columns),
        "table": rows,
        "configs": list(records),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bunsan.bench.compare``: the same as ``bunsan bench compare``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
