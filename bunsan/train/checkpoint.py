"""Checkpoints that survive a crash at any moment and resume a run exactly.

Three promises, and how they are kept:

* **A crash never destroys the last good checkpoint.** A file is written under
  a temporary name in the same directory, flushed and ``fsync``-ed, renamed over
  its final name with ``os.replace`` (atomic on POSIX), and the directory is
  ``fsync``-ed so that the rename itself is durable. A crash before the rename
  leaves only a stray temporary file, which restore ignores.
* **A damaged file is detected, not loaded.** Every file starts with a header
  holding the SHA-256 and length of the payload; a truncated or altered file
  fails the check and restore falls back to the previous one with a warning.
* **Loading runs no code from the file.** The payload holds only tensors,
  numbers, strings and containers (checked when saving) and is read with
  ``torch.load(weights_only=True)``; random-number-generator states of numpy
  and Python are converted to tensors and lists for that.

The collective part (:func:`save`, :func:`restore`) follows one rule: rank 0
decides and the others follow. Rank 0 writes the file and tells every rank
whether it succeeded; rank 0 picks the checkpoint to restore and broadcasts its
name, so all ranks load the same one even if the directory changes meanwhile.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import random
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from bunsan import comm
from bunsan.comm import inspector
from bunsan.errors import CheckpointError

__all__ = [
    "Checkpoint",
    "Restored",
    "check_model_fits",
    "check_plain",
    "digest",
    "find_latest_valid",
    "read_file",
    "restore",
    "rng_state",
    "save",
    "set_rng_state",
    "write_file",
]

FORMAT = 1
_MAGIC = b"BUNSAN-CHECKPOINT 1\n"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Checkpoint:
    """Where and when :class:`bunsan.TrainingSession` writes checkpoints.

    Files are named after ``path`` and the global sample count at which they
    were written: ``Checkpoint("models/mnist.pt")`` writes
    ``models/mnist.000000054000.pt``, ... (a ``path`` that is a directory, or
    ends with ``/``, gets ``checkpoint.<samples>.pt`` inside it).

    Args:
        path: File name pattern, see above. Its directory is created.
        every: Global samples between two checkpoints (a checkpoint is written
            after the step that crosses each multiple); ``None`` means at the
            end of every epoch. A last checkpoint is always written when
            training ends.
        restore: Continue from the newest valid checkpoint when one exists
            (a damaged one is skipped with a warning). When checkpoint files
            exist but every one is damaged, restoring raises
            :class:`~bunsan.errors.CheckpointError`: the user asked to resume.
        keep: Keep the newest ``keep`` files and delete older ones; ``None``
            keeps all.
        allow_fresh_start: With ``restore``, start from scratch (after the
            warnings) instead of raising when every checkpoint file is damaged.

    Raises:
        ValueError: ``every`` < 1 or ``keep`` < 1.
    """

    path: str | os.PathLike[str]
    every: int | None = None
    restore: bool = True
    keep: int | None = 2
    allow_fresh_start: bool = False

    def __post_init__(self) -> None:
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ValueError(f"every must be a number of samples >= 1 or None (every epoch), got {self.every!r}")
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1):
            raise ValueError(f"keep must be >= 1 or None (keep every file), got {self.keep!r}")

    def _parts(self) -> tuple[Path, str, str]:
        raw = os.fspath(self.path)
        path = Path(raw)
        if raw.endswith(("/", os.sep)) or path.is_dir():
            return path, "checkpoint", ".pt"
        return path.parent, path.stem if path.suffix else path.name, path.suffix

    @property
    def directory(self) -> Path:
        return self._parts()[0]

    def file_for(self, samples: int) -> Path:
        """The file written after ``samples`` global samples."""
        directory, stem, suffix = self._parts()
        return directory / f"{stem}.{samples:012d}{suffix}"

    def files(self) -> list[tuple[int, Path]]:
        """Existing checkpoint files as ``(samples, path)``, newest (most samples) first."""
        directory, stem, suffix = self._parts()
        pattern = re.compile(re.escape(stem) + r"\.(\d{12,})" + re.escape(suffix) + "$")
        if not directory.is_dir():
            return []
        found = []
        for entry in directory.iterdir():
            match = pattern.match(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found, key=lambda item: item[0], reverse=True)


# ----------------------------------------------------------------------------- file format


def _fsync(fd: int) -> None:
    os.fsync(fd)


def _write_payload(file: Any, data: bytes) -> None:
    for start in range(0, len(data), _CHUNK):
        file.write(data[start : start + _CHUNK])


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not supported here (e.g. some network file systems); the rename is still atomic
    try:
        _fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` to ``path`` atomically, with a checksum. Not collective.

    The bytes go to a temporary file in the same directory (same file system,
    so the rename is atomic), which is flushed, ``fsync``-ed and renamed over
    ``path``; then the directory is ``fsync``-ed. A crash at any point leaves
    either the old file or the new one, never a mix.

    Raises:
        CheckpointError: ``payload`` holds something ``torch.load(weights_only=True)``
            could not read back (named by its key path).
        OSError: The file system refused (disk full, permissions).
    """
    check_plain(payload)
    buffer = io.BytesIO()
    torch.save(dict(payload), buffer)
    data = buffer.getvalue()
    header = _MAGIC + f"sha256 {hashlib.sha256(data).hexdigest()} {len(data)}\n".encode()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(header)
            _write_payload(file, data)
            file.flush()
            _fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    _fsync_directory(target.parent)
    return target


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a file written by :func:`write_file`. Not collective.

    Raises:
        CheckpointError: The file is missing, truncated, fails its checksum or
            cannot be unpickled safely. The message names the file.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"cannot read checkpoint {path}: {error}") from None
    if not raw.startswith(_MAGIC):
        raise CheckpointError(f"{path} is not a bunsan checkpoint (bad header)")
    end = raw.find(b"\n", len(_MAGIC))
    fields = raw[len(_MAGIC) : end].decode(errors="replace").split() if end > 0 else []
    if len(fields) != 3 or fields[0] != "sha256" or not fields[2].isdigit():
        raise CheckpointError(f"{path} has a damaged header")
    data = raw[end + 1 :]
    if len(data) != int(fields[2]):
        raise CheckpointError(f"{path} is truncated: {len(data)} of {fields[2]} payload bytes")
    if hashlib.sha256(data).hexdigest() != fields[1]:
        raise CheckpointError(f"{path} fails its SHA-256 checksum (the file was altered or damaged)")
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"cannot load {path}: {type(error).__name__}: {error}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} has format {payload.get('format') if isinstance(payload, dict) else '?'}, expected {FORMAT}"
        )
    return payload


