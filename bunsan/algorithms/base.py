"""The interface every data-parallel algorithm implements.

An algorithm is driven by :class:`bunsan.optim.DistributedOptimizer`. For every
optimizer step the wrapper calls, in this order::

    algorithm.reduce_gradients()   # in optimizer.step(), after loss.backward()
    optimizer.step()               # the user's own torch optimizer
    algorithm.after_step()
    algorithm.step += 1

Both hooks are *collective*: every rank of ``group`` calls them the same number
of times. Algorithms that average gradients do it *during* backward: per-parameter
hooks start the exchange as gradients become ready and a callback queued on the
autograd engine completes it before ``loss.backward()`` returns, so whatever the
user puts between backward and step (clipping, ``GradScaler.unscale_``) sees the
global average; ``reduce_gradients`` then only runs an exchange that no backward
started on this rank (a rank whose backward reached none of the parameters).
Each algorithm overrides what it needs:

================  ===============================  ==================================
algorithm         during backward                  ``after_step``
================  ===============================  ==================================
exact / N-bit     average (quantized) gradients    nothing
model averaging   only during warm start           average parameters every block
block momentum    only during warm start           block update every block
asynchronous      nothing                          push update, pull model (p2p)
================  ===============================  ==================================

Two more collectives end training cleanly: :meth:`join`, called by a rank that
has run out of data (it keeps answering the others' synchronizations until every
rank has joined), and :meth:`sync_replicas`, which brings every replica to the
same model now (block algorithms have a partial block to finish).

Buffers (BatchNorm running statistics) are averaged over the ranks whenever the
replicas' parameters are made equal: every step for gradient averaging, every
block for the block algorithms (:mod:`bunsan.algorithms.buffers`).

Samples are counted for the algorithm by the model's forward pre-hook that
:func:`bunsan.distribute` installs (leading dimension of the first input);
``samples`` is the global count, all ranks together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan.algorithms.buffers import BufferSync
from bunsan.comm import Traffic, get_world_size
from bunsan.errors import CheckpointError

__all__ = ["Algorithm"]


class Algorithm:
    """Base class of bunsan's data-parallel training algorithms.

    Args:
        group: process group to work in; ``None`` means every rank of the job.
    """

    name: ClassVar[str] = ""  # registry key, also the ``--algorithm`` value

    def __init__(self, *, group: ProcessGroup | None = None) -> None:
        self.group = group
        self.step = 0  # completed optimizer steps
        self.samples = 0  # global samples trained so far, all ranks together
        self.local_samples = 0  # samples this rank has trained
        self.traffic = Traffic()
        self.named_params: list[tuple[str, Tensor]] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending_samples = 0  # counted in forward, not yet part of a step
        self._unconfirmed_samples = 0  # train-mode forwards whose output no backward has reached yet
        self.buffer_sync: BufferSync | None = None  # set by setup_buffers()

    # -- set-up -----------------------------------------------------------------
    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        """Called once by :func:`bunsan.distribute` with the trainable parameters."""
        self.named_params = list(named_params)

    def setup_buffers(self, modules: Sequence[tuple[str, Any, list[str]]]) -> None:
        """Called once by :func:`bunsan.distribute` with the modules whose buffers stay equal across ranks."""
        self.buffer_sync = BufferSync(modules, self.group, self.traffic) if modules else None

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once by :func:`bunsan.distribute` with the user's (unwrapped) optimizer.

        Algorithms that touch the optimizer's state (resetting local momentum after
        a block synchronization) use ``self.optimizer``.
        """
        self.optimizer = optimizer

    @property
    def params(self) -> list[Tensor]:
        return [p for _, p in self.named_params]

    @property
    def world_size(self) -> int:
        return get_world_size(self.group)

    def count_samples(self, n: int) -> None:
        """Record ``n`` local training samples of a forward pass that leads to this step."""
        self._pending_samples += int(n)

    def note_forward(self, n: int) -> None:
        """Record a train-mode forward of ``n`` samples not yet known to lead to this step.

        :func:`bunsan.distribute`'s hooks call it at every forward and confirm it
        (:meth:`count_samples`) when a backward reaches the forward's output. If a
        step confirmed nothing (a loss computed from an intermediate tensor, not from
        the model's output), the unconfirmed forwards count instead.
        """
        self._unconfirmed_samples += int(n)

    def confirm_forward(self, n: int) -> None:
        """A noted forward's output was back-propagated: its samples belong to this step."""
        self._unconfirmed_samples = max(0, self._unconfirmed_samples - int(n))
        self.count_samples(n)

    def _take_local_samples(self) -> int:
        n = self._pending_samples or self._unconfirmed_samples
        self._pending_samples = self._unconfirmed_samples = 0
        self.local_samples += n
        return n

    # -- collective hooks -----------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Collective. Replace each local ``p.grad`` by the gradient the optimizer applies."""

    def after_step(self) -> None:
        """Collective. Synchronize parameters after the local optimizer update."""

    def join(self) -> None:
        """Collective. This rank has no more data: take part in the others' syncs until all join."""

    def complete_exchange(self) -> None:
        """Collective. Finish a gradient exchange that is still pending (none is, after backward)."""

    def sync_replicas(self) -> None:
        """Collective. Bring every replica to the same model now."""

    def set_gradient_sync(self, enabled: bool) -> None:
        """Whether the next backward exchanges gradients (DDP's ``require_backward_grad_sync``)."""
        if enabled:
            self.end_accumulation()
        else:
            self.begin_accumulation()

    def begin_accumulation(self) -> None:
        """Gradients of the next backward passes must not be communicated yet (``no_sync``)."""

    def end_accumulation(self) -> None:
        """Undo :meth:`begin_accumulation`."""

    # -- measurement and state ------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counted traffic of this rank: bytes per step and per sample, collectives."""
        steps = max(self.step, 1)
        samples = max(self.local_samples, 1)
        return {
            "steps": self.step,
            "samples": self.samples,
            "local_samples": self.local_samples,
            "bytes_sent": self.traffic.sent,
            "bytes_received": self.traffic.received,
            "bytes_sent_per_step": self.traffic.sent / steps,
            "bytes_sent_per_sample": self.traffic.sent / samples,
            "collectives": self.traffic.calls,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (this rank's part)."""
        return {
            "algorithm": self.name,
            "world_size": self.world_size,
            "step": self.step,
            "samples": self.samples,
            "local_samples": self.local_samples,
        }

    def _check_state_is_mine(self, state: dict[str, Any]) -> None:
        """Raise :class:`CheckpointError` unless ``state`` was saved by an algorithm of this name."""
        if state.get("algorithm") != self.name:
            raise CheckpointError(
                f"the state is of algorithm {state.get('algorithm')!r}, not {self.name!r}: "
                "load it into the algorithm that saved it"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state_is_mine(state)
        self.step = int(state["step"])
        self.samples = int(state["samples"])
        self.local_samples = int(state["local_samples"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
