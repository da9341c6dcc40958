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

A wrapper that switches algorithms during training (:class:`~bunsan.algorithms.auto.Auto`) uses
the public lifecycle only, as Bagua's ``Algorithm``/``AlgorithmImpl`` pair does: it sets
:attr:`Algorithm.observer` to an :class:`Observer`, whose named callbacks the algorithm calls at
the same points on every rank (before and after a gradient exchange, at the end of a block
round with its timings), and it replaces one algorithm by another with :meth:`Algorithm.hand_over`,
which carries the counters, the samples of the step under way and, where asked, the mean of the
ranks' optimizer states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan import comm
from bunsan.algorithms.buffers import BufferSync
from bunsan.comm import Traffic, get_world_size
from bunsan.errors import CheckpointError

__all__ = ["Algorithm", "Observer", "RoundReport", "average_optimizer_state_"]


@dataclass(frozen=True)
class RoundReport:
    """The end of a block round, as every rank sees it (:meth:`Observer.after_round`)."""

    seconds: float  # this rank's whole round: its passes over the parameters and its all-reduces, waits included
    active: int  # ranks still training after it
    # the observer's values (Observer.report_values) summed over the ranks; None where the round was made
    # by a rank's sync_replicas() (between steps: nothing to act on) or carried no report
    sums: tuple[float, ...] | None = None


class Observer:
    """The named callbacks an algorithm gives a wrapper that drives it (:attr:`Algorithm.observer`).

    Every callback is called at the same point on every rank, so an observer may run collectives
    where it says so. The defaults do nothing; an algorithm calls those that apply to it.
    """

    def holds_exchange(self) -> bool:
        """Whether the coming gradient exchange waits for the end of backward and calls
        :meth:`before_exchange` before its first collective (asked once a step)."""
        return False

    def before_exchange(self) -> bool:
        """At the end of backward, before the exchange's first collective (collective where
        :meth:`holds_exchange` said so). True: the algorithm was replaced (:meth:`Algorithm.hand_over`),
        and its successor takes this step's gradients; no exchange runs."""
        return False

    def after_exchange(self, seconds: float) -> None:
        """Local: a gradient exchange ended; ``seconds`` this rank spent completing it after backward."""

    def report_width(self) -> int:
        """How many values this rank adds to the coming block round's counts (the same on every rank)."""
        return 0

    def report_values(self) -> Sequence[float] | None:
        """This rank's values for the coming round (``report_width`` of them), or ``None`` for zeros."""
        return None

    def after_round(self, report: RoundReport) -> None:
        """Every rank, at the end of each block round, joined ranks included: its timings and the report's sums."""


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
        self.observer: Observer | None = None  # a wrapper's callbacks (the lifecycle above)

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

    # -- lifecycle: replacing this algorithm by another ------------------------------
    def release(self) -> None:
        """Stop acting on this rank's gradients (remove hooks): a successor takes over."""

    def hand_over(self, successor: Algorithm, *, mid_step: bool = False, average_optimizer_state: bool = False) -> None:
        """``successor`` replaces this algorithm from now on, at the same step on every rank (collective
        with ``average_optimizer_state``): it takes the counters (steps, samples); with ``mid_step`` also
        the samples of the step under way, whose backward ran but whose exchange will not
        (:meth:`Observer.before_exchange`), and those counted but not yet part of a step, so that they
        count as the successor's. With ``average_optimizer_state`` every rank's optimizer state becomes
        the ranks' mean (a block algorithm's local steps made them differ; an exact successor needs them
        equal). This algorithm is released; the successor still needs :meth:`setup` and the rest."""
        if average_optimizer_state:
            average_optimizer_state_(self.optimizer, self.params, self.group)
        self.release()
        self.observer = None
        successor.step, successor.samples, successor.local_samples = self.step, self.samples, self.local_samples
        if mid_step:
            taken = self._take_back_round()
            successor.local_samples -= taken
            successor._pending_samples += taken + self._pending_samples
            successor._unconfirmed_samples += self._unconfirmed_samples
            self._pending_samples = self._unconfirmed_samples = 0

    def _take_back_round(self) -> int:
        """The samples that the step under way took for its exchange, which will not run (0 if none)."""
        return 0

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


@torch.no_grad()
def average_optimizer_state_(
    optimizer: torch.optim.Optimizer | None, params: Sequence[Tensor], group: ProcessGroup | None
) -> None:
    """Collective: every rank's floating-point optimizer state tensors of ``params`` (SGD's momentum,
    Adam's moments and its step count) become their mean over the ranks that hold them, and a rank
    that lacks one (a parameter its local steps never reached: a layer only some ranks' forward uses)
    takes that mean too, so that exact steps after it update every replica alike (without the step
    count a rank's Adam would start that parameter's moments over). Where ranks stepped a parameter
    unequally often, the step count is their mean, and its bias correction follows it."""
    if optimizer is None:
        return
    index = {id(p): i for i, p in enumerate(params)}
    mine = sorted(
        (index[id(p)], key, tuple(value.shape), str(value.dtype), str(value.device))
        for p, state in optimizer.state.items()
        if id(p) in index
        for key, value in state.items()
        if torch.is_tensor(value) and value.is_floating_point()
    )
    holders: dict[tuple[int, str, tuple[int, ...], str, str], int] = {}
    for entries in comm.all_gather_object(mine, group=group):
        for entry in set(entries):
            holders[entry] = holders.get(entry, 0) + 1
    by_dtype: dict[str, list[tuple[int, str, tuple[int, ...], str, str]]] = {}
    for entry in sorted(holders):
        by_dtype.setdefault(entry[3], []).append(entry)
    device = comm.tensor_device(group)  # where the backend moves tensors (a CPU step count on NCCL too)
    for name, entries in by_dtype.items():
        held = [optimizer.state[params[i]].get(key) for i, key, *_ in entries]
        fits = [torch.is_tensor(h) and tuple(h.shape) == shape for h, (_, _, shape, *_) in zip(held, entries)]
        dtype = getattr(torch, name.removeprefix("torch."))  # the same on every rank, held or not
        flat = torch.cat(
            [
                (h.reshape(-1) if ok else torch.zeros(shape).reshape(-1)).to(device=device, dtype=dtype)
                for h, ok, (_, _, shape, *_) in zip(held, fits, entries)
            ]
        )
        comm.all_reduce(flat, group=group)
        offset = 0
        for h, ok, entry in zip(held, fits, entries):
            i, key, shape, _, where = entry
            numel = int(torch.Size(shape).numel())
            mean = flat[offset : offset + numel].view(shape) / holders[entry]
            offset += numel
            if ok:
                h.copy_(mean)
            else:
                optimizer.state[params[i]][key] = mean.to(torch.device(where)).clone()
