"""Collectives on picklable objects, and a tensor scatter, for moving data sets around.

``src`` is always the sender's rank *within* ``group`` (the global rank when
``group`` is ``None``), as ChainerMN's ``root``; torch's own ``src`` is a
global rank.

A call that raises on one rank before it reaches the collective leaves the
other ranks waiting until the process group's timeout. Callers that can fail
on the sender only (a bad data set on rank 0) should first broadcast a small
header that says so, as :func:`bunsan.data.scatter` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_int
from bunsan.comm.collectives import tensor_device

__all__ = ["broadcast_object", "group_rank", "group_size", "scatter_objects", "scatter_tensor"]


def group_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank within ``group`` (``None``: the world). Not collective."""
    return dist.get_rank(group)


def group_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (``None``: the world). Not collective."""
    return dist.get_world_size(group)


T = TypeVar("T")


def _one_per_rank(name: str, items: Sequence[T] | None, src: int, size: int) -> Sequence[T]:
    if items is None or len(items) != size:
        count = "None" if items is None else f"{len(items)} items"
        raise ValueError(f"{name} on src={src} must hold one item per rank ({size}), got {count}")
    return items


def _check_src(src: int, group: ProcessGroup | None) -> int:
    size = dist.get_world_size(group)
    return int(check_int("src", src, minimum=0, maximum=size - 1, hint="a rank of the group"))


def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Return rank ``src``'s ``obj`` on every rank. Collective.

    Args:
        obj: A picklable object; read on ``src`` only, ignored elsewhere.
        src: Sender, a rank within ``group``.
        group: Process group; ``None`` means the world.

    Returns:
        ``src``'s object (on ``src`` itself, ``obj`` unchanged).
    """
    src = _check_src(src, group)
    holder = [obj if dist.get_rank(group) == src else None]
    dist.broadcast_object_list(holder, group=group, group_src=src)
    return holder[0]


def scatter_objects(objects: Sequence[Any] | None, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Send ``objects[r]`` to rank ``r``; return this rank's object. Collective.

    Every object is pickled; for large tensors use :func:`scatter_tensor`.

    Args:
        objects: On ``src``, one picklable object per rank of ``group``; ignored
            (pass ``None``) elsewhere.
        src: Sender, a rank within ``group``.
        group: Process group; ``None`` means the world.

    Returns:
        The object meant for this rank.

    Raises:
        ValueError: On ``src``, when ``objects`` is not one object per rank.
    """
    src = _check_src(src, group)
    size = dist.get_world_size(group)
    inputs = None
    if dist.get_rank(group) == src:
        objects = _one_per_rank("objects", objects, src, size)
        inputs = list(objects)
    output: list[Any] = [None]
    dist.scatter_object_list(output, inputs, group=group, group_src=src)
    return output[0]


def scatter_tensor(
    chunks: Sequence[Tensor] | None, out: Tensor, src: int = 0, group: ProcessGroup | None = None
) -> Tensor:
    """Send ``chunks[r]`` to rank ``r``, received into ``out`` in place. Collective.

    Every rank must pass an ``out`` of the same shape and dtype as the chunks
    (broadcast them first with :func:`broadcast_object` when only ``src``
    knows them). Tensors travel as they are, with no pickling.

    Args:
        chunks: On ``src``, one tensor per rank of ``group``, all of ``out``'s
            shape and dtype; ignored (pass ``None``) elsewhere.
        out: Receives this rank's chunk.
        src: Sender, a rank within ``group``.
        group: Process group; ``None`` means the world.

    Returns:
        ``out``.
    """
    src = _check_src(src, group)
    device = tensor_device(group)
    size = dist.get_world_size(group)
    scatter_list = None
    if dist.get_rank(group) == src:
        chunks = _one_per_rank("chunks", chunks, src, size)
        for index, chunk in enumerate(chunks):
            if chunk.shape != out.shape or chunk.dtype != out.dtype:
                raise ValueError(
                    f"chunks[{index}] is {chunk.dtype} {tuple(chunk.shape)} but out is "
                    f"{out.dtype} {tuple(out.shape)}; every chunk must match out"
                )
        scatter_list = [chunk.to(device).contiguous() for chunk in chunks]
    buffer = (
        out
        if out.device == device and out.is_contiguous()
        else torch.empty_like(out, device=device, memory_format=torch.contiguous_format)
    )
    dist.scatter(buffer, scatter_list, group=group, group_src=src)
    if buffer is not out:
        out.copy_(buffer)
    return out
