"""The checkpoint file: where files go, how one is written atomically and read back verified.

A file is written under a temporary name in the same directory, flushed and
``fsync``-ed, renamed over its final name with ``os.replace`` (atomic on POSIX),
and the directory is ``fsync``-ed so that the rename itself is durable. Every file
starts with a header holding the SHA-256 and length of the payload, and the payload
holds only what ``torch.load(weights_only=True)`` reads. See :mod:`bunsan.train.checkpoint`.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bunsan._validate import check_int
from bunsan.errors import CheckpointError

__all__ = ["FORMAT", "Checkpoint", "check_plain", "find_latest_valid", "read_file", "write_file"]

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
        TypeError: ``every`` or ``keep`` is not an int (or None).
        ValueError: ``every`` < 1 or ``keep`` < 1.
    """

    path: str | os.PathLike[str]
    every: int | None = None
    restore: bool = True
    keep: int | None = 2
    allow_fresh_start: bool = False

    def __post_init__(self) -> None:
        check_int("every", self.every, minimum=1, allow_none=True, hint="global samples; None means every epoch")
        check_int("keep", self.keep, minimum=1, allow_none=True, hint="None keeps every file")

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
    if isinstance(obj, (Tensor, *_PLAIN)):
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
