"""Reference models, by class or by name (``create("digits_cnn")``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from bunsan.models.reference import (
    BNInceptionCIFAR,
    CIFARConvNet,
    CIFARResNet,
    MNISTConvNet,
    ResNet20,
    ResNet110,
)
from bunsan.models.small import MLP, MLP10M, MNIST1DCNN, DigitsCNN

__all__ = [
    "MLP",
    "MLP10M",
    "MNIST1DCNN",
    "BNInceptionCIFAR",
    "CIFARConvNet",
    "CIFARResNet",
    "DigitsCNN",
    "MNISTConvNet",
    "ResNet20",
    "ResNet110",
    "create",
    "names",
]

# A plain dict, not import-time decorators: one place to read, easy to grep.
_MODELS: dict[str, type[nn.Module]] = {
    "digits_cnn": DigitsCNN,
    "mlp": MLP,
    "mlp_10m": MLP10M,  # the 10.5M-parameter MLP of bench quantized and tools/predict.py
    "mnist1d_cnn": MNIST1DCNN,
    # the CNTK 2.2 benchmark's models (bunsan.models.reference)
    "bn_inception_cifar": BNInceptionCIFAR,
    "cifar_convnet": CIFARConvNet,
    "mnist_convnet": MNISTConvNet,
    "resnet20": ResNet20,
    "resnet110": ResNet110,
}


def names() -> list[str]:
    """Names accepted by :func:`create`."""
    return sorted(_MODELS)


def create(name: str, **kwargs: Any) -> nn.Module:
    """Build the model registered as ``name``; ``kwargs`` go to its constructor."""
    try:
        cls = _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(names())}") from None
    return cls(**kwargs)
