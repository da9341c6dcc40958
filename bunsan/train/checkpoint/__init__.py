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

The package, by seam: :mod:`~bunsan.train.checkpoint.files` (the file and its
format), :mod:`~bunsan.train.checkpoint.state` (digests, random states, model
fit), :mod:`~bunsan.train.checkpoint.collective` (:func:`save`, :func:`restore`)
and :mod:`~bunsan.train.checkpoint.session_state` (what a
:class:`bunsan.TrainingSession` saves and restores). The collective part follows
one rule: rank 0 decides and the others follow. Rank 0 writes the file and tells every rank
whether it succeeded; rank 0 picks the checkpoint to restore and broadcasts its
name, so all ranks load the same one even if the directory changes meanwhile.
"""

from __future__ import annotations

from bunsan.train.checkpoint.collective import Restored, restore, save
from bunsan.train.checkpoint.files import FORMAT, Checkpoint, check_plain, find_latest_valid, read_file, write_file
from bunsan.train.checkpoint.state import check_model_fits, digest, rng_state, set_rng_state

__all__ = [
    "FORMAT",
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
