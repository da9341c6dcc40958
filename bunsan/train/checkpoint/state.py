"""What a checkpoint holds besides tensors: digests, random-number-generator states, model fit checks.

All pure and local (no communication). See :mod:`bunsan.train.checkpoint`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from bunsan.errors import CheckpointError

__all__ = ["check_model_fits", "digest", "rng_state", "set_rng_state"]


def _walk_digest(obj: Any, h: Any) -> None:
    if isinstance(obj, Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _walk_digest(obj[key], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for value in obj:
            _walk_digest(value, h)
        h.update(b"]")
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def digest(obj: Any) -> str:
    """SHA-256 of a nested structure of tensors and primitives (values, dtypes and shapes)."""
    h = hashlib.sha256()
    _walk_digest(obj, h)
    return h.hexdigest()


def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu(v) for v in obj)
    return obj


# ----------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and Python random states, as tensors and lists (weights_only-safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- model fit


def check_model_fits(saved: Mapping[str, Tensor], model: nn.Module, source: str) -> None:
    """Raise one :class:`CheckpointError` naming the first entry where ``saved`` does not fit ``model``.

    Entries are compared in the model's own order: names, then shapes and dtypes.
    """
    own = model.state_dict()
    for name, tensor in own.items():
        if name not in saved:
            raise CheckpointError(
                f"{source} was saved from another model: it has no entry {name!r} "
                f"(shape {list(tensor.shape)}), which this model has"
            )
        theirs = saved[name]
        if not isinstance(theirs, Tensor) or tuple(theirs.shape) != tuple(tensor.shape):
            shape = list(theirs.shape) if isinstance(theirs, Tensor) else type(theirs).__name__
            raise CheckpointError(
                f"{source} was saved from another model: {name!r} is {shape} in the checkpoint "
                f"but {list(tensor.shape)} in this model"
            )
        if theirs.dtype != tensor.dtype:
            raise CheckpointError(
                f"{source} was saved from another model: {name!r} is {theirs.dtype} in the checkpoint "
                f"but {tensor.dtype} in this model"
            )
    extra = [name for name in saved if name not in own]
    if extra:
        raise CheckpointError(
            f"{source} was saved from another model: it has an entry {extra[0]!r} that this model lacks"
        )
