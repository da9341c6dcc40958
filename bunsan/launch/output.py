"""Copy the workers' output to the launcher's, one whole line at a time, tagged with the rank (``--tag-output``)."""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Callable
from typing import IO, Any

from bunsan.launch.proctree import POLL_S

__all__ = ["OutputPump", "OutputSink", "read_available"]


def read_available(fd: int) -> bytes | None:
    """Read what a non-blocking pipe holds now: ``None`` if nothing yet, ``b""`` at end of file or on an error."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _binary(stream: IO[Any]) -> IO[bytes]:
    return getattr(stream, "buffer", stream)


OutputSink = Callable[[int, int, bytes], None]
"""``sink(rank, stream, data)``: whole lines of a worker's output; ``stream`` is 1 (stdout) or 2 (stderr)."""


class OutputPump:
    """Copy the workers' output to ours, one whole line at a time, prefixed with ``[rank] ``.

    With a ``sink`` the lines go to it instead, untouched (the per-host agent
    frames them for the launcher).
    """

    _MAX_PARTIAL = 1 << 16  # flush a line this long even without its newline

    def __init__(self, stdout: IO[Any], stderr: IO[Any], sink: OutputSink | None = None) -> None:
        self._selector = selectors.DefaultSelector()
        self._dests = {1: _binary(stdout), 2: _binary(stderr)}
        self._sink = sink
        self._partial: dict[int, bytes] = {}

    def add(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        for pipe, stream in ((process.stdout, 1), (process.stderr, 2)):
            if pipe is not None:
                os.set_blocking(pipe.fileno(), False)
                self._selector.register(pipe, selectors.EVENT_READ, (rank, stream, pipe))
                self._partial[pipe.fileno()] = b""

    @property
    def open(self) -> bool:
        return bool(self._selector.get_map())

    def pump(self, timeout_s: float) -> None:
        """Copy what is available, waiting at most ``timeout_s`` for it."""
        if not self.open:
            time.sleep(timeout_s)
            return
        for key, _ in self._selector.select(timeout_s):
            rank, stream, pipe = key.data
            fd = key.fd
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            data = self._partial[fd] + chunk
            if not chunk:  # end of file: flush the last, unterminated line
                self._selector.unregister(pipe)
                pipe.close()
                del self._partial[fd]
                self._write(rank, stream, data.splitlines(keepends=True))
                continue
            lines = data.splitlines(keepends=True)
            if lines and not lines[-1].endswith((b"\n", b"\r")) and len(lines[-1]) < self._MAX_PARTIAL:
                self._partial[fd] = lines.pop()
            else:
                self._partial[fd] = b""
            self._write(rank, stream, lines)

    def drain(self, timeout_s: float) -> None:
        """Copy output until every pipe is closed or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        while self.open and (left := deadline - time.monotonic()) > 0:
            self.pump(min(left, POLL_S))
        self.close()

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            rank, stream, pipe = key.data
            self._write(rank, stream, [self._partial.pop(key.fd, b"")])
            self._selector.unregister(pipe)
            pipe.close()
        self._selector.close()

    def _write(self, rank: int, stream: int, lines: list[bytes]) -> None:
        data = b"".join(line if line.endswith((b"\n", b"\r")) else line + b"\n" for line in lines if line)
        if not data:
            return
        if self._sink is not None:
            self._sink(rank, stream, data)
            return
        prefix = f"[{rank}] ".encode()
        out = b"".join(prefix + line for line in data.splitlines(keepends=True))
        try:
            dest = self._dests[stream]
            dest.write(out)
            dest.flush()
        except (BrokenPipeError, ValueError):  # our reader went away; keep the job running
            pass
