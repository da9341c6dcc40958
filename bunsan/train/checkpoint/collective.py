"""Collective save and restore of one checkpoint of the whole job: rank 0 decides, the others follow.

Rank 0 writes the file and tells every rank whether it succeeded; rank 0 picks the
checkpoint to restore and broadcasts its name, so all ranks load the same one even if
the directory changes meanwhile. See :mod:`bunsan.train.checkpoint`.
"""

from __future__ import annotations

import glob
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bunsan import comm
from bunsan.comm import inspector
from bunsan.errors import CheckpointError
from bunsan.train.checkpoint.files import FORMAT, Checkpoint, find_latest_valid, read_file, write_file
from bunsan.train.checkpoint.state import _cpu, digest

__all__ = ["Restored", "restore", "save"]


def _broadcast(obj: Any, group: Any) -> Any:
    return obj if comm.get_world_size(group) == 1 else comm.broadcast_object(obj, src=0, group=group)


@inspector.activity("in checkpoint save")  # a stall report names it
def save(
    checkpoint: Checkpoint,
    samples: int,
    *,
    common: Mapping[str, Any],
    replicated: Mapping[str, Any],
    per_rank: Mapping[str, Any],
    group: Any = None,
) -> Path:
    """Write one checkpoint of the whole job: rank 0 writes, every rank contributes. Collective.

    Args:
        checkpoint: Where.
        samples: Global samples trained; names the file.
        common: The same on every rank by construction (counters, schedules,
            history): rank 0's is written.
        replicated: Usually the same on every rank (model, optimizer and
            algorithm state under exact data parallelism) but not always (a
            block algorithm between two synchronizations). Every rank sends a
            digest of each entry; an entry whose digests all agree is written
            once, any other is gathered from every rank and written per rank.
            The keys must be the same on every rank.
        per_rank: Always written per rank (random states, partial sums).

    Returns:
        The file written (the same path on every rank).

    Raises:
        CheckpointError: On every rank, when rank 0 could not write.
    """
    rank, world_size = comm.get_rank(group), comm.get_world_size(group)
    replicated = {key: _cpu(value) for key, value in replicated.items()}
    mine = _cpu(dict(per_rank))
    if world_size > 1:
        digests = comm.all_gather_object({key: digest(value) for key, value in replicated.items()}, group=group)
        # Same key order on every rank (the caller builds the same dict), so the
        # all-gathers below are called in the same order everywhere.
        differing = [key for key in replicated if len({d[key] for d in digests}) > 1]
        replicas = {key: comm.all_gather_object(replicated[key], group=group) for key in differing}
        every_rank = comm.all_gather_object(mine, group=group)
    else:
        replicas, every_rank = {}, [mine]
    path = checkpoint.file_for(samples)
    error = None
    if rank == 0:
        values = dict(replicated)
        for key, gathered in replicas.items():
            values[key] = gathered[0]  # the same object as the list's first entry: torch.save stores it once
        payload = {
            "format": FORMAT,
            "world_size": world_size,
            "samples": int(samples),
            "common": _cpu(dict(common)),
            "replicated": values,
            "replicas": replicas,
            "per_rank": every_rank,
        }
        try:
            write_file(path, payload)
            _prune(checkpoint)
        except (OSError, CheckpointError) as failure:
            error = f"could not write checkpoint {path}: {failure}"
    # Everyone learns whether rank 0 succeeded, so that a failure raises on every rank.
    error = _broadcast(error, group)
    if error is not None:
        raise CheckpointError(error)
    return path


def _prune(checkpoint: Checkpoint) -> None:
    files = checkpoint.files()
    if checkpoint.keep is not None:
        for _, old in files[checkpoint.keep :]:
            try:
                old.unlink()
            except OSError:
                pass
    # Temporary files of writers that were killed before their rename.
    directory, stem, suffix = checkpoint._parts()
    for stray in directory.glob(f".{glob.escape(stem)}.*{glob.escape(suffix)}.*.tmp"):
        try:
            stray.unlink()
        except OSError:
            pass


