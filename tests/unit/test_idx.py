"""The MNIST IDX reader on tiny files written here, plain and gzip-compressed."""

from __future__ import annotations

import gzip

import pytest
import torch

from bunsan.datasets.idx import IMAGES_MAGIC, LABELS_MAGIC, mnist_idx, read_idx, write_idx


def _mnist_files(root, n=5, gz=True, split="train"):
    prefix = "train" if split == "train" else "t10k"
    suffix = ".gz" if gz else ""
    images = (torch.arange(n * 4 * 3) % 256).to(torch.uint8).reshape(n, 4, 3)
    labels = torch.arange(n, dtype=torch.uint8) % 10
    write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images)
    write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    return images, labels


def test_header_is_mnists_big_endian_layout(tmp_path):
    images, labels = _mnist_files(tmp_path, n=5, gz=False)
    raw = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    assert int.from_bytes(raw[:4], "big") == IMAGES_MAGIC == 2051
    assert [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(3)] == [5, 4, 3]
    assert raw[16:] == images.numpy().tobytes()
    assert int.from_bytes((tmp_path / "train-labels-idx1-ubyte").read_bytes()[:4], "big") == LABELS_MAGIC == 2049


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("split", ["train", "test"])
def test_mnist_idx_reads_images_and_labels(tmp_path, gz, split):
    images, labels = _mnist_files(tmp_path, gz=gz, split=split)
    x, y = mnist_idx(tmp_path, split).tensors
    assert x.shape == (5, 1, 4, 3) and x.dtype == torch.float32 and y.dtype == torch.int64
    torch.testing.assert_close(x[:, 0], images.float() / 255)
    assert torch.equal(y, labels.long())


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(torch.int16, 258), (torch.int32, -70000), (torch.float32, 1.5), (torch.float64, -2.25), (torch.int8, -3)],
)
def test_other_types_are_big_endian(tmp_path, dtype, value):
    tensor = torch.tensor([[value, 0], [1, value]], dtype=dtype)
    path = write_idx(tmp_path / "t.idx", tensor)
    assert torch.equal(read_idx(path), tensor)
    if dtype == torch.int16:
        assert path.read_bytes()[12:14] == b"\x01\x02"  # 258, most significant byte first


def test_gzip_is_detected_by_content_not_name(tmp_path):
    path = tmp_path / "labels"
    path.write_bytes(gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 2, 7, 9])))
    assert read_idx(path, LABELS_MAGIC).tolist() == [7, 9]


def test_wrong_magic_is_refused_naming_the_file(tmp_path):
    _mnist_files(tmp_path, gz=False)
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte has magic number 2049, expected 2051"):
        read_idx(tmp_path / "train-labels-idx1-ubyte", IMAGES_MAGIC)
    (tmp_path / "junk").write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match="is not an IDX file"):
        read_idx(tmp_path / "junk")


def test_truncated_and_oversized_files_are_refused(tmp_path):
    path = write_idx(tmp_path / "t", torch.zeros(4, 4, dtype=torch.uint8))
    raw = path.read_bytes()
    path.write_bytes(raw[:-1])
    with pytest.raises(ValueError, match="holds 15 data bytes but its header"):
        read_idx(path)
    path.write_bytes(raw + b"\x00")
    with pytest.raises(ValueError, match="holds 17 data bytes"):
        read_idx(path)
    path.write_bytes(raw[:6])
    with pytest.raises(ValueError, match="truncated inside its header"):
        read_idx(path)


def test_missing_files_and_mismatched_counts(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        mnist_idx(tmp_path)
    _mnist_files(tmp_path, n=5)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="has 5 images but .* has 4 labels"):
        mnist_idx(tmp_path)
    with pytest.raises(ValueError, match="split must be"):
        mnist_idx(tmp_path, "validation")
