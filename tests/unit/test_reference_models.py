"""The CNTK benchmark's reference models: shapes, parameter counts, a backward pass, the registry."""

from __future__ import annotations

import pytest
import torch

from bunsan import models
from bunsan.models import reference


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "kwargs", "input_shape"),
    [
        ("cifar_convnet", {}, (3, 32, 32)),
        ("cifar_convnet", {"image_size": 12}, (3, 12, 12)),
        ("resnet20", {}, (3, 8, 8)),  # global pooling: any size from 8x8 up
        ("resnet20", {"shortcut": "A"}, (3, 8, 8)),
        ("resnet110", {}, (3, 8, 8)),
        ("bn_inception_cifar", {}, (3, 8, 8)),
        ("mnist_convnet", {}, (1, 28, 28)),
        ("mnist_convnet", {"image_size": 8}, (1, 8, 8)),
    ],
)
def test_forward_shape_and_backward_on_tiny_inputs(name, kwargs, input_shape):
    torch.manual_seed(0)
    model = models.create(name, **kwargs)
    out = model(torch.randn(2, *input_shape))
    assert out.shape == (2, 10)
    torch.nn.functional.cross_entropy(out, torch.tensor([1, 7])).backward()
    for parameter_name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), parameter_name


def test_full_size_cifar_outputs():
    x = torch.randn(1, 3, 32, 32)
    for name in ("resnet20", "bn_inception_cifar"):
        assert models.create(name, num_classes=7).eval()(x).shape == (1, 7)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        # He et al. 2016, Table 6: ResNet-20 0.27M, ResNet-110 1.7M (option A, no projection parameters)
        (lambda: reference.CIFARResNet(20, shortcut="A"), 269_722),
        (lambda: reference.CIFARResNet(110, shortcut="A"), 1_727_962),
        # option B adds two 1x1 projections with batch norm: 16*32 + 32*64 weights + 2*(32+64) BN = 2,752
        (lambda: reference.ResNet20(), 272_474),
        (lambda: reference.ResNet110(), 1_730_714),
        # conv 1,792 + 3 x 36,928; dense 4096*256+256, 256*128+128, 128*10+10
        (lambda: reference.CIFARConvNet(), 1_195_594),
        (lambda: reference.MNISTConvNet(28), 141_786),
        (lambda: reference.BNInceptionCIFAR(), 2_657_034),
    ],
)
def test_parameter_counts(model, expected):
    assert _count(model()) == expected


def test_published_sizes_of_the_resnets():
    assert _count(models.create("resnet20")) == pytest.approx(0.27e6, rel=0.02)
    assert _count(models.create("resnet110")) == pytest.approx(1.7e6, rel=0.02)


def test_resnet_structure():
    model = reference.CIFARResNet(32)
    blocks = [m for m in model.modules() if isinstance(m, reference._BasicBlock)]
    assert len(blocks) == 15  # (32 - 2) / 6 = 5 per stage
    assert sum(isinstance(b.shortcut, torch.nn.Identity) for b in blocks) == 13  # all but the 2 that widen
    option_a = reference.CIFARResNet(20, shortcut="A")
    widening = [b for b in option_a.modules() if isinstance(b, reference._BasicBlock)][3]
    assert _count(widening.shortcut) == 0
    shortcut = widening.shortcut(torch.ones(1, 16, 8, 8))
    assert shortcut.shape == (1, 32, 4, 4) and shortcut[:, :16].eq(1).all() and shortcut[:, 16:].eq(0).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"depth": 21}, "6 n \\+ 2"),
        ({"depth": 2}, "6 n \\+ 2"),
        ({"shortcut": "C"}, "'A'"),
        ({"num_classes": 0}, "num_classes"),
    ],
)
def test_resnet_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        reference.CIFARResNet(**kwargs)


def test_inception_widths_follow_the_block_arguments():
    model = reference.BNInceptionCIFAR()
    widths = [m.out_channels for m in model.modules() if isinstance(m, reference._Inception)]
    assert widths == [128, 256, 288, 304, 752, 512]
    assert model.classifier.in_features == 512


def test_mnist_convnet_layers_are_those_of_the_cntk_example():
    # 28x28: unpadded 3x3 convolutions leave 4x4x64 = 1024 features; 8x8 digits are padded: 2x2x64 = 256.
    assert reference.MNISTConvNet(28).classifier[0].in_features == 1024
    assert reference.MNISTConvNet(8).classifier[0].in_features == 256
    keys = list(reference.MNISTConvNet(8).state_dict())
    assert keys == [
        "features.0.weight",
        "features.0.bias",
        "features.3.weight",
        "features.3.bias",
        "features.6.weight",
        "features.6.bias",
        "classifier.0.weight",
        "classifier.0.bias",
        "classifier.3.weight",
        "classifier.3.bias",
    ]


def test_registry_has_the_benchmark_models():
    for name, cls in [
        ("cifar_convnet", reference.CIFARConvNet),
        ("resnet20", reference.ResNet20),
        ("resnet110", reference.ResNet110),
        ("bn_inception_cifar", reference.BNInceptionCIFAR),
        ("mnist_convnet", reference.MNISTConvNet),
    ]:
        assert name in models.names()
        assert type(models.create(name)) is cls
    assert models.create("resnet110").depth == 110
