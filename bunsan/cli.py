"""The ``bunsan`` command.

One argparse subparser per subcommand; each registers a handler that takes
the parsed namespace and returns the exit status. Today there is ``run``;
``bench`` and ``doctor`` plug in the same way, through a ``_add_<name>``
function listed in ``_SUBCOMMANDS``. Handlers import what they need
themselves, so ``bunsan run`` never pays for importing torch.

Exit status 2 means bad input, reported as one line,
``bunsan <subcommand>: error: <sentence>``, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Sequence

from bunsan.launch.config import ArgumentParser, LaunchConfig, UsageError, add_run_arguments, config_from_namespace

__all__ = ["build_parser", "main"]

_RUN_DESCRIPTION = """\
Start N workers of a training script on this machine and watch them.
A COMMAND ending in .py runs with this Python; anything else runs as is.
Workers get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT (torchrun's convention), BUNSAN_JOB_ID and
BUNSAN_LAUNCHER=bunsan, and OMP_NUM_THREADS=1 unless it is set.
If a worker fails, the whole job is stopped and its exit code returned."""

_RUN_EPILOG = """\
examples:
  bunsan run -np 4 train.py --epochs 10
  bunsan run -np 2 --tag-output -- python -X dev train.py
  bunsan run -H localhost:4 -np 2 --dry-run train.py"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bunsan")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="start N workers of a training script on this machine",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(parser)
    parser.set_defaults(handler=_run)


# Subcommands in the order `bunsan --help` lists them.
_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_run,)


def build_parser() -> ArgumentParser:
    """Return the parser of the ``bunsan`` command and its subcommands.

    It raises :class:`~bunsan.launch.config.UsageError` on bad input
    instead of exiting; :func:`main` turns that into one line and status 2.
    """
    parser = ArgumentParser(
        prog="bunsan",
        description="bunsan: distributed PyTorch training. Run 'bunsan COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"bunsan {_version()}")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", parser_class=ArgumentParser)
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps subparsers here, there is no public accessor
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``bunsan`` command line and return its exit status.

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        The exit status: the subcommand's, or 2 for bad input.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        # parse_known_args: an unknown option before the command is reported
        # by the subcommand's parser, so the message names `bunsan run`.
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            message = f"unrecognized option {unknown[0]!r}; see the options with --help"
            _subparser(parser, args.subcommand).error(message)
        if args.subcommand is None:
            parser.error("no command given; try 'bunsan run -np 2 train.py', or 'bunsan --help' for the commands")
    except UsageError as err:
        print(f"{err.prog}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help and --version
        return exit_.code if isinstance(exit_.code, int) else 0
    return int(args.handler(args))


def _master_addr(config: LaunchConfig, all_local: bool, rank0_host: str) -> str:
    if config.master_addr is not None:
        return config.master_addr
    return "127.0.0.1" if all_local else rank0_host


def _run(args: argparse.Namespace) -> int:
    """``bunsan run``: plan the job, then print it (``--dry-run``) or run it here."""
    from bunsan.launch import hosts as hostlib
    from bunsan.launch import local

    def fail(message: str) -> int:
        print(f"bunsan run: error: {message}", file=sys.stderr)
        return 2

    try:
        config = config_from_namespace(args, os.environ)
        if config.hostfile is not None:
            hosts = hostlib.read_hostfile(config.hostfile)
        elif config.hosts is not None:
            hosts = hostlib.parse_hosts(config.hosts)
        else:
            hosts = [hostlib.Host("localhost", config.nproc or 1)]
        slots = hostlib.assign_slots(hosts, config.nproc)
        argv = local.worker_command(config.command)
    except ValueError as err:
        return fail(str(err))

    hostname = socket.gethostname()
    used = list(dict.fromkeys(slot.host for slot in slots))
    local_names = [name for name in used if hostlib.is_local_host(name, hostname)]
    remote = [name for name in used if name not in local_names]
    master_port = config.master_port or local.find_free_port()
    job_id = local.new_job_id()
    specs = local.plan_workers(
        slots, argv, os.environ, _master_addr(config, not remote, slots[0].host), master_port, job_id
    )
    if config.dry_run:
        env = specs[0].env
        print(
            f"bunsan run: dry run of job {job_id}: {len(specs)} worker(s) on {len(used)} host(s), "
            f"MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']}"
        )
        print(local.format_plan(specs))
        return 0
    if remote:
        return fail(
            f"host {remote[0]!r} is not this machine, and multi-host fan-out comes with ssh support, "
            f"which bunsan run does not have yet; run on localhost or use --dry-run to check the plan"
        )
    if len(local_names) > 1:
        return fail(
            f"hosts {local_names[0]!r} and {local_names[1]!r} are both this machine; list it once with all its slots"
        )
    return local.run_workers(specs, job_id, tag_output=config.tag_output)
