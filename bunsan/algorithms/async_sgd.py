"""Asynchronous data-parallel SGD with a parameter server (CNTK's DataParallelASGD).

A parameter server holds the global model ``W``. Every worker trains its own
replica with the user's local optimizer and, each time it has trained
``sync_period`` samples since its last synchronization, it

1. *pushes* its accumulated update ``u = w_local - w_pulled`` (its model now
   minus the model it last pulled), and
2. *pulls* the current global model, which becomes its replica and its new
   ``w_pulled``,

without waiting for the other workers. The server applies every update as it
arrives, ``W = W + u`` (``W = W + u / max(staleness, 1)`` with
``staleness_aware=True``), one at a time, in arrival order, and records that
order. This is Downpour SGD (Dean et al. 2012, "Large Scale Distributed Deep
Networks", NIPS 2012) with accumulated pushes, as CNTK's DataParallelASGD
(whose server was Multiverso) does it; a slow worker delays only itself.

Learning rate and the number of workers. Every worker's update is applied in
full, so N workers move ``W`` about N times as far per unit of time as one
worker would; per *sample* it is plain SGD with the local minibatch, i.e. N
times the step of synchronous SGD that averages the N workers' gradients at the
same learning rate (``DataParallelSGD`` with the same global batch). Updates are
also *stale*: an update computed from ``W_t`` lands on ``W_{t+tau}``, with
``tau`` around ``N - 1`` when all workers run at one speed. Large steps on stale
models diverge where synchronous SGD would not. What to do:

* scale the local learning rate by ``1/N`` relative to ``DataParallelSGD`` at the
  same global batch (the usual starting point; :func:`scaled_lr`);
* ramp the learning rate up over the first ``lr_warmup`` samples from
  ``lr_warmup_start`` of its value (CNTK's ``AdjustLearningRateAtBeginning``):
  the first updates, when the model changes fastest and staleness hurts most,
  are small;
* or divide each update by its staleness (``staleness_aware=True``; Zhang et al.
  2016, "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016),
  which is close to ``1/N`` at equal speeds and adapts when speeds differ;
* bound the staleness (``staleness_bound``): a worker more than that many pushes
  ahead of the slowest active worker waits (the stale synchronous parallel model
  of Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous
  Parallel Parameter Server", NIPS 2013).

Staleness also acts like extra momentum (Mitliagkas et al. 2016, "Asynchrony
begets momentum, with an application to deep learning"): with the local
optimizer's momentum on top, long sync periods become unstable. Measured on
MNIST-1D (4 workers, momentum 0.9, ``lr / 4``): pushing after every step or
every 2 steps reached DataParallelSGD's accuracy, every 4 steps diverged; lower
the local momentum, or the period, when that happens.

Recht et al. 2011 ("Hogwild!", NIPS 2011) show that lock-free asynchronous SGD
converges at nearly the serial rate when updates are sparse and the delay is
bounded; dense neural-network updates are not sparse, which is why the step
size and the staleness matter here.

Units. ``sync_period`` is in samples *per worker* (CNTK's ``syncPeriod``);
``lr_warmup`` is in samples of all workers together, as this worker knows them:
the server's count at its last pull plus its own samples since.

Where the server runs (``server="rank0"``). Rank 0 hosts the server beside its
own worker. Rank 0's worker pushes and pulls by calling the server in-process
(no bytes on the wire); every other worker ``w`` talks to the server over a
two-rank gloo process group ``[0, w]`` of its own, created collectively in
:meth:`AsyncSGD.setup` (:func:`bunsan.comm.p2p.new_pair_groups`).

Threads. On rank 0 one daemon thread per remote worker serves that worker: it
receives the worker's push, applies it under the server's lock, and sends the
current model back. Each thread is the only user of its pair group on rank 0,
and the worker's main thread the only user on the worker, so no process group
is ever used by two threads at once; rank 0's main thread never touches the
pair groups, and the server threads never touch ``group`` (the main thread's
collectives in :meth:`AsyncSGD.join` and :meth:`AsyncSGD.sync_replicas`). The
threads are daemons: they never keep a process alive.

Messages. One message each way per synchronization: a ``uint8`` buffer holding
a 32-byte header (four int64: kind, a count, samples, spare) and the parameters'
bytes, grouped by dtype. Worker to server: ``PUSH`` or ``DONE`` (the last push,
sent by :meth:`AsyncSGD.join`) with the update. Server to worker: ``REPLY`` with
the global model, ``FINAL`` with the final model once every worker is done,
``WAIT`` (a keep-alive while the server holds a reply back, every ``timeout_s /
4``; the worker receives again), or ``ABORT`` (another worker failed).

Failures. A worker that dies closes its connections, and the server thread that
serves it fails at once; a worker that falls silent for ``timeout_s`` fails it
too. The server then answers every other worker ``ABORT`` and rank 0's worker
raises :class:`bunsan.errors.CommunicationError` naming the failed rank at its
next step; under ``bunsan run`` the failure watch (:mod:`bunsan.comm.group`)
then ends the whole job. A dead server (rank 0) closes its connections and every
worker's pending receive raises.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
import warnings
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan.algorithms.base import Algorithm
from bunsan.comm import Traffic, barrier, broadcast_tensors, get_rank, get_world_size, global_rank, p2p
from bunsan.errors import CheckpointError, CommunicationError, ConfigurationError

__all__ = [
    "ARRIVALS_KEPT",
    "AsyncSGD",
    "ParameterServer",
    "lr_warmup_factor",
    "may_proceed",
    "scaled_lr",
    "staleness_scale",
]

# Message kinds: header[0].
PUSH, DONE, REPLY, WAIT, FINAL, ABORT = 1, 2, 3, 4, 5, 6
_KIND_NAMES = {PUSH: "PUSH", DONE: "DONE", REPLY: "REPLY", WAIT: "WAIT", FINAL: "FINAL", ABORT: "ABORT"}
_HEADER_BYTES = 32  # four int64
_ALIGN = 16  # every dtype's segment starts at a multiple of this many bytes
_LOCAL_POLL_S = 0.5  # rank 0's worker re-checks for failures this often while held back
ARRIVALS_KEPT = 10_000  # the server remembers this many recent arrivals (about 1 MB); counts cover all


# -- pure arithmetic ----------------------------------------------------------------
def lr_warmup_factor(samples: float, warmup: int, start: float) -> float:
    """The learning-rate multiplier after ``samples`` global samples: ``start`` rising linearly to 1 at ``warmup``.

    ``warmup = 0`` means no ramp (always 1). CNTK's ``AdjustLearningRateAtBeginning``
    ramps the same way, from a small fraction of the rate to all of it.
    """
    if warmup <= 0 or samples >= warmup:
        return 1.0
    return start + (1.0 - start) * max(float(samples), 0.0) / warmup


def staleness_scale(staleness: int) -> float:
    """The weight of an update that is ``staleness`` server updates old: ``1 / max(staleness, 1)``.

    Zhang et al. 2016 divide the learning rate by the staleness; a fresh update
    (staleness 0) is applied in full, as one of staleness 1.
    """
    return 1.0 / max(int(staleness), 1)


def may_proceed(worker: int, pushes: Mapping[int, int], done: Collection[int], bound: int | None) -> bool:
    """Whether ``worker`` may have its reply: at most ``bound`` pushes ahead of the slowest active worker.

    Workers in ``done`` have finished and do not hold anyone back. ``bound=None``
    means no bound. The slowest worker always proceeds, so waiting cannot deadlock.
    """
    if bound is None:
        return True
    active = [count for w, count in pushes.items() if w not in done]
    if not active:
        return True
    return pushes[worker] - min(active) <= bound


def scaled_lr(lr: float, world_size: int) -> float:
    """The local learning rate that makes ``world_size`` asynchronous workers step like one synchronous SGD.

    ``DataParallelSGD`` at learning rate ``lr`` moves the model once per global
    batch; AsyncSGD applies every worker's update in full, so ``lr / world_size``
    moves it about as far per sample (see the module docstring).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return lr / world_size


