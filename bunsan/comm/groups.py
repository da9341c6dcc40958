"""Subgroups of the world for hybrid layouts: model parallel inside a block, data parallel across.

With ``world_size = k x m`` ranks and a model-parallel group size ``k``, ranks are
laid out as a ``m x k`` grid, row-major::

    world_size=4, group_size=2:        model-parallel groups  [0, 1] [2, 3]
                                        data-parallel groups   [0, 2] [1, 3]

Neighbouring ranks form a model-parallel group because they usually share a
machine (``bunsan run`` fills hosts in order), and model parallelism talks on
every layer while data parallelism talks once per step. The same choice as
Megatron-LM's tensor-parallel groups (Shoeybi et al. 2019).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

from bunsan.comm.collectives import _call, get_rank, get_world_size, is_initialized

__all__ = ["new_group", "new_groups", "rank_grid"]


def rank_grid(world_size: int, group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of every model-parallel and every data-parallel group. Pure.

    Args:
        world_size: Ranks in the job.
        group_size: Ranks per model-parallel group; must divide ``world_size``.

    Returns:
        ``(model_parallel, data_parallel)``: lists of rank lists. Model-parallel
        group ``g`` is ``[g*k, ..., g*k + k - 1]``; data-parallel group ``i`` is
        ``[i, i + k, i + 2k, ...]``.

    Raises:
        ValueError: ``group_size`` is not a divisor of ``world_size`` in ``1..world_size``.

    Example:
        >>> rank_grid(4, 2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= world_size:
        raise ValueError(f"group_size must be an int in 1..{world_size} (the world size), got {group_size!r}")
    if world_size % group_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"group_size={group_size} does not divide the world size {world_size}; choose one of {divisors}"
        )
    blocks = world_size // group_size
    model_parallel = [list(range(b * group_size, (b + 1) * group_size)) for b in range(blocks)]
    data_parallel = [list(range(i, world_size, group_size)) for i in range(group_size)]
    return model_parallel, data_parallel


def new_group(ranks: list[int]) -> ProcessGroup | None:
    """Create a process group of ``ranks`` (global ranks). Collective over the world.

    Every rank of the world must call it, with the same ``ranks``, in the same
    order as every other group creation (torch.distributed matches group creations
    by their order). Returns ``None`` (the world) without a process group.
    """
    if not is_initialized():
        return None
    return _call("new_group", lambda: dist.new_group(ranks=sorted(ranks)))


def new_groups(group_size: int) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """This rank's model-parallel and data-parallel groups. Collective over the world.

    Creates every group of :func:`rank_grid` (all ranks must call this, with the
    same ``group_size``, at the same point of the program) and returns the two this
    rank belongs to. Without a process group both are ``None``. Each call creates
    new groups: call it once and keep the result.

    Args:
        group_size: Ranks per model-parallel group; must divide the world size.

    Returns:
        ``(model_parallel_group, data_parallel_group)``.

    Raises:
        ValueError: ``group_size`` does not divide the world size.

    Example:
        >>> mp_group, dp_group = new_groups(2)   # 4 ranks: [0,1] [2,3] and [0,2] [1,3]
    """
    world_size = get_world_size()
    model_parallel, data_parallel = rank_grid(world_size, group_size)
    if not is_initialized():
        return None, None
    rank = get_rank()
    mine_mp = mine_dp = None
    # Same order on every rank: all model-parallel groups, then all data-parallel ones.
    for ranks in model_parallel:
        group = new_group(ranks)
        if rank in ranks:
            mine_mp = group
    for ranks in data_parallel:
        group = new_group(ranks)
        if rank in ranks:
            mine_dp = group
    return mine_mp, mine_dp
