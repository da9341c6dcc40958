"""The models of the CNTK 2.2 distributed-training benchmark, written for PyTorch.

Each class is our own reading of a published architecture; where the CNTK
sample and the paper differ, the docstring says which one we follow and why.

===================  ======================================  ===========  =====================
name                 model                                   parameters   input
===================  ======================================  ===========  =====================
``cifar_convnet``    CNTK's ConvNet for CIFAR-10             1.20 M       ``(N, 3, 32, 32)``
``resnet20``         ResNet-20 (He et al. 2016, CIFAR)       0.27 M       ``(N, 3, H, W)``
``resnet110``        ResNet-110 (He et al. 2016, CIFAR)      1.73 M       ``(N, 3, H, W)``
``bn_inception_cifar``  BN-Inception cut down for CIFAR-10   2.66 M       ``(N, 3, H, W)``
``mnist_convnet``    CNTK's ConvNet for MNIST                0.14 M       ``(N, 1, 28, 28)``
===================  ======================================  ===========  =====================

Parameter counts are for 10 classes and the default options.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from bunsan._validate import check_int

__all__ = [
    "BNInceptionCIFAR",
    "CIFARConvNet",
    "CIFARResNet",
    "MNISTConvNet",
    "ResNet20",
    "ResNet110",
]


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        check_int(f"{owner} {name}", value, minimum=1)


def _xavier_init(model: nn.Module) -> None:
    """Xavier-uniform weights and zero biases for every convolution and linear layer, in place."""
    for layer in model.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


class CIFARConvNet(nn.Module):
    """CNTK 2.2's ConvNet for CIFAR-10 (``ConvNet_CIFAR10_DataAug_Distributed.py``), the "ConvNet" of the benchmark.

    Two stages of [conv 3x3/64, conv 3x3/64, max-pool 3x3 stride 2], every
    convolution padded; then dense 256, dropout 0.5, dense 128, dropout 0.5 and
    dense ``num_classes``; ReLU after every layer but the last. The CNTK sample
    pads its pooling too (``default_options(pad=True)``), so 32 -> 16 -> 8 and the
    first dense layer sees 8 x 8 x 64 = 4096 inputs: 1.05 M of the model's
    1.20 M parameters are in that one layer, which makes it the benchmark's
    communication-heavy model (little compute per parameter).

    The sample multiplies its 0..255 pixels by 1/256 and subtracts a mean
    image in the reader; here inputs are expected already scaled (e.g. to
    [0, 1] by :func:`bunsan.datasets.cifar10`). Initialization is CNTK's
    default, Glorot-uniform weights and zero biases.

    Args:
        num_classes: Output classes.
        image_size: Side of the square input images (32 for CIFAR-10).
        in_channels: Input channels.
        dropout: Dropout probability after each hidden dense layer.
    """

    def __init__(self, num_classes: int = 10, image_size: int = 32, in_channels: int = 3, dropout: float = 0.5) -> None:
        super().__init__()
        _check_positive("CIFARConvNet", num_classes=num_classes, image_size=image_size, in_channels=in_channels)
        layers: list[nn.Module] = []
        channels = in_channels
        for _ in range(2):
            layers += [
                nn.Conv2d(channels, 64, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(64, 64, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            ]
            channels = 64
        self.features = nn.Sequential(*layers, nn.Flatten())
        side = image_size
        for _ in range(2):
            side = (side - 1) // 2 + 1  # a padded 3x3 pooling of stride 2: ceil(side / 2)
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 256),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(256, 128),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(128, num_classes),
        )
        _xavier_init(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


def _conv_bn(in_channels: int, out_channels: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Convolution without bias ("same" padding), then batch norm: the unit of CNTK's ResNet and BN-Inception."""
    conv = nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=kernel // 2, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_in", nonlinearity="relu")  # CNTK's he_normal()
    return nn.Sequential(conv, nn.BatchNorm2d(out_channels))


def _conv_bn_relu(in_channels: int, out_channels: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(*_conv_bn(in_channels, out_channels, kernel, stride), nn.ReLU(inplace=True))


class _PadShortcut(nn.Module):
    """Option A: subsample by 2 and append zero channels; no parameters."""

    def __init__(self, extra_channels: int) -> None:
        super().__init__()
        self.extra_channels = extra_channels

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, ::2, ::2]
        zeros = x.new_zeros(x.shape[0], self.extra_channels, x.shape[2], x.shape[3])
        return torch.cat([x, zeros], dim=1)


