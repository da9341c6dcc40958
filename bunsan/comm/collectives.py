"""Collectives on tensors and lists of tensors, with counted traffic and clear errors.

Every call here is *collective*: all ranks of ``group`` must call it in the same
order with tensors of the same sizes. Each wrapper

* counts the bytes this rank sends and receives into an optional
  :class:`Traffic` (the algorithms' ``stats()`` come from these counts), and
* turns torch's errors into :class:`bunsan.errors.CommunicationError`, naming the
  ranks that never reached the collective when it timed out.

Bytes are counted per call from the actual message sizes, with the volume an
optimal ring algorithm moves per rank: an all-reduce of ``M`` bytes over ``N``
ranks sends ``2 (N-1)/N * M``; an all-gather or reduce-scatter whose full result
is ``M`` bytes sends ``(N-1)/N * M``; a broadcast sends ``M`` from the root.
These are the message sizes bunsan hands to the backend, not packet captures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_choice
from bunsan.comm import group as _group
from bunsan.comm import inspector as _inspector
from bunsan.comm.layout import FlatGroup, group_by_kind
from bunsan.errors import CommunicationError

__all__ = [
    "Traffic",
    "all_gather_into",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast_tensors",
    "get_backend",
    "get_rank",
    "get_world_size",
    "global_rank",
    "is_initialized",
    "tensor_device",
    "wait",
]

T = TypeVar("T")


@dataclass
class Traffic:
    """Bytes this rank sent and received, and how many collectives it took part in."""

    sent: int = 0
    received: int = 0
    calls: int = 0

    def add(self, sent: float, received: float) -> None:
        self.sent += int(sent)
        self.received += int(received)
        self.calls += 1

    def reset(self) -> None:
        self.sent = self.received = self.calls = 0


def is_initialized() -> bool:
    """Whether torch.distributed has a default process group in this process."""
    return dist.is_available() and dist.is_initialized()


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend of ``group`` (``"gloo"``, ``"nccl"``), or ``"none"`` without a process group."""
    return str(dist.get_backend(group)) if is_initialized() else "none"


