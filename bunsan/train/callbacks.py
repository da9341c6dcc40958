"""What a :class:`bunsan.TrainingSession` reports while it trains: progress, CSV, TensorBoard.

A :class:`Callback` gets the session at fixed points. Every rank calls every
hook at the same points with the same reduced values, so a callback may not
run collectives of its own unless it runs them on every rank. The ones here
write only on rank 0 (``session.is_main``): one bar, one log, however many
workers.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from bunsan import _extras

if TYPE_CHECKING:
    from bunsan.train.metrics import EvalResult
    from bunsan.train.session import TrainingSession
    from bunsan.train.summaries import EpochSummary, TrainingSummary

__all__ = ["CSVLogger", "Callback", "ProgressPrinter", "TensorBoardLogger", "format_metrics", "standard_callbacks"]


class Callback:
    """Base class: override the hooks you need. All are called on every rank."""

    def on_train_begin(self, session: TrainingSession) -> None:
        """After a restore (if any), before the first step."""

    def on_step_end(self, session: TrainingSession, samples: int) -> None:
        """After each optimizer step; ``samples`` is the step's global minibatch."""

    def on_cross_validation(self, session: TrainingSession, result: EvalResult) -> None:
        """After each cross-validation, before its control callback runs."""

    def on_epoch_end(self, session: TrainingSession, epoch: EpochSummary) -> None:
        """After each complete epoch, after its checkpoint (if one was due) is written."""

    def on_checkpoint(self, session: TrainingSession, path: Path) -> None:
        """After a checkpoint file is written (on every rank, with the same path)."""

    def on_train_end(self, session: TrainingSession, summary: TrainingSummary) -> None:
        """After the final test; ``summary`` is what ``train()`` returns."""


def format_metrics(loss: float, metrics: dict[str, float], prefix: str = "") -> str:
    """``"loss 0.1234  error 0.0312"``, with an optional ``prefix`` on every name."""
    parts = [f"{prefix}loss {loss:.4f}"] + [f"{prefix}{name} {value:.4f}" for name, value in metrics.items()]
    return "  ".join(parts)


