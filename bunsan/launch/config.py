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
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from bunsan.launch.hosts import parse_hosts
from bunsan.launch.options import RUN_OPTIONS, SSH_OPTIONS, Option, add_run_arguments, add_ssh_arguments
from bunsan.launch.quoting import quoted

__all__ = [
    "HOST_KEY_CHECKING",
    "ArgumentParser",
    "LaunchConfig",
    "RemoteSettings",
    "UsageError",
    "add_run_arguments",
    "add_ssh_arguments",
    "config_from_namespace",
    "parse_env_file",
    "parse_run_args",
    "remote_settings",
    "resolve_exports",
]

_T = TypeVar("_T")

HOST_KEY_CHECKING = ("yes", "accept-new", "no")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SSH_OPTION_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*=.*$")


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


@dataclass(frozen=True, kw_only=True)
class RemoteSettings:
    """How to reach the remote hosts (``bunsan run`` and ``bunsan doctor``), with their ``BUNSAN_*`` fallbacks applied.

    Keyword-only, so that :class:`LaunchConfig`, which adds the rest of ``bunsan
    run``'s options to these, keeps ``command`` first.

    Attributes:
        ssh_port: ``ssh -p`` for every remote host; ``None`` leaves it to ssh.
        ssh_identity: ``ssh -i`` key file; ``None`` leaves it to ssh.
        ssh_host_key_checking: ``StrictHostKeyChecking`` (``yes``,
            ``accept-new``, ``no``); ``None`` leaves it to ssh's config.
        ssh_options: More ``ssh -o KEY=VALUE`` options.
        remote_python: Interpreter on the remote hosts; ``None`` means the
            launcher's own ``sys.executable`` (the same path everywhere).
        remote_cwd: Working directory on the remote hosts; ``None`` means the
            launcher's current directory.
    """

    ssh_port: int | None = None
    ssh_identity: str | None = None
    ssh_host_key_checking: str | None = None
    ssh_options: tuple[str, ...] = ()
    remote_python: str | None = None
    remote_cwd: str | None = None

    def __post_init__(self) -> None:
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise UsageError(f"--ssh-port must be in 1..65535, got {self.ssh_port}")
        if self.ssh_host_key_checking is not None and self.ssh_host_key_checking not in HOST_KEY_CHECKING:
            raise UsageError(
                f"--ssh-host-key-checking must be one of {', '.join(HOST_KEY_CHECKING)}, "
                f"got {quoted(self.ssh_host_key_checking)}"
            )
        for option in self.ssh_options:
            if not _SSH_OPTION_RE.match(option):
                raise UsageError(
                    f"--ssh-option {quoted(option)} is not KEY=VALUE; e.g. --ssh-option ConnectionAttempts=3"
                )
        if self.remote_python is not None and not os.path.isabs(self.remote_python):
            raise UsageError(
                f"--remote-python must be an absolute path, got {quoted(self.remote_python)}; "
                "e.g. --remote-python /opt/venv/bin/python"
            )


