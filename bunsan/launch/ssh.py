"""Fan a job out over ssh: one agent per host, one launcher that watches them all.

``bunsan run`` opens one plain ssh connection per host (the system's OpenSSH
client, ``BatchMode=yes``: never a password prompt) and runs ``python -m
bunsan.launch.remote`` there: an agent that starts that host's workers with the
same hygiene as a job on one machine and streams their output back. Why an
agent of our own and not ``torchrun`` per host: docs/experiments/design-notes.md,
"Launcher: why an agent per host, not torchrun".

What the launcher does, per attempt:

1. Start the agents: ``ssh HOST exec env BUNSAN_JOB_ID=<id> PYTHON -m
   bunsan.launch.remote`` (the agent of a host that is this machine runs
   without ssh). Each gets an ``init`` message on its stdin: command,
   working directory, environment, its slots.
2. When every agent is ready, choose the rendezvous: ``--master-addr``, or
   rank 0's host address as the launcher reached it (the server side of the
   ssh connection, ``SSH_CONNECTION``), or, when rank 0 runs here, this
   machine's address as the first remote host sees it (the client side).
   The port is the one rank 0's agent found free on its host (or checked,
   for ``--master-port``). Then ``start`` goes to every agent.
3. Copy the workers' output, optionally tagged ``[host:rank]``; ping every
   agent once a second.
4. On the first failure on any host (a worker's exit code, a lost host), or
   a signal to the launcher, tell every agent to stop; after the agents'
   grace, close the connections, which stops whatever agent is left; exit
   with the failing worker's code (the earliest failure of all hosts).

If the launcher is SIGKILLed, its ssh clients die with it
(``PR_SET_PDEATHSIG``; a janitor sweeps what carries the launcher's mark),
every agent sees end-of-file on its stdin and stops its workers.

Remote python and working directory: by default the launcher's own
``sys.executable`` and current directory, the same paths on every host (a
shared file system or identical installs); ``--remote-python`` and
``--remote-cwd`` change them. Each host's workers get that host's own login
environment plus ``-x``/``--env-file`` variables and what ``bunsan.init()``
reads; unless ``GLOO_SOCKET_IFNAME`` is set, the agent sets it to the
interface that reaches ``MASTER_ADDR`` (see :func:`bunsan.launch.remote.interface_for`).
The agents' stdin carries the launcher's messages, so in a multi-host job no
worker reads the launcher's stdin (on one machine rank 0 does).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from bunsan.launch.output import read_available
from bunsan.launch.plan import HOST_JOB_VARIABLE, JOB_ID_VARIABLE, JobOutcome, exit_code_of
from bunsan.launch.proctree import GRACE_S, POLL_S, Signals, die_with_launcher_hook, start_janitor, stop_janitor
from bunsan.launch.protocol import AgentInit, Frame, FrameDecoder
from bunsan.launch.ssh_plan import (
    HostPlan,
    SshOptions,
    agent_command,
    master_address,
    ssh_command,
)

__all__ = ["run_hosts"]

START_TIMEOUT_S = 60.0  # every agent must be ready within this (ssh ConnectTimeout is less)
PING_S = 1.0
_STDERR_TAIL = 5


# ---------------------------------------------------------------------------
# One agent, seen from the launcher.


@dataclass
class _Failure:
    code: int
    kind: str
    cause: str
    rank: int | None = None
    time: float = field(default_factory=time.time)
    origin: bool = True  # False: this host's workers only stopped because a rank elsewhere failed


class _Agent:
    def __init__(self, plan: HostPlan, process: subprocess.Popen[bytes]) -> None:
        self.plan = plan
        self.host = plan.host
        self.process = process
        self.decoder = FrameDecoder()
        self.ready: dict[str, Any] | None = None
        self.done: dict[str, Any] | None = None
        self.started = False  # told to start its workers
        self.stopped = False
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL)
        self._stderr_partial = b""
        self._stdin_pending = b""
        self._stdin_open = process.stdin is not None
        if process.stdin is not None:
            os.set_blocking(process.stdin.fileno(), False)

    def send(self, message: Mapping[str, Any] | bytes) -> None:
        """Queue a message for the agent; never blocks (a stalled ssh must not stall the launcher)."""
        if not self._stdin_open:
            return
        self._stdin_pending += message if isinstance(message, bytes) else json.dumps(message).encode() + b"\n"
        self.flush()

    def flush(self) -> None:
        stdin = self.process.stdin
        while self._stdin_pending and self._stdin_open and stdin is not None:
            try:
                written = os.write(stdin.fileno(), self._stdin_pending)
            except BlockingIOError:
                return
            except OSError:  # the ssh client is gone
                self.close_stdin()
                return
            self._stdin_pending = self._stdin_pending[written:]

    def close_stdin(self) -> None:
        if self._stdin_open and self.process.stdin is not None:
            self._stdin_open = False
            with contextlib.suppress(OSError):
                self.process.stdin.close()

    def stderr_lines(self, chunk: bytes) -> list[bytes]:
        data = self._stderr_partial + chunk
        lines = data.splitlines(keepends=True)
        if chunk and lines and not lines[-1].endswith(b"\n"):
            self._stderr_partial = lines.pop()
        else:
            self._stderr_partial = b""
        for line in lines:
            text = line.decode(errors="replace").strip()
            if text:
                self.stderr_tail.append(text)
        return lines

    def exited(self) -> bool:
        return self.process.poll() is not None


class _Fanout:
    """The launcher's side of one attempt: the agents, their output, the first failure."""

    def __init__(self, tag_output: bool, stdout: IO[Any], stderr: IO[Any]) -> None:
        self.tag_output = tag_output
        self.stdout = getattr(stdout, "buffer", stdout)
        self.stderr_text = stderr
        self.stderr = getattr(stderr, "buffer", stderr)
        self.selector = selectors.DefaultSelector()
        self.agents: list[_Agent] = []
        self.failure: _Failure | None = None
        self.raised: list[_Failure] = []  # ranks that reported their own exception, on any host

    # -- messages and output

    def say(self, message: str) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):
            print(f"bunsan run: {message}", file=self.stderr_text, flush=True)

    def _write(self, dest: IO[bytes], data: bytes) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):
            dest.write(data)
            dest.flush()

    def _on_frame(self, agent: _Agent, frame: Frame) -> None:
        if frame.kind in ("o", "e"):
            dest = self.stdout if frame.kind == "o" else self.stderr
            if self.tag_output:
                prefix = f"[{agent.host}:{frame.rank}] ".encode()
                self._write(dest, b"".join(prefix + line for line in frame.payload.splitlines(keepends=True)))
            else:
                self._write(dest, frame.payload)
        elif frame.kind == "m":
            self.say(f"{agent.host}: {frame.payload.decode(errors='replace')}")
        elif frame.kind == "s":
            try:
                status = json.loads(frame.payload)
            except ValueError:
                status = {}
            self._on_status(agent, status)
        else:  # not a frame: a login banner or the like
            self._write(self.stderr, f"[{agent.host}] ".encode() + frame.payload)

    def _on_status(self, agent: _Agent, status: dict[str, Any]) -> None:
        event = status.get("event")
        if event == "ready":
            agent.ready = status
        elif event == "error":
            self.fail(_Failure(2, "start", f"{agent.host}: {status.get('message')}"))
        elif event == "report":
            what = str(status.get("what", ""))[:300]
            self.raised.append(
                _Failure(
                    int(status.get("code", 1)),
                    "failed",
                    f"rank {status.get('rank')} on host {agent.host} failed first ({what})",
                    status.get("rank"),
                    float(status.get("time", time.time())),
                )
            )
        elif event == "failed":
            self.fail(self._host_failure(agent, status, float(status["time"])))
        elif event == "done":
            agent.done = status
            if status.get("kind") == "failed" and status.get("code"):
                self.fail(self._host_failure(agent, status, time.time()))

    @staticmethod
    def _host_failure(agent: _Agent, status: Mapping[str, Any], when: float) -> _Failure:
        """The failure an agent's ``failed`` or ``done`` status names, with the host in its cause."""
        cause = f"{status.get('cause')} on host {agent.host}"
        return _Failure(
            int(status["code"]), "failed", cause, status.get("rank"), when, bool(status.get("origin", True))
        )

    def fail(self, failure: _Failure) -> None:
        """Keep the failure that ended the job: a host's own failure before a consequence, then the earliest."""
        current = self.failure
        if current is None or (
            failure.kind == "failed"
            and current.kind == "failed"
            and (not current.origin, current.time) > (not failure.origin, failure.time)
        ):
            self.failure = failure

    def first_failure(self) -> _Failure | None:
        """The failure to report: the earliest rank that raised, on any host, else :meth:`fail`'s choice."""
        if self.raised and (self.failure is None or self.failure.kind in ("failed", "lost")):
            return min(self.raised, key=lambda f: f.time)
        return self.failure

    def pump(self, timeout_s: float) -> None:
        for key, _ in self.selector.select(timeout_s):
            agent, is_stdout = key.data
            chunk = read_available(key.fd)
            if chunk is None:
                continue
            if not chunk:
                self.selector.unregister(key.fileobj)
                if is_stdout:
                    rest = agent.decoder.rest()  # a frame cut short: show what there is
                    if rest:
                        self._write(self.stderr, f"[{agent.host}] ".encode() + rest + b"\n")
                else:
                    for line in agent.stderr_lines(b""):
                        self._write(self.stderr, f"[{agent.host}] ".encode() + line)
                continue
            if is_stdout:
                for frame in agent.decoder.feed(chunk):
                    self._on_frame(agent, frame)
            else:
                for line in agent.stderr_lines(chunk):
                    self._write(self.stderr, f"[{agent.host}] ".encode() + line)

    # -- lifecycle

    def add(self, plan: HostPlan, process: subprocess.Popen[bytes]) -> _Agent:
        agent = _Agent(plan, process)
        for pipe, is_stdout in ((process.stdout, True), (process.stderr, False)):
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
            self.selector.register(pipe, selectors.EVENT_READ, (agent, is_stdout))
        self.agents.append(agent)
        return agent

    def check_exits(self) -> None:
        """An agent that ended without saying ``done`` lost its host (or never got there)."""
        for agent in self.agents:
            if agent.exited() and agent.done is None and not agent.stopped:
                self.pump(0.0)  # its last words may still be in the pipe
                if agent.done is not None:
                    continue
                agent.stopped = True
                code = agent.process.returncode
                tail = "; ".join(agent.stderr_tail) or "no message"
                if agent.ready is None:
                    self.fail(
                        _Failure(2, "start", f"cannot start the agent on {agent.host} (exit code {code}): {tail}")
                    )
                else:
                    self.fail(
                        _Failure(
                            255 if code in (0, None) else exit_code_of(code),
                            "lost",
                            f"lost host {agent.host} (exit code {code}): {tail}",
                        )
                    )

    def stop(self, sig: int, grace_s: float) -> None:
        """Stop every agent: ask, then close its connection, then kill the client. Bounded by ~2 grace + 4 s."""
        for agent in self.agents:
            if not agent.exited():
                agent.send({"op": "stop", "signal": int(sig)})
        deadline = time.monotonic() + 2 * grace_s + 2.0  # the agents' own SIGTERM-then-SIGKILL
        while any(not a.exited() for a in self.agents) and time.monotonic() < deadline:
            for agent in self.agents:
                agent.flush()
            self.pump(POLL_S)
        for agent in self.agents:
            agent.close_stdin()  # end-of-file: an agent that missed "stop" stops now
        deadline = time.monotonic() + 1.0
        while any(not a.exited() for a in self.agents) and time.monotonic() < deadline:
            self.pump(POLL_S)
        for sig_ in (signal.SIGTERM, signal.SIGKILL):
            for agent in self.agents:
                if not agent.exited():
                    with contextlib.suppress(ProcessLookupError):
                        agent.process.send_signal(sig_)
            deadline = time.monotonic() + 1.0
            while any(not a.exited() for a in self.agents) and time.monotonic() < deadline:
                self.pump(POLL_S)
        self.pump(0.0)

    def close(self) -> None:
        for agent in self.agents:
            agent.close_stdin()
            for pipe in (agent.process.stdout, agent.process.stderr):
                if pipe is not None:
                    with contextlib.suppress(KeyError, ValueError):
                        self.selector.unregister(pipe)
                    pipe.close()
            if agent.process.poll() is None:
                agent.process.kill()
            agent.process.wait()
        self.selector.close()


