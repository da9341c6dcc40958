"""Which collective each rank is in and what it is doing: out-of-step detection and stall reports.

Every collective of :mod:`bunsan.comm.collectives` is numbered per process
group, on every rank alike (the same order on all ranks is the contract of a
collective). A rank that skips one (``if not torch.isfinite(loss): continue``
before ``optimizer.step()``), or that calls another one (a loss logged with
``all_reduce`` while a finished rank answers the others inside ``join()``),
pairs its collectives with the wrong ones of its peers. Gloo then either waits
until the timeout (minutes) or, when the message sizes differ, ends a process
with ``std::terminate``. This module names such a mismatch within seconds.

How, without cost on the fast path:

1. Each collective appends ``(group, number, op, shape)`` to a ring of the last
   :data:`RING` ones (a deque append) and marks the rank "waiting" while it
   blocks (two attribute writes). Nothing is sent.
2. The failure watch thread of :mod:`bunsan.comm.group` calls :func:`poll`
   every ``poll_s``. It publishes this rank's *state* (its last collective and
   its activity: training, "in join", "in join called by finalize()",
   "finished", "in checkpoint save", ...) to the store when it changed, as the
   watch already publishes its progress count.
3. Only when a collective has waited longer than :data:`CHECK_S` does the
   thread publish the ring and read the peers' rings. Two rings that hold
   different operations under the same number are proof that the ranks are
   out of step: every rank that sees it prints one sentence naming the group,
   the number, each rank's operation and activity, sets the job's abort key
   (so the other ranks end too) and exits with code 1. A job whose collectives
   went out of step never exits 0.
4. After ``stall_s`` (default 60 s, :func:`configure`) of waiting, the lowest
   waiting rank prints once which ranks have not reached the collective and
   what each is doing, and keeps waiting (Horovod's stall inspector does the
   same for its tensor queue).
5. When the backend raises instead (a peer ended, a timeout), :func:`diagnose`
   turns the peers' published states into the sentence the user needs, e.g.
   "rank 1 finished its data and called finalize() while rank 0 was still
   training: call optimizer.join() on every rank after the loop".

Activities that matter for those sentences are published at once from the
main thread (:func:`activity`): they change a few times per job.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from bunsan._validate import check_number
from bunsan.comm.mismatch import (
    FINALIZE_JOIN,
    IN_FINALIZE,
    TRAINING,
    describe_mismatch,
    describe_state,
    forgotten_join,
    skipped_step,
)

__all__ = [
    "ABORT_KEY",
    "CHECK_S",
    "DEFAULT_STALL_S",
    "FINALIZE_JOIN",
    "IN_FINALIZE",
    "RING",
    "TRAINING",
    "activity",
    "begin_wait",
    "collectives_in_world",
    "compare_at_end",
    "configure",
    "count_steps_of",
    "describe_mismatch",
    "diagnose",
    "end_wait",
    "in_finalize_join_hint",
    "poll",
    "set_activity",
    "skipped_step",
    "stall_report",
    "started",
    "use_store",
    "waiting",
]

RING = 64  # recent collectives kept per rank for the comparison
CHECK_S = 1.0  # a wait longer than this publishes the ring and compares it with the peers'
DEFAULT_STALL_S = 60.0

_STATE_KEY = "inspect/state/{rank}"
_RING_KEY = "inspect/ring/{rank}"
_STEPS_KEY = "inspect/steps/{rank}"
ABORT_KEY = "abort"  # the job's abort key, "<rank>:<reason>"; bunsan.comm.group watches it
STEPS_KEPT = 512  # (steps completed, first world collective after them) of the recent steps


class _Local:
    """This rank's view; written by the main thread, read by the watch thread."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.stall_s = DEFAULT_STALL_S
        self.seqs: dict[Any, int] = {}  # per group key: collectives started
        self.ring: deque[tuple[Any, ...]] = deque(maxlen=RING)
        self.last: tuple[Any, ...] | None = None
        self.step_sources: list[weakref.ref[Any]] = []  # algorithms whose .step tags the collectives
        # Where each recent step count began: (tag, number of the first world collective with it).
        self.transitions: deque[tuple[int, int]] = deque(maxlen=STEPS_KEPT)
        self.published_ring: tuple[str, int, str, int] | None = None
        self.activity = TRAINING
        self.wait_since: float | None = None
        self.published_state = ""
        self.published_ring_for: float | None = None
        self.reported_stall_for: float | None = None
        self.lock = threading.Lock()
        self.store: Any = None  # the world's store, from use_store(); None before init and after finalize


