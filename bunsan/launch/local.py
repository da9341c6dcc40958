"""Start the workers of a job on this machine and watch them until the job ends.

Process hygiene, the invariants this module keeps:

* Every worker starts in its own session, so its process group is its whole
  tree (unless a descendant calls ``setsid`` itself).
* Every process of the job carries ``BUNSAN_JOB_ID=<id>`` in its environment
  and inherits it, so :func:`job_pids` finds descendants that left the
  worker's process group (``setsid``, ``start_new_session=True``).
* When any worker fails, the launcher signals every worker's process group and
  every process of the job: SIGTERM, then SIGKILL after ``grace_s`` (<= 3 s),
  and exits with the code of the first worker that failed.
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

__all__ = [
    "GRACE_S",
    "WorkerSpec",
    "exit_code_of",
    "find_free_port",
    "first_failure",
    "format_plan",
    "is_job_environ",
    "job_pids",
    "new_job_id",
    "plan_workers",
    "run_workers",
    "worker_command",
    "worker_environment",
]

GRACE_S = 3.0  # between SIGTERM (or a forwarded signal) and SIGKILL
KILL_WAIT_S = 3.0  # after SIGKILL, how long to wait for the job to vanish
POLL_S = 0.05  # how often the watch loop checks the workers
DRAIN_S = 1.0  # after the job is gone, how long to wait for the last output
_FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


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


# ---------------------------------------------------------------------------
# Pure helpers: planning, environment, exit codes.


def new_job_id() -> str:
    """Return a fresh id for one launch, unique enough to tell jobs apart in ``/proc``."""
    return uuid.uuid4().hex[:16]


def worker_command(command: Sequence[str], python: str | None = None) -> list[str]:
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

    Raises:
        ValueError: The script does not exist or the executable is not found.
    """
    if not command:
        raise ValueError("no command given; put the training script after the options, e.g. bunsan run -np 2 train.py")
    first, rest = command[0], list(command[1:])
    if first.endswith(".py"):
        if not os.path.isfile(first):
            raise ValueError(f"script {first!r} does not exist (looked in {os.getcwd()}); check the path")
        return [python or sys.executable, "-u", first, *rest]
    if first in ("python", "python3"):
        return [python or sys.executable, "-u", *rest]
    if shutil.which(first) is None:
        raise ValueError(f"command {first!r} is neither a .py script nor an executable on PATH; check the spelling")
    return [first, *rest]


def worker_environment(
    slot: Slot, base: Mapping[str, str], master_addr: str, master_port: int, job_id: str
) -> dict[str, str]:
    """Return the environment of the worker in ``slot``: ``base`` plus what ``bunsan.init()`` reads.

    The variables follow torchrun's convention (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``), so the same script also runs under torchrun. On top:
    ``BUNSAN_JOB_ID`` (finds the job's processes) and ``BUNSAN_LAUNCHER=bunsan``.
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
) -> list[WorkerSpec]:
    """Return one :class:`WorkerSpec` per slot, in rank order. Pure."""
    return [
        WorkerSpec(
            slot.rank,
            slot.local_rank,
            slot.host,
            tuple(argv),
            worker_environment(slot, base_env, master_addr, master_port, job_id),
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


def is_job_environ(environ: bytes, job_id: str) -> bool:
    """Whether a ``/proc/<pid>/environ`` blob belongs to job ``job_id``."""
    return f"BUNSAN_JOB_ID={job_id}".encode() in environ.split(b"\0")


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


def job_pids(job_id: str, proc: str = "/proc") -> list[int]:
    """Return the live processes whose environment has ``BUNSAN_JOB_ID=<job_id>``.

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
        if is_job_environ(environ, job_id):
            found.append(int(entry))
    return found


def _signal_job_pid(pid: int, job_id: str, sig: int) -> None:
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
                if not is_job_environ(f.read(), job_id):
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


def _signal_job(processes: Sequence[subprocess.Popen[bytes]], job_id: str, sig: int) -> None:
    """Send ``sig`` to every worker's process group and to every process of the job."""
    _signal_groups(processes, sig)
    for pid in job_pids(job_id):
        _signal_job_pid(pid, job_id, sig)


