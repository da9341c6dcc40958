"""``QuantizedDDPStrategy``: Lightning's ``DDPStrategy`` with bunsan's quantized communication hook.

::

    from bunsan.integrations.lightning import QuantizedDDPStrategy

    strategy = QuantizedDDPStrategy(bits=1, total_steps=trainer_steps)
    trainer = lightning.pytorch.Trainer(strategy=strategy, accelerator="cpu", devices=2)
    trainer.fit(model, loader)                        # or ckpt_path=... to resume
    strategy.hook_state.stats()

``DDPStrategy(ddp_comm_hook=...)`` registers a hook on CUDA only; this strategy registers
:func:`bunsan.algorithms.quantized_hook` right after Lightning wraps the model in DDP, on every
device, before the first backward.

Checkpoints: Lightning writes its checkpoint from rank 0 only, and the hook's residuals differ
by rank. On save, every rank's hook state is gathered into the checkpoint (under
``"bunsan_quantized_hook"``); on ``trainer.fit(..., ckpt_path=...)`` each rank loads its own
entry before the first step. ``Trainer.save_checkpoint`` (and so ``ModelCheckpoint``) runs on
every rank, as the gather needs; a checkpoint saved with ``weights_only=True`` carries no hook
state. A checkpoint of a job of another world size resets the residuals with a warning and keeps
the step count.

Lightning is imported on first use of :class:`QuantizedDDPStrategy` (the ``lightning`` extra),
so importing this module needs no Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bunsan._extras import require
from bunsan.integrations._hook_checkpoint import lazy_attribute

__all__ = ["QuantizedDDPStrategy"]

if TYPE_CHECKING:  # the class is built on first use, when Lightning is imported
    from lightning.pytorch.strategies import DDPStrategy as QuantizedDDPStrategy

_built: dict[str, type] = {}


def _build() -> type:
    """Define the strategy class on Lightning's ``DDPStrategy`` (imported here, on first use)."""
    strategies = require("lightning.pytorch.strategies", "bunsan.integrations.lightning", "lightning")
    from bunsan.algorithms import QuantizedHookState, quantized_hook
    from bunsan.integrations._hook_checkpoint import KEY, check_arguments, gather_states, load_state
    from bunsan.integrations._hook_checkpoint import hook_arguments as arguments_of

    class QuantizedDDPStrategy(strategies.DDPStrategy):  # type: ignore[name-defined]
        """Lightning's ``DDPStrategy`` that exchanges gradients with :func:`bunsan.algorithms.quantized_hook`.

        Args:
            bits: passed to :class:`bunsan.algorithms.QuantizedHookState`, as every argument of
                ``hook_arguments`` (``total_steps``, ``warmup_steps``, ``rotate``, ``chunk_size``,
                ``grad_scaler``): its defaults and rules hold.
            ddp_arguments: every other keyword goes to Lightning's ``DDPStrategy`` (``bucket_cap_mb``,
                ``find_unused_parameters``, ``process_group_backend``, ...).

        Attributes:
            hook_state: the :class:`~bunsan.algorithms.QuantizedHookState` of this rank, from the
                start of ``fit`` on (``None`` before).

        Raises:
            ValueError, TypeError: arguments that QuantizedHookState refuses, when the strategy is made.
            ValueError: a ``ddp_comm_hook`` as well (one hook per model).
        """

        def __init__(
            self,
            bits: int = 1,
            *,
            total_steps: int | None = None,
            warmup_steps: int | None = None,
            rotate: bool | None = None,
            chunk_size: int | None = None,
            grad_scaler: Any = None,
            **ddp_arguments: Any,
        ) -> None:
            if ddp_arguments.get("ddp_comm_hook") is not None:
                raise ValueError("QuantizedDDPStrategy registers bunsan's hook: do not pass ddp_comm_hook as well")
            hook_arguments = arguments_of(bits, total_steps, warmup_steps, rotate, chunk_size, grad_scaler)
            self.hook_arguments = check_arguments("QuantizedDDPStrategy", hook_arguments)
            super().__init__(**ddp_arguments)
            self.hook_state: QuantizedHookState | None = None
            self._saved_hook_state: dict[str, Any] | None = None  # loaded before the model is wrapped

        def configure_ddp(self) -> None:
            """Wrap the model (Lightning), then register the hook and load a resumed checkpoint's hook state."""
            super().configure_ddp()
            self.hook_state = QuantizedHookState(self.model, **self.hook_arguments)
            if self._saved_hook_state is not None:
                load_state(self.hook_state, self._saved_hook_state, "the Lightning checkpoint")
                self._saved_hook_state = None
            self.model.register_comm_hook(self.hook_state, quantized_hook)

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            """Gather every rank's hook state into ``checkpoint`` (collective), then let rank 0 write it."""
            # the same decision on every rank: the hook exists on all or none, and weights_only
            # checkpoints (no "optimizer_states") are made alike on every rank
            if self.hook_state is not None and "optimizer_states" in checkpoint:
                checkpoint[KEY] = gather_states(self.hook_state)
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            """Read the checkpoint (every rank does) and keep its hook state for this rank's hook."""
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            saved = checkpoint.get(KEY)
            if saved is not None and self.hook_state is not None:  # restored after the model was wrapped
                load_state(self.hook_state, saved, f"checkpoint {checkpoint_path}")
            else:
                self._saved_hook_state = saved
            return checkpoint

    QuantizedDDPStrategy.__module__ = __name__
    QuantizedDDPStrategy.__qualname__ = "QuantizedDDPStrategy"  # pickle finds it through the module's __getattr__
    return QuantizedDDPStrategy


__getattr__ = lazy_attribute(__name__, "QuantizedDDPStrategy", _build)
