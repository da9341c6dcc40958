"""Output from one rank: ``bunsan.print``, ``rank_zero_only`` and a logging filter.

With N workers every ``print`` appears N times. The usual cure, a ``log``
function chosen once at the top of the script, does not reach the functions a
script calls; these helpers ask for the rank at the moment they run, so they
work anywhere (as Lightning's ``rank_zero_only`` and Accelerate's
``Accelerator.print`` do)::

    bunsan.print(f"epoch {epoch}: loss {loss:.4f}")        # rank 0 only

    @bunsan.rank_zero_only
    def save_plot(curve): ...                               # runs on rank 0, returns None elsewhere

    handler = logging.StreamHandler()
    handler.addFilter(bunsan.RankFilter())                  # records of rank 0 only
    logging.basicConfig(handlers=[handler], format="[rank %(rank)s] %(message)s")

Only the output is limited to one rank: never put a collective (an optimizer
step, ``bunsan.evaluate``, a ``break`` out of the training loop) behind a rank
test, or the other ranks wait for it forever.
"""

from __future__ import annotations

import builtins
import functools
import logging
from collections.abc import Callable, Collection
from typing import Any, TypeVar, cast

from bunsan import comm
from bunsan._validate import check_int
from bunsan.errors import ConfigurationError

__all__ = ["RankFilter", "print", "rank_zero_only", "this_rank"]

F = TypeVar("F", bound=Callable[..., Any])


def this_rank() -> int:
    """This process's global rank: from the process group once joined, else from the launcher's variables.

    Before :func:`bunsan.init` a script started by ``bunsan run``, torchrun,
    mpirun or srun already knows its rank from the environment; a lone process
    is rank 0.
    """
    if comm.is_initialized():
        return comm.get_rank()
    from bunsan.runtime import detect_environment

    try:
        return detect_environment().rank
    except ConfigurationError:
        return 0


def print(*args: Any, rank: int | None = 0, **kwargs: Any) -> None:
    """``builtins.print`` on rank ``rank`` only (default 0); ``rank=None`` prints on every rank.

    Takes ``print``'s arguments (``sep``, ``end``, ``file``, ``flush``). Not a
    collective: the other ranks return at once.
    """
    check_int("rank", rank, allow_none=True)
    if rank is None or this_rank() == rank:
        builtins.print(*args, **kwargs)


def rank_zero_only(fn: F) -> F:
    """Decorate ``fn`` to run on rank 0 only; on every other rank the call returns ``None``.

    The rank is read at each call, so a function decorated at import time, before
    :func:`bunsan.init`, still behaves. ``fn`` must not call collectives.
    """
    if not callable(fn):
        raise TypeError(f"rank_zero_only decorates a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if this_rank() == 0 else None

    return cast(F, wrapper)  # same parameters (functools.wraps); the result is None off rank 0, as documented


class RankFilter(logging.Filter):
    """A ``logging`` filter that passes the records of some ranks and tags every record with its rank.

    Add it to a handler (``handler.addFilter(RankFilter())``) rather than to a
    logger, so that it also sees the records of child loggers. Each record
    gets a ``rank`` attribute for the format string (``%(rank)s``).

    Args:
        ranks: Ranks whose records pass; default ``(0,)``. ``None`` passes every
            rank's records (only the ``rank`` tag is added).
        min_level: Records at this level or above pass from every rank (default
            ``logging.WARNING``: a warning on rank 3 is worth seeing). ``None``
            applies ``ranks`` to every level.
    """

    def __init__(self, ranks: Collection[int] | None = (0,), min_level: int | None = logging.WARNING) -> None:
        super().__init__()
        if ranks is not None:
            if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Collection):
                raise TypeError(f"ranks must be a collection of ints or None, got {type(ranks).__name__}")
            for r in ranks:
                check_int("each of ranks", r, minimum=0)
        self.ranks = None if ranks is None else frozenset(ranks)
        self.min_level = min_level

    def filter(self, record: logging.LogRecord) -> bool:
        rank = this_rank()
        record.rank = rank
        if self.ranks is None or rank in self.ranks:
            return True
        return self.min_level is not None and record.levelno >= self.min_level
