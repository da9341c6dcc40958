"""The process group, its rendezvous store and the job-wide failure watch.

This module creates the torch.distributed world for :func:`bunsan.init` and keeps one promise of bunsan's: a rank that
fails ends the whole job within seconds, whatever started it (``bunsan run``, torchrun, mpirun, srun). Launchers other
than ``bunsan run`` do not always kill the survivors, and a survivor blocked in a collective would otherwise sit until
the collective timeout (minutes). So:

1. A failing rank prints its traceback and sets an abort key in the rendezvous store before it exits
   (:func:`signal_abort`).
2. Every rank runs a daemon thread (:class:`Watchdog`) with its own store connection. It polls the abort key every
   ``poll_s`` and ends its process when the key appears or when the store itself is gone (rank 0, which hosts it,
   died without a word, e.g. by SIGKILL). It also publishes how many collectives this rank has started, so that a
   timed-out collective can name the ranks that never reached it (:func:`lagging_ranks`).

A failure of a non-zero rank that dies silently (SIGKILL) is seen by its peers as a closed gloo/NCCL connection, which
raises in the collective and so takes path 1; the watch also checks, every ``poll_s``, that the ranks on its own host
are alive, and :func:`dead_ranks` tells which rank vanished, so the survivors name it.

What listens on the network, and who may talk to it: :mod:`bunsan.comm.rendezvous`.

A rank that ends the job on its own (a failed peer, a lost store) first ends its own child processes
(:mod:`bunsan.launch.treewatch`), and tells ``bunsan run`` why in one line on ``BUNSAN_REPORT_FD`` (:func:`report`),
so that the launcher names the rank that failed first, not the first process to exit.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bunsan.comm import inspector as _inspector
from bunsan.comm.rendezvous import bind_address, keep_gloo_on_loopback, share_secret, tcp_store
from bunsan.errors import ConfigurationError
from bunsan.launch import treewatch
from bunsan.launch.blame import FailureReport
from bunsan.launch.plan import REPORT_FD_VARIABLE  # set by `bunsan run`: a pipe to the launcher

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "REPORT_FD_VARIABLE",
    "TREE_VARIABLE",
    "Watchdog",
    "abort_reason",
    "bind_address",
    "collectives_started",
    "create_world",
    "dead_ranks",
    "destroy_world",
    "end_children",
    "end_process",
    "is_backend_error",
    "lagging_ranks",
    "mark_finished",
    "note_collective",
    "report",
    "signal_abort",
    "world_settings",
]

_ABORT_KEY = _inspector.ABORT_KEY  # defined there: the inspector ends the job by it too
_PROGRESS_KEY = "progress/{rank}"
_PEER_KEY = "peer/{rank}"  # "host pid start-time" of each rank
_BEAT_KEY = "beat/{rank}"  # a counter the watch advances every poll; "done" once it stopped
_FAILED_KEY = "failed/{rank}"  # the reason each rank that failed gave, or a peer found for it
TREE_VARIABLE = treewatch.TREE_VARIABLE  # marks every process this rank starts
DEFAULT_TIMEOUT_S = 300.0  # bunsan.init()'s collective timeout without BUNSAN_TIMEOUT
TREE_GRACE_S = 1.0  # SIGTERM to this rank's children, then SIGKILL


class _World:
    """What this process knows about its world beyond torch.distributed itself."""

    store: dist.Store | None = None  # the rendezvous store (prefixed for this job)
    watch_store: dist.Store | None = None
    watchdog: Watchdog | None = None
    rank = 0
    world_size = 1
    collectives = 0  # collectives this rank has started (same sequence on every rank)
    store_on_rank0 = True  # False under torchrun's agent store: rank 0's death leaves the store up
    report_fd: int | None = None
    tree_id: str | None = None


_world = _World()


def note_collective() -> int:
    """Count one collective started by this rank; returns its 1-based sequence number."""
    _world.collectives += 1
    return _world.collectives


def collectives_started() -> int:
    return _world.collectives


def world_settings(
    backend: str | None, timeout_s: float | None, stall_s: float | None
) -> tuple[str, float, float | None]:
    """:func:`bunsan.init`'s arguments, else ``BUNSAN_BACKEND``/``BUNSAN_TIMEOUT``/``BUNSAN_STALL_S``, else defaults.

    The defaults: nccl when a CUDA device is visible, else gloo; :data:`DEFAULT_TIMEOUT_S`; ``None`` for the
    inspector's own. Unchecked, but a variable that is not a number of seconds raises
    :class:`~bunsan.errors.ConfigurationError`.
    """

    def seconds(name: str, raw: str) -> float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigurationError(f"{name}={raw!r} is not a number of seconds") from None

    backend = backend or os.environ.get("BUNSAN_BACKEND") or ("nccl" if cuda_available() else "gloo")
    if timeout_s is None:
        timeout_s = seconds("BUNSAN_TIMEOUT", os.environ.get("BUNSAN_TIMEOUT", str(DEFAULT_TIMEOUT_S)))
    if stall_s is None and os.environ.get("BUNSAN_STALL_S"):
        stall_s = seconds("BUNSAN_STALL_S", os.environ["BUNSAN_STALL_S"])
    return backend, timeout_s, stall_s


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
    guard_tree: bool = False,
    all_local: bool = True,
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
        agent_store: the store is torchrun's agent's, not rank 0's.
        watch_poll_s: how often the watch thread looks at the store.
        guard_tree: start a janitor process that ends this rank's child
            processes when it dies, however it dies (for launchers other than
            ``bunsan run``, which does that itself; :mod:`bunsan.launch.treewatch`).
        all_local: every rank runs on this host (``LOCAL_WORLD_SIZE == WORLD_SIZE``).
    """
    _world.rank, _world.world_size = rank, world_size
    _world.collectives = 0
    _world.store_on_rank0 = not agent_store
    if world_size == 1:
        store: dist.Store = dist.HashStore()
    else:
        _open_report_channel()
        _guard_process_tree(rank, janitor=guard_tree)
        if backend == "gloo" and all_local:
            keep_gloo_on_loopback(master_addr)
        store = tcp_store(master_addr, master_port, world_size, rank == 0 and not agent_store, timeout_s, all_local)
    _bind_torch_defaults_before_the_group_exists()
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"bunsan/{job_id}/pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    # bunsan's own keys: under a prefix that only the ranks know (see the module docstring).
    prefix = f"bunsan/{job_id}/" if world_size == 1 else f"bunsan/{job_id}/{share_secret()}/"
    _world.store = dist.PrefixStore(prefix, store)
    _inspector.use_store(_world.store)
    if world_size > 1:
        host = socket.gethostname()
        _world.store.set(_PEER_KEY.format(rank=rank), f"{host} {os.getpid()} {treewatch.start_time(os.getpid())}")
        # A second connection for the watch thread: store calls from two threads
        # on one client would interleave on the socket.
        client = tcp_store(master_addr, master_port, world_size, False, min(timeout_s, 30.0))
        _world.watch_store = dist.PrefixStore(prefix, client)
        _world.watchdog = Watchdog(_world.watch_store, rank, poll_s=watch_poll_s, world_size=world_size, host=host)
        _world.watchdog.start()


