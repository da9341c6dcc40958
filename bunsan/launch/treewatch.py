"""End a worker's own child processes, however the worker ends, under any launcher.

``bunsan run`` sweeps every process of a job (:mod:`bunsan.launch.local`). Under
torchrun or a launch by hand nobody does: torchrun signals a worker's process
group only while the worker still runs, and a worker that bunsan ends (a peer
failed) or that dies (SIGKILL, the OOM killer) leaves its DataLoader workers
and the subprocesses of the user's script behind. Three things close that gap,
all in the worker (:func:`bunsan.comm.group.create_world` sets them up):

1. Every process the worker starts from then on carries
   ``BUNSAN_TREE=<id>`` in its environment (unless it is started with an
   environment of its own), so it can be found again even after it left the
   process tree (``setsid``, a dead parent).
2. Children the worker forks from its main thread (DataLoader and
   multiprocessing workers) get ``PR_SET_PDEATHSIG`` = SIGKILL: the kernel
   ends them when the worker dies (:func:`kill_forks_with_parent`).
3. A janitor, a small process of its own (this file, run as a script with the
   standard library only: no torch, started with ``python -I -S``), waits for the worker to
   end, however it ends, then ends what carries the mark and the descendants
   it saw while the worker lived (:func:`start_janitor`, :func:`main`).

A worker that ends on purpose also calls :func:`end_tree` before it exits.

Processes are found in ``/proc`` by their mark or their parent pid, and each is
identified by its pid *and* its start time, so a reused pid is never hit.
Linux only; elsewhere every function here does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

__all__ = [
    "TREE_VARIABLE",
    "descendants",
    "end_processes",
    "end_tree",
    "is_alive",
    "kill_forks_with_parent",
    "main",
    "marked",
    "start_janitor",
    "start_time",
]

TREE_VARIABLE = "BUNSAN_TREE"
RECORD_S = 2.0  # how often the janitor notes the worker's descendants
KILL_WAIT_S = 3.0
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_LINUX = sys.platform.startswith("linux")


class _State:
    janitor: subprocess.Popen[bytes] | None = None
    fork_hook = False
    forking_from_main = False
    forking_parent = 0


_state = _State()


# ---------------------------------------------------------------------------
# Reading /proc.


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat.rsplit(")", 1)[1].split()


def start_time(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or ``""``."""
    fields = _stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else ""


def is_alive(pid: int, start: str = "") -> bool:
    """Whether ``pid`` runs (not a zombie) and, when ``start`` is given, is the process that started then."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X", "x"):
        return False
    return not start or (len(fields) > 19 and fields[19] == start)


def _pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def descendants(pid: int) -> dict[int, str]:
    """Every living descendant of ``pid`` (by parent pid), with its start time."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for other in _pids():
        fields = _stat_fields(other)
        if not fields or len(fields) < 20 or fields[0] in ("Z", "X", "x"):
            continue
        children.setdefault(int(fields[1]), []).append(other)
        starts[other] = fields[19]
    found: dict[int, str] = {}
    stack = list(children.get(pid, ()))
    while stack:
        child = stack.pop()
        if child not in found:
            found[child] = starts[child]
            stack += children.get(child, ())
    return found


def marked(value: str, variable: str = TREE_VARIABLE) -> dict[int, str]:
    """Every living process whose environment has ``<variable>=<value>``, with its start time."""
    entry = f"{variable}={value}".encode()
    found = {}
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or not ours to read
            continue
        if entry in environ.split(b"\0"):
            start = start_time(pid)
            if start:
                found[pid] = start
    return found


# ---------------------------------------------------------------------------
# Ending processes.


def _signal(targets: dict[int, str], sig: int) -> None:
    for pid, start in targets.items():
        if start_time(pid) != start:  # gone, or the pid now belongs to another process
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(targets: dict[int, str], wait_s: float) -> dict[int, str]:
    deadline = time.monotonic() + wait_s
    while True:
        alive = {pid: start for pid, start in targets.items() if is_alive(pid, start)}
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def end_processes(targets: dict[int, str], grace_s: float) -> list[int]:
    """SIGTERM ``targets`` (pid -> start time), SIGKILL what is left after ``grace_s``; the pids still alive after."""
    _signal(targets, signal.SIGTERM)
    alive = _wait_gone(targets, grace_s)
    if alive:
        _signal(alive, signal.SIGKILL)
        alive = _wait_gone(alive, KILL_WAIT_S)
    return sorted(alive)


