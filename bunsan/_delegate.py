"""A wrapper's view of the object it wraps: attributes read and written through to it."""

from __future__ import annotations

from typing import Any

__all__ = ["optimizer_attribute"]


def optimizer_attribute(name: str) -> Any:
    """A property that reads and writes ``self.optimizer.<name>``: a wrapping optimizer shows its optimizer's
    ``param_groups``, ``state`` and ``defaults``, so that schedulers, GradScaler and checkpoints see them."""

    def get(self: Any) -> Any:
        return getattr(self.optimizer, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self.optimizer, name, value)

    return property(get, set_)
