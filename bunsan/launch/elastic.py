"""``bunsan run -np N --min-np M``: an elastic job on this machine that goes on when a worker dies.

The launcher starts torchft's lighthouse (:mod:`bunsan.elastic.lighthouse`) as a process of the job, so the
rendezvous outlives every worker, rank 0 included; then the workers, each a quorum member of its own
(:mod:`bunsan.elastic`). When a worker ends with an error or a signal the others go on: the launcher says
which one and how, and while ``--max-restarts`` allows it, starts the slot again, and the new worker joins
at the next step with the state of a live peer. The job ends when every slot has ended: with 0 if every
worker still in it exited 0, else with the first failure's code. It stops early, with one sentence, when
fewer than ``M`` workers are left running (no step could commit). Everything the job started is ended on
the way out, as for any ``bunsan run`` job (:mod:`bunsan.launch.proctree`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from bunsan.launch import blame
from bunsan.launch.local import _Job, _start_worker, _stop_job
from bunsan.launch.output import OutputPump
from bunsan.launch.plan import JOB_ID_VARIABLE, JobOutcome, WorkerSpec, exit_code_of
from bunsan.launch.proctree import GRACE_S, POLL_S, Signals, die_with_launcher_hook, start_janitor, stop_janitor

__all__ = ["LIGHTHOUSE_START_S", "describe_exit", "elastic_environment", "replica_name", "run_elastic_job"]

LIGHTHOUSE_START_S = 60.0  # the lighthouse imports torch before it answers


def elastic_environment(
    spec: WorkerSpec, lighthouse: str, nproc: int, min_np: int, start: int, folder: str
) -> WorkerSpec:
    """``spec`` with what :mod:`bunsan.elastic` reads; ``start`` counts the slot's starts (a fresh name each)."""
    env = dict(spec.env)
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # no fixed group: the quorum's groups have their own stores
        env.pop(name, None)
    env.update(
        BUNSAN_ELASTIC_LIGHTHOUSE=lighthouse,
        BUNSAN_ELASTIC_NP=str(nproc),
        BUNSAN_ELASTIC_MIN_NP=str(min_np),
        BUNSAN_ELASTIC_REPLICA=replica_name(env.get(JOB_ID_VARIABLE, "job"), spec.rank, start),
        BUNSAN_RESTART=str(start),
        BUNSAN_ELASTIC_DIR=folder,
    )
    env.setdefault("RUST_LOG", "warn")  # torchft's quorum server logs every quorum at info
    return dataclasses.replace(spec, env=env)


def replica_name(job_id: str, rank: int, start: int) -> str:
    """The quorum name of slot ``rank``'s ``start``-th worker (0 for the first)."""
    return f"{job_id}-{rank}-{start}"


def describe_exit(rank: int, returncode: int) -> str:
    """``rank 2 was killed by SIGKILL (exit code 137)`` or ``rank 2 exited with code 1``."""
    return f"rank {rank} {blame.describe_exit(returncode)}"


def _start_lighthouse(min_np: int, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "bunsan.elastic.lighthouse", "--min-np", str(min_np), "--until-stdin-closes"],
        stdin=subprocess.PIPE,  # its end of the job: EOF when the launcher goes
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_launcher_hook(),
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], LIGHTHOUSE_START_S)
    line = process.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("http"):
        process.kill()
        raise RuntimeError(f"the lighthouse did not start (it said {line!r}); is torchft installed?")
    return process, line


class _Slots:
    """The workers by slot: the process running in each, how each slot ended, the restarts left."""

    def __init__(self, specs: Sequence[WorkerSpec], restarts: int, job_id: str, folder: str) -> None:
        self.specs, self.job_id, self.folder = list(specs), job_id, folder
        self.running: dict[int, subprocess.Popen[bytes]] = {}
        self.ended: dict[int, int] = {}  # slot -> returncode of its last worker
        self.starts = {spec.rank: 0 for spec in specs}
        self.restarts = restarts
        self.first_failure: tuple[int, int] | None = None
        self.late: set[int] = set()  # slots whose worker was stopped because the job ended before it joined

    def joined(self, rank: int) -> bool:
        """Whether slot ``rank``'s current worker has been in a quorum (:mod:`bunsan.elastic.member` marks it)."""
        name = replica_name(self.job_id, rank, self.starts[rank])
        return os.path.exists(os.path.join(self.folder, f"joined-{name}"))

    def reap(self) -> list[tuple[int, int]]:
        """The slots whose worker has just ended, with its returncode."""
        done = [(rank, p.returncode) for rank, p in self.running.items() if p.poll() is not None]
        for rank, code in done:
            del self.running[rank]
            self.ended[rank] = code
            if code != 0 and self.first_failure is None and rank not in self.late:
                self.first_failure = (rank, code)
        return done


