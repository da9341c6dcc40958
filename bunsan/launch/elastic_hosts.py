"""``bunsan run --min-np`` with ``-H``/``--hostfile`` or ``--host-discovery-script``: the elastic job's pool of
hosts, and its workers on hosts other than this one.

The pool (:mod:`bunsan.launch.discovery`) is the hosts and slots of ``-H``/``--hostfile``, or the discovery
script's answer, asked again every few seconds; with neither, this machine with ``-np`` slots. ``-np`` workers
start on it first, filling each host before the next; :mod:`bunsan.launch.elastic` then restarts lost ones and
grows the group onto free slots up to ``--max-np``.

A worker on another host starts as the workers of a multi-host job do (:mod:`bunsan.launch.ssh`): one ssh
connection running the per-host agent (:mod:`bunsan.launch.remote`), here with one worker each, so that each
worker ends on its own and the agent's process-tree cleanup ends it whatever happens to the launcher (the
connection closes: the agent stops its worker). Once the agent is ready its ``start`` message carries what
only the connection tells: ``BUNSAN_ELASTIC_LIGHTHOUSE`` at this machine's address as the host sees it (the
client side of ``SSH_CONNECTION``) and ``BUNSAN_ELASTIC_HOST``, the host's address as this machine reached it
(the server side), where its worker serves its store and its state. The agent tells the launcher when its
worker has joined a quorum, as the file mark of :mod:`bunsan.elastic.member` does for workers here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bunsan.launch import elastic
from bunsan.launch.discovery import DiscoveryError, run_discovery
from bunsan.launch.hosts import Host, assign_slots
from bunsan.launch.plan import JOB_ID_VARIABLE, WorkerSpec, plan_workers, worker_command
from bunsan.launch.proctree import POLL_S, die_with_launcher_hook
from bunsan.launch.protocol import AgentInit, FrameDecoder
from bunsan.launch.ssh import PING_S, _Agent
from bunsan.launch.ssh_plan import HostPlan, SshOptions, agent_command, ssh_command

__all__ = ["SshStarter", "run_from_config", "source_address"]

_SENT = ("BUNSAN_ELASTIC_NP", "BUNSAN_ELASTIC_MIN_NP", "BUNSAN_ELASTIC_REPLICA", "BUNSAN_ELASTIC_DIR", "RUST_LOG")


def source_address(host: str) -> str | None:
    """This machine's address on the route to ``host`` (a UDP socket's connect sends nothing), or ``None``."""
    try:
        address = socket.getaddrinfo(host.rsplit("@", 1)[-1], None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            source = str(sock.getsockname()[0])
    except OSError:
        return None
    return None if source.startswith("127.") else source


class SshStarter:
    """Starts the workers of other hosts, one agent each over ssh (module docstring); pings and stops them."""

    def __init__(
        self,
        job_id: str,
        command: Sequence[str],
        ssh: SshOptions,
        exports: Mapping[str, str],
        *,
        lighthouse_port: Callable[[], int],
        remote_python: str | None = None,
        remote_cwd: str | None = None,
        tag_output: bool = False,
        oversubscribe: bool = False,
    ) -> None:
        self.job_id, self.ssh, self.exports = job_id, ssh, dict(exports)
        self.python = remote_python or sys.executable
        self.argv = worker_command(command, python=self.python, check=False)
        self.script = command[0] if command[0].endswith(".py") else None
        self.cwd = remote_cwd or os.getcwd()
        self.lighthouse_port, self.tag_output, self.oversubscribe = lighthouse_port, tag_output, oversubscribe
        self.agents: list[_Agent] = []
        self.next_ping = 0.0
        self._lock = threading.Lock()

    def start(self, spec: WorkerSpec, on_joined: Callable[[str], None]) -> subprocess.Popen[bytes]:
        """Start slot ``spec.rank``'s worker on ``spec.host``; the returned ssh client ends with the worker's code."""
        env = {**os.environ, JOB_ID_VARIABLE: self.job_id}  # the launcher's sweeps find the client by it
        process = subprocess.Popen(
            ssh_command(spec.host, agent_command(self.python, self.job_id), self.ssh),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_launcher_hook(),
        )
        slot = (spec.rank, spec.local_rank, int(spec.env.get("WORLD_SIZE", "1")), 1)
        plan = HostPlan(spec.host, spec.rank, False, (slot,), tuple(self.argv), self.script, self.python, self.cwd)
        agent = _Agent(plan, process)
        with self._lock:
            self.agents.append(agent)
        init = AgentInit(
            job_id=self.job_id,
            group_rank=len(self.agents),  # the agent's own mark: one per worker start, even on one host
            hosts=2,  # several hosts: the agent sets GLOO_SOCKET_IFNAME to the interface towards this machine
            restart=int(spec.env.get("BUNSAN_RESTART", "0")),
            cwd=self.cwd,
            argv=list(self.argv),
            script=self.script,
            env={**self.exports, **{k: spec.env[k] for k in _SENT if k in spec.env}},
            slots=[list(slot)],
            oversubscribe=self.oversubscribe,
        )
        agent.send(init.to_line())
        for target in (self._frames, self._stderr):
            threading.Thread(target=target, args=(agent, on_joined), daemon=True).start()
        return process

    def _frames(self, agent: _Agent, on_joined: Callable[[str], None]) -> None:
        """Copy the agent's frames: the worker's output, the agent's messages, its status events."""
        assert agent.process.stdout is not None
        decoder, rank = FrameDecoder(), agent.plan.slots[0][0]
        while chunk := _read(agent.process.stdout.fileno()):
            for frame in decoder.feed(chunk):
                if frame.kind in ("o", "e"):
                    data = frame.payload
                    if self.tag_output:
                        data = b"".join(f"[{rank}] ".encode() + line for line in data.splitlines(keepends=True))
                    _write(sys.stdout if frame.kind == "o" else sys.stderr, data)
                elif frame.kind == "m":
                    _write(sys.stderr, f"bunsan run: {agent.host}: ".encode() + frame.payload + b"\n")
                elif frame.kind == "s":
                    self._on_status(agent, json.loads(frame.payload or b"{}"), on_joined)
                else:
                    _write(sys.stderr, f"[{agent.host}] ".encode() + frame.payload)

    def _on_status(self, agent: _Agent, status: Mapping[str, Any], on_joined: Callable[[str], None]) -> None:
        event = status.get("event")
        if event == "ready":
            here, there = _addresses(agent.host, str(status.get("ssh_connection", "")))
            env = {
                "BUNSAN_ELASTIC_LIGHTHOUSE": f"http://{here}:{self.lighthouse_port()}",
                "BUNSAN_ELASTIC_HOST": there,
            }
            with self._lock:
                agent.send({"op": "start", "master_addr": here, "master_port": 0, "env": env})
                agent.started = True
        elif event == "joined":
            on_joined(str(status.get("replica", "")))
        elif event == "error":
            _write(sys.stderr, f"bunsan run: {agent.host}: {status.get('message')}\n".encode())

    def _stderr(self, agent: _Agent, on_joined: Callable[[str], None]) -> None:
        """The ssh client's own stderr (a refused login, a lost connection), each line with the host's name."""
        assert agent.process.stderr is not None
        while chunk := _read(agent.process.stderr.fileno()):
            for line in agent.stderr_lines(chunk):
                _write(sys.stderr, f"[{agent.host}] ".encode() + line)

    def ping(self) -> None:
        """Once a second, tell each agent that the launcher lives (it stops its worker after a silence)."""
        if time.monotonic() < self.next_ping:
            return
        self.next_ping = time.monotonic() + PING_S
        with self._lock:
            for agent in self.agents:
                if not agent.exited():
                    agent.send(b'{"op": "ping"}\n')

    def stop(self, grace_s: float) -> None:
        """Stop every agent's worker: ask, close the connection, then kill the client. Bounded by ~2 grace + 3 s."""
        with self._lock:
            live = [agent for agent in self.agents if not agent.exited()]
            for agent in live:
                agent.send({"op": "stop", "signal": 15})
        deadline = time.monotonic() + 2 * grace_s + 2.0
        while any(not a.exited() for a in live) and time.monotonic() < deadline:
            with self._lock:
                for agent in live:
                    agent.flush()
            time.sleep(POLL_S)
        for agent in live:
            agent.close_stdin()
            if not agent.exited():
                agent.process.kill()
            agent.process.wait()


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def _write(stream: Any, data: bytes) -> None:
    try:
        stream.buffer.write(data)
        stream.buffer.flush()
    except (BrokenPipeError, ValueError, AttributeError):
        pass


