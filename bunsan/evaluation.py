"""Evaluate in a plain training script: one call over the workers' shards, or one all-reduce of your sums.

Two ways, both exact (every test sample counted once, sums not averages of
averages; :mod:`bunsan.train.metrics` explains why that matters)::

    # 1. bunsan splits the test set over the workers, runs the model, combines:
    result = bunsan.evaluate(model, test_set, loss_fn=F.cross_entropy)
    bunsan.print(f"test loss {result['loss']:.4f}, accuracy {result['accuracy']:.2%}")

    # 2. keep your own loop over your shard, then sum its counters over the workers:
    totals = bunsan.all_reduce_metrics({"loss": loss_sum, "correct": correct, "samples": seen})
    accuracy = totals["correct"] / totals["samples"]

Both are collectives: call them on every rank, not behind ``if bunsan.is_main()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from bunsan import comm
from bunsan._validate import check_int, check_type
from bunsan.train import metrics as _metrics

__all__ = ["all_reduce_metrics", "evaluate"]

_NAMED = {"accuracy": _metrics.accuracy, "error": _metrics.classification_error}
DEFAULT_BATCH = 1000  # global evaluation minibatch when the data carry none: memory only, not the result


def all_reduce_metrics(values: Mapping[str, Any], group: Any = None) -> dict[str, float]:
    """Sum each of this rank's numbers over every rank of ``group``; return the totals on every rank. Collective.

    Args:
        values: ``{name: number}``: Python numbers or one-element tensors
            (sums and counts, e.g. a summed loss and the samples it covers). The
            same names on every rank, in any order.
        group: Process group; ``None`` means the world.

    Returns:
        ``{name: total}`` as floats, identical on every rank. One float64
        all-reduce carries them all; counts are exact below 2**53. A job of one
        process returns the values as floats.
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"values must be a mapping of names to numbers, got {type(values).__name__}")
    names = sorted(values)  # the same order on every rank, whatever order each built its dict in
    numbers = []
    for name in names:
        value = values[name]
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"values[{name!r}] has {value.numel()} elements; pass one number per name")
            value = value.detach().item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"values[{name!r}] must be a number, got {type(value).__name__}")
        numbers.append(float(value))
    buffer = torch.tensor(numbers, dtype=torch.float64)
    if comm.get_world_size(group) > 1:
        buffer = buffer.to(comm.tensor_device(group))  # NCCL: the current CUDA device
        # Every rank must send the same number of values: a missing name would pair
        # one rank's "loss" with another's "samples". Check the names first.
        everyone = comm.all_gather_object(names, group=group)
        if any(other != names for other in everyone):
            raise ValueError(f"all_reduce_metrics got different names on different ranks: {everyone}")
        comm.all_reduce(buffer, group=group)
    return dict(zip(names, buffer.cpu().tolist(), strict=True))


def evaluate(
    model: nn.Module,
    data: Dataset | DataLoader | Sequence[Tensor] | Any,
    metrics: Mapping[str, Callable[[Tensor, Tensor], Tensor]] | Sequence[str] = ("accuracy",),
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    *,
    batch_size: int | None = None,
    device: torch.device | None = None,
    group: Any = None,
) -> dict[str, float]:
    """Loss and metrics of ``model`` on all of ``data``, split over the workers, exact. Collective.

    Worker ``r`` of ``w`` runs the model on samples ``r, r + w, ...``, in eval
    mode and without gradients; sums and counts are then all-reduced once
    (:func:`bunsan.train.metrics.evaluate`). Every worker gets the same result.

    Args:
        model: The model; put back in its training mode afterwards.
        data: A map-style data set of ``(inputs..., target)`` items, a tuple of
            tensors ``(x, y)``, or a ``DataLoader`` / :func:`bunsan.data.loader`
            over one (its whole ``dataset`` is evaluated, with its
            ``collate_fn``; a loader's ``batch_size`` is taken per worker).
        metrics: ``{name: fn(output, target) -> per-sample values}``, or names
            of the built-in ones: ``"accuracy"``, ``"error"``.
        loss_fn: ``loss_fn(output, target)``, averaged over the batch (e.g.
            ``F.cross_entropy``); ``None`` reports no loss.
        batch_size: Samples per forward pass on each worker; default the
            loader's, else 1000 over all workers.
        device: Where to run; default the device of the model's first parameter.
        group: Process group; ``None`` means the world.

    Returns:
        ``{"loss": ..., <metric>: ..., "samples": n}``: per-sample means, and
        the number of samples evaluated (each counted once).
    """
    check_type("model", model, nn.Module, hint="a torch.nn.Module")
    if isinstance(metrics, Mapping):
        chosen = dict(metrics)
    elif isinstance(metrics, (list, tuple)):
        unknown = [m for m in metrics if m not in _NAMED]
        if unknown:
            raise ValueError(f"unknown metric names {unknown}; choose among {sorted(_NAMED)} or pass {{name: fn}}")
        chosen = {m: _NAMED[m] for m in metrics}
    else:
        raise TypeError(
            f"metrics must be a mapping of names to functions or a list of names, got {type(metrics).__name__}"
        )
    world_size = comm.get_world_size(group)
    collate_fn = None
    dataset = data
    if hasattr(data, "dataset") and hasattr(data, "batch_size") and not isinstance(data, Dataset):
        dataset = data.dataset
        loader_collate = getattr(data, "collate_fn", None)
        if loader_collate is not None and getattr(loader_collate, "__name__", "") != "default_collate":
            collate_fn = loader_collate
        if batch_size is None and data.batch_size is not None:
            batch_size = data.batch_size
    check_int("batch_size", batch_size, minimum=1, allow_none=True, hint="samples per forward pass on each worker")
    global_batch = DEFAULT_BATCH if batch_size is None else batch_size * world_size
    dataset = _metrics.as_dataset(dataset, "data")
    result = _metrics.evaluate(
        model,
        loss_fn if loss_fn is not None else _no_loss,
        chosen,
        dataset,
        global_batch,
        group=group,
        device=device,
        collate_fn=collate_fn,
    )
    out = {"loss": result.loss} if loss_fn is not None else {}
    out.update(result.metrics)
    out["samples"] = result.samples
    return out


def _no_loss(output: Tensor, target: Tensor) -> Tensor:
    return output.new_zeros((), dtype=torch.float64)
