"""What a :class:`bunsan.TrainingSession` writes into a checkpoint and how it takes it back.

The session's state falls in three parts, saved by :func:`bunsan.train.checkpoint.save`:

* *common*, the same on every rank: the counters (samples, steps, epoch, position in
  the epoch, ...), the control state a cross-validation callback may change (learning
  rate and momentum schedules, ``extra_state``) and the history of epochs and evaluations;
* *replicated*: model, optimizer and algorithm state (the same on every rank under exact
  data parallelism, per rank between two synchronizations of a block algorithm);
* *per rank*: random states and the epoch's partial sums.

A checkpoint restores exactly into the same number of workers. Into another number,
the model, the optimizer and the control state are restored, the position in the epoch
is rounded to the new number of workers, and a warning names what starts afresh.

This module is the session's own persistence: it reads and sets the session's
attributes, private ones included, so that ``session.py`` keeps only the training loop.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bunsan.errors import CheckpointError
from bunsan.train.checkpoint.collective import Restored, restore, save
from bunsan.train.checkpoint.state import check_model_fits, rng_state, set_rng_state
from bunsan.train.metrics import Accumulator, EvalResult
from bunsan.train.summaries import EpochSummary

if TYPE_CHECKING:
    from bunsan.train.session import TrainingSession

__all__ = ["common_state", "restore_session", "save_session"]


def common_state(session: TrainingSession) -> dict[str, Any]:
    """The part of ``session``'s state that is the same on every rank: counters, control state, history."""
    return {
        "counters": {
            "samples": session.samples,
            "steps": session.steps,
            "epoch": session.epoch,
            "position": session.position,
            "cv_index": session.cv_index,
            "samples_per_epoch": session.samples_per_epoch,
            "seed": session.seed,
            "last_minibatch": session._last_minibatch,
        },
        "stopped": session._stopped,
        "control": session._control(),
        "history": {
            "epochs": [e.as_dict() for e in session.epochs],
            "cross_validations": [r.as_dict() for r in session.cross_validations],
        },
    }


def save_session(session: TrainingSession) -> Path:
    """Write one checkpoint of ``session`` (rank 0 writes, every rank contributes). Collective.

    In an elastic job it is not collective: the quorum's rank 0 writes and the others only name the file
    (:mod:`bunsan.train.elastic_feed`)."""
    assert session.checkpoint is not None
    if getattr(session, "elastic", None) is not None and not session.is_main:
        return session.checkpoint.file_for(session.samples)
    common = common_state(session)
    replicated = {
        "model": session.model.state_dict(),
        "optimizer": session.optimizer.optimizer.state_dict(),
        "algorithm": session.algorithm.state_dict(),
    }
    per_rank = {"rng": rng_state(), "accumulator": {k: list(v) for k, v in session._acc.local().items()}}
    return save(
        session.checkpoint,
        session.samples,
        common=common,
        replicated=replicated,
        per_rank=per_rank,
        group=session.group,
    )


def restore_session(session: TrainingSession) -> None:
    """Continue ``session`` from its newest valid checkpoint, if there is one. Collective.

    Raises:
        CheckpointError: The checkpoint was written for another model, other
            training data, another seed or an optimizer of another shape.
    """
    assert session.checkpoint is not None
    restored = restore(session.checkpoint, session.group)
    if restored is None:
        return
    notes = _restore_replicated(session, restored)
    counters = restored.common["counters"]
    session.samples, session.steps = int(counters["samples"]), int(counters["steps"])
    session.epoch, session.cv_index = int(counters["epoch"]), int(counters["cv_index"])
    session._last_minibatch = int(counters.get("last_minibatch", 0))
    if restored.world_size == session.world_size:
        assert restored.per_rank is not None
        session.position = int(counters["position"])
        session._acc = Accumulator.from_local(restored.per_rank["accumulator"])
        set_rng_state(restored.per_rank["rng"])
    else:
        # The epoch's first position * saved_world samples of its order were trained;
        # continue at the same point of the order, rounded down (a few samples may repeat).
        offset = int(counters["position"]) * restored.world_size
        session.position = min(offset // session.world_size, session.partition.shard_size)
        session._acc = Accumulator()
        if session.is_main:  # the partial sums of every saved rank, counted once
            for saved in restored.all_per_rank:
                for name, (total, count) in saved["accumulator"].items():
                    session._acc.add(name, float(total), int(count))
        notes.append("the data position was rounded to the new number of workers and random states are not restored")
    session._apply_control(restored.common["control"])
    session._stopped = restored.common["stopped"]
    history = restored.common["history"]
    session.epochs = [EpochSummary.from_dict(e) for e in history["epochs"]]
    session.cross_validations = [EvalResult.from_dict(r) for r in history["cross_validations"]]
    session.restored_from = str(restored.path)
    if notes and session.is_main:
        warnings.warn(
            f"restored {restored.path} written by {restored.world_size} worker(s) into {session.world_size}: "
            + "; ".join(notes),
            stacklevel=3,  # restore_session <- TrainingSession.train <- the user's call
        )


def _restore_replicated(session: TrainingSession, restored: Restored) -> list[str]:
    """Check that ``restored`` fits ``session``, load model, optimizer and algorithm; return the notes."""
    source = f"checkpoint {restored.path}"
    check_model_fits(restored.replicated["model"], session.model, source)
    counters = restored.common["counters"]
    same_world = restored.world_size == session.world_size
    if same_world and counters["samples_per_epoch"] != session.samples_per_epoch:
        raise CheckpointError(
            f"{source} was written for {counters['samples_per_epoch']} training samples per epoch, but this "
            f"session has {session.samples_per_epoch}: restore with the same training data"
        )
    if counters["seed"] != session.seed:
        raise CheckpointError(f"{source} was written with seed={counters['seed']}; build the session with that seed")
    notes = list(restored.notes)
    session.model.load_state_dict(restored.replicated["model"])
    try:
        session.optimizer.optimizer.load_state_dict(restored.replicated["optimizer"])
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"{source} has an optimizer state that does not fit this optimizer: {error}") from None
    if same_world:
        session.algorithm.load_state_dict(restored.replicated["algorithm"])
    else:
        notes.append(f"the algorithm's per-rank state ({session.algorithm!r}) starts afresh")
    return notes
