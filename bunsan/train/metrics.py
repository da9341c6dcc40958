"""Exactly reduced metrics: sums and counts, never an average of averages.

A metric over a data set split across workers is ``sum of per-sample values /
number of samples``. Each worker accumulates its own sum and count, and one
float64 all-reduce of every sum and count gives the global value, exactly as one
process would compute it over the whole set (up to float rounding of the sums).
Averaging the workers' averages is wrong whenever they saw different numbers of
samples, which is the normal case for an evaluation set of odd size.

:func:`evaluate` runs a model over a data set distributed over the workers
without counting any sample twice; :class:`CrossValidation` and :class:`Test` say
when :class:`bunsan.TrainingSession` runs it and on what.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from bunsan import comm
from bunsan._validate import check_int

__all__ = [
    "Accumulator",
    "CrossValidation",
    "EvalResult",
    "MetricFn",
    "Test",
    "accuracy",
    "as_dataset",
    "classification_error",
    "evaluate",
    "fetch",
    "metric_sum",
]

MetricFn = Callable[[Tensor, Tensor], Tensor]
CrossValidationCallback = Callable[[int, float, int, int], Any]


def classification_error(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample error, 1.0 where the arg-max class is not ``target`` (CNTK's ``classification_error``).

    Args:
        output: Scores ``(N, C)``.
        target: Class indices ``(N,)``, or one-hot / probabilities ``(N, C)``.

    Returns:
        Float tensor ``(N,)`` of 0.0 and 1.0.
    """
    if target.dim() == output.dim():
        target = target.argmax(dim=-1)
    return (output.argmax(dim=-1) != target).to(torch.float32)


def accuracy(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample accuracy, ``1 - classification_error``."""
    return 1.0 - classification_error(output, target)


def metric_sum(fn: MetricFn, output: Tensor, target: Tensor) -> tuple[Tensor, int]:
    """``(sum of per-sample values, count)`` of metric ``fn`` on one batch.

    ``fn`` should return one value per sample (shape ``(N,)``). A 0-dim result
    is taken as the batch mean and multiplied by the batch size.
    """
    values = fn(output, target)
    if not isinstance(values, Tensor):
        values = torch.as_tensor(values, dtype=torch.float64)
    n = int(output.shape[0])
    if values.dim() == 0:
        return values.detach().to(torch.float64) * n, n
    if values.shape[0] != n:
        raise ValueError(
            f"metric {getattr(fn, '__name__', fn)!r} returned {tuple(values.shape)} values for a batch of {n}; "
            "return one value per sample (shape (N,)) or a 0-dim batch mean"
        )
    return values.detach().to(torch.float64).sum(), n


@dataclass
class Accumulator:
    """Running sums and counts of named quantities on this rank.

    Sums are kept as float64 tensors on the batch's device, so accumulating
    costs no host synchronization; :meth:`reduce` is the one collective.
    """

    sums: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, total: Tensor | float, count: int) -> None:
        """Add ``total`` (a sum over ``count`` samples) to ``name``."""
        if not isinstance(total, Tensor):
            total = torch.tensor(float(total), dtype=torch.float64)
        total = total.detach().to(torch.float64)
        if name in self.sums:
            self.sums[name] = self.sums[name] + total.to(self.sums[name].device)
        else:
            self.sums[name] = total.clone()
        self.counts[name] = self.counts.get(name, 0) + int(count)

    def local(self) -> dict[str, tuple[float, int]]:
        """This rank's ``{name: (sum, count)}`` as Python numbers (for checkpoints)."""
        return {name: (float(self.sums[name].item()), self.counts[name]) for name in self.sums}

    @classmethod
    def from_local(cls, state: Mapping[str, Sequence[Any]]) -> Accumulator:
        acc = cls()
        for name, (total, count) in state.items():
            acc.add(name, float(total), int(count))
        return acc

    def reduce(
        self, names: Sequence[str], group: Any = None, device: torch.device | None = None
    ) -> dict[str, tuple[float, int]]:
        """Global ``{name: (sum, count)}`` over every rank of ``group``. Collective.

        ``names`` must be the same list on every rank (a name this rank never
        saw counts zero), so that every rank sends a buffer of the same size.
        One float64 all-reduce carries all sums and counts; float64 counts are
        exact below 2**53.

        Args:
            device: Where the buffer lives; it must be the same kind on every
                rank (CUDA for NCCL), also on a rank that accumulated nothing.
                Default: where the sums are, else the CPU.
        """
        if device is None:
            device = next(iter(self.sums.values())).device if self.sums else torch.device("cpu")
        buffer = torch.zeros(2 * len(names), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            if name in self.sums:
                buffer[2 * i] = self.sums[name].to(device)
                buffer[2 * i + 1] = float(self.counts[name])
        if comm.get_world_size(group) > 1:
            comm.all_reduce(buffer, group=group)
        values = buffer.tolist()
        return {name: (values[2 * i], round(values[2 * i + 1])) for i, name in enumerate(names)}


@dataclass
class EvalResult:
    """Result of a distributed evaluation (cross-validation or test).

    Attributes:
        loss: Mean loss per sample.
        metrics: Mean of each metric per sample.
        samples: Samples evaluated (each counted once, all workers together).
        minibatches: Global minibatches evaluated.
        index: 0-based number of the cross-validation (None for a test).
        trained_samples: Global training samples seen when it ran.
    """

    loss: float
    metrics: dict[str, float]
    samples: int
    minibatches: int
    index: int | None = None
    trained_samples: int | None = None

    @property
    def error(self) -> float:
        """The first metric, or the loss without metrics (what CNTK's callbacks call the error)."""
        return next(iter(self.metrics.values())) if self.metrics else self.loss

    def as_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss,
            "metrics": dict(self.metrics),
            "samples": self.samples,
            "minibatches": self.minibatches,
            "index": self.index,
            "trained_samples": self.trained_samples,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> EvalResult:
        return cls(
            float(state["loss"]),
            {k: float(v) for k, v in state["metrics"].items()},
            int(state["samples"]),
            int(state["minibatches"]),
            state.get("index"),
            state.get("trained_samples"),
        )


def as_dataset(data: Any, name: str) -> Dataset:
    """A map-style dataset from ``data``: a Dataset, or a tuple of equally long tensors ``(x, y)``."""
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, Tensor) for t in data):
        if len({len(t) for t in data}) != 1:
            raise ValueError(f"{name}: the tensors of the tuple have different lengths {[len(t) for t in data]}")
        return TensorDataset(*data)
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise ValueError(
            f"{name} must be a map-style Dataset (with __len__ and __getitem__) or a tuple of tensors (x, y), "
            f"got {type(data).__name__}"
        )
    return data