class _BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with ReLU between, plus the shortcut, then ReLU (He et al. 2016, Fig. 2)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv_bn_relu(in_channels, out_channels, 3, stride), _conv_bn(out_channels, out_channels, 3)
        )
        self.shortcut: nn.Module
        if stride == 1 and in_channels == out_channels:
            self.shortcut = nn.Identity()
        elif shortcut == "A":
            self.shortcut = _PadShortcut(out_channels - in_channels)
        else:
            self.shortcut = _conv_bn(in_channels, out_channels, 1, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class CIFARResNet(nn.Module):
    """ResNet for CIFAR-10 (He et al., "Deep residual learning for image recognition", CVPR 2016, section 4.2).

    A 3x3 conv-BN-ReLU of 16 channels, then three stages of ``n`` basic blocks
    with 16, 32 and 64 channels (the first block of the second and third
    stages has stride 2: 32 -> 16 -> 8 on CIFAR), global average pooling and
    one linear layer: ``depth = 6 n + 2`` layers with weights.

    Where the channel count grows, the shortcut is

    * ``"B"`` (default): a 1x1 convolution of stride 2 with batch norm, as in
      CNTK's ``resnet_basic_inc`` of the benchmark's sample, or
    * ``"A"``: the paper's parameter-free CIFAR shortcut, every second pixel
      and zero-padded channels.

    The two differ by 2,752 parameters (0.272 M vs 0.270 M for ResNet-20).
    Convolution weights are He-normal, as in CNTK; pooling is global, so
    inputs of any size from 8x8 up work.

    Args:
        depth: ``6 n + 2``: 20, 32, 44, 56, 110, ...
        num_classes: Output classes.
        shortcut: ``"A"`` or ``"B"``, see above.
        in_channels: Input channels.
        widths: Channels of the three stages.
    """

    def __init__(
        self,
        depth: int = 20,
        num_classes: int = 10,
        shortcut: str = "B",
        in_channels: int = 3,
        widths: Sequence[int] = (16, 32, 64),
    ) -> None:
        super().__init__()
        _check_positive("CIFARResNet", depth=depth, num_classes=num_classes, in_channels=in_channels)
        if (depth - 2) % 6 or depth < 8:
            raise ValueError(f"CIFARResNet depth must be 6 n + 2 with n >= 1 (20, 32, 44, 56, 110), got {depth}")
        if shortcut not in ("A", "B"):
            raise ValueError(
                f"CIFARResNet shortcut must be 'A' (zero padding) or 'B' (1x1 projection), got {shortcut!r}"
            )
        if len(widths) != 3:
            raise ValueError(f"CIFARResNet widths must give 3 stages, got {widths!r}")
        blocks_per_stage = (depth - 2) // 6
        self.depth, self.shortcut = depth, shortcut
        layers: list[nn.Module] = [_conv_bn_relu(in_channels, widths[0], 3)]
        channels = widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(_BasicBlock(channels, width, stride, shortcut))
                channels = width
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(channels, num_classes)
        nn.init.kaiming_normal_(self.classifier.weight, mode="fan_in", nonlinearity="relu")
        nn.init.zeros_(self.classifier.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class ResNet20(CIFARResNet):
    """:class:`CIFARResNet` of depth 20 (3 blocks per stage, 0.27 M parameters)."""

    def __init__(self, num_classes: int = 10, shortcut: str = "B", in_channels: int = 3) -> None:
        super().__init__(20, num_classes, shortcut, in_channels)


class ResNet110(CIFARResNet):
    """:class:`CIFARResNet` of depth 110 (18 blocks per stage, 1.73 M parameters)."""

    def __init__(self, num_classes: int = 10, shortcut: str = "B", in_channels: int = 3) -> None:
        super().__init__(110, num_classes, shortcut, in_channels)


class _Inception(nn.Module):
    """An Inception-v2 block (Ioffe and Szegedy 2015): branches computed side by side, concatenated on channels.

    With ``stride=1``: a 1x1 branch, a 1x1 -> 3x3 branch, a 1x1 -> 3x3 -> 3x3
    branch, and a pooling (3x3, stride 1, "same") -> 1x1 branch. With
    ``stride=2`` (a "pass-through" block that halves the image): the 3x3 and
    double-3x3 branches end with stride 2, and the pooling branch is a plain
    3x3 max pooling of stride 2 of the input, with no 1x1 branch.
    """

    def __init__(
        self,
        in_channels: int,
        n1x1: int,
        n3x3_reduce: int,
        n3x3: int,
        ndbl_reduce: int,
        ndbl: int,
        npool: int,
        pool: str = "avg",
        stride: int = 1,
    ) -> None:
        super().__init__()
        self.branches = nn.ModuleList()
        if stride == 1:
            self.branches.append(_conv_bn_relu(in_channels, n1x1, 1))
        self.branches.append(
            nn.Sequential(_conv_bn_relu(in_channels, n3x3_reduce, 1), _conv_bn_relu(n3x3_reduce, n3x3, 3, stride))
        )
        self.branches.append(
            nn.Sequential(
                _conv_bn_relu(in_channels, ndbl_reduce, 1),
                _conv_bn_relu(ndbl_reduce, ndbl, 3),
                _conv_bn_relu(ndbl, ndbl, 3, stride),
            )
        )
        if stride == 1:
            pooling: nn.Module = (
                nn.AvgPool2d(3, 1, padding=1, count_include_pad=False)
                if pool == "avg"
                else nn.MaxPool2d(3, 1, padding=1)
            )
            self.branches.append(nn.Sequential(pooling, _conv_bn_relu(in_channels, npool, 1)))
            self.out_channels = n1x1 + n3x3 + ndbl + npool
        else:
            self.branches.append(nn.MaxPool2d(3, 2, padding=1))
            self.out_channels = n3x3 + ndbl + in_channels

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


class BNInceptionCIFAR(nn.Module):
    """BN-Inception cut down for 32x32 images: CNTK's ``bn_inception_cifar_model``, the benchmark's "BN-Inception".

    Our reading of the CNTK sample (``BN_Inception.py``; Ioffe and Szegedy,
    "Batch normalization", ICML 2015, for the blocks): the ImageNet stem (7x7
    stride 2, pooling) is replaced by three 3x3/32 conv-BN-ReLU layers, a 1x1/32
    and a 3x3/64, all at full resolution; then six Inception blocks (block
    arguments: 1x1, 3x3 reduce, 3x3, double-3x3 reduce, double-3x3, pool
    projection):

    ======  =============================  ==========  ======
    block   arguments                      pooling     image
    ======  =============================  ==========  ======
    3a      32, 32, 32, 32, 48, 16         average     32
    3b      -, 64, 80, 32, 48, -           stride 2    32->16
    4a      96, 48, 64, 48, 64, 64         average     16
    4b      48, 64, 96, 80, 96, 64         average     16
    4c      -, 128, 192, 192, 256, -       stride 2    16->8
    5a      176, 96, 160, 96, 112, 64      max         8
    ======  =============================  ==========  ======

    then global average pooling and one linear layer. The sample's comments
    give some widths that its arithmetic does not (e.g. 288 channels after 4b,
    where the branches add up to 304); here every width follows from the block
    arguments. The average-pooling branch does not count the zero padding.
    Every convolution is bias-free and followed by batch norm and ReLU; He-normal
    weights as in the sample. 2.66 M parameters, 1.35 M of them in block 4c.

    Args:
        num_classes: Output classes.
        in_channels: Input channels.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        _check_positive("BNInceptionCIFAR", num_classes=num_classes, in_channels=in_channels)
        stem = nn.Sequential(
            _conv_bn_relu(in_channels, 32, 3),
            _conv_bn_relu(32, 32, 3),
            _conv_bn_relu(32, 32, 3),
            _conv_bn_relu(32, 32, 1),
            _conv_bn_relu(32, 64, 3),
        )
        blocks: list[_Inception] = []
        channels = 64
        for args, pool, stride in (
            ((32, 32, 32, 32, 48, 16), "avg", 1),
            ((0, 64, 80, 32, 48, 0), "max", 2),
            ((96, 48, 64, 48, 64, 64), "avg", 1),
            ((48, 64, 96, 80, 96, 64), "avg", 1),
            ((0, 128, 192, 192, 256, 0), "max", 2),
            ((176, 96, 160, 96, 112, 64), "max", 1),
        ):
            block = _Inception(channels, *args, pool=pool, stride=stride)
            blocks.append(block)
            channels = block.out_channels
        self.features = nn.Sequential(stem, *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(channels, num_classes)
        nn.init.kaiming_normal_(self.classifier.weight, mode="fan_in", nonlinearity="relu")
        nn.init.zeros_(self.classifier.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class MNISTConvNet(nn.Module):
    """CNTK 2.2's ConvNet for MNIST (``ConvNet_MNIST.py`` and the distributed-training article).

    conv 5x5/32 (padded), max-pool 2, conv 3x3/48, max-pool 2, conv 3x3/64,
    dense 96, dropout 0.5, dense ``num_classes``; ReLU everywhere;
    Glorot-uniform weights and zero biases, CNTK's defaults.

    CNTK leaves the 3x3 convolutions unpadded (28x28 -> 4x4x64 before the
    dense layer). On images too small for that (the 8x8 digits would shrink
    below one pixel) they are padded instead; the flatten size is worked out
    from ``image_size`` either way. The layer names (``features``,
    ``classifier``) are those of ``examples/cntk_mnist.py``, whose
    checkpoints load into this class.

    Args:
        image_size: Side of the square 1-channel input images (28 for MNIST, 8 for digits).
        num_classes: Output classes.
    """

    def __init__(self, image_size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        _check_positive("MNISTConvNet", image_size=image_size, num_classes=num_classes)
        unpadded = (image_size // 2 - 2) // 2 - 2  # side after the last 3x3 convolution without padding
        pad = 0 if unpadded >= 1 else 1
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(32, 48, 3, padding=pad),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(48, 64, 3, padding=pad),
            nn.ReLU(),
            nn.Flatten(),
        )
        side = image_size // 2
        side = (side + 2 * pad - 2) // 2
        side = side + 2 * pad - 2
        if side < 1:
            raise ValueError(f"MNISTConvNet image_size {image_size} is too small; use 4 or more")
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 96),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(96, num_classes),
        )
        _xavier_init(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))
