"""The optimizer of an elastic job: exact data-parallel SGD whose step commits only if every member's exchange did.

``step()`` averages the gradients over the step's members (weighted by each member's part of the global
batch, so that the result is the gradient of the global batch's mean loss whatever the membership), asks the
quorum whether every exchange went through, and only then steps the wrapped optimizer. A step that did not
commit changes nothing (parameters, optimizer state, the loaders' positions): the next quorum does it again
(docs/explanation/elastic.md). The arithmetic is :class:`bunsan.DataParallelSGD`'s exact all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bunsan._delegate import init_optimizer_hooks, optimizer_attribute
from bunsan.elastic.member import Member

__all__ = ["ElasticOptimizer"]


class ElasticOptimizer(torch.optim.Optimizer):
    """``optimizer`` made elastic-data-parallel over ``model``'s parameters (module docstring).

    A joining worker receives ``model``'s state and ``optimizer``'s from a live peer. ``committed`` says
    whether the last ``step()`` counted.
    """

    param_groups = optimizer_attribute("param_groups")
    state = optimizer_attribute("state")
    defaults = optimizer_attribute("defaults")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, member: Member) -> None:
        self.optimizer, self.model, self.member = optimizer, model, member
        self.committed = False
        init_optimizer_hooks(self)
        member.register(member.unique_name("model"), model.state_dict, model.load_state_dict)
        member.register(member.unique_name("optimizer"), optimizer.state_dict, optimizer.load_state_dict)

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

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
        self.member.begin_step()  # a loop that feeds its own batches: the step's quorum starts here
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._average_gradients()
        self.committed = self.member.commit()
        if not self.committed:
            return None
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self.optimizer!r})"
