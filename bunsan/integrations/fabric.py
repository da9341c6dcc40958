"""``QuantizedFabricStrategy``: Lightning Fabric's ``DDPStrategy`` with bunsan's quantized communication hook.

::

    from lightning.fabric import Fabric
    from bunsan.integrations.fabric import QuantizedFabricStrategy

    strategy = QuantizedFabricStrategy(bits=1, total_steps=steps)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)     # the hook is registered here
    ...
    fabric.save(path, {"model": model, "optimizer": optimizer})   # every rank's hook state goes along
    fabric.load(path, {"model": model, "optimizer": optimizer})   # each rank takes its own back

Fabric wraps the model in DDP in ``setup_module``; this strategy registers
:func:`bunsan.algorithms.quantized_hook` on the wrapped model there, before the first backward.
Fabric writes a checkpoint from rank 0 only, and the hook's residuals differ by rank: ``save``
gathers every rank's hook state into the checkpoint (a collective: every rank calls
``fabric.save``, as Fabric asks anyway), and ``load`` gives each rank its own entry (from a job of
another world size: residuals reset with a warning, step counts kept). Load after ``setup``.

Lightning is imported on first use of :class:`QuantizedFabricStrategy` (the ``lightning`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bunsan._extras import require
from bunsan.integrations._hook_checkpoint import lazy_attribute

__all__ = ["QuantizedFabricStrategy"]

if TYPE_CHECKING:  # the class is built on first use, when Lightning is imported
    from lightning.fabric.strategies import DDPStrategy as QuantizedFabricStrategy

_built: dict[str, type] = {}


def _build() -> type:
    """Define the strategy class on Fabric's ``DDPStrategy`` (imported here, on first use)."""
    strategies = require("lightning.fabric.strategies", "bunsan.integrations.fabric", "lightning")
    from bunsan.algorithms import QuantizedHookState, quantized_hook
    from bunsan.integrations._hook_checkpoint import KEY, check_arguments, gather_states, load_state
    from bunsan.integrations._hook_checkpoint import hook_arguments as arguments_of

    class QuantizedFabricStrategy(strategies.DDPStrategy):  # type: ignore[name-defined]
        """Fabric's ``DDPStrategy`` that exchanges gradients with :func:`bunsan.algorithms.quantized_hook`.

        Args:
            bits: passed to :class:`bunsan.algorithms.QuantizedHookState`, as ``total_steps``,
                ``warmup_steps``, ``rotate``, ``chunk_size`` and ``grad_scaler``: its defaults and rules hold.
            ddp_arguments: every other keyword goes to Fabric's ``DDPStrategy`` (``process_group_backend``,
                and DDP's own such as ``bucket_cap_mb`` or ``find_unused_parameters``).

        Attributes:
            hook_state: the :class:`~bunsan.algorithms.QuantizedHookState` of this rank, from
                ``fabric.setup`` on (``None`` before).

        Raises:
            ValueError, TypeError: arguments that QuantizedHookState refuses, when the strategy is made.
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
            hook_arguments = arguments_of(bits, total_steps, warmup_steps, rotate, chunk_size, grad_scaler)
            self.hook_arguments = check_arguments("QuantizedFabricStrategy", hook_arguments)
            super().__init__(**ddp_arguments)
            self.hook_state: QuantizedHookState | None = None

        def setup_module(self, module: Any) -> Any:
            """Wrap the module in DDP (Fabric), then register the hook on it."""
            ddp = super().setup_module(module)
            if self.hook_state is not None:
                raise RuntimeError("QuantizedFabricStrategy carries one hook state: set up one model per strategy")
            self.hook_state = QuantizedHookState(ddp, **self.hook_arguments)
            ddp.register_comm_hook(self.hook_state, quantized_hook)
            return ddp

        def save_checkpoint(
            self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
        ) -> None:
            """Gather every rank's hook state into the checkpoint (collective), then let rank 0 write it."""
            if self.hook_state is not None:
                state = {**state, KEY: gather_states(self.hook_state)}
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

        def load_checkpoint(
            self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
        ) -> dict[str, Any]:
            """Restore ``state`` as Fabric does, and this rank's own hook state from the checkpoint."""
            remaining = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
            saved = remaining.pop(KEY, None)
            if saved is not None:
                if self.hook_state is None:
                    raise RuntimeError("load the checkpoint after fabric.setup(model): the hook state is made there")
                load_state(self.hook_state, saved, f"checkpoint {path}")
            return remaining

    QuantizedFabricStrategy.__module__ = __name__
    QuantizedFabricStrategy.__qualname__ = "QuantizedFabricStrategy"
    return QuantizedFabricStrategy


__getattr__ = lazy_attribute(__name__, "QuantizedFabricStrategy", _build)