def _bind_torch_defaults_before_the_group_exists() -> None:
    """Import ``torch.distributed.nn`` now, while there is no default process group.

    Its functions bind ``group=group.WORLD`` as a default argument at import. Imported after ``init_process_group``
    (any torch optimizer imports it, through ``torch._dynamo``), that default keeps the group alive past
    ``destroy_process_group()``, and a Gloo thread can end the finished process in ``std::terminate`` at shutdown
    (docs/experiments/design-notes.md, "Launcher, runtime and CLI").
    """
    with contextlib.suppress(ImportError):
        import torch.distributed.nn  # noqa: F401 - imported for its side effect, see the docstring


def destroy_world(*, barrier: bool) -> None:
    """Stop the watch and destroy the process group.

    With ``barrier`` (a normal end; collective) every rank stops its watch before rank 0, which hosts the store, may
    leave: otherwise a slower rank would take rank 0's exit for a crash.
    """
    if _world.watchdog is not None:
        _world.watchdog.stop()
        with contextlib.suppress(Exception):  # a finished rank is not a dead one (see dead_ranks)
            _world.watchdog.store.set(_BEAT_KEY.format(rank=_world.rank), "done")
        _world.watchdog = None
    if dist.is_initialized():
        if barrier and _world.world_size > 1:
            try:
                dist.barrier()
            except Exception:
                pass
        dist.destroy_process_group()
    _world.store = _world.watch_store = None
    _inspector.use_store(None)
    _world.world_size, _world.rank = 1, 0


