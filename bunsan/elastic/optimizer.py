"""The optimizer of an elastic job: exact data-parallel SGD whose step commits only if every member's exchange did.

As with :class:`bunsan.DataParallelSGD`, the gradients are averaged before ``backward()`` returns, so what a
loop does between backward and step (clipping, ``GradScaler.unscale_``, logging a norm) sees the average:
the members' gradients, each weighted by its part of the global batch, which makes the result the gradient
of the global batch's mean loss whatever the membership. ``step()`` then asks the quorum whether every
member's exchange went through, and only then steps the wrapped optimizer. A step that did not commit
changes nothing (parameters, optimizer state, the loaders' positions): the next quorum does it again
(docs/explanation/elastic.md). Backward passes inside :meth:`ElasticOptimizer.no_sync` send nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from bunsan._delegate import init_optimizer_hooks, optimizer_attribute
from bunsan.elastic.member import Member

__all__ = ["ElasticOptimizer", "WrappedOptimizer"]


class WrappedOptimizer(torch.optim.Optimizer):
    """What the elastic optimizers share: the wrapped ``self.optimizer``'s groups, state and state dict."""

    optimizer: torch.optim.Optimizer
    param_groups = optimizer_attribute("param_groups")
    state = optimizer_attribute("state")
    defaults = optimizer_attribute("defaults")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)


class ElasticOptimizer(WrappedOptimizer):
    """``optimizer`` made elastic-data-parallel over ``model``'s parameters (module docstring).

    A joining worker receives ``model``'s state and ``optimizer``'s from a live peer. ``committed`` says
    whether the last ``step()`` counted.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, member: Member) -> None:
        self.optimizer, self.model, self.member = optimizer, model, member
        self.committed = False
        self._queued = self._averaged = self._accumulating = False
        init_optimizer_hooks(self)
        for p in self._parameters():
            p.register_post_accumulate_grad_hook(self._on_grad)
        member.register(member.unique_name("model"), model.state_dict, model.load_state_dict)
        member.register(member.unique_name("optimizer"), optimizer.state_dict, optimizer.load_state_dict)

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def _on_grad(self, _: torch.Tensor) -> None:
        if not self._queued and not self._accumulating:  # once per backward, after its last gradient
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._queued = False
        self.committed = False  # until step() commits: a step GradScaler skips never does
        self.member.begin_step()  # a loop that feeds its own batches: the step's quorum starts here
        self._average_gradients()
        self._averaged = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside send nothing; the last one, outside, sends."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _average_gradients(self) -> None:
        """Each member's gradient times its share, averaged over the members: one buffer per dtype and device."""
        params = self._parameters()
        for p in params:
            if p.grad is None:  # unused here, maybe used by another member: it must take part all the same
                p.grad = torch.zeros_like(p)
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            assert p.grad is not None
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        flats = [torch.cat([g.reshape(-1) for g in grads]) for grads in buckets.values()]
        share = self.member.share
        if share != 1.0:
            for flat in flats:
                flat.mul_(share)
        self.member.allreduce_mean(flats)
        for grads, flat in zip(buckets.values(), flats, strict=True):
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Average the gradients over the step's members; step ``optimizer`` if the quorum commits the step.

        Returns the closure's loss, or ``None`` for a dropped step (``committed`` is then False)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._averaged:  # no backward since the last step (or all of them inside no_sync)
            self.member.begin_step()
            self._average_gradients()
        self._averaged = False
        self.committed = self.member.commit()
        if not self.committed:
            return None
        self.optimizer.step()
        return loss

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self.optimizer!r})"
