"""The parameter server: the global model, its update rule and one thread per remote worker (rank 0).

Each thread is the only user of its worker's pair group on rank 0, and rank 0's main
thread never touches the pair groups, so no process group is used by two threads at
once. The threads are daemons: they never keep a process alive. See
:mod:`bunsan.algorithms.async_sgd` for the protocol and failures.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_int
from bunsan.algorithms.async_sgd.messages import (
    ABORT,
    DONE,
    FINAL,
    KIND_NAMES,
    PUSH,
    REPLY,
    WAIT,
    MessageLayout,
    payload,
)
from bunsan.algorithms.async_sgd.rules import may_proceed, staleness_scale
from bunsan.comm import Traffic, p2p
from bunsan.errors import CommunicationError

__all__ = ["ARRIVALS_KEPT", "ParameterServer"]

LOCAL_POLL_S = 0.5  # rank 0's worker re-checks for failures this often while held back
ARRIVALS_KEPT = 10_000  # the server remembers this many recent arrivals (about 1 MB); counts cover all


class ParameterServer:
    """The global model, its update rule and the threads that serve remote workers (rank 0).

    All state is guarded by one lock (``cond``). An update is applied under the
    lock, so updates are applied one at a time; the order in which they take the
    lock is the arrival order; the most recent ``arrivals_kept`` arrivals are in
    :attr:`arrivals`, and running counts (:attr:`version`, :attr:`pushes`, the
    staleness sum and maximum) cover every update, so memory stays flat however
    long the job runs.

    Args:
        layout: where each parameter lies in a message.
        workers: global ranks of every worker, this rank's own included.
        channels: the pair group of each remote worker (empty with one worker).
        staleness_bound: hold a worker's reply back while it is more than this many
            pushes ahead of the slowest active worker; ``None``: never.
        staleness_aware: weight each update by :func:`staleness_scale`.
        timeout_s: how long a thread waits for its worker's next message; the
            keep-alive period is a quarter of it.
        arrivals_kept: how many recent arrivals :attr:`arrivals` keeps.
    """

    def __init__(
        self,
        layout: MessageLayout,
        workers: Sequence[int],
        channels: Mapping[int, ProcessGroup],
        *,
        staleness_bound: int | None,
        staleness_aware: bool,
        timeout_s: float,
        arrivals_kept: int = ARRIVALS_KEPT,
    ) -> None:
        check_int("arrivals_kept", arrivals_kept, minimum=1)
        self.layout = layout
        self.channels = dict(channels)
        self.staleness_bound = staleness_bound
        self.staleness_aware = staleness_aware
        self.timeout_s = timeout_s
        self.keepalive_s = timeout_s / 4
        self.cond = threading.Condition()
        self.model = layout.message()  # W, in message layout
        self._views = layout.views(self.model)
        self.version = 0  # updates applied
        self.samples = 0  # samples of every applied update
        self.pushes = {w: 0 for w in workers}
        self.worker_samples = {w: 0 for w in workers}
        self.pulled = {w: 0 for w in workers}  # version each worker last received
        self.done: set[int] = set()
        self.staleness_sum = 0
        self.staleness_max = 0
        self.held_back = 0  # replies that waited for the staleness bound
        self.error: BaseException | None = None
        self.failed_rank: int | None = None
        # (worker rank, its push number from 1, staleness) of the recent updates: a ring,
        # so that a job of any length holds at most arrivals_kept of them.
        self._arrivals: deque[tuple[int, int, int]] = deque(maxlen=arrivals_kept)
        self._threads: list[threading.Thread] = []
        self._traffics: list[Traffic] = []

    # -- the update rule (call with ``cond`` held) -----------------------------------
    def load_model(self) -> None:
        """``W`` = the parameters now (rank 0's replica)."""
        with self.cond:
            self.layout.gather(self._views)

    @torch.no_grad()
    def _apply(self, worker: int, update: Sequence[Tensor], samples: int) -> None:
        staleness = self.version - self.pulled[worker]
        scale = staleness_scale(staleness) if self.staleness_aware else 1.0
        for w, u in zip(self._views, update):
            if scale == 1.0:
                w.add_(u)
            else:
                w.add_(u, alpha=scale)
        self.version += 1
        self.samples += samples
        self.pushes[worker] += 1
        self.worker_samples[worker] += samples
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self._arrivals.append((worker, self.pushes[worker], staleness))
        self.cond.notify_all()

    def _snapshot(self, worker: int, message: Tensor, kind: int) -> None:
        payload(message).copy_(payload(self.model))
        header = self.layout.header(message)
        header[0], header[1], header[2], header[3] = kind, self.version, self.samples, 0
        self.pulled[worker] = self.version

    def _may_proceed(self, worker: int) -> bool:
        return may_proceed(worker, self.pushes, self.done, self.staleness_bound)

    def _all_done(self) -> bool:
        return len(self.done) == len(self.pushes)

    def check(self) -> None:
        """Raise :class:`CommunicationError` if a server thread has failed (call with ``cond`` held)."""
        if self.error is not None:
            raise CommunicationError(
                f"the parameter server lost worker rank {self.failed_rank}: {self.error}"
            ) from self.error

    def _fail(self, worker: int, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error, self.failed_rank = error, worker
            self.cond.notify_all()

    # -- rank 0's own worker --------------------------------------------------------
    def push_local(self, worker: int, update: Sequence[Tensor], samples: int, *, done: bool) -> None:
        """Apply rank 0's own update (in-process: nothing on the wire)."""
        with self.cond:
            self.check()
            self._apply(worker, update, samples)
            if done:
                self.done.add(worker)

    def pull_local(self, worker: int, message: Tensor, *, final: bool) -> None:
        """Copy the global model into ``message`` once rank 0's worker may have it.

        Waits for the staleness bound (or, with ``final``, for every worker to be
        done); raises if a server thread failed meanwhile.
        """
        ready = self._all_done if final else (lambda: self._may_proceed(worker))
        with self.cond:
            held = False
            while True:
                self.check()
                if ready():
                    self._snapshot(worker, message, FINAL if final else REPLY)
                    self.held_back += held and not final
                    return
                held = True
                self.cond.wait(timeout=LOCAL_POLL_S)

    def mark_all_pulled(self) -> None:
        """Every worker now holds the current model (after a sync_replicas())."""
        with self.cond:
            for w in self.pulled:
                self.pulled[w] = self.version

    # -- threads for remote workers ---------------------------------------------------
    def start(self) -> None:
        """Start one daemon thread per remote worker."""
        for worker in sorted(self.channels):
            traffic = Traffic()
            self._traffics.append(traffic)
            thread = threading.Thread(
                target=self._serve, args=(worker, traffic), name=f"bunsan-server-{worker}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _serve(self, worker: int, traffic: Traffic) -> None:
        group = self.channels[worker]
        inbox, outbox = self.layout.message(), self.layout.message()
        try:
            while True:
                p2p.recv(inbox, worker, group=group, traffic=traffic)
                kind, _, samples, _ = self.layout.header(inbox).tolist()
                if kind not in (PUSH, DONE):
                    raise CommunicationError(f"unexpected message {KIND_NAMES.get(kind, kind)} from rank {worker}")
                with self.cond:
                    if self.error is None:
                        self._apply(worker, self.layout.views(inbox), int(samples))
                        if kind == DONE:
                            self.done.add(worker)
                final = kind == DONE
                if not self._reply(worker, outbox, group, traffic, final=final) or final:
                    return
        except BaseException as e:
            self._fail(worker, e)

    def _reply(self, worker: int, outbox: Tensor, group: ProcessGroup, traffic: Traffic, *, final: bool) -> bool:
        """Send the model once ``worker`` may have it, keep-alives meanwhile; False after an abort."""
        ready = self._all_done if final else (lambda: self._may_proceed(worker))
        header = self.layout.header(outbox)
        held = False
        while True:
            with self.cond:
                if self.error is None and not ready():
                    held = True
                    self.cond.wait_for(lambda: self.error is not None or ready(), timeout=self.keepalive_s)
                if self.error is not None:
                    kind = ABORT
                    header[0], header[1] = ABORT, -1 if self.failed_rank is None else self.failed_rank
                elif ready():
                    kind = FINAL if final else REPLY
                    self._snapshot(worker, outbox, kind)
                    self.held_back += held and not final
                else:
                    kind = WAIT
                    header[0] = WAIT
            p2p.send(outbox, worker, group=group, traffic=traffic)
            if kind != WAIT:
                return kind != ABORT

    def finish(self) -> None:
        """Wait for the threads, which end after sending the final model; raise if one failed."""
        deadline = time.monotonic() + self.timeout_s
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        with self.cond:
            self.check()
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise CommunicationError(f"parameter server threads {alive} did not finish within {self.timeout_s} s")

    # -- measurement and state ------------------------------------------------------
    @property
    def traffic(self) -> Traffic:
        total = Traffic()
        for t in self._traffics:
            total.sent += t.sent
            total.received += t.received
            total.calls += t.calls
        return total

    @property
    def arrivals(self) -> list[tuple[int, int, int]]:
        """The most recent applied updates (at most ``arrivals_kept``), oldest first, in arrival order.

        Each is ``(worker rank, its push number from 1, staleness)``; push numbers
        count from the start of training, so a trimmed log still says which push it was.
        """
        with self.cond:
            return list(self._arrivals)

    def state_dict(self) -> dict[str, Any]:
        with self.cond:
            return {
                "model": self.layout.named(self._views),
                "version": self.version,
                "samples": self.samples,
                "pushes": dict(self.pushes),
                "worker_samples": dict(self.worker_samples),
                "pulled": dict(self.pulled),
                "staleness_sum": self.staleness_sum,
                "staleness_max": self.staleness_max,
                "held_back": self.held_back,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self.cond:
            self.layout.load_named(self._views, state["model"], "server model")
            self.version = int(state["version"])
            self.samples = int(state["samples"])
            for key in ("pushes", "worker_samples", "pulled"):
                table = getattr(self, key)
                for w in table:
                    table[w] = int(state[key].get(w, 0))
            self.staleness_sum = int(state["staleness_sum"])
            self.staleness_max = int(state["staleness_max"])
            self.held_back = int(state.get("held_back", 0))
