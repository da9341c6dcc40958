"""Real "hosts" on this machine for multi-host launcher tests: network namespaces with sshd.

Layout (``mode == "netns"``, needs root)::

    namespace <p>-c (the launcher runs here)        namespace <p>-h1        namespace <p>-h2
      br0 10.213.0.1/24 --- vh1 <== veth ==> eth0 10.213.0.11     vh2 <== veth ==> eth0 10.213.0.12
                          \\-- vh2 ------------------------------------------/

Every address lives on an interface inside a namespace made here; nothing is
added to the machine's own network. Each host namespace runs its own sshd
(Debian's openssh-server, installed with apt-get when missing) with its own
config: key authentication with a key generated for the test, no PAM, a pid
file in the test's directory. sshd runs in the private mount namespace that
``ip netns exec`` creates, where a tmpfs over ``/run`` gives it the privilege
separation directory it needs, so nothing is written under the real ``/run``;
the same mount namespace lets a test give one host a different view of a
directory (``views``), as on real machines with their own disks.

Without network namespaces (``mode == "loopback"``, or ``BUNSAN_TEST_HOST_MODE=loopback``),
sshd listens on 127.0.0.2, 127.0.0.3, ... of the machine's own loopback, and
the hosts are named ``USER@127.0.0.N`` (a user name makes ``bunsan run`` use
ssh even for a loopback address). As root, each sshd runs in a mount
namespace of its own (``unshare``); as another user, sshd runs as that user,
which needs no privilege separation directory and logs in only that user.

Every process started in a host is killed when the hosts are closed: in
``netns`` mode everything in the host's network namespace, in ``loopback``
mode everything in sshd's mount namespace (as root) or below sshd in the
process tree (otherwise). Then the namespaces are deleted.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.0"
SSHD = "/usr/sbin/sshd"
SSHD_READY_S = 20.0


class HostsUnavailable(Exception):
    """No way to make test hosts here; the message is the precise reason (for pytest.skip)."""


def _run(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


def ensure_sshd() -> str:
    """Return the path of sshd, installing what is missing first (as root, with apt-get).

    Installs Debian's ``openssh-server`` (which brings ``openssh-client``:
    ssh, ssh-keygen) when sshd or the client is missing, and ``iproute2``
    (``ip netns``) when ``ip`` is missing. While installing, a ``policy-rc.d``
    that denies starting services is put in place if there is none, so that
    the install does not start a machine-wide sshd on port 22.

    Raises:
        HostsUnavailable: Something is missing and cannot be installed here.
    """
    packages = []
    if not os.access(SSHD, os.X_OK) or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        packages.append("openssh-server")
    if shutil.which("ip") is None and os.geteuid() == 0:
        packages.append("iproute2")
    if not packages:
        return SSHD
    if os.geteuid() != 0:
        raise HostsUnavailable(
            f"{SSHD} or the ssh client is missing and only root can install openssh-server (apt-get); "
            "as root the tests install it themselves"
        )
    if shutil.which("apt-get") is None:
        raise HostsUnavailable(f"{', '.join(packages)} missing and there is no apt-get to install it with")
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\n# written by bunsan's tests while installing openssh-server\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    try:
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:  # stale package lists: update once, then retry
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=600)
            result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)
    if result.returncode != 0 or not os.access(SSHD, os.X_OK):
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise HostsUnavailable(f"apt-get install {' '.join(packages)} failed: {tail[0]}")
    return SSHD


def _namespaces_work() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"bsnprobe-{secrets.token_hex(3)}"
    if _run("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    _run("ip", "netns", "del", probe, check=False)
    return True


def _listening(pid: int, port: int) -> bool:
    """Whether process ``pid``'s network namespace has a TCP socket listening on ``port``."""
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def _descendants(roots: set[int]) -> set[int]:
    """``roots`` and every live process below them (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found and Path(f"/proc/{pid}").exists():
            found.add(pid)
            todo += children.get(pid, [])
    return found


def _mount_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


@dataclass
class SshHosts:
    """Hosts reachable over ssh from the launcher's namespace.

    Attributes:
        names: Host names for ``-H`` and hostfiles, in order.
        mode: ``"netns"`` or ``"loopback"``.
        ssh_port: The port every sshd listens on.
        identity: The private key that logs in as root.
        client_ns: The namespace the launcher must run in (``None`` in loopback mode).
        namespaces: The hosts' namespaces (``netns`` mode).
    """

    names: list[str]
    mode: str
    ssh_port: int
    identity: Path
    client_ns: str | None = None
    namespaces: list[str] = field(default_factory=list)
    _sshd: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _mount_ns: list[str] = field(default_factory=list)
    _created_ns: list[str] = field(default_factory=list)

    def ssh_args(self) -> list[str]:
        """``bunsan run``/``bunsan doctor`` options that reach these hosts."""
        return ["--ssh-port", str(self.ssh_port), "--ssh-identity", str(self.identity), "--ssh-host-key-checking", "no"]

    def launcher(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run where the hosts can be reached (the client namespace in ``netns`` mode)."""
        prefix = ["ip", "netns", "exec", self.client_ns] if self.client_ns else []
        return [*prefix, *argv]

    def hostfile(self, path: Path, slots: int) -> Path:
        path.write_text("".join(f"{name} slots={slots}\n" for name in self.names))
        return path

    def processes(self) -> list[int]:
        """Every live process in the hosts (their sshd included)."""
        pids: set[int] = set()
        for ns in self.namespaces:
            result = _run("ip", "netns", "pids", ns, check=False)
            pids.update(int(p) for p in result.stdout.split() if p.isdigit())
        if self._mount_ns:
            for entry in os.listdir("/proc"):
                if entry.isdigit() and _mount_namespace(int(entry)) in self._mount_ns:
                    pids.add(int(entry))
        elif self.mode == "loopback":  # not root: no namespace to tell them by; follow sshd's descendants
            pids |= _descendants({p.pid for p in self._sshd if p.poll() is None})
        return sorted(pids)

    def close(self) -> None:
        """Kill every process in the hosts, then delete the namespaces. Safe to call twice."""
        for process in self._sshd:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for _ in range(3):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for process in self._sshd:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self._sshd.clear()
        for ns in reversed(self._created_ns):
            _run("ip", "netns", "del", ns, check=False)
        self._created_ns.clear()