def fetch(dataset: Dataset, indices: Tensor, collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
    """The batch of ``dataset`` at ``indices``, collated.

    A ``TensorDataset`` is indexed with the whole index tensor at once; other
    datasets through ``__getitems__`` when they have it, else item by item.
    """
    if isinstance(dataset, TensorDataset) and collate_fn is None:
        return tuple(t[indices] for t in dataset.tensors)
    index_list = indices.tolist()
    getitems = getattr(dataset, "__getitems__", None)
    items = getitems(index_list) if getitems is not None else [dataset[i] for i in index_list]
    return (collate_fn or default_collate)(items)


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def split_batch(batch: Any) -> tuple[tuple[Any, ...], Any]:
    """``(inputs, target)``: a batch is ``(input, ..., target)``; the model gets the inputs."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError(
            f"a batch must be a tuple (inputs..., target), got {type(batch).__name__}; "
            "a dataset item should be (x, y) as in TensorDataset(x, y)"
        )
    return tuple(batch[:-1]), batch[-1]


def _rows(batch: Any, keep: Tensor) -> Any:
    if isinstance(batch, Tensor):
        return batch[keep]
    return type(batch)(_rows(b, keep) for b in batch)


def evaluate(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    metrics: Mapping[str, MetricFn],
    data: Dataset,
    minibatch_size: int,
    group: Any = None,
    device: torch.device | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> EvalResult:
    """Loss and metrics of ``model`` on ``data``, split over the workers, exact. Collective.

    Worker ``r`` of ``w`` takes positions ``r, r + w, r + 2w, ...`` of the data set
    (no shuffling), padded to ``ceil(n / w)`` samples so that every worker runs
    the same number of forward passes of the same size (a model with collectives
    in its forward, model-parallel or synchronized batch norm, needs that). The
    padding samples are positions ``>= n``; their outputs are masked out before
    the loss and metrics, so every sample counts exactly once. Then one
    all-reduce of sums and counts (:class:`Accumulator`).

    Args:
        model: Put in eval mode for the evaluation, then back to its mode.
        loss_fn: ``loss_fn(output, target)``, averaged over the batch.
        metrics: ``{name: fn(output, target) -> per-sample values}``.
        data: A map-style dataset of ``(inputs..., target)`` items.
        minibatch_size: Global minibatch; each worker takes
            ``max(1, minibatch_size // w)`` samples per forward pass.
        group: Process group; ``None`` means the world.
        device: Where to run; default the device of the model's first parameter.

    Returns:
        An :class:`EvalResult` that is identical on every rank.
    """
    rank, world_size = comm.get_rank(group), comm.get_world_size(group)
    n = len(cast(Sized, data))  # map-style: as_dataset checked __len__
    if n == 0:
        raise ValueError("cannot evaluate on an empty data set")
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    local_batch = max(1, int(minibatch_size) // world_size)
    shard = -(-n // world_size)  # ceil: the same on every rank
    positions = torch.arange(shard, dtype=torch.int64) * world_size + rank
    valid = positions < n
    indices = torch.where(valid, positions, positions % n)  # padding repeats from the start; masked out below
    names = ["loss", *metrics]
    acc = Accumulator()
    was_training = model.training
    model.eval()
    minibatches = 0
    try:
        with torch.no_grad():
            for start in range(0, shard, local_batch):
                minibatches += 1
                keep = valid[start : start + local_batch]
                batch = to_device(fetch(data, indices[start : start + local_batch], collate_fn), device)
                inputs, target = split_batch(batch)
                output = model(*inputs)
                kept = int(keep.sum())
                if kept == 0:
                    continue
                if kept < len(keep):
                    keep_dev = keep.to(output.device)
                    output, target = output[keep_dev], _rows(target, keep_dev)
                acc.add("loss", loss_fn(output, target).detach() * kept, kept)
                for name, fn in metrics.items():
                    acc.add(name, *metric_sum(fn, output, target))
    finally:
        model.train(was_training)
    totals = acc.reduce(names, group, device)
    count = totals["loss"][1]
    means = {name: totals[name][0] / max(totals[name][1], 1) for name in names}
    return EvalResult(means.pop("loss"), means, count, minibatches)


@dataclass
class CrossValidation:
    """Evaluate on held-out data during training and let ``callback`` steer (CNTK's ``CrossValidationConfig``).

    Args:
        data: A map-style dataset of ``(inputs..., target)``, or a tuple of tensors ``(x, y)``.
        every: Global training samples between two evaluations (after the step
            that crosses each multiple); ``None`` means at the end of every epoch.
        callback: ``callback(index, average_error, samples, minibatches) -> bool``
            with the 0-based evaluation number, the first metric of the session
            (the loss without metrics), the samples and global minibatches
            evaluated. Return ``False`` to stop training, ``True`` (or ``None``)
            to go on. It may change ``session.learning_rate_per_sample``,
            ``session.learning_rate_schedule``, ``session.momentum_time_constant``
            and ``session.extra_state``. It runs on every rank with identical
            inputs; rank 0's decision and settings are then applied on every
            rank (see :class:`TrainingSession`).
        minibatch_size: Global minibatch of the evaluation.

    The evaluation does not synchronize the replicas first: doing so would make
    a block algorithm's trajectory depend on how often one validates. With a
    block algorithm between two synchronizations, each worker evaluates its own
    replica on its share of the data.
    """

    data: Any
    every: int | None = None
    callback: CrossValidationCallback | None = None
    minibatch_size: int = 1024

    def __post_init__(self) -> None:
        self.data = as_dataset(self.data, "CrossValidation data")
        check_int("every", self.every, minimum=1, allow_none=True, hint="global samples; None means every epoch")
        check_int("minibatch_size", self.minibatch_size, minimum=1, hint="global samples per evaluation step")


@dataclass
class Test:
    """Evaluate the final model on ``data``, distributed and exact (CNTK's ``TestConfig``).

    Args:
        data: A map-style dataset of ``(inputs..., target)``, or a tuple of tensors ``(x, y)``.
        minibatch_size: Global minibatch of the evaluation.
    """

    data: Any
    minibatch_size: int = 1024
    __test__ = False  # not a pytest test class, though users' test modules import it

    def __post_init__(self) -> None:
        self.data = as_dataset(self.data, "Test data")
        check_int("minibatch_size", self.minibatch_size, minimum=1, hint="global samples per evaluation step")
