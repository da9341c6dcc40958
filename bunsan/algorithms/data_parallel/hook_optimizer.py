"""Local momentum and 1-bit Adam for :func:`~bunsan.algorithms.data_parallel.ddp_hook.quantized_hook`.

A DDP communication hook sees gradients, not the optimizer, so on its own it quantizes the
plain gradient and the optimizer's momentum acts after the exchange. DataParallelSGD's
local momentum takes the momentum step on each worker *before* compression and hands the
optimizer the averaged result with its momentum and weight decay set to zero for that
step (Zheng et al. 2019, "Communication-Efficient Distributed Blockwise Momentum SGD with
Error-Feedback"), so that error feedback corrects the transmitted momentum itself; with
Adam/AdamW the same place holds 1-bit Adam's frozen-variance momentum (Tang et al. 2021,
"1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed").
:class:`HookOptimizer` pairs the hook with the optimizer for that, as 1-bit Adam pairs an
optimizer with its engine::

    state = QuantizedHookState(ddp_model, bits=1, total_steps=steps)
    ddp_model.register_comm_hook(state, quantized_hook)
    optimizer = HookOptimizer(torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9), state)

The arithmetic is DataParallelSGD's own (:class:`~bunsan.algorithms.data_parallel.momentum.LocalMomentum`,
with its momentum cap :func:`~bunsan.algorithms.data_parallel.momentum.default_quantized_momentum`):

* before a quantized bucket is encoded, each worker's momentum step on its own gradient
  goes into the bucket (divided by the world size), written into a spare buffer;
* once every rank's exchange is known finite (the hook's agreement at the last bucket), the
  spare buffers are committed, and the decoded mean is turned back into gradient units, so
  that clipping and ``GradScaler.unscale_`` between backward and ``step()`` act on a
  gradient; a step with an inf or NaN on any rank drops them, and the momentum stays as it
  was, as the residuals do;
* ``step()`` runs the recursion forward on what the user left in ``p.grad`` and lets the
  optimizer step along it with momentum and weight decay held at zero (1-bit Adam: the
  frozen-variance update instead).

During the exact warm-up the optimizer runs as it is, with its own momentum, as under DDP.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from bunsan._delegate import init_optimizer_hooks, optimizer_attribute
from bunsan._validate import check_choice, check_number, check_type
from bunsan.algorithms.data_parallel.buckets import Bucket
from bunsan.algorithms.data_parallel.ddp_hook import QuantizedHookState
from bunsan.algorithms.data_parallel.momentum import LocalMomentum, default_quantized_momentum
from bunsan.algorithms.onebit_adam import FrozenVarianceAdam, is_adam
from bunsan.comm import get_world_size
from bunsan.compression.rotation import ROTATED_CHUNK_SIZE, RotatedQuantizer
from bunsan.errors import CheckpointError

__all__ = ["HookOptimizer"]


class _WorkerMomentum(LocalMomentum):
    """DataParallelSGD's local momentum driven by the hook: what :class:`HookOptimizer` attaches to the state.

    An :class:`~bunsan.algorithms.base.Algorithm` only so as to be a
    :class:`~bunsan.algorithms.data_parallel.momentum.LocalMomentum`; it takes part in no
    exchange of its own.
    """

    name = "hook_local_momentum"

    def __init__(self, optimizer: torch.optim.Optimizer, state: QuantizedHookState, cap: float | None) -> None:
        super().__init__(group=state.group)
        self.optimizer = optimizer
        self.named_params = [(name, p) for p, name in state._names.items()]
        self._name_of = dict(state._names)
        self.quantizing = False
        self.local_momentum = True
        self.quantized_momentum = cap
        self._adam = FrozenVarianceAdam(optimizer) if is_adam(optimizer) else None
        self._quantizer = state._quantizer
        self._momentum = {}
        self._momentum_pending = {}
        self._momentum_spare = {}
        self._in_gradient_units = []
        self._shown = []
        self._unit_samples = None
        self._warned_rebase = False
        self._buckets = []  # this step's quantized buckets, their slots over DDP's buffers
        self._hook_state = state
        self._group_of = {}
        self._held = []
        self.converted = False  # the last exchange was quantized and finite: p.grad is in gradient units

    # -- called by quantized_hook ------------------------------------------------------
    def before_encode(self, bucket: Bucket, buffer: Tensor, n: int) -> None:
        """This worker's momentum step for every parameter of ``buffer`` (DDP's bucket), divided by ``n``."""
        if not self._hook_state._pending:  # the step's first bucket (a step that raised left nothing either)
            self.quantizing = True
            self.converted = False
            self._in_gradient_units, self._unit_samples, self._buckets = [], None, []
        slots = bucket.views(buffer)
        for p, slot in zip(bucket.params, slots, strict=True):
            group = self._momentum_group(p)
            if group is None:
                slot.div_(n)
            else:
                self._momentum_step(p, slot, group, slot, n)  # reads the gradient, then writes over it
        self._buckets.append(dataclasses.replace(bucket, buffer=buffer, slots=slots, indices=list(range(len(slots)))))

    def after_exchange(self, finite: bool) -> None:
        """At the hook's last bucket, the same ``finite`` on every rank: commit or drop this step's momentum,
        and put the decoded mean into gradient units before DDP copies it into ``p.grad``."""
        self._settle_momentum(finite)
        if finite:
            self._to_gradient_units([1.0] * max((len(b.params) for b in self._buckets), default=0))
            slot_of = {p: s for b in self._buckets for p, s in zip(b.params, b.slots, strict=True)}
            if self._in_gradient_units:
                self._sample_gradient_units([slot_of[p] for p, _ in self._in_gradient_units])
        self.converted = finite
        self.quantizing = False
        self._buckets = []

    # -- called by HookOptimizer.step() ----------------------------------------------
    def reduce_gradients(self) -> None:
        if self.converted:
            self.converted = False
            self._from_gradient_units()  # after the user's clipping or unscaling
            self._hold_momentum()  # the workers applied momentum before compression

    def after_step(self) -> None:
        self._release_momentum()
        if self._adam is not None:
            self._adam.apply()

    def state_dict(self) -> dict[str, Any]:
        return {"local_momentum": {k: v.detach().clone() for k, v in self._momentum.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._momentum = {k: v.detach().clone() for k, v in state.get("local_momentum", {}).items()}
        self._momentum_pending.clear()
        self._momentum_spare.clear()
        self.converted = False


class HookOptimizer(torch.optim.Optimizer):
    """An SGD or Adam/AdamW optimizer paired with :func:`quantized_hook`: local momentum, 1-bit Adam.

    With ``torch.optim.SGD`` (momentum, weight decay, dampening, Nesterov, maximize) it is
    ``DataParallelSGD(bits=b)``'s local momentum (Zheng et al. 2019, "Communication-Efficient
    Distributed Blockwise Momentum SGD with Error-Feedback"); with ``torch.optim.Adam`` /
    ``AdamW`` 1-bit Adam with frozen variance after the warm-up (Tang et al. 2021, "1-bit
    Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed";
    :mod:`bunsan.algorithms.onebit_adam`). See the module docstring for how the work is split
    between the hook and :meth:`step`, and docs/how-to/ddp-hooks.md.

    It is a :class:`torch.optim.Optimizer` (learning-rate schedulers, step hooks and
    ``GradScaler`` accept it) whose ``param_groups``, ``state`` and ``defaults`` are the
    wrapped optimizer's. Each worker's momentum differs by rank: every rank saves and loads
    its own :meth:`state_dict` (the optimizer's, plus ``"local_momentum"``).

    Args:
        optimizer: a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` over the DDP model's parameters.
        state: the :class:`~bunsan.algorithms.data_parallel.ddp_hook.QuantizedHookState` registered
            with the hook, quantizing (``bits`` 1..16). With Adam at 1 bit and the state's default
            ``rotate``/``chunk_size``, its chunks become rotated (DataParallelSGD's default there);
            Adam needs a warm-up of at least one step (its variance is estimated from exact
            gradients first).
        quantized_momentum: the momentum the workers apply while quantizing, at most, with
            the gradient scaled by ``(1 - applied) / (1 - beta)`` so that the step
            ``lr / (1 - beta)`` is kept. ``"auto"`` (default): DataParallelSGD's choice
            (:func:`~bunsan.algorithms.data_parallel.momentum.default_quantized_momentum`:
            at 1 bit 0.8 with SGD at 2 ranks, 0.5 otherwise; above 1 bit the optimizer's own).

    Raises:
        TypeError: ``optimizer`` is not SGD/Adam/AdamW, is a HookOptimizer already, or
            ``state`` is not a QuantizedHookState.
        ValueError: ``state`` is exact (``bits=32``) or has a HookOptimizer already; Adam
            with no warm-up.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        state: QuantizedHookState,
        *,
        quantized_momentum: float | str | None = "auto",
    ) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns the parameter groups and state.
        if isinstance(optimizer, HookOptimizer):
            raise TypeError("the optimizer is a HookOptimizer already; wrap the torch optimizer once")
        check_type("optimizer", optimizer, torch.optim.Optimizer, hint="torch.optim.SGD, Adam or AdamW")
        adam = is_adam(optimizer)
        if not (adam or isinstance(optimizer, torch.optim.SGD)):
            raise TypeError(
                f"HookOptimizer serves torch.optim.SGD (local momentum) and Adam/AdamW (1-bit Adam), got "
                f"{type(optimizer).__name__}; other optimizers take the hook's averaged gradient unwrapped"
            )
        check_type("state", state, QuantizedHookState, hint="the state registered with quantized_hook")
        if state._quantizer is None:
            raise ValueError(
                "HookOptimizer needs a quantizing QuantizedHookState (bits 1..16); with bits=32 the hook is "
                "DDP's exact all-reduce and the optimizer needs no wrapper"
            )
        if state._momentum is not None:
            raise ValueError("this QuantizedHookState has a HookOptimizer already: wrap one optimizer per state")
        if adam and state.warmup_steps == 0:
            raise ValueError(
                "1-bit Adam freezes the variance that exact steps estimated: give QuantizedHookState a warm-up "
                "(warmup_steps >= 1, e.g. the learning-rate warm-up's steps)"
            )
        if isinstance(quantized_momentum, str):
            check_choice("quantized_momentum", quantized_momentum, ("auto",), hint="'auto', None or [0, 1)")
            cap = default_quantized_momentum(state.bits, get_world_size(state.group), adam=adam)
        else:
            check_number(
                "quantized_momentum", quantized_momentum, minimum=0.0, maximum=1.0, max_inclusive=False,
                allow_none=True, hint="'auto', None or a momentum in [0, 1)",
            )  # fmt: skip
            cap = None if quantized_momentum is None else float(quantized_momentum)
        if adam and state.bits == 1 and state._codec_default and not state._layouts:
            state._quantizer = RotatedQuantizer(1, ROTATED_CHUNK_SIZE)  # DataParallelSGD's choice for 1-bit Adam
        if adam and state.bits == 1 and not isinstance(state._quantizer, RotatedQuantizer):
            warnings.warn(
                "1-bit Adam without rotated chunks: DataParallelSGD rotates them for Adam at 1 bit (measured far "
                "closer to exact training); build the QuantizedHookState with rotate=True",
                stacklevel=2,
            )
        self.optimizer = optimizer
        self.hook_state = state
        self._local = _WorkerMomentum(optimizer, state, cap)
        state._momentum = self._local
        init_optimizer_hooks(self)

    @property
    def quantized_momentum(self) -> float | None:
        """The momentum the workers apply at most while quantizing (None: the optimizer's own)."""
        return self._local.quantized_momentum

    # The wrapped optimizer's attributes, seen through this object.
    param_groups = optimizer_attribute("param_groups")
    state = optimizer_attribute("state")
    defaults = optimizer_attribute("defaults")

    def __repr__(self) -> str:
        return f"HookOptimizer({type(self.optimizer).__name__}, {self.hook_state!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("HookOptimizer: add parameter groups to the torch optimizer before wrapping it")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The optimizer's step; after a quantized exchange along the averaged momentum, its own held at zero."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._local.reduce_gradients()
        try:
            self.optimizer.step()
        except BaseException:
            self._local._release_momentum()
            raise
        self._local.after_step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the optimizer's in torch's format, plus ``"local_momentum"`` (this worker's buffers).

        A plain torch optimizer loads it as it is (torch ignores the extra key).
        """
        state = dict(self.optimizer.state_dict())
        state.update(self._local.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (this rank's); a plain torch optimizer's state starts the
        workers' momentum from the optimizer's."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise CheckpointError("not an optimizer state: expected the output of optimizer.state_dict()")
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != "local_momentum"})
        self._local.load_state_dict(state_dict)
