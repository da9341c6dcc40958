"""``bunsan run -np N --min-np M [--max-np X]``: an elastic job that goes on when a worker dies, and grows.

The launcher starts torchft's lighthouse (:mod:`bunsan.elastic.lighthouse`) as a process of the job, so the
rendezvous outlives every worker, rank 0 included; then the workers, each a quorum member of its own
(:mod:`bunsan.elastic`), on the slots of the job's pool (this machine, ``-H``/``--hostfile`` or a discovery
script: :mod:`bunsan.launch.discovery`; other hosts' workers start through :mod:`bunsan.launch.elastic_hosts`).
When a worker ends with an error or a signal the others go on: the launcher says which one and how, and
while ``--max-restarts`` allows it, starts the slot again on a free slot of the pool, and the new worker
joins at the next step with the state of a live peer. While fewer than ``--max-np`` workers run, free slots
of the pool get new workers, which join the same way (docs/how-to/elastic.md, "Growing the group"). The job
ends when every slot has ended: with 0 if every worker still in it exited 0, else with the first failure's
code. It stops early, with one sentence, when fewer than ``M`` workers are left running (no step could
commit). Everything the job started, grown workers included, is ended on the way out, as for any
``bunsan run`` job (:mod:`bunsan.launch.proctree`).
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
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from bunsan.launch import blame
from bunsan.launch.discovery import DISCOVERY_INTERVAL_S, DiscoveryError, count_by_host, grow_count, place
from bunsan.launch.hosts import Host
from bunsan.launch.local import _Job, _start_worker, _stop_job
from bunsan.launch.output import OutputPump
from bunsan.launch.plan import JOB_ID_VARIABLE, JobOutcome, WorkerSpec, exit_code_of
from bunsan.launch.proctree import GRACE_S, POLL_S, Signals, die_with_launcher_hook, start_janitor, stop_janitor

__all__ = [
    "LIGHTHOUSE_START_S",
    "Growth",
    "RemoteStarter",
    "describe_exit",
    "elastic_environment",
    "replica_name",
    "run_elastic_job",
]

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


def _start_lighthouse(min_np: int, env: dict[str, str], bind: str) -> tuple[subprocess.Popen[bytes], str]:
    # run as a file, not ``-m``: importing the bunsan package would import torch first (lighthouse._server_class)
    script = str(Path(__file__).resolve().parents[1] / "elastic" / "lighthouse.py")
    argv = [sys.executable, script, "--min-np", str(min_np), "--bind", bind]
    process = subprocess.Popen(
        [*argv, "--until-stdin-closes"],
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


@dataclasses.dataclass
class Growth:
    """Where the job's workers may run (:mod:`bunsan.launch.discovery`) and how it grows.

    Attributes:
        pool: the hosts and their slots now.
        max_np: the most workers the job runs at once (``--max-np``).
        discover: the discovery script's next answer (raises ``DiscoveryError``), or ``None``: a fixed pool.
        interval_s: seconds between two calls of ``discover``.
    """

    pool: list[Host]
    max_np: int
    discover: Callable[[], list[Host]] | None = None
    interval_s: float = DISCOVERY_INTERVAL_S
    next_at: float = 0.0
    said: str | None = None  # the last failure said, so that a failing script is named once, not every call
    _answer: list[list[Host] | DiscoveryError] = dataclasses.field(default_factory=list)
    _asking: threading.Thread | None = None

    def refresh(self, log: Callable[[str], None]) -> None:
        """Take the discovery script's last answer, and ask again when it is time (in a thread: a slow script
        must not hold up the watch). A failure keeps the last pool and is said once."""
        if self.discover is None:
            return
        if self._answer:
            self._take(self._answer.pop(), log)
        if (self._asking is None or not self._asking.is_alive()) and time.monotonic() >= self.next_at:
            self.next_at = time.monotonic() + self.interval_s
            self._asking = threading.Thread(target=self._ask, daemon=True)
            self._asking.start()

    def _ask(self) -> None:
        assert self.discover is not None
        try:
            self._answer.append(self.discover())
        except DiscoveryError as err:
            self._answer.append(err)

    def _take(self, answer: list[Host] | DiscoveryError, log: Callable[[str], None]) -> None:
        if isinstance(answer, DiscoveryError):
            if str(answer) != self.said:
                log(f"{answer}; the job goes on with the hosts it has")
            self.said = str(answer)
            return
        self.said = None
        gone = sorted({h.name for h in self.pool} - {h.name for h in answer})
        if gone:
            log(f"host(s) {', '.join(gone)} left the discovery script's list; their workers run on until they end")
        self.pool = answer


class _Slots:
    """The workers by slot: the process running in each, its host, how each slot ended, the restarts left.

    Slots ``0..-np-1`` are the starting workers; a worker that grows the group gets the next number."""

    def __init__(self, specs: Sequence[WorkerSpec], restarts: int, job_id: str, folder: str) -> None:
        self.job_id, self.folder = job_id, folder
        self.running: dict[int, subprocess.Popen[bytes]] = {}
        self.hosts = {spec.rank: spec.host for spec in specs}
        self.local = {spec.rank: spec.local_rank for spec in specs}
        self.ended: dict[int, int] = {}  # slot -> returncode of its last worker
        self.starts = {spec.rank: 0 for spec in specs}
        self.restarts = restarts
        self.first_failure: tuple[int, int] | None = None
        self.late: set[int] = set()  # slots whose worker was stopped because the job ended before it joined
        self.waiting: list[int] = []  # lost slots to start again as soon as a slot of the pool is free
        self.lost = 0  # workers lost for good: they keep their place under --max-np
        self.reported: set[str] = set()  # replicas whose remote agent said that they joined

    def joined(self, rank: int) -> bool:
        """Whether slot ``rank``'s current worker has been in a quorum (:mod:`bunsan.elastic.member` marks it)."""
        name = replica_name(self.job_id, rank, self.starts[rank])
        return name in self.reported or os.path.exists(os.path.join(self.folder, f"joined-{name}"))

    def by_host(self) -> dict[str, int]:
        """Running workers per host."""
        return count_by_host([self.hosts[rank] for rank in self.running])

    def local_rank(self, host: str) -> int:
        """The lowest local rank that no running worker on ``host`` has (``LOCAL_RANK`` of the next one there)."""
        taken = {self.local[rank] for rank in self.running if self.hosts[rank] == host}
        return min(set(range(len(taken) + 1)) - taken)

    def reap(self) -> list[tuple[int, int]]:
        """The slots whose worker has just ended, with its returncode."""
        done = [(rank, p.returncode) for rank, p in self.running.items() if p.poll() is not None]
        for rank, code in done:
            del self.running[rank]
            self.ended[rank] = code
            if code != 0 and self.first_failure is None and rank not in self.late:
                self.first_failure = (rank, code)
        return done


