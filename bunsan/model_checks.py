"""The model checks :func:`bunsan.distribute` makes before training: the same model on every rank.

Both are collectives. :func:`check_same_model` compares names, shapes and dtypes (one
``all_gather_object``); :func:`check_same_values` compares each parameter's checksums (one pair of
float64 all-reduces) where the caller asked not to broadcast rank 0's values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bunsan.comm import all_gather_object, all_reduce
from bunsan.errors import ModelMismatchError

__all__ = ["check_same_model", "check_same_values"]


def _signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    entries = [(f"parameter {n}", tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    entries += [(f"buffer {n}", tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return entries


def check_same_model(model: nn.Module, group: Any = None) -> None:
    """Raise :class:`ModelMismatchError` on every rank unless all ranks hold the same
    parameter and buffer names, shapes and dtypes. Collective.

    The error names the first rank that differs from rank 0 and the first entry
    that differs, identically on every rank, so no rank is left waiting.
    """
    mine = _signature(model)
    everyone = all_gather_object(mine, group=group)
    reference = everyone[0]
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        ref_by_name = {name: (shape, dtype) for name, shape, dtype in reference}
        their_by_name = {name: (shape, dtype) for name, shape, dtype in theirs}
        for name, shape, dtype in theirs:
            if name not in ref_by_name:
                raise ModelMismatchError(
                    f"model differs between ranks: rank {r} has {name} {list(shape)}, which rank 0 does not have"
                )
            if ref_by_name[name] != (shape, dtype):
                ref_shape, ref_dtype = ref_by_name[name]
                raise ModelMismatchError(
                    f"model differs between ranks: {name} is {list(shape)} {dtype} on rank {r} "
                    f"but {list(ref_shape)} {ref_dtype} on rank 0"
                )
        for name, shape, _ in reference:
            if name not in their_by_name:
                raise ModelMismatchError(
                    f"model differs between ranks: rank {r} lacks {name} {list(shape)}, which rank 0 has"
                )
        raise ModelMismatchError(
            f"model differs between ranks: rank {r} registers its parameters in another order than rank 0"
        )


def check_same_values(model: nn.Module, group: Any) -> None:
    """Collective: raise on every rank unless every rank starts from the same parameter values.

    One float64 all-reduce of per-tensor checksums (sum and sum of squares of
    each tensor): cheap, and any difference a user would care about shows.
    """
    tensors = list(model.named_parameters())
    if not tensors:
        return
    sums = torch.stack(
        [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()]) for _, p in tensors]
    ).reshape(-1)
    low, high = sums.clone(), sums.clone()
    all_reduce(low, op="min", group=group)
    all_reduce(high, op="max", group=group)
    differ = (high - low).abs() > 1e-9 * (1 + high.abs())
    if bool(differ.any()):
        first = int(differ.nonzero()[0].item()) // 2
        name = tensors[first][0]
        raise ModelMismatchError(
            f"distribute(broadcast=False): parameter {name} has different values on different ranks; "
            "seed every rank alike, load the same checkpoint on every rank, or leave broadcast=True "
            "(pass check=False to skip this check)"
        )
