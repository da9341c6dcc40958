"""TrainingSession: CNTK's ``training_session`` for torch models on bunsan.

One object runs the whole data-parallel training: it distributes the model
and optimizer, partitions the data, follows schedules stated in samples (the
global minibatch size, a per-sample learning rate, momentum as a time
constant), cross-validates and lets a callback adjust the learning rate or stop,
writes checkpoints that resume a run exactly, and tests the final model, with
every metric reduced exactly over the workers. See CNTK 2's
``cntk.train.training_session`` with ``CheckpointConfig``,
``CrossValidationConfig`` and ``TestConfig`` (Microsoft Cognitive Toolkit,
2017) for the model it follows.

Distributed invariants kept here:

* Every decision (the size of the next minibatch, whether to cross-validate,
  checkpoint or stop) is a function of global counts that every rank computes
  alike (samples trained, position in the epoch), so no rank ever waits in a
  collective the others skip.
* Every rank runs the same number of optimizer steps with the same number of
  samples (the remainder of ``len(train_data) % world_size`` is left out of
  each epoch, a different part each epoch), so the algorithms' per-step
  collectives always match.
* A cross-validation callback runs on every rank with the same all-reduced
  inputs, and then rank 0's outcome (continue or stop, learning rate, momentum,
  ``extra_state``) is sent to every rank and applied: a callback that reads
  something rank-local (a clock, a file) cannot split the job.
* Checkpoints are written by rank 0 and chosen by rank 0 (:mod:`bunsan.train.checkpoint`).
"""

from __future__ import annotations

import math
import numbers
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from bunsan import comm
from bunsan.algorithms.base import Algorithm
from bunsan.data.partition import Partition
from bunsan.errors import CheckpointError
from bunsan.optim import DistributedOptimizer, distribute
from bunsan.train import checkpoint as _ckpt
from bunsan.train.callbacks import Callback, CSVLogger, ProgressPrinter, TensorBoardLogger
from bunsan.train.checkpoint import Checkpoint
from bunsan.train.metrics import (
    Accumulator,
    EvalResult,
    MetricFn,
    as_dataset,
    evaluate,
    fetch,
    metric_sum,
    split_batch,
    to_device,
)
from bunsan.train.schedules import (
    Schedule,
    ScheduleLike,
    as_schedule,
    learning_rate,
    local_minibatch_size,
    momentum_from_time_constant,
    plan_minibatches,
    schedule,
)

__all__ = ["CrossValidation", "EpochSummary", "Test", "TrainingSession", "TrainingSummary"]

LossFn = Callable[[Tensor, Tensor], Tensor]
CrossValidationCallback = Callable[[int, float, int, int], Any]


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
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ValueError(f"every must be a number of samples >= 1 or None (every epoch), got {self.every!r}")
        _check_eval_minibatch(self.minibatch_size)


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
        _check_eval_minibatch(self.minibatch_size)


def _check_eval_minibatch(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"minibatch_size must be an integer >= 1, got {value!r}")


@dataclass
class EpochSummary:
    """One epoch of training, reduced over every worker.

    Attributes:
        epoch: 0-based epoch.
        samples: Global samples trained in the epoch.
        trained_samples: Global samples trained since the start when it ended.
        loss: Mean training loss per sample (exact: sums and counts all-reduced).
        metrics: Mean of each metric per training sample.
        seconds: Wall time of the epoch in this process (since the restore, for
            the epoch a run resumed in).
        samples_per_s: ``samples / seconds`` over the part this process trained.
        learning_rate_per_sample: In effect at the end of the epoch (None when
            the session does not set the learning rate).
        minibatch_size: Global minibatch the schedule asked for at the epoch's
            last step (before rounding to the workers and cutting at the epoch's end).
        complete: False for the part of an epoch trained before a stop.
        cross_validation: The evaluation run at the end of this epoch, if any.
    """

    epoch: int
    samples: int
    trained_samples: int
    loss: float
    metrics: dict[str, float]
    seconds: float
    samples_per_s: float
    learning_rate_per_sample: float | None
    minibatch_size: int
    complete: bool = True
    cross_validation: EvalResult | None = None

    def as_dict(self) -> dict[str, Any]:
        state = {
            k: getattr(self, k)
            for k in (
                "epoch",
                "samples",
                "trained_samples",
                "loss",
                "seconds",
                "samples_per_s",
                "learning_rate_per_sample",
                "minibatch_size",
                "complete",
            )
        }
        state["metrics"] = dict(self.metrics)
        state["cross_validation"] = self.cross_validation.as_dict() if self.cross_validation else None
        return state

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> EpochSummary:
        cv = state.get("cross_validation")
        return cls(
            int(state["epoch"]),
            int(state["samples"]),
            int(state["trained_samples"]),
            float(state["loss"]),
            {k: float(v) for k, v in state["metrics"].items()},
            float(state["seconds"]),
            float(state["samples_per_s"]),
            state["learning_rate_per_sample"],
            int(state["minibatch_size"]),
            bool(state["complete"]),
            EvalResult.from_dict(cv) if cv else None,
        )