def run_elastic_job(
    specs: Sequence[WorkerSpec],
    job_id: str,
    min_np: int,
    max_restarts: int,
    *,
    tag_output: bool = False,
    log: Callable[[str], None],
) -> JobOutcome:
    """Run the elastic job of ``specs`` on this machine (module docstring); how it ended."""
    pump = OutputPump(sys.stdout, sys.stderr)
    job = _Job(job_id, JOB_ID_VARIABLE)
    folder = tempfile.mkdtemp(prefix=f"bunsan-elastic-{job_id}-")
    slots = _Slots(specs, max_restarts, job_id, folder)
    with Signals() as signals:
        janitor = start_janitor(job_id, GRACE_S)
        lighthouse: subprocess.Popen[bytes] | None = None
        try:
            lighthouse, address = _start_lighthouse(min_np, {"RUST_LOG": "warn", **specs[0].env})
            job.processes.append(lighthouse)
            preexec = die_with_launcher_hook()

            def start(spec: WorkerSpec) -> None:
                spec = elastic_environment(spec, address, len(specs), min_np, slots.starts[spec.rank], folder)
                process = _start_worker(spec, tag_output, preexec, stdin_to_rank0=False)
                slots.running[spec.rank] = process
                job.processes.append(process)
                pump.add(spec.rank, process)

            for spec in specs:
                start(spec)
            return _watch(slots, start, min_np, pump, signals, job, log)
        finally:
            if job.alive():
                _stop_job(job, signal.SIGTERM, GRACE_S, pump, signals)
            pump.drain(1.0)
            stop_janitor(janitor)
            shutil.rmtree(folder, ignore_errors=True)


def _stop_late(slots: _Slots, log: Callable[[str], None]) -> None:
    """The job is ending (a worker finished): a worker that never joined a quorum has nothing left to do."""
    for rank, process in slots.running.items():
        if rank not in slots.late and not slots.joined(rank):
            slots.late.add(rank)
            log(f"rank {rank} had not joined when the job ended; stopping it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)


def _watch(
    slots: _Slots,
    start: Callable[[WorkerSpec], None],
    min_np: int,
    pump: OutputPump,
    signals: Signals,
    job: _Job,
    log: Callable[[str], None],
) -> JobOutcome:
    while True:
        if signals.received:
            sig = signals.received[0]
            log(f"got {signal.Signals(sig).name}; stopping the job")
            _stop_job(job, sig, GRACE_S, pump, signals)
            return JobOutcome(128 + sig, "signal", cause=f"stopped by {signal.Signals(sig).name}")
        finished = sum(code == 0 for code in slots.ended.values())
        for rank, code in slots.reap():
            if code == 0 or rank in slots.late:
                continue
            what = describe_exit(rank, code)
            if slots.restarts > 0 and not finished:
                slots.restarts -= 1
                slots.starts[rank] += 1
                log(
                    f"{what}; the others go on, and a new worker starts in its place ({slots.restarts} restart(s) left)"
                )
                start(slots.specs[rank])
                slots.ended.pop(rank, None)
            elif slots.running:
                log(f"{what}; the other {len(slots.running)} go on (--min-np {min_np})")
        finished = sum(code == 0 for code in slots.ended.values())
        if finished:
            _stop_late(slots, log)
        if not slots.running:
            if finished >= min_np or (finished and slots.first_failure is None):
                return JobOutcome(0, "ok")
            rank, code = slots.first_failure or (0, 1)
            return JobOutcome(exit_code_of(code), "failed", rank, describe_exit(rank, code))
        if not finished and len(slots.running) < min_np:
            rank, code = slots.first_failure or (0, 1)
            cause = f"{describe_exit(rank, code)}, and {len(slots.running)} worker(s) are left, fewer than --min-np {min_np}"
            log(f"{cause}; stopping the job")
            _stop_job(job, signal.SIGTERM, GRACE_S, pump, signals)
            return JobOutcome(exit_code_of(code), "failed", rank, cause)
        pump.pump(POLL_S)
