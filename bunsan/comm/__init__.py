"""Communication: the only package of bunsan that calls torch.distributed."""

from __future__ import annotations

from bunsan.comm.collectives import (
    Traffic,
    all_gather_into,
    all_gather_object,
    all_reduce,
    all_reduce_mean,
    all_to_all,
    barrier,
    broadcast_tensors,
    flatten,
    get_rank,
    get_world_size,
    global_rank,
    is_initialized,
    unflatten_into,
    wait,
)

__all__ = [
    "Traffic",
    "all_gather_into",
    "all_gather_object",
    "all_reduce",
    "all_reduce_mean",
    "all_to_all",
    "barrier",
    "broadcast_tensors",
    "flatten",
    "get_rank",
    "get_world_size",
    "global_rank",
    "is_initialized",
    "unflatten_into",
    "wait",
]
