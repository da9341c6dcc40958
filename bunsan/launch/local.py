"""Start the workers of a job on this machine and watch them until the job ends.

Process hygiene, the invariants this module keeps:

* Every worker starts in its own session, so its process group is its whole
  tree (unless a descendant calls ``setsid`` itself).
* Every process of the job carries ``BUNSAN_JOB_ID=<id>`` in its environment
  and inherits it, so :func:`job_pids` finds descendants that left the
  worker's process group (``setsid``, ``start_new_session=True``). On a host
  of a multi-host job the per-host agent (:mod:`bunsan.launch.remote`) sweeps
  by ``BUNSAN_HOST_JOB_ID=<id>.h<group rank>`` instead, so that it only ever
  touches its own host's share of the job, even where two "hosts" share one
  process table.
* When any worker fails, the launcher signals every worker's process group and
  every process of the job: SIGTERM, then SIGKILL after ``grace_s`` (<= 3 s),
  and exits with the code of the worker that failed first.
* "First" is the rank whose failure ended the job, not the first process to
  exit: a rank whose exception ends the job may take a second to exit while
  the others, told to stop, are already gone. Every worker gets the write end
  of a pipe (``BUNSAN_REPORT_FD``); ``bunsan.init()`` writes one line there
  before its rank exits on purpose: "I raised", or "I stop because rank k
  failed or died" (:class:`FailureReport`, :func:`attribute_failure`).
* SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded the same way,
  then escalated to SIGKILL; the launcher exits 128 + signal number.
* If the launcher itself is SIGKILLed, the kernel kills the workers
  (``PR_SET_PDEATHSIG``) and a small janitor process, which notices the
  launcher's death when a pipe closes, sweeps the rest of the job.

The watching is done by one thread: a loop that polls the workers and, with
``--tag-output``, copies their output line by line. Threads would make
``preexec_fn`` and ``fork`` unsafe, and signal handlers run in the main thread
anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from bunsan.launch.hosts import Slot
from bunsan.launch.quoting import quoted

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
    "run_workers",
    "start_janitor",
    "stop_janitor",
    "sweep_job",
    "worker_command",
    "worker_environment",
]

GRACE_S = 3.0  # between SIGTERM (or a forwarded signal) and SIGKILL
KILL_WAIT_S = 3.0  # after SIGKILL, how long to wait for the job to vanish
POLL_S = 0.05  # how often the watch loop checks the workers
DRAIN_S = 1.0  # after the job is gone, how long to wait for the last output
_FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
JOB_ID_VARIABLE = "BUNSAN_JOB_ID"  # every process of a job carries it
REPORT_FD_VARIABLE = "BUNSAN_REPORT_FD"  # the workers' end of the launcher's report pipe
ORIGIN_WAIT_S = 2.0  # how long to wait for the rank that failed first to exit by itself
HOST_JOB_VARIABLE = "BUNSAN_HOST_JOB_ID"  # "<job id>.h<group rank>": one host's share of a job


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: where it runs, what it runs, with which environment.

    Attributes:
        rank: Global rank.
        local_rank: Rank on its host.
        host: Host name, as given by the user (``"localhost"`` by default).
        argv: The command line, already resolved by :func:`worker_command`.
        env: The complete environment of the worker.
    """

    rank: int
    local_rank: int
    host: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)


@dataclass(frozen=True)
class JobOutcome:
    """How a job (or one host's share of it) ended.

    Attributes:
        code: The exit status to report (see :func:`run_workers`).
        kind: ``"ok"``; ``"failed"`` (a worker failed); ``"signal"`` (the
            launcher got a signal); ``"interrupted"`` (the ``interrupt``
            callback asked to stop); ``"start"`` (a worker could not start).
        rank: The global rank of the worker that failed, for ``"failed"``.
        cause: One sentence for the log, e.g. ``"rank 1 exited with code 3"``.
        unconfirmed: Hosts where the end of every worker could not be
            confirmed (a lost connection): ``bunsan run --cleanup`` is for them.
        origin: False when the failed workers here only stopped because a
            rank on another host failed (``rank`` is then that rank): the
            launcher of a multi-host job prefers another host's own failure.
    """

    code: int
    kind: str
    rank: int | None = None
    cause: str = ""
    unconfirmed: tuple[str, ...] = ()
    origin: bool = True


