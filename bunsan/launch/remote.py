"""The per-host agent of a multi-host job: ``python -m bunsan.launch.remote``.

``bunsan run`` starts one agent on every host of a job, over one ssh
connection per host (:mod:`bunsan.launch.ssh`). The agent starts that host's
workers with the same hygiene as a job on one machine
(:func:`bunsan.launch.local.run_job`: a session per worker, the job marked in
every environment, ``PR_SET_PDEATHSIG``, a janitor), streams their output
back, and ends its workers when

* one of them fails (it reports the rank and the exit code, and exits with it),
* the launcher tells it to (another host failed, Ctrl-C),
* or the launcher is gone: its stdin, the ssh channel, reaches end-of-file
  (the ssh client died, SIGKILL included, or the connection dropped), or no
  heartbeat came for :data:`HEARTBEAT_TIMEOUT_S` (a connection that hangs
  without closing).

The agent watches its stdin instead of relying on ``ssh -tt``: a pseudo
terminal would mangle the output (``\\r\\n``, echo), merge stderr into stdout,
and only hang up the remote side when the ssh client dies, not when the
connection stalls.

The agent sweeps by ``BUNSAN_HOST_JOB_ID=<job id>.h<group rank>``, which only
its own workers carry, so it never touches another host's share of the job,
even where several "hosts" share one process table. Every worker still
carries ``BUNSAN_JOB_ID=<job id>``, by which ``bunsan run --cleanup`` finds
all of them.

The protocol between the launcher and the agents is :mod:`bunsan.launch.protocol`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import select
import shutil
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from bunsan.launch import local, plan
from bunsan.launch.hosts import Slot, check_oversubscription, usable_cores
from bunsan.launch.output import read_available
from bunsan.launch.protocol import HEARTBEAT_TIMEOUT_S, AgentInit, Frame, FrameDecoder, encode_frame
from bunsan.launch.quoting import MAX_QUOTED_PATH, quoted

__all__ = [
    "HEARTBEAT_TIMEOUT_S",
    "AgentInit",
    "Frame",
    "FrameDecoder",
    "check_port",
    "encode_frame",
    "interface_for",
    "main",
]

INIT_TIMEOUT_S = 60.0  # the launcher sends init right after starting ssh
OUTBOX_STALL_S = 30.0  # output that cannot be sent for this long: the connection is gone
FLUSH_AT_EXIT_S = 5.0
_SIOCGIFADDR = 0x8915  # from <linux/sockios.h>
_ELASTIC_DIR = "BUNSAN_ELASTIC_DIR"  # an elastic job's folder of joined marks (bunsan.launch.elastic_hosts)


# ---------------------------------------------------------------------------
# Checks the agent makes on its host.


def check_port(port: int) -> int:
    """Return ``port`` if it is free on this host, or a free port when ``port`` is 0.

    Binds the wildcard address, as rank 0's rendezvous store will. The port
    can still be taken between this check and the workers' start; the
    window is a second or two.

    Raises:
        OSError: The port is in use (``errno.EADDRINUSE``) or cannot be bound.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", port))
        return int(sock.getsockname()[1])


