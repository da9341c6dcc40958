"""Bundled and synthetic data sets: shapes, dtypes, splits, determinism, caching."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from bunsan import datasets
from bunsan.datasets import bundled


def test_digits_shapes_dtypes_and_fixed_stratified_split():
    train, test = datasets.digits("train"), datasets.digits("test")
    x, y = train.tensors
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32
    assert y.shape == (1437,) and y.dtype == torch.int64
    assert test.tensors[0].shape == (360, 1, 8, 8)
    assert 0.0 <= x.min() and x.max() == 1.0
    assert set(y.tolist()) == set(range(10))
    torch.testing.assert_close(datasets.digits("train").tensors[0], x)  # deterministic

    everything = datasets.digits("all").tensors[1]
    train_index, test_index = datasets.stratified_split(everything, 360, seed=0)
    assert len(set(train_index.tolist()) | set(test_index.tolist())) == 1797
    assert not set(train_index.tolist()) & set(test_index.tolist())
    expected = torch.bincount(everything).double() * 360 / 1797
    assert (torch.bincount(test.tensors[1]) - expected).abs().max() < 1  # each class in proportion
    assert not torch.equal(datasets.digits("test", seed=1).tensors[1], test.tensors[1])


def test_digits32_is_digits_at_cifar_shape():
    small_x, small_y = datasets.digits("test").tensors
    x, y = datasets.load("digits32", "test").tensors
    assert x.shape == (360, 3, 32, 32) and x.dtype == torch.float32 and x.is_contiguous()
    assert torch.equal(y, small_y)  # the same images, labels and split
    assert torch.equal(x[:, 0], x[:, 2]) and 0.0 <= x.min() and x.max() <= 1.0
    # each 4x4 block's mean follows its 8x8 pixel (bilinear resizing keeps the picture)
    blocks = x[:, :1].reshape(360, 1, 8, 4, 8, 4).mean(dim=(3, 5))
    assert torch.corrcoef(torch.stack([blocks.flatten(), small_x.flatten()]))[0, 1] > 0.95
    assert datasets.info("digits32").input_shape == (3, 32, 32)
    gray, gray_y = datasets.load("digits32_gray", "test").tensors
    assert gray.shape == (360, 1, 32, 32) and torch.equal(gray[:, 0], x[:, 0]) and torch.equal(gray_y, y)
    assert datasets.info("digits32_gray").input_shape == tuple(gray.shape[1:])
    with pytest.raises(ValueError, match="channels"):
        datasets.digits32("test", channels=0)


def test_bad_split_names_the_argument():
    with pytest.raises(ValueError, match="split"):
        datasets.digits("validation")


def test_mnist1d_shapes_dtypes_and_leaves_global_rng_alone():
    np.random.seed(123)
    random.seed(123)
    expected_np, expected_py = np.random.rand(), random.random()
    np.random.seed(123)
    random.seed(123)
    train = datasets.mnist1d("train", disk_cache=False)
    assert (np.random.rand(), random.random()) == (expected_np, expected_py)
    x, y = train.tensors
    assert x.shape == (4000, 1, 40) and x.dtype == torch.float32
    assert y.shape == (4000,) and y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    test = datasets.mnist1d("test", disk_cache=False)
    assert test.tensors[0].shape == (1000, 1, 40)
    x.zero_()  # callers get copies: the cache is untouched
    assert datasets.mnist1d("train", disk_cache=False).tensors[0].abs().sum() > 0


def test_mnist1d_disk_cache_round_trip(tmp_path, monkeypatch):
    data = datasets.mnist1d("train", disk_cache=False).tensors  # in-process cache: no new generation
    key = bundled._mnist1d_key({})
    bundled._write_npz(tmp_path / f"mnist1d-{key}.npz", bundled._mnist1d_memory[key])
    monkeypatch.setattr(bundled, "_mnist1d_memory", {})

    def fail(overrides):
        raise AssertionError("regenerated despite the disk cache")

    monkeypatch.setattr(bundled, "_generate_mnist1d", fail)
    again = datasets.mnist1d("train", cache_dir=tmp_path).tensors
    torch.testing.assert_close(again[0], data[0])
    assert torch.equal(again[1], data[1])
    assert bundled._read_npz(tmp_path / "missing.npz") is None


def test_mnist1d_20k_is_mnist1d_at_twenty_thousand_sequences(tmp_path, monkeypatch):
    monkeypatch.setenv("BUNSAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bundled, "_mnist1d_memory", {})
    info = datasets.info("mnist1d_20k")
    train, test = datasets.load("mnist1d_20k", "train"), datasets.load("mnist1d_20k", "test")
    assert (len(train), len(test)) == (info.train_size, info.test_size) == (16000, 4000)
    assert tuple(train.tensors[0].shape[1:]) == info.input_shape == datasets.info("mnist1d").input_shape
    assert set(test.tensors[1].tolist()) == set(range(10))
    assert list(tmp_path.glob("mnist1d-*.npz"))  # generated once, then read from the cache
    # the same generator at another size: not the default set's sequences
    assert not torch.equal(train.tensors[0][:10], datasets.mnist1d("train", disk_cache=False).tensors[0][:10])


def test_mnist1d_rejects_unknown_arguments():
    with pytest.raises(ValueError, match="bogus"):
        datasets.mnist1d(disk_cache=False, bogus=1)


def test_synthetic_shapes_and_determinism():
    x, y = datasets.synthetic(10, (3, 4, 4), num_classes=5, seed=1).tensors
    assert x.shape == (10, 3, 4, 4) and x.dtype == torch.float32
    assert y.shape == (10,) and y.dtype == torch.int64 and 0 <= y.min() and y.max() < 5
    torch.manual_seed(99)  # global state does not matter
    assert torch.equal(datasets.synthetic(10, (3, 4, 4), 5, seed=1).tensors[0], x)
    assert not torch.equal(datasets.synthetic(10, (3, 4, 4), 5, seed=2).tensors[0], x)
    assert datasets.synthetic(4, 7, 2).tensors[0].shape == (4, 7)
    with pytest.raises(ValueError, match="num_classes"):
        datasets.synthetic(4, 7, 0)


def test_info_and_load_by_name():
    assert datasets.names() == ["digits", "digits32", "digits32_gray", "mnist1d", "mnist1d_20k"]
    info = datasets.info("digits")
    x, y = datasets.load("digits", "test").tensors
    assert (tuple(x.shape[1:]), len(x)) == (info.input_shape, info.test_size)
    assert datasets.info("mnist1d").input_shape == (1, 40)
    with pytest.raises(ValueError, match="unknown data set 'cifar'"):
        datasets.info("cifar")
