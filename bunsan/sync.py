"""Copy one rank's model and optimizer state to every rank (Horovod's two broadcasts).

A Horovod script starts with::

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

so that every worker starts from the same weights, also after rank 0 alone
loaded a checkpoint. The same two calls exist here under the same names and
arguments. :func:`bunsan.distribute` already broadcasts rank 0's parameters and
buffers when it is called, so a script needs them only when it changes the
model or the optimizer on one rank afterwards (a checkpoint loaded by rank 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from bunsan import comm
from bunsan._validate import check_int, check_type

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def _check_root(root_rank: Any) -> int:
    return int(check_int("root_rank", root_rank, minimum=0, maximum=comm.get_world_size() - 1))


def _tensors_of(params: Any) -> list[Tensor]:
    if isinstance(params, nn.Module):
        return list(params.state_dict(keep_vars=True).values())
    if isinstance(params, Mapping):
        values = list(params.values())
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, Tensor)):
        # named_parameters() gives (name, tensor) pairs; parameters() gives tensors.
        values = [item[1] if isinstance(item, tuple) and len(item) == 2 else item for item in params]
    else:
        raise TypeError(
            "params must be a Module, a state_dict, model.named_parameters() or model.parameters(), "
            f"got {type(params).__name__}"
        )
    bad = [type(v).__name__ for v in values if not isinstance(v, Tensor)]
    if bad:
        raise TypeError(f"params must hold tensors only, got {bad[0]}")
    return values


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Overwrite every rank's tensors with rank ``root_rank``'s, in place. Collective.

    Args:
        params: A module (its parameters and buffers), ``model.state_dict()``,
            ``model.named_parameters()`` or ``model.parameters()``: the same
            tensors in the same order on every rank.
        root_rank: The rank whose values every rank ends with.

    One message per dtype (:func:`bunsan.comm.broadcast_tensors`); gradients are
    not tracked. A job of one process returns at once.
    """
    tensors = _tensors_of(params)
    root_rank = _check_root(root_rank)
    if comm.get_world_size() == 1:
        return
    with torch.no_grad():
        # A state_dict of a module holds detached views; parameters themselves need
        # .data so that the in-place copy is not recorded by autograd.
        comm.broadcast_tensors([t.data for t in tensors], src=root_rank)


def _strip(value: Any, tensors: list[Tensor]) -> Any:
    """``value`` with every tensor replaced by a placeholder naming its index in ``tensors``."""
    if isinstance(value, Tensor):
        tensors.append(value)
        return _Placeholder(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: list[Tensor]) -> Any:
    if isinstance(value, _Placeholder):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


class _Placeholder:
    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank rank ``root_rank``'s optimizer state (momentum buffers, step counts, hyperparameters). Collective.

    The state's structure travels as one pickled object and its tensors as flat
    messages, one per dtype. A rank whose optimizer has not stepped yet (its
    momentum buffers do not exist) gets them created. For a
    :class:`bunsan.DistributedOptimizer` only the wrapped torch optimizer's
    state is broadcast: the algorithm's state (quantization residuals) is each
    rank's own.

    Args:
        optimizer: A ``torch.optim.Optimizer`` over the same parameters on every rank.
        root_rank: The rank whose state every rank ends with.
    """
    inner = getattr(optimizer, "optimizer", None)
    target = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    check_type("optimizer", target, torch.optim.Optimizer, hint="torch.optim.Optimizer")
    root_rank = _check_root(root_rank)
    if comm.get_world_size() == 1:
        return
    is_root = comm.get_rank() == root_rank
    tensors: list[Tensor] = []
    skeleton = _strip(target.state_dict(), tensors) if is_root else None
    skeleton = comm.broadcast_object(skeleton, src=root_rank)
    # Every rank must pass tensors of the same devices (NCCL: the current CUDA
    # device); the optimizer's load_state_dict then moves each state tensor to
    # its parameter's device.
    device = comm.tensor_device()
    if is_root:
        received = [t.detach().to(device) for t in tensors]
    else:
        slots: list[_Placeholder] = []
        _collect(skeleton, slots)
        received = [torch.empty(p.shape, dtype=p.dtype, device=device) for p in sorted(slots, key=lambda p: p.index)]
    comm.broadcast_tensors(received, src=root_rank)
    if not is_root:
        target.load_state_dict(_fill(skeleton, received))


def _collect(value: Any, slots: list[_Placeholder]) -> None:
    if isinstance(value, _Placeholder):
        slots.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, slots)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, slots)