def _tree(pid: int, tree_id: str | None, also: Iterable[tuple[int, str]] = (), living: bool = True) -> dict[int, str]:
    # Descendants by parent pid only while ``pid`` lives: a dead pid may be reused.
    targets = dict(descendants(pid)) if living else {}
    if tree_id:
        targets.update(marked(tree_id))
    targets.update(also)
    for own in (os.getpid(), pid):
        targets.pop(own, None)
    if _state.janitor is not None:
        targets.pop(_state.janitor.pid, None)  # it ends by itself once the worker is gone
    return targets


def end_tree(pid: int, tree_id: str | None, grace_s: float) -> list[int]:
    """End the descendants of ``pid`` and the processes marked ``tree_id``; returns those that survived.

    Called by a worker, with its own pid, just before it exits on purpose.
    """
    if not _LINUX:
        return []
    return end_processes(_tree(pid, tree_id), grace_s)


# ---------------------------------------------------------------------------
# In the worker: forked children die with it; a janitor for the rest.


def _before_fork() -> None:
    _state.forking_from_main = threading.current_thread() is threading.main_thread()
    _state.forking_parent = os.getpid()


def _after_fork_in_child() -> None:
    # PR_SET_PDEATHSIG fires when the *thread* that forked ends: only the main
    # thread lives as long as the worker, so children forked elsewhere are left
    # to the janitor.
    if not _state.forking_from_main:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != _state.forking_parent:  # the worker died before prctl took effect
        os._exit(1)


def kill_forks_with_parent() -> None:
    """From now on, children forked from the main thread get SIGKILL when this process dies (Linux)."""
    if _LINUX and not _state.fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _state.fork_hook = True


def start_janitor(pid: int, tree_id: str, grace_s: float = 2.0) -> subprocess.Popen[bytes] | None:
    """Start the janitor of worker ``pid`` (normally this process); None where it cannot run.

    The janitor has a session of its own (a signal to the worker's process group
    does not reach it), no stdin, stdout or stderr of the worker (a caller that
    reads the worker's output to its end does not wait for it), and neither
    the mark nor the report channel.
    """
    if not _LINUX or _state.janitor is not None:
        return _state.janitor
    env = {k: v for k, v in os.environ.items() if k not in (TREE_VARIABLE, "BUNSAN_REPORT_FD")}
    argv = [
        sys.executable,
        "-I",
        "-S",
        os.path.abspath(__file__),
        "--pid",
        str(pid),
        "--start",
        start_time(pid),
        "--tree",
        tree_id,
        "--grace",
        str(grace_s),
    ]
    try:
        _state.janitor = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    except OSError:
        return None
    return _state.janitor


def _wait_for_death(pid: int, start: str) -> dict[int, str]:
    """Wait until ``pid`` ends; meanwhile note its descendants. Returns what was noted."""
    seen: dict[int, str] = {}
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
    try:
        while is_alive(pid, start):
            seen.update(descendants(pid))
            seen.pop(os.getpid(), None)
            if pidfd is not None:
                select.select([pidfd], [], [], RECORD_S)  # readable once the process has ended
            else:
                time.sleep(min(RECORD_S, 0.2))
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return seen


def main(argv: list[str] | None = None) -> int:
    """The janitor: ``treewatch.py --pid PID --start TICKS --tree ID [--grace S]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="bunsan treewatch")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--start", default="")
    parser.add_argument("--tree", required=True)
    parser.add_argument("--grace", type=float, default=2.0)
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # outlive the job's teardown; we end by ourselves
    seen = _wait_for_death(args.pid, args.start)
    alive = {p: s for p, s in seen.items() if is_alive(p, s)}
    end_processes(_tree(args.pid, args.tree, alive.items(), living=False), max(0.0, min(args.grace, 3.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