_local = _Local()


def configure(*, rank: int, world_size: int, stall_s: float | None = None) -> None:
    """Reset the counters for a new world (called by :func:`bunsan.init`)."""
    check_number("stall_s", stall_s, minimum=0, min_inclusive=False, hint="seconds", allow_none=True)
    _local.rank, _local.world_size = rank, world_size
    _local.stall_s = DEFAULT_STALL_S if stall_s is None else float(stall_s)
    _local.seqs = {}
    _local.ring = deque(maxlen=RING)
    _local.last, _local.activity, _local.wait_since = None, TRAINING, None
    _local.step_sources, _local.published_ring = [], None
    _local.transitions = deque(maxlen=STEPS_KEPT)
    _local.published_state = ""
    _local.published_ring_for = _local.reported_stall_for = None


def collectives_in_world() -> int:
    """Collectives of the world group this rank has started (the same on every rank in step)."""
    return _local.seqs.get("world", 0)


def _group_key(group: Any) -> str:
    """A name of ``group`` that every member computes alike: ``world`` or its global ranks.

    Not cached by ``id(group)``: a destroyed group's id can be reused by a new one.
    """
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return "group " + ",".join(map(str, dist.get_process_group_ranks(group)))
    except Exception:
        return f"group@{id(group)}"


def started(what: str, group: Any, tensor: Any = None) -> int:
    """Record one collective started by this rank; returns its number in ``group`` (from 1).

    On the fast path: the entry keeps the tensor's size and dtype as they are;
    the text is made only when the watch thread publishes it.
    """
    key = "world" if group is None else _group_key(group)
    seq = _local.seqs.get(key, 0) + 1
    _local.seqs[key] = seq
    # The step tag: collectives made while training carry the number of optimizer
    # steps completed before them; inside join() a rank answers other ranks' steps (-1: not compared).
    tag = _steps() if _local.activity == TRAINING else -1
    if key == "world" and tag >= 0 and (not _local.transitions or _local.transitions[-1][0] != tag):
        _local.transitions.append((tag, seq))
    entry = (key, seq, what, -1 if tensor is None else tensor.numel(), None if tensor is None else tensor.dtype, tag)
    _local.ring.append(entry)
    _local.last = entry
    return seq


def begin_wait() -> bool:
    """Mark this rank as blocked in a collective; returns whether this call started the wait (pass it to end_wait)."""
    if _local.wait_since is not None:  # nested: the outer wait is the one timed
        return False
    _local.wait_since = time.monotonic()
    return True


def end_wait(started_here: bool) -> None:
    if started_here:
        _local.wait_since = None


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """:func:`begin_wait` and :func:`end_wait` around a block."""
    mine = begin_wait()
    try:
        yield
    finally:
        end_wait(mine)


def _entry(e: tuple[Any, ...]) -> list[Any]:
    """A ring entry as published: ``[group, number, "op [numel x dtype]", steps]``."""
    key, seq, what, numel, dtype, tag = e
    shape = "" if dtype is None else f"{numel} x {str(dtype).removeprefix('torch.')}"
    return [key, seq, f"{what} [{shape}]", tag]


def _ring() -> list[list[Any]]:
    return [_entry(e) for e in list(_local.ring)]


def count_steps_of(algorithm: Any) -> None:
    """Tag this rank's collectives with ``algorithm.step`` (completed optimizer steps); held weakly.

    For algorithms whose every step communicates: the same collective made after
    different numbers of steps on two ranks means one of them skipped a step.
    """
    _local.step_sources.append(weakref.ref(algorithm))


def _steps() -> int:
    total = 0
    for ref in _local.step_sources:
        algorithm = ref()
        if algorithm is not None:
            total += algorithm.step
    return total


def _state() -> dict[str, Any]:
    last = _local.last
    return {
        "rank": _local.rank,
        "activity": _local.activity,
        "last": _entry(last) if last else None,
        "waiting": _local.wait_since is not None,
    }


