"""Model-Averaging SGD: replicas trained locally, their parameters averaged every block.

Periodic parameter averaging of independently trained replicas (Povey, Zhang &
Khudanpur 2015, "Parallel training of DNNs with natural gradient and parameter
averaging", Kaldi's nnet2; Lin et al. 2020, "Don't Use Large Mini-Batches, Use
Local SGD"). CNTK calls it ModelAveragingSGD.

It is BMUF (:mod:`bunsan.algorithms.block_momentum`) with the filter turned off:
``bm = 0`` and ``zeta = 1`` give ``W = W_start + mean_i(w_i - W_start) =
mean_i(w_i)``, whatever the number of samples in a block. It shares all of
:class:`~bunsan.algorithms.block_momentum.BlockwiseSGD`'s machinery: warm start,
uneven data (:meth:`join`), :meth:`sync_replicas`, checkpoints.
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from bunsan.algorithms.blockwise import BlockwiseSGD

__all__ = ["ModelAveragingSGD"]


class ModelAveragingSGD(BlockwiseSGD):
    """Average the replicas' parameters every ``block_size`` samples per worker.

    Each worker trains its own replica with the user's optimizer; after
    ``block_size`` local samples the parameters are averaged over the workers
    that trained in the block, and every replica continues from the average.
    The local optimizer's state (momentum included) is kept across the
    average: a plain parameter average, as in CNTK's and Kaldi's model
    averaging; use ``BlockMomentumSGD(block_momentum=0, block_learning_rate=1/N,
    reset_local_momentum=True)`` to drop the momentum too. With a block of one
    minibatch and SGD without momentum it equals ``DataParallelSGD()``.

    Call ``optimizer.join()`` on every rank after the training loop (it averages
    the last partial block and handles ranks whose data ended early; afterwards
    every replica is equal), and ``optimizer.sync_replicas()`` on every rank to
    average now, e.g. before evaluating in the middle of training.

    Args:
        block_size: samples per worker between two averages (CNTK's ``syncPeriod``).
        warm_start: samples (all workers together) of exact synchronous SGD first,
            gradients averaged every step.
        group: process group; ``None`` means every rank.

    Raises:
        ValueError: ``block_size`` <= 0 or ``warm_start`` < 0.
        TypeError: ``block_size`` or ``warm_start`` is not an int.

    Example:
        >>> model, optimizer = bunsan.distribute(model, optimizer, bunsan.ModelAveragingSGD(block_size=64 * 8))
    """

    name = "model_averaging"

    def __init__(self, block_size: int, *, warm_start: int = 0, group: ProcessGroup | None = None) -> None:
        super().__init__(block_size, nesterov=False, reset_local_momentum=False, warm_start=warm_start, group=group)

    def __repr__(self) -> str:
        return f"ModelAveragingSGD(block_size={self.block_size}, warm_start={self.warm_start})"

    def filter_coefficients(self, samples_per_worker: float) -> tuple[float, float]:
        # No filter: D = G and W = W + G, the plain average, for blocks of any size.
        return 0.0, 1.0
