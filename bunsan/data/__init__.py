"""Partitioned data: each worker's disjoint, deterministic share of every epoch.

``loader(dataset, batch_size)`` is what a training script needs; ``Partition``
is the sampler underneath, ``shard_indices`` the pure split, and ``scatter``
sends a data set read on one rank to all ranks.

Note: ``bunsan.data.loader`` is the function; its module is
``sys.modules["bunsan.data.loader"]``.
"""

from __future__ import annotations

from bunsan.data.loader import DistributedLoader, loader
from bunsan.data.partition import Partition, epoch_order, shard_indices, shard_size
from bunsan.data.scatter import ListDataset, scatter

__all__ = [
    "DistributedLoader",
    "ListDataset",
    "Partition",
    "epoch_order",
    "loader",
    "scatter",
    "shard_indices",
    "shard_size",
]
