"""What every job-running benchmark shares: starting a job, noting how it went, the machine, the record.

A benchmark runs its measurements as ``bunsan run -np N`` jobs (or in shaped network
namespaces, :mod:`bunsan.bench.netns`), one after another, each with a timeout
(:func:`run_job`); a job that fails or times out becomes a ``failed`` record with its
stderr tail kept (:func:`run_recorded_job`) and the others go on. Every JSON record
names the command, the machine and the load average before and after
(:func:`record_document`), since timings on a shared machine are only comparable
side by side. Also shared: the options every such benchmark takes
(:func:`add_job_arguments`), their checks (one rule, :mod:`bunsan._validate`), text
tables of records (:func:`format_records`) and the ``python -m`` entry
(:func:`command_main`).

This module imports no torch at the top (``bunsan`` builds its parser from the
benchmarks without it): the standard library, :mod:`bunsan._table`, :mod:`bunsan._validate`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bunsan._table import format_table
from bunsan._validate import check_int, check_number

__all__ = [
    "Column",
    "Refused",
    "add_job_arguments",
    "check_at_least",
    "check_positive",
    "command_main",
    "format_records",
    "job_command",
    "job_directory",
    "job_environment",
    "load_average",
    "machine_info",
    "record_document",
    "record_header",
    "refuse",
    "report_failures",
    "run_job",
    "run_jobs",
    "run_recorded_job",
    "say_jobs",
    "slug",
    "stop_with_parent",
    "tail",
    "usable_cores",
    "write_record",
]

# a column of format_records: its header and a str.format template over a record's keys, or a function of it
Column = tuple[str, str | Callable[[dict[str, Any]], str]]

STDERR_TAIL_LINES = 30  # kept in the JSON record of a failed job
STOP_GRACE_S = 10.0  # after SIGTERM to a timed-out job's launcher, before SIGKILL


class Refused(ValueError):
    """Bad input found before any job started."""


def refuse(prog: str, message: object) -> int:
    """Say ``PROG: error: MESSAGE`` on stderr and return 2, the exit code of bad input."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def check_at_least(*checks: tuple[str, Any, int]) -> None:
    """Check that each ``(option, value, minimum)`` is an int >= minimum.

    Raises:
        TypeError: a value is not an int.
        ValueError: a value is below its minimum.
    """
    for name, value, minimum in checks:
        check_int(name, value, minimum=minimum)


def check_positive(name: str, value: Any) -> None:
    """Check that ``value`` is a number > 0 (a timeout, a learning rate); TypeError or ValueError."""
    check_number(name, value, minimum=0, min_inclusive=False)


# -- one job ------------------------------------------------------------------------------
def job_command(module: str, flag: str, spec: dict[str, Any], workers: int, network: str | None = None) -> list[str]:
    """``bunsan run -np WORKERS -- python -m MODULE FLAG SPEC``, or the shaped-network launcher's equivalent.

    ``module`` may also be the path of a script (ending in ``.py``: ``python PATH FLAG SPEC``), as the
    campaign tools of a checkout's ``tools/`` run their jobs. The launcher and the workers both run
    with this Python (and so this environment).
    """
    target = [module] if module.endswith(".py") else ["-m", module]
    worker = [sys.executable, "-u", *target, flag, json.dumps(spec)]
    if network is not None:  # workers in network namespaces joined by shaped links
        from bunsan.bench import netns

        return netns.launcher_command(network, workers, worker)
    return [sys.executable, "-m", "bunsan", "run", "-np", str(workers), "--", *worker]