def use_store(store: Any) -> None:
    """Publish this rank's records through ``store`` (the world's store), or stop publishing (``None``).

    :mod:`bunsan.comm.group` calls it when the world is created and destroyed; the
    store is handed over rather than looked up so that this module imports nothing
    of the group's (no import cycle).
    """
    _local.store = store


def _main_store() -> Any:
    return _local.store


@contextlib.contextmanager
def activity(name: str) -> Iterator[None]:
    """Say what this rank is doing (``"in checkpoint save"``, ``"in join"``) while inside.

    Published at once (one store write from the calling thread), so a peer that
    fails meanwhile can name it.
    """
    previous = _local.activity
    set_activity(name)
    try:
        yield
    finally:
        set_activity(previous)


def set_activity(name: str) -> None:
    """Set this rank's activity and publish it now (see :func:`activity`)."""
    _local.activity = name
    store = _main_store()
    if store is None or _local.world_size == 1:
        return
    with contextlib.suppress(Exception):  # the store may be gone at the very end
        store.set(_STATE_KEY.format(rank=_local.rank), json.dumps(_state()))


def _read(store: Any, key: str) -> Any:
    """The JSON value a rank published under ``key`` (a state, a ring, step records), or None."""
    try:
        if not store.check([key]):
            return None
        return json.loads(store.get(key).decode())
    except Exception:
        return None


def _steps_record(store: Any, rank: int) -> list[list[int]] | None:
    if rank == _local.rank:
        return [list(t) for t in list(_local.transitions)]
    steps: list[list[int]] | None = _read(store, _STEPS_KEY.format(rank=rank))
    return steps