@dataclass(frozen=True)
class FailureReport:
    """What a worker told the launcher just before it exited on purpose.

    Attributes:
        rank: The worker's rank.
        event: ``"raised"``: it failed on its own (an uncaught exception);
            ``"stopped"``: it stops because rank ``peer`` failed or died.
        peer: For ``"stopped"``, the rank it blames (None when unknown).
        code: The exit code it is about to exit with.
        what: One line: the exception, or why it stops.
        time: Wall-clock time of the report.
    """

    rank: int
    event: str
    peer: int | None = None
    code: int = 1
    what: str = ""
    time: float = 0.0

    @classmethod
    def from_line(cls, line: bytes) -> FailureReport | None:
        """Parse one line of the report pipe; None for anything malformed."""
        try:
            data = json.loads(line)
            peer = data.get("peer")
            return cls(
                int(data["rank"]),
                str(data["event"]),
                None if peer is None else int(peer),
                int(data.get("code", 1)),
                str(data.get("what", ""))[:300],
                float(data.get("time", 0.0)),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


@dataclass(frozen=True)
class Attribution:
    """Which rank to blame for a failed job, with the code and the sentence (see :func:`attribute_failure`).

    Attributes:
        rank: The rank to name.
        code: The exit status for the launcher.
        cause: One sentence for the log.
        origin: False when the failure came from a rank that is not ours (another host).
        wait_for: A rank of ours, still running, whose exit would make the
            answer exact: the caller may wait for it a little and ask again.
    """

    rank: int
    code: int
    cause: str
    origin: bool = True
    wait_for: int | None = None


def attribute_failure(
    first: int, returncodes: Mapping[int, int | None], reports: Sequence[FailureReport], final: bool = False
) -> Attribution:
    """Name the rank whose failure ended the job. Pure.

    Args:
        first: The rank of the first worker seen to fail (non-zero exit).
        returncodes: ``Popen.returncode`` of every worker here, by rank (None: running).
        reports: What the workers reported so far.
        final: Do not ask to wait (the caller has waited already).

    Rules, in order: a worker killed by a signal without a word (SIGKILL, the
    OOM killer; bunsan's own exits always report first) names itself; else the
    earliest ``"raised"`` report names the rank (an exception ended the job;
    the others' exits are its consequences); else, if the first to fail said
    it stopped because of rank k, rank k (here, or on another host); else the
    first to fail itself (a crash, ``sys.exit(3)``).
    """
    reported = {r.rank for r in reports}
    silent = [rank for rank, code in returncodes.items() if code is not None and code < 0 and rank not in reported]
    if silent:
        rank = first if first in silent else min(silent)
        code = returncodes[rank]
        assert code is not None
        return Attribution(rank, exit_code_of(code), f"rank {rank} {_describe_exit(code)}")
    origins = sorted((r for r in reports if r.event == "raised"), key=lambda r: r.time)
    if origins:
        origin = origins[0]
        code = returncodes.get(origin.rank)
        if code is None and origin.rank in returncodes and not final:
            return Attribution(origin.rank, origin.code, "", wait_for=origin.rank)
        if code not in (None, 0):
            assert code is not None
            return Attribution(
                origin.rank,
                exit_code_of(code),
                f"rank {origin.rank} {_describe_exit(code)} (it failed first: {origin.what})",
            )
        return Attribution(
            origin.rank, origin.code, f"rank {origin.rank} failed first ({origin.what}); exit code {origin.code}"
        )
    first_code = returncodes.get(first)
    first_status = exit_code_of(first_code) if first_code is not None else 1
    blamed = next((r.peer for r in reports if r.rank == first and r.event == "stopped" and r.peer is not None), None)
    if blamed is not None and blamed != first:
        if blamed not in returncodes:
            return Attribution(
                blamed, first_status, f"rank {first} stopped because rank {blamed} on another host failed", origin=False
            )
        code = returncodes[blamed]
        if code is None and not final:
            return Attribution(blamed, first_status, "", wait_for=blamed)
        if code not in (None, 0):
            assert code is not None
            return Attribution(
                blamed,
                exit_code_of(code),
                f"rank {blamed} {_describe_exit(code)} first; the others stopped because of it",
            )
    if first_code is None:
        return Attribution(first, first_status, f"rank {first} failed")
    return Attribution(first, first_status, f"rank {first} {_describe_exit(first_code)}")


# ---------------------------------------------------------------------------
# Pure helpers: planning, environment, exit codes.


def new_job_id() -> str:
    """Return a fresh id for one launch, unique enough to tell jobs apart in ``/proc``."""
    return uuid.uuid4().hex[:16]


def worker_command(command: Sequence[str], python: str | None = None, check: bool = True) -> list[str]:
    """Resolve the user's command into the argv every worker runs.

    A first argument ending in ``.py`` is a script, run unbuffered with the
    launcher's own interpreter so the workers see the same virtual
    environment. A bare ``python`` or ``python3`` is that interpreter too (with
    ``-u``): ``bunsan run -np 2 python -m pkg`` from a virtual environment that is
    not activated must not fall back to the system's Python. Anything else is an
    executable, looked up on ``PATH``.

    Args:
        command: The script or executable, then its arguments.
        python: Interpreter for ``.py`` scripts; ``None`` means ``sys.executable``.
        check: Check here that the script exists or the executable is on
            ``PATH``. Off for workers that run on other hosts: their agent
            checks there, in its own working directory.

    Raises:
        ValueError: The script does not exist or the executable is not found.
    """
    if not command:
        raise ValueError("no command given; put the training script after the options, e.g. bunsan run -np 2 train.py")
    first, rest = command[0], list(command[1:])
    if first.endswith(".py"):
        if check and not os.path.isfile(first):
            raise ValueError(f"script {quoted(first)} does not exist (looked in {os.getcwd()}); check the path")
        return [python or sys.executable, "-u", first, *rest]
    if first in ("python", "python3"):
        return [python or sys.executable, "-u", *rest]
    if check and shutil.which(first) is None:
        raise ValueError(
            f"command {quoted(first)} is neither a .py script nor an executable on PATH; check the spelling"
        )
    return [first, *rest]


def worker_environment(
    slot: Slot, base: Mapping[str, str], master_addr: str, master_port: int, job_id: str, restart: int = 0
) -> dict[str, str]:
    """Return the environment of the worker in ``slot``: ``base`` plus what ``bunsan.init()`` reads.

    The variables follow torchrun's convention (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``), so the same script also runs under torchrun. On top:
    ``BUNSAN_JOB_ID`` (finds the job's processes; the same for every attempt of
    a job restarted with ``--max-restarts``), ``BUNSAN_RESTART`` (0 for the
    first attempt, then 1, 2, ...) and ``BUNSAN_LAUNCHER=bunsan``.
    ``OMP_NUM_THREADS`` defaults to 1 when ``base`` does not set it: on CPU,
    workers that each use every core slow each other down (a step was 15x
    slower with 2 threads per worker on 2 cores).
    """
    env = dict(base)
    env.update(
        RANK=str(slot.rank),
        WORLD_SIZE=str(slot.world_size),
        LOCAL_RANK=str(slot.local_rank),
        LOCAL_WORLD_SIZE=str(slot.local_world_size),
        GROUP_RANK=str(slot.group_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        BUNSAN_JOB_ID=job_id,
        BUNSAN_RESTART=str(restart),
        BUNSAN_LAUNCHER="bunsan",
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def plan_workers(
    slots: Sequence[Slot],
    argv: Sequence[str],
    base_env: Mapping[str, str],
    master_addr: str,
    master_port: int,
    job_id: str,
    restart: int = 0,
) -> list[WorkerSpec]:
    """Return one :class:`WorkerSpec` per slot, in rank order. Pure."""
    return [
        WorkerSpec(
            slot.rank,
            slot.local_rank,
            slot.host,
            tuple(argv),
            worker_environment(slot, base_env, master_addr, master_port, job_id, restart),
        )
        for slot in slots
    ]


def format_plan(specs: Sequence[WorkerSpec]) -> str:
    """Render the workers of a job as a table: rank, local rank, host, command."""
    header = ("rank", "local_rank", "host", "command")
    rows = [(str(s.rank), str(s.local_rank), s.host, shlex.join(s.argv)) for s in specs]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def exit_code_of(returncode: int) -> int:
    """Map a ``Popen.returncode`` to a shell exit status: a death by signal N gives 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def first_failure(returncodes: Sequence[int | None]) -> int | None:
    """Return the index (rank) of the failed worker to report, or ``None``.

    ``returncodes`` is one poll of every worker (``None``: still running).
    Workers that failed within one poll interval are tied; the lowest rank
    wins, so the choice is deterministic.
    """
    return next((rank for rank, code in enumerate(returncodes) if code not in (None, 0)), None)


def is_job_environ(environ: bytes, job_id: str, variable: str = JOB_ID_VARIABLE) -> bool:
    """Whether a ``/proc/<pid>/environ`` blob has the entry ``<variable>=<job_id>``."""
    return f"{variable}={job_id}".encode() in environ.split(b"\0")


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {exit_code_of(returncode)})"
    return f"exited with code {returncode}"


# ---------------------------------------------------------------------------
# Finding and signalling the job's processes.


def find_free_port(host: str = "") -> int:
    """Return a TCP port that was free a moment ago (the OS picks it when binding port 0).

    Another process may take it before rank 0 binds it; the window is short
    and ``--master-port`` is the way out if it ever matters.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def job_pids(job_id: str, proc: str = "/proc", variable: str = JOB_ID_VARIABLE) -> list[int]:
    """Return the live processes whose environment has ``<variable>=<job_id>``.

    ``variable`` is ``BUNSAN_JOB_ID`` (the whole job, on this machine) or
    ``BUNSAN_HOST_JOB_ID`` (one host's share, for its agent).

    The caller's own pid is left out. Zombies have an empty environ and are
    not listed: they are dead, only not reaped yet. A process that replaced
    its environment at ``exec`` is not found either; the process-group kill
    covers it unless it also left the group.
    """
    own = os.getpid()
    found = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            with open(os.path.join(proc, entry, "environ"), "rb") as f:
                environ = f.read()
        except OSError:  # gone, or not ours to read
            continue
        if is_job_environ(environ, job_id, variable):
            found.append(int(entry))
    return found


def _signal_job_pid(pid: int, job_id: str, sig: int, variable: str = JOB_ID_VARIABLE) -> None:
    """Send ``sig`` to ``pid`` if it still belongs to the job.

    With a pidfd the check and the signal address the same process, so a pid
    reused in between by an unrelated process is never hit.
    """
    pidfd = None
    try:
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(pid)
            except OSError as err:
                if isinstance(err, ProcessLookupError):
                    return
                pidfd = None  # kernel without pidfd: fall back to os.kill
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if not is_job_environ(f.read(), job_id, variable):
                    return
        except OSError:
            return
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _signal_groups(processes: Iterable[subprocess.Popen[bytes]], sig: int) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)  # each worker leads its own group: pgid == pid


def _signal_job(
    processes: Sequence[subprocess.Popen[bytes]], job_id: str, sig: int, variable: str = JOB_ID_VARIABLE
) -> None:
    """Send ``sig`` to every worker's process group and to every process of the job."""
    _signal_groups(processes, sig)
    for pid in job_pids(job_id, variable=variable):
        _signal_job_pid(pid, job_id, sig, variable)


def _job_alive(processes: Sequence[subprocess.Popen[bytes]], job_id: str, variable: str = JOB_ID_VARIABLE) -> bool:
    running = [p for p in processes if p.poll() is None]  # poll() also reaps the dead
    return bool(running) or bool(job_pids(job_id, variable=variable))


# ---------------------------------------------------------------------------
# Starting workers.


def die_with_launcher_hook() -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that makes the worker die with the launcher (Linux).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child ends,
    so workers must be started from the launcher's main thread, which lives
    as long as the launcher. libc is loaded here, before the fork, so the
    child only makes two system calls.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def die_with_launcher() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return die_with_launcher


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


# ---------------------------------------------------------------------------
# The janitor: sweeps the job if the launcher is killed with SIGKILL.


def sweep_job(job_id: str, grace_s: float, variable: str = JOB_ID_VARIABLE) -> list[int]:
    """SIGTERM every process of the job on this machine, then SIGKILL what is left after ``grace_s``.

    Returns:
        The pids that were found (and signalled) on the first look.
    """
    first: list[int] | None = None
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        deadline = time.monotonic() + wait_s
        while pids := job_pids(job_id, variable=variable):
            if first is None:
                first = pids
            for pid in pids:
                _signal_job_pid(pid, job_id, sig, variable)
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        else:
            return first or []
    return first or []


def start_janitor(job_id: str, grace_s: float, variable: str = JOB_ID_VARIABLE) -> tuple[int, int] | None:
    """Fork a process that sweeps the job once the launcher is gone.

    It waits for end-of-file on a pipe whose only writer is the launcher: the
    kernel closes it however the launcher ends, SIGKILL included. Returns the
    janitor's pid and the pipe's write end, or ``None`` where fork is not
    safe (another thread is running) or not available.
    """
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return None
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the janitor
        try:
            for sig in _FORWARDED_SIGNALS:  # Ctrl-C reaches the launcher's group; outlive it
                signal.signal(sig, signal.SIG_IGN)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)  # hold no pipe of the caller open
            os.closerange(3, read_fd)
            os.closerange(read_fd + 1, 65536)
            while os.read(read_fd, 4096):
                pass
            sweep_job(job_id, grace_s, variable)
        finally:
            os._exit(0)
    os.close(read_fd)
    return pid, write_fd


def stop_janitor(janitor: tuple[int, int] | None) -> None:
    """Tell the janitor that the launcher ended normally; it sweeps once and exits."""
    if janitor is None:
        return
    pid, write_fd = janitor
    os.close(write_fd)  # the janitor sweeps (finds nothing) and exits
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:  # already reaped (SIGCHLD ignored by our caller)
            return
        time.sleep(0.01)
    # Still sweeping something; it exits by itself, so do not block on it.


# ---------------------------------------------------------------------------
# Output tagging.


def _binary(stream: IO[Any]) -> IO[bytes]:
    return getattr(stream, "buffer", stream)


OutputSink = Callable[[int, int, bytes], None]
"""``sink(rank, stream, data)``: whole lines of a worker's output; ``stream`` is 1 (stdout) or 2 (stderr)."""


class _OutputPump:
    """Copy the workers' output to ours, one whole line at a time, prefixed with ``[rank] ``.

    With a ``sink`` the lines go to it instead, untouched (the per-host agent
    frames them for the launcher).
    """

    _MAX_PARTIAL = 1 << 16  # flush a line this long even without its newline

    def __init__(self, stdout: IO[Any], stderr: IO[Any], sink: OutputSink | None = None) -> None:
        self._selector = selectors.DefaultSelector()
        self._dests = {1: _binary(stdout), 2: _binary(stderr)}
        self._sink = sink
        self._partial: dict[int, bytes] = {}

    def add(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        for pipe, stream in ((process.stdout, 1), (process.stderr, 2)):
            if pipe is not None:
                os.set_blocking(pipe.fileno(), False)
                self._selector.register(pipe, selectors.EVENT_READ, (rank, stream))
                self._partial[pipe.fileno()] = b""

    @property
    def open(self) -> bool:
        return bool(self._selector.get_map())

    def pump(self, timeout_s: float) -> None:
        """Copy what is available, waiting at most ``timeout_s`` for it."""
        if not self.open:
            time.sleep(timeout_s)
            return
        for key, _ in self._selector.select(timeout_s):
            rank, stream = key.data
            fd = key.fd
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            data = self._partial[fd] + chunk
            if not chunk:  # end of file: flush the last, unterminated line
                self._selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                del self._partial[fd]
                self._write(rank, stream, data.splitlines(keepends=True))
                continue
            lines = data.splitlines(keepends=True)
            if lines and not lines[-1].endswith((b"\n", b"\r")) and len(lines[-1]) < self._MAX_PARTIAL:
                self._partial[fd] = lines.pop()
            else:
                self._partial[fd] = b""
            self._write(rank, stream, lines)

    def drain(self, timeout_s: float) -> None:
        """Copy output until every pipe is closed or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        while self.open and (left := deadline - time.monotonic()) > 0:
            self.pump(min(left, POLL_S))
        self.close()

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            rank, stream = key.data
            self._write(rank, stream, [self._partial.pop(key.fd, b"")])
            self._selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _write(self, rank: int, stream: int, lines: list[bytes]) -> None:
        data = b"".join(line if line.endswith((b"\n", b"\r")) else line + b"\n" for line in lines if line)
        if not data:
            return
        if self._sink is not None:
            self._sink(rank, stream, data)
            return
        prefix = f"[{rank}] ".encode()
        out = b"".join(prefix + line for line in data.splitlines(keepends=True))
        try:
            dest = self._dests[stream]
            dest.write(out)
            dest.flush()
        except (BrokenPipeError, ValueError):  # our reader went away; keep the job running
            pass


# ---------------------------------------------------------------------------
# Watching the job.


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


class _Signals:
    """Record SIGINT, SIGTERM and SIGHUP instead of dying; restore the old handlers on exit."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in _FORWARDED_SIGNALS:
                self._old[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)


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
        _signal_job(self.processes, self.job_id, sig, self.variable)

    def alive(self) -> bool:
        return _job_alive(self.processes, self.job_id, self.variable)


def _wait_gone(job: _Job, timeout_s: float, pump: _OutputPump, hurry: Callable[[], bool] = lambda: False) -> bool:
    """Wait until no worker runs and no process of the job is left; True if so in time."""
    deadline = time.monotonic() + timeout_s
    while job.alive():
        if time.monotonic() >= deadline or hurry():
            return False
        pump.pump(POLL_S)
    return True


def _stop_job(job: _Job, first_signal: int, grace_s: float, pump: _OutputPump, signals: _Signals) -> None:
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
    _signal_groups(job.processes, signal.SIGKILL)


def _watch(
    processes: Sequence[subprocess.Popen[bytes]],
    pump: _OutputPump,
    signals: _Signals,
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
    pump: _OutputPump,
    signals: _Signals,
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

    :func:`run_workers` is this function for the ``bunsan run`` of one
    machine; the per-host agent of a multi-host job (:mod:`bunsan.launch.remote`)
    uses the keyword arguments.

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

    Raises:
        ValueError: ``grace_s`` is outside [0, 3].
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    if log is None:

        def log(message: str) -> None:
            _say(stderr, message)

    if not 0 <= grace_s <= GRACE_S:
        raise ValueError(f"grace_s must be in [0, {GRACE_S}], got {grace_s}; the whole job must end within 10 s")
    pump = _OutputPump(stdout, stderr, sink)
    job = _Job(job_id, variable)
    reports = _Reports()

    def read_reports() -> None:
        for item in reports.poll():
            if on_report is not None:
                on_report(item)

    with _Signals() as signals:
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
    pump: _OutputPump,
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
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
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


def run_workers(
    specs: Sequence[WorkerSpec],
    job_id: str,
    tag_output: bool = False,
    grace_s: float = GRACE_S,
    stdout: IO[Any] | None = None,
    stderr: IO[Any] | None = None,
) -> int:
    """Start ``specs`` on this machine, wait for them, and leave nothing behind.

    Must be called from the main thread to forward signals; elsewhere it
    still runs, without forwarding.

    Args:
        specs: The workers, in rank order (see :func:`plan_workers`); their
            environments must carry ``BUNSAN_JOB_ID=job_id``.
        job_id: The job's id; every process of the job is found by it.
        tag_output: Prefix each line of worker output with ``[rank] ``;
            otherwise workers write straight to our stdout and stderr.
        grace_s: Seconds between SIGTERM (or a forwarded signal) and SIGKILL.
        stdout: Where tagged output goes; ``None`` means ``sys.stdout``.
        stderr: Where tagged error output and the launcher's own messages
            go; ``None`` means ``sys.stderr``.

    Returns:
        0 if every worker exited 0; else the exit code of the first worker to
        fail (128 + N for a death by signal N); 128 + N if the launcher got
        signal N (130 for SIGINT, 143 for SIGTERM); 2 if a worker could not
        be started.

    Raises:
        ValueError: ``grace_s`` is outside [0, 3].
    """
    return run_job(specs, job_id, tag_output=tag_output, grace_s=grace_s, stdout=stdout, stderr=stderr).code