def _start_agent(
    plan: HostPlan, job_id: str, ssh: SshOptions, preexec: Callable[[], None] | None
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    # The launcher's mark: its janitor sweeps the ssh clients (and local
    # agents) by it, and only them, if the launcher is SIGKILLed.
    env[HOST_JOB_VARIABLE] = f"{job_id}.launcher"
    if plan.local:
        env[JOB_ID_VARIABLE] = job_id
        argv = [plan.python, "-m", "bunsan.launch.remote"]
    else:
        argv = ssh_command(plan.host, agent_command(plan.python, job_id), ssh)
    return subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C reaches the launcher only; it forwards it as "stop"
        preexec_fn=preexec,
    )


def run_hosts(
    plans: Sequence[HostPlan],
    job_id: str,
    *,
    env: Mapping[str, str],
    ssh: SshOptions,
    restart: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    tag_output: bool = False,
    grace_s: float = GRACE_S,
    start_timeout_s: float = START_TIMEOUT_S,
    stdout: IO[Any] | None = None,
    stderr: IO[Any] | None = None,
    oversubscribe: bool = False,
) -> JobOutcome:
    """Run one attempt of a multi-host job: an agent per host, until the job ends everywhere.

    Must be called from the main thread (signals, ``PR_SET_PDEATHSIG``).

    Args:
        plans: One per host, rank 0's host first (see :func:`plan_hosts`).
        job_id: The job's id (``BUNSAN_JOB_ID``).
        env: Variables added to each host's environment for the workers (``-x``, ``--env-file``).
        ssh: How to reach the remote hosts.
        restart: The attempt, for ``BUNSAN_RESTART``.
        master_addr, master_port: Fixed rendezvous; ``None`` chooses (see the module docstring).
        tag_output: Prefix each line of worker output with ``[host:rank] ``.
        grace_s: Seconds between SIGTERM and SIGKILL, on every host.
        start_timeout_s: How long every agent may take to be ready.
        stdout, stderr: Where output and messages go; ``None`` means ``sys.stdout``/``sys.stderr``.
        oversubscribe: Let a host run more workers than it has cores (each
            agent checks its own host, see :func:`bunsan.launch.hosts.check_oversubscription`).

    Returns:
        How the job ended: ``code`` is 0, the earliest failed worker's exit
        code, 255 for a host lost during the run, 2 when a host could not
        start its agent, or 128 + N after signal N to the launcher.
    """
    fanout = _Fanout(tag_output, sys.stdout if stdout is None else stdout, sys.stderr if stderr is None else stderr)
    hosts = len(plans)
    launcher_mark = f"{job_id}.launcher"
    with Signals() as signals:
        janitor = start_janitor(launcher_mark, grace_s, HOST_JOB_VARIABLE)
        try:
            preexec = die_with_launcher_hook()
            for plan in plans:
                try:
                    process = _start_agent(plan, job_id, ssh, preexec)
                except OSError as err:
                    fanout.fail(_Failure(2, "start", f"cannot start {ssh.executable!r} for host {plan.host}: {err}"))
                    break
                agent = fanout.add(plan, process)
                agent.send(
                    AgentInit(
                        job_id=job_id,
                        group_rank=plan.group_rank,
                        hosts=hosts,
                        restart=restart,
                        cwd=plan.cwd,
                        argv=list(plan.argv),
                        script=plan.script,
                        env=dict(env),
                        slots=[list(s) for s in plan.slots],
                        check_port=(master_port or 0) if plan is plans[0] else None,
                        grace_s=grace_s,
                        oversubscribe=oversubscribe,
                    ).to_line()
                )
            return _watch(fanout, plans, signals, master_addr, start_timeout_s, grace_s)
        finally:
            fanout.close()
            stop_janitor(janitor)


