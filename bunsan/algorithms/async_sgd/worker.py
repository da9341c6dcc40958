"""The worker side of asynchronous SGD: :class:`AsyncSGD`, the algorithm a rank runs."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_choice, check_int, check_number, check_type
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
from bunsan.algorithms.async_sgd.rules import lr_warmup_factor
from bunsan.algorithms.async_sgd.server import ParameterServer
from bunsan.algorithms.base import Algorithm
from bunsan.comm import Traffic, barrier, broadcast_tensors, get_rank, get_world_size, global_rank, p2p
from bunsan.errors import CheckpointError, CommunicationError, ConfigurationError

__all__ = ["AsyncSGD"]


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
            periods send less but make updates staler, which with heavy local
            momentum can diverge (docs/explanation/block-algorithms.md).
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
        self.sync_period: int = check_int(
            "sync_period",
            sync_period,
            minimum=1,
            hint="samples per worker between two pushes; 1 pushes after every step",
        )
        self.staleness_bound: int | None = check_int(
            "staleness_bound",
            staleness_bound,
            minimum=0,
            allow_none=True,
            hint="pushes; None means no bound, 0 keeps the workers in lock step",
        )
        self.staleness_aware: bool = check_type("staleness_aware", staleness_aware, bool)
        self.lr_warmup: int = check_int(
            "lr_warmup", lr_warmup, minimum=0, hint="global samples; 0 turns the learning-rate ramp off"
        )
        self.lr_warmup_start: float = check_number(
            "lr_warmup_start",
            lr_warmup_start,
            minimum=0.0,
            maximum=1.0,
            min_inclusive=False,
            hint="the fraction of the learning rate the ramp starts from",
        )
        self.server_placement: str = check_choice(
            "server",
            server,
            ("rank0",),
            hint="the server runs on rank 0 beside its worker; dedicated server ranks are not implemented",
        )
        self.timeout_s: float = check_number("timeout_s", timeout_s, minimum=0.0, min_inclusive=False, hint="seconds")

        self.sync_samples = 0  # local samples since the last push
        self.sync_steps = 0
        self.pushes = 0
        self.pulls = 0
        self.keepalives = 0  # WAIT messages received while held back or waiting at the end
        self.sync_s = 0.0  # time spent in push/pull, waits included
        self.server_version = 0  # the server's update count at the last pull
        self.server: ParameterServer | None = None
        self._layout: MessageLayout | None = None
        self._channels: dict[int, ProcessGroup] = {}
        self._server_rank = 0
        self._rank = 0
        # Set up by setup(): the outgoing update (and, on rank 0, the pulled model), the
        # incoming reply, and the model at the last pull, all in message layout.
        self._message = self._reply = self._base = torch.empty(0, dtype=torch.uint8)
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
        self._layout = MessageLayout(self.named_params)
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

    def _require_setup(self) -> MessageLayout:
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
                f"expected {KIND_NAMES[expected]} from the parameter server on rank {self._server_rank}, "
                f"got {KIND_NAMES.get(kind, kind)}"
            )

    def _accept(self, reply: Tensor) -> None:
        """The pulled model becomes the replica and the base of the next update."""
        layout = self._require_setup()
        _, version, samples, _ = layout.header(reply).tolist()
        layout.scatter(layout.views(reply))
        payload(self._base).copy_(payload(reply))
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