def _end_job(message: str, store: Any) -> None:
    """Print ``message``, set the abort key so every rank ends, and exit 1."""
    print(f"[bunsan] rank {_local.rank}: {message}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):  # the watch thread's own store client, in the abort key's format
        if not store.check([ABORT_KEY]):
            store.set(ABORT_KEY, f"{_local.rank}:{message}")
    time.sleep(0.5)  # let the peers read the key and print their own line
    sys.stdout.flush()
    os._exit(1)


def poll(store: Any) -> None:
    """One round of the watch thread: publish the state; on a long wait compare rings and report stalls.

    Never raises: a store that fails is the watch's own business (it ends the process).
    """
    if _local.world_size <= 1:
        return
    with contextlib.suppress(Exception):
        _poll(store)


def _poll(store: Any) -> None:
    state = json.dumps(_state())
    if state != _local.published_state:
        store.set(_STATE_KEY.format(rank=_local.rank), state)
        _local.published_state = state
    ring = _ring()
    if ring and _local.published_ring != tuple(ring[-1]):
        # The recent collectives, compared with the next rank's: a ring of ranks
        # each comparing with its neighbour sees any pair that differs, at a cost
        # of one write and two reads per rank and poll.
        store.set(_RING_KEY.format(rank=_local.rank), json.dumps(ring))
        store.set(_STEPS_KEY.format(rank=_local.rank), json.dumps(list(_local.transitions)))
        _local.published_ring = tuple(ring[-1])
        neighbour = (_local.rank + 1) % _local.world_size
        theirs = _read(store, _RING_KEY.format(rank=neighbour))
        if theirs is not None:
            states: dict[int, dict[str, Any] | None] = {
                _local.rank: _state(),
                neighbour: _read(store, _STATE_KEY.format(rank=neighbour)),
            }
            message = describe_mismatch(
                {_local.rank: ring, neighbour: theirs},
                states,
                lambda r: _steps_record(store, r),
            )
            if message is not None:
                _end_job(message, store)
                return
    since = _local.wait_since
    if since is None:
        return
    waited = time.monotonic() - since
    if waited < CHECK_S:
        return
    if _local.published_ring_for != since:
        store.set(_RING_KEY.format(rank=_local.rank), json.dumps(ring))
        _local.published_ring_for = since
    rings: dict[int, list[list[Any]]] = {_local.rank: ring}
    states = {_local.rank: _state()}
    for r in range(_local.world_size):
        if r == _local.rank:
            continue
        state = states[r] = _read(store, _STATE_KEY.format(rank=r))
        if state is not None and state.get("waiting"):
            theirs = _read(store, _RING_KEY.format(rank=r))
            if theirs is not None:
                rings[r] = theirs
    message = describe_mismatch(rings, states)
    if message is not None:
        _end_job(message, store)
        return
    if waited >= _local.stall_s and _local.reported_stall_for != since:
        _local.reported_stall_for = since
        waiting_ranks = [r for r, s in states.items() if s is not None and s.get("waiting")]
        if min(waiting_ranks, default=_local.rank) == _local.rank:
            print(f"[bunsan] rank {_local.rank}: {stall_report(waited, states)}", file=sys.stderr, flush=True)


def stall_report(waited: float, states: dict[int, dict[str, Any] | None]) -> str:
    """One report: this rank's collective, the ranks that have not reached it and what each is doing."""
    mine = _entry(_local.last) if _local.last else None
    here = f"{mine[0]} collective #{mine[1]} {mine[2]}" if mine else "a collective"
    missing = []
    for r, s in sorted(states.items()):
        if r == _local.rank:
            continue
        last = s.get("last") if s else None
        reached = (
            s is not None
            and s.get("waiting")
            and last is not None
            and mine is not None
            and last[0] == mine[0]
            and last[1] >= mine[1]
        )
        if not reached:
            missing.append(f"rank {r} is {describe_state(s)}")
    if not missing:
        return (
            f"{here} has waited {waited:.0f} s; every rank has reached it (the backend is slow "
            "or a message is lost); still waiting"
        )
    return f"{here} has waited {waited:.0f} s for {len(missing)} rank(s), still waiting: " + "; ".join(missing)


def compare_at_end(timeout_s: float) -> str | None:
    """At the end of the job: compare this rank's recent collectives with the next rank's; the sentence or None.

    Every rank calls it at the same point (after the joins, which end
    together), so the next rank's record appears within moments. Short jobs end
    before the watch thread has compared anything; this is their check.
    """
    store = _main_store()
    if store is None or _local.world_size <= 1:
        return None
    from datetime import timedelta

    rank, neighbour = _local.rank, (_local.rank + 1) % _local.world_size
    ring = _ring()
    store.set(f"inspect/final/{rank}", json.dumps(ring))
    store.set(_STATE_KEY.format(rank=rank), json.dumps(_state()))
    key = f"inspect/final/{neighbour}"
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        theirs = json.loads(store.get(key).decode())
    except Exception:
        return None
    states = {rank: _state(), neighbour: _read(store, _STATE_KEY.format(rank=neighbour))}
    return describe_mismatch({rank: ring, neighbour: theirs}, states)


def in_finalize_join_hint() -> str | None:
    """The likely cause when a peer vanished while this rank answered its exchanges from finalize(), or None.

    A rank still training that calls a collective which ``join()`` does not
    answer (a logged loss, an evaluation) pairs it with this rank's exchange;
    when the sizes differ, Gloo ends one of the two processes on the spot, and
    if that one hosted the store there is nothing left to read.
    """
    if _local.activity != FINALIZE_JOIN:
        return None
    return (
        f"another rank ended while rank {_local.rank}, which had finished its data and called finalize(), was "
        "answering its exchanges: that rank was still training and called another collective (such as an "
        "all_reduce of the loss); call optimizer.join() on every rank after the loop"
    )


def diagnose(timeout_s: float = 2.0) -> str | None:
    """After the backend raised: the sentence the peers' published states support, or None.

    Publishes this rank's state and ring at once, then reads the peers' for up
    to ``timeout_s`` (they publish theirs within a poll of the watch thread).
    """
    store = _main_store()
    if store is None or _local.world_size <= 1:
        return None
    rank = _local.rank
    try:
        store.set(_STATE_KEY.format(rank=rank), json.dumps({**_state(), "waiting": True}))
        store.set(_RING_KEY.format(rank=rank), json.dumps(_ring()))
    except Exception:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.check([_STATE_KEY.format(rank=rank)])
        except Exception:
            return None
        states: dict[int, dict[str, Any] | None] = {rank: _state()}
        rings: dict[int, list[list[Any]]] = {rank: _ring()}
        for r in range(_local.world_size):
            if r != rank:
                states[r] = _read(store, _STATE_KEY.format(rank=r))
                ring = _read(store, _RING_KEY.format(rank=r))
                if ring is not None:
                    rings[r] = ring
        message = forgotten_join(states) or describe_mismatch(rings, states)
        if message is not None or time.monotonic() >= deadline:
            return message
        time.sleep(0.25)
