"""Blockwise model-update filtering (BMUF): the pure arithmetic, unit-tested without processes.

Chen & Huo 2016 (see :mod:`bunsan.algorithms.block_momentum` for the equations, the
time-constant convention and CNTK's parameterization); used by
:class:`bunsan.algorithms.blockwise.BlockwiseSGD`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bunsan._validate import check_int, check_number

__all__ = [
    "block_gain",
    "default_block_learning_rate",
    "default_block_momentum",
    "momentum_to_time_constant",
    "reset_momentum_buffers",
    "scaled_block_momentum",
    "time_constant_to_momentum",
    "update_block_start_",
    "update_global_model_",
]


def default_block_momentum(world_size: int) -> float:
    """CNTK's default block momentum ``1 - 1/N`` for ``N`` workers (0 for one worker).

    With it ``zeta = (1 - bm) * N * block_learning_rate = block_learning_rate``.
    """
    check_int("world_size", world_size, minimum=1)
    return 1.0 - 1.0 / world_size


def default_block_learning_rate(world_size: int) -> float:
    """``1 / sqrt(N)``: the filter's long-run gain ``N * block_learning_rate`` becomes ``sqrt(N)``.

    The default for the global-minibatch framing, DDP's: the learning rate is that of the averaged
    gradient, so each local step already moves about as far as an exact step would. Averaging N
    workers' block changes divides their noise variance by N, which allows ``sqrt(N)`` times one
    worker's change at the same noise: the square-root scaling rule (Krizhevsky 2014, "One weird
    trick for parallelizing convolutional neural networks"; Hoffer et al. 2017, "Train longer,
    generalize better"). CNTK's per-worker framing, where each worker runs a single-process
    recipe and the workers' progress adds up, is ``block_learning_rate=1``: gain ``N``, the
    linear rule (docs/explanation/block-algorithms.md).
    """
    check_int("world_size", world_size, minimum=1)
    return 1.0 / math.sqrt(world_size)


def momentum_to_time_constant(block_momentum: float, block_size: int) -> float:
    """The time constant ``tau`` (samples per worker) with ``block_momentum = exp(-block_size / tau)``.

    ``block_momentum = 0`` has time constant 0 (no memory at all).
    """
    check_number("block_momentum", block_momentum, minimum=0.0, maximum=1.0, max_inclusive=False)
    if block_momentum == 0.0:
        return 0.0
    return -block_size / math.log(block_momentum)


def time_constant_to_momentum(time_constant: float, samples: float) -> float:
    """The momentum ``exp(-samples / time_constant)`` of a block of ``samples`` per worker."""
    if time_constant == 0.0:
        return 0.0
    return math.exp(-samples / time_constant)


def scaled_block_momentum(block_momentum: float, block_size: int, samples: float) -> float:
    """The block momentum for a block that held ``samples`` per worker instead of ``block_size``.

    Holding the momentum as a time constant gives ``bm ** (samples / block_size)``
    (equal to ``time_constant_to_momentum(momentum_to_time_constant(bm, block_size), samples)``):
    a half block forgets half as much (in log scale) as a full one.
    """
    check_number("samples", samples, minimum=0.0, min_inclusive=False, hint="a block that trained has samples")
    return block_momentum ** (samples / block_size)


def block_gain(block_momentum: float, world_size: int, block_learning_rate: float) -> float:
    """The block learning rate ``zeta = (1 - bm) * N * block_learning_rate`` (CNTK's convention)."""
    return (1.0 - block_momentum) * world_size * block_learning_rate


def update_global_model_(
    global_model: Tensor, momentum: Tensor, block_change: Tensor, block_momentum: float, gain: float
) -> None:
    """In place: ``D = bm * D + zeta * G`` then ``W = W + D`` (Chen & Huo 2016, eqs. 6-7).

    Args:
        global_model: ``W``, updated in place.
        momentum: ``D``, the filtered block update, updated in place.
        block_change: ``G = mean_i(w_i) - W_start``, the block's average model change.
        block_momentum: ``bm`` for this block (already scaled to its actual size).
        gain: ``zeta`` for this block.
    """
    momentum.mul_(block_momentum).add_(block_change, alpha=gain)
    global_model.add_(momentum)


def update_block_start_(
    start: Tensor, global_model: Tensor, momentum: Tensor, block_momentum: float, nesterov: bool
) -> None:
    """In place: the next block's starting model, ``W + bm * D`` (Nesterov) or ``W`` (classic)."""
    if nesterov:
        torch.add(global_model, momentum, alpha=block_momentum, out=start)
    else:
        start.copy_(global_model)


def reset_momentum_buffers(optimizer: torch.optim.Optimizer) -> int:
    """Drop the local optimizer's momentum buffers, in place; return how many were dropped.

    Only ``momentum_buffer`` entries are touched (SGD, RMSprop with momentum): the
    next step starts the momentum afresh from its gradient, as after construction.
    Adam-family moments are normalized statistics with a step count, not a
    momentum of the block's updates, and are kept.
    """
    dropped = 0
    for state in optimizer.state.values():
        if state.pop("momentum_buffer", None) is not None:
            dropped += 1
    return dropped
