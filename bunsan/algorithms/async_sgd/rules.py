"""The pure rules of asynchronous SGD: learning-rate ramp, staleness weight, staleness bound.

Unit-tested without processes; :mod:`bunsan.algorithms.async_sgd` explains where each is used.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from bunsan._validate import check_int

__all__ = ["lr_warmup_factor", "may_proceed", "scaled_lr", "staleness_scale"]


def lr_warmup_factor(samples: float, warmup: int, start: float) -> float:
    """The learning-rate multiplier after ``samples`` global samples: ``start`` rising linearly to 1 at ``warmup``.

    ``warmup = 0`` means no ramp (always 1). CNTK's ``AdjustLearningRateAtBeginning``
    ramps the same way, from a small fraction of the rate to all of it.
    """
    if warmup <= 0 or samples >= warmup:
        return 1.0
    return start + (1.0 - start) * max(float(samples), 0.0) / warmup


def staleness_scale(staleness: int) -> float:
    """The weight of an update that is ``staleness`` server updates old: ``1 / max(staleness, 1)``.

    Zhang et al. 2016 divide the learning rate by the staleness; a fresh update
    (staleness 0) is applied in full, as one of staleness 1.
    """
    return 1.0 / max(int(staleness), 1)


def may_proceed(worker: int, pushes: Mapping[int, int], done: Collection[int], bound: int | None) -> bool:
    """Whether ``worker`` may have its reply: at most ``bound`` pushes ahead of the slowest active worker.

    Workers in ``done`` have finished and do not hold anyone back. ``bound=None``
    means no bound. The slowest worker always proceeds, so waiting cannot deadlock.
    """
    if bound is None:
        return True
    active = [count for w, count in pushes.items() if w not in done]
    if not active:
        return True
    return pushes[worker] - min(active) <= bound


def scaled_lr(lr: float, world_size: int) -> float:
    """The local learning rate that makes ``world_size`` asynchronous workers step like one synchronous SGD.

    ``DataParallelSGD`` at learning rate ``lr`` moves the model once per global
    batch; AsyncSGD applies every worker's update in full, so ``lr / world_size``
    moves it about as far per sample (see the module docstring).
    """
    check_int("world_size", world_size, minimum=1)
    return lr / world_size
