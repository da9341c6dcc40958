"""Block-Momentum SGD: blockwise model-update filtering (BMUF).

Chen & Huo 2016, "Scalable training of deep learning machines by incremental block
training with intra-block parallel optimization and blockwise model-update
filtering" (ICASSP 2016). Each worker trains its own replica for a *block* of
``block_size`` samples (per worker) with the user's local optimizer; then the
block's model changes are averaged over the workers and filtered with a block
momentum before the next block starts::

    G = mean_i(w_i) - W_start          # the block's average model change
    D = bm * D + zeta * G              # block momentum, a first-order IIR filter
    W = W + D                          # the global model
    W_start = W + bm * D   (Nesterov)  or   W   (classic)

``W_start`` is the model every replica starts the next block from (the paper's
``W_g``). CNTK's parameterization is kept: ``zeta = (1 - bm) * N *
block_learning_rate`` with ``N`` the world size, and ``bm = 1 - 1/N`` by default,
so that ``zeta = block_learning_rate`` then. The block learning rate defaults to
``1 / sqrt(N)``, for the learning rate of the global minibatch that DDP users bring;
CNTK's default, for its per-worker framing, is 1
(:func:`bunsan.algorithms.bmuf.default_block_learning_rate`).

Block momentum as a time constant (CNTK's ``blockMomentumAsTimeConstant``): ``bm``
is the momentum of a *full* block of ``block_size`` samples per worker, i.e.
``bm = exp(-block_size / tau)`` with ``tau = -block_size / ln(bm)`` samples per
worker. A block that actually held ``s`` samples per worker (a last partial
block, or minibatches that do not divide ``block_size``) is filtered with
``bm_s = exp(-s / tau) = bm ** (s / block_size)`` and ``zeta_s = (1 - bm_s) * N *
block_learning_rate``. ``s`` is the mean over the workers that contributed to the
block (the sum of their block samples divided by their number), taken from an
all-reduce so that every rank uses the same ``bm_s``. The Nesterov look-ahead
``W + bm * D`` uses the nominal ``bm``: the next block is expected to be full.

The pure arithmetic is :mod:`bunsan.algorithms.bmuf`; the communication, shared
with :class:`bunsan.algorithms.model_averaging.ModelAveragingSGD` (``bm = 0``,
``zeta = 1``), is :class:`bunsan.algorithms.blockwise.BlockwiseSGD`, whose module
lists the distributed invariants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan._validate import check_number
from bunsan.algorithms.blockwise import BlockwiseSGD
from bunsan.algorithms.bmuf import (
    block_gain,
    default_block_learning_rate,
    default_block_momentum,
    momentum_to_time_constant,
    reset_momentum_buffers,
    scaled_block_momentum,
    time_constant_to_momentum,
    update_block_start_,
    update_global_model_,
)

__all__ = [
    "BlockMomentumSGD",
    "BlockwiseSGD",
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


class BlockMomentumSGD(BlockwiseSGD):
    """Block-Momentum SGD (BMUF; Chen & Huo 2016), with CNTK's parameterization.

    Workers train locally for ``block_size`` samples each; then the block's model
    change is averaged over the workers and filtered: ``G = mean_i(w_i) - W_start``,
    ``D = bm * D + zeta * G``, ``W = W + D``; the next block starts from
    ``W_start = W + bm * D`` (Nesterov, the default) or ``W``. ``zeta = (1 - bm) * N
    * block_learning_rate``. With ``block_momentum=0`` and ``zeta = 1``
    (``block_learning_rate = 1 / N``) it is exactly model averaging.

    The momentum is held as a time constant: a block that held ``s`` samples per
    worker instead of ``block_size`` uses ``bm ** (s / block_size)`` and the
    matching ``zeta`` (see the module docstring). During the first
    ``warm_start`` samples (all workers together) gradients are averaged every
    step instead, exactly as ``DataParallelSGD()``; block training then starts from
    the model at that point.

    Ending training. Call ``optimizer.join()`` (:meth:`join`) on every rank after
    the training loop: it finishes the last partial block and, with uneven data,
    keeps a rank whose data ended early taking part in the others'
    synchronizations (with weight 0: the average is over the ranks that trained)
    until all have joined. Afterwards every replica holds the same model,
    ``W_start`` of the last synchronization. For evaluation in the middle of
    training call ``optimizer.sync_replicas()`` (:meth:`sync_replicas`) on every rank: it
    ends the current block now, leaving every replica at the same ``W_start``,
    and training goes on with a new block.

    Args:
        block_size: samples per worker in one block (CNTK's ``syncPeriod``); best a
            multiple of the minibatch size (a warning says so otherwise).
        block_momentum: ``bm`` of a full block, in ``[0, 1)``; ``None`` means
            ``1 - 1/N`` for ``N`` workers.
        block_learning_rate: scales ``zeta = (1 - bm) * N * block_learning_rate``, whose
            long-run gain is ``N * block_learning_rate``. ``None`` means ``1 / sqrt(N)``
            (gain ``sqrt(N)``), for a learning rate of the global minibatch as DDP users bring;
            ``1.0`` is CNTK's default, for its per-worker framing in which each worker runs a
            single-process recipe (:func:`bunsan.algorithms.bmuf.default_block_learning_rate`).
        nesterov: start each block from the look-ahead ``W + bm * D``.
        reset_local_momentum: drop the local optimizer's momentum buffers after
            each synchronization, so that momentum from before the average does
            not push the new model.
        warm_start: samples (all workers together) of exact synchronous SGD first.
        group: process group; ``None`` means every rank.

    Raises:
        ValueError: an argument is out of range (the message names it).
        TypeError: ``block_size`` or ``warm_start`` is not an int.

    Example:
        >>> algorithm = bunsan.BlockMomentumSGD(block_size=64 * 16)   # sync every 16 minibatches of 64
        >>> model, optimizer = bunsan.distribute(model, optimizer, algorithm)
        >>> for x, y in loader: ...                                     # the usual loop
        >>> optimizer.join()                                            # every rank: equal models after
    """

    name = "block_momentum"

    def __init__(
        self,
        block_size: int,
        *,
        block_momentum: float | None = None,
        block_learning_rate: float | None = None,
        nesterov: bool = True,
        reset_local_momentum: bool = True,
        warm_start: int = 0,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            block_size, nesterov=nesterov, reset_local_momentum=reset_local_momentum, warm_start=warm_start, group=group
        )
        check_number(
            "block_momentum",
            block_momentum,
            minimum=0.0,
            maximum=1.0,
            max_inclusive=False,
            allow_none=True,
            hint="None means 1 - 1/world_size, and 0 turns the filter off (model averaging)",
        )
        check_number(
            "block_learning_rate",
            block_learning_rate,
            minimum=0.0,
            min_inclusive=False,
            allow_none=True,
            hint="None means 1/sqrt(world_size); 1.0 is CNTK's per-worker framing",
        )
        self.requested_block_momentum = None if block_momentum is None else float(block_momentum)
        self.requested_block_learning_rate = None if block_learning_rate is None else float(block_learning_rate)
        # Resolved by setup() once the world size is known.
        self.block_momentum = self.requested_block_momentum
        self.block_learning_rate = self.requested_block_learning_rate

    def __repr__(self) -> str:
        return (
            f"BlockMomentumSGD(block_size={self.block_size}, block_momentum={self.requested_block_momentum}, "
            f"block_learning_rate={self.requested_block_learning_rate}, nesterov={self.nesterov}, "
            f"reset_local_momentum={self.reset_local_momentum}, warm_start={self.warm_start})"
        )

    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        super().setup(named_params)
        if self.requested_block_momentum is None:
            self.block_momentum = default_block_momentum(self.world_size)
        if self.requested_block_learning_rate is None:
            self.block_learning_rate = default_block_learning_rate(self.world_size)

    def _resolved_block_learning_rate(self) -> float:
        if self.block_learning_rate is None:
            self.block_learning_rate = default_block_learning_rate(self.world_size)
        return self.block_learning_rate

    def _resolved_block_momentum(self) -> float:
        if self.block_momentum is None:
            self.block_momentum = default_block_momentum(self.world_size)
        return self.block_momentum

    @property
    def lookahead_momentum(self) -> float:
        return self._resolved_block_momentum()

    @property
    def time_constant(self) -> float:
        """The block momentum as a time constant, in samples per worker."""
        return momentum_to_time_constant(self._resolved_block_momentum(), self.block_size)

    def filter_coefficients(self, samples_per_worker: float) -> tuple[float, float]:
        bm = scaled_block_momentum(self._resolved_block_momentum(), self.block_size, samples_per_worker)
        return bm, block_gain(bm, self.world_size, self._resolved_block_learning_rate())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(block_momentum=self.block_momentum, block_learning_rate=self._resolved_block_learning_rate())
        return state
