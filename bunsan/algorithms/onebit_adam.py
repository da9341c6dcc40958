"""Adam and AdamW under quantized data parallelism: exact warm-up, then frozen variance.

Adam cannot simply be handed a quantized average gradient: its second moment
``v`` is a nonlinear function of the gradient, so the error that quantization
and error feedback push from one step to the next inflates ``v`` and the
delayed remainders are then divided by the wrong scale. 1-bit Adam (Tang et
al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed") observed that ``v`` settles early in training and splits
training in two stages:

1. warm-up: plain Adam with exact averaging (``DataParallelSGD``'s
   ``warm_start``), so that ``v`` is estimated from exact gradients;
2. compression: ``v`` is frozen; each worker takes Adam's momentum step on its
   own gradient, ``m_i = beta1 * m_i + (1 - beta1) * g_i``, the momenta are
   averaged through the quantized exchange with error feedback, and every
   replica applies ``x -= lr * mean(m_i) / (1 - beta1^t) / (sqrt(v_hat) + eps)``
   (AdamW first multiplies ``x`` by ``1 - lr * weight_decay``, Adam adds
   ``weight_decay * x`` to ``g_i``). With the variance frozen the update is
   linear in the momentum, so error feedback is as sound as for momentum SGD.

One change from the paper: what is quantized is not ``m_i`` but the update
direction ``m_i / (sqrt(v_hat) + eps)``, the same linear map on every rank. Adam
gives every coordinate a step of about the same size, so these values share one
scale, which a chunk's two reconstruction values fit; a raw momentum mixes
coordinates of very different scales in one chunk, and the small ones, whose
``1 / sqrt(v_hat)`` is large, get an error of the chunk's size multiplied by it.
Measured on the transformer of docs/experiments/transformer_onebit_adam.py (see
docs/experiments/design-notes.md, "1-bit Adam").

0/1 Adam (Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam") freezes ``v`` at the end of the learning-rate warm-up,
which needs no tuning: that is this module's advice for ``warm_start``. Users of
DeepSpeed's implementation reported divergence when the freeze came too early
(e.g. deepspeedai/DeepSpeed issues about ``freeze_step``): with no warm start at
all ``v`` would be zero and the first compressed step would divide by ``eps``.
So with ``warm_start=0`` the warm-up defaults to the variance's own time
constant, ``ceil(1 / (1 - beta2))`` steps (1000 for beta2 = 0.999, 50 for 0.98).

``v_hat`` is the bias-corrected variance at the freeze, ``v / (1 - beta2^t0)``;
the correction ``1 - beta2^t0`` is kept in the optimizer's per-parameter state
(``"frozen_variance_correction"``), so it goes into the optimizer's checkpoint.
During the compression stage the torch optimizer does not run on these
parameters (their ``grad`` is hidden from it for the step); this module updates
``exp_avg`` (to the averaged momentum), ``step`` and the parameters, and leaves
``exp_avg_sq`` as it was at the freeze.

Pure tensor arithmetic; the exchange is DataParallelSGD's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["CORRECTION_KEY", "FrozenVarianceAdam", "is_adam", "warm_up_steps"]

CORRECTION_KEY = "frozen_variance_correction"


def is_adam(optimizer: Any) -> bool:
    """True for ``torch.optim.Adam`` and ``torch.optim.AdamW`` (and their subclasses)."""
    return isinstance(optimizer, torch.optim.Adam)


def warm_up_steps(optimizer: torch.optim.Optimizer) -> int:
    """The default exact warm-up: the variance's time constant, ``ceil(1 / (1 - beta2))`` steps."""
    beta2 = max(float(group["betas"][1]) for group in optimizer.param_groups)
    return max(1, math.ceil(1.0 / (1.0 - beta2))) if beta2 < 1 else 1


def _decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


