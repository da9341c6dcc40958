"""Channel-parallel convolution: output channels split across the ranks of a group.

Rank ``r`` of the group holds a contiguous slice of the convolution's output
channels (its filters and their biases), computes them on the full, replicated
input, and the slices are all-gathered along the channel dimension so that every
rank continues with the full, replicated output. This is the channel-wise model
parallelism of ChainerMN's model-parallel examples; the two communication steps
are the conjugate operators of Megatron-LM (Shoeybi et al. 2019, "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism")::

    x --copy_to_group--> conv(x, W_r, b_r) --gather_from_group(dim=1)--> y
       forward: identity            forward: all-gather of every rank's channels
       backward: all-reduce (sum)   backward: keep this rank's channels of dL/dy

Every rank computes the same loss from the same ``y`` (a *replicated*
objective). Rank ``r``'s filters see only their own channels of ``dL/dy``, and the
input gradient rank ``r`` computes covers only its filters' contribution, so the
true ``dL/dx`` is the sum over ranks: the all-reduce of the backward. When ``x``
needs no gradient (the first layer), the backward communicates nothing.

Cost per layer and step on ``n`` ranks: the forward all-gathers the whole output
(each rank receives ``(n-1)/n`` of it) and the backward all-reduces a tensor of
the input's size, while the computation per rank shrinks by ``n``. That is why the
ChainerMN authors measured channel-wise model parallelism slower than one GPU
(2-3x with 4 GPUs): activations are large next to the filters, so the layer moves
far more bytes than data parallelism, which moves only gradients of the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.modules.utils import _pair

from bunsan.comm.autograd import copy_to_group, gather_from_group, split_sizes
from bunsan.comm.collectives import Traffic, get_rank, get_world_size
from bunsan.nn._split_conv import ConvConfig, SplitConv2d

__all__ = ["ChannelParallelConv2d"]


class ChannelParallelConv2d(SplitConv2d):
    """A :class:`torch.nn.Conv2d` whose output channels are split across ``group``.

    Channels are split as evenly as possible, in rank order: with ``C`` output
    channels on ``n`` ranks, rank ``r`` holds ``C // n`` channels, plus one for the
    first ``C % n`` ranks (``10`` channels on ``4`` ranks: ``3, 3, 2, 2``; see
    :func:`bunsan.comm.autograd.split_sizes`). ``self.weight`` is this rank's slice
    ``(channels[r], in_channels, kh, kw)`` and ``self.bias`` its ``(channels[r],)``.

    The input must be the same on every rank of ``group``; the output is the full
    ``(N, out_channels, H', W')`` on every rank. Forward and backward are
    collective over ``group``.

    Initialization: the layer draws a full :class:`torch.nn.Conv2d` from this
    rank's random generator and keeps its slice. With the same seed on every rank
    (the usual practice of data-parallel scripts) the layer therefore equals the
    ``nn.Conv2d`` built under that seed, and the slices are parts of one
    initialization rather than copies of each other. :meth:`from_conv` slices a
    given convolution instead.

    Supported: any ``kernel_size``, ``stride``, ``padding`` (ints, pairs,
    ``"valid"``, ``"same"``), ``dilation``, ``bias``; zero padding only and
    ``groups=1`` (grouped convolutions would need the input channels split too).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, bias:
            As for :class:`torch.nn.Conv2d` (``padding`` defaults to 0).
        group: Process group whose ranks share the layer; ``None`` means the world.
        traffic: Optional :class:`bunsan.comm.Traffic` counting this layer's bytes.
        device, dtype: Of the parameters.

    Raises:
        ValueError: ``out_channels`` is smaller than the group (a rank would hold no channel).

    Example:
        >>> conv = ChannelParallelConv2d.from_conv(nn.Conv2d(3, 64, 3, padding=1))
        >>> y = conv(x)   # x replicated on every rank; y = the full 64 channels
    """

    default_padding = 0

    @classmethod
    def _check(cls, config: ConvConfig, group: ProcessGroup | None) -> None:
        _check_supported(config.groups, config.padding_mode)
        _check_channels(config.out_channels, group)

    def _take(self, full: nn.Conv2d, group: ProcessGroup | None, traffic: Traffic | None) -> None:
        self.group = group
        self.traffic = traffic
        self.in_channels = full.in_channels
        self.out_channels = full.out_channels
        self.kernel_size = _pair(full.kernel_size)
        self.stride = _pair(full.stride)
        self.padding = full.padding
        self.dilation = _pair(full.dilation)
        self.channel_sizes = split_sizes(full.out_channels, get_world_size(group))
        rank = get_rank(group)
        self.channel_start = sum(self.channel_sizes[:rank])
        stop = self.channel_start + self.channel_sizes[rank]
        with torch.no_grad():
            self.weight = nn.Parameter(full.weight[self.channel_start : stop].clone())
            self.bias = None if full.bias is None else nn.Parameter(full.bias[self.channel_start : stop].clone())

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"ChannelParallelConv2d expects (N, {self.in_channels}, H, W), got shape {tuple(x.shape)}")
        x = copy_to_group(x, self.group, self.traffic)  # backward: sum the ranks' partial dL/dx
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
        return gather_from_group(y, 1, self.channel_sizes, self.group, self.traffic)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, channels here={self.channel_start}..{self.channel_start + self.weight.shape[0]}"
        )


def _check_supported(groups: int, padding_mode: str) -> None:
    if groups != 1:
        raise ValueError(
            f"ChannelParallelConv2d supports groups=1 only, got groups={groups}; split a grouped "
            "convolution by hand or use it unsplit"
        )
    if padding_mode != "zeros":
        raise ValueError(
            f"ChannelParallelConv2d supports padding_mode='zeros' only, got {padding_mode!r}; pad the "
            "input with torch.nn.functional.pad first and use padding=0"
        )


def _check_channels(out_channels: int, group: ProcessGroup | None) -> None:
    n = get_world_size(group)
    if out_channels < n:
        raise ValueError(
            f"out_channels={out_channels} is smaller than the group's {n} ranks, so a rank would hold no "
            "channel; use a smaller group or more channels"
        )