def _job_alive(processes: Sequence[subprocess.Popen[bytes]], job_id: str) -> bool:
    running = [p for p in processes if p.poll() is None]  # poll() also reaps the dead
    return bool(running) or bool(job_pids(job_id))


# ---------------------------------------------------------------------------
# Starting workers.


def _die_with_launcher_hook() -> Callable[[], None] | None:
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


def _start_worker(spec: WorkerSpec, tag_output: bool, preexec: Callable[[], None] | None) -> subprocess.Popen[bytes]:
    pipe = subprocess.PIPE if tag_output else None  # untagged: output passes through untouched
    return subprocess.Popen(
        list(spec.argv),
        env=dict(spec.env),
        stdin=None if spec.rank == 0 else subprocess.DEVNULL,  # like mpirun: stdin goes to rank 0
        stdout=pipe,
        stderr=pipe,
        start_new_session=True,
        preexec_fn=preexec,
    )


# ---------------------------------------------------------------------------
# The janitor: sweeps the job if the launcher is killed with SIGKILL.


def _sweep(job_id: str, grace_s: float) -> None:
    """SIGTERM every process of the job, then SIGKILL what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        deadline = time.monotonic() + wait_s
        while pids := job_pids(job_id):
            for pid in pids:
                _signal_job_pid(pid, job_id, sig)
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        else:
            return


def _start_janitor(job_id: str, grace_s: float) -> tuple[int, int] | None:
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
            _sweep(job_id, grace_s)
        finally:
            os._exit(0)
    os.close(read_fd)
    return pid, write_fd


def _stop_janitor(janitor: tuple[int, int] | None) -> None:
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


class _OutputPump:
    """Copy the workers' output to ours, one whole line at a time, prefixed with ``[rank] ``."""

    _MAX_PARTIAL = 1 << 16  # flush a line this long even without its newline

    def __init__(self, stdout: IO[Any], stderr: IO[Any]) -> None:
        self._selector = selectors.DefaultSelector()
        self._stdout = _binary(stdout)
        self._stderr = _binary(stderr)
        self._partial: dict[int, bytes] = {}

    def add(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        for pipe, dest in ((process.stdout, self._stdout), (process.stderr, self._stderr)):
            if pipe is not None:
                os.set_blocking(pipe.fileno(), False)
                self._selector.register(pipe, selectors.EVENT_READ, (f"[{rank}] ".encode(), dest))
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
            prefix, dest = key.data
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
                self._write(dest, prefix, data.splitlines(keepends=True), final=True)
                continue
            lines = data.splitlines(keepends=True)
            if lines and not lines[-1].endswith((b"\n", b"\r")) and len(lines[-1]) < self._MAX_PARTIAL:
                self._partial[fd] = lines.pop()
            else:
                self._partial[fd] = b""
            self._write(dest, prefix, lines)

    def drain(self, timeout_s: float) -> None:
        """Copy output until every pipe is closed or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        while self.open and (left := deadline - time.monotonic()) > 0:
            self.pump(min(left, POLL_S))
        self.close()

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            prefix, dest = key.data
            self._write(dest, prefix, [self._partial.pop(key.fd, b"")], final=True)
            self._selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    @staticmethod
    def _write(dest: IO[bytes], prefix: bytes, lines: list[bytes], final: bool = False) -> None:
        out = b"".join(prefix + (line if line.endswith((b"\n", b"\r")) else line + b"\n") for line in lines if line)
        if not out:
            return
        try:
            dest.write(out)
            dest.flush()
        except (BrokenPipeError, ValueError):  # our reader went away; keep the job running
            pass


# ---------------------------------------------------------------------------
# Watching the job.


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


def _wait_gone(
    processes: Sequence[subprocess.Popen[bytes]],
    job_id: str,
    timeout_s: float,
    pump: _OutputPump,
    hurry: Callable[[], bool] = lambda: False,
) -> bool:
    """Wait until no worker runs and no process of the job is left; True if so in time."""
    deadline = time.monotonic() + timeout_s
    while _job_alive(processes, job_id):
        if time.monotonic() >= deadline or hurry():
            return False
        pump.pump(POLL_S)
    return True


def _stop_job(
    processes: Sequence[subprocess.Popen[bytes]],
    job_id: str,
    first_signal: int,
    grace_s: float,
    pump: _OutputPump,
    signals: _Signals,
) -> None:
    """Signal the whole job with ``first_signal``, then SIGKILL what is left after ``grace_s``.

    A further SIGINT/SIGTERM to the launcher cuts the grace short (Ctrl-C twice).
    """
    seen = len(signals.received)
    _signal_job(processes, job_id, first_signal)
    gone = _wait_gone(processes, job_id, grace_s, pump, hurry=lambda: len(signals.received) > seen)
    deadline = time.monotonic() + KILL_WAIT_S
    while not gone and time.monotonic() < deadline:
        # Again and again: a dying process may still have forked.
        _signal_job(processes, job_id, signal.SIGKILL)
        gone = _wait_gone(processes, job_id, 0.1, pump)
    # Members of the groups that dropped BUNSAN_JOB_ID from their environment.
    _signal_groups(processes, signal.SIGKILL)


def _watch(processes: Sequence[subprocess.Popen[bytes]], pump: _OutputPump, signals: _Signals) -> tuple[str, int]:
    """Wait for the job to end. Returns ("ok", 0), ("failed", index) or ("signal", signum)."""
    while True:
        if signals.received:
            return "signal", signals.received[0]
        index = first_failure([p.poll() for p in processes])
        if index is not None:
            return "failed", index
        if all(p.returncode == 0 for p in processes):
            return "ok", 0
        pump.pump(POLL_S)


def _start_all(
    specs: Sequence[WorkerSpec],
    tag_output: bool,
    processes: list[subprocess.Popen[bytes]],
    pump: _OutputPump,
    signals: _Signals,
    stderr: IO[Any],
) -> bool:
    """Start the workers in rank order, appending to ``processes``; False if one cannot start."""
    preexec = _die_with_launcher_hook()
    for spec in specs:
        if signals.received:  # Ctrl-C during startup: _watch reports it
            break
        try:
            process = _start_worker(spec, tag_output, preexec)
        except OSError as err:
            _say(stderr, f"error: cannot start rank {spec.rank} ({shlex.join(spec.argv)}): {err}")
            return False
        processes.append(process)
        pump.add(spec.rank, process)
    return True


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
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    if not 0 <= grace_s <= GRACE_S:
        raise ValueError(f"grace_s must be in [0, {GRACE_S}], got {grace_s}; the whole job must end within 10 s")
    pump = _OutputPump(stdout, stderr)
    processes: list[subprocess.Popen[bytes]] = []
    with _Signals() as signals:
        janitor = _start_janitor(job_id, grace_s)

        def stop(first_signal: int) -> None:
            _stop_job(processes, job_id, first_signal, grace_s, pump, signals)

        try:
            if not _start_all(specs, tag_output, processes, pump, signals, stderr):
                stop(signal.SIGTERM)
                return 2
            outcome, detail = _watch(processes, pump, signals)
            if outcome == "ok":
                # Every worker exited 0; still sweep what they left running in the background.
                if _job_alive(processes, job_id):
                    _say(stderr, f"all workers exited 0; stopping processes they left behind (job {job_id})")
                stop(signal.SIGTERM)
                return 0
            if outcome == "failed":
                returncode = processes[detail].returncode
                assert returncode is not None
                others = sum(p.poll() is None for p in processes)
                stopping = f"stopping the other {others} worker(s)" if others else "stopping what is left of the job"
                _say(stderr, f"rank {specs[detail].rank} {_describe_exit(returncode)}; {stopping}")
                stop(signal.SIGTERM)
                return exit_code_of(returncode)
            _say(stderr, f"got {signal.Signals(detail).name}; stopping the job")
            stop(detail)  # forward the launcher's signal, then escalate
            return 128 + detail
        finally:
            # Also reached on an unexpected exception in the launcher itself.
            if _job_alive(processes, job_id):
                _stop_job(processes, job_id, signal.SIGKILL, 0.0, pump, signals)
            pump.drain(DRAIN_S)
            _stop_janitor(janitor)