@dataclass
class TrainingSummary:
    """What :meth:`TrainingSession.train` returns (the same on every rank).

    Attributes:
        epochs: Every epoch since the start of training, restored ones included;
            a last incomplete one when training stopped inside an epoch.
        cross_validations: Every cross-validation since the start.
        test: The final test, if a :class:`Test` was given.
        samples: Global samples trained since the start.
        steps: Optimizer steps since the start.
        seconds: Training wall time of this process (not counting the test).
        samples_per_s: Global samples per second trained by this process.
        bytes_per_sample: Bytes this worker sent per training sample it
            processed, as counted by the algorithm (``algorithm.stats()``).
        stats: The algorithm's ``stats()`` on this rank.
        stopped_by: ``"max_epochs"``, ``"max_samples"`` or ``"cross_validation"``.
        restored_from: The checkpoint this run continued from, if any.
    """

    epochs: list[EpochSummary]
    cross_validations: list[EvalResult]
    test: EvalResult | None
    samples: int
    steps: int
    seconds: float
    samples_per_s: float
    bytes_per_sample: float
    stats: dict[str, float]
    stopped_by: str
    restored_from: str | None = None

    @property
    def loss(self) -> float | None:
        """The training loss of the last epoch."""
        return self.epochs[-1].loss if self.epochs else None

    @property
    def metrics(self) -> dict[str, float]:
        """The training metrics of the last epoch."""
        return dict(self.epochs[-1].metrics) if self.epochs else {}


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(before, after]``. Pure."""
    return after // every > before // every


class TrainingSession:
    """Data-parallel training with schedules, checkpoints, cross-validation and a final test.

    Example (CNTK's MNIST sample, ``examples/cntk_mnist.py``)::

        session = bunsan.TrainingSession(
            model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0), "data_parallel",
            train_set, minibatch_size=bunsan.schedule([256] * 6 + [512] * 9 + [1024]),
            max_epochs=40, metrics={"error": classification_error},
            learning_rate_per_sample=0.001, momentum_time_constant=[0] * 5 + [1024],
            checkpoint=bunsan.Checkpoint("models/mnist.pt"),
            cross_validation=bunsan.CrossValidation(cv_set, every=3 * len(train_set), callback=adjust),
            test=bunsan.Test(test_set))
        summary = session.train()

    Construction is collective (it calls :func:`bunsan.distribute`), and so is
    :meth:`train`: every rank builds the session with the same arguments.

    **Minibatches.** ``minibatch_size`` is the *global* minibatch (all workers
    together), a number or a schedule (:func:`bunsan.schedule`). Each worker
    takes ``minibatch_size // world_size`` samples (rounded down, so a request
    of 256 on 3 workers trains 255); a minibatch smaller than the world size is
    refused. The schedule is evaluated at the global sample count at the start
    of each step, so the size may change inside an epoch: the epoch's shard
    order is fixed by ``(seed, epoch)`` and batches are cut from it on the fly,
    so the position in the epoch is just a count and checkpoints hold it. The
    last minibatch of an epoch takes what is left; none spans two epochs. Each
    epoch leaves out the ``len(train_data) % world_size`` remainder (a
    different part every epoch when shuffling), so every worker runs the same
    steps.

    **Learning rate per sample** (CNTK's ``UnitType.sample``). With
    ``learning_rate_per_sample`` set, every step sets ``lr =
    learning_rate_per_sample * n`` on every parameter group of the optimizer,
    where ``n`` is the step's actual global minibatch. With a loss averaged
    over the minibatch (torch's default) and gradients averaged over the
    workers, the update is ``learning_rate_per_sample * sum of per-sample
    gradients``, independent of how the minibatch is split or grown. For block
    algorithms (local steps, then averaging) the same ``lr`` makes one averaged
    step of plain SGD equal the synchronous one. ``None`` leaves the
    optimizer's ``lr`` alone.

    **Momentum as a time constant.** With ``momentum_time_constant`` (in
    samples; a number or schedule), every step sets ``momentum =
    exp(-n / time_constant)`` (0 for a time constant of 0). With
    ``unit_gain=True`` (CNTK's default) it also sets ``dampening = momentum``
    so that SGD's velocity is ``m * v + (1 - m) * g`` (torch's first momentum
    step still takes ``g`` whole). The optimizer must have a ``momentum``
    setting (``torch.optim.SGD``).

    **Changing the learning rate from a callback.** ``session.learning_rate_per_sample``
    is the rate in effect now; assigning it (``session.learning_rate_per_sample *= 0.5``)
    makes it constant from now on, like CNTK's ``learner.reset_learning_rate``.
    ``session.learning_rate_schedule`` is the schedule itself (indexed by the
    global sample count since the start); assign a new one to change later
    values too. Both apply on every rank: the cross-validation callback's
    outcome is rank 0's, broadcast (see the module docstring), and both go into
    checkpoints. ``session.extra_state`` is a dict of numbers and strings that
    a callback may keep across restarts (it is checkpointed and broadcast too).

    Args:
        model: The model; :func:`bunsan.distribute` copies rank 0's parameters
            to every rank.
        loss_fn: ``loss_fn(output, target)``, averaged over the batch.
        optimizer: A torch optimizer over ``model``'s parameters (or one
            already returned by :func:`bunsan.distribute`, with ``algorithm=None``).
        algorithm: An :class:`~bunsan.algorithms.Algorithm`, a registered name,
            or None for exact ``DataParallelSGD()``.
        train_data: A map-style dataset of ``(inputs..., target)`` items, or a
            tuple of tensors ``(x, y)``. The model gets the inputs; the number
            of samples is the length of the first.
        minibatch_size: Global minibatch: a number, a list (one entry per
            epoch) or a :class:`~bunsan.train.schedules.Schedule`.
        max_epochs: Stop after this many sweeps of ``train_data``.
        max_samples: Stop after this many global samples (at least one of the
            two limits is required).
        metrics: ``{name: fn(output, target) -> per-sample values}``, e.g.
            ``{"error": bunsan.train.classification_error}``; reduced exactly.
        learning_rate_per_sample: See above; a number, list or schedule.
        momentum_time_constant: See above; a number, list or schedule.
        unit_gain: Unit-gain momentum (see above).
        checkpoint: A :class:`Checkpoint` or a path for ``Checkpoint(path)``.
        cross_validation: A :class:`CrossValidation`.
        test: A :class:`Test`, run once training ends.
        progress: Print a bar (rank 0, terminals only) and one line per epoch.
        log_csv: Path of a CSV file with one row per epoch (rank 0).
        tensorboard: Log directory for TensorBoard (needs ``bunsan[tensorboard]``).
        callbacks: More :class:`~bunsan.train.callbacks.Callback` objects.
        seed: Seed of the data order; the same on every rank.
        shuffle: Reshuffle the training data every epoch.
        collate_fn: Turns a list of items into a batch; default torch's.
        dataloader_kwargs: When given (e.g. ``{"num_workers": 2}``), batches
            are read through a ``torch.utils.data.DataLoader`` with these
            arguments, one per epoch; otherwise in this process.

    Raises:
        ValueError: For a bad argument, naming it: no limit, a minibatch
            smaller than the world size, a momentum schedule for an optimizer
            without momentum, ...
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        algorithm: Algorithm | str | None = None,
        train_data: Dataset | Sequence[Tensor] | None = None,
        minibatch_size: ScheduleLike = 256,
        *,
        max_epochs: int | None = None,
        max_samples: int | None = None,
        metrics: Mapping[str, MetricFn] | None = None,
        learning_rate_per_sample: ScheduleLike | None = None,
        momentum_time_constant: ScheduleLike | None = None,
        unit_gain: bool = True,
        checkpoint: Checkpoint | str | Path | None = None,
        cross_validation: CrossValidation | None = None,
        test: Test | None = None,
        progress: bool = True,
        log_csv: str | Path | None = None,
        tensorboard: str | Path | None = None,
        callbacks: Sequence[Callback] = (),
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if train_data is None:
            raise ValueError("train_data is required: a map-style Dataset or a tuple of tensors (x, y)")
        self.train_data = as_dataset(train_data, "train_data")
        for name, limit in (("max_epochs", max_epochs), ("max_samples", max_samples)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {limit!r}")
        if max_epochs is None and max_samples is None:
            raise ValueError("give max_epochs or max_samples (or both): training needs a limit")
        self.metrics: dict[str, MetricFn] = dict(metrics or {})
        if "loss" in self.metrics:
            raise ValueError("'loss' is reserved for the loss; name the metric otherwise, e.g. 'error'")
        for name, fn in self.metrics.items():
            if not callable(fn):
                raise ValueError(f"metrics[{name!r}] must be callable fn(output, target), got {type(fn).__name__}")
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            checkpoint = Checkpoint(checkpoint)
        if cross_validation is not None and not isinstance(cross_validation, CrossValidation):
            raise ValueError(
                f"cross_validation must be a bunsan.CrossValidation, got {type(cross_validation).__name__}"
            )
        if test is not None and not isinstance(test, Test):
            raise ValueError(f"test must be a bunsan.Test, got {type(test).__name__}")

        # Collective: every rank distributes its model and optimizer.
        if isinstance(optimizer, DistributedOptimizer):
            if algorithm is not None:
                raise ValueError(
                    "the optimizer is already a DistributedOptimizer with its own algorithm; pass algorithm=None, "
                    "or pass the plain torch optimizer and let the session distribute it"
                )
            self.model, self.optimizer = model, optimizer
        else:
            self.model, self.optimizer = distribute(model, optimizer, algorithm)
        self.algorithm: Algorithm = self.optimizer.algorithm
        self.group = self.algorithm.group
        self.rank = comm.get_rank(self.group)
        self.world_size = comm.get_world_size(self.group)
        self.loss_fn = loss_fn

        # drop_last: every worker gets the same number of samples, none twice.
        self.partition = Partition(
            len(self.train_data), rank=self.rank, world_size=self.world_size, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.samples_per_epoch = self.partition.shard_size * self.world_size
        self.minibatch_schedule = as_schedule("minibatch_size", minibatch_size, self.samples_per_epoch)
        assert self.minibatch_schedule is not None
        for value in self.minibatch_schedule.values:
            try:
                local_minibatch_size(value, self.world_size)
            except ValueError as error:
                raise ValueError(f"minibatch_size: {error}") from None
        self._lr = as_schedule("learning_rate_per_sample", learning_rate_per_sample, self.samples_per_epoch)
        self._momentum = as_schedule("momentum_time_constant", momentum_time_constant, self.samples_per_epoch)
        self._check_rates(self._lr, self._momentum)
        if self._momentum is not None and any("momentum" not in g for g in self.optimizer.param_groups):
            raise ValueError(
                f"momentum_time_constant needs an optimizer with a 'momentum' setting such as torch.optim.SGD; "
                f"{type(self.optimizer.optimizer).__name__} has none"
            )
        self.unit_gain = bool(unit_gain)
        self.checkpoint = checkpoint
        self.cross_validation = cross_validation
        self.test = test
        self.seed = seed
        self.collate_fn = collate_fn
        self.dataloader_kwargs = dict(dataloader_kwargs) if dataloader_kwargs is not None else None
        self.max_epochs, self.max_samples = max_epochs, max_samples

        self.callbacks: list[Callback] = []
        if progress:
            self.callbacks.append(ProgressPrinter())
        if log_csv is not None:
            self.callbacks.append(CSVLogger(log_csv))
        if tensorboard is not None:
            self.callbacks.append(TensorBoardLogger(tensorboard))
        self.callbacks.extend(callbacks)

        first = next(self.model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        # Progress: the same on every rank at every step.
        self.samples = 0  # global samples trained since the start of training
        self.steps = 0
        self.epoch = 0  # the epoch being trained (= epochs completed)
        self.position = 0  # samples of this epoch's shard consumed, the same on every rank
        self.cv_index = 0
        self.extra_state: dict[str, Any] = {}
        self.epochs: list[EpochSummary] = []
        self.cross_validations: list[EvalResult] = []
        self.restored_from: str | None = None
        self._stopped: str | None = None
        self._acc = Accumulator()
        self._trained = False
        self._epoch_clock = (time.perf_counter(), 0)
        self._last_minibatch = 0

    # -- settings a callback may change ------------------------------------------------
    @staticmethod
    def _check_rates(lr: Schedule | None, momentum: Schedule | None) -> None:
        for name, sched in (("learning_rate_per_sample", lr), ("momentum_time_constant", momentum)):
            if sched is not None and any(v < 0 for v in sched.values):
                raise ValueError(f"{name} values must be >= 0, got {sched.values}")

    @property
    def is_main(self) -> bool:
        """True on rank 0 of the session's group: the rank that prints and writes files."""
        return self.rank == 0

    @property
    def learning_rate_schedule(self) -> Schedule | None:
        """The per-sample learning-rate schedule over global samples (None: the optimizer's lr is left alone)."""
        return self._lr

    @learning_rate_schedule.setter
    def learning_rate_schedule(self, value: ScheduleLike | None) -> None:
        new = as_schedule("learning_rate_schedule", value, self.samples_per_epoch)
        self._check_rates(new, None)
        self._lr = new

    @property
    def learning_rate_per_sample(self) -> float | None:
        """The per-sample learning rate in effect now; assigning makes it constant from now on."""
        return None if self._lr is None else float(self._lr(self.samples))

    @learning_rate_per_sample.setter
    def learning_rate_per_sample(self, value: float | None) -> None:
        if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool) or value < 0):
            raise ValueError(f"learning_rate_per_sample must be a number >= 0 or None, got {value!r}")
        self._lr = None if value is None else schedule(float(value))

    @property
    def momentum_schedule(self) -> Schedule | None:
        """The momentum time-constant schedule over global samples (None: momentum is left alone)."""
        return self._momentum

    @momentum_schedule.setter
    def momentum_schedule(self, value: ScheduleLike | None) -> None:
        new = as_schedule("momentum_schedule", value, self.samples_per_epoch)
        self._check_rates(None, new)
        self._momentum = new

    @property
    def momentum_time_constant(self) -> float | None:
        """The momentum time constant in effect now, in samples; assigning makes it constant from now on."""
        return None if self._momentum is None else float(self._momentum(self.samples))

    @momentum_time_constant.setter
    def momentum_time_constant(self, value: float | None) -> None:
        self.momentum_schedule = None if value is None else float(value)

    @property
    def minibatch_size(self) -> int:
        """The global minibatch the next step asks for (before rounding to the workers)."""
        return int(self.minibatch_schedule(self.samples))

    def running_loss(self) -> float:
        """This rank's mean training loss so far in the epoch (local, no communication)."""
        total = self._acc.sums.get("loss")
        count = self._acc.counts.get("loss", 0)
        return float(total.item()) / count if total is not None and count else math.nan

    # -- the control state: the same on every rank, broadcast from rank 0 and checkpointed
    def _control(self) -> dict[str, Any]:
        return {
            "learning_rate": self._lr.state_dict() if self._lr is not None else None,
            "momentum": self._momentum.state_dict() if self._momentum is not None else None,
            "extra_state": dict(self.extra_state),
        }

    def _apply_control(self, control: Mapping[str, Any]) -> None:
        self._lr = Schedule.from_state_dict(control["learning_rate"]) if control["learning_rate"] else None
        self._momentum = Schedule.from_state_dict(control["momentum"]) if control["momentum"] else None
        self.extra_state = dict(control["extra_state"])

    # -- training --------------------------------------------------------------------------
    def _emit(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _limit_reached(self) -> str | None:
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            return "max_epochs"
        if self.max_samples is not None and (self.max_samples - self.samples) // self.world_size <= 0:
            return "max_samples"
        return None

    def _batches(self, plan: Sequence[int]) -> Iterator[Any]:
        indices = self.partition.indices(epoch=self.epoch)  # this rank's shard, fixed by (seed, epoch)
        cuts, start = [], self.position
        for local in plan:
            cuts.append(indices[start : start + local])
            start += local
        if self.dataloader_kwargs is None:
            return (fetch(self.train_data, cut, self.collate_fn) for cut in cuts)
        kwargs = dict(self.dataloader_kwargs)
        if self.collate_fn is not None:
            kwargs.setdefault("collate_fn", self.collate_fn)
        return iter(DataLoader(self.train_data, batch_sampler=[cut.tolist() for cut in cuts], **kwargs))

    def _step(self, batch: Any, local: int) -> None:
        minibatch = local * self.world_size  # the step's actual global minibatch
        for group in self.optimizer.param_groups:
            if self._lr is not None:
                group["lr"] = learning_rate(self._lr(self.samples), minibatch)
            if self._momentum is not None:
                group["momentum"] = momentum_from_time_constant(self._momentum(self.samples), minibatch)
                if self.unit_gain and "dampening" in group:
                    group["dampening"] = group["momentum"]
        inputs, target = split_batch(to_device(batch, self.device))
        self.optimizer.zero_grad()
        output = self.model(*inputs)
        loss = self.loss_fn(output, target)
        loss.backward()
        self.optimizer.step()  # collective: the algorithm's exchange
        n = int(inputs[0].shape[0]) if isinstance(inputs[0], Tensor) else local
        self._acc.add("loss", loss.detach() * n, n)
        detached = output.detach()
        for name, fn in self.metrics.items():
            self._acc.add(name, *metric_sum(fn, detached, target))
        self._last_minibatch = int(self.minibatch_schedule(self.samples))

    def _reduce_epoch(self, complete: bool) -> EpochSummary:
        """Collective: all-reduce the epoch's sums and counts."""
        totals = self._acc.reduce(["loss", *self.metrics], self.group, self.device)
        self._acc = Accumulator()
        count = totals["loss"][1]
        start_time, start_samples = self._epoch_clock
        seconds = time.perf_counter() - start_time
        trained_here = self.samples - start_samples
        summary = EpochSummary(
            epoch=self.epoch,
            samples=count,
            trained_samples=self.samples,
            loss=totals["loss"][0] / max(count, 1),
            metrics={name: totals[name][0] / max(totals[name][1], 1) for name in self.metrics},
            seconds=seconds,
            samples_per_s=trained_here / seconds if seconds > 0 else 0.0,
            learning_rate_per_sample=self.learning_rate_per_sample,
            minibatch_size=self._last_minibatch,
            complete=complete,
        )
        self._epoch_clock = (time.perf_counter(), self.samples)
        return summary

    def _run_cross_validation(self) -> tuple[EvalResult, bool]:
        cv = self.cross_validation
        assert cv is not None
        result = evaluate(
            self.model, self.loss_fn, self.metrics, cv.data, cv.minibatch_size, self.group, self.device, self.collate_fn
        )
        result.index, result.trained_samples = self.cv_index, self.samples
        self.cv_index += 1
        self.cross_validations.append(result)
        self._emit("on_cross_validation", result)
        keep_going = True
        if cv.callback is not None:
            keep_going = self._steer(
                lambda: cv.callback(
                    result.index,
                    result.error,
                    result.samples,  # type: ignore[misc]
                    result.minibatches,
                )
            )
        return result, keep_going

    def _steer(self, call: Callable[[], Any]) -> bool:
        """Run a control callback on every rank, then apply rank 0's outcome everywhere. Collective."""
        error = None
        try:
            decision = call()
            keep_going = decision is None or bool(decision)
        except Exception:
            error, keep_going = traceback.format_exc(), True
        outcome = {"continue": keep_going, "control": self._control(), "error": error}
        outcomes = comm.all_gather_object(outcome, group=self.group) if self.world_size > 1 else [outcome]
        for rank, theirs in enumerate(outcomes):
            if theirs["error"] is not None:
                raise RuntimeError(f"the cross-validation callback raised on rank {rank}:\n{theirs['error']}")
        chosen = outcomes[0]
        differing = [rank for rank, theirs in enumerate(outcomes) if theirs != chosen]
        if differing and self.is_main:
            warnings.warn(
                f"the cross-validation callback decided differently on rank(s) {differing} than on rank 0 "
                "(it depends on something rank-local); rank 0's decision and settings apply on every rank",
                stacklevel=2,
            )
        self._apply_control(chosen["control"])
        return bool(chosen["continue"])

    def _save(self) -> None:
        assert self.checkpoint is not None
        common = {
            "counters": {
                "samples": self.samples,
                "steps": self.steps,
                "epoch": self.epoch,
                "position": self.position,
                "cv_index": self.cv_index,
                "samples_per_epoch": self.samples_per_epoch,
                "seed": self.seed,
                "last_minibatch": self._last_minibatch,
            },
            "stopped": self._stopped,
            "control": self._control(),
            "history": {
                "epochs": [e.as_dict() for e in self.epochs],
                "cross_validations": [r.as_dict() for r in self.cross_validations],
            },
        }
        replicated = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.optimizer.state_dict(),
            "algorithm": self.algorithm.state_dict(),
        }
        per_rank = {"rng": _ckpt.rng_state(), "accumulator": {k: list(v) for k, v in self._acc.local().items()}}
        path = _ckpt.save(
            self.checkpoint, self.samples, common=common, replicated=replicated, per_rank=per_rank, group=self.group
        )
        self._emit("on_checkpoint", path)

    def _restore(self) -> None:
        assert self.checkpoint is not None
        restored = _ckpt.restore(self.checkpoint, self.group)
        if restored is None:
            return
        source = f"checkpoint {restored.path}"
        _ckpt.check_model_fits(restored.replicated["model"], self.model, source)
        counters = restored.common["counters"]
        if restored.world_size == self.world_size and counters["samples_per_epoch"] != self.samples_per_epoch:
            raise CheckpointError(
                f"{source} was written for {counters['samples_per_epoch']} training samples per epoch, but this "
                f"session has {self.samples_per_epoch}: restore with the same training data"
            )
        if counters["seed"] != self.seed:
            raise CheckpointError(
                f"{source} was written with seed={counters['seed']}; build the session with that seed"
            )
        notes = list(restored.notes)
        self.model.load_state_dict(restored.replicated["model"])
        try:
            self.optimizer.optimizer.load_state_dict(restored.replicated["optimizer"])
        except (ValueError, KeyError) as error:
            raise CheckpointError(
                f"{source} has an optimizer state that does not fit this optimizer: {error}"
            ) from None
        same_world = restored.world_size == self.world_size
        if same_world:
            self.algorithm.load_state_dict(restored.replicated["algorithm"])
        else:
            notes.append(f"the algorithm's per-rank state ({self.algorithm!r}) starts afresh")
        self.samples, self.steps = int(counters["samples"]), int(counters["steps"])
        self.epoch, self.cv_index = int(counters["epoch"]), int(counters["cv_index"])
        self._last_minibatch = int(counters.get("last_minibatch", 0))
        if same_world:
            assert restored.per_rank is not None
            self.position = int(counters["position"])
            self._acc = Accumulator.from_local(restored.per_rank["accumulator"])
            _ckpt.set_rng_state(restored.per_rank["rng"])
        else:
            # The epoch's first position * saved_world samples of its order were trained;
            # continue at the same point of the order, rounded down (a few samples may repeat).
            offset = int(counters["position"]) * restored.world_size
            self.position = min(offset // self.world_size, self.partition.shard_size)
            self._acc = Accumulator()
            if self.is_main:  # the partial sums of every saved rank, counted once
                for saved in restored.all_per_rank:
                    for name, (total, count) in saved["accumulator"].items():
                        self._acc.add(name, float(total), int(count))
            notes.append(
                "the data position was rounded to the new number of workers and random states are not restored"
            )
        self._apply_control(restored.common["control"])
        self._stopped = restored.common["stopped"]
        history = restored.common["history"]
        self.epochs = [EpochSummary.from_dict(e) for e in history["epochs"]]
        self.cross_validations = [EvalResult.from_dict(r) for r in history["cross_validations"]]
        self.restored_from = str(restored.path)
        if notes and self.is_main:
            warnings.warn(
                f"restored {restored.path} written by {restored.world_size} worker(s) into {self.world_size}: "
                + "; ".join(notes),
                stacklevel=3,
            )

    def train(self) -> TrainingSummary:
        """Train until a limit or the cross-validation callback stops it; then test. Collective.

        Returns:
            A :class:`TrainingSummary`, the same on every rank.

        Raises:
            CheckpointError: The checkpoint to restore does not fit this model
                (naming the first entry that differs), or cannot be written.
            RuntimeError: ``train()`` was already called on this session.
        """
        if self._trained:
            raise RuntimeError("train() was already called on this session; build a new one (it can restore)")
        self._trained = True
        if self.checkpoint is not None and self.checkpoint.restore:
            self._restore()
        self._emit("on_train_begin")
        started, samples_at_start = time.perf_counter(), self.samples
        self._epoch_clock = (started, self.samples)
        cv, ckpt = self.cross_validation, self.checkpoint
        stop = self._stopped or self._limit_reached()
        while stop is None:
            plan = plan_minibatches(
                self.partition.shard_size,
                self.position,
                self.samples,
                self.minibatch_schedule,
                self.world_size,
                self.max_samples,
            )
            batches = self._batches(plan)
            for local in plan:
                self._step(next(batches), local)
                before = self.samples
                self.position += local
                self.samples += local * self.world_size
                self.steps += 1
                self._emit("on_step_end", local * self.world_size)
                # Every decision below depends only on global counts: the same on every rank.
                epoch_done = self.position == self.partition.shard_size
                epoch_summary = self._reduce_epoch(complete=True) if epoch_done else None
                if cv is not None and (_crossed(before, self.samples, cv.every) if cv.every else epoch_done):
                    result, keep_going = self._run_cross_validation()
                    if epoch_summary is not None:
                        epoch_summary.cross_validation = result
                    if not keep_going:
                        stop = "cross_validation"
                if epoch_done:
                    assert epoch_summary is not None
                    self.epochs.append(epoch_summary)
                    self.epoch, self.position = self.epoch + 1, 0
                stop = stop or self._limit_reached()
                # Only the callback's decision is kept in checkpoints: limits are re-read
                # from the restoring session's arguments, so a run can be extended.
                self._stopped = "cross_validation" if stop == "cross_validation" else None
                if ckpt is not None and (
                    stop or (_crossed(before, self.samples, ckpt.every) if ckpt.every else epoch_done)
                ):
                    # The last checkpoint comes before join() and sync_replicas(): a run restored
                    # from it continues the trajectory of one that never stopped.
                    self._save()
                if epoch_summary is not None:
                    self._emit("on_epoch_end", epoch_summary)
                if stop:
                    break
            else:
                stop = self._limit_reached()
                if stop is None and not plan:  # cannot happen: a plan is empty only at a limit
                    raise RuntimeError("no minibatch could be planned; this is a bug in bunsan")
        seconds = time.perf_counter() - started
        # Uneven data cannot happen here (every rank runs the same steps), but join()
        # is the contract's clean end; sync_replicas() brings block algorithms' replicas together.
        self.optimizer.join()
        self.optimizer.sync_replicas()
        epochs = list(self.epochs)
        if self.position > 0:
            # Collective: every rank has the same position, so all of them enter.
            epochs.append(self._reduce_epoch(complete=False))
        test_result = None
        if self.test is not None:
            test_result = evaluate(
                self.model,
                self.loss_fn,
                self.metrics,
                self.test.data,
                self.test.minibatch_size,
                self.group,
                self.device,
                self.collate_fn,
            )
        stats = dict(self.algorithm.stats())
        summary = TrainingSummary(
            epochs=epochs,
            cross_validations=list(self.cross_validations),
            test=test_result,
            samples=self.samples,
            steps=self.steps,
            seconds=seconds,
            samples_per_s=(self.samples - samples_at_start) / seconds if seconds > 0 else 0.0,
            bytes_per_sample=float(stats.get("bytes_sent_per_sample", 0.0)),
            stats=stats,
            stopped_by=stop,
            restored_from=self.restored_from,
        )
        self._emit("on_train_end", summary)
        return summary
