"""``QuantizedHookCallback``: bunsan's quantized communication hook under the Hugging Face ``Trainer``.

::

    from bunsan.integrations.transformers import QuantizedHookCallback

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(QuantizedHookCallback(trainer, bits=1))
    trainer.train()                                   # or resume_from_checkpoint=...

The Trainer wraps the model in DDP inside ``train()``, after the callbacks' constructors and
before ``on_train_begin``; the callbacks receive the unwrapped model, so the callback is given
the Trainer and registers :func:`bunsan.algorithms.quantized_hook` on ``trainer.model_wrapped``
at ``on_train_begin``, before the first backward.

Checkpoints: at every ``on_save`` each rank writes its own hook state to
``bunsan_quantized_hook_rank<R>.pt`` in the checkpoint's folder (``<output_dir>/checkpoint-<step>``).
When ``train()`` resumes (the Trainer's global step is above 0 at ``on_train_begin``), each rank
loads its own file from that folder, or from ``resume_from`` where the checkpoint lies elsewhere.
If a rank finds no file, every rank starts the hook fresh, with a warning; files of a job of
another world size reset the residuals with a warning and keep the step count.

The Trainer is imported on first use of :class:`QuantizedHookCallback` (the ``transformers``
extra), so importing this module needs no transformers.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from bunsan._extras import require
from bunsan.integrations._hook_checkpoint import lazy_attribute

__all__ = ["QuantizedHookCallback"]

if TYPE_CHECKING:  # the class is built on first use, when transformers is imported
    from transformers import TrainerCallback as QuantizedHookCallback

_built: dict[str, type] = {}

FILE = "bunsan_quantized_hook_rank{rank}.pt"  # one per rank in each checkpoint folder


def _read_own(folder: str, rank: int) -> dict[str, Any] | None:
    """This rank's saved hook state in ``folder``, or None when there is none."""
    import torch

    path = os.path.join(folder, FILE.format(rank=rank))
    return torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None


def _load(hook_state: Any, folder: str, device: Any) -> None:
    """Each rank loads its own file from ``folder``, or, if some rank has none, every rank starts fresh. Collective."""
    import torch

    from bunsan.comm import all_reduce, get_rank, get_world_size
    from bunsan.integrations._hook_checkpoint import rank_state

    entry = _read_own(folder, get_rank())
    missing = torch.tensor([0.0 if entry is not None else 1.0], device=device)
    all_reduce(missing)  # the same decision on every rank: their step counts must agree
    if missing.item() > 0:
        warnings.warn(
            f"QuantizedHookCallback: {int(missing.item())} rank(s) found no hook state in {folder} (a checkpoint "
            "elsewhere: pass resume_from=); the hook starts fresh, with its warm-up",
            stacklevel=4,
        )
        return
    assert entry is not None
    hook_state.load_state_dict(rank_state(entry, get_world_size(), f"checkpoint {folder}"))


def _build() -> type:
    """Define the callback class on transformers' ``TrainerCallback`` (imported here, on first use)."""
    hf = require("transformers", "bunsan.integrations.transformers", "transformers")
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from bunsan.algorithms import QuantizedHookState, quantized_hook
    from bunsan.comm import get_rank
    from bunsan.integrations._hook_checkpoint import check_arguments
    from bunsan.integrations._hook_checkpoint import hook_arguments as arguments_of

    prefix = require(
        "transformers.trainer_utils", "bunsan.integrations.transformers", "transformers"
    ).PREFIX_CHECKPOINT_DIR

    class QuantizedHookCallback(hf.TrainerCallback):  # type: ignore[name-defined]
        """A ``TrainerCallback`` that registers :func:`bunsan.algorithms.quantized_hook` on the Trainer's DDP model.

        Args:
            trainer: the ``transformers.Trainer`` whose model to hook (add the callback to it with
                ``trainer.add_callback``).
            bits: passed to :class:`bunsan.algorithms.QuantizedHookState`, as ``total_steps``,
                ``warmup_steps``, ``rotate``, ``chunk_size`` and ``grad_scaler``: its defaults and
                rules hold, but for ``total_steps``: when neither it nor ``warmup_steps`` is given,
                the Trainer's ``max_steps``.
            resume_from: the checkpoint folder to load the hook state from when ``train()`` resumes
                from a checkpoint outside ``<output_dir>/checkpoint-<step>``.

        Attributes:
            hook_state: this rank's :class:`~bunsan.algorithms.QuantizedHookState` from
                ``on_train_begin`` on (``None`` before, and without DDP).

        Raises:
            TypeError: ``trainer`` is not a ``transformers.Trainer``; the arguments QuantizedHookState refuses.
            ValueError: the arguments QuantizedHookState refuses.
        """

        def __init__(
            self,
            trainer: Any,
            bits: int = 1,
            *,
            total_steps: int | None = None,
            warmup_steps: int | None = None,
            rotate: bool | None = None,
            chunk_size: int | None = None,
            grad_scaler: Any = None,
            resume_from: str | os.PathLike[str] | None = None,
        ) -> None:
            if not isinstance(trainer, hf.Trainer):
                raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
            hook_arguments = arguments_of(bits, total_steps, warmup_steps, rotate, chunk_size, grad_scaler)
            probe = dict(hook_arguments)
            if total_steps is None and warmup_steps is None:
                probe["total_steps"] = 1  # the Trainer's max_steps at on_train_begin
            check_arguments("QuantizedHookCallback", probe)
            self.hook_arguments = hook_arguments
            self.trainer = trainer
            self.resume_from = None if resume_from is None else os.fspath(resume_from)
            self.hook_state: QuantizedHookState | None = None
            self._hooked: Any = None  # the DDP model the hook is registered on (once per DDP model)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Register the hook on the DDP model the Trainer has just made, and load a resumed checkpoint's state."""
            wrapped = self.trainer.model_wrapped
            if wrapped is self._hooked:  # train() again on the same DDP model: its hook is registered
                return
            if not isinstance(wrapped, DistributedDataParallel):
                if wrapped is self.trainer.model:
                    warnings.warn("QuantizedHookCallback: the Trainer runs without DDP, nothing to hook", stacklevel=2)
                    return
                raise TypeError(
                    f"QuantizedHookCallback hooks DistributedDataParallel; the Trainer wrapped the model in "
                    f"{type(wrapped).__name__} (FSDP and DeepSpeed exchange gradients their own way)"
                )
            arguments: dict[str, Any] = dict(self.hook_arguments)
            if arguments["total_steps"] is None and arguments["warmup_steps"] is None:
                arguments["total_steps"] = max(int(state.max_steps), 1)
            hook_state = QuantizedHookState(wrapped, **arguments)
            if state.global_step > 0:
                folder = self.resume_from or os.path.join(args.output_dir, f"{prefix}-{state.global_step}")
                _load(hook_state, folder, next(wrapped.parameters()).device)
            wrapped.register_comm_hook(hook_state, quantized_hook)
            self.hook_state, self._hooked = hook_state, wrapped

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """Write this rank's hook state into the checkpoint folder the Trainer has just saved (every rank)."""
            if self.hook_state is None:
                return
            folder = os.path.join(args.output_dir, f"{prefix}-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(self.hook_state.state_dict(), os.path.join(folder, FILE.format(rank=get_rank())))

    QuantizedHookCallback.__module__ = __name__
    QuantizedHookCallback.__qualname__ = "QuantizedHookCallback"
    return QuantizedHookCallback


__getattr__ = lazy_attribute(__name__, "QuantizedHookCallback", _build)