def _sshd_config(directory: Path, name: str, listen: str, port: int, host_key: Path, authorized: Path) -> Path:
    config = directory / f"sshd_config.{name}"
    config.write_text(
        f"Port {port}\n"
        f"ListenAddress {listen}\n"
        f"HostKey {host_key}\n"
        f"PidFile {directory / f'sshd.{name}.pid'}\n"
        f"AuthorizedKeysFile {authorized}\n"
        "PermitRootLogin prohibit-password\n"  # root logs in with the test key only
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"  # the key lives under /tmp, which is world-writable
        "PrintMotd no\n"
        "PrintLastLog no\n"
        "UseDNS no\n"
        "LogLevel ERROR\n"
        "MaxStartups 64\n"
        "MaxSessions 64\n"
    )
    return config


def start_hosts(
    directory: Path, count: int = 2, views: Mapping[int, Sequence[tuple[Path, Path]]] | None = None
) -> SshHosts:
    """Start ``count`` hosts with sshd; see the module docstring.

    Args:
        directory: A fresh directory for keys, configs and pid files.
        count: Number of hosts.
        views: ``{host index: [(source, target), ...]}``: in that host,
            ``target`` shows ``source`` (a bind mount in the host's own mount
            namespace). ``netns`` mode only.

    Raises:
        HostsUnavailable: With the precise reason, when neither mode works here.
    """
    sshd = ensure_sshd()
    forced = os.environ.get("BUNSAN_TEST_HOST_MODE")
    mode = forced or ("netns" if _namespaces_work() else "loopback")
    root = os.geteuid() == 0
    if mode == "loopback" and root and shutil.which("unshare") is None:
        raise HostsUnavailable("network namespaces do not work here and the loopback fallback needs unshare")
    directory.mkdir(parents=True, exist_ok=True)
    identity, host_key = directory / "id_ed25519", directory / "ssh_host_ed25519_key"
    for key in (identity, host_key):
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bunsan-test", "-f", str(key))
    authorized = directory / "authorized_keys"
    authorized.write_text(identity.with_suffix(".pub").read_text())
    prefix = f"bsn{secrets.token_hex(3)}"
    port = 2222
    etc_hosts, resolv = directory / "etc_hosts", directory / "resolv.conf"
    names = {f"{SUBNET}.1": f"{prefix}-c", **{f"{SUBNET}.{11 + i}": f"{prefix}-h{i + 1}" for i in range(count)}}
    # Also the IPv4-mapped IPv6 forms: the rendezvous store accepts on a dual-stack socket.
    etc_hosts.write_text(
        "127.0.0.1 localhost\n::1 localhost\n" + "".join(f"{a} {n}\n::ffff:{a} {n}\n" for a, n in names.items())
    )
    resolv.write_text("# test hosts: no DNS\n")
    hosts = SshHosts([], mode, port, identity)
    try:
        if mode == "netns":
            _make_network(hosts, prefix, count)
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.2", 0))
                hosts.ssh_port = port = probe.getsockname()[1]
        for index in range(count):
            listen = f"{SUBNET}.{11 + index}" if mode == "netns" else f"127.0.0.{2 + index}"
            user = "root" if root else pwd.getpwuid(os.geteuid()).pw_name
            hosts.names.append(listen if mode == "netns" else f"{user}@{listen}")
            config = _sshd_config(directory, f"h{index + 1}", listen, port, host_key, authorized)
            mounts = ["mount -n -t tmpfs -o mode=755 bunsan-test-run /run", "mkdir -m 755 /run/sshd"]
            if mode == "netns":
                # The hosts' own /etc/hosts and an empty resolv.conf: names resolve from the file,
                # and nothing ever asks a DNS server (which the namespaces could not reach anyway).
                mounts += [f"mount -n --bind '{etc_hosts}' /etc/hosts", f"mount -n --bind '{resolv}' /etc/resolv.conf"]
            for source, target in (views or {}).get(index, ()):
                mounts.append(f"mount -n --bind '{source}' '{target}'")
            script = " && ".join([*mounts, f"exec {sshd} -D -e -f '{config}'"])
            if mode == "netns":
                argv = ["ip", "netns", "exec", hosts.namespaces[index], "sh", "-c", script]
            elif root:
                argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
            else:  # sshd as this user: no privilege separation, so no /run/sshd and no mounts
                argv = [sshd, "-D", "-e", "-f", str(config)]
            log = open(directory / f"sshd.h{index + 1}.log", "wb")  # noqa: SIM115 - kept by the process
            hosts._sshd.append(
                subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
            )
            log.close()
        deadline = time.monotonic() + SSHD_READY_S
        for index, process in enumerate(hosts._sshd):
            while not _listening(process.pid, port):
                if process.poll() is not None or time.monotonic() > deadline:
                    text = (directory / f"sshd.h{index + 1}.log").read_text(errors="replace").strip()
                    raise HostsUnavailable(f"sshd of host {index + 1} did not start: {text or 'no output'}")
                time.sleep(0.02)
            if mode == "loopback":
                mount_ns = _mount_namespace(process.pid)
                if mount_ns is not None and mount_ns != _mount_namespace(os.getpid()):
                    hosts._mount_ns.append(mount_ns)
        return hosts
    except BaseException:
        hosts.close()
        raise


def _make_network(hosts: SshHosts, prefix: str, count: int) -> None:
    client = f"{prefix}-c"
    for ns in [client, *(f"{prefix}-h{i + 1}" for i in range(count))]:
        _run("ip", "netns", "add", ns)
        hosts._created_ns.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
    hosts.client_ns = client
    _run("ip", "-n", client, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", client, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
    _run("ip", "-n", client, "link", "set", "br0", "up")
    for i in range(count):
        ns, veth = f"{prefix}-h{i + 1}", f"vh{i + 1}"
        _run("ip", "-n", client, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", client, "link", "set", veth, "master", "br0")
        _run("ip", "-n", client, "link", "set", veth, "up")
        _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{11 + i}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        hosts.namespaces.append(ns)


if __name__ == "__main__":  # a manual check: start two hosts, print how to reach them, wait for Enter
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        started = start_hosts(Path(tmp))
        try:
            print(started, file=sys.stderr)
            print("launcher prefix:", " ".join(started.launcher([])), "ssh args:", " ".join(started.ssh_args()))
            input("Enter to stop the hosts ")
        finally:
            started.close()