# how a note names a rank whose process vanished (written by a peer's watch or excepthook, not by the rank)
SILENT_DEATH = "died without a word"


def peer_failure(reason: str, traceback: bool = True) -> str:
    """What a line says of a rank after its name, from the reason in its failure note: a silent death as such
    (the note was written by a peer that found its process gone), else that it failed, and where to look."""
    if reason.startswith(SILENT_DEATH):
        return reason
    return f"failed ({reason})" + ("; see its traceback above" if traceback else "")


def signal_abort(reason: str, failed: int | None = None) -> None:
    """Tell every other rank that rank ``failed`` (default: this one) failed. Best effort, never raises."""
    if _world.store is None or _world.world_size == 1:
        return
    rank = _world.rank if failed is None else failed
    try:  # each rank's own note first: the abort key holds only the latest, and ranks may fail together
        _world.store.set(_FAILED_KEY.format(rank=rank), reason)
        _world.store.set(_ABORT_KEY, f"{rank}:{reason}")
    except Exception:
        pass


def silence_watch() -> None:
    """This rank is failing on its own: its watch stops, so that it never speaks of a peer's exit as the cause."""
    if _world.watchdog is not None:
        _world.watchdog.silence()


# ---------------------------------------------------------------------------
# Telling the launcher, ending this rank's processes.


def _open_report_channel() -> None:
    raw = os.environ.get(REPORT_FD_VARIABLE)
    _world.report_fd = None
    if not raw:
        return
    try:
        fd = int(raw)
        os.set_inheritable(fd, False)  # the user's subprocesses do not get it
        os.set_blocking(fd, False)  # a launcher that stopped reading must not block a failing rank
    except (ValueError, OSError):
        return
    _world.report_fd = fd


def report(event: str, *, peer: int | None = None, code: int = 1, what: str = "") -> None:
    """Tell ``bunsan run`` why this rank is about to exit, in one line. Best effort, never raises.

    ``event`` is ``"raised"`` (this rank failed on its own: the launcher names it as the cause) or ``"stopped"`` (it
    ends because rank ``peer`` failed or died). Written before the abort key is set, so the launcher has the cause
    before any consequence exits.
    """
    if _world.report_fd is None:
        return
    line = FailureReport(_world.rank, event, peer, code, what[:300], time.time()).to_line()
    with contextlib.suppress(OSError):
        os.write(_world.report_fd, line)  # one write below PIPE_BUF: never mixed with another rank's


def _guard_process_tree(rank: int, janitor: bool) -> None:
    """Mark every process this rank starts from now on; make forked children die with it; start the janitor."""
    _world.tree_id = f"{secrets.token_hex(8)}.r{rank}"
    os.environ[TREE_VARIABLE] = _world.tree_id
    treewatch.kill_forks_with_parent()
    if janitor:
        treewatch.start_janitor(os.getpid(), _world.tree_id)


def end_children() -> None:
    """End this rank's child processes: SIGTERM, then SIGKILL after a second. Never raises."""
    with contextlib.suppress(Exception):
        treewatch.end_tree(os.getpid(), _world.tree_id, TREE_GRACE_S)


def end_process(code: int = 1) -> None:
    """End this rank's child processes (SIGTERM, then SIGKILL), flush, and exit with ``code`` at once.

    A normal interpreter shutdown could block in the process group's teardown while the other ranks sit in a
    collective, so this never returns.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    end_children()
    os._exit(code)


# ---------------------------------------------------------------------------
# Which rank vanished.


def _peers(store: dist.Store, world_size: int) -> dict[int, tuple[str, int, str]]:
    peers = {}
    for r in range(world_size):
        key = _PEER_KEY.format(rank=r)
        if store.check([key]):
            host, pid, start = store.get(key).decode().split(" ", 2)
            peers[r] = (host, int(pid), start)
    return peers


def is_backend_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.distributed's own error (a collective that broke), as opposed to the user's."""
    return isinstance(exc, getattr(dist, "DistError", ()))


