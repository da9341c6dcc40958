"""Layers for distributed training: synchronized batch norm and model-parallel convolutions.

* :class:`SyncBatchNorm`, :func:`convert_sync_batchnorm`: batch statistics over the
  whole minibatch of a process group (data parallelism).
* :class:`ChannelParallelConv2d`: output channels split across a group.
* :class:`SpatialParallelConv2d` and its pooling layers, :func:`split_height`,
  :func:`gather_height`: the image split into bands of rows across a group, with
  halo exchange.

Every layer equals its single-process twin in outputs and gradients; the tests in
``tests/dist/`` check that on 2 and 4 Gloo ranks.
"""

from __future__ import annotations

from bunsan.nn.channel_parallel import ChannelParallelConv2d
from bunsan.nn.spatial_parallel import (
    SpatialParallelAvgPool2d,
    SpatialParallelConv2d,
    SpatialParallelMaxPool2d,
    gather_height,
    split_height,
)
from bunsan.nn.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "ChannelParallelConv2d",
    "SpatialParallelAvgPool2d",
    "SpatialParallelConv2d",
    "SpatialParallelMaxPool2d",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "gather_height",
    "split_height",
]
