"""Small reference models for the bundled data sets: fast enough for CPU tests and benchmarks."""

from __future__ import annotations

from torch import Tensor, nn

from bunsan._validate import check_int

__all__ = ["MLP", "MNIST1DCNN", "DigitsCNN"]


class DigitsCNN(nn.Module):
    """A LeNet-style CNN (LeCun et al., 1998) for 1x8x8 digits: two 3x3 convolutions, one pooling, two linear layers.

    About 151 k parameters. Input ``(N, 1, 8, 8)``, output logits ``(N, num_classes)``.

    Args:
        num_classes: Output classes.
        channels: Channels of the first convolution; the second has twice as many.
        hidden: Width of the hidden linear layer.
    """

    def __init__(self, num_classes: int = 10, channels: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class MNIST1DCNN(nn.Module):
    """A 1-D CNN for MNIST-1D sequences (Greydanus and Kobak, ICML 2024).

    Three strided convolutions with ReLU then one linear layer, the shape of
    the convolutional baseline of the MNIST-1D paper. Input ``(N, 1, 40)``,
    output logits ``(N, num_classes)``.

    Args:
        num_classes: Output classes.
        channels: Channels of every convolution.
        length: Input sequence length.
    """

    def __init__(self, num_classes: int = 10, channels: int = 32, length: int = 40) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=2),  # 40 -> 20
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),  # 20 -> 10
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),  # 10 -> 5
            nn.ReLU(),
        )
        out_length = length
        for _ in range(3):
            out_length = (out_length + 1) // 2
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(channels * out_length, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """A multi-layer perceptron: flatten, ``depth`` hidden layers of ``hidden`` units with ReLU, a linear output.

    ``depth=0`` is a linear (logistic-regression) model.

    Args:
        in_features: Inputs per sample after flattening (e.g. 64 for 1x8x8).
        hidden: Units per hidden layer; must be >= 1.
        out_features: Outputs, e.g. the number of classes.
        depth: Number of hidden layers; must be >= 0.
    """

    def __init__(self, in_features: int, hidden: int = 128, out_features: int = 10, depth: int = 2) -> None:
        super().__init__()
        for name, value, minimum in (
            ("in_features", in_features, 1),
            ("hidden", hidden, 1),
            ("out_features", out_features, 1),
            ("depth", depth, 0),
        ):
            check_int(f"MLP {name}", value, minimum=minimum)
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class MLP10M(MLP):
    """The communication-heavy 10.5M-parameter MLP of the benchmarks: three hidden layers of 2048.

    With 1024 inputs (``digits32``, 1x32x32) and 10 classes: 1024x2048 + 2 x 2048x2048 +
    2048x10 weights and their biases, 10,512,394 parameters (42 MB of fp32 gradients per
    step), against a compute of tens of milliseconds per step on one CPU core: the model of
    ``bunsan bench quantized`` and ``tools/predict.py`` where the exchange, not the
    compute, sets the step time.

    Args:
        in_features: Inputs per sample after flattening; default 1024.
        out_features: Outputs (classes); default 10.
    """

    def __init__(self, in_features: int = 1024, out_features: int = 10) -> None:
        super().__init__(in_features, hidden=2048, out_features=out_features, depth=3)