class ProgressPrinter(Callback):
    """A tqdm bar (rank 0, terminals only) and one summary line per epoch (rank 0).

    The bar shows the epoch's samples, samples per second and rank 0's running
    loss (local to rank 0, so that the bar costs no communication; the epoch
    line has the exact global loss). When stdout is not a terminal there is no
    bar, only the lines, so logs of batch jobs stay readable. The bar is drawn by
    tqdm, the ``progress`` extra (``pip install 'bunsan[progress]'``): without it
    there is no bar either, only the lines.

    Args:
        bar: Force the bar on or off; ``None`` shows it when stdout is a terminal
            and tqdm is installed.
        stream: Where to write; default ``sys.stdout``.
        refresh_s: Minimum seconds between two updates of the loss on the bar
            (reading the loss synchronizes with the GPU).

    Raises:
        MissingExtraError: ``bar=True`` and tqdm is not installed (an ImportError; the message names the extra).
    """

    def __init__(self, bar: bool | None = None, stream: IO[str] | None = None, refresh_s: float = 0.5) -> None:
        if bar:
            _extras.check("ProgressPrinter(bar=True)", ["tqdm"], "progress")
        self.bar = bar
        self.stream = stream
        self.refresh_s = refresh_s
        self._tqdm: Any = None
        self._last_refresh = 0.0
        self._epoch_shown = -1

    def _out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stdout

    def _use_bar(self) -> bool:
        if self.bar is not None:
            return self.bar
        out = self._out()
        return bool(getattr(out, "isatty", lambda: False)()) and _extras.available("tqdm")

    def _write(self, line: str) -> None:
        if self._tqdm is not None:
            self._tqdm.write(line, file=self._out())
        else:
            print(line, file=self._out(), flush=True)

    def _open_bar(self, session: TrainingSession, done: int) -> None:
        tqdm = _extras.require("tqdm.auto", "the progress bar", "progress").tqdm
        self._tqdm = tqdm(
            total=session.samples_per_epoch,
            initial=done,
            desc=f"epoch {session.epoch + 1}",
            unit="sample",
            dynamic_ncols=True,
            leave=False,
            file=self._out(),
        )
        self._epoch_shown = session.epoch

    def on_train_begin(self, session: TrainingSession) -> None:
        if not session.is_main:
            return
        where = f", restored from {session.restored_from}" if session.restored_from else ""
        elastic = getattr(session, "elastic", None)
        workers = session.world_size if elastic is None else elastic.member.size()
        self._write(
            f"training on {workers} worker(s) with {session.algorithm!r}: "
            f"{session.samples_per_epoch} samples per epoch{where}"
        )

    def on_step_end(self, session: TrainingSession, samples: int) -> None:
        if not session.is_main or not self._use_bar():
            return
        if self._tqdm is None or self._epoch_shown != session.epoch:
            self._close_bar()
            # The epoch's samples before this step: 0, or where a restored run resumed.
            self._open_bar(session, session.position * session.world_size - samples)
        self._tqdm.update(samples)
        now = time.monotonic()
        if now - self._last_refresh >= self.refresh_s:
            self._last_refresh = now
            self._tqdm.set_postfix(loss=f"{session.running_loss():.4f}", refresh=False)

    def _close_bar(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def on_cross_validation(self, session: TrainingSession, result: EvalResult) -> None:
        if session.is_main:
            self._write(
                f"cross-validation {result.index + 1 if result.index is not None else ''} after "
                f"{result.trained_samples} samples: {format_metrics(result.loss, result.metrics)} "
                f"({result.samples} samples)"
            )

    def on_epoch_end(self, session: TrainingSession, epoch: EpochSummary) -> None:
        if not session.is_main:
            return
        self._close_bar()
        lr = f"  lr/sample {epoch.learning_rate_per_sample:.4g}" if epoch.learning_rate_per_sample is not None else ""
        self._write(
            f"epoch {epoch.epoch + 1}: {format_metrics(epoch.loss, epoch.metrics)}  "
            f"({epoch.samples} samples, minibatch {epoch.minibatch_size}{lr}, "
            f"{epoch.samples_per_s:.0f} samples/s)"
        )

    def on_train_end(self, session: TrainingSession, summary: TrainingSummary) -> None:
        if not session.is_main:
            return
        self._close_bar()
        if summary.test is not None:
            self._write(
                f"test: {format_metrics(summary.test.loss, summary.test.metrics)} ({summary.test.samples} samples)"
            )
        self._write(
            f"finished ({summary.stopped_by}) after {summary.samples} samples, {summary.steps} steps: "
            f"{summary.samples_per_s:.0f} samples/s, {summary.bytes_per_sample:.1f} bytes sent per sample and worker"
        )


class CSVLogger(Callback):
    """One CSV row per epoch, written by rank 0; appended to an existing file (a resumed run).

    Columns: ``epoch, samples, loss, <metrics>, cv_loss, cv_<metrics>,
    learning_rate_per_sample, minibatch_size, samples_per_s, seconds``; the
    cross-validation cells are empty for epochs without one.

    Args:
        path: The CSV file; its directory is created.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._columns: list[str] = []

    def on_train_begin(self, session: TrainingSession) -> None:
        names = list(session.metrics)
        self._columns = [
            "epoch",
            "samples",
            "loss",
            *names,
            "cv_loss",
            *(f"cv_{n}" for n in names),
            "learning_rate_per_sample",
            "minibatch_size",
            "samples_per_s",
            "seconds",
        ]
        if not session.is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size == 0:
            with self.path.open("w", newline="") as file:
                csv.writer(file).writerow(self._columns)

    def on_epoch_end(self, session: TrainingSession, epoch: EpochSummary) -> None:
        if not session.is_main:
            return
        cv = epoch.cross_validation
        row: dict[str, Any] = {
            "epoch": epoch.epoch + 1,
            "samples": epoch.trained_samples,
            "loss": epoch.loss,
            **epoch.metrics,
            "learning_rate_per_sample": epoch.learning_rate_per_sample,
            "minibatch_size": epoch.minibatch_size,
            "samples_per_s": epoch.samples_per_s,
            "seconds": epoch.seconds,
        }
        if cv is not None:
            row["cv_loss"] = cv.loss
            row.update({f"cv_{name}": value for name, value in cv.metrics.items()})
        with self.path.open("a", newline="") as file:
            csv.writer(file).writerow(["" if row.get(c) is None else row.get(c) for c in self._columns])


class TensorBoardLogger(Callback):
    """Scalars for TensorBoard, written by rank 0; the x axis is the global sample count.

    Needs the optional ``tensorboard`` package (``pip install 'bunsan[tensorboard]'``).

    Args:
        log_dir: The run's directory, as for ``torch.utils.tensorboard.SummaryWriter``.

    Raises:
        MissingExtraError: tensorboard is not installed (an ImportError; the message names the extra).
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise _extras.MissingExtraError(
                f"TensorBoard logging needs the tensorboard package: {_extras.install_hint('tensorboard')} "
                f"(or pass tensorboard=None) [{error}]",
                name="tensorboard",
            ) from None
        self._writer_class = SummaryWriter
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def on_train_begin(self, session: TrainingSession) -> None:
        if session.is_main:
            self._writer = self._writer_class(log_dir=str(self.log_dir))

    def on_epoch_end(self, session: TrainingSession, epoch: EpochSummary) -> None:
        if self._writer is None:
            return
        step = epoch.trained_samples
        self._writer.add_scalar("train/loss", epoch.loss, step)
        for name, value in epoch.metrics.items():
            self._writer.add_scalar(f"train/{name}", value, step)
        if epoch.learning_rate_per_sample is not None:
            self._writer.add_scalar("train/learning_rate_per_sample", epoch.learning_rate_per_sample, step)
        self._writer.add_scalar("train/minibatch_size", epoch.minibatch_size, step)
        self._writer.add_scalar("train/samples_per_s", epoch.samples_per_s, step)

    def on_cross_validation(self, session: TrainingSession, result: EvalResult) -> None:
        if self._writer is None:
            return
        self._writer.add_scalar("cross_validation/loss", result.loss, result.trained_samples)
        for name, value in result.metrics.items():
            self._writer.add_scalar(f"cross_validation/{name}", value, result.trained_samples)

    def on_train_end(self, session: TrainingSession, summary: TrainingSummary) -> None:
        if self._writer is None:
            return
        if summary.test is not None:
            self._writer.add_scalar("test/loss", summary.test.loss, summary.samples)
            for name, value in summary.test.metrics.items():
                self._writer.add_scalar(f"test/{name}", value, summary.samples)
        self._writer.close()
        self._writer = None


def standard_callbacks(
    progress: bool,
    log_csv: str | os.PathLike[str] | None,
    tensorboard: str | os.PathLike[str] | None,
    more: Sequence[Callback],
) -> list[Callback]:
    """The callbacks that :class:`bunsan.TrainingSession`'s reporting arguments ask for, then ``more``."""
    chosen: list[Callback] = [ProgressPrinter()] if progress else []
    if log_csv is not None:
        chosen.append(CSVLogger(log_csv))
    if tensorboard is not None:
        chosen.append(TensorBoardLogger(tensorboard))
    return [*chosen, *more]
