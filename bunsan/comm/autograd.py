"""Differentiable communication: collectives and halo exchange that autograd can see through.

Model-parallel layers and synchronized batch norm need communication *inside* the
graph, so that ``loss.backward()`` also runs the conjugate communication of the
backward pass. Each function here is an :class:`torch.autograd.Function` whose
forward and backward are both *collective*: every rank of ``group`` calls the
forward in the same order, and every rank then runs the backward (autograd does
that by itself when every rank calls ``backward()`` on a loss that depends on the
output, which is the case in SPMD code where all ranks run the same model).

Two kinds of objectives meet here, and the backward pass differs between them:

* **Summed objective** (data parallel, e.g. :class:`bunsan.nn.SyncBatchNorm`):
  rank ``r`` computes its own loss ``L_r`` on its own samples and the objective is
  ``sum_r L_r``. A value that all ranks share, ``S = sum_r s_r``, feeds every
  ``L_q``, so ``d(sum_q L_q)/ds_r = sum_q dL_q/dS``: the backward of an all-reduce
  is an all-reduce (:func:`all_reduce_sum`).
* **Replicated objective** (model parallel): every rank computes the *same* loss
  ``L`` from the same replicated activations. Then the conjugate pairs of
  Shoeybi et al. 2019 ("Megatron-LM: Training Multi-Billion Parameter Language
  Models Using Model Parallelism", the ``f`` and ``g`` operators) apply:

  ============================  ======================  =========================
  function                      forward                 backward
  ============================  ======================  =========================
  :func:`copy_to_group`         identity                all-reduce (sum)
  :func:`gather_from_group`     all-gather along a dim  keep this rank's slice
  :func:`scatter_to_group`      keep this rank's slice  all-gather along a dim
  ============================  ======================  =========================

  A replicated input ``x`` that each rank uses for its own share of the work gets
  only that share's gradient on each rank; the true ``dL/dx`` is their sum, hence
  the all-reduce of :func:`copy_to_group`. A gathered output is replicated, so each
  rank already holds the full ``dL/dy`` and keeps the slice it produced.

:func:`halo_exchange` is point-to-point: each rank sends the borders of its band of
rows to its neighbours and receives theirs, and the backward sends the halos'
gradients back to be added to the borders they came from.

Every function accepts an optional :class:`bunsan.comm.Traffic` that counts the
bytes of forward and backward messages. With no process group, or a group of one
rank, every function is the identity (a halo is zeros).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_int
from bunsan.comm.collectives import (
    Traffic,
    _call,
    all_gather_into,
    all_reduce,
    get_rank,
    get_world_size,
    global_rank,
)

__all__ = [
    "all_reduce_sum",
    "copy_to_group",
    "gather_from_group",
    "halo_exchange",
    "scatter_to_group",
    "split_sizes",
]


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous slices of ``total`` elements, as even as possible. Pure.

    The first ``total % parts`` slices get one element more, as ``torch.tensor_split``
    and ``numpy.array_split`` do: ``split_sizes(10, 4) == [3, 3, 2, 2]``.

    Raises:
        ValueError: ``parts < 1`` or ``total < 0``.
    """
    check_int("parts", parts, minimum=1)
    check_int("total", total, minimum=0)
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _reduced(tensor: Tensor, group: ProcessGroup | None, traffic: Traffic | None) -> Tensor:
    out = tensor.contiguous().clone()
    all_reduce(out, group=group, traffic=traffic)
    return out


