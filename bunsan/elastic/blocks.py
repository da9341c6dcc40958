"""Block algorithms in an elastic job: a block is one step of the quorum, committed or done again whole.

:class:`bunsan.BlockMomentumSGD` (BMUF, Chen & Huo 2016) and :class:`bunsan.ModelAveragingSGD` train locally
for a block of ``block_size`` samples per worker, then filter the workers' average model change into the
global model ``W`` with the block momentum ``D`` (:mod:`bunsan.algorithms.bmuf`). In an elastic job the quorum
is taken at the start of each block, so the block's members train their parts of the same global batches as
an exact job would cut them (:class:`~bunsan.elastic.loader.ElasticLoader`), and the block ends in one
exchange of the members' model changes, each weighted by its part of the block's samples. That exchange is
the step's commit: when every member's went through, ``W``, ``D`` and the next block's start move on and
the loaders' positions with them; when a member died during the block, the survivors go back to the block's
start (model, buffers, their optimizer's state) and the next quorum trains the block again without it.
Nothing of a block is ever half applied; a dead worker costs at most the block in flight
(docs/explanation/elastic.md).

The filter is the one the job would use at its starting size ``N`` (``-np``): the global batch, hence the
samples of a block, do not change with the membership, so neither do the block momentum and the block
learning rate. A block ends at the end of its loader's epoch too, as a shorter block (its momentum scaled as
:func:`~bunsan.algorithms.bmuf.scaled_block_momentum` says). A worker that joins receives ``W``, ``D``, the
block's start and the optimizer's state as they were at the block's start, from a live peer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bunsan._delegate import init_optimizer_hooks
from bunsan.algorithms.blockwise import BlockwiseSGD
from bunsan.algorithms.bmuf import (
    block_gain,
    default_block_learning_rate,
    default_block_momentum,
    reset_momentum_buffers,
    scaled_block_momentum,
    update_block_start_,
    update_global_model_,
)
from bunsan.elastic.member import Member
from bunsan.elastic.optimizer import WrappedOptimizer

__all__ = ["ElasticBlockOptimizer", "block_filter", "distribute"]


def distribute(
    model: nn.Module, optimizer: torch.optim.Optimizer, member: Member, algorithm: BlockwiseSGD
) -> ElasticBlockOptimizer:
    """:func:`bunsan.distribute` of a block algorithm in an elastic job (module docstring)."""
    if algorithm.warm_start:
        raise NotImplementedError(
            f"an elastic job (bunsan run --min-np) runs {type(algorithm).__name__} without a warm start for "
            f"now; drop warm_start={algorithm.warm_start}, or drop --min-np to use it"
        )
    return ElasticBlockOptimizer(model, optimizer, member, algorithm)


def block_filter(algorithm: BlockwiseSGD, workers: int) -> Callable[[float], tuple[float, float]]:
    """``samples_per_worker -> (bm, zeta)`` of ``algorithm`` at ``workers`` workers (the job's starting size)."""
    if type(algorithm).__name__ == "ModelAveragingSGD":
        return lambda samples: (0.0, 1.0)
    requested_bm = getattr(algorithm, "requested_block_momentum", None)
    requested_lr = getattr(algorithm, "requested_block_learning_rate", None)
    momentum = default_block_momentum(workers) if requested_bm is None else requested_bm
    rate = default_block_learning_rate(workers) if requested_lr is None else requested_lr

    def coefficients(samples: float) -> tuple[float, float]:
        bm = scaled_block_momentum(momentum, algorithm.block_size, samples) if momentum else 0.0
        return bm, block_gain(bm, workers, rate)

    return coefficients


class ElasticBlockOptimizer(WrappedOptimizer):
    """``optimizer`` trained locally in blocks of ``algorithm`` over ``model`` in an elastic job (module docstring).

    Between ``backward()`` and ``step()``, ``p.grad`` is this worker's own gradient, as with the block
    algorithms outside an elastic job. ``committed`` says whether the last ``step()`` ended a block that counted.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, member: Member, algorithm: BlockwiseSGD):
        self.optimizer, self.model, self.member, self.algorithm = optimizer, model, member, algorithm
        self.committed = False
        self.blocks = 0  # block ends that committed
        self._filter = block_filter(algorithm, member.start_size)
        # the Nesterov look-ahead W + bm * D takes the full block's momentum (BlockwiseSGD's rule)
        self._lookahead = self._filter(float(algorithm.block_size))[0] if algorithm.nesterov else 0.0
        init_optimizer_hooks(self)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad():
            self.start = [p.detach().clone() for p in self._params]
            self.global_model = [p.detach().clone() for p in self._params]
            self.momentum = [torch.zeros_like(p) for p in self._params]
            self.start_buffers = [b.detach().clone() for b in self._buffers]
        self._optimizer_start = copy.deepcopy(optimizer.state_dict())
        member.register(member.unique_name("block"), self.state_dict_for_joiner, self.load_state_for_joiner)
        member.on_flush(self._end_block)

    # -- the state a joiner receives: the block's start, which no local step changes ---------------------------
    def state_dict_for_joiner(self) -> dict[str, Any]:
        """``W``, ``D``, the block's start (parameters, buffers, the optimizer's state) and the blocks so far."""
        return {
            "start": self.start,
            "global_model": self.global_model,
            "momentum": self.momentum,
            "buffers": self.start_buffers,
            "optimizer": self._optimizer_start,
            "blocks": self.blocks,
        }

    @torch.no_grad()
    def load_state_for_joiner(self, state: dict[str, Any]) -> None:
        """Start the block where the live peer started it."""
        for mine, theirs in zip(
            (self.start, self.global_model, self.momentum, self.start_buffers),
            (state["start"], state["global_model"], state["momentum"], state["buffers"]),
            strict=True,
        ):
            if len(mine) != len(theirs):
                raise ValueError("the live peer's model has other parameters or buffers than this worker's")
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b)
        self._optimizer_start = copy.deepcopy(state["optimizer"])
        self.blocks = int(state["blocks"])
        self._restart_block()

    # -- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """A local step of ``optimizer``; at the block's end (``block_size`` samples per worker at the job's
        starting size), the members' exchange. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.member.begin_step()  # a loop that feeds its own batches: the block's quorum starts here
        self.optimizer.step()
        self.committed = False
        if self.member.step_samples == 0:
            raise RuntimeError(
                "a block algorithm in an elastic job counts its block in the samples that bunsan.data.loader "
                "hands out: train on the loader's batches"
            )
        if self.member.step_samples >= self.algorithm.block_size * self.member.start_size:
            self._end_block()
        return loss

    def join(self) -> None:
        """End the block in flight (the loop's data ended before it): afterwards every replica is equal."""
        self.member.flush()

    sync_replicas = join

    @torch.no_grad()
    def _end_block(self) -> None:
        samples = self.member.step_samples
        share = self.member.share
        changes = [p.detach() - s for p, s in zip(self._params, self.start, strict=True)]
        buffers = [b.detach().clone() for b in self._buffers]
        sent = changes + buffers
        if share != 1.0:
            for t in sent:
                t.mul_(share)
        self.member.allreduce_mean(sent)  # the members' changes, each weighted by its part of the block
        self.committed = self.member.commit()
        if self.committed:
            bm, gain = self._filter(samples / self.member.start_size)
            for w, d, g, s in zip(self.global_model, self.momentum, changes, self.start, strict=True):
                update_global_model_(w, d, g, bm, gain)
                update_block_start_(s, w, d, self._lookahead, self.algorithm.nesterov)
            for start, mean in zip(self.start_buffers, buffers, strict=True):
                start.copy_(mean)
            if self.algorithm.reset_local_momentum:
                reset_momentum_buffers(self.optimizer)
            self._optimizer_start = copy.deepcopy(self.optimizer.state_dict())
            self.blocks += 1
        self._restart_block()

    @torch.no_grad()
    def _restart_block(self) -> None:
        """Every parameter, buffer and the optimizer's state as at the (new or dropped) block's start."""
        for p, s in zip(self._params, self.start, strict=True):
            p.copy_(s)
        for b, s in zip(self._buffers, self.start_buffers, strict=True):
            b.copy_(s)
        if not self.committed:  # the state as at the block's start; the hyperparameters as they are now
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            self.optimizer.load_state_dict(copy.deepcopy(self._optimizer_start))
            for group, values in zip(self.optimizer.param_groups, hyper, strict=True):
                group.update(values)

    def __repr__(self) -> str:
        return f"ElasticBlockOptimizer({self.algorithm!r}, {self.optimizer!r})"
