"""Options of ``bunsan run``, parsed into one frozen dataclass.

Precedence: command-line flag, then the ``BUNSAN_*`` environment variable,
then the default. Parsing is pure: the environment is a parameter, nothing is
started and no file is read, so all of it is unit-tested in one process.

Every mistake surfaces as a :class:`UsageError` (a ``ValueError``) whose
message is one sentence that names the option and suggests the fix; the
``bunsan`` command prints it as ``bunsan run: error: <message>`` and exits 2.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from bunsan.launch.hosts import parse_hosts

__all__ = [
    "ArgumentParser",
    "LaunchConfig",
    "UsageError",
    "add_run_arguments",
    "config_from_namespace",
    "parse_run_args",
]

_T = TypeVar("_T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


class UsageError(ValueError):
    """Bad command-line input. The message is one sentence, without the prefix.

    Attributes:
        prog: The command that rejected the input, e.g. ``"bunsan run"``.
    """

    def __init__(self, message: str, prog: str = "bunsan run") -> None:
        super().__init__(message)
        self.prog = prog


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that raises :class:`UsageError` instead of exiting.

    argparse prints a usage block and calls ``sys.exit(2)`` on bad input; the
    caller decides instead, so tests can check the message and the ``bunsan``
    command can print exactly one line. Abbreviated long options are off:
    ``-n`` must not silently mean ``-np``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, prog=self.prog)


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``bunsan run`` needs to start a job.

    Attributes:
        command: The worker command: a ``.py`` script (run with the launcher's
            own Python) or any executable, followed by its arguments.
        nproc: Number of workers (``-np``). ``None`` means every slot of the
            hosts, or 1 when no hosts are given.
        hosts: ``-H`` value such as ``"node1:4,node2:4"``; ``None`` runs locally.
        hostfile: Path of a hostfile (``HOST slots=N`` lines); ``None`` if not given.
        master_addr: Address of rank 0's rendezvous store; ``None`` means
            ``127.0.0.1`` when every worker is local, else rank 0's host.
        master_port: Port of the rendezvous store; ``None`` picks a free port.
        tag_output: Prefix each line of worker output with ``[rank]``.
        dry_run: Print what would run where, start nothing.
    """

    command: tuple[str, ...]
    nproc: int | None = None
    hosts: str | None = None
    hostfile: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    tag_output: bool = False
    dry_run: bool = False

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError(
                "no command given; put the training script after the options, e.g. bunsan run -np 2 train.py"
            )
        if self.nproc is not None and self.nproc < 1:
            raise UsageError(f"-np must be >= 1, got {self.nproc}; pass the number of worker processes, e.g. -np 2")
        if self.hosts is not None and self.hostfile is not None:
            raise UsageError("-H/--hosts and --hostfile were both given; use one of them")
        if self.hosts is not None:
            try:
                parse_hosts(self.hosts)
            except ValueError as err:
                raise UsageError(str(err)) from None
        if self.master_addr is not None and not self.master_addr.strip():
            raise UsageError("--master-addr is empty; give a host name or address, e.g. --master-addr 10.0.0.1")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(
                f"--master-port must be in 1..65535, got {self.master_port}; leave it out to pick a free port"
            )


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``bunsan run`` and its ``command`` to ``parser``.

    Defaults are left as ``None`` so :func:`config_from_namespace` can tell
    "not given" from "given", and fall back to the environment.
    """
    parser.add_argument(
        "-np", "-n", "--np", dest="nproc", type=_whole_number, metavar="N",
        help="number of worker processes (env BUNSAN_NPROC; default: all slots of the hosts, or 1)",
    )
    parser.add_argument(
        "-H", "--hosts", metavar="HOST:SLOTS,...",
        help="hosts and their slots, e.g. node1:4,node2:4 (env BUNSAN_HOSTS; default: this machine)",
    )
    parser.add_argument(
        "--hostfile", metavar="PATH",
        help="file of 'HOST slots=N' lines, '#' comments (env BUNSAN_HOSTFILE)",
    )
    parser.add_argument(
        "--master-addr", metavar="ADDR",
        help="address of rank 0 for the rendezvous (env BUNSAN_MASTER_ADDR; default 127.0.0.1 on one machine)",
    )
    parser.add_argument(
        "--master-port", type=_whole_number, metavar="PORT",
        help="port of the rendezvous (env BUNSAN_MASTER_PORT; default: a free port)",
    )
    parser.add_argument(
        "--tag-output", action="store_true", default=None,
        help="prefix every line of worker output with [rank] (env BUNSAN_TAG_OUTPUT)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", default=None,
        help="print the rank, local rank, host and command of every worker, start nothing",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="[--] COMMAND ...",
        help="script.py (run with this Python) or an executable, then its arguments",
    )


def _from_environ(
    environ: Mapping[str, str], name: str, convert: Callable[[str], _T], expected: str
) -> _T | None:
    if name not in environ:
        return None
    try:
        return convert(environ[name])
    except ValueError:
        raise UsageError(f"environment variable {name}={environ[name]!r} is not {expected}; fix or unset it") from None


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(text)


def config_from_namespace(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Build the config from parsed arguments, filling gaps from ``BUNSAN_*`` variables.

    Field ``x_y`` falls back to ``BUNSAN_X_Y`` (``nproc`` to ``BUNSAN_NPROC``).
    ``--dry-run`` has no environment fallback: a stray variable must never
    turn a launch into a no-op.

    Args:
        args: The namespace of a parser set up by :func:`add_run_arguments`.
        environ: The environment to read; ``None`` means ``os.environ``.
            Tests pass a dict instead of patching ``os.environ``.

    Raises:
        UsageError: An option or environment variable is invalid.
    """
    environ = os.environ if environ is None else environ

    def pick(name: str, convert: Callable[[str], _T], expected: str) -> _T | None:
        value = getattr(args, name)
        return value if value is not None else _from_environ(environ, f"BUNSAN_{name.upper()}", convert, expected)

    command = list(args.command)
    if command and command[0] == "--":  # `bunsan run -np 2 -- train.py`
        command = command[1:]
    return LaunchConfig(
        command=tuple(command),
        nproc=pick("nproc", int, "a whole number"),
        hosts=pick("hosts", str, "a host list"),
        hostfile=pick("hostfile", str, "a path"),
        master_addr=pick("master_addr", str, "an address"),
        master_port=pick("master_port", int, "a port number"),
        tag_output=bool(pick("tag_output", _boolean, "a boolean (1/0, true/false)")),
        dry_run=bool(args.dry_run),
    )


def parse_run_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Parse the arguments that follow ``bunsan run``.

    Args:
        argv: Options, then the command, e.g. ``["-np", "2", "train.py", "--lr", "0.1"]``.
            Everything from the first non-option (or after ``--``) is the
            command, passed to the workers untouched.
        environ: The environment for ``BUNSAN_*`` fallbacks; ``None`` means ``os.environ``.

    Returns:
        The validated config.

    Raises:
        UsageError: Unknown option, missing value, no command, or an invalid value.
    """
    parser = ArgumentParser(prog="bunsan run", add_help=False)
    add_run_arguments(parser)
    return config_from_namespace(parser.parse_args(list(argv)), environ)
