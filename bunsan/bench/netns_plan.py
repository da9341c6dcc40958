"""The shaped network's plan, pure: the ``--network`` specification, the namespaces, the ``ip``/``tc`` commands.

:mod:`bunsan.bench.netns` carries these out (it needs root) and explains the
set-up; everything here only computes names, addresses, commands and
environments, so it is tested without privileges. No torch.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from bunsan._validate import check_int

__all__ = [
    "BRIDGE",
    "MASTER_PORT",
    "MAX_WORKERS",
    "MIN_BURST_BYTES",
    "PREFIX",
    "QUEUE_LATENCY",
    "SUBNET",
    "WORKER_INTERFACE",
    "NetworkSpec",
    "Topology",
    "launcher_command",
    "parse_network",
    "parse_rate",
    "plan_topology",
    "setup_commands",
    "worker_environment",
]

PREFIX = "bunsan"  # namespaces are named bunsan-<launcher pid>-br and bunsan-<launcher pid>-w<rank>
SUBNET = "10.213"  # a /16 inside the namespaces only; rank r is 10.213.x.y with x * 256 + y = r + 1
WORKER_INTERFACE = "bsn0"  # the worker's end of its link, in every worker namespace
BRIDGE = "bsn-br"
MASTER_PORT = 29500
MAX_WORKERS = 1000
MIN_BURST_BYTES = 16 * 1024
QUEUE_LATENCY = "50ms"  # tbf's queue: packets waiting longer than this are dropped (TCP resends)

_RATE = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>bit|kbit|mbit|gbit|tbit)", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_SIZE = re.compile(r"(?P<number>\d+)\s*(?P<unit>b|kb|mb|k|m)?", re.IGNORECASE)
_SIZE_UNITS = {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}
_NOT_SUPPORTED = ("delay", "latency", "jitter", "loss", "duplicate", "reorder", "corrupt")


def parse_rate(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 bits per second (SI units, as tc reads them).

    Raises:
        ValueError: not a positive number followed by bit, kbit, mbit, gbit or tbit.
    """
    match = _RATE.fullmatch(text.strip())
    if not match:
        raise ValueError(
            f"rate {text!r} is not a number with a unit bit, kbit, mbit, gbit or tbit "
            "(bits per second, SI: 1gbit = 10^9 bit/s), e.g. rate=100mbit"
        )
    bits = float(match["number"]) * _UNITS[match["unit"].lower()]
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit, too slow for a job to start")
    return int(bits)


@dataclass(frozen=True)
class NetworkSpec:
    """What ``--network`` asked for: each worker's link rate in bits/s and the token bucket's burst in bytes."""

    rate_bits: int
    burst_bytes: int

    @property
    def label(self) -> str:
        """The rate in tc's words, e.g. ``1gbit``."""
        for unit in ("tbit", "gbit", "mbit", "kbit"):
            if self.rate_bits % _UNITS[unit] == 0:
                return f"{self.rate_bits // _UNITS[unit]}{unit}"
        return f"{self.rate_bits}bit"


def parse_size(text: str) -> int:
    """``"16kb"`` -> 16384 bytes: a whole number with b, kb (k) or mb (m), powers of 1024 as tc reads them.

    Raises:
        ValueError: not a whole number of bytes with one of those units.
    """
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size in bytes, kb or mb, e.g. 16kb")
    return int(match["number"]) * _SIZE_UNITS[(match["unit"] or "b").lower()]


