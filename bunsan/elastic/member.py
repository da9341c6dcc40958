"""This worker's membership of an elastic job: torchft's per-step quorum, its group and the state a joiner heals from.

One :class:`Member` per process, made by :func:`bunsan.init` when ``bunsan run --min-np`` started the worker
(:func:`requested`). Each worker is a torchft replica group of one process: its own ``TCPStore``, a
``torchft.Manager`` that asks the lighthouse (a process of the launcher, so that the rendezvous outlives any
worker) for a quorum at every step, and a reconfigurable Gloo or NCCL process group over the quorum's members.
A step is the Manager's: :meth:`Member.begin_step` takes part in the quorum (a worker behind the others loads
their state first, from a live peer over HTTP: no checkpoint file), :meth:`Member.commit` asks whether every
member's exchange went through; a step that did not is dropped on every member and done again by the
quorum that follows (docs/explanation/elastic.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from bunsan._extras import require
from bunsan.errors import ConfigurationError

__all__ = [
    "LIGHTHOUSE_VARIABLE",
    "MIN_NP_VARIABLE",
    "NP_VARIABLE",
    "REPLICA_VARIABLE",
    "Member",
    "current",
    "requested",
]

LIGHTHOUSE_VARIABLE = "BUNSAN_ELASTIC_LIGHTHOUSE"  # the lighthouse's address, e.g. http://10.0.0.1:29510
MIN_NP_VARIABLE = "BUNSAN_ELASTIC_MIN_NP"  # steps commit only with at least this many members
NP_VARIABLE = "BUNSAN_ELASTIC_NP"  # the job's starting size: global batch = per-worker batch x this
REPLICA_VARIABLE = "BUNSAN_ELASTIC_REPLICA"  # this worker's name in the quorum, unique per start
DIR_VARIABLE = "BUNSAN_ELASTIC_DIR"  # where a worker marks that it joined (bunsan.launch.elastic)
TRACE_VARIABLE = "BUNSAN_ELASTIC_TRACE"  # a folder: each worker appends its steps to <replica>.trace there
TIMEOUT_S = 300.0  # a collective or quorum that waits this long fails the step: a peer hung (BUNSAN_TIMEOUT)
# Building a quorum's group waits for every member's address; a member that died after the quorum formed never
# sends it. Every live member arrives within the same quorum's reply, so a short wait tells a dead one.
CONNECT_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_VARIABLE = "BUNSAN_ELASTIC_CONNECT_TIMEOUT"  # seconds, instead of CONNECT_TIMEOUT_S

_member: Member | None = None


def requested() -> bool:
    """Whether this process was started as a worker of an elastic job (``bunsan run --min-np``)."""
    return bool(os.environ.get(LIGHTHOUSE_VARIABLE))


def current() -> Member | None:
    """The member :func:`bunsan.init` made, or ``None`` outside an elastic job."""
    return _member


def _int_variable(name: str, minimum: int) -> int:
    text = os.environ.get(name, "")
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={text!r} is not an integer") from None
    if value < minimum:
        raise ConfigurationError(f"environment variable {name}={value} must be >= {minimum}")
    return value


class Member:
    """One worker's part in an elastic job (module docstring). Built from the launcher's variables.

    Attributes:
        manager: the ``torchft.Manager``.
        start_size: the job's starting number of workers (``-np``).
        min_size: the fewest members a step may commit with (``--min-np``).
    """

    def __init__(self, backend: str = "gloo", timeout_s: float | None = None) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
        require("torchft", "elastic training (bunsan run --min-np)", "elastic")
        from torch.distributed import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.start_size = _int_variable(NP_VARIABLE, 1)
        self.min_size = _int_variable(MIN_NP_VARIABLE, 1)
        self.replica = os.environ.get(REPLICA_VARIABLE) or f"{socket.gethostname()}-{os.getpid()}"
        host = os.environ.get("BUNSAN_ELASTIC_HOST", "127.0.0.1")
        timeout = timedelta(seconds=timeout_s or float(os.environ.get("BUNSAN_TIMEOUT") or TIMEOUT_S))
        self._states: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._commit_hooks: list[Callable[[], None]] = []
        self._drop_hooks: list[Callable[[], None]] = []
        self._flush: Callable[[], None] | None = None  # ends a block in flight (bunsan.elastic.blocks)
        self.step_samples = 0  # global samples the loaders handed out in this step (a block: all its batches)
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        if backend == "nccl":
            group = ProcessGroupNCCL(timeout=timeout)
        else:
            connect = float(os.environ.get(CONNECT_TIMEOUT_VARIABLE) or CONNECT_TIMEOUT_S)
            group = _gloo_group(ProcessGroupGloo, timeout, timedelta(seconds=min(connect, timeout.total_seconds())))
        self._group = group
        self.manager = Manager(
            pg=group,
            load_state_dict=self._load_state,
            state_dict=self._state,
            min_replica_size=self.min_size,
            use_async_quorum=False,  # the step's rank must be known before its batch is cut
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=self._store.port,
            lighthouse_addr=os.environ[LIGHTHOUSE_VARIABLE],
            replica_id=self.replica,
            hostname=host,
        )
        self.epoch_source: Callable[[], int] | None = None  # the first loader's epoch (bunsan.elastic.epochs)
        _quiet(self.manager)
        trace = os.environ.get(TRACE_VARIABLE)  # one line per step: time, committed steps, committed?, members
        self._trace = open(os.path.join(trace, f"{self.replica}.trace"), "a") if trace else None  # noqa: SIM115
        self.members_seen = 0  # the quorum size at the last step, to say when it changes
        self._dropped: str | None = None  # why the last step was dropped, said at the next quorum
        self.in_step = False
        self.share = 1.0  # this member's part of the step's global batch, times the members (1: an equal part)

    # -- state a joiner receives ------------------------------------------------------------------------
    def register(self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """Hand ``state_dict()`` to a joining worker, which loads it with ``load_state_dict``; ``name`` unique."""
        if name in self._states:
            raise ValueError(f"elastic state {name!r} is registered twice")
        self._states[name] = (state_dict, load_state_dict)

    def unique_name(self, prefix: str) -> str:
        """``prefix`` followed by the first number that makes a name not registered yet (``loader0``, ...)."""
        n = 0
        while f"{prefix}{n}" in self._states:
            n += 1
        return f"{prefix}{n}"

    def on_commit(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after every committed step (before the optimizer's next use)."""
        self._commit_hooks.append(hook)

    def on_drop(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after every dropped step."""
        self._drop_hooks.append(hook)

    def on_flush(self, end_step: Callable[[], None]) -> None:
        """``end_step()`` ends a step that spans several batches (a block) before its planned end: a loader
        calls :meth:`flush` at the end of its epoch. One per member."""
        if self._flush is not None:
            raise ValueError("one block optimizer per elastic job: bunsan.distribute was called twice")
        self._flush = end_step

    def flush(self) -> bool:
        """End the step in flight now if it spans batches; whether there was one to end."""
        if self._flush is None or not self.in_step:
            return False
        self._flush()
        return True

    def _state(self) -> dict[str, Any]:
        return {name: get() for name, (get, _) in self._states.items()}

    def _load_state(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self._states) - set(state))
        if missing:
            raise ConfigurationError(
                f"the live peer's state lacks {missing}: every worker must register the same state "
                "(the same script, the same calls of bunsan.distribute and bunsan.data.loader)"
            )
        for name, (_, load) in self._states.items():
            load(state[name])

    # -- the step -------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Take part in this step's quorum (a worker behind the others heals first). Idempotent per step."""
        if self.in_step:
            return
        self.manager.start_quorum()
        self.in_step = True
        self.share = 1.0
        members = self.size()
        if self._dropped is not None and self.rank() == 0:
            _say(self._dropped)
        self._dropped = None
        if members != self.members_seen and self.members_seen and self.rank() == 0:
            _say(f"the job goes on with {members} worker{'s' * (members != 1)} (it had {self.members_seen})")
        if not self.members_seen:
            _mark_joined(self.replica)
            if self.step_count() > 0:  # a late joiner: it has just loaded a live peer's state
                _say(f"{self.replica} joined at step {self.step_count()} with a live peer's state")
        self.members_seen = members

    def rank(self) -> int:
        """This worker's place in the step's quorum, 0..size()-1."""
        rank = self.manager.participating_rank()
        return 0 if rank is None else rank

    def size(self) -> int:
        """The members of the step's quorum."""
        return max(1, self.manager.num_participants())

    def allreduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by the members' mean of it, in place; a failure shows in :meth:`commit`."""
        works = [self.manager.allreduce(t) for t in tensors]
        for work in works:
            work.wait()

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor`` (the same shape on each), in quorum-rank order; a failure shows in
        :meth:`commit` (the result is then zeros)."""
        outputs = [torch.zeros_like(tensor) for _ in range(self.size())]
        if self.manager.errored() or self.size() == 1:
            outputs[0].copy_(tensor)
            return outputs
        from torch.distributed.distributed_c10d import AllgatherOptions

        try:
            self._group.allgather([outputs], [tensor], AllgatherOptions()).wait()
        except Exception as error:  # a dead peer: the step is dropped on every member
            self.manager.report_error(error)
        return outputs

    def commit(self) -> bool:
        """Whether every member's exchange went through: then the step counts, else it is dropped everywhere."""
        failed = self.manager.errored()
        committed = bool(self.manager.should_commit())
        self.in_step = False
        if not committed:
            # A member blocked in the exchange on this one (a ring's far side of a dead peer) waits for its
            # data until the group's timeout; closing this member's end of the group fails that wait now, so
            # every survivor asks for the next quorum within the heartbeat timeout, not the join timeout.
            self._group.abort()
        if not committed:  # said by the next quorum's first member: this step's may be the one that died
            cause = str(getattr(failed, "original_exception", failed) or "a member failed").splitlines()[0][:200]
            self._dropped = f"step {self.step_count()} was dropped on every worker ({cause}); this quorum does it again"
        self.step_samples = 0
        for hook in self._commit_hooks if committed else self._drop_hooks:
            hook()
        if self._trace is not None:
            self._trace.write(f"{time.time():.6f} {self.step_count()} {int(committed)} {self.size()}\n")
            self._trace.flush()
        return committed

    def step_count(self) -> int:
        """Steps committed so far by the job (a joiner's count is its peer's)."""
        return int(self.manager.current_step())

    def leave(self) -> None:
        """Stop taking part (the lighthouse drops this worker from the next quorum)."""
        self.manager.shutdown(wait=False)

    def allreduce_sum(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by the members' sum of it, in place; a failure shows in :meth:`commit`."""
        from torch.distributed import ReduceOp

        works = [self.manager.allreduce(t, reduce_op=ReduceOp.SUM) for t in tensors]
        for work in works:
            work.wait()


def _gloo_group(base: Any, timeout: timedelta, connect_timeout: timedelta) -> Any:
    """torchft's reconfigurable Gloo group whose connection to a new quorum waits ``connect_timeout``, and
    whose collectives then wait ``timeout`` (a peer's longer compute is not a failure)."""

    class _Gloo(base):
        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            pg = super()._create_pg(store, rank, world_size)  # connects with self._timeout: connect_timeout
            pg._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
            return pg

    return _Gloo(timeout=connect_timeout)


def _mark_joined(replica: str) -> None:
    """Tell the launcher that this worker is in a quorum (a file in ``BUNSAN_ELASTIC_DIR``): a worker that has
    not joined when the job ends is stopped, not waited for."""
    folder = os.environ.get(DIR_VARIABLE)
    if folder:
        with contextlib.suppress(OSError), open(os.path.join(folder, f"joined-{replica}"), "w") as f:
            f.write(f"{time.time()}\n")


def _say(message: str) -> None:
    print(f"[bunsan] {message}", file=sys.stderr, flush=True)


def _quiet(manager: Any) -> None:
    """torchft logs every quorum and every failure with its traceback; bunsan says one line per event instead
    (``BUNSAN_ELASTIC_DEBUG=1`` keeps torchft's logs)."""
    if os.environ.get("BUNSAN_ELASTIC_DEBUG"):
        return
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
    with contextlib.suppress(AttributeError):  # the checkpoint server's access log, one line per heal
        manager._checkpoint_transport._server.RequestHandlerClass.log_message = lambda *args: None


def join(backend: str = "gloo") -> Member:
    """Make this process's :class:`Member` (once)."""
    global _member
    if _member is None:
        _member = Member(backend)
    return _member


def leave() -> None:
    """End this process's membership, if any."""
    global _member
    if _member is not None:
        _member.leave()
        _member = None