def _ipv4_of_interface(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def interface_for(master_addr: str) -> str | None:
    """Name of the network interface this host reaches ``master_addr`` through (IPv4), or None.

    Gloo binds every rank to the address its host name resolves to, and
    falls back to loopback when that address is not usable here (Debian maps
    the host name to 127.0.1.1 by default); ranks on other hosts then cannot
    connect. ``GLOO_SOCKET_IFNAME`` set to this interface avoids that.
    Connecting a UDP socket sends nothing: it only asks the kernel for the
    route.
    """
    try:
        address = socket.getaddrinfo(master_addr, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            source = sock.getsockname()[0]
    except OSError:
        return None
    if source.startswith("127."):
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of_interface(name) == source:
            return name
    return None


# ---------------------------------------------------------------------------
# The agent's two channels.


class _Outbox:
    """Frames to the launcher, written without ever blocking the agent's loop.

    A stalled connection must not stop the agent from noticing that the
    launcher is gone, so stdout is non-blocking and unsent bytes wait here.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending = bytearray()
        self._stalled_since: float | None = None
        self.broken = False
        os.set_blocking(fd, False)

    def send(self, kind: str, rank: int, payload: bytes) -> None:
        if not self.broken:
            self._pending += encode_frame(kind, rank, payload)
            self.flush()

    def status(self, event: str, **fields: Any) -> None:
        self.send("s", -1, json.dumps({"event": event, **fields}).encode())

    def message(self, text: str) -> None:
        self.send("m", -1, text.encode(errors="replace"))

    def flush(self) -> None:
        while self._pending and not self.broken:
            try:
                written = os.write(self._fd, self._pending)
            except BlockingIOError:
                if self._stalled_since is None:
                    self._stalled_since = time.monotonic()
                return
            except OSError:  # EPIPE: the ssh channel is gone
                self.broken = True
                self._pending.clear()
                return
            del self._pending[:written]
            self._stalled_since = None

    def stalled(self) -> bool:
        return self._stalled_since is not None and time.monotonic() - self._stalled_since > OUTBOX_STALL_S

    def close(self, timeout_s: float) -> None:
        """Send what is left, waiting at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._pending and not self.broken and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                select.select([], [self._fd], [], max(0.0, min(0.1, deadline - time.monotonic())))
            self.flush()


class _Inbox:
    """JSON lines from the launcher, read without blocking; notices end-of-file."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = b""
        self.eof = False
        self.last_heard = time.monotonic()
        os.set_blocking(fd, False)

    def poll(self) -> list[dict[str, Any]]:
        messages = []
        while not self.eof:
            chunk = read_available(self._fd)
            if chunk is None:
                break
            if not chunk:
                self.eof = True
                break
            self.last_heard = time.monotonic()
            self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            if line.strip():
                with contextlib.suppress(ValueError):
                    messages.append(json.loads(line))
        return messages

    def wait(self, timeout_s: float, outbox: _Outbox) -> dict[str, Any] | None:
        """The next message other than ``ping``; None at end-of-file or after ``timeout_s`` of silence.

        Pings count as signs of life: the launcher may wait a while for a slow
        host before it sends ``start``, and keeps pinging meanwhile.
        """
        pending: list[dict[str, Any]] = []
        self.last_heard = time.monotonic()
        while True:
            pending += [m for m in self.poll() if m.get("op") != "ping"]
            if pending:
                return pending[0]
            deadline = self.last_heard + timeout_s
            if self.eof or time.monotonic() >= deadline:
                return None
            outbox.flush()
            with contextlib.suppress(OSError, ValueError):
                select.select([self._fd], [], [], min(0.1, max(0.0, deadline - time.monotonic())))


# ---------------------------------------------------------------------------
# The agent.


def _slots(init: AgentInit) -> list[Slot]:
    return [
        Slot("", rank, local_rank, world, local_world, init.group_rank)
        for rank, local_rank, world, local_world in init.slots
    ]


def _worker_base_env(init: AgentInit, master_addr: str, environ: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k != plan.HOST_JOB_VARIABLE}
    env.update(init.env)
    env[plan.HOST_JOB_VARIABLE] = init.host_job_id
    if init.hosts > 1 and "GLOO_SOCKET_IFNAME" not in env:
        interface = interface_for(master_addr)
        if interface is not None:
            env["GLOO_SOCKET_IFNAME"] = interface
    return env


def _prepare(init: AgentInit, outbox: _Outbox | None = None) -> tuple[str | None, int | None]:
    """Check the working directory, the script, the core count and the port. Returns (error, port)."""
    host = socket.gethostname()
    try:
        warning = check_oversubscription(len(init.slots), usable_cores(), host, init.oversubscribe)
    except ValueError as err:
        return str(err), None
    if warning is not None and outbox is not None:
        outbox.message(f"warning: {warning}")
    try:
        os.chdir(init.cwd)
    except OSError as err:
        return (
            f"cannot change to the working directory {quoted(init.cwd)} on {host} ({err.strerror}); see --remote-cwd",
            None,
        )
    if init.script is not None and not os.path.isfile(init.script):
        return (
            f"script {quoted(init.script, MAX_QUOTED_PATH)} does not exist on {host} (looked in {quoted(init.cwd, MAX_QUOTED_PATH)}); check the path",
            None,
        )
    if init.check_port is None:
        return None, None
    try:
        return None, check_port(init.check_port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            return (
                f"port {init.check_port} is in use on {host}; choose another --master-port "
                "or leave it out to pick a free one"
            ), None
        return f"cannot bind port {init.check_port} on {host} ({err.strerror})", None


class _JoinedMarks:
    """An elastic worker's mark that it joined a quorum (``joined-<replica>`` files that
    :mod:`bunsan.elastic.member` writes in ``BUNSAN_ELASTIC_DIR``), told to the launcher once each as a
    ``joined`` status: the launcher's folder is on another machine. The folder is made here if missing and
    then removed at the end."""

    def __init__(self, folder: str | None, outbox: _Outbox) -> None:
        self.folder, self.outbox, self.told = folder, outbox, set[str]()
        self.made = bool(folder) and not os.path.isdir(str(folder))
        self.next_at = 0.0
        if self.made:
            with contextlib.suppress(OSError):
                os.makedirs(str(folder), mode=0o700)

    def poll(self) -> None:
        if not self.folder or time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + 0.5
        with contextlib.suppress(OSError):
            for name in os.listdir(self.folder):
                if name.startswith("joined-") and name not in self.told:
                    self.told.add(name)
                    self.outbox.status("joined", replica=name[len("joined-") :])

    def close(self) -> None:
        if self.made and self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def _run(init: AgentInit, inbox: _Inbox, outbox: _Outbox) -> int:
    error, port = _prepare(init, outbox)
    if error is not None:
        outbox.status("error", message=error)
        return 2
    outbox.status(
        "ready",
        hostname=socket.gethostname(),
        ssh_connection=os.environ.get("SSH_CONNECTION", ""),
        pid=os.getpid(),
        port=port,
        python=sys.version.split()[0],
    )
    message = inbox.wait(init.heartbeat_timeout_s, outbox)
    if message is None or message.get("op") != "start":
        return 1 if message is None else 128 + int(message.get("signal", signal.SIGTERM))

    def interrupt() -> int | None:
        outbox.flush()
        for message in inbox.poll():
            if message.get("op") == "stop":
                return int(message.get("signal", signal.SIGTERM))
        if inbox.eof or outbox.broken:
            print(
                "bunsan agent: the launcher is gone (ssh connection closed); stopping the workers",
                file=sys.stderr,
                flush=True,
            )
            return signal.SIGTERM
        if time.monotonic() - inbox.last_heard > init.heartbeat_timeout_s or outbox.stalled():
            print(
                f"bunsan agent: nothing from the launcher for {init.heartbeat_timeout_s:.0f} s; stopping the workers",
                file=sys.stderr,
                flush=True,
            )
            return signal.SIGTERM
        return None

    master_addr, master_port = str(message["master_addr"]), int(message["master_port"])
    base_env = {**_worker_base_env(init, master_addr, os.environ), **message.get("env", {})}
    joined = _JoinedMarks(base_env.get(_ELASTIC_DIR), outbox)

    def watch() -> int | None:
        joined.poll()
        return interrupt()

    specs = plan.plan_workers(
        _slots(init),
        init.argv,
        base_env,
        master_addr,
        master_port,
        init.job_id,
        init.restart,
    )
    outcome = local.run_job(
        specs,
        init.host_job_id,
        tag_output=True,
        grace_s=init.grace_s,
        variable=plan.HOST_JOB_VARIABLE,
        sink=lambda rank, stream, data: outbox.send("o" if stream == 1 else "e", rank, data),
        interrupt=watch,
        log=outbox.message,
        stdin_to_rank0=False,
        # Reported at once, with the time: the launcher reports the earliest
        # failure of all hosts, not the first consequence to reach it.
        on_failure=lambda failed: outbox.status(
            "failed", code=failed.code, rank=failed.rank, cause=failed.cause, time=time.time(), origin=failed.origin
        ),
        # A rank that raised says so before it exits (and before its peers stop):
        # forwarded at once, so the launcher names it even if this host is stopped first.
        on_report=lambda item: (
            outbox.status("report", rank=item.rank, code=item.code, what=item.what, time=item.time)
            if item.event == "raised"
            else None
        ),
    )
    joined.close()
    outbox.status(
        "done", code=outcome.code, kind=outcome.kind, rank=outcome.rank, cause=outcome.cause, origin=outcome.origin
    )
    return outcome.code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent on this host; the launcher talks to it over stdin and stdout."""
    # Frames get their own copy of stdout; fd 1 then points at stderr, so a
    # stray print (of a library, say) cannot corrupt the frame stream.
    frames_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    outbox = _Outbox(frames_fd)
    inbox = _Inbox(0)
    message = inbox.wait(INIT_TIMEOUT_S, outbox)
    if message is None or message.get("op") != "init":
        print("bunsan agent: no job description from the launcher; exiting", file=sys.stderr, flush=True)
        return 1
    try:
        code = _run(AgentInit.from_message(message), inbox, outbox)
    finally:
        outbox.close(FLUSH_AT_EXIT_S)
    return code


if __name__ == "__main__":
    sys.exit(main())