def parse_network(text: str) -> NetworkSpec:
    """Parse ``--network rate=RATE[,burst=SIZE]``, e.g. ``rate=1gbit`` or ``rate=100mbit,burst=64kb``.

    Raises:
        ValueError: one sentence: a missing rate, an unknown key, or delay/loss
            emulation (netem), which is not supported.
    """
    options: dict[str, str] = {}
    for item in text.split(","):
        key, equals, value = item.partition("=")
        key = key.strip().lower()
        if not equals or not key or not value.strip():
            raise ValueError(f"--network {text!r}: {item.strip()!r} is not KEY=VALUE; write e.g. --network rate=1gbit")
        if key in _NOT_SUPPORTED:
            raise ValueError(
                f"--network {text!r}: {key} cannot be emulated: that needs tc's netem, which this "
                "kernel lacks; bunsan shapes the rate only (tbf). Drop "
                f"{key}={value.strip()} and use rate=..."
            )
        if key not in ("rate", "burst"):
            raise ValueError(f"--network {text!r}: unknown key {key!r}; the keys are rate (required) and burst")
        if key in options:
            raise ValueError(f"--network {text!r} sets {key} twice")
        options[key] = value.strip()
    if "rate" not in options:
        raise ValueError(f"--network {text!r} has no rate; write e.g. --network rate=1gbit")
    rate_bits = parse_rate(options["rate"])
    burst = max(rate_bits // 8 // 1000, MIN_BURST_BYTES)  # 1 ms of traffic
    if "burst" in options:
        try:
            burst = parse_size(options["burst"])
        except ValueError:
            raise ValueError(
                f"--network {text!r}: burst {options['burst']!r} is not a size in bytes, kb or mb"
            ) from None
        if burst < 2048:
            raise ValueError(f"--network {text!r}: burst must be at least 2kb (one full-size packet)")
    return NetworkSpec(rate_bits, burst)


@dataclass(frozen=True)
class Topology:
    """Names and addresses of one job's namespaces: a bridge namespace and one per worker."""

    prefix: str
    world_size: int

    @property
    def bridge_namespace(self) -> str:
        return f"{self.prefix}-br"

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}-w{rank}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace, the bridge's first."""
        return [self.bridge_namespace, *(self.namespace(r) for r in range(self.world_size))]

    def address(self, rank: int) -> str:
        host = rank + 1
        return f"{SUBNET}.{host // 256}.{host % 256}"

    @staticmethod
    def bridge_port(rank: int) -> str:
        return f"w{rank}"  # the bridge's end of worker rank's link, in the bridge namespace


def plan_topology(world_size: int, prefix: str | None = None) -> Topology:
    """The namespaces of a job of ``world_size`` workers, named after this process by default. Pure."""
    check_int("world_size", world_size, minimum=1, maximum=MAX_WORKERS, hint="the workers of one shaped network")
    return Topology(prefix or f"{PREFIX}-{os.getpid()}", world_size)


def _shape(namespace: str, device: str, spec: NetworkSpec) -> list[str]:
    return [
        "tc",
        "-n",
        namespace,
        "qdisc",
        "add",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{spec.rate_bits}bit",
        "burst",
        str(spec.burst_bytes),
        "latency",
        QUEUE_LATENCY,
    ]


def setup_commands(topology: Topology, spec: NetworkSpec | None) -> list[list[str]]:
    """The ``ip`` and ``tc`` commands that build ``topology``, in order; ``spec=None`` leaves the links unshaped. Pure."""
    br = topology.bridge_namespace
    commands = [["ip", "netns", "add", ns] for ns in topology.namespaces]
    commands += [
        ["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "-n", br, "link", "set", BRIDGE, "up"],
    ]
    for rank in range(topology.world_size):
        ns, port = topology.namespace(rank), topology.bridge_port(rank)
        commands += [
            # Both ends are created inside their namespaces: nothing appears in this machine's own.
            ["ip", "link", "add", WORKER_INTERFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", br],
            ["ip", "-n", br, "link", "set", port, "master", BRIDGE],
            ["ip", "-n", br, "link", "set", port, "up"],
            ["ip", "-n", ns, "addr", "add", f"{topology.address(rank)}/16", "dev", WORKER_INTERFACE],
            ["ip", "-n", ns, "link", "set", WORKER_INTERFACE, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
        if spec is not None:
            commands += [_shape(ns, WORKER_INTERFACE, spec), _shape(br, port, spec)]  # both directions
    return commands


def worker_environment(
    topology: Topology, rank: int, base: dict[str, str], job_id: str, master_port: int = MASTER_PORT
) -> dict[str, str]:
    """What worker ``rank`` runs with: ``base`` plus what :func:`bunsan.init` and Gloo read. Pure."""
    env = dict(base)
    for name in ("GROUP_RANK", "TORCHELASTIC_RUN_ID", "BUNSAN_RESTART"):
        env.pop(name, None)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(topology.world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(topology.world_size),  # one machine, even if the network says otherwise
        MASTER_ADDR=topology.address(0),
        MASTER_PORT=str(master_port),
        BUNSAN_JOB_ID=job_id,
        BUNSAN_LAUNCHER="bunsan-netns",
        GLOO_SOCKET_IFNAME=WORKER_INTERFACE,
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launcher_command(network: str, workers: int, worker_argv: Sequence[str]) -> list[str]:
    """The command that runs ``worker_argv`` on ``workers`` workers on a shaped network (this module's launcher)."""
    return [sys.executable, "-m", "bunsan.bench.netns", "--network", network, "-np", str(workers), "--", *worker_argv]
