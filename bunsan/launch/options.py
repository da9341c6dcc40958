"""The options of ``bunsan run`` and ``bunsan doctor``, each declared once.

One :class:`Option` per option gives its flags, its :class:`~bunsan.launch.config.LaunchConfig`
field, its parser, its ``BUNSAN_<NAME>`` fallback and its help; the argparse arguments
are built from it here and the environment fallback in :mod:`bunsan.launch.config`
(the only launcher module that reads ``BUNSAN_*``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bunsan.launch.quoting import quoted

__all__ = ["RUN_OPTIONS", "SSH_OPTIONS", "Option", "add_run_arguments", "add_ssh_arguments", "whole_number"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_BOOLEAN = "a boolean (1/0, true/false)"


def whole_number(text: str) -> int:
    """Parse a command-line integer; argparse reports a bad one as one sentence."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {quoted(text)}") from None


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(text)


@dataclass(frozen=True)
class Option:
    """One option of ``bunsan run`` (or ``bunsan doctor``), declared once.

    Attributes:
        name: The :class:`~bunsan.launch.config.LaunchConfig` field and the argparse ``dest``.
        flags: The command-line spellings.
        help: What the option does; the help adds "(env ...; default ...)".
        metavar: How the help shows its value.
        parse: Text to value, for the command line and the environment
            (``None``: a switch or a repeatable option).
        expected: What the environment variable must be, for its error message.
        env: Whether ``BUNSAN_<NAME>`` is a fallback. Never for ``--dry-run``
            and ``--cleanup`` (a stray variable must not turn a launch into a
            no-op), ``-x``, ``--ssh-option``, or ``--job-id`` (every worker
            carries ``BUNSAN_JOB_ID``; a nested launch is another job).
        default: The default as the help describes it.
        action: ``"store"``, ``"store_true"`` or ``"append"``.
    """

    name: str
    flags: tuple[str, ...]
    help: str
    metavar: str | None = None
    parse: Callable[[str], Any] | None = str
    expected: str = "a path"
    env: bool = True
    default: str = ""
    action: str = "store"

    @property
    def env_name(self) -> str:
        return f"BUNSAN_{self.name.upper()}"

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Add this option to ``parser``, with ``None`` as its default ("not given")."""
        notes = [f"env {self.env_name}"] if self.env else []
        if self.default:
            notes.append(self.default)
        text = f"{self.help} ({'; '.join(notes)})" if notes else self.help
        kwargs: dict[str, Any] = {"dest": self.name, "help": text}
        if self.action == "store_true":
            kwargs.update(action="store_true", default=None)  # None: the environment may still fill it
        else:
            kwargs.update(action=self.action, metavar=self.metavar)
            if self.parse is int:
                kwargs["type"] = whole_number  # one sentence for a bad value, not argparse's "invalid int value"
        parser.add_argument(*self.flags, **kwargs)


def _switch(name: str, help: str, env: bool = True) -> Option:
    return Option(
        name,
        (f"--{name.replace('_', '-')}",),
        help,
        None,
        _boolean if env else None,
        _BOOLEAN,
        env=env,
        action="store_true",
    )


def _repeatable(name: str, flag: str, help: str, metavar: str) -> Option:
    return Option(name, (flag,), help, metavar, None, env=False, action="append")


RUN_OPTIONS = (
    Option(
        "nproc",
        ("-np", "-n", "--np"),
        "number of worker processes",
        "N",
        int,
        "a whole number",
        default="default: all slots of the hosts, or 1",
    ),
    Option(
        "hosts",
        ("-H", "--hosts"),
        "hosts and their slots, e.g. node1:4,node2:4",
        "HOST:SLOTS,...",
        expected="a host list",
        default="default: this machine",
    ),
    Option("hostfile", ("--hostfile",), "file of 'HOST slots=N' lines, '#' comments", "PATH"),
    Option(
        "master_addr",
        ("--master-addr",),
        "address of rank 0 for the rendezvous",
        "ADDR",
        expected="an address",
        default="default 127.0.0.1 on one machine",
    ),
    Option(
        "master_port",
        ("--master-port",),
        "port of the rendezvous",
        "PORT",
        int,
        "a port number",
        default="default: a free port",
    ),
    _switch("tag_output", "prefix every line of worker output with [rank], or [host:rank] on several hosts"),
    _switch("dry_run", "print the rank, local rank, host and command of every worker, start nothing", env=False),
    _repeatable(
        "exports", "-x", "pass VAR (from this environment, or with VALUE) to every worker; repeatable", "VAR[=VALUE]"
    ),
    Option("env_file", ("--env-file",), "file of VAR=value lines ('#' comments) set for every worker", "PATH"),
    Option(
        "max_restarts",
        ("--max-restarts",),
        "after a worker fails, restart all workers on all hosts up to K times; workers see BUNSAN_RESTART=1, 2, ... "
        "(with --min-np: start the lost worker again, K times in the whole job)",
        "K",
        int,
        "a whole number",
        default="default 0",
    ),
    Option(
        "min_np",
        ("--min-np",),
        "elastic job: when a worker dies the others go on while at least N remain, and --max-restarts "
        "restarts the lost one, which rejoins (docs/how-to/elastic.md)",
        "N",
        int,
        "a whole number",
        env=False,  # a stray variable must not turn every job elastic
        default="default: not elastic",
    ),
    Option(
        "max_np",
        ("--max-np",),
        "elastic job: grow up to N workers onto free slots of -H/--hostfile or of --host-discovery-script",
        "N",
        int,
        "a whole number",
        env=False,
        default="default: -np",
    ),
    Option(
        "host_discovery_script",
        ("--host-discovery-script",),
        "elastic job: an executable that prints one HOST:SLOTS line per host that may run workers; run at the "
        "start and every 2 s, the job grows onto new slots up to --max-np",
        "PATH",
        env=False,
    ),
    Option(
        "job_id",
        ("--job-id",),
        "the job's id, which every worker carries as BUNSAN_JOB_ID; with --cleanup, the job to clean up",
        "ID",
        env=False,
        default="default: a fresh one",
    ),
    _switch(
        "cleanup",
        "end what is left of job --job-id (or of every job whose launcher is gone) on its hosts, "
        "found by BUNSAN_JOB_ID in /proc/*/environ; starts nothing",
        env=False,
    ),
    _switch(
        "oversubscribe",
        "start more workers than a host has CPU cores without a warning, and more than 8 per core at all "
        "(refused otherwise)",
    ),
)

SSH_OPTIONS = (
    Option(
        "ssh_port",
        ("--ssh-port",),
        "ssh port of every remote host",
        "PORT",
        int,
        "a port number",
        default="default: ssh's own",
    ),
    Option("ssh_identity", ("--ssh-identity",), "ssh private key, ssh -i", "KEYFILE"),
    Option(
        "ssh_host_key_checking",
        ("--ssh-host-key-checking",),
        "StrictHostKeyChecking; 'no' also skips known_hosts",
        "yes|accept-new|no",
        expected="yes, accept-new or no",
    ),
    _repeatable("ssh_options", "--ssh-option", "another ssh -o option; repeatable", "KEY=VALUE"),
    Option(
        "remote_python",
        ("--remote-python",),
        "Python on the remote hosts",
        "PATH",
        default="default: this Python's path",
    ),
    Option(
        "remote_cwd",
        ("--remote-cwd",),
        "working directory on the remote hosts",
        "DIR",
        default="default: the current one",
    ),
)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``bunsan run`` and its ``command`` to ``parser``.

    Defaults are left as ``None`` so :func:`bunsan.launch.config.config_from_namespace`
    can tell "not given" from "given", and fall back to the environment.
    """
    for option in RUN_OPTIONS:
        option.add_to(parser)
    add_ssh_arguments(parser)
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="[--] COMMAND ...",
        help="script.py (run with this Python) or an executable, then its arguments",
    )


def add_ssh_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options that say how to reach remote hosts (``bunsan run`` and ``bunsan doctor``)."""
    group = parser.add_argument_group("remote hosts (ssh)")
    for option in SSH_OPTIONS:
        option.add_to(group)