def mark_finished() -> None:
    """Say in the store that this rank ends on purpose, so that no peer takes it for a silent death."""
    with contextlib.suppress(Exception):
        if _world.store is not None and _world.world_size > 1:
            _world.store.set(_BEAT_KEY.format(rank=_world.rank), "done")


def dead_ranks(wait_s: float | None = None, local_wait_s: float = 1.0) -> list[int] | None:
    """The ranks whose process is gone, or None when that cannot be told (no store). Not collective.

    A rank on this host is dead when its process no longer exists (or is a zombie, or its pid was reused); a process
    killed a moment ago may take a little to vanish, so this waits up to ``local_wait_s`` for one to. A rank on
    another host is dead when its watch's heartbeat stood still for ``wait_s`` (default 3 polls; 0 skips the check). A
    rank that said it finished (:func:`mark_finished`) is never dead. When the store does not answer, this host's
    ranks are checked from the processes the watch learned (a launcher tearing the job down may have stopped the store
    first); where that finds none dead and rank 0 hosted the store, the answer is rank 0. Call it from the main thread
    (it uses the main store connection).
    """
    watchdog = _world.watchdog
    store = _world.store  # the caller's connection: the watch thread uses its own
    if store is None or _world.world_size == 1:
        return None
    here = socket.gethostname()
    store_gone = [0] if _world.store_on_rank0 and _world.rank != 0 else None  # the answer without a store
    try:
        peers = _peers(store, _world.world_size)
    except Exception:
        # The store did not answer (a launcher tearing the job down may be why): the watch has
        # learned the processes of this host's ranks already, and those need no store to check.
        learned = watchdog._local_peers if watchdog is not None else None
        if not learned:
            return store_gone
        found = _dead_among({r: (here, pid, start) for r, (pid, start) in learned.items()}, here, None, local_wait_s)
        return sorted(found) or store_gone
    dead = _dead_among(peers, here, store, local_wait_s)
    remote = [r for r, (host, _, _) in peers.items() if r != _world.rank and host != here]
    if remote and not dead and wait_s != 0:
        poll_s = watchdog.poll_s if watchdog is not None else 0.5
        try:
            before = {r: store.get(_BEAT_KEY.format(rank=r)) for r in remote}
            time.sleep(3 * poll_s if wait_s is None else wait_s)
            after = {r: store.get(_BEAT_KEY.format(rank=r)) for r in remote}
        except Exception:
            return store_gone
        dead += [r for r in remote if before[r] == after[r] != b"done"]
    return sorted(dead)


def _dead_among(
    peers: dict[int, tuple[str, int, str]], here: str, store: dist.Store | None, local_wait_s: float
) -> list[int]:
    """The ranks of ``peers`` on this host whose process is gone (waiting up to ``local_wait_s`` for one to
    go), less those that said in ``store`` that they finished (none asked without a store: it may not answer)."""
    local = {r: (pid, start) for r, (host, pid, start) in peers.items() if r != _world.rank and host == here}
    # A killed process closes its sockets a moment before it is gone from the process table.
    deadline = time.monotonic() + (local_wait_s if local else 0.0)
    while True:
        dead = [r for r, (pid, start) in local.items() if not treewatch.is_alive(pid, start)]
        if store is not None:
            with contextlib.suppress(Exception):
                dead = [
                    r
                    for r in dead
                    if not (store.check([_BEAT_KEY.format(rank=r)]) and store.get(_BEAT_KEY.format(rank=r)) == b"done")
                ]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.02)


def abort_reason() -> tuple[int, str] | None:
    """``(rank, reason)`` when some rank has already signalled a failure, else None."""
    if _world.watch_store is None:
        return None
    try:
        if not _world.watch_store.check([_ABORT_KEY]):
            return None
        failed, _, reason = _world.watch_store.get(_ABORT_KEY).decode(errors="replace").partition(":")
        return int(failed), reason
    except Exception:
        return None


