"""A wrapper's view of the object it wraps: attributes read and written through to it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["init_optimizer_hooks", "optimizer_attribute"]


def optimizer_attribute(name: str) -> Any:
    """A property that reads and writes ``self.optimizer.<name>``: a wrapping optimizer shows its optimizer's
    ``param_groups``, ``state`` and ``defaults``, so that schedulers, GradScaler and checkpoints see them."""

    def get(self: Any) -> Any:
        return getattr(self.optimizer, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self.optimizer, name, value)

    return property(get, set_)


def init_optimizer_hooks(wrapper: Any) -> None:
    """Give a wrapping optimizer torch's hook registries and step wrapper, as ``torch.optim.Optimizer.__init__``
    makes them (OrderedDicts: a ``RemovableHandle`` keeps a weak reference), so that step hooks fire."""
    for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post"):
        setattr(wrapper, f"_optimizer_{name}_hooks", OrderedDict())
    wrapper._optimizer_load_state_dict_pre_hooks = OrderedDict()
    wrapper._optimizer_load_state_dict_post_hooks = OrderedDict()
    wrapper._patch_step_function()
