"""Quantized SGD in an elastic job: 1-16-bit exchange with error feedback and local momentum, step by step.

:class:`bunsan.DataParallelSGD` with ``bits < 32`` quantizes what each worker sends and keeps what the
quantization dropped as a residual for the next step (error feedback, Seide et al. 2014; Strom 2015); with
SGD momentum each worker applies the momentum to its own gradient before it is quantized, at most
``quantized_momentum`` with the gradient scaled so that the steady step ``lr / (1 - momentum)`` is kept
(local momentum, Zheng et al. 2019; docs/explanation/quantized.md). In an elastic job the same arithmetic
runs as one transaction per step (:class:`~bunsan.elastic.optimizer.ElasticOptimizer`): each member's
payload is gathered by every member and decoded in quorum-rank order, so every replica applies the same
mean; the new residual and worker momentum are kept only if the step commits, so a dropped step leaves
them as they were. What changes with the membership:

* a member that dies takes its residual with it: at most one step's quantization error of its part of
  the global batch, never a sample;
* a member that joins starts with a zero residual (it has sent nothing) and takes the job's momentum
  (the mean the last committed step applied) as its own;
* the exchange is one all-gather of the payloads (one quantization stage), where a fixed group's is two
  stages by stripes: ``members`` payloads received per step instead of two, which is small at the sizes
  elastic jobs run.

Between ``backward()`` and ``step()``, ``p.grad`` shows the mean gradient the update came from, so
clipping and ``GradScaler`` act on a gradient; ``step()`` runs the momentum recursion on what the loop left
there, with the optimizer's own momentum and weight decay held at zero for the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from bunsan.compression import DEFAULT_CHUNK_SIZE, Quantizer
from bunsan.compression.rotation import ROTATED_CHUNK_SIZE, RotatedQuantizer
from bunsan.elastic.member import Member
from bunsan.elastic.optimizer import ElasticOptimizer

__all__ = ["ElasticQuantizedOptimizer"]


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.SGD):
        raise NotImplementedError(
            f"an elastic job (bunsan run --min-np) quantizes with torch.optim.SGD for now, not "
            f"{type(optimizer).__name__} (1-bit Adam is not elastic yet); use bits=32, or drop --min-np"
        )
    for group in optimizer.param_groups:
        if group.get("nesterov") or group.get("maximize"):
            raise NotImplementedError(
                "an elastic job (bunsan run --min-np) quantizes SGD without nesterov or maximize for now"
            )


class ElasticQuantizedOptimizer(ElasticOptimizer):
    """``optimizer`` (SGD) exchanging ``bits``-bit gradients in an elastic job (module docstring).

    Args:
        algorithm: the :class:`bunsan.DataParallelSGD` whose ``bits``, ``rotate``, ``error_feedback``,
            ``local_momentum`` and ``quantized_momentum`` are used.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, member: Member, algorithm: Any) -> None:
        _check_optimizer(optimizer)
        super().__init__(model, optimizer, member)
        self.algorithm = algorithm
        rotate = bool(algorithm.rotate)
        self.quantizer = RotatedQuantizer(algorithm.bits, ROTATED_CHUNK_SIZE) if rotate else None
        self.plain = Quantizer(algorithm.bits, DEFAULT_CHUNK_SIZE)
        self.local_momentum = bool(algorithm.local_momentum)
        self.cap = algorithm.quantized_momentum  # None: the optimizer's momentum, uncapped
        self._group_of: dict[Tensor, dict[str, Any]] = {}
        self.residuals: dict[int, Tensor] = {}  # by parameter index, float32, committed
        self.worker_momentum: dict[int, Tensor] = {}  # this member's, committed
        self.job_momentum: dict[int, Tensor] = {}  # the mean the last committed step applied, on every member
        self._pending: tuple[dict[int, Tensor], dict[int, Tensor]] | None = None
        member.register(member.unique_name("quantized"), self._joiner_state, self._load_joiner_state)

    def _joiner_state(self) -> dict[str, Any]:
        return {"momentum": self.job_momentum}

    def _load_joiner_state(self, state: dict[str, Any]) -> None:
        self.job_momentum = {int(i): t.clone() for i, t in state["momentum"].items()}
        self.worker_momentum = {i: t.clone() for i, t in self.job_momentum.items()}
        self.residuals, self._pending = {}, None

    def _refresh_groups(self) -> None:
        """``p -> its param group``, read again each step: ``optimizer.load_state_dict`` (a joiner's heal)
        replaces the group dicts."""
        self._group_of = {p: g for g in self.optimizer.param_groups for p in g["params"]}

    def _local(self, p: Tensor) -> tuple[float, float, float] | None:
        """``(applied momentum, keep, weight decay)`` if this member applies ``p``'s momentum itself."""
        group = self._group_of[p]
        beta = float(group["momentum"])
        if not self.local_momentum or beta == 0:
            return None
        applied = beta if self.cap is None else min(beta, self.cap)
        return applied, (1 - applied) / (1 - beta) * (1 - float(group["dampening"])), float(group["weight_decay"])

    def _average_gradients(self) -> None:
        """Quantize each member's momentum (or gradient) with its residual, gather, decode the mean into
        ``p.grad`` in gradient units; the new residuals and momentum wait for the commit."""
        self._refresh_groups()
        params = self._parameters()
        sent = []
        momentum: dict[int, Tensor] = {}
        for i, p in enumerate(params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            local = self._local(p)
            if local is None:
                sent.append(g.detach().float().reshape(-1))
                continue
            applied, keep, decay = local
            d = g.detach().float() + decay * p.detach().float() if decay else g.detach().float()
            old = self.worker_momentum.get(i)
            momentum[i] = d * keep if old is None else old * applied + d * keep
            sent.append(momentum[i].reshape(-1))
        flat = torch.cat(sent) if sent else torch.zeros(0)
        flat.mul_(self.member.share)
        residual = self.residuals.get(-1)
        residual = torch.zeros_like(flat) if residual is None or not self.algorithm.error_feedback else residual.clone()
        codec = self.quantizer or self.plain
        payload = codec.encode_with_feedback(flat, residual)
        gathered = self.member.allgather(payload)
        mean = torch.zeros_like(flat)
        for each in gathered:  # quorum-rank order: the same sum on every member
            mean.add_(codec.decode(each, flat.numel()))
        mean.div_(len(gathered))
        self._pending = (momentum, {-1: residual})
        self._show_gradients(params, mean)

    @torch.no_grad()
    def _show_gradients(self, params: list[Tensor], mean: Tensor) -> None:
        offset = 0
        for i, p in enumerate(params):
            values = mean[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            local = self._local(p)
            if local is not None:  # the mean momentum back to the gradient it came from
                applied, keep, decay = local
                previous = self.job_momentum.get(i)
                values = (values - previous * applied if previous is not None else values) / keep
                if decay:
                    values = values - decay * p.float()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(values)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Commit or drop the step (:class:`ElasticOptimizer`); on a commit, step along the momentum the
        loop's ``p.grad`` gives, with the optimizer's momentum and weight decay held at zero."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._averaged:
            self.member.begin_step()
            self._average_gradients()
        self._averaged = False
        self.committed = self.member.commit()
        pending, self._pending = self._pending, None
        if not self.committed or pending is None:
            return None
        momentum, residuals = pending
        self.residuals.update(residuals)
        self._refresh_groups()
        held = []
        for i, p in enumerate(self._parameters()):
            local = self._local(p)
            if local is None or p.grad is None:
                continue
            applied, keep, decay = local
            d = p.grad.float() + decay * p.float() if decay else p.grad.float()
            previous = self.job_momentum.get(i)
            self.job_momentum[i] = d * keep if previous is None else previous * applied + d * keep
            self.worker_momentum[i] = momentum[i]
            p.grad.copy_(self.job_momentum[i])
            held.append(self._group_of[p])
        saved = [(g, g["momentum"], g["weight_decay"]) for g in {id(g): g for g in held}.values()]
        for group, _, _ in saved:
            group["momentum"], group["weight_decay"] = 0.0, 0.0
        try:
            self.optimizer.step()
        finally:
            for group, beta, decay in saved:
                group["momentum"], group["weight_decay"] = beta, decay
        return loss

    def __repr__(self) -> str:
        return f"ElasticQuantizedOptimizer({self.algorithm!r}, {self.optimizer!r})"
