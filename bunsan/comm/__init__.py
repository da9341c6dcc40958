"""Communication: the only package of bunsan that calls torch.distributed."""

from __future__ import annotations

from bunsan.comm.collectives import (
    Traffic,
    all_gather_into,
    all_gather_object,
    all_reduce,
    all_to_all,
    barrier,
    broadcast_tensors,
    get_backend,
    get_rank,
    get_world_size,
    global_rank,
    is_initialized,
    tensor_device,
    wait,
)
from bunsan.comm.objects import broadcast_object, group_rank, group_size, scatter_objects, scatter_tensor

__all__ = [
    "Traffic",
    "all_gather_into",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast_object",
    "broadcast_tensors",
    "get_backend",
    "get_rank",
    "get_world_size",
    "global_rank",
    "group_rank",
    "group_size",
    "is_initialized",
    "scatter_objects",
    "scatter_tensor",
    "tensor_device",
    "wait",
]
