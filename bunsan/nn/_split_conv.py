"""What the model-parallel convolutions share: built like :class:`torch.nn.Conv2d`, or from one.

:class:`~bunsan.nn.ChannelParallelConv2d` and :class:`~bunsan.nn.SpatialParallelConv2d`
take torch's constructor arguments, draw a full ``nn.Conv2d`` from this rank's random
generator (so that with one seed on every rank the parts belong to one initialization),
and keep what this rank needs of it; :meth:`SplitConv2d.from_conv` does the same with a
given convolution. A subclass says which configurations it supports (``_check``) and
what it keeps (``_take``).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from torch import nn
from torch.distributed import ProcessGroup

from bunsan._validate import check_type
from bunsan.comm.collectives import Traffic

__all__: list[str] = []  # private to bunsan.nn


class ConvConfig(NamedTuple):
    """The settings of a convolution that decide whether a model-parallel layer supports it."""

    out_channels: int
    kernel_size: Any
    stride: Any
    padding: Any
    dilation: Any
    groups: int
    padding_mode: str


class SplitConv2d(nn.Module):
    """Base of the model-parallel convolutions; the arguments are :class:`torch.nn.Conv2d`'s.

    ``padding=None`` means the subclass's default (``default_padding``).
    """

    default_padding: ClassVar[int | str] = 0

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str | None = None,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        group: ProcessGroup | None = None,
        traffic: Traffic | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        padding = self.default_padding if padding is None else padding
        self._check(ConvConfig(out_channels, kernel_size, stride, padding, dilation, groups, padding_mode), group)
        full = nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            "zeros",  # the only padding_mode _check lets through
            device=device,
            dtype=dtype,
        )
        self._take(full, group, traffic)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, group: ProcessGroup | None = None, traffic: Traffic | None = None) -> Any:
        """This rank's layer made from ``conv`` (its weights are copied, ``conv`` is left as it is).

        Call it on every rank with the same ``conv`` (the same weights), e.g. a
        model built under the same seed, to get a layer equal to ``conv``.
        """
        check_type("conv", conv, nn.Conv2d, hint="torch.nn.Conv2d, whose weights are copied")
        config = ConvConfig(
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
            conv.padding_mode,
        )
        cls._check(config, group)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._take(conv, group, traffic)
        return layer

    @classmethod
    def _check(cls, config: ConvConfig, group: ProcessGroup | None) -> None:
        """Raise ``ValueError`` naming the argument of a configuration this layer does not support."""
        raise NotImplementedError

    def _take(self, full: nn.Conv2d, group: ProcessGroup | None, traffic: Traffic | None) -> None:
        """Keep this rank's part of ``full``."""
        raise NotImplementedError
