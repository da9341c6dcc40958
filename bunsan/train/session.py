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
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from bunsan import comm
from bunsan._validate import check_int, check_type
from bunsan.algorithms.base import Algorithm
from bunsan.optim import DistributedOptimizer, distribute
from bunsan.train import elastic_feed
from bunsan.train.callbacks import Callback, standard_callbacks
from bunsan.train.checkpoint.files import Checkpoint
from bunsan.train.checkpoint.session_state import restore_session, save_session
from bunsan.train.control import SessionControl
from bunsan.train.feed import TrainFeed
from bunsan.train.metrics import (
    Accumulator,
    CrossValidation,
    EvalResult,
    MetricFn,
    Test,
    as_dataset,
    evaluate,
    metric_sum,
    split_batch,
    to_device,
)
from bunsan.train.schedules import (
    Schedule,
    ScheduleLike,
    as_schedule,
    local_minibatch_size,
    plan_minibatches,
)
from bunsan.train.summaries import EpochSummary, TrainingSummary

__all__ = ["CrossValidation", "EpochSummary", "Test", "TrainingSession", "TrainingSummary"]

LossFn = Callable[[Tensor, Tensor], Tensor]


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(before, after]``. Pure."""
    return after // every > before // every


class TrainingSession(SessionControl):
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
    :meth:`train`: every rank builds the session with the same arguments. In an
    elastic job (``bunsan run --min-np``) it needs no change: :mod:`bunsan.train.elastic_feed`.

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

    The keyword arguments come in groups, each handled by one object: the data
    (``train_data``, ``seed``, ``shuffle``, ``collate_fn``, ``dataloader_kwargs``:
    :class:`~bunsan.train.feed.TrainFeed`), the schedules a callback steers
    (``learning_rate_per_sample``, ``momentum_time_constant``, ``unit_gain``:
    :class:`~bunsan.train.control.SessionControl`) and the reporting (``progress``,
    ``log_csv``, ``tensorboard``, ``callbacks``:
    :func:`~bunsan.train.callbacks.standard_callbacks`).

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
        check_int("max_epochs", max_epochs, minimum=1, allow_none=True)
        check_int("max_samples", max_samples, minimum=1, allow_none=True, hint="global samples")
        if max_epochs is None and max_samples is None:
            raise ValueError("give max_epochs or max_samples (or both): training needs a limit")
        self.metrics: dict[str, MetricFn] = dict(metrics or {})
        if "loss" in self.metrics:
            raise ValueError("'loss' is reserved for the loss; name the metric otherwise, e.g. 'error'")
        for name, fn in self.metrics.items():
            if not callable(fn):
                raise TypeError(f"metrics[{name!r}] must be callable fn(output, target), got {type(fn).__name__}")
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            checkpoint = Checkpoint(checkpoint)
        if cross_validation is not None:
            check_type("cross_validation", cross_validation, CrossValidation, hint="bunsan.CrossValidation(data, ...)")
        if test is not None:
            check_type("test", test, Test, hint="bunsan.Test(data)")

        # Collective: every rank distributes its model and optimizer (in an elastic job: elastic_feed's).
        member = elastic_feed.session_member()
        if member is not None:
            self.model, self.optimizer = model, elastic_feed.distribute(model, optimizer, algorithm, member)
        elif isinstance(optimizer, DistributedOptimizer):
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

        # The data and steps of an elastic job (bunsan.train.elastic_feed); None outside one.
        feed = elastic_feed.ElasticFeed
        self.elastic = None if member is None else feed(member, self.train_data, seed, shuffle, collate_fn)
        self.feed = self.elastic or TrainFeed(
            self.train_data,
            self.rank,
            self.world_size,
            seed=seed,
            shuffle=shuffle,
            collate_fn=collate_fn,
            dataloader_kwargs=dataloader_kwargs,
        )
        self.partition, self.seed, self.collate_fn = self.feed.partition, seed, collate_fn
        self.samples_per_epoch = self.partition.shard_size * self.world_size
        minibatches = as_schedule("minibatch_size", minibatch_size, self.samples_per_epoch)
        assert minibatches is not None  # None only for a None value, which minibatch_size is not
        self.minibatch_schedule: Schedule = minibatches
        for value in self.minibatch_schedule.values:
            try:
                local_minibatch_size(value, self.world_size)
            except ValueError as error:
                raise ValueError(f"minibatch_size: {error}") from None
        self._init_control(learning_rate_per_sample, momentum_time_constant, unit_gain)
        if self._momentum is not None and any("momentum" not in g for g in self.optimizer.param_groups):
            raise ValueError(
                f"momentum_time_constant needs an optimizer with a 'momentum' setting such as torch.optim.SGD; "
                f"{type(self.optimizer.optimizer).__name__} has none"
            )
        self.checkpoint = checkpoint
        self.cross_validation = cross_validation
        self.test = test
        self.max_epochs, self.max_samples = max_epochs, max_samples

        self.callbacks = standard_callbacks(progress, log_csv, tensorboard, callbacks)

        first = next(self.model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        # Progress: the same on every rank at every step.
        self.samples = 0  # global samples trained since the start of training
        self.steps = 0
        self.epoch = 0  # the epoch being trained (= epochs completed)
        self.position = 0  # samples of this epoch's shard consumed, the same on every rank
        self.cv_index = 0
        self.epochs: list[EpochSummary] = []
        self.cross_validations: list[EvalResult] = []
        self.restored_from: str | None = None
        self._stopped: str | None = None
        self._acc = Accumulator()
        self._trained = False
        self._epoch_clock = (time.perf_counter(), 0)
        self._last_minibatch = 0

    @property
    def minibatch_size(self) -> int:
        """The global minibatch the next step asks for (before rounding to the workers)."""
        return int(self.minibatch_schedule(self.samples))

    def running_loss(self) -> float:
        """This rank's mean training loss so far in the epoch (local, no communication)."""
        total = self._acc.sums.get("loss")
        count = self._acc.counts.get("loss", 0)
        return float(total.item()) / count if total is not None and count else math.nan

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

    def _step(self, batch: Any, local: int) -> bool:
        if self.elastic is not None:  # a step of the job's quorum, redone until one commits it
            return self.elastic.step(self, batch, local)
        minibatch = local * self.world_size  # the step's actual global minibatch
        self._set_rates(self.optimizer.param_groups, minibatch)
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
        return True

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
        index, callback = self.cv_index, cv.callback
        result.index, result.trained_samples = index, self.samples
        self.cv_index += 1
        self.cross_validations.append(result)
        self._emit("on_cross_validation", result)
        keep_going = True
        if callback is not None:
            keep_going = self._steer(lambda: callback(index, result.error, result.samples, result.minibatches))
        return result, keep_going

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
            restore_session(self)
        if self.elastic is not None:
            self.elastic.begin(self)  # the first quorum: a late joiner receives the job's state here
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
            batches = self.feed.batches(self.epoch, self.position, plan)
            for local in plan:
                if not self._step(next(batches), local):
                    break  # an elastic worker that received its peers' later state: plan again from it
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
                    self._emit("on_checkpoint", save_session(self))
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