def _gather(
    tensor: Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup | None, traffic: Traffic | None
) -> Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank ``r`` holds ``sizes[r]``)."""
    n, rank = len(sizes), get_rank(group)
    width = max(sizes)
    piece = tensor
    if sizes[rank] < width:
        # all_gather moves equal sizes: pad the short slices, cut the padding after.
        pad_shape = list(tensor.shape)
        pad_shape[dim] = width - sizes[rank]
        piece = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
    piece = piece.contiguous()
    # Rank-major flat buffer: what all_gather_into fills on every backend.
    out = piece.new_empty(n * piece.numel())
    all_gather_into(out, piece.view(-1), group=group, traffic=traffic)
    out = out.view(n, *piece.shape)
    if all(s == width for s in sizes):
        return torch.cat(out.unbind(0), dim=dim)
    return torch.cat([out[r].narrow(dim, 0, sizes[r]) for r in range(n)], dim=dim)


def _check_sizes(tensor: Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup | None, whole: bool) -> None:
    n = get_world_size(group)
    if len(sizes) != n:
        raise ValueError(f"sizes must hold one size per rank of the group ({n}), got {list(sizes)}")
    expected = sum(sizes) if whole else sizes[get_rank(group)]
    if tensor.shape[dim] != expected:
        what = "the sum of sizes" if whole else f"sizes[{get_rank(group)}] (this rank's slice)"
        raise ValueError(
            f"tensor has {tensor.shape[dim]} elements along dim {dim} but {what} is {expected}; sizes={list(sizes)}"
        )


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: ProcessGroup | None, traffic: Traffic | None) -> Tensor:
        ctx.group, ctx.traffic = group, traffic
        return _reduced(tensor, group, traffic)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # Summed objective: every rank's loss depends on the sum, so each input's
        # gradient is the sum of all ranks' output gradients.
        return _reduced(grad, ctx.group, ctx.traffic), None, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: ProcessGroup | None, traffic: Traffic | None) -> Tensor:
        ctx.group, ctx.traffic = group, traffic
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # Each rank used the replicated input for its own share of the work, so it
        # holds only that share's gradient: dL/dx = sum over ranks.
        return _reduced(grad, ctx.group, ctx.traffic), None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: Tensor, dim: int, sizes: list[int], group: ProcessGroup | None, traffic: Traffic | None
    ) -> Tensor:
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return _gather(tensor, dim, sizes, group, traffic)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        # The gathered output is replicated, so this rank already holds all of dL/dy:
        # keep the slice this rank produced. No communication.
        rank = get_rank(ctx.group)
        start = _offsets(ctx.sizes)[rank]
        return grad.narrow(ctx.dim, start, ctx.sizes[rank]).contiguous(), None, None, None, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: Tensor, dim: int, sizes: list[int], group: ProcessGroup | None, traffic: Traffic | None
    ) -> Tensor:
        ctx.dim, ctx.sizes, ctx.group, ctx.traffic = dim, sizes, group, traffic
        rank = get_rank(group)
        start = _offsets(sizes)[rank]
        return tensor.narrow(dim, start, sizes[rank]).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        # The input was replicated and each rank used only its slice: the full
        # gradient is the concatenation of every rank's slice gradient.
        return _gather(grad, ctx.dim, ctx.sizes, ctx.group, ctx.traffic), None, None, None, None


def all_reduce_sum(tensor: Tensor, group: ProcessGroup | None = None, traffic: Traffic | None = None) -> Tensor:
    """Sum ``tensor`` over ``group``, differentiably, for a *summed* objective. Collective.

    Forward: all-reduce (sum) into a new tensor. Backward: all-reduce (sum) of the
    gradient, because every rank's own loss depends on the sum (see the module
    docstring). This is what synchronized batch norm needs.

    Args:
        tensor: This rank's contribution; same shape and dtype on every rank.
        group: Process group; ``None`` means the world.
        traffic: Optional byte counter for forward and backward messages.

    Returns:
        The sum over ranks (a new tensor).
    """
    if get_world_size(group) == 1:
        return tensor.clone()
    return _AllReduceSum.apply(tensor, group, traffic)


def copy_to_group(tensor: Tensor, group: ProcessGroup | None = None, traffic: Traffic | None = None) -> Tensor:
    """Enter a model-parallel region: identity forward, all-reduce backward. Collective in backward.

    Megatron-LM's ``f`` operator (Shoeybi et al. 2019). Apply it to a replicated
    tensor (an activation, or a replicated weight) that each rank of ``group`` uses
    for its own share of the work, under a *replicated* objective.

    Args:
        tensor: The replicated tensor; the same on every rank.
        group: Process group; ``None`` means the world.
        traffic: Optional byte counter (the backward's all-reduce).
    """
    if get_world_size(group) == 1:
        return tensor
    return _CopyToGroup.apply(tensor, group, traffic)


def gather_from_group(
    tensor: Tensor,
    dim: int,
    sizes: Sequence[int],
    group: ProcessGroup | None = None,
    traffic: Traffic | None = None,
) -> Tensor:
    """Leave a model-parallel region: all-gather along ``dim`` forward, slice backward. Collective.

    Megatron-LM's ``g`` operator (Shoeybi et al. 2019). Rank ``r`` contributes
    ``sizes[r]`` elements along ``dim`` (unequal sizes are padded for the
    all-gather and cut after); every rank receives the concatenation in rank
    order. The backward keeps this rank's slice of the (replicated) gradient and
    communicates nothing.

    Args:
        tensor: This rank's slice; all other dimensions equal on every rank.
        dim: Dimension to concatenate along.
        sizes: Every rank's slice size along ``dim``, in rank order; the same list on every rank.
        group: Process group; ``None`` means the world.
        traffic: Optional byte counter.

    Raises:
        ValueError: ``sizes`` does not have one entry per rank, or disagrees with ``tensor``.
    """
    dim = dim % tensor.dim()
    _check_sizes(tensor, dim, sizes, group, whole=False)
    if get_world_size(group) == 1:
        return tensor
    return _GatherFromGroup.apply(tensor, dim, list(sizes), group, traffic)


def scatter_to_group(
    tensor: Tensor,
    dim: int,
    sizes: Sequence[int],
    group: ProcessGroup | None = None,
    traffic: Traffic | None = None,
) -> Tensor:
    """Keep this rank's slice of a replicated tensor; all-gather the gradient backward. Collective in backward.

    The conjugate of :func:`gather_from_group`. Rank ``r`` keeps elements
    ``sum(sizes[:r]) .. sum(sizes[:r+1])`` along ``dim`` (a contiguous copy).

    Args:
        tensor: The full tensor, the same on every rank.
        dim: Dimension to split.
        sizes: Every rank's slice size, in rank order; must sum to ``tensor.shape[dim]``.
        group: Process group; ``None`` means the world.
        traffic: Optional byte counter (the backward's all-gather).

    Raises:
        ValueError: ``sizes`` does not have one entry per rank, or does not sum to the size of ``dim``.
    """
    dim = dim % tensor.dim()
    _check_sizes(tensor, dim, sizes, group, whole=True)
    if get_world_size(group) == 1:
        return tensor
    return _ScatterToGroup.apply(tensor, dim, list(sizes), group, traffic)


# -- halo exchange -------------------------------------------------------------------


def _exchange(
    messages: Sequence[tuple[int, Tensor | None, Tensor | None]],
    group: ProcessGroup | None,
    traffic: Traffic | None,
) -> None:
    """Send and receive with neighbours, all posted at once. Collective over the neighbours.

    ``messages`` holds ``(peer, send, recv)`` with ``peer`` a rank of ``group``.
    Every send and receive is posted before any is waited on
    (``batch_isend_irecv``), so no ordering between ranks is needed and no pair of
    ranks can wait on each other: the deadlock of two blocking ``send`` calls
    facing each other cannot happen. NCCL needs the batched form besides (its
    sends are kernels that wait for the matching receive).
    """
    ops = []
    for peer, send, recv in messages:
        dst = global_rank(group, peer)
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), dst, group))
            if traffic is not None:
                traffic.add(send.numel() * send.element_size(), 0)
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, dst, group))
            if traffic is not None:
                traffic.add(0, recv.numel() * recv.element_size())
    if not ops:
        return

    def run() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    _call("halo exchange", run, numbered=False)  # neighbours only: not every rank makes one


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: Tensor, dim: int, halo: int, group: ProcessGroup | None, traffic: Traffic | None
    ) -> Tensor:
        ctx.dim, ctx.halo, ctx.group, ctx.traffic = dim, halo, group, traffic
        rank, n = get_rank(group), get_world_size(group)
        length = tensor.shape[dim]
        halo_shape = list(tensor.shape)
        halo_shape[dim] = halo
        # The ends of the whole tensor get zeros: the zero padding of the
        # single-process layer, which only the first and the last rank apply.
        before = tensor.new_zeros(halo_shape)
        after = tensor.new_zeros(halo_shape)
        messages: list[tuple[int, Tensor | None, Tensor | None]] = []
        if rank > 0:  # my first rows go to the previous rank, its last rows come to me
            messages.append((rank - 1, tensor.narrow(dim, 0, halo), before))
        if rank < n - 1:
            messages.append((rank + 1, tensor.narrow(dim, length - halo, halo), after))
        _exchange(messages, group, traffic)
        return torch.cat([before, tensor, after], dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        dim, halo, group = ctx.dim, ctx.halo, ctx.group
        rank, n = get_rank(group), get_world_size(group)
        length = grad.shape[dim] - 2 * halo
        grad_in = grad.narrow(dim, halo, length).contiguous()  # a copy: the borders are added to below
        halo_shape = list(grad.shape)
        halo_shape[dim] = halo
        # The halos' gradients belong to the neighbours' border rows: send them back,
        # and receive the gradients of my border rows that the neighbours computed.
        from_before = grad.new_empty(halo_shape) if rank > 0 else None
        from_after = grad.new_empty(halo_shape) if rank < n - 1 else None
        messages: list[tuple[int, Tensor | None, Tensor | None]] = []
        if rank > 0:
            messages.append((rank - 1, grad.narrow(dim, 0, halo), from_before))
        if rank < n - 1:
            messages.append((rank + 1, grad.narrow(dim, halo + length, halo), from_after))
        _exchange(messages, group, ctx.traffic)
        if from_before is not None:
            grad_in.narrow(dim, 0, halo).add_(from_before)
        if from_after is not None:
            grad_in.narrow(dim, length - halo, halo).add_(from_after)
        return grad_in, None, None, None, None


def halo_exchange(
    tensor: Tensor,
    dim: int,
    halo: int,
    group: ProcessGroup | None = None,
    traffic: Traffic | None = None,
) -> Tensor:
    """Extend this rank's band by ``halo`` elements of each neighbour along ``dim``. Collective.

    The ranks of ``group`` hold consecutive bands of one tensor along ``dim``
    (rank 0 the first). The result is ``cat([halo_before, tensor, halo_after], dim)``
    where ``halo_before`` is the last ``halo`` elements of rank ``r-1``'s band and
    ``halo_after`` the first ``halo`` of rank ``r+1``'s; at the two ends of the
    whole tensor they are zeros. The backward sends each halo's gradient back to
    its owner, which adds it to its border elements.

    Args:
        tensor: This rank's band; all dimensions but ``dim`` equal on every rank.
        dim: The split dimension.
        halo: Elements to borrow from each side; every band must have at least this many.
        group: Process group; ``None`` means the world.
        traffic: Optional byte counter (forward and backward messages).

    Raises:
        ValueError: ``halo < 0``, or this rank's band is shorter than ``halo``.
    """
    dim = dim % tensor.dim()
    check_int("halo", halo, minimum=0, hint="rows each neighbour needs")
    if halo == 0:
        return tensor
    if tensor.shape[dim] < halo:
        raise ValueError(
            f"rank {get_rank(group)}'s band has {tensor.shape[dim]} elements along dim {dim}, fewer than "
            f"the halo of {halo} its neighbours need; use fewer ranks or a larger input"
        )
    if get_world_size(group) == 1:
        zeros_shape = list(tensor.shape)
        zeros_shape[dim] = halo
        zeros = tensor.new_zeros(zeros_shape)
        return torch.cat([zeros, tensor, zeros], dim=dim)
    return _HaloExchange.apply(tensor, dim, halo, group, traffic)
