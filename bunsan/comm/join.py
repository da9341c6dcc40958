"""torch's join protocol for uneven inputs, as bunsan's algorithms take part in it.

``with torch.distributed.algorithms.join.Join([optimizer]): ...`` lets a rank whose
data ends early leave the loop: on exit it keeps *shadowing* the collectives of
the ranks still training (each object's ``JoinHook``) until every rank has
left, and the objects passed in (DDP models, ZeroRedundancyOptimizer, bunsan's
``DistributedOptimizer``) each shadow their own. A ``Joinable`` tells the
context, once per iteration and before its own collectives, that this rank is
still training (:func:`notify_join_context`: one small all-reduce inside a
``Join``, nothing outside one).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.join import Join, Joinable

from bunsan.comm.collectives import wait

__all__ = ["join_group", "notify_join_context"]


def join_group(group: ProcessGroup | None) -> Any:
    """The process group object a ``Join`` compares across its joinables (``None`` means the world group).

    A DDP model reports the world group itself, so ``None`` must become that object
    for ``Join([ddp_model, optimizer])`` to see one group.
    """
    return dist.group.WORLD if group is None else group


def notify_join_context(joinable: Joinable) -> None:
    """Tell an enclosing :class:`Join` that this rank has not joined. Collective inside a ``Join`` only.

    Outside a ``Join`` context (or for any but its first joinable) it does nothing.
    """
    wait(Join.notify_join_context(joinable), "join notification")
