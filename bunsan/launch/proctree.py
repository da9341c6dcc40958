"""Find and signal every process of a job on this machine, and the janitor that outlives the launcher.

* Every worker starts in its own session, so its process group is its whole
  tree (unless a descendant calls ``setsid`` itself).
* Every process of the job carries ``BUNSAN_JOB_ID=<id>`` in its environment
  and inherits it, so :func:`job_pids` finds descendants that left the
  worker's process group (``setsid``, ``start_new_session=True``). On a host
  of a multi-host job the per-host agent (:mod:`bunsan.launch.remote`) sweeps
  by ``BUNSAN_HOST_JOB_ID=<id>.h<group rank>`` instead, so that it only ever
  touches its own host's share of the job, even where two "hosts" share one
  process table.
* If the launcher itself is SIGKILLed, the kernel kills the workers
  (``PR_SET_PDEATHSIG``, :func:`die_with_launcher_hook`) and a small janitor
  process, which notices the launcher's death when a pipe closes, sweeps the
  rest of the job (:func:`start_janitor`).

:mod:`bunsan.launch.treewatch` does the same for one worker's own children
under any launcher; it runs as a standalone script with the standard library
only, so it cannot share this module's code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bunsan.launch.plan import JOB_ID_VARIABLE

__all__ = [
    "FORWARDED_SIGNALS",
    "GRACE_S",
    "KILL_WAIT_S",
    "POLL_S",
    "Signals",
    "die_with_launcher_hook",
    "is_job_environ",
    "job_alive",
    "job_pids",
    "signal_groups",
    "signal_job",
    "start_janitor",
    "stop_janitor",
    "sweep_job",
]

GRACE_S = 3.0  # between SIGTERM (or a forwarded signal) and SIGKILL
KILL_WAIT_S = 3.0  # after SIGKILL, how long to wait for the job to vanish
POLL_S = 0.05  # how often the watch loop checks the workers
FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def is_job_environ(environ: bytes, job_id: str, variable: str = JOB_ID_VARIABLE) -> bool:
    """Whether a ``/proc/<pid>/environ`` blob has the entry ``<variable>=<job_id>``."""
    return f"{variable}={job_id}".encode() in environ.split(b"\0")


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


def signal_groups(processes: Iterable[subprocess.Popen[bytes]], sig: int) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)  # each worker leads its own group: pgid == pid


def signal_job(
    processes: Sequence[subprocess.Popen[bytes]], job_id: str, sig: int, variable: str = JOB_ID_VARIABLE
) -> None:
    """Send ``sig`` to every worker's process group and to every process of the job."""
    signal_groups(processes, sig)
    for pid in job_pids(job_id, variable=variable):
        _signal_job_pid(pid, job_id, sig, variable)


def job_alive(processes: Sequence[subprocess.Popen[bytes]], job_id: str, variable: str = JOB_ID_VARIABLE) -> bool:
    running = [p for p in processes if p.poll() is None]  # poll() also reaps the dead
    return bool(running) or bool(job_pids(job_id, variable=variable))


def die_with_launcher_hook(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that makes the worker die with the launcher (Linux).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child ends,
    so workers must be started from the launcher's main thread, which lives
    as long as the launcher. libc is loaded here, before the fork, so the
    child only makes two system calls. ``sig``: what the child gets then;
    SIGKILL for a worker, SIGTERM for a child that is itself a launcher and
    must stop its own workers (a benchmark's job: :func:`bunsan.bench._common.run_job`).
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
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return die_with_launcher


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
            for sig in FORWARDED_SIGNALS:  # Ctrl-C reaches the launcher's group; outlive it
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


class Signals:
    """Record SIGINT, SIGTERM and SIGHUP instead of dying; restore the old handlers on exit."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED_SIGNALS:
                self._old[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)
