"""Real data that needs no network: scikit-learn's digits and MNIST-1D generated from code.

Both return ``torch.utils.data.TensorDataset`` of ``(inputs, labels)`` with
float32 inputs and int64 labels, the same on every call and every machine.
They need the ``data`` extra (``pip install 'bunsan[data]'``: scikit-learn and
mnist1d); without it they raise :class:`bunsan._extras.MissingExtraError`, an
ImportError whose one sentence names the extra.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import tempfile
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from bunsan import _extras
from bunsan._validate import check_int

__all__ = ["digits", "mnist1d"]

_SPLITS = ("train", "test", "all")


def _check_split(split: str) -> str:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    return split


# ----------------------------------------------------------------------------- digits


def _load_digits_numpy() -> tuple[np.ndarray, np.ndarray]:
    # Read the CSV that scikit-learn ships (what load_digits reads) without
    # importing sklearn: that import costs ~1 s and sets KMP_* environment
    # variables in the caller's process. Fall back to load_digits if the file
    # ever moves.
    spec = _extras.find_spec("sklearn", "bunsan.datasets.digits()", "data")
    for location in spec.submodule_search_locations or ():
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[Tensor, Tensor]:
    images, labels = _load_digits_numpy()  # bundled with scikit-learn: no download
    x = torch.from_numpy(images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)  # pixels are 0..16
    return x, torch.from_numpy(labels.astype(np.int64))


def stratified_split(labels: Tensor, test_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """Split indices into (train, test) with each class in proportion. Pure, deterministic.

    Each class gets ``floor(test_size * n_c / n)`` test samples, and the
    leftover test slots go to the classes with the largest fractional parts
    (largest remainder, ties to the lower class). Within a class the test
    samples are drawn by a permutation seeded with ``seed``. Both index
    tensors are sorted.
    """
    num_samples = len(labels)
    if not 0 < test_size < num_samples:
        raise ValueError(f"test_size must be in (0, {num_samples}), got {test_size}")
    classes, counts = torch.unique(labels, return_counts=True)
    exact = counts.double() * test_size / num_samples
    quota = exact.floor().long()
    leftover = test_size - int(quota.sum())
    # Stable sort by decreasing remainder: ties keep the lower class first.
    order = torch.sort(exact - quota, descending=True, stable=True).indices
    quota[order[:leftover]] += 1
    generator = torch.Generator().manual_seed(seed)
    test = []
    for cls, count in zip(classes.tolist(), quota.tolist()):
        members = (labels == cls).nonzero().flatten()
        test.append(members[torch.randperm(len(members), generator=generator)[:count]])
    test_index = torch.cat(test).sort().values
    is_test = torch.zeros(num_samples, dtype=torch.bool)
    is_test[test_index] = True
    return (~is_test).nonzero().flatten(), test_index


def digits(split: str = "train", *, test_size: int = 360, seed: int = 0) -> TensorDataset:
    """Handwritten digits from scikit-learn (UCI "Optical Recognition of Handwritten Digits").

    1797 grey-scale images of 8x8 pixels in 10 classes, shipped inside
    scikit-learn. The split is stratified and fixed by ``seed``: by default
    1437 training and 360 test images.

    Args:
        split: ``"train"``, ``"test"`` or ``"all"``.
        test_size: Images in the test split.
        seed: Seed of the split (not of any training order).

    Returns:
        ``TensorDataset(x, y)``: ``x`` float32 ``(N, 1, 8, 8)`` in ``[0, 1]``,
        ``y`` int64 ``(N,)`` in ``0..9``.
    """
    _check_split(split)
    x, y = _digits_arrays()
    if split == "all":
        return TensorDataset(x.clone(), y.clone())
    train_index, test_index = stratified_split(y, test_size, seed)
    index = train_index if split == "train" else test_index
    return TensorDataset(x[index], y[index])


def digits32(split: str = "train", *, test_size: int = 360, seed: int = 0, channels: int = 3) -> TensorDataset:
    """:func:`digits` as CIFAR-shaped images: each 8x8 image resized to 32x32 (bilinear) on 3 equal channels.

    For models that take CIFAR's input (ResNet-20, the CIFAR convnet) where no
    CIFAR-10 files are at hand: the same 1797 images, labels and split as
    :func:`digits`, so accuracy is comparable across models and runs offline.
    ``channels=1`` (the data set ``digits32_gray``) keeps one channel: 1024 inputs,
    those of the 10.5M-parameter MLP of the benchmarks (``mlp_10m``).

    Returns:
        ``TensorDataset(x, y)``: ``x`` float32 ``(N, channels, 32, 32)`` in ``[0, 1]``, ``y`` as :func:`digits`.
    """
    import torch.nn.functional as F

    check_int("channels", channels, minimum=1)

    small = digits(split, test_size=test_size, seed=seed)
    x, y = small.tensors
    large = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
    return TensorDataset(large.expand(-1, channels, -1, -1).contiguous(), y)


# ----------------------------------------------------------------------------- MNIST-1D

_MNIST1D_KEYS = ("x", "y", "x_test", "y_test")
_mnist1d_memory: dict[str, dict[str, Tensor]] = {}


def _default_cache_dir() -> Path:
    return Path(os.environ.get("BUNSAN_CACHE_DIR") or Path.home() / ".cache" / "bunsan")


def _mnist1d_key(overrides: dict[str, Any]) -> str:
    # Keyed by the package version and the arguments changed from its defaults,
    # so that a cache hit does not have to import mnist1d (and matplotlib).
    try:
        version = metadata.version("mnist1d")
    except metadata.PackageNotFoundError:
        version = "unknown"
    text = json.dumps({"mnist1d": version, "args": overrides}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _generate_mnist1d(overrides: dict[str, Any]) -> dict[str, Tensor]:
    generator = _extras.require("mnist1d.data", "bunsan.datasets.mnist1d()", "data")
    args = generator.get_dataset_args()
    unknown = sorted(set(overrides) - set(vars(args)) | ({"url"} & set(overrides)))
    if unknown:
        known = sorted(set(vars(args)) - {"url"})
        raise ValueError(f"unknown MNIST-1D arguments {unknown}; choose among {known}")
    vars(args).update(overrides)
    # make_dataset reseeds the global numpy and random generators: put the
    # caller's state back afterwards.
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        data = generator.make_dataset(args)  # generated from code; never get_dataset(), which downloads
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    return {
        "x": torch.from_numpy(np.asarray(data["x"], dtype=np.float32)).unsqueeze(1),
        "y": torch.from_numpy(np.asarray(data["y"], dtype=np.int64)),
        "x_test": torch.from_numpy(np.asarray(data["x_test"], dtype=np.float32)).unsqueeze(1),
        "y_test": torch.from_numpy(np.asarray(data["y_test"], dtype=np.int64)),
    }


def _read_npz(path: Path) -> dict[str, Tensor] | None:
    try:
        with np.load(path, allow_pickle=False) as archive:
            data = {key: torch.from_numpy(archive[key].copy()) for key in _MNIST1D_KEYS}
    except (OSError, KeyError, ValueError):
        return None  # missing or damaged: regenerate
    if data["x"].dim() != 3 or len(data["x"]) != len(data["y"]) or len(data["x_test"]) != len(data["y_test"]):
        return None
    return data


def _write_npz(path: Path, data: dict[str, Tensor]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename: ranks that generate at the same time never see half a file.
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                arrays: dict[str, Any] = {key: value.numpy() for key, value in data.items()}
                np.savez(file, **arrays)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as error:
        warnings.warn(
            f"could not cache MNIST-1D in {path.parent}: {error}; pass disk_cache=False to skip", stacklevel=3
        )


def mnist1d(
    split: str = "train",
    *,
    disk_cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    **dataset_args: Any,
) -> TensorDataset:
    """MNIST-1D (Greydanus and Kobak, "Scaling down deep learning with MNIST-1D", ICML 2024).

    Ten 1-D templates of the digits, randomly padded, translated, scaled,
    sheared and noised into sequences of 40 values. Generated offline with
    ``mnist1d.data.make_dataset(get_dataset_args())`` (seed 42), never
    downloaded: 4000 training and 1000 test sequences by default.

    Generation takes about a second, so the result is kept in this process
    and, unless ``disk_cache=False``, in ``cache_dir`` as an ``.npz`` file
    keyed by the mnist1d version and ``dataset_args``. The global numpy and
    ``random`` states are left as they were.

    Args:
        split: ``"train"``, ``"test"`` or ``"all"`` (train then test).
        disk_cache: Read and write the on-disk cache.
        cache_dir: Where; default ``$BUNSAN_CACHE_DIR`` or ``~/.cache/bunsan``.
        **dataset_args: Overrides of ``mnist1d.data.get_dataset_args()``,
            e.g. ``num_samples=10000`` or ``seed=0``.

    Returns:
        ``TensorDataset(x, y)``: ``x`` float32 ``(N, 1, 40)``, standardized over
        the whole set; ``y`` int64 ``(N,)`` in ``0..9``.
    """
    _check_split(split)
    key = _mnist1d_key(dataset_args)
    data = _mnist1d_memory.get(key)
    if data is None:
        path = Path(cache_dir if cache_dir is not None else _default_cache_dir()) / f"mnist1d-{key}.npz"
        data = _read_npz(path) if disk_cache else None
        if data is None:
            data = _generate_mnist1d(dataset_args)
            if disk_cache:
                _write_npz(path, data)
        _mnist1d_memory[key] = data
    if split == "train":
        x, y = data["x"], data["y"]
    elif split == "test":
        x, y = data["x_test"], data["y_test"]
    else:
        x, y = torch.cat([data["x"], data["x_test"]]), torch.cat([data["y"], data["y_test"]])
    return TensorDataset(x.clone(), y.clone())  # clones: a caller's in-place edit never reaches the cache
