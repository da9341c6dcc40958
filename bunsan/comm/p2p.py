"""Point-to-point messages and dedicated process groups, for the parameter server.

:class:`bunsan.algorithms.AsyncSGD` talks to its server over p2p messages, not
collectives: a worker pushes and pulls when *it* is ready. This module wraps the
few torch.distributed calls it needs, as :mod:`bunsan.comm.collectives` does for
collectives:

* :func:`new_pair_groups` creates one two-rank gloo group per (root, worker) pair,
  so that every thread of the server owns a group of its own (see "Threads");
* :func:`send` / :func:`recv` (blocking) and :func:`isend` / :func:`irecv` (a
  handle to :meth:`P2PWork.wait` on) count the bytes into an optional
  :class:`~bunsan.comm.Traffic` and turn torch's errors into
  :class:`~bunsan.errors.CommunicationError` naming the peer.

Threads. Gloo's send and recv may be called from a thread other than the main
one, but bunsan never lets two threads use one process group at once: two
threads matching messages on one group could take each other's messages, and a
main thread's collective could interleave with a server thread's traffic. Each
group made here is used by exactly one thread on each of its two ranks.

Timeouts. A message that does not arrive within the group's ``timeout_s``
raises; waiting again on the same receive afterwards is not possible with gloo
(it aborts the process), so a long wait is a loop of fresh receives of
keep-alive messages, which is what AsyncSGD does. A peer that dies closes its
connections, and a pending receive from it raises at once.

Bytes counted are the message sizes handed to the backend: a send of ``M``
bytes adds ``M`` sent, a receive ``M`` received.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_number
from bunsan.comm.collectives import Traffic, is_initialized
from bunsan.errors import CommunicationError

__all__ = [
    "P2PWork",
    "destroy_group",
    "irecv",
    "isend",
    "new_pair_groups",
    "recv",
    "send",
]

T = TypeVar("T")


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _error(what: str, peer: int, e: BaseException) -> CommunicationError:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CommunicationError(
            f"{what} rank {peer} timed out: rank {peer} sent nothing in time. Backend said: {text}"
        )
    return CommunicationError(f"{what} rank {peer} failed, most likely because rank {peer} died. Backend said: {text}")


def _call(what: str, peer: int, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except CommunicationError:
        raise
    except RuntimeError as e:
        raise _error(what, peer, e) from e


def new_pair_groups(root: int, members: list[int], *, timeout_s: float) -> dict[int, ProcessGroup]:
    """Create one gloo group ``[root, w]`` for every ``w`` in ``members`` (global ranks). Collective.

    Every rank of the *job* must call it with the same arguments: torch's
    ``new_group`` is entered by all processes of the default group, in the same
    order. Gloo whatever the default backend is (CPU tensors travel), so the
    server also works beside NCCL training.

    Args:
        root: the global rank every group contains (the server).
        members: the other ranks, one group each; ``root`` itself is skipped.
        timeout_s: how long a receive on these groups waits before it raises.

    Returns:
        On ``root``: every group by its member ``w``. On a member ``w``: ``{w: group}``.
        Elsewhere: ``{}``.
    """
    if not is_initialized():
        return {}
    check_number("timeout_s", timeout_s, minimum=0.0, min_inclusive=False)
    me = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    groups: dict[int, ProcessGroup] = {}
    for w in members:  # the same order on every rank: new_group is collective
        if w == root:
            continue
        group = _call(
            "creating the server channel with",
            w,
            functools.partial(dist.new_group, ranks=sorted((root, w)), timeout=timeout, backend="gloo"),
        )
        if me in (root, w):
            groups[w] = group
    return groups


def destroy_group(group: ProcessGroup | None) -> None:
    """Release a group made by :func:`new_pair_groups` on this rank (local, not collective)."""
    if group is None or not is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError):  # already destroyed with the default group
        pass


def send(tensor: Tensor, dst: int, *, group: ProcessGroup, tag: int = 0, traffic: Traffic | None = None) -> None:
    """Send ``tensor`` to global rank ``dst``; returns once the data is handed to the backend."""
    if traffic is not None:
        traffic.add(_nbytes(tensor), 0)
    _call("sending to", dst, lambda: dist.send(tensor, dst=dst, group=group, tag=tag))


def recv(tensor: Tensor, src: int, *, group: ProcessGroup, tag: int = 0, traffic: Traffic | None = None) -> None:
    """Receive into ``tensor`` (in place) from global rank ``src``; raises after the group's timeout."""
    _call("receiving from", src, lambda: dist.recv(tensor, src=src, group=group, tag=tag))
    if traffic is not None:
        traffic.add(0, _nbytes(tensor))


class P2PWork:
    """A pending :func:`isend` or :func:`irecv`; call :meth:`wait` exactly once."""

    def __init__(self, work: Any, what: str, peer: int, received: int, traffic: Traffic | None) -> None:
        self._work, self._what, self._peer = work, what, peer
        self._received, self._traffic = received, traffic

    def wait(self) -> None:
        _call(self._what, self._peer, self._work.wait)
        if self._traffic is not None and self._received:
            self._traffic.add(0, self._received)


def isend(tensor: Tensor, dst: int, *, group: ProcessGroup, tag: int = 0, traffic: Traffic | None = None) -> P2PWork:
    """Start sending ``tensor`` to global rank ``dst``; do not touch it before ``wait()``."""
    if traffic is not None:
        traffic.add(_nbytes(tensor), 0)
    work = _call("sending to", dst, lambda: dist.isend(tensor, dst=dst, group=group, tag=tag))
    return P2PWork(work, "sending to", dst, 0, None)


def irecv(tensor: Tensor, src: int, *, group: ProcessGroup, tag: int = 0, traffic: Traffic | None = None) -> P2PWork:
    """Start receiving into ``tensor`` from global rank ``src``; it holds the data after ``wait()``."""
    work = _call("receiving from", src, lambda: dist.irecv(tensor, src=src, group=group, tag=tag))
    return P2PWork(work, "receiving from", src, _nbytes(tensor), traffic)
