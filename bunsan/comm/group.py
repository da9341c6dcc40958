"""The process group, its rendezvous store and the job-wide failure watch.

This module creates the torch.distributed world for :func:`bunsan.init` and keeps
one promise of bunsan's: a rank that fails ends the whole job within seconds,
whatever started it (``bunsan run``, torchrun, mpirun, srun). Launchers other than
``bunsan run`` do not always kill the survivors, and a survivor blocked in a
collective would otherwise sit until the collective timeout (minutes). So:

1. A failing rank prints its traceback and sets an abort key in the rendezvous
   store before it exits (:func:`signal_abort`).
2. Every rank runs a daemon thread (:class:`Watchdog`) with its own store
   connection. It polls the abort key every ``poll_s`` and ends its process when
   the key appears or when the store itself is gone (rank 0, which hosts it,
   died without a word, e.g. by SIGKILL). It also publishes how many collectives
   this rank has started, so that a timed-out collective can name the ranks that
   never reached it (:func:`lagging_ranks`).

A failure of a non-zero rank that dies silently (SIGKILL) is seen by its peers as
a closed gloo/NCCL connection, which raises in the collective and so takes path 1.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bunsan.comm import inspector as _inspector

__all__ = [
    "Watchdog",
    "abort_reason",
    "collectives_started",
    "create_world",
    "destroy_world",
    "lagging_ranks",
    "note_collective",
    "signal_abort",
]

_ABORT_KEY = "abort"
_PROGRESS_KEY = "progress/{rank}"


class _World:
    """What this process knows about its world beyond torch.distributed itself."""

    store: dist.Store | None = None  # the rendezvous store (prefixed for this job)
    watch_store: dist.Store | None = None
    watchdog: Watchdog | None = None
    rank = 0
    world_size = 1
    collectives = 0  # collectives this rank has started (same sequence on every rank)


_world = _World()


def note_collective() -> int:
    """Count one collective started by this rank; returns its 1-based sequence number."""
    _world.collectives += 1
    return _world.collectives


def collectives_started() -> int:
    return _world.collectives


def _tcp_store(addr: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.Store:
    return dist.TCPStore(
        addr,
        port,
        world_size if is_master else None,
        is_master,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def create_world(
    *,
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    job_id: str,
    agent_store: bool = False,
    watch_poll_s: float = 0.5,
) -> None:
    """Create the default process group and start the failure watch. Collective.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        rank, world_size: this process's place in the job.
        master_addr, master_port: where rank 0 hosts the rendezvous store (or where
            torchrun's agent already hosts it, when ``agent_store`` is true).
        timeout_s: collective and rendezvous timeout.
        job_id: namespace for bunsan's keys in the store, so a restarted job does
            not see the abort key of its previous attempt.
    """
    _world.rank, _world.world_size = rank, world_size
    _world.collectives = 0
    if world_size == 1:
        store: dist.Store = dist.HashStore()
    else:
        store = _tcp_store(master_addr, master_port, world_size, rank == 0 and not agent_store, timeout_s)
    _world.store = dist.PrefixStore(f"bunsan/{job_id}/", store)
    _bind_torch_defaults_before_the_group_exists()
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", _world.store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if world_size > 1:
        # A second connection for the watch thread: store calls from two threads
        # on one client would interleave on the socket.
        client = _tcp_store(master_addr, master_port, world_size, False, min(timeout_s, 30.0))
        _world.watch_store = dist.PrefixStore(f"bunsan/{job_id}/", client)
        _world.watchdog = Watchdog(_world.watch_store, rank, poll_s=watch_poll_s)
        _world.watchdog.start()


def _bind_torch_defaults_before_the_group_exists() -> None:
    """Import ``torch.distributed.nn`` now, while there is no default process group.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated once at
    import. Imported after ``init_process_group`` (building any torch optimizer imports
    it, through ``torch._dynamo``), that default holds the live group for the rest of the
    process, so ``destroy_process_group()`` cannot free it: Gloo's threads outlive the
    job and, when one of them releases a finished collective while the interpreter is
    shutting down, it needs the GIL, is ended by Python, and the process dies in
    ``std::terminate`` (SIGABRT, exit 134) after its work is done. Measured with
    torch 2.13: 2 of 12 30-epoch benchmark jobs under load (core file: a ``pt_gloo_runloop`` thread in
    ``~AsyncAllgatherWork`` -> ``gil_scoped_acquire`` -> ``pthread_exit``). Imported
    first, the default is None and the group dies with ``destroy_process_group()``.
    """
    with contextlib.suppress(ImportError):
        import torch.distributed.nn  # noqa: F401


def destroy_world(*, barrier: bool) -> None:
    """Stop the watch and destroy the process group.

    With ``barrier`` (a normal end; collective) every rank stops its watch before
    rank 0, which hosts the store, may leave: otherwise a slower rank would take
    rank 0's exit for a crash.
    """
    if _world.watchdog is not None:
        _world.watchdog.stop()
        _world.watchdog = None
    if dist.is_initialized():
        if barrier and _world.world_size > 1:
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer already gone; nothing left to protect
                pass
        dist.destroy_process_group()
    _world.store = _world.watch_store = None
    _world.world_size, _world.rank = 1, 0


def signal_abort(reason: str) -> None:
    """Tell every other rank that this one failed (best effort, never raises)."""
    if _world.store is None or _world.world_size == 1:
        return
    try:
        _world.store.set(_ABORT_KEY, f"{_world.rank}:{reason}")
    except Exception:  # noqa: BLE001 - the store may be gone already; the peers then see that
        pass


def abort_reason() -> tuple[int, str] | None:
    """``(rank, reason)`` when some rank has already signalled a failure, else None."""
    if _world.watch_store is None:
        return None
    try:
        if not _world.watch_store.check([_ABORT_KEY]):
            return None
        failed, _, reason = _world.watch_store.get(_ABORT_KEY).decode(errors="replace").partition(":")
        return int(failed), reason
    except Exception:  # noqa: BLE001
        return None


def lagging_ranks() -> list[int] | None:
    """Ranks that have started fewer collectives than this one, or None if unknown.

    Read from the counters the watch threads publish; used to name the missing
    ranks when a collective times out.
    """
    watchdog = _world.watchdog
    if watchdog is None:
        return None
    watchdog.publish()
    time.sleep(2 * watchdog.poll_s)  # let the peers publish their latest counts
    try:
        counts = {
            r: int(watchdog.store.get(_PROGRESS_KEY.format(rank=r)))
            for r in range(_world.world_size)
            if watchdog.store.check([_PROGRESS_KEY.format(rank=r)])
        }
    except Exception:  # noqa: BLE001
        return None
    mine = _world.collectives
    return [r for r in range(_world.world_size) if counts.get(r, 0) < mine]


class Watchdog(threading.Thread):
    """Ends this process when another rank has failed (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, poll_s: float = 0.5) -> None:
        super().__init__(name="bunsan-watchdog", daemon=True)
        self.store, self.rank, self.poll_s = store, rank, poll_s
        self._stop_event = threading.Event()
        self._published = -1

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5 * self.poll_s + 1)

    def publish(self) -> None:
        count = _world.collectives
        if count != self._published:
            self.store.set(_PROGRESS_KEY.format(rank=self.rank), str(count))
            self._published = count

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            try:
                self.publish()
                _inspector.poll(self.store)  # out-of-step collectives and stall reports
                if self.store.check([_ABORT_KEY]):
                    value = self.store.get(_ABORT_KEY).decode(errors="replace")
                    failed, _, reason = value.partition(":")
                    if int(failed) != self.rank:
                        self._end(f"rank {failed} failed ({reason}); see its traceback above")
            except Exception as e:  # noqa: BLE001 - any store failure means the job is broken
                if not self._stop_event.is_set():
                    self._end(f"lost the rendezvous store (rank 0 or the launcher is gone: {type(e).__name__})")

    def _end(self, why: str) -> None:
        if self._stop_event.is_set():
            return
        print(f"[bunsan] rank {self.rank}: stopping because {why}", file=sys.stderr, flush=True)
        # Give the failed rank's own exit a head start, so a launcher that reports
        # the first failure reports the real one.
        time.sleep(0.5)
        sys.stdout.flush()
        os._exit(1)


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0
