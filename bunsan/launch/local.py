"""Start the workers of a job on this machine and watch them until the job ends.

The run loop. The invariants it keeps with its siblings:

* Every worker starts in its own session and every process of the job carries
  ``BUNSAN_JOB_ID`` (:mod:`bunsan.launch.proctree` finds and signals them).
* When any worker fails, the launcher signals every worker's process group and
  every process of the job: SIGTERM, then SIGKILL after ``grace_s`` (<= 3 s),
  and exits with the code of the worker that failed first
  (:mod:`bunsan.launch.blame` says which one that is).
* SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded the same way,
  then escalated to SIGKILL; the launcher exits 128 + signal number.
* If the launcher itself is SIGKILLed, ``PR_SET_PDEATHSIG`` and a janitor
  process end the job (:mod:`bunsan.launch.proctree`).

The watching is done by one thread: a loop that polls the workers and, with
``--tag-output``, copies their output line by line (:mod:`bunsan.launch.output`).
Threads would make ``preexec_fn`` and ``fork`` unsafe, and signal handlers run in
the main thread anyway.

The names of the planning, blaming and process modules that this module used to
hold are re-exported here, so ``from bunsan.launch.local import ...`` keeps working.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from bunsan._validate import check_int, check_number
from bunsan.launch.blame import Attribution, FailureReport, attribute_failure
from bunsan.launch.output import OutputPump, OutputSink
from bunsan.launch.plan import (
    HOST_JOB_VARIABLE,
    JOB_ID_VARIABLE,
    REPORT_FD_VARIABLE,
    JobOutcome,
    WorkerSpec,
    exit_code_of,
    find_free_port,
    first_failure,
    format_plan,
    new_job_id,
    plan_workers,
    worker_command,
    worker_environment,
)
from bunsan.launch.proctree import (
    GRACE_S,
    KILL_WAIT_S,
    POLL_S,
    Signals,
    die_with_launcher_hook,
    is_job_environ,
    job_alive,
    job_pids,
    signal_groups,
    signal_job,
    start_janitor,
    stop_janitor,
    sweep_job,
)

__all__ = [
    "GRACE_S",
    "HOST_JOB_VARIABLE",
    "JOB_ID_VARIABLE",
    "REPORT_FD_VARIABLE",
    "Attribution",
    "FailureReport",
    "JobOutcome",
    "WorkerSpec",
    "attribute_failure",
    "die_with_launcher_hook",
    "exit_code_of",
    "find_free_port",
    "first_failure",
    "format_plan",
    "is_job_environ",
    "job_pids",
    "new_job_id",
    "plan_workers",
    "run_attempts",
    "run_job",
    "start_janitor",
    "stop_janitor",
    "sweep_job",
    "worker_command",
    "worker_environment",
]

DRAIN_S = 1.0  # after the job is gone, how long to wait for the last output
ORIGIN_WAIT_S = 2.0  # how long to wait for the rank that failed first to exit by itself


def _start_worker(
    spec: WorkerSpec,
    tag_output: bool,
    preexec: Callable[[], None] | None,
    stdin_to_rank0: bool = True,
    report_fd: int | None = None,
) -> subprocess.Popen[bytes]:
    pipe = subprocess.PIPE if tag_output else None  # untagged: output passes through untouched
    env = dict(spec.env)
    if report_fd is not None:
        env[REPORT_FD_VARIABLE] = str(report_fd)
    return subprocess.Popen(
        list(spec.argv),
        env=env,
        pass_fds=() if report_fd is None else (report_fd,),
        # Like mpirun, stdin goes to rank 0; an agent keeps its stdin (the ssh channel) to itself.
        stdin=None if spec.rank == 0 and stdin_to_rank0 else subprocess.DEVNULL,
        stdout=pipe,
        stderr=pipe,
        start_new_session=True,
        preexec_fn=preexec,
    )


class _Reports:
    """The launcher's end of the report pipe: :class:`FailureReport` lines from the workers."""

    _MAX_BUFFER = 1 << 20  # a worker that floods the pipe loses its lines, not our memory

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self._buffer = b""
        self.items: list[FailureReport] = []

    def poll(self) -> list[FailureReport]:
        """Read what arrived; returns the new reports."""
        new: list[FailureReport] = []
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._buffer = (self._buffer + chunk)[-self._MAX_BUFFER :]
            *lines, self._buffer = self._buffer.split(b"\n")
            new += [r for r in map(FailureReport.from_line, lines) if r is not None]
        self.items += new
        return new

    def close_write_end(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def close(self) -> None:
        self.close_write_end()
        with contextlib.suppress(OSError):
            os.close(self.read_fd)


def _say(stderr: IO[Any], message: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):  # our reader went away
        print(f"bunsan run: {message}", file=stderr, flush=True)


class _Job:
    """The processes of one job on this machine, and how to find the ones that wandered off."""

    def __init__(self, job_id: str, variable: str) -> None:
        self.job_id = job_id
        self.variable = variable
        self.processes: list[subprocess.Popen[bytes]] = []

    def signal(self, sig: int) -> None:
        signal_job(self.processes, self.job_id, sig, self.variable)

    def alive(self) -> bool:
        return job_alive(self.processes, self.job_id, self.variable)


def _wait_gone(job: _Job, timeout_s: float, pump: OutputPump, hurry: Callable[[], bool] = lambda: False) -> bool:
    """Wait until no worker runs and no process of the job is left; True if so in time."""
    deadline = time.monotonic() + timeout_s
    while job.alive():
        if time.monotonic() >= deadline or hurry():
            return False
        pump.pump(POLL_S)
    return True


def _stop_job(job: _Job, first_signal: int, grace_s: float, pump: OutputPump, signals: Signals) -> None:
    """Signal the whole job with ``first_signal``, then SIGKILL what is left after ``grace_s``.

    A further SIGINT/SIGTERM to the launcher cuts the grace short (Ctrl-C twice).
    """
    seen = len(signals.received)
    job.signal(first_signal)
    gone = _wait_gone(job, grace_s, pump, hurry=lambda: len(signals.received) > seen)
    deadline = time.monotonic() + KILL_WAIT_S
    while not gone and time.monotonic() < deadline:
        # Again and again: a dying process may still have forked.
        job.signal(signal.SIGKILL)
        gone = _wait_gone(job, 0.1, pump)
    # Members of the groups that dropped the job's variable from their environment.
    signal_groups(job.processes, signal.SIGKILL)


def _watch(
    processes: Sequence[subprocess.Popen[bytes]],
    pump: OutputPump,
    signals: Signals,
    interrupt: Callable[[], int | None] | None,
    on_tick: Callable[[], None] = lambda: None,
) -> tuple[str, int]:
    """Wait for the job to end.

    Returns ("ok", 0), ("failed", index), ("signal", signum) or ("interrupted", signum).
    """
    while True:
        on_tick()
        if signals.received:
            return "signal", signals.received[0]
        if interrupt is not None and (sig := interrupt()) is not None:
            return "interrupted", sig
        index = first_failure([p.poll() for p in processes])
        if index is not None:
            return "failed", index
        if all(p.returncode == 0 for p in processes):
            return "ok", 0
        pump.pump(POLL_S)


def _start_all(
    specs: Sequence[WorkerSpec],
    tag_output: bool,
    job: _Job,
    pump: OutputPump,
    signals: Signals,
    log: Callable[[str], None],
    stdin_to_rank0: bool,
    report_fd: int | None = None,
) -> bool:
    """Start the workers in rank order, appending to ``job.processes``; False if one cannot start."""
    preexec = die_with_launcher_hook()
    for spec in specs:
        if signals.received:  # Ctrl-C during startup: _watch reports it
            break
        try:
            process = _start_worker(spec, tag_output, preexec, stdin_to_rank0, report_fd)
        except OSError as err:
            log(f"error: cannot start rank {spec.rank} ({shlex.join(spec.argv)}): {err}")
            return False
        job.processes.append(process)
        pump.add(spec.rank, process)
    return True


def run_job(
    specs: Sequence[WorkerSpec],
    job_id: str,
    *,
    tag_output: bool = False,
    grace_s: float = GRACE_S,
    stdout: IO[Any] | None = None,
    stderr: IO[Any] | None = None,
    variable: str = JOB_ID_VARIABLE,
    sink: OutputSink | None = None,
    interrupt: Callable[[], int | None] | None = None,
    log: Callable[[str], None] | None = None,
    stdin_to_rank0: bool = True,
    on_failure: Callable[[JobOutcome], None] | None = None,
    on_report: Callable[[FailureReport], None] | None = None,
) -> JobOutcome:
    """Start ``specs`` on this machine, wait for them, leave nothing behind; say how it ended.

    ``bunsan run`` calls it for a job on one machine; the per-host agent of a
    multi-host job (:mod:`bunsan.launch.remote`) uses the keyword arguments.

    Args:
        specs: The workers, in rank order (see :func:`plan_workers`); their
            environments must carry ``<variable>=<job_id>``.
        job_id: The value of ``variable`` that marks every process of the job.
        tag_output: Pipe the workers' output and copy it line by line, with
            ``[rank] `` in front (or to ``sink``); otherwise workers write
            straight to our stdout and stderr.
        grace_s: Seconds between SIGTERM (or a forwarded signal) and SIGKILL.
        stdout: Where tagged output goes; ``None`` means ``sys.stdout``.
        stderr: Where tagged error output and the launcher's own messages
            go; ``None`` means ``sys.stderr``.
        variable: The environment variable that marks the job's processes.
        sink: With ``tag_output``, receives the output lines instead of stdout/stderr.
        interrupt: Polled every few milliseconds; a signal number stops the
            job as if the launcher had received that signal.
        log: Receives the launcher's messages; default: stderr, prefixed ``bunsan run: ``.
        stdin_to_rank0: Rank 0 inherits our stdin (as with mpirun).
        on_failure: Called with the outcome as soon as a worker has failed,
            before the others are stopped (which takes up to ``2 * grace_s``).
        on_report: Called with each :class:`FailureReport` as it arrives
            (the per-host agent forwards them to the launcher).

    Returns:
        How the job ended; its ``code`` is 0 if every worker exited 0; else the
        exit code of the worker that failed first (128 + N for a death by signal
        N); 128 + N if the launcher got signal N (130 for SIGINT, 143 for
        SIGTERM); 2 if a worker could not be started.

    Raises:
        TypeError: ``grace_s`` is not a number.
        ValueError: ``grace_s`` is outside [0, 3].
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    if log is None:

        def log(message: str) -> None:
            _say(stderr, message)

    check_number("grace_s", grace_s, minimum=0, maximum=GRACE_S, hint="the whole job must end within 10 s")
    pump = OutputPump(stdout, stderr, sink)
    job = _Job(job_id, variable)
    reports = _Reports()

    def read_reports() -> None:
        for item in reports.poll():
            if on_report is not None:
                on_report(item)

    with Signals() as signals:
        janitor = start_janitor(job_id, grace_s, variable)

        def stop(first_signal: int) -> None:
            _stop_job(job, first_signal, grace_s, pump, signals)

        try:
            started = _start_all(specs, tag_output, job, pump, signals, log, stdin_to_rank0, reports.write_fd)
            reports.close_write_end()  # the workers hold it now
            if not started:
                stop(signal.SIGTERM)
                return JobOutcome(2, "start", cause="a worker could not be started")
            outcome, detail = _watch(job.processes, pump, signals, interrupt, read_reports)
            if outcome == "ok":
                # Every worker exited 0; still sweep what they left running in the background.
                if job.alive():
                    log(f"all workers exited 0; stopping processes they left behind (job {job_id})")
                stop(signal.SIGTERM)
                return JobOutcome(0, "ok")
            if outcome == "failed":
                blame = _attribute(specs, job, detail, pump, reports, read_reports)
                others = sum(p.poll() is None for p in job.processes)
                stopping = f"stopping the other {others} worker(s)" if others else "stopping what is left of the job"
                failed = JobOutcome(blame.code, "failed", blame.rank, blame.cause, origin=blame.origin)
                if on_failure is not None:
                    on_failure(failed)
                log(f"{blame.cause}; {stopping}")
                stop(signal.SIGTERM)
                return failed
            name = signal.Signals(detail).name
            if outcome == "signal":
                log(f"got {name}; stopping the job")
            stop(detail)  # forward the signal, then escalate
            return JobOutcome(128 + detail, outcome, cause=f"stopped by {name}")
        finally:
            # Also reached on an unexpected exception in the launcher itself.
            if job.alive():
                _stop_job(job, signal.SIGKILL, 0.0, pump, signals)
            pump.drain(DRAIN_S)
            reports.close()
            stop_janitor(janitor)


def _attribute(
    specs: Sequence[WorkerSpec],
    job: _Job,
    index: int,
    pump: OutputPump,
    reports: _Reports,
    read_reports: Callable[[], None],
) -> Attribution:
    """:func:`attribute_failure` for the worker at ``index``, waiting up to ``ORIGIN_WAIT_S`` when it asks to."""
    ranks = [spec.rank for spec in specs]

    def ask(final: bool) -> Attribution:
        read_reports()
        codes = {rank: process.poll() for rank, process in zip(ranks, job.processes, strict=False)}
        return attribute_failure(specs[index].rank, codes, reports.items, final=final)

    blame = ask(final=False)
    if blame.wait_for is not None:
        # The rank that failed first is still in its exception hook (rank 0 lingers
        # a second so the others can read why): let it exit with its own code.
        waited = job.processes[ranks.index(blame.wait_for)]
        deadline = time.monotonic() + ORIGIN_WAIT_S
        while waited.poll() is None and time.monotonic() < deadline:
            pump.pump(POLL_S)
        blame = ask(final=True)
    return blame


def run_attempts(attempt: Callable[[int], JobOutcome], max_restarts: int, log: Callable[[str], None]) -> JobOutcome:
    """Run ``attempt(0)``, and again with 1, 2, ... after each failure, at most ``max_restarts`` more times.

    Only a failed worker or a lost host leads to a restart; success, a
    signal to the launcher, or a worker that could not start end the job.
    Every restart is logged with its cause.
    """
    check_int("max_restarts", max_restarts, minimum=0)
    restart = 0
    while True:
        outcome = attempt(restart)
        if outcome.kind not in ("failed", "lost") or restart == max_restarts:
            if restart and outcome.kind == "ok":
                log(f"the job succeeded after {restart} restart(s)")
            elif max_restarts and outcome.kind in ("failed", "lost"):
                log(f"giving up after {restart} restart(s) (--max-restarts {max_restarts})")
            return outcome
        restart += 1
        log(
            f"restart {restart} of {max_restarts} after: {outcome.cause}; "
            f"starting every worker again (BUNSAN_RESTART={restart})"
        )
