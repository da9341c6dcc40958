"""Spatial model parallelism: an image split into bands of rows across the ranks of a group.

Rank ``r`` holds a contiguous band of rows of every activation (rank 0 the top
band). A convolution needs, at the border of a band, the rows just beyond it:
each rank borrows them from its neighbours (a *halo exchange*, the classic
domain decomposition of stencil codes; for CNNs see Dryden et al. 2019,
"Improving Strong-Scaling of CNN Training by Exploiting Finer-Grained
Parallelism", and Jia et al. 2019, "Beyond Data and Model Parallelism for Deep
Neural Networks", cited by the ChainerMN material). A 3x3 convolution borrows one
row from each side, so the bytes exchanged are a thin border, not the whole
activation as in channel-wise model parallelism.

A small CNN runs split like this (every rank runs the same code)::

    x = split_height(x, group)                        # this rank's band of the replicated input
    x = relu(SpatialParallelConv2d(1, 8, 3)(x))       # halo exchange, then a local convolution
    x = SpatialParallelMaxPool2d(2)(x)                # local: every band has an even number of rows
    x = relu(SpatialParallelConv2d(8, 8, 3)(x))
    x = gather_height(x, group)                       # the full activation, replicated
    y = linear(x.flatten(1))                          # replicated layers as usual

Gradients: every rank computes the same loss from the same gathered activation
(a *replicated* objective). The convolution's weights are replicated; each rank's
backward sees only its band's share of the weight gradient, so the layer passes
its weights through :func:`bunsan.comm.autograd.copy_to_group`, whose backward
sums them over the group: after ``loss.backward()`` every rank holds the full
gradient, as in the single-process model, and a plain optimizer keeps the
replicas equal.

Supported: :class:`SpatialParallelConv2d` with stride 1, "same" zero padding,
odd kernel sizes (any dilation), any ``groups``; pooling with kernel 2 and stride 2
over bands with an even number of rows. Anything else raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.modules.utils import _pair

from bunsan.comm.autograd import copy_to_group, gather_from_group, halo_exchange, scatter_to_group, split_sizes
from bunsan.comm.collectives import Traffic, all_gather_into, get_rank, get_world_size
from bunsan.nn._split_conv import ConvConfig, SplitConv2d

__all__ = [
    "SpatialParallelAvgPool2d",
    "SpatialParallelConv2d",
    "SpatialParallelMaxPool2d",
    "gather_height",
    "split_height",
]

_HEIGHT = 2  # the split dimension of (N, C, H, W)


def split_height(x: Tensor, group: ProcessGroup | None = None, traffic: Traffic | None = None) -> Tensor:
    """This rank's band of rows of the replicated ``x``. Differentiable; collective in backward.

    ``H`` rows are cut into contiguous bands as evenly as possible, in rank order:
    rank ``r`` gets ``H // n`` rows plus one for the first ``H % n`` ranks
    (:func:`bunsan.comm.autograd.split_sizes`). The backward all-gathers the bands'
    gradients into the gradient of the whole ``x`` (communication happens only
    when ``x`` needs a gradient).

    Args:
        x: ``(N, C, H, W)``, the same on every rank of ``group``.
        group: Process group; ``None`` means the world.
        traffic: Optional byte counter.

    Raises:
        ValueError: ``x`` is not 4-D, or has fewer rows than the group has ranks.
    """
    if x.dim() != 4:
        raise ValueError(f"split_height expects (N, C, H, W), got shape {tuple(x.shape)}")
    n = get_world_size(group)
    if x.shape[_HEIGHT] < n:
        raise ValueError(f"cannot split {x.shape[_HEIGHT]} rows over {n} ranks; every rank needs at least one row")
    return scatter_to_group(x, _HEIGHT, split_sizes(x.shape[_HEIGHT], n), group, traffic)


def gather_height(
    x: Tensor, group: ProcessGroup | None = None, height: int | None = None, traffic: Traffic | None = None
) -> Tensor:
    """Join every rank's band of rows into the full activation. Collective; differentiable.

    The backward keeps this rank's band of the (replicated) gradient and
    communicates nothing.

    Args:
        x: This rank's band ``(N, C, h_r, W)``.
        group: Process group; ``None`` means the world.
        height: The full height, when known: the bands are then those of
            :func:`split_height` and no extra message is needed. Without it the
            ranks first exchange their bands' heights (one tiny all-gather).
        traffic: Optional byte counter.

    Raises:
        ValueError: ``x`` is not 4-D, or ``height`` does not fit this rank's band.
    """
    if x.dim() != 4:
        raise ValueError(f"gather_height expects (N, C, h, W), got shape {tuple(x.shape)}")
    n = get_world_size(group)
    if height is not None:
        sizes = split_sizes(height, n)
    elif n == 1:
        sizes = [x.shape[_HEIGHT]]
    else:
        mine = torch.tensor([x.shape[_HEIGHT]], dtype=torch.int64, device=x.device)
        everyone = mine.new_empty(n)
        all_gather_into(everyone, mine, group=group, traffic=traffic)
        sizes = [int(h) for h in everyone.tolist()]
    return gather_from_group(x, _HEIGHT, sizes, group, traffic)


class SpatialParallelConv2d(SplitConv2d):
    """A "same" :class:`torch.nn.Conv2d` over an image split into bands of rows across ``group``.

    Takes this rank's band ``(N, C_in, h_r, W)`` and returns the band
    ``(N, C_out, h_r, W)`` of the single-process convolution's output. Before the
    local convolution, each rank receives ``dilation * (kh - 1) / 2`` rows from
    each neighbour (:func:`bunsan.comm.autograd.halo_exchange`); the first and the
    last rank pad the image's top and bottom with zeros, as the single-process
    layer does. The width is not split and is padded locally. Forward and backward
    are collective over ``group``.

    The weights are replicated on every rank (the full ``(C_out, C_in/groups, kh,
    kw)``) and their gradients are summed over the group in backward, so each rank
    holds the single-process gradient (see the module docstring). Initialization
    draws a full :class:`torch.nn.Conv2d` from this rank's generator: with the same
    seed on every rank the replicas start equal; :meth:`from_conv` copies a given
    convolution.

    Supported: stride 1; ``padding="same"`` or the equivalent integers
    ``dilation * (k - 1) / 2``; odd kernel height and width; any dilation and
    ``groups``; zero padding. Every band needs at least as many rows as the halo.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            padding_mode: As for :class:`torch.nn.Conv2d`, within the supported set above
            (``padding`` defaults to ``"same"``).
        group: Process group whose ranks hold the bands; ``None`` means the world.
        traffic: Optional :class:`bunsan.comm.Traffic` counting this layer's bytes.
        device, dtype: Of the parameters.

    Raises:
        ValueError: For a configuration outside the supported set, naming the argument.
    """

    default_padding = "same"

    @classmethod
    def _check(cls, config: ConvConfig, group: ProcessGroup | None) -> None:
        _check_spatial(config.kernel_size, config.stride, config.padding, config.dilation, config.padding_mode)

    def _take(self, full: nn.Conv2d, group: ProcessGroup | None, traffic: Traffic | None) -> None:
        self.group = group
        self.traffic = traffic
        self.in_channels, self.out_channels = full.in_channels, full.out_channels
        self.kernel_size = _pair(full.kernel_size)
        self.dilation = _pair(full.dilation)
        self.groups = full.groups
        self.halo = self.dilation[0] * (self.kernel_size[0] - 1) // 2
        self.width_padding = self.dilation[1] * (self.kernel_size[1] - 1) // 2
        with torch.no_grad():
            self.weight = nn.Parameter(full.weight.detach().clone())
            self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"SpatialParallelConv2d expects this rank's band (N, {self.in_channels}, h, W), "
                f"got shape {tuple(x.shape)}"
            )
        x = halo_exchange(x, _HEIGHT, self.halo, self.group, self.traffic)
        # Replicated weights: each rank's backward holds its band's share of the
        # weight gradient; copy_to_group sums the shares over the group.
        weight = copy_to_group(self.weight, self.group, self.traffic)
        bias = None if self.bias is None else copy_to_group(self.bias, self.group, self.traffic)
        return F.conv2d(x, weight, bias, 1, (0, self.width_padding), self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, padding=same, "
            f"dilation={self.dilation}, halo={self.halo}"
        )


def _check_spatial(kernel_size: Any, stride: Any, padding: Any, dilation: Any, padding_mode: str) -> None:
    kh, kw = _pair(kernel_size)
    dh, dw = _pair(dilation)
    if _pair(stride) != (1, 1):
        raise ValueError(
            f"SpatialParallelConv2d supports stride=1 only, got stride={stride}; downsample with "
            "SpatialParallelMaxPool2d/AvgPool2d(2) instead"
        )
    if kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(f"SpatialParallelConv2d needs an odd kernel_size (3, 5, ...), got {kernel_size}")
    same = (dh * (kh - 1) // 2, dw * (kw - 1) // 2)
    if padding != "same" and _pair(padding) != same:
        raise ValueError(
            f"SpatialParallelConv2d supports 'same' padding only, i.e. padding='same' or {same} for "
            f"kernel_size={kernel_size}, dilation={dilation}; got padding={padding!r}"
        )
    if padding_mode != "zeros":
        raise ValueError(f"SpatialParallelConv2d supports padding_mode='zeros' only, got {padding_mode!r}")


class _SpatialPool2d(nn.Module):
    _kind = ""

    def __init__(self, kernel_size: int | tuple[int, int] = 2, stride: int | tuple[int, int] | None = None) -> None:
        super().__init__()
        if _pair(kernel_size) != (2, 2) or (stride is not None and _pair(stride) != (2, 2)):
            raise ValueError(
                f"SpatialParallel{self._kind}Pool2d supports kernel_size=2 and stride=2 (or None) only, got "
                f"kernel_size={kernel_size}, stride={stride}: larger windows would cross band borders"
            )
        self.kernel_size = 2

    def _check(self, x: Tensor) -> None:
        if x.dim() != 4:
            raise ValueError(f"SpatialParallel{self._kind}Pool2d expects (N, C, h, W), got shape {tuple(x.shape)}")
        if x.shape[_HEIGHT] % 2:
            # A window would straddle two ranks' bands. Only this rank can see it;
            # it raises, and bunsan's failure handling ends the other ranks.
            raise ValueError(
                f"rank {get_rank()}: SpatialParallel{self._kind}Pool2d needs an even number of rows in "
                f"every band, this band has {x.shape[_HEIGHT]}; make the image height divisible by "
                "2 x ranks (per pooling layer)"
            )

    def extra_repr(self) -> str:
        return "kernel_size=2, stride=2"


class SpatialParallelMaxPool2d(_SpatialPool2d):
    """2x2 max pooling, stride 2, on this rank's band of rows: local, no communication.

    Equals :class:`torch.nn.MaxPool2d(2)` of the whole image when every band has an
    even number of rows (windows then never cross a border); raises
    ``ValueError`` otherwise.
    """

    _kind = "Max"

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return F.max_pool2d(x, 2, 2)


class SpatialParallelAvgPool2d(_SpatialPool2d):
    """2x2 average pooling, stride 2, on this rank's band of rows: local, no communication.

    Equals :class:`torch.nn.AvgPool2d(2)` of the whole image when every band has an
    even number of rows; raises ``ValueError`` otherwise.
    """

    _kind = "Avg"

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return F.avg_pool2d(x, 2, 2)