def find_latest_valid(
    checkpoint: Checkpoint, validate: Callable[[Path, dict[str, Any]], None] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest file of ``checkpoint`` that reads back whole, and its payload. Not collective.

    Damaged files, and files that ``validate(path, payload)`` rejects with a
    :class:`CheckpointError`, are skipped with a warning naming the file and the reason.
    """
    for _, path in checkpoint.files():
        try:
            payload = read_file(path)
            if validate is not None:
                validate(path, payload)
            return path, payload
        except CheckpointError as error:
            warnings.warn(f"skipping damaged checkpoint: {error}; trying the previous one", stacklevel=2)
    return None


_PLAIN = (str, bytes, int, float, bool, type(None), torch.dtype, torch.Size, torch.device)


def check_plain(obj: Any, where: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` unless ``obj`` is made of what ``weights_only`` loading reads.

    Allowed: tensors, ``str``, ``bytes``, numbers, ``bool``, ``None``, torch
    dtypes/sizes/devices, and dicts, lists and tuples of those.
    """
    if isinstance(obj, Tensor) or isinstance(obj, _PLAIN):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(f"{where} has a key {key!r} of type {type(key).__name__}; use str or int keys")
            check_plain(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__name__}, which torch.load(weights_only=True) cannot read back; "
        "state_dict() methods must return tensors, numbers, strings and dicts/lists of them"
    )


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
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
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


# ----------------------------------------------------------------------------- collective save / restore


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
