"""The hook state of every rank in a trainer's checkpoint: argument check, gather, and each rank's own entry.

Shared by the Lightning and Hugging Face integrations; imports neither framework.

Distributed invariants kept here:

* :func:`gather_states` is a collective: every rank calls it at the same checkpoint.
* :func:`own_state` decides from the saved world size alone, the same on every rank, so either
  every rank loads its own residuals or every rank resets them, and the step counters (which
  decide whether a step quantizes) stay equal on every rank.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from bunsan.algorithms import QuantizedHookState
from bunsan.comm import all_gather_object, get_rank, get_world_size

__all__ = [
    "KEY",
    "check_arguments",
    "gather_states",
    "hook_arguments",
    "lazy_attribute",
    "load_state",
    "own_state",
    "rank_state",
]

KEY = "bunsan_quantized_hook"  # the checkpoint's entry: {"world_size": n, "ranks": [state_dict of rank 0, ...]}


def lazy_attribute(module: str, name: str, build: Callable[[], type]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that builds the class ``name`` on first use (its framework imported then).

    The class is kept in the module's ``_built`` dict, read at each call (tests empty it).
    """

    def getattr_(attribute: str) -> Any:
        if attribute != name:
            raise AttributeError(f"module {module!r} has no attribute {attribute!r}")
        built: dict[str, type] = sys.modules[module]._built
        if name not in built:
            built[name] = build()
        return built[name]

    return getattr_


def hook_arguments(
    bits: int, total_steps: int | None, warmup_steps: int | None, rotate: Any, chunk_size: Any, grad_scaler: Any
) -> dict[str, Any]:
    """QuantizedHookState's keyword arguments as an integration takes them: the optional ones only where given."""
    given = {"rotate": rotate, "chunk_size": chunk_size, "grad_scaler": grad_scaler}
    arguments = {"bits": bits, "total_steps": total_steps, "warmup_steps": warmup_steps}
    arguments.update({k: v for k, v in given.items() if v is not None})
    return arguments


def check_arguments(owner: str, hook_arguments: dict[str, Any]) -> dict[str, Any]:
    """Fail now, not at the start of training, when QuantizedHookState would refuse ``hook_arguments``.

    The state is built on an empty module: the arguments are checked by QuantizedHookState itself,
    so its defaults and rules are not repeated here.
    """
    for name in ("module", "group"):
        if name in hook_arguments:
            raise TypeError(f"{owner} sets {name!r} itself (the DDP-wrapped model, its process group): do not pass it")
    QuantizedHookState(nn.Module(), **hook_arguments)
    return dict(hook_arguments)


def gather_states(state: QuantizedHookState) -> dict[str, Any]:
    """Every rank's :meth:`QuantizedHookState.state_dict`, on CPU, in rank order. Collective."""
    mine = state.state_dict()
    mine["residuals"] = {which: {k: v.cpu() for k, v in saved.items()} for which, saved in mine["residuals"].items()}
    return {"world_size": get_world_size(state.group), "ranks": all_gather_object(mine, group=state.group)}


def own_state(saved: dict[str, Any], rank: int, world_size: int, source: str) -> dict[str, Any]:
    """This rank's entry of :func:`gather_states`' result, ready for :meth:`QuantizedHookState.load_state_dict`.

    From a job of another world size, :func:`rank_state` of rank 0's entry: no residuals, the same
    step counters on every rank.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("ranks"), list) or not saved["ranks"]:
        raise ValueError(f"{source} holds no hook state of bunsan's form {{'world_size': n, 'ranks': [...]}}")
    if len(saved["ranks"]) == world_size:
        return rank_state(saved["ranks"][rank], world_size, source)
    return rank_state(saved["ranks"][0], world_size, source)


def rank_state(entry: dict[str, Any], world_size: int, source: str) -> dict[str, Any]:
    """One rank's saved state for this job, or its step counters alone (a warning) if saved by another world size.

    A residual is what one rank's quantization dropped from its own share of the data, and an
    owner's residual belongs to a stripe set by the world size: neither means anything in a job of
    another size, so they are reset (at most one step's quantization error is lost). The step
    counters are kept, so the warm-up is not repeated.
    """
    saved_size = int(entry["world_size"])
    if saved_size == world_size:
        return dict(entry)
    warnings.warn(
        f"{source}: the hook's quantization residuals were saved by a job of {saved_size} ranks and this job has "
        f"{world_size}: they are reset (at most one step's quantization error is lost)",
        stacklevel=3,
    )
    return {**entry, "world_size": world_size, "residuals": {"residual": {}, "owner_residual": {}}}


def load_state(state: QuantizedHookState, saved: dict[str, Any], source: str) -> None:
    """Load this rank's entry of ``saved`` (the result of :func:`gather_states`) into ``state``."""
    state.load_state_dict(own_state(saved, get_rank(state.group), get_world_size(state.group), source))