def slug(text: str) -> str:
    """``block_momentum:block_size=1024`` -> ``block_momentum_block_size_1024``: a directory name."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last ``lines`` lines of a text file; empty if it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def job_environment(threads: int) -> dict[str, str]:
    """This environment with ``threads`` intra-op threads per worker and no worker count of its own."""
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


def stop_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for a job a benchmark starts: SIGTERM reaches it when the benchmark dies.

    A benchmark's job is a launcher (``bunsan run``, the shaped-network launcher)
    that stops its workers, and removes its namespaces, on SIGTERM. Ctrl-C and a
    timeout stop it through :func:`run_job`; without this a benchmark ended by
    ``kill``, a scheduler's SIGTERM or SIGKILL left its running job behind, workers
    and all (seen: a ``tools/predict.py`` killed at 100 Mbit/s left its job
    training on). ``PR_SET_PDEATHSIG`` fires when the starting thread ends, so
    start jobs from the main thread (as every benchmark here does).
    """
    from bunsan.launch.proctree import die_with_launcher_hook

    return die_with_launcher_hook(signal.SIGTERM)


def run_job(
    command: Sequence[str], directory: Path, timeout_s: float, env: dict[str, str]
) -> tuple[str, int | None, float]:
    """Run one job, output to ``directory``; return ``(status, exit code, seconds)``.

    ``status`` is ``"ok"``, ``"failed"`` or ``"timeout"``. The job is stopped (SIGTERM,
    then SIGKILL) on a timeout and on Ctrl-C, and gets SIGTERM however this process
    ends (:func:`stop_with_parent`).
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "command.txt").write_text(shlex.join(command) + "\n")
    start = time.perf_counter()
    with open(directory / "stdout.txt", "wb") as out, open(directory / "stderr.txt", "wb") as err:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, preexec_fn=stop_with_parent()
        )
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(process)
            return "timeout", None, time.perf_counter() - start
        except BaseException:  # Ctrl-C: do not leave the job behind
            _stop(process)
            raise
    return ("ok" if code == 0 else "failed"), code, time.perf_counter() - start


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
        record["stderr_tail"] = tail(directory / "stderr.txt")
    return result


def say_jobs(jobs: Sequence[tuple[dict[str, Any], Callable[[Path], list[str]]]], say: Callable[[str], None]) -> int:
    """``--dry-run``: say the command line of each job of :func:`run_jobs`, start nothing; return 0."""
    for record, command in jobs:
        say(shlex.join(command(Path(record["dir"]) / "result.json")))
    return 0


def run_jobs(
    jobs: Sequence[tuple[dict[str, Any], Callable[[Path], list[str]]]],
    timeout_s: float,
    env: dict[str, str],
    *,
    on_result: Callable[[dict[str, Any], dict[str, Any]], None],
    progress: Callable[[dict[str, Any]], str],
    say: Callable[[str], None],
) -> tuple[list[dict[str, Any]], bool]:
    """Run ``jobs`` one after another (jobs at once would share the cores and spoil each other's times).

    Each job is ``(record, command)``: ``record`` has the ``label``, ``workers`` and
    ``dir`` of the job; ``command(result_path)`` is the job's command line. A job's
    result goes through ``on_result(record, result)``; a failed job keeps its status
    and stderr tail in its record and the others go on. After each job,
    ``[i/n] LABEL -np N: progress(record)`` is said.

    Returns:
        The records of the jobs that ran, and whether Ctrl-C stopped the run (the job
        running then was stopped and has no record).
    """
    records: list[dict[str, Any]] = []
    for index, (record, command) in enumerate(jobs, start=1):
        directory = Path(record["dir"])
        result_path = directory / "result.json"
        result_path.unlink(missing_ok=True)  # never report a previous run's result
        try:
            result = run_recorded_job(command(result_path.resolve()), directory, result_path, record, timeout_s, env)
        except KeyboardInterrupt:  # run_job has stopped the job; report what finished
            say(f"interrupted during job {index} of {len(jobs)}; the table holds the jobs that finished")
            return records, True
        if result is not None:
            on_result(record, result)
        records.append(record)
        say(f"[{index}/{len(jobs)}] {record['label']} -np {record['workers']}: {progress(record)}")
    return records, False


def job_directory(out: Path, workers: int, label: str) -> Path:
    """Where the job of setting ``label`` at ``workers`` workers writes: ``OUT/npN-LABEL``."""
    return out / f"np{workers}-{slug(label)}"


def report_failures(records: Sequence[dict[str, Any]], say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Say which jobs failed, with the last lines of their stderr; return those records."""
    failed = [r for r in records if r["status"] != "ok"]
    for r in failed:
        say(f"{r['label']} -np {r['workers']} {r['status']}; last lines of {r['dir']}/stderr.txt:")
        say("\n".join("    " + line for line in (r.get("stderr_tail") or "(empty)").splitlines()[-8:]))
    return failed


def write_record(args: argparse.Namespace, out: Path, document: dict[str, Any], say: Callable[[str], None]) -> Path:
    """Write a benchmark's JSON record to ``--json``, or else ``OUT/BENCHMARK.json``, and say where."""
    from bunsan.bench import write_json

    path = Path(args.json) if args.json else out / f"{document['benchmark']}.json"
    write_json(str(path), document)
    say(f"JSON: {path}")
    return path


def record_header(benchmark: str, args: argparse.Namespace, load_before: Any, started: float) -> dict[str, Any]:
    """The head of every benchmark's JSON record: what ran, with which arguments, on which machine, when."""
    return {
        "benchmark": benchmark,
        "command": shlex.join(sys.argv),
        "arguments": {k: v for k, v in vars(args).items() if k not in ("handler", "subcommand", "benchmark")},
        "machine": {
            **machine_info(args.threads),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
    }


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
    """The JSON record of a benchmark that runs one job per configuration: its head, its table, its records."""
    return {
        **record_header(benchmark, args, load_before, started),
        "reference_workers": reference,
        "columns": list(columns),
        "table": rows,
        "configs": list(records),
    }


def format_records(records: Sequence[dict[str, Any]], columns: Sequence[Column], left: int = 1) -> str:
    """A text table (:func:`bunsan._table.format_table`) with one row per record.

    Each column is ``(header, cell)``: ``cell`` is a :meth:`str.format` template over the
    record's keys (``"{ddp_ms:.3f}"``) or a function of the record. The first ``left``
    columns are left-aligned (names), the others right-aligned (numbers).
    """
    header = [name for name, _ in columns]
    rows = [[cell.format(**r) if isinstance(cell, str) else cell(r) for _, cell in columns] for r in records]
    return format_table(header, rows, right=header[left:])


# -- the machine---------------------------------------------------------------------------
def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else all of the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info(threads: int) -> dict[str, Any]:
    """The machine a benchmark ran on, for its JSON record (imports torch)."""
    import torch

    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "threads_per_worker": threads,
        "cuda": torch.cuda.is_available(),
    }


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded; None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -- the command --------------------------------------------------------------------------
def add_job_arguments(parser: argparse.ArgumentParser, benchmark: str, timeout_s: float, one_job: bool = False) -> None:
    """Add ``--threads --timeout-s --out --json --plots --no-plots``, the options of every job-running benchmark."""
    plot, output = ("plot", "job's output") if one_job else ("plots", "jobs' outputs")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per worker; default %(default)s")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=timeout_s,
        help=f"{'for the job' if one_job else 'per job'}; default %(default)s",
    )
    parser.add_argument("--out", default=f"runs/{benchmark}", help=f"directory of the {output}; default %(default)s")
    parser.add_argument("--json", metavar="FILE", help=f"the JSON record; default OUT/{benchmark}.json")
    parser.add_argument("--plots", metavar="DIR", help=f"PNG {plot}; default OUT/plots")
    parser.add_argument("--no-plots", action="store_true", help=f"write no {plot}")


def command_main(
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    epilog: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    *,
    worker: Callable[[dict[str, Any]], int] | None = None,
    allow_abbrev: bool = False,
) -> int:
    """A benchmark's ``python -m`` entry: ``--worker SPEC`` runs one job's worker, else parse and ``run``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if worker is not None and argv[:1] == ["--worker"]:
        return worker(json.loads(argv[1]))
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=allow_abbrev,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if prog.startswith("bunsan bench"):  # also when started as `python -m`, which bypasses bunsan.cli's check
        from bunsan import _extras

        try:
            _extras.check_command("bench")
        except _extras.MissingExtraError as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
    return run(args)