# -- the message layout ---------------------------------------------------------------
@dataclass
class _Segment:
    """The parameters of one (dtype, device), laid out one after another in a message."""

    dtype: torch.dtype
    names: list[str]
    params: list[Tensor]
    offsets: list[int]  # element offset of each parameter in the segment
    numel: int
    start: int  # byte offset of the segment in the message
    nbytes: int


class _Layout:
    """Where each parameter's values lie in a message (the same on every rank)."""

    def __init__(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, Tensor]]] = {}
        for name, p in named_params:
            by_kind.setdefault((p.dtype, p.device), []).append((name, p))
        self.segments: list[_Segment] = []
        position = _HEADER_BYTES
        # Sorted by a key every rank computes alike, so every rank lays messages out the same way.
        for (dtype, _), members in sorted(by_kind.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
            offsets, total = [], 0
            for _, p in members:
                offsets.append(total)
                total += p.numel()
            nbytes = total * torch.empty((), dtype=dtype).element_size()
            self.segments.append(
                _Segment(dtype, [n for n, _ in members], [p for _, p in members], offsets, total, position, nbytes)
            )
            position += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = position

    def message(self) -> Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    @staticmethod
    def header(message: Tensor) -> Tensor:
        return message[:_HEADER_BYTES].view(torch.int64)

    def views(self, message: Tensor) -> list[Tensor]:
        """One flat typed view of ``message`` per segment."""
        return [message[s.start : s.start + s.nbytes].view(s.dtype) for s in self.segments]

    @torch.no_grad()
    def gather(self, views: Sequence[Tensor]) -> None:
        """Copy the parameters into ``views``, in place."""
        for s, flat in zip(self.segments, views):
            for p, offset in zip(s.params, s.offsets):
                flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))

    @torch.no_grad()
    def scatter(self, views: Sequence[Tensor]) -> None:
        """Copy ``views`` into the parameters, in place."""
        for s, flat in zip(self.segments, views):
            for p, offset in zip(s.params, s.offsets):
                p.copy_(flat[offset : offset + p.numel()].view_as(p))

    def named(self, views: Sequence[Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for s, flat in zip(self.segments, views):
            for name, p, offset in zip(s.names, s.params, s.offsets):
                out[name] = flat[offset : offset + p.numel()].view(p.shape).clone()
        return out

    @torch.no_grad()
    def load_named(self, views: Sequence[Tensor], saved: Mapping[str, Tensor], what: str) -> None:
        """Copy ``saved`` (by parameter name) into ``views``; raise CheckpointError if it is another model's."""
        for s, flat in zip(self.segments, views):
            for name, p, offset in zip(s.names, s.params, s.offsets):
                if name not in saved:
                    raise CheckpointError(
                        f"the checkpoint's {what} has no parameter {name!r}: it is from another model"
                    )
                if tuple(saved[name].shape) != tuple(p.shape):
                    raise CheckpointError(
                        f"the checkpoint's {what}[{name!r}] has shape {list(saved[name].shape)}, the model's "
                        f"parameter has {list(p.shape)}: it is from another model"
                    )
                flat[offset : offset + p.numel()].copy_(saved[name].reshape(-1))


def _payload(message: Tensor) -> Tensor:
    return message[_HEADER_BYTES:]


# -- the server -----------------------------------------------------------------------
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
        layout: _Layout,
        workers: Sequence[int],
        channels: Mapping[int, ProcessGroup],
        *,
        staleness_bound: int | None,
        staleness_aware: bool,
        timeout_s: float,
        arrivals_kept: int = ARRIVALS_KEPT,
    ) -> None:
        if arrivals_kept < 1:
            raise ValueError(f"arrivals_kept must be >= 1, got {arrivals_kept}")
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
        _payload(message).copy_(_payload(self.model))
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
                self.cond.wait(timeout=_LOCAL_POLL_S)

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
                    raise CommunicationError(f"unexpected message {_KIND_NAMES.get(kind, kind)} from rank {worker}")
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


# -- argument checks ------------------------------------------------------------------
def _check_count(name: str, value: Any, minimum: int, hint: str, unit: str = "samples") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int number of {unit}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {hint}")
    return int(value)


# -- the algorithm ------------------------------------------------------------------
class AsyncSGD(Algorithm):
    """Asynchronous data-parallel SGD with a parameter server (CNTK's DataParallelASGD).

    Each worker trains locally and, every ``sync_period`` samples, pushes its
    accumulated update (its model minus the model it last pulled) to the server
    and pulls the current global model, without waiting for the other workers.
    The server on rank 0 applies the updates in arrival order, ``W = W + u``. See
    the module docstring for the learning rate (use about ``lr / N`` of
    ``DataParallelSGD``'s, or ``lr_warmup``, or ``staleness_aware``), threads,
    messages and failures.

    Ending training. Call ``optimizer.join()`` (:meth:`join`) on every rank after
    the training loop: the worker pushes its last partial update and tells the
    server it is done; the server keeps serving the others until every worker is
    done, then every rank receives the final global model. Uneven data is fine:
    a worker that runs out early simply waits in ``join()`` (keep-alives keep its
    wait from timing out). Afterwards every replica equals the server's model.
    A script that forgets it is joined by :func:`bunsan.finalize` (or at
    interpreter exit): rank 0 must not leave while its server threads still wait
    in gloo receives, which ended the process in ``std::terminate`` (exit 134).
    ``optimizer.sync_replicas()`` (:meth:`sync_replicas`) gives every replica the
    same global model in the middle of training (for an evaluation); every rank
    must call it, and none may have joined.

    Counts: ``samples`` is the server's global count at this worker's last pull
    plus this worker's samples since; ``step`` and ``local_samples`` are this
    worker's. On rank 0, :attr:`server` is the :class:`ParameterServer` and
    :attr:`arrivals` the applied updates in arrival order.

    Args:
        sync_period: samples per worker between two push/pulls (CNTK's
            ``syncPeriod``); a worker pushes after the first step that brings it
            to ``sync_period`` samples since its last push, so the default 1 (or
            anything up to the minibatch) pushes and pulls after every step. Longer
            periods send less but make updates staler: on MNIST-1D with momentum
            0.9, 4 local steps per push diverged where 1 and 2 did not
            (``bunsan.bench.async_bench``).
        staleness_bound: a worker more than this many pushes ahead of the slowest
            worker still training waits for it; ``None`` (default): never wait.
            ``0`` keeps the workers in lock step.
        staleness_aware: divide each update by its staleness, the number of server
            updates since the worker's last pull (Zhang et al. 2016).
        lr_warmup: global samples over which the learning rate ramps linearly from
            ``lr_warmup_start`` of its value up to all of it; 0 (default): no ramp.
            Needs the local optimizer (:func:`bunsan.distribute` attaches it).
        lr_warmup_start: the fraction of the learning rate the ramp starts from, in (0, 1].
        server: where the server runs; ``"rank0"`` (beside rank 0's worker) is the
            only placement implemented.
        timeout_s: how long the server waits for a worker's next message and a
            worker for the server's answer (keep-alives every quarter of it keep
            legitimate waits alive). A crash is seen at once (closed connections).
        group: process group of the workers; ``None`` (every rank of the job) is
            required, because the server's channels are created by every rank.

    Raises:
        TypeError: ``sync_period`` or ``lr_warmup`` is not an int, ...
        ValueError: an argument is out of range (the message names it).

    Example:
        >>> algorithm = bunsan.AsyncSGD(lr_warmup=4000)       # push and pull after every step
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.05 / bunsan.size(), momentum=0.9)
        >>> model, optimizer = bunsan.distribute(model, optimizer, algorithm)
        >>> for x, y in loader: ...                         # the usual loop
        >>> optimizer.join()                                # every rank: the server's final model after
    """

    name = "async"

    def __init__(
        self,
        sync_period: int = 1,
        *,
        staleness_bound: int | None = None,
        staleness_aware: bool = False,
        lr_warmup: int = 0,
        lr_warmup_start: float = 0.1,
        server: str = "rank0",
        timeout_s: float = 1800.0,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(group=group)
        self.sync_period = _check_count(
            "sync_period", sync_period, 1, "it is the samples per worker between two pushes; 1 pushes after every step"
        )
        if staleness_bound is not None:
            staleness_bound = _check_count(
                "staleness_bound",
                staleness_bound,
                0,
                "None means no bound, 0 keeps the workers in lock step",
                unit="pushes",
            )
        self.staleness_bound = staleness_bound
        if not isinstance(staleness_aware, bool):
            raise TypeError(f"staleness_aware must be True or False, got {staleness_aware!r}")
        self.staleness_aware = staleness_aware
        self.lr_warmup = _check_count("lr_warmup", lr_warmup, 0, "0 turns the learning-rate ramp off")
        if not isinstance(lr_warmup_start, numbers.Real) or not 0.0 < lr_warmup_start <= 1.0:
            raise ValueError(
                f"lr_warmup_start must be in (0, 1], the fraction of the learning rate the ramp "
                f"starts from, got {lr_warmup_start!r}"
            )
        self.lr_warmup_start = float(lr_warmup_start)
        if server != "rank0":
            raise ValueError(
                f"server must be 'rank0' (the server runs on rank 0 beside its worker), got {server!r}; "
                "dedicated server ranks are not implemented"
            )
        self.server_placement = server
        if not isinstance(timeout_s, numbers.Real) or not timeout_s > 0 or not math.isfinite(timeout_s):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)

        self.sync_samples = 0  # local samples since the last push
        self.sync_steps = 0
        self.pushes = 0
        self.pulls = 0
        self.keepalives = 0  # WAIT messages received while held back or waiting at the end
        self.sync_s = 0.0  # time spent in push/pull, waits included
        self.server_version = 0  # the server's update count at the last pull
        self.server: ParameterServer | None = None
        self._layout: _Layout | None = None
        self._channels: dict[int, ProcessGroup] = {}
        self._server_rank = 0
        self._rank = 0
        self._message: Tensor | None = None  # outgoing update (and, on rank 0, the pulled model)
        self._reply: Tensor | None = None
        self._base: Tensor | None = None  # the model at the last pull, in message layout
        self._begun = False
        self._base_loaded = False
        self._server_loaded = False
        self._joined = False
        self._checked_first_step = False
        self._saved_lrs: list[Any] | None = None
        self.lr_scale = 1.0

    def __repr__(self) -> str:
        return (
            f"AsyncSGD(sync_period={self.sync_period}, staleness_bound={self.staleness_bound}, "
            f"staleness_aware={self.staleness_aware}, lr_warmup={self.lr_warmup}, "
            f"lr_warmup_start={self.lr_warmup_start}, server={self.server_placement!r})"
        )

    # -- set-up ---------------------------------------------------------------------
    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        """Lay out the messages and create the server's channels. Collective over every rank of the job."""
        super().setup(named_params)
        n = self.world_size
        if self.group is not None and n != get_world_size(None):
            raise ConfigurationError(
                f"AsyncSGD needs group=None: its server channels are created by every rank of the job, "
                f"and the given group has {n} of {get_world_size(None)} ranks"
            )
        self._layout = _Layout(self.named_params)
        self._message, self._reply, self._base = (self._layout.message() for _ in range(3))
        self._rank = get_rank()
        self._server_rank = global_rank(self.group, 0)
        workers = [global_rank(self.group, r) for r in range(n)]
        if n > 1:
            self._channels = p2p.new_pair_groups(self._server_rank, workers, timeout_s=self.timeout_s)
        if self._rank == self._server_rank:
            self.server = ParameterServer(
                self._layout,
                workers,
                {w: g for w, g in self._channels.items() if w != self._rank},
                staleness_bound=self.staleness_bound,
                staleness_aware=self.staleness_aware,
                timeout_s=self.timeout_s,
            )

    def _begin(self) -> None:
        """At the first step: the model now is the start (after any checkpoint the user loaded).

        On rank 0 the server takes its model and opens; a remote worker's first
        push waits in the channel until then.
        """
        if self._begun:
            return
        layout = self._require_setup()
        if not self._base_loaded:
            layout.gather(layout.views(self._base))
        if self.server is not None:
            if not self._server_loaded:
                self.server.load_model()
            self.server.start()
        self._begun = True

    def _require_setup(self) -> _Layout:
        if self._layout is None:
            raise RuntimeError("AsyncSGD is not set up: build it with bunsan.distribute(model, optimizer, algorithm)")
        return self._layout

    # -- hooks ------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Local. Nothing is exchanged per step; scales the learning rate during the ramp."""
        self._begin()
        if self._joined:
            raise RuntimeError("this worker has joined: AsyncSGD cannot train after optimizer.join()")
        if self.lr_warmup and not self._checked_first_step and self.optimizer is None:
            raise RuntimeError(
                "AsyncSGD(lr_warmup=...) scales the local optimizer's learning rate: build it with "
                "bunsan.distribute(model, optimizer, algorithm), or call algorithm.attach_optimizer(optimizer)"
            )
        self.lr_scale = lr_warmup_factor(self.samples, self.lr_warmup, self.lr_warmup_start)
        if self.lr_scale < 1.0 and self.optimizer is not None:
            self._saved_lrs = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * self.lr_scale

    def _restore_lr(self) -> None:
        if self._saved_lrs is not None and self.optimizer is not None:
            for g, lr in zip(self.optimizer.param_groups, self._saved_lrs):
                g["lr"] = lr
        self._saved_lrs = None

    def after_step(self) -> None:
        """Not collective. Every ``sync_period`` samples: push the update, pull the global model."""
        self._begin()
        self._restore_lr()
        n = self._take_local_samples()
        if not self._checked_first_step:
            self._checked_first_step = True
            if n == 0:
                warnings.warn(
                    "no training samples were counted in this step, but AsyncSGD pushes after sync_period samples: "
                    "use bunsan.distribute() (it counts the model's inputs) or call algorithm.count_samples(n)",
                    stacklevel=3,
                )
        self.samples += n
        self.sync_samples += n
        self.sync_steps += 1
        if self.server is not None:
            with self.server.cond:
                self.server.check()  # a remote worker failed: say so now, not at the end
        if self.sync_samples >= self.sync_period:
            self._exchange(final=False)

    @torch.no_grad()
    def _exchange(self, *, final: bool) -> None:
        """Push this worker's update; pull the model (with ``final``: the final one, once all are done)."""
        layout = self._require_setup()
        start = time.perf_counter()
        message = self._message
        update = layout.views(message)
        layout.gather(update)
        for u, b in zip(update, layout.views(self._base)):
            u.sub_(b)
        samples = self.sync_samples
        self.pushes += 1
        if self.server is not None:
            self.server.push_local(self._rank, update, samples, done=final)
            self.server.pull_local(self._rank, message, final=final)
            reply = message
        else:
            header = layout.header(message)
            header[0], header[1], header[2], header[3] = DONE if final else PUSH, self.pushes, samples, 0
            channel = self._channels[self._rank]
            p2p.send(message, self._server_rank, group=channel, traffic=self.traffic)
            reply = self._await(FINAL if final else REPLY, channel)
        self._accept(reply)
        self.sync_samples = self.sync_steps = 0
        self.sync_s += time.perf_counter() - start

    def _await(self, expected: int, channel: ProcessGroup) -> Tensor:
        layout = self._require_setup()
        reply = self._reply
        while True:
            p2p.recv(reply, self._server_rank, group=channel, traffic=self.traffic)
            kind = int(layout.header(reply)[0])
            if kind == expected:
                return reply
            if kind == WAIT:
                self.keepalives += 1
                continue
            if kind == ABORT:
                failed = int(layout.header(reply)[1])
                who = f"worker rank {failed}" if failed >= 0 else "a worker"
                raise CommunicationError(
                    f"the parameter server on rank {self._server_rank} stopped because {who} failed; see its error"
                )
            raise CommunicationError(
                f"expected {_KIND_NAMES[expected]} from the parameter server on rank {self._server_rank}, "
                f"got {_KIND_NAMES.get(kind, kind)}"
            )

    def _accept(self, reply: Tensor) -> None:
        """The pulled model becomes the replica and the base of the next update."""
        layout = self._require_setup()
        _, version, samples, _ = layout.header(reply).tolist()
        layout.scatter(layout.views(reply))
        _payload(self._base).copy_(_payload(reply))
        self.server_version, self.samples = int(version), int(samples)
        self.pulls += 1

    def join(self) -> None:
        """Collective. Push the last partial update, wait until every worker is done, take the final model.

        The server keeps serving the other workers meanwhile. When it returns on
        every rank, every replica equals the server's final model.
        """
        if self._joined:
            return
        self._begin()
        self._restore_lr()
        self._exchange(final=True)
        if self.server is not None:
            self.server.finish()
        self._joined = True
        barrier(self.group)  # every rank has its final model: the channels may close
        for channel in self._channels.values():
            p2p.destroy_group(channel)
        self._channels = {}

    @torch.no_grad()
    def sync_replicas(self) -> None:
        """Collective. Every replica takes the current global model (all ranks, none joined).

        Each worker pushes what it has; after a barrier (so every push is applied)
        rank 0 broadcasts the server's model.
        """
        if self._joined:
            return
        layout = self._require_setup()
        self._begin()
        self._exchange(final=False)
        if self.world_size == 1:
            return  # the pull above already gave the global model
        barrier(self.group)
        if self.server is not None:
            with self.server.cond:
                layout.scatter(layout.views(self.server.model))
                self.samples = self.server.samples
            self.server.mark_all_pulled()
        broadcast_tensors(self.params, src=self._server_rank, group=self.group, traffic=self.traffic)
        layout.gather(layout.views(self._base))

    # -- measurement and state ------------------------------------------------------
    @property
    def arrivals(self) -> list[tuple[int, int, int]]:
        """On rank 0, the recent applied updates in arrival order as ``(worker rank, push number, staleness)``.

        At most :data:`ARRIVALS_KEPT` (the oldest are dropped); ``stats()`` counts every update.
        """
        return self.server.arrivals if self.server is not None else []

    def stats(self) -> dict[str, float]:
        """This rank's counted traffic, the server's included on rank 0, and the push/pull counts."""
        out = super().stats()
        server = self.server.traffic if self.server is not None else Traffic()
        sent = self.traffic.sent + server.sent
        out.update(
            bytes_sent=sent,
            bytes_received=self.traffic.received + server.received,
            bytes_sent_per_step=sent / max(self.step, 1),
            bytes_sent_per_sample=sent / max(self.local_samples, 1),
            collectives=self.traffic.calls + server.calls,
            pushes=self.pushes,
            pulls=self.pulls,
            keepalives=self.keepalives,
            sync_s=self.sync_s,
            server_version=self.server_version,
        )
        if self.server is not None:
            with self.server.cond:
                version = self.server.version
                out.update(
                    server_updates=version,
                    server_samples=self.server.samples,
                    server_bytes_sent=server.sent,
                    server_bytes_received=server.received,
                    mean_staleness=self.server.staleness_sum / max(version, 1),
                    max_staleness=self.server.staleness_max,
                    held_back=self.server.held_back,
                )
        return out

    def state_dict(self) -> dict[str, Any]:
        """This worker's counts and pulled model; on rank 0 also the server's model and counts."""
        state = super().state_dict()
        state.update(
            sync_period=self.sync_period,
            staleness_bound=self.staleness_bound,
            sync_samples=self.sync_samples,
            sync_steps=self.sync_steps,
            pushes=self.pushes,
            pulls=self.pulls,
            server_version=self.server_version,
            begun=self._begun or self._base_loaded,
        )
        if state["begun"] and self._layout is not None:
            state["base"] = self._layout.named(self._layout.views(self._base))
        if self.server is not None and (self._begun or self._server_loaded):
            state["server"] = self.server.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; load it after :func:`bunsan.distribute`, before training."""
        super().load_state_dict(state)
        self.sync_samples = int(state["sync_samples"])
        self.sync_steps = int(state["sync_steps"])
        self.pushes = int(state["pushes"])
        self.pulls = int(state["pulls"])
        self.server_version = int(state["server_version"])
        if not state.get("begun"):
            return
        if self._layout is None:
            raise CheckpointError("load the algorithm's state after bunsan.distribute() has set it up")
        self._layout.load_named(self._layout.views(self._base), state["base"], "pulled model")
        self._base_loaded = True
        if self.server is not None and "server" in state:
            self.server.load_state_dict(state["server"])
            self._server_loaded = True
