"""The protocol between ``bunsan run`` and its per-host agents (:mod:`bunsan.launch.remote`). Pure.

Protocol (private between the launcher and the agent of the same version):

* launcher to agent, on stdin: one JSON object per line. First ``init``
  (what to run, see :class:`AgentInit`), then ``start`` with
  ``master_addr`` and ``master_port`` (and, for an elastic job's worker,
  ``env``: variables only known once the agent is ready), ``ping`` every second, and ``stop``
  with the signal to forward.
* agent to launcher, on stdout: frames ``KIND RANK LENGTH\\n`` followed by
  ``LENGTH`` bytes (:func:`encode_frame`, :class:`FrameDecoder`). ``o`` and
  ``e`` carry whole lines of a worker's stdout and stderr, ``m`` a message of
  the agent, ``s`` a status event in JSON: ``ready`` (host name, the ssh
  connection's addresses, the checked port), ``error`` (cannot start:
  working directory, script or port), ``report`` (a worker raised: it is
  about to exit and the job will end because of it), ``failed`` (a worker
  failed, with the time, sent before the others are stopped; ``origin`` false
  when it only stopped because a rank of another host failed) and ``done``
  (the outcome, once every worker here is gone); for an elastic job's worker
  also ``joined`` (the replica that joined a quorum). The agent's own stderr is not framed: a traceback
  of the agent itself reaches the launcher's stderr as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from bunsan.launch.proctree import GRACE_S

__all__ = ["HEARTBEAT_TIMEOUT_S", "AgentInit", "Frame", "FrameDecoder", "encode_frame"]

HEARTBEAT_TIMEOUT_S = 30.0  # no message from the launcher for this long: it is gone
_FRAME_KINDS = frozenset(b"oems")


# ---------------------------------------------------------------------------
# Frames: agent to launcher. Pure.


@dataclass(frozen=True)
class Frame:
    """One unit of the agent's stdout: ``kind`` is ``"o"``, ``"e"``, ``"m"`` or ``"s"``."""

    kind: str
    rank: int
    payload: bytes


def encode_frame(kind: str, rank: int, payload: bytes) -> bytes:
    """Return the bytes of one frame (see the module docstring)."""
    return f"{kind} {rank} {len(payload)}\n".encode() + payload


class FrameDecoder:
    """Split a byte stream into :class:`Frame` objects, whatever the chunking.

    Anything that is not a frame header (for instance a shell's greeting
    printed before the agent started) is returned as a frame of kind ``"?"``
    so that it is shown, not lost.
    """

    _MAX_HEADER = 64

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        while self._buffer:
            newline = self._buffer.find(b"\n", 0, self._MAX_HEADER)
            if newline < 0:
                if len(self._buffer) >= self._MAX_HEADER:  # no header can be this long
                    frames.append(Frame("?", -1, self._buffer))
                    self._buffer = b""
                break
            header = self._buffer[:newline].split(b" ")
            if len(header) != 3 or len(header[0]) != 1 or header[0][0] not in _FRAME_KINDS:
                frames.append(Frame("?", -1, self._buffer[: newline + 1]))
                self._buffer = self._buffer[newline + 1 :]
                continue
            try:
                rank, length = int(header[1]), int(header[2])
            except ValueError:
                frames.append(Frame("?", -1, self._buffer[: newline + 1]))
                self._buffer = self._buffer[newline + 1 :]
                continue
            end = newline + 1 + length
            if len(self._buffer) < end:
                break
            frames.append(Frame(header[0].decode(), rank, self._buffer[newline + 1 : end]))
            self._buffer = self._buffer[end:]
        return frames

    def rest(self) -> bytes:
        """Bytes of an incomplete frame left at the end of the stream."""
        rest, self._buffer = self._buffer, b""
        return rest


# ---------------------------------------------------------------------------
# What the launcher sends first.


@dataclass(frozen=True)
class AgentInit:
    """The ``init`` message: everything an agent needs but the master address and port.

    Attributes:
        job_id: The job's id (``BUNSAN_JOB_ID``), the same on every host and attempt.
        group_rank: Index of this host among the hosts of the job.
        hosts: Number of hosts in the job.
        restart: 0 for the first attempt, then 1, 2, ... (``BUNSAN_RESTART``).
        cwd: Working directory of the workers.
        argv: The worker command, already resolved for this host.
        script: A ``.py`` script that must exist in ``cwd``, or ``None``.
        env: Variables added to this host's own environment for the workers.
        slots: ``[rank, local_rank, world_size, local_world_size]`` of each worker here.
        check_port: Port to check (0: pick a free one), or ``None`` on hosts other than rank 0's.
        grace_s: Seconds between SIGTERM and SIGKILL when the job stops.
        heartbeat_timeout_s: Silence from the launcher that counts as its death.
        oversubscribe: ``--oversubscribe``: more workers than this host has cores are fine.
    """

    job_id: str
    group_rank: int
    hosts: int
    restart: int
    cwd: str
    argv: list[str]
    script: str | None
    env: dict[str, str]
    slots: list[list[int]]
    check_port: int | None = None
    grace_s: float = GRACE_S
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    oversubscribe: bool = False
    op: str = field(default="init")

    def to_line(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> AgentInit:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in message.items() if k in names})

    @property
    def host_job_id(self) -> str:
        """The value of ``BUNSAN_HOST_JOB_ID`` for this host's workers."""
        return f"{self.job_id}.h{self.group_rank}"
