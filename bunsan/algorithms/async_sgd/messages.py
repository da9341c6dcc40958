"""The wire format between the parameter server and its workers.

One message each way per synchronization: a ``uint8`` buffer holding a 32-byte
header (four int64: kind, a count, samples, spare) and the parameters' bytes, one
segment per (dtype, device) in the order of :func:`bunsan.comm.layout.group_by_kind`,
each segment aligned to 16 bytes. Worker to server: ``PUSH``, or ``DONE`` (the last
push) with the update. Server to worker: ``REPLY`` with the global model, ``FINAL``
with the final model once every worker is done, ``WAIT`` (a keep-alive while the
server holds a reply back), or ``ABORT`` (another worker failed; the count is its rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from bunsan.comm.layout import FlatGroup, group_by_kind

__all__ = ["ABORT", "DONE", "FINAL", "KIND_NAMES", "PUSH", "REPLY", "WAIT", "MessageLayout", "payload"]

# Message kinds: header[0].
PUSH, DONE, REPLY, WAIT, FINAL, ABORT = 1, 2, 3, 4, 5, 6
KIND_NAMES = {PUSH: "PUSH", DONE: "DONE", REPLY: "REPLY", WAIT: "WAIT", FINAL: "FINAL", ABORT: "ABORT"}
HEADER_BYTES = 32  # four int64
_ALIGN = 16  # every dtype's segment starts at a multiple of this many bytes


@dataclass
class _Segment(FlatGroup):
    """The parameters of one (dtype, device), laid out one after another in a message."""

    start: int = 0  # byte offset of the segment in the message
    nbytes: int = 0


class MessageLayout:
    """Where each parameter's values lie in a message (the same on every rank)."""

    def __init__(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        self.segments: list[_Segment] = []
        position = HEADER_BYTES
        for members in group_by_kind(named_params):
            segment = _Segment(**FlatGroup.fields_of(members), start=position)
            segment.nbytes = segment.numel * segment.params[0].element_size()
            self.segments.append(segment)
            position += -(-segment.nbytes // _ALIGN) * _ALIGN
        self.nbytes = position

    def message(self) -> Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    @staticmethod
    def header(message: Tensor) -> Tensor:
        return message[:HEADER_BYTES].view(torch.int64)

    def views(self, message: Tensor) -> list[Tensor]:
        """One flat typed view of ``message`` per segment."""
        return [message[s.start : s.start + s.nbytes].view(s.dtype) for s in self.segments]

    @torch.no_grad()
    def gather(self, views: Sequence[Tensor]) -> None:
        """Copy the parameters into ``views``, in place."""
        for s, flat in zip(self.segments, views):
            s.pack(flat)

    def scatter(self, views: Sequence[Tensor]) -> None:
        """Copy ``views`` into the parameters, in place."""
        for s, flat in zip(self.segments, views):
            s.unpack(flat)

    def named(self, views: Sequence[Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for s, flat in zip(self.segments, views):
            out.update(s.named(flat))
        return out

    @torch.no_grad()
    def load_named(self, views: Sequence[Tensor], saved: Mapping[str, Tensor], what: str) -> None:
        """Copy ``saved`` (by parameter name) into ``views``; raise CheckpointError if it is another model's."""
        for s, flat in zip(self.segments, views):
            s.load_named(flat, saved, what)


def payload(message: Tensor) -> Tensor:
    """Everything of ``message`` after the header."""
    return message[HEADER_BYTES:]