def _addresses(host: str, connection: str) -> tuple[str, str]:
    """(this machine as ``host`` sees it, ``host`` as this machine reached it), from ``SSH_CONNECTION``."""
    fields = connection.split()
    name = host.rsplit("@", 1)[-1]
    if len(fields) == 4 and not fields[0].startswith("127."):
        return fields[0], fields[2]
    return source_address(host) or socket.gethostname(), name


def run_from_config(
    config: Any,
    hosts: Sequence[Host],
    exports: Mapping[str, str],
    base_env: Mapping[str, str],
    job_id: str,
    is_local: Callable[[str], bool],
    ssh: SshOptions,
    log: Callable[[str], None],
) -> int:
    """Run the elastic job of ``config`` (a :class:`~bunsan.launch.config.LaunchConfig`) on its pool; its exit code.

    Raises:
        ValueError: The discovery script's first answer failed, or the pool has fewer slots than ``-np``.
    """
    discover = None
    pool = list(hosts)
    if config.host_discovery_script is not None:
        script = config.host_discovery_script

        def discover() -> list[Host]:
            return run_discovery(script)

        try:
            pool = discover()
        except DiscoveryError as err:
            raise ValueError(f"{err}; the job cannot start") from None
    slots = assign_slots(pool, config.nproc)
    remotes = [h.name for h in pool if not is_local(h.name)]
    env = dict(base_env)
    here = source_address(remotes[0]) if remotes else None
    if here is not None:  # the other hosts' workers reach this machine's at this address
        env.setdefault("BUNSAN_ELASTIC_HOST", here)
    local_argv = worker_command(config.command, check=any(is_local(h.name) for h in pool))
    specs = plan_workers(slots, local_argv, env, "127.0.0.1", 0, job_id)
    port: list[int] = []
    starter = None
    if remotes or discover is not None:
        starter = SshStarter(
            job_id,
            config.command,
            ssh,
            exports,
            lighthouse_port=lambda: port[0],
            remote_python=config.remote_python,
            remote_cwd=config.remote_cwd,
            tag_output=config.tag_output,
            oversubscribe=config.oversubscribe,
        )
    growth = elastic.Growth(pool, config.max_np or config.nproc, discover)
    return elastic.run_elastic_job(
        specs,
        job_id,
        config.min_np,
        config.max_restarts,
        tag_output=config.tag_output,
        log=log,
        growth=growth,
        is_local=is_local,
        remote=starter,
        bind="0.0.0.0:0" if starter is not None else "127.0.0.1:0",
        on_address=lambda address: port.append(int(address.rsplit(":", 1)[1])),
    ).code
