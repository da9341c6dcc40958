"""Plan a job: the workers' command lines, environments and ranks, and how exit codes are reported. Pure.

Every process of a job carries ``BUNSAN_JOB_ID=<id>`` (see :mod:`bunsan.launch.proctree`);
the variables follow torchrun's convention so that the same script runs under either.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bunsan._table import format_table
from bunsan.launch.hosts import Slot
from bunsan.launch.quoting import MAX_QUOTED_PATH, quoted

__all__ = [
    "HOST_JOB_VARIABLE",
    "JOB_ID_VARIABLE",
    "REPORT_FD_VARIABLE",
    "JobOutcome",
    "WorkerSpec",
    "exit_code_of",
    "find_free_port",
    "first_failure",
    "format_plan",
    "new_job_id",
    "plan_workers",
    "worker_command",
    "worker_environment",
]

JOB_ID_VARIABLE = "BUNSAN_JOB_ID"  # every process of a job carries it
REPORT_FD_VARIABLE = "BUNSAN_REPORT_FD"  # the workers' end of the launcher's report pipe
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
        code: The exit status to report (see :func:`bunsan.launch.local.run_job`).
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
            raise ValueError(
                f"script {quoted(first, MAX_QUOTED_PATH)} does not exist (looked in {os.getcwd()}); check the path"
            )
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
    workers that each use every core slow each other down (docs/experiments/design-notes.md,
    "Launcher, runtime and CLI").
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
    rows = [(str(s.rank), str(s.local_rank), s.host, shlex.join(s.argv)) for s in specs]
    return format_table(("rank", "local_rank", "host", "command"), rows, rule=False)


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


def find_free_port(host: str = "") -> int:
    """Return a TCP port that was free a moment ago (the OS picks it when binding port 0).

    Another process may take it before rank 0 binds it; the window is short
    and ``--master-port`` is the way out if it ever matters.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
