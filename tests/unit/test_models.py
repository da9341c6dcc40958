"""Reference models: output shapes, gradients, the registry."""

from __future__ import annotations

import pytest
import torch

from bunsan import models


@pytest.mark.parametrize(
    ("name", "kwargs", "input_shape"),
    [
        ("digits_cnn", {}, (1, 8, 8)),
        ("mnist1d_cnn", {}, (1, 40)),
        ("mnist1d_cnn", {"length": 37, "channels": 8}, (1, 37)),
        ("mlp", {"in_features": 64, "hidden": 16, "out_features": 10, "depth": 2}, (1, 8, 8)),
        ("mlp", {"in_features": 40, "out_features": 10, "depth": 0}, (40,)),
    ],
)
def test_forward_shape_and_backward(name, kwargs, input_shape):
    model = models.create(name, **kwargs)
    out = model(torch.randn(5, *input_shape))
    assert out.shape == (5, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_registry():
    assert models.names() == [
        "bn_inception_cifar",
        "cifar_convnet",
        "digits_cnn",
        "mlp",
        "mlp_10m",
        "mnist1d_cnn",
        "mnist_convnet",
        "resnet110",
        "resnet20",
    ]
    assert isinstance(models.create("digits_cnn"), models.DigitsCNN)
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        models.create("resnet")


def test_mlp_10m_is_the_benchmarks_10_5m_mlp():
    from bunsan.bench.job import build_model
    from bunsan.bench.quantized import MODELS
    from bunsan.datasets import info

    model = models.create("mlp_10m")
    bench_model, shape = MODELS["mlp-10m"]()
    assert sum(p.numel() for p in model.parameters()) == 10_512_394
    assert [p.shape for p in model.parameters()] == [p.shape for p in bench_model.parameters()]
    assert shape == (1024,)
    assert model(torch.randn(3, 1, 32, 32)).shape == (3, 10)
    # bench compare sizes it from the data set (1x32x32 digits32_gray -> 1024 inputs)
    built = build_model("mlp_10m", info("digits32_gray"))
    assert type(built) is models.MLP10M
    assert built.layers[1].in_features == 1024


def test_mlp_depth_and_validation():
    assert sum(isinstance(m, torch.nn.Linear) for m in models.MLP(4, 8, 2, depth=3).modules()) == 4
    with pytest.raises(ValueError, match="depth"):
        models.MLP(4, 8, 2, depth=-1)
    with pytest.raises(TypeError, match="MLP hidden must be an int >= 1"):
        models.MLP(4, 8.0, 2)