def _watch(
    fanout: _Fanout,
    plans: Sequence[HostPlan],
    signals: Signals,
    master_addr: str | None,
    start_timeout_s: float,
    grace_s: float,
) -> JobOutcome:
    started = False
    start_deadline = time.monotonic() + start_timeout_s
    next_ping = time.monotonic() + PING_S
    agents = fanout.agents
    while fanout.failure is None:
        if signals.received:
            sig = signals.received[0]
            fanout.say(f"got {signal.Signals(sig).name}; stopping the job on {len(agents)} host(s)")
            fanout.stop(sig, grace_s)
            return JobOutcome(
                128 + sig, "signal", cause=f"stopped by {signal.Signals(sig).name}", unconfirmed=_unconfirmed(fanout)
            )
        fanout.pump(POLL_S)
        fanout.check_exits()
        now = time.monotonic()
        ready = [a.ready for a in agents if a.ready is not None]
        if not started and len(agents) == len(plans) and len(ready) == len(agents):
            connections = {
                a.host: str(r.get("ssh_connection", "")) for a, r in zip(agents, ready, strict=True) if not a.plan.local
            }
            addr = master_addr or master_address(plans[0].host, plans[0].local, connections)
            port = int(ready[0]["port"])
            for agent in agents:
                agent.send({"op": "start", "master_addr": addr, "master_port": port})
                agent.started = True
            started = True
        elif not started and now > start_deadline:
            late = [a.host for a in agents if a.ready is None]
            fanout.fail(_Failure(2, "start", f"host(s) {', '.join(late)} not ready after {start_timeout_s:.0f} s"))
            break
        if started and all(a.done is not None or a.exited() for a in agents) and fanout.failure is None:
            fanout.check_exits()
            if fanout.failure is None:
                return JobOutcome(0, "ok", unconfirmed=_unconfirmed(fanout))
        if now >= next_ping:
            for agent in agents:
                agent.send(b'{"op": "ping"}\n')
            next_ping = now + PING_S
        for agent in agents:
            agent.flush()
    failure = fanout.failure
    assert failure is not None
    others = sum(1 for a in agents if not a.exited())
    fanout.say(f"{failure.cause}; stopping the job on {others} host(s)" if others else failure.cause)
    fanout.stop(signal.SIGTERM, grace_s)
    final = fanout.first_failure()  # an earlier failure may have been reported meanwhile
    assert final is not None
    if final is not failure:
        fanout.say(f"the first failure was: {final.cause}")
    return JobOutcome(final.code, final.kind, final.rank, final.cause, _unconfirmed(fanout))


def _unconfirmed(fanout: _Fanout) -> tuple[str, ...]:
    """Hosts whose agent was told to start workers but never said that they are all gone."""
    return tuple(a.host for a in fanout.agents if a.started and a.done is None)
