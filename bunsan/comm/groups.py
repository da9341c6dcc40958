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

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import init_device_mesh

from bunsan._validate import check_int
from bunsan.comm.collectives import _call, get_backend, get_world_size, is_initialized

__all__ = ["new_groups", "rank_grid"]


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
        TypeError: ``group_size`` is not an int.
        ValueError: ``group_size`` is not a divisor of ``world_size`` in ``1..world_size``.

    Example:
        >>> rank_grid(4, 2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    check_int("world_size", world_size, minimum=1)
    check_int("group_size", group_size, minimum=1, maximum=world_size, hint="at most the world size")
    if world_size % group_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"group_size={group_size} does not divide the world size {world_size}; choose one of {divisors}"
        )
    blocks = world_size // group_size
    model_parallel = [list(range(b * group_size, (b + 1) * group_size)) for b in range(blocks)]
    data_parallel = [list(range(i, world_size, group_size)) for i in range(group_size)]
    return model_parallel, data_parallel


def new_groups(group_size: int) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """This rank's model-parallel and data-parallel groups. Collective over the world.

    Creates the groups of :func:`rank_grid` as the two named dimensions of a
    ``torch.distributed.device_mesh.init_device_mesh`` (all ranks must call this,
    with the same ``group_size``, at the same point of the program) and returns the
    two this rank belongs to. Without a process group both are ``None``. Each call
    creates new groups: call it once and keep the result. A dimension that spans
    the whole world (``group_size`` 1 or the world size) is the default group.

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
    rank_grid(world_size, group_size)  # refuses a group_size that does not divide the world
    if not is_initialized():
        return None, None
    # torch's DeviceMesh builds exactly rank_grid's layout: the mesh is arange(world_size)
    # viewed as (world_size // k, k), row-major, so a row (dim "model_parallel") holds k
    # consecutive ranks and a column (dim "data_parallel") the ranks at the same position.
    # A dimension spanning the whole world is the default group itself.
    device = "cuda" if get_backend() == "nccl" else "cpu"
    mesh = _call(
        "init_device_mesh",
        lambda: init_device_mesh(
            device, (world_size // group_size, group_size), mesh_dim_names=("data_parallel", "model_parallel")
        ),
    )
    return mesh.get_group("model_parallel"), mesh.get_group("data_parallel")