@dataclass(frozen=True)
class LaunchConfig(RemoteSettings):
    """Everything ``bunsan run`` needs to start a job: the ssh settings of :class:`RemoteSettings` and these.

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
        tag_output: Prefix each line of worker output with ``[rank]``
            (``[host:rank]`` in a multi-host job).
        dry_run: Print what would run where, start nothing.
        exports: ``-x`` values, ``"VAR"`` (take it from the launcher's
            environment) or ``"VAR=value"``, in order.
        env_file: ``--env-file``: a file of ``VAR=value`` lines for the workers.
        max_restarts: Restart the whole job (all hosts, same world size) up
            to this many times after a worker fails.
        min_np: ``--min-np``: an elastic job (:mod:`bunsan.launch.elastic`) that goes on while at least
            this many workers remain; ``None``: a worker's failure ends the job.
        max_np: ``--max-np``: the most workers an elastic job holds (it grows onto free slots of its
            pool, :mod:`bunsan.launch.discovery`); ``None`` means ``-np``.
        host_discovery_script: ``--host-discovery-script``: an executable that prints the elastic job's
            pool, one ``HOST:SLOTS`` line per host; ``None``: the pool is ``-H``/``--hostfile``, or this machine.
        job_id: The job's id; ``None`` makes a fresh one.
        cleanup: End what is left of a job (``--job-id``, or every job whose
            launcher is gone) on its hosts, instead of launching one.
        oversubscribe: Start more workers than a host has cores without a
            warning, and more than ``OVERSUBSCRIBE_LIMIT`` per core at all
            (see :func:`bunsan.launch.hosts.check_oversubscription`).
    """

    command: tuple[str, ...]
    nproc: int | None = None
    hosts: str | None = None
    hostfile: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    tag_output: bool = False
    dry_run: bool = False
    exports: tuple[str, ...] = ()
    env_file: str | None = None
    max_restarts: int = 0
    min_np: int | None = None
    max_np: int | None = None
    host_discovery_script: str | None = None
    job_id: str | None = None
    cleanup: bool = False
    oversubscribe: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.job_id is not None and not _JOB_ID_RE.match(self.job_id):
            raise UsageError(
                f"--job-id {quoted(self.job_id)} is not valid; use 1 to 64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if self.cleanup:
            return  # --cleanup needs no command; the host options are checked as usual
        _check_remote_cwd(self.remote_cwd)
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        _check_elastic(self)
        for export in self.exports:
            name = export.split("=", 1)[0]
            if not _ENV_NAME_RE.match(name):
                raise UsageError(
                    f"-x {quoted(export)}: {quoted(name)} is not a variable name; use -x NAME or -x NAME=value"
                )
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


def _check_remote_cwd(remote_cwd: str | None) -> None:
    if remote_cwd is not None and not os.path.isabs(remote_cwd):
        raise UsageError(f"--remote-cwd must be an absolute path, got {quoted(remote_cwd)}")


def _values(options: Sequence[Option], args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """The given or ``BUNSAN_*`` values of ``options`` that are set; repeatable ones as tuples, switches as bools."""
    values: dict[str, Any] = {}
    for option in options:
        value = getattr(args, option.name, None)
        if value is None and option.env and option.parse is not None:
            value = _from_environ(environ, option.env_name, option.parse, option.expected)
        if value is not None:
            values[option.name] = tuple(value) if option.action == "append" else value
    return values


def remote_settings(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, prog: str = "bunsan doctor"
) -> RemoteSettings:
    """Read the options of :func:`add_ssh_arguments` from ``args``, falling back to ``BUNSAN_*``.

    Raises:
        UsageError: A value is invalid.
    """
    try:
        settings = RemoteSettings(**_values(SSH_OPTIONS, args, os.environ if environ is None else environ))
        _check_remote_cwd(settings.remote_cwd)
    except UsageError as err:
        raise UsageError(str(err), prog=prog) from None
    return settings


def parse_env_file(text: str, source: str = "<env file>") -> dict[str, str]:
    """Parse ``VAR=value`` lines: ``#`` comments, blank lines, an optional ``export``. Pure.

    A value in matching single or double quotes loses the quotes; nothing
    else is interpreted (no ``$VAR`` expansion).

    Raises:
        ValueError: Naming ``source`` and the line, for a line that is not ``VAR=value``.
    """
    env: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _ENV_NAME_RE.match(name):
            raise ValueError(f"{source}:{lineno}: cannot read {quoted(raw.strip())}; expected VAR=value")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[name] = value
    return env


def resolve_exports(
    exports: Sequence[str], environ: Mapping[str, str], file_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables added to every worker's environment: ``--env-file`` first, then ``-x`` in order. Pure.

    Raises:
        UsageError: ``-x VAR`` names a variable that is not set here.
    """
    env = dict(file_env or {})
    for export in exports:
        name, sep, value = export.partition("=")
        if sep:
            env[name] = value
        elif name in environ:
            env[name] = environ[name]
        else:
            short = name if len(name) <= 80 else quoted(name)
            raise UsageError(f"-x {short}: {short} is not set in this environment; give a value with -x {short}=VALUE")
    return env


def _from_environ(environ: Mapping[str, str], name: str, convert: Callable[[str], _T], expected: str) -> _T | None:
    if name not in environ:
        return None
    try:
        return convert(environ[name])
    except ValueError:
        raise UsageError(
            f"environment variable {name}={quoted(environ[name])} is not {expected}; fix or unset it"
        ) from None


def config_from_namespace(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Build the config from parsed arguments, filling gaps from ``BUNSAN_*`` variables.

    Field ``x_y`` falls back to ``BUNSAN_X_Y`` (``nproc`` to ``BUNSAN_NPROC``),
    except the options declared without one (see :class:`bunsan.launch.options.Option`).

    Args:
        args: The namespace of a parser set up by :func:`add_run_arguments`.
        environ: The environment to read; ``None`` means ``os.environ``.
            Tests pass a dict instead of patching ``os.environ``.

    Raises:
        UsageError: An option or environment variable is invalid.
    """
    environ = os.environ if environ is None else environ
    command = list(args.command)
    if command and command[0] == "--":  # `bunsan run -np 2 -- train.py`
        command = command[1:]
    return LaunchConfig(command=tuple(command), **_values((*RUN_OPTIONS, *SSH_OPTIONS), args, environ))


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


def _check_elastic(config: LaunchConfig) -> None:
    """The rules of --min-np, --max-np and --host-discovery-script (docs/how-to/elastic.md)."""
    if config.min_np is None:
        for value, flag in ((config.max_np, "--max-np"), (config.host_discovery_script, "--host-discovery-script")):
            if value is not None:
                raise UsageError(f"{flag} is for elastic jobs and needs --min-np, e.g. -np 4 --min-np 2 {flag} ...")
        return
    if config.min_np < 1 or (config.nproc is not None and config.min_np > config.nproc):
        raise UsageError(f"--min-np must be between 1 and -np ({config.nproc}), got {config.min_np}")
    if config.nproc is None:
        raise UsageError("--min-np needs -np: the job's starting number of workers")
    if config.max_np is not None and config.max_np < config.nproc:
        raise UsageError(f"--max-np must be >= -np ({config.nproc}), got {config.max_np}")
    if config.host_discovery_script is not None:
        if config.hosts is not None or config.hostfile is not None:
            raise UsageError("--host-discovery-script and -H/--hostfile were both given; use one of them")
        if not config.host_discovery_script.strip():
            raise UsageError("--host-discovery-script is empty; give the path of an executable")
    elif (
        config.max_np is not None and config.max_np > config.nproc and config.hosts is None and config.hostfile is None
    ):
        raise UsageError(
            f"--max-np {config.max_np} needs slots to grow onto; give -H/--hostfile with more than -np slots, "
            "or --host-discovery-script"
        )