def lagging_ranks() -> list[int] | None:
    """Ranks that have started fewer collectives than this one, or None if unknown.

    Read from the counters the watch threads publish; used to name the missing ranks when a collective times out.
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
    except Exception:
        return None
    mine = _world.collectives
    return [r for r in range(_world.world_size) if counts.get(r, 0) < mine]


class Watchdog(threading.Thread):
    """Ends this process when another rank has failed or died (see the module docstring)."""

    def __init__(
        self, store: dist.Store, rank: int, poll_s: float = 0.5, world_size: int = 1, host: str | None = None
    ) -> None:
        super().__init__(name="bunsan-watchdog", daemon=True)
        self.store, self.rank, self.poll_s = store, rank, poll_s
        self.world_size = world_size
        self.host = socket.gethostname() if host is None else host
        self._stop_event = threading.Event()
        self._published = -1
        self._beats = 0
        self._local_peers: dict[int, tuple[int, str]] | None = None  # rank -> (pid, start) on this host

    def silence(self) -> None:
        self._stop_event.set()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5 * self.poll_s + 1)

    def publish(self) -> None:
        count = _world.collectives
        if count != self._published:
            self.store.set(_PROGRESS_KEY.format(rank=self.rank), str(count))
            self._published = count

    def _find_local_peers(self) -> None:
        """Learn the pids of the ranks on this host, once every rank has published its own."""
        if self._local_peers is not None:
            return
        peers = _peers(self.store, self.world_size)
        if len(peers) == self.world_size:
            self._local_peers = {
                r: (pid, start) for r, (host, pid, start) in peers.items() if r != self.rank and host == self.host
            }

    def _abort_note(self) -> tuple[int, str] | None:
        """The failed rank and its reason, where a rank has left a failure note (:func:`signal_abort`)."""
        if not self.store.check([_ABORT_KEY]):
            return None
        failed, _, reason = self.store.get(_ABORT_KEY).decode(errors="replace").partition(":")
        return int(failed), reason

    def _own_note(self, rank: int) -> str | None:
        """The reason rank ``rank`` gave for its failure (:func:`signal_abort`), or the abort key's if it names
        ``rank`` (the inspector, ending the job, writes that key only); None when it left no note."""
        with contextlib.suppress(Exception):
            key = _FAILED_KEY.format(rank=rank)
            if self.store.check([key]):
                return self.store.get(key).decode("utf-8", "replace")
            note = self._abort_note()
            return note[1] if note is not None and note[0] == rank else None
        return None

    def _check_local_peers(self) -> None:
        """A rank on this host whose process is gone died without a word (SIGKILL, OOM): end the job, naming it,
        unless it left a failure note before its death (several ranks may raise at once): then that is the reason."""
        for r, (pid, start) in (self._local_peers or {}).items():
            if not treewatch.is_alive(pid, start):
                note = self._own_note(r)
                if note is not None:
                    self._end(f"rank {r} {peer_failure(note)}", peer=r)
                    return
                why = f"{SILENT_DEATH} (process {pid} on {self.host} is gone: killed by a signal or out of memory?)"
                signal_abort(why, failed=r)
                self._end(f"rank {r} {why}", peer=r)

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            try:
                self.publish()
                self._beats += 1
                self.store.set(_BEAT_KEY.format(rank=self.rank), str(self._beats))
                _inspector.poll(self.store)  # out-of-step collectives and stall reports
                note = self._abort_note()
                if note is not None and note[0] != self.rank:
                    self._end(f"rank {note[0]} {peer_failure(note[1])}", peer=note[0])
                self._find_local_peers()
            except Exception as e:
                if not self._stop_event.is_set():
                    if _world.store_on_rank0 and self.rank != 0:
                        self._end(
                            f"rank 0 is gone: it hosted the rendezvous store, which stopped answering "
                            f"({type(e).__name__}); see rank 0's output",
                            peer=0,
                        )
                    else:
                        self._end(f"lost the rendezvous store (the launcher's agent is gone: {type(e).__name__})")
            self._check_local_peers()

    def _end(self, why: str, peer: int | None = None) -> None:
        if self._stop_event.is_set():
            return
        print(f"[bunsan] rank {self.rank} of {_world.world_size}: stopping because {why}", file=sys.stderr, flush=True)
        report("stopped", peer=peer, what=why)
        # Give the failed rank's own exit a head start, so a launcher that reports
        # the first process to exit (not bunsan run) reports the real one.
        time.sleep(0.5)
        end_process(1)


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0
