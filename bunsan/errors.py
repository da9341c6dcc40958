"""Exceptions raised by bunsan.

Every error bunsan raises on purpose derives from :class:`BunsanError`, so a
training script can catch them in one place. Bad arguments are ``ValueError`` or
``TypeError`` raised where the argument is given; the classes here are for
failures at run time.
"""

from __future__ import annotations

__all__ = [
    "BunsanError",
    "CheckpointError",
    "CommunicationError",
    "ConfigurationError",
    "MissingExtraError",
    "ModelMismatchError",
    "WorkerFailedError",
]


class BunsanError(Exception):
    """Base class of bunsan's run-time errors."""


class ConfigurationError(BunsanError, ValueError):
    """The environment or the combination of settings cannot work (a ValueError too)."""


class CommunicationError(BunsanError, RuntimeError):
    """A collective failed or did not complete within the timeout."""


class WorkerFailedError(BunsanError, RuntimeError):
    """Another worker of the job failed, so this one cannot go on."""


class ModelMismatchError(BunsanError, ValueError):
    """The model is not the same on every rank (names, shapes or dtypes differ)."""


class CheckpointError(BunsanError, RuntimeError):
    """A checkpoint cannot be written, read, or does not fit the model."""


class MissingExtraError(BunsanError, ImportError):
    """An optional dependency is not installed; the message names the extra of bunsan that installs it.

    An ``ImportError`` too, so ``except ImportError`` around an optional feature keeps working.
    """