class FrozenVarianceAdam:
    """The compression stage of 1-bit Adam for one torch Adam/AdamW optimizer.

    ``momentum_step`` runs on each worker before compression; ``hide`` before the
    torch optimizer's step (so it skips these parameters); ``apply`` after it,
    with the averaged momenta back in ``p.grad``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not is_adam(optimizer):
            raise TypeError(f"FrozenVarianceAdam serves torch.optim.Adam / AdamW, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        # sqrt(v_hat) + eps per parameter, frozen; with the variance tensor it came from, so that a
        # loaded optimizer state (new tensors) is read again.
        self._denominators: dict[Tensor, tuple[Tensor, Tensor]] = {}
        self._hidden: list[tuple[Tensor, Tensor]] = []

    def denominator(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """``sqrt(v_hat) + eps`` of ``p``, frozen at its first call (the end of the warm-up)."""
        state = self.optimizer.state.get(p, {})
        if "exp_avg_sq" not in state:
            raise RuntimeError(
                "the compressed Adam stage started before Adam had updated this parameter: give DataParallelSGD "
                "a warm_start long enough for every parameter to get a gradient"
            )
        if CORRECTION_KEY not in state:  # the freeze: the variance as it is now, bias-corrected
            state[CORRECTION_KEY] = 1.0 - float(group["betas"][1]) ** float(state["step"])
        variance = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
        source, value = self._denominators.get(p, (None, None))
        if source is not variance or value is None:
            value = (variance / state[CORRECTION_KEY]).sqrt_().add_(group["eps"])
            self._denominators[p] = (variance, value)
        return value

    def momentum_step(
        self,
        buf: Tensor | None,
        out: Tensor,
        p: Tensor,
        grad: Tensor,
        group: dict[str, Any],
        cap: float | None = None,
    ) -> Tensor:
        """This worker's Adam momentum, preconditioned: returns ``m_i / (sqrt(v_hat) + eps)``.

        ``m_i = beta1 * m_i + (1 - beta1) * d``, with ``d`` the gradient (negated
        under ``maximize``, plus ``weight_decay * p`` for Adam's L2 form), written into
        ``out`` (``buf``, the committed ``m_i``, is only read: the caller commits ``out``
        once the step's exchange is known to be finite). The first time (``buf`` None),
        ``m_i`` continues from the optimizer's ``exp_avg``, which the exact warm-up made
        equal on every rank. What travels is the momentum divided by the frozen
        denominator, the update itself: its coordinates share one scale, which is what
        a chunk's two means fit, whereas a raw momentum's small coordinates would get
        the chunk's error at their own, tiny, scale and have it multiplied by their
        large ``1 / sqrt(v_hat)``. The map is linear and the same on every rank, so
        error feedback in these coordinates loses nothing. ``cap``: the workers'
        ``beta1`` at most (Adam's momentum averages, so the steady value is kept
        whatever ``beta1`` is).
        """
        d = -grad if group["maximize"] else grad
        if group["weight_decay"] and not _decoupled(self.optimizer, group):
            d = d.add(p.detach(), alpha=group["weight_decay"])
        beta1 = float(group["betas"][0]) if cap is None else min(float(group["betas"][0]), cap)
        if buf is None:
            held = self.optimizer.state.get(p, {}).get("exp_avg")
            buf = held.detach() if held is not None else torch.zeros_like(p, dtype=torch.float32)
        torch.mul(buf, beta1, out=out).add_(d, alpha=1 - beta1)
        return out / self.denominator(p, group)

    def hide(self, params: list[Tensor]) -> None:
        """Take ``p.grad`` away from the torch optimizer for this step (it skips a parameter without one)."""
        self._hidden = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in self._hidden:
            p.grad = None

    def apply(self) -> None:
        """The frozen-variance update of every hidden parameter from its averaged update direction; in place.

        ``p.grad`` holds the mean over workers of ``m_i / (sqrt(v_hat) + eps)``.
        """
        groups = {p: g for g in self.optimizer.param_groups for p in g["params"]}
        hidden, self._hidden = self._hidden, []
        with torch.no_grad():
            for p, averaged in hidden:
                p.grad = averaged  # visible again, e.g. to logging after the step
                group = groups[p]
                state = self.optimizer.state[p]
                beta1 = float(group["betas"][0])
                lr = float(group["lr"])
                step = state["step"]
                t = float(step) + 1
                if group["weight_decay"] and _decoupled(self.optimizer, group):
                    p.mul_(1 - lr * group["weight_decay"])
                p.add_(averaged, alpha=-lr / (1 - beta1**t))
                torch.mul(averaged, self.denominator(p, group), out=state["exp_avg"])  # the mean momentum
                if isinstance(step, Tensor):
                    step.add_(1)
                else:
                    state["step"] = step + 1
