"""Hybrid parallelism: model parallel inside groups of ``k`` ranks, data parallel across them.

With ``world_size = k x m``, the ranks form ``m`` model-parallel groups of ``k``
consecutive ranks (rank ``r`` in group ``r // k``) and ``k`` data-parallel groups
of the ranks at the same position (``r % k``) in every model-parallel group::

    4 ranks, model_parallel_size=2:   model parallel [0, 1] [2, 3];  data parallel [0, 2] [1, 3]

These are the two named dimensions (``"data_parallel"``, ``"model_parallel"``) of a
``torch.distributed.device_mesh.DeviceMesh`` of shape ``(m, k)``, built by
:func:`bunsan.comm.groups.new_groups`.

Model-parallel layers (:class:`bunsan.nn.ChannelParallelConv2d`, the spatial
layers, :func:`bunsan.parallel.pipeline`) take the model-parallel group; the
data-parallel algorithm takes the data-parallel one, and each model-parallel
group reads its own share of the data::

    mp_group, dp_group = bunsan.parallel.hybrid_groups(model_parallel_size=2)
    model = Net(conv=bunsan.nn.ChannelParallelConv2d(3, 64, 3, padding=1, group=mp_group))
    model, optimizer = bunsan.distribute(model, optimizer, bunsan.DataParallelSGD(group=dp_group))
    shard = dataset[dp_rank::dp_size]          # the same shard on every rank of a model-parallel group

This works with :func:`bunsan.distribute` as it is: the model-parallel layers hold
different slices on the ranks of a model-parallel group, but the same slice (same
names, shapes and dtypes) on the ranks of a data-parallel group, which is what
``distribute`` checks; it broadcasts from the data-parallel group's first rank.
Gradients of the replicated layers are the same on every rank of a model-parallel
group (they all compute the same loss), so averaging over the data-parallel
group gives every replica the gradient of the global batch. Any
:class:`bunsan.DataParallelSGD` setting (``bits``, ``compression``) applies to the
data-parallel dimension only.
"""

from __future__ import annotations

from typing import NamedTuple

from torch.distributed import ProcessGroup

from bunsan.comm.groups import new_groups, rank_grid

__all__ = ["HybridGroups", "hybrid_groups", "rank_grid"]


class HybridGroups(NamedTuple):
    """This rank's two groups; unpacks as ``mp_group, dp_group = hybrid_groups(k)``."""

    model_parallel: ProcessGroup | None
    data_parallel: ProcessGroup | None


def hybrid_groups(model_parallel_size: int) -> HybridGroups:
    """Create the model- and data-parallel groups of a hybrid layout. Collective over the world.

    Every rank must call it, with the same ``model_parallel_size``, at the same
    point of the program: torch.distributed creates groups collectively and
    matches them by order. Each call creates new groups (and their connections):
    call it once and keep the result.

    Args:
        model_parallel_size: ``k``, ranks per model-parallel group; must divide the world size.

    Returns:
        ``(model_parallel, data_parallel)``: this rank's groups (``None`` for both
        without a process group).

    Raises:
        ValueError: ``model_parallel_size`` does not divide the world size.
    """
    model_parallel, data_parallel = new_groups(model_parallel_size)
    return HybridGroups(model_parallel, data_parallel)