def tensor_device(group: ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live for ``group``'s backend to move it: NCCL moves only CUDA tensors (the
    current device's), Gloo and no process group the CPU's. A collective of a few numbers (a maximum
    over ranks, a count) allocates its tensor here, or it fails on NCCL even at one worker."""
    if get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 when there is no process group)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (1 when there is no process group)."""
    return dist.get_world_size(group) if is_initialized() else 1


def _call(
    what: str,
    fn: Callable[[], T],
    *,
    group: ProcessGroup | None = None,
    tensor: Tensor | None = None,
    blocking: bool = True,
    numbered: bool = True,
) -> T:
    """Run one collective: number it (per group, the same on every rank) and translate its errors.

    ``blocking`` marks the rank as waiting while ``fn`` runs, so that the watch
    thread can compare the ranks' recent collectives when the wait is long
    (:mod:`bunsan.comm.inspector`); an asynchronous start is timed in :func:`wait`.
    ``numbered=False`` is for exchanges that not every rank of the group makes
    (a halo exchange between neighbours), which must not enter the comparison.
    """
    seq = _group.note_collective()
    if numbered:
        _inspector.started(what, group, tensor)
    waits = blocking and _inspector.begin_wait()
    try:
        return fn()
    except CommunicationError:
        raise
    except RuntimeError as e:
        raise _communication_error(what, seq, e) from e
    finally:
        _inspector.end_wait(waits)


def _communication_error(what: str, seq: int, e: BaseException) -> CommunicationError:
    text = str(e)
    first = text.splitlines()[0] if text else type(e).__name__
    if "no backend type associated with device type" in text.lower():  # no peer died: the tensor's device
        return CommunicationError(
            f"{what} (collective #{seq}) failed: its tensor is on a device that this process group's backend "
            "does not move (NCCL moves only CUDA tensors, Gloo CPU ones); allocate it on "
            f"bunsan.comm.tensor_device(group). Backend said: {first}"
        )
    # The peers' published states often say what went wrong (a forgotten join(),
    # collectives out of step); that sentence comes first, the backend's after it.
    # Inside finalize()'s join the likely cause needs no store (which may have died with the peer).
    named = _inspector.in_finalize_join_hint() or _inspector.diagnose()
    if named is not None:
        return CommunicationError(f"{what} (collective #{seq}) failed: {named}. Backend said: {first}")
    if "timed out" in text.lower() or "timeout" in text.lower():
        lagging = _group.lagging_ranks()
        who = f"ranks {lagging} never reached it" if lagging else "the missing ranks are unknown"
        return CommunicationError(f"{what} (collective #{seq}) timed out: {who}. Backend said: {first}")
    return CommunicationError(f"{what} (collective #{seq}) failed, most likely because another rank died: {first}")


def wait(work: Any, what: str = "collective") -> None:
    """Wait for an asynchronous collective started by :func:`all_reduce`."""
    if work is None:
        return
    waits = _inspector.begin_wait()
    try:
        work.wait()
    except RuntimeError as e:
        raise _communication_error(what, _group.collectives_started(), e) from e
    finally:
        _inspector.end_wait(waits)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@functools.cache
def _allreduce_options(op: str) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = _REDUCE_OPS[op]  # type: ignore[assignment]  # torch's stub: RedOpType for ReduceOp
    return options


def all_reduce(
    tensor: Tensor,
    *,
    op: str = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
    traffic: Traffic | None = None,
) -> Any:
    """Reduce ``tensor`` in place across ``group``. Collective.

    The call goes to the process group's own ``allreduce`` (as DDP's reducer and
    torch's communication hooks make it), not through ``torch.distributed.all_reduce``,
    whose Python checks cost about as much as the launch itself (15-30 us of a 30-60 us
    call, measured here): DataParallelSGD launches one per bucket on the critical
    path of backward. Complex tensors take torch's path (it reduces them as pairs of reals).

    In a group of one the tensor is already the result: nothing is sent, and no backend
    sees it (NCCL would refuse a CPU tensor even then: a lone process on a GPU machine
    whose model stays on the CPU).

    Args:
        op: ``"sum"``, ``"max"`` or ``"min"``.
        async_op: return a work handle to pass to :func:`wait` instead of blocking.

    Returns:
        The work handle when ``async_op`` (None in a group of one), else None.
    """
    check_choice("op", op, _REDUCE_OPS)
    n = get_world_size(group)
    if traffic is not None:
        nbytes = tensor.numel() * tensor.element_size()
        traffic.add(2 * (n - 1) / n * nbytes, 2 * (n - 1) / n * nbytes)
    if n == 1:
        return None
    if tensor.is_complex():
        start = functools.partial(dist.all_reduce, tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    else:
        start = functools.partial(_start_all_reduce, tensor, op, group, async_op)
    return _call("all_reduce", start, group=group, tensor=tensor, blocking=not async_op)


def _start_all_reduce(tensor: Tensor, op: str, group: ProcessGroup | None, async_op: bool) -> Any:
    process_group = group if group is not None else dist.group.WORLD
    assert process_group is not None, "all_reduce needs an initialized process group"
    work = process_group.allreduce([tensor], _allreduce_options(op))
    if async_op:
        return work
    work.wait()
    return None


def broadcast_tensors(
    tensors: Sequence[Tensor], src: int = 0, group: ProcessGroup | None = None, traffic: Traffic | None = None
) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values, in place. Collective.

    Tensors are sent as one flat message per (dtype, device), in the order of
    :func:`bunsan.comm.layout.group_by_kind`. ``src`` is a global rank. In a group of
    one there is nothing to send.
    """
    n = get_world_size(group)
    if n == 1:
        return
    is_src = get_rank() == src
    for members in group_by_kind([(str(i), t) for i, t in enumerate(tensors)]):
        layout = FlatGroup.of(members)
        flat = torch.empty(layout.numel, dtype=layout.dtype, device=layout.device)
        layout.pack(flat)
        if traffic is not None:
            nbytes = flat.numel() * flat.element_size()
            traffic.add(nbytes * (n - 1) if is_src else 0, 0 if is_src else nbytes)
        _call("broadcast", functools.partial(dist.broadcast, flat, src=src, group=group), group=group, tensor=flat)
        if not is_src:
            layout.unpack(flat)


def all_gather_into(
    output: Tensor,
    tensor: Tensor,
    group: ProcessGroup | None = None,
    traffic: Traffic | None = None,
    async_op: bool = False,
) -> Any:
    """Gather every rank's ``tensor`` into ``output`` (rank-major, 1-D concat). Collective.

    ``output`` must have ``world_size * tensor.numel()`` elements. Returns a work
    handle for :func:`wait` when ``async_op``.
    """
    n = get_world_size(group)
    if output.numel() != n * tensor.numel():
        raise ValueError(f"output has {output.numel()} elements, expected {n} x {tensor.numel()}")
    if traffic is not None:
        nbytes = tensor.numel() * tensor.element_size()
        traffic.add((n - 1) * nbytes, (n - 1) * nbytes)
    if n == 1:
        output.copy_(tensor.reshape(-1))
        return None
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; torch >= 2.4 is supported
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _call(
        "all_gather",
        lambda: gather(output, tensor.contiguous(), group=group, async_op=async_op),
        group=group,
        tensor=tensor,
        blocking=not async_op,
    )


def all_to_all(
    output: Tensor,
    tensor: Tensor,
    group: ProcessGroup | None = None,
    traffic: Traffic | None = None,
    async_op: bool = False,
) -> Any:
    """Send the ``i``-th of ``world_size`` equal slices of ``tensor`` to rank ``i``. Collective.

    ``output``'s ``j``-th slice receives rank ``j``'s slice for this rank. Returns a
    work handle for :func:`wait` when ``async_op``.
    """
    n = get_world_size(group)
    if tensor.numel() % n or output.numel() != tensor.numel():
        raise ValueError(
            f"all_to_all needs equal slices: {tensor.numel()} and {output.numel()} elements over {n} ranks"
        )
    if traffic is not None:
        nbytes = tensor.numel() * tensor.element_size()
        traffic.add((n - 1) / n * nbytes, (n - 1) / n * nbytes)
    if n == 1:
        output.copy_(tensor)
        return None
    return _call(
        "all_to_all",
        lambda: dist.all_to_all_single(output, tensor.contiguous(), group=group, async_op=async_op),
        group=group,
        tensor=tensor,
        blocking=not async_op,
    )


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s member number ``group_rank``."""
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def barrier(group: ProcessGroup | None = None) -> None:
    """Block until every rank of ``group`` has called it. Collective."""
    if is_initialized():
        _call("barrier", lambda: dist.barrier(group=group), group=group)


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order. Collective."""
    n = get_world_size(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    _call("all_gather_object", lambda: dist.all_gather_object(out, obj, group=group), group=group)
    return out