@dataclass
class Restored:
    """What :func:`restore` hands back to this rank.

    Attributes:
        path: The file, the same on every rank.
        samples: Global samples trained when it was written.
        world_size: The world size of the job that wrote it.
        common: Counters and control state (the same on every rank).
        replicated: This rank's model, optimizer, ... state: its own when the
            ranks differed and the world size is the same, else rank 0's.
        per_rank: This rank's per-rank state, or None when the world size changed.
        all_per_rank: Every saved rank's per-rank state.
        notes: What could not be restored exactly (world size changed), for a warning.
    """

    path: Path
    samples: int
    world_size: int
    common: dict[str, Any]
    replicated: dict[str, Any]
    per_rank: dict[str, Any] | None
    all_per_rank: list[dict[str, Any]]
    notes: list[str]


_LAYOUT = ("world_size", "samples", "common", "replicated", "replicas", "per_rank")


def _check_layout(path: Path, payload: dict[str, Any]) -> None:
    missing = [key for key in _LAYOUT if key not in payload]
    if missing:
        raise CheckpointError(f"{path} is not a training checkpoint: it lacks {missing}")


def _pick(path: Path, payload: dict[str, Any], rank: int, world_size: int) -> Restored:
    saved_world = int(payload["world_size"])
    same = saved_world == world_size
    replicated = dict(payload["replicated"])
    notes = []
    for key, values in payload["replicas"].items():
        if same:
            replicated[key] = values[rank]
        else:
            notes.append(f"the ranks' {key!r} differed when saved; every rank takes rank 0's")
    return Restored(
        path,
        int(payload["samples"]),
        saved_world,
        dict(payload["common"]),
        replicated,
        payload["per_rank"][rank] if same else None,
        list(payload["per_rank"]),
        notes,
    )


def restore(checkpoint: Checkpoint, group: Any = None) -> Restored | None:
    """Load the newest valid checkpoint on every rank, or return None when there is none. Collective.

    Rank 0 picks the file (skipping damaged ones with a warning) and broadcasts
    its name; every other rank reads that same file and verifies it. If any
    rank cannot, every rank raises the same :class:`CheckpointError`.

    Raises:
        CheckpointError: Checkpoint files exist but every one is damaged, and
            ``checkpoint.allow_fresh_start`` is false; or a rank cannot read
            the file rank 0 chose.
    """
    rank, world_size = comm.get_rank(group), comm.get_world_size(group)
    payload: dict[str, Any] | None = None
    chosen: str | None = None
    refusal: str | None = None
    if rank == 0:
        files = checkpoint.files()
        found = find_latest_valid(checkpoint, _check_layout)
        if found is not None:
            chosen, payload = str(found[0]), found[1]
        elif files and not checkpoint.allow_fresh_start:
            refusal = (
                f"every one of the {len(files)} checkpoint file(s) in {checkpoint.directory} is damaged (see the "
                "warnings), so there is nothing to resume from; repair or remove them, or pass "
                "Checkpoint(..., allow_fresh_start=True) to start from scratch"
            )
    # One broadcast: every rank learns the file, or that there is none, or that restoring must fail.
    chosen, refusal = _broadcast((chosen, refusal), group)
    if refusal is not None:
        raise CheckpointError(refusal)
    if chosen is None:
        return None
    error = None
    if rank != 0:
        try:
            payload = read_file(chosen)
            _check_layout(Path(chosen), payload)
        except CheckpointError as failure:
            error = str(failure)
    if world_size > 1:
        errors = comm.all_gather_object(error, group=group)
        for failed, message in enumerate(errors):
            if message is not None:
                raise CheckpointError(
                    f"rank {failed} cannot read the checkpoint rank 0 chose ({message}); "
                    "every rank must see the same checkpoint directory (a shared file system)"
                )
    assert payload is not None
    return _pick(Path(chosen), payload, rank, world_size)
