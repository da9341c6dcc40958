"""The flat parameter layout every exchange of bunsan uses.

Collectives move one flat tensor per message, not one per parameter: a large
message pays the network latency once. The parameters of one message must share
a dtype and a device, and every rank must lay them out alike, or the ranks' sums
mix different parameters. :class:`FlatGroup` is one such run of parameters (their
names, order and element offsets); :func:`group_by_kind` splits parameters into one
group per (dtype, device) in an order every rank computes alike. Data-parallel
buckets, the block algorithms' model changes, the parameter server's messages and
:func:`bunsan.comm.broadcast_tensors` all build on it, and so share one answer to
"a checkpoint from another model" (:meth:`FlatGroup.load_named`).

Pure tensor bookkeeping: nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch
from torch import Tensor

from bunsan.errors import CheckpointError

__all__ = ["FlatGroup", "LayoutFields", "group_by_kind", "kind_order"]

Kind = tuple[torch.dtype, torch.device]


class LayoutFields(TypedDict):
    """The fields of a :class:`FlatGroup`, for the constructors of its subclasses."""

    names: list[str]
    params: list[Tensor]
    offsets: list[int]
    numel: int


@dataclass
class FlatGroup:
    """Parameters of one dtype and device, one after another in a flat tensor.

    ``offsets[i]`` is the element offset of ``params[i]``; ``numel`` the total.
    A flat tensor "of this group" is any 1-D tensor of at least ``numel`` elements
    (a bucket, a momentum buffer, a typed view of a message).
    """

    names: list[str]
    params: list[Tensor]
    offsets: list[int]
    numel: int

    @staticmethod
    def fields_of(named: Sequence[tuple[str, Tensor]]) -> LayoutFields:
        """The :class:`FlatGroup` fields of ``named`` laid out in its order (for subclasses' constructors)."""
        offsets, total = [], 0
        for _, p in named:
            offsets.append(total)
            total += p.numel()
        return LayoutFields(names=[n for n, _ in named], params=[p for _, p in named], offsets=offsets, numel=total)

    @staticmethod
    def of(named: Sequence[tuple[str, Tensor]]) -> FlatGroup:
        """The group of ``named`` (name, tensor) pairs, in this order."""
        return FlatGroup(**FlatGroup.fields_of(named))

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def zeros(self, extra: int = 0) -> Tensor:
        """A zero flat tensor of this group's dtype and device, with ``extra`` trailing elements."""
        return torch.zeros(self.numel + extra, dtype=self.dtype, device=self.device)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's slot in ``flat``, shaped like the parameter (views: writes go to ``flat``)."""
        return [flat[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def pack(self, flat: Tensor, tensors: Sequence[Tensor | None] | None = None) -> None:
        """Copy ``tensors`` (one per parameter; default the parameters) into ``flat``, in place.

        ``None`` writes zeros: a parameter with no gradient on this rank contributes nothing.
        """
        sources: Sequence[Tensor | None] = self.params if tensors is None else tensors
        for t, p, o in zip(sources, self.params, self.offsets):
            slot = flat[o : o + p.numel()]
            if t is None:
                slot.zero_()
            else:
                slot.copy_(t.detach().reshape(-1))

    def unpack(self, flat: Tensor, tensors: Sequence[Tensor] | None = None) -> None:
        """Copy ``flat``'s slots into ``tensors`` (default the parameters), in place."""
        with torch.no_grad():
            for t, view in zip(self.params if tensors is None else tensors, self.views(flat)):
                t.copy_(view)

    def named(self, flat: Tensor) -> dict[str, Tensor]:
        """``flat``'s slots by parameter name, as copies (for a checkpoint)."""
        return {name: view.detach().clone() for name, view in zip(self.names, self.views(flat))}

    def load_named(self, flat: Tensor, saved: Mapping[str, Tensor], what: str, *, strict: bool = True) -> None:
        """Copy ``saved`` (by parameter name) into ``flat``'s slots, in place.

        Raises:
            CheckpointError: with ``strict``, a parameter is missing from ``saved`` or
                has another shape there: the checkpoint is from another model. Without
                ``strict`` such parameters keep their values.
        """
        for name, view in zip(self.names, self.views(flat)):
            value = saved.get(name)
            if value is None:
                if strict:
                    raise CheckpointError(
                        f"the checkpoint's {what} has no parameter {name!r}: it is from another model"
                    )
                continue
            if tuple(value.shape) != tuple(view.shape):
                if strict:
                    raise CheckpointError(
                        f"the checkpoint's {what}[{name!r}] has shape {list(value.shape)}, the model's "
                        f"parameter has {list(view.shape)}: it is from another model"
                    )
                continue
            view.copy_(value)


def kind_order(kind: Kind) -> tuple[str, str]:
    """A sort key for (dtype, device) that every rank computes alike (no ids, no hashes)."""
    return str(kind[0]), str(kind[1])


def group_by_kind(named: Sequence[tuple[str, Tensor]]) -> list[list[tuple[str, Tensor]]]:
    """Split ``named`` into one list per (dtype, device), members in their given order.

    The lists come sorted by :func:`kind_order`, so every rank sends its groups'
    messages in the same order.
    """
    by_kind: dict[Kind, list[tuple[str, Tensor]]] = {}
    for name, t in named:
        by_kind.setdefault((t.dtype, t.device), []).append((name, t))
    return [members for _, members in sorted(by_kind.items(), key=lambda kv: kind_order(kv[0]))]
