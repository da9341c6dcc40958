"""CIFAR-10's binary batches, on small files written in exactly that format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bunsan import datasets
from bunsan.datasets import cifar


def _write_batch(path, labels, seed):
    """Records of 1 label byte + 1024 red + 1024 green + 1024 blue bytes, rows in order."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
    records = np.concatenate([np.asarray(labels, dtype=np.uint8)[:, None], pixels], axis=1)
    path.write_bytes(records.tobytes())
    return pixels


@pytest.fixture
def root(tmp_path):
    pixels = {}
    for i in range(1, 6):
        pixels[f"data_batch_{i}.bin"] = _write_batch(tmp_path / f"data_batch_{i}.bin", [i, 9 - i], seed=i)
    pixels["test_batch.bin"] = _write_batch(tmp_path / "test_batch.bin", [0, 3, 9], seed=0)
    return tmp_path, pixels


def test_reads_both_splits_in_order(root):
    path, pixels = root
    train = datasets.cifar10(path, "train")
    x, y = train.tensors
    assert x.shape == (10, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == [1, 8, 2, 7, 3, 6, 4, 5, 5, 4]
    expected = np.concatenate([pixels[f"data_batch_{i}.bin"] for i in range(1, 6)]) / 255.0
    torch.testing.assert_close(x.reshape(10, -1), torch.from_numpy(expected).float())
    x_test, y_test = datasets.cifar10(path, split="test").tensors
    assert x_test.shape == (3, 3, 32, 32) and y_test.tolist() == [0, 3, 9]
    assert 0.0 <= float(x_test.min()) and float(x_test.max()) <= 1.0


def test_planes_and_rows_land_where_they_belong(tmp_path):
    record = np.zeros(cifar.RECORD_BYTES, dtype=np.uint8)
    record[0] = 6  # frog
    record[1 + 0] = 255  # red, row 0, column 0
    record[1 + 1024 + 32 * 2 + 5] = 51  # green, row 2, column 5
    record[1 + 2048 + 32 * 31 + 31] = 102  # blue, row 31, column 31
    (tmp_path / "test_batch.bin").write_bytes(record.tobytes())
    x, y = datasets.cifar10(tmp_path, "test").tensors
    assert cifar.CIFAR10_CLASSES[int(y[0])] == "frog"
    assert float(x[0, 0, 0, 0]) == 1.0
    assert float(x[0, 1, 2, 5]) == pytest.approx(0.2)
    assert float(x[0, 2, 31, 31]) == pytest.approx(0.4)
    assert float(x.sum()) == pytest.approx(1.6)


def test_finds_the_unpacked_tarball_directory(root, tmp_path_factory):
    path, _ = root
    parent = tmp_path_factory.mktemp("parent")
    (parent / "cifar-10-batches-bin").symlink_to(path, target_is_directory=True)
    assert len(datasets.cifar10(parent, "test")) == 3


def test_missing_file_is_named(root):
    path, _ = root
    (path / "data_batch_4.bin").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4.bin is missing"):
        datasets.cifar10(path, "train")
    assert len(datasets.cifar10(path, "test")) == 3  # the other split is still fine
    with pytest.raises(FileNotFoundError, match="does not exist"):
        datasets.cifar10(path / "nowhere")


def test_short_file_is_refused(root):
    path, _ = root
    data = (path / "test_batch.bin").read_bytes()
    (path / "test_batch.bin").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"test_batch.bin has 9119 bytes: 2 whole records of 3073 bytes and 2973"):
        datasets.cifar10(path, "test")
    (path / "test_batch.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="0 bytes"):
        datasets.cifar10(path, "test")


def test_bad_label_and_bad_split(root):
    path, _ = root
    _write_batch(path / "test_batch.bin", [1, 10], seed=3)
    with pytest.raises(ValueError, match="record 1 has label 10"):
        datasets.cifar10(path, "test")
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        datasets.cifar10(path, "valid")