class RemoteStarter(Protocol):
    """Starts one worker on a host other than this one (:class:`bunsan.launch.elastic_ssh.SshStarter`)."""

    def start(self, spec: WorkerSpec, on_joined: Callable[[str], None]) -> subprocess.Popen[bytes]: ...

    def ping(self) -> None: ...

    def stop(self, grace_s: float) -> None: ...


def _spec_like(template: WorkerSpec, rank: int, host: str, local_rank: int) -> WorkerSpec:
    """A worker of slot ``rank`` on ``host``, otherwise as ``template`` (a starting worker of this machine)."""
    env = {**template.env, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    return dataclasses.replace(template, rank=rank, host=host, local_rank=local_rank, env=env)


def run_elastic_job(
    specs: Sequence[WorkerSpec],
    job_id: str,
    min_np: int,
    max_restarts: int,
    *,
    tag_output: bool = False,
    log: Callable[[str], None],
    growth: Growth | None = None,
    is_local: Callable[[str], bool] = lambda host: True,
    remote: RemoteStarter | None = None,
    bind: str = "127.0.0.1:0",
    on_address: Callable[[str], None] = lambda address: None,
) -> JobOutcome:
    """Run the elastic job of ``specs`` (module docstring); how it ended.

    ``growth``: the pool it grows onto, up to its ``max_np`` (none: it never grows). ``remote`` starts the
    workers of hosts that ``is_local`` says are not this one; ``bind``: the lighthouse's address
    (``0.0.0.0:0`` when remote workers must reach it), which ``on_address`` is told once it serves."""
    pump = OutputPump(sys.stdout, sys.stderr)
    job = _Job(job_id, JOB_ID_VARIABLE)
    folder = tempfile.mkdtemp(prefix=f"bunsan-elastic-{job_id}-")
    slots = _Slots(specs, max_restarts, job_id, folder)
    with Signals() as signals:
        janitor = start_janitor(job_id, GRACE_S)
        try:
            lighthouse, address = _start_lighthouse(min_np, {"RUST_LOG": "warn", **specs[0].env}, bind)
            job.processes.append(lighthouse)
            on_address(address)
            address = address.replace("//0.0.0.0:", "//127.0.0.1:")  # this machine's workers
            preexec = die_with_launcher_hook()

            def start(rank: int, host: str) -> None:
                slots.hosts[rank], slots.local[rank] = host, slots.local_rank(host)
                spec = _spec_like(specs[0], rank, host, slots.local[rank])
                spec = elastic_environment(spec, address, len(specs), min_np, slots.starts[rank], folder)
                if is_local(host):
                    process = _start_worker(spec, tag_output, preexec, stdin_to_rank0=False)
                    pump.add(spec.rank, process)
                else:
                    assert remote is not None, f"no way to start a worker on {host}"
                    process = remote.start(spec, slots.reported.add)
                slots.running[spec.rank] = process
                job.processes.append(process)

            for spec in specs:
                start(spec.rank, spec.host)
            if growth is None:  # the starting workers' slots, none to grow onto
                growth = Growth([Host(h, n) for h, n in count_by_host([s.host for s in specs]).items()], len(specs))
            return _watch(slots, start, min_np, pump, signals, job, log, growth, remote, lighthouse)
        finally:
            if remote is not None:
                remote.stop(GRACE_S)
            if job.alive():
                _stop_job(job, signal.SIGTERM, GRACE_S, pump, signals)
            pump.drain(1.0)
            stop_janitor(janitor)
            shutil.rmtree(folder, ignore_errors=True)


def _stop_late(slots: _Slots, log: Callable[[str], None]) -> None:
    """The job is ending (a worker finished): a worker that never joined a quorum has nothing left to do."""
    slots.waiting.clear()
    for rank, process in slots.running.items():
        if rank not in slots.late and not slots.joined(rank):
            slots.late.add(rank)
            log(f"rank {rank} had not joined when the job ended; stopping it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)


def _on_lost(slots: _Slots, rank: int, code: int, finished: int, min_np: int, log: Callable[[str], None]) -> None:
    """Slot ``rank``'s worker failed: start it again while --max-restarts allows (when a slot is free)."""
    what = describe_exit(rank, code)
    if slots.restarts > 0 and not finished:
        slots.restarts -= 1
        slots.starts[rank] += 1
        slots.waiting.append(rank)
        slots.ended.pop(rank, None)
        log(f"{what}; the others go on, and a new worker starts in its place ({slots.restarts} restart(s) left)")
        return
    slots.lost += 1
    if slots.running:
        log(f"{what}; the other {len(slots.running)} go on (--min-np {min_np})")


def _fill(slots: _Slots, start: Callable[[int, str], None], growth: Growth, log: Callable[[str], None]) -> None:
    """Start the lost slots that wait for a free slot, then grow the group onto free slots up to --max-np."""
    for rank in list(slots.waiting):
        host = place(growth.pool, slots.by_host(), prefer=slots.hosts[rank])
        if host is None:
            break
        slots.waiting.remove(rank)
        start(rank, host)
    if slots.waiting:
        return
    for _ in range(grow_count(growth.max_np, len(slots.running), slots.lost, growth.pool, slots.by_host())):
        host = place(growth.pool, slots.by_host())
        assert host is not None  # grow_count counts free slots only
        rank = max(slots.starts) + 1
        slots.starts[rank] = 0
        start(rank, host)
        log(f"the group grows: rank {rank} starts on {host} ({len(slots.running)} running, --max-np {growth.max_np})")


def _watch(
    slots: _Slots,
    start: Callable[[int, str], None],
    min_np: int,
    pump: OutputPump,
    signals: Signals,
    job: _Job,
    log: Callable[[str], None],
    growth: Growth,
    remote: RemoteStarter | None,
    lighthouse: subprocess.Popen[bytes],
) -> JobOutcome:
    while True:
        if signals.received:
            sig = signals.received[0]
            log(f"got {signal.Signals(sig).name}; stopping the job")
            _stop_job(job, sig, GRACE_S, pump, signals)
            return JobOutcome(128 + sig, "signal", cause=f"stopped by {signal.Signals(sig).name}")
        if lighthouse.poll() is not None and slots.running:  # it ends only with the launcher otherwise
            cause = f"the lighthouse (the job's rendezvous) {blame.describe_exit(lighthouse.returncode)}"
            log(f"{cause}; no step can commit without it: stopping the job")
            _stop_job(job, signal.SIGTERM, GRACE_S, pump, signals)
            return JobOutcome(exit_code_of(lighthouse.returncode) or 1, "failed", cause=cause)
        finished = sum(code == 0 for code in slots.ended.values())
        for rank, code in slots.reap():
            if code != 0 and rank not in slots.late:
                _on_lost(slots, rank, code, finished, min_np, log)
        finished = sum(code == 0 for code in slots.ended.values())
        if finished:
            _stop_late(slots, log)
        else:
            growth.refresh(log)
            _fill(slots, start, growth, log)
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
        if remote is not None:
            remote.ping()
        pump.pump(POLL_S)
