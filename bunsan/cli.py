"""The ``bunsan`` command: ``run``, ``bench`` (``compare``, ``throughput``, ``comm``, ``tta``, ``peers``),
``doctor`` and ``plan``.

One argparse subparser per subcommand; each registers a handler that takes
the parsed namespace and returns the exit status, through a ``_add_<name>``
function listed in ``_SUBCOMMANDS``. Handlers import what they need
themselves, so ``bunsan run`` never pays for importing torch. The options of
``bunsan run`` and their ``BUNSAN_*`` fallbacks are declared once, in
:mod:`bunsan.launch.options`.

Exit status 2 means bad input, reported as one line,
``bunsan <subcommand>: error: <sentence>``, without a traceback; or an optional
extra that the subcommand needs and is not installed, also one line,
``bunsan: error: bunsan <subcommand> needs <packages> ...: pip install 'bunsan[<extra>]'``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from bunsan import _extras
from bunsan.launch.config import ArgumentParser, LaunchConfig, UsageError, add_run_arguments, config_from_namespace
from bunsan.launch.quoting import quoted

__all__ = ["build_parser", "main"]

_RUN_DESCRIPTION = """\
Start N workers of a training script on this machine, or on the hosts of
-H/--hostfile over ssh, and watch them.
A COMMAND ending in .py runs with this Python; anything else runs as is.
Workers get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT (torchrun's convention), BUNSAN_JOB_ID,
BUNSAN_RESTART and BUNSAN_LAUNCHER=bunsan, and OMP_NUM_THREADS=1 unless it
is set. If a worker fails on any host, the whole job is stopped on every
host and its exit code returned (or the job restarted, --max-restarts).
Remote hosts are reached with the system's ssh (BatchMode: keys, no
password prompt) and run this Python and this directory unless
--remote-python/--remote-cwd say otherwise."""

_RUN_EPILOG = """\
examples:
  bunsan run -np 4 train.py --epochs 10
  bunsan run -np 2 --tag-output -- python -X dev train.py
  bunsan run -H localhost:4 -np 2 --dry-run train.py
  bunsan run --hostfile hosts -x NCCL_DEBUG=INFO --max-restarts 2 train.py
  bunsan run --cleanup --hostfile hosts --job-id 3f2a91c04b7d11e8"""


_COMPARE_HELP = "train every algorithm setting at every worker count; time, speed ratio, error, bytes"


def _version() -> str:
    """The installed distribution's version, else (a source tree on sys.path) ``bunsan.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bunsan")
    except PackageNotFoundError:
        from bunsan import __version__  # bunsan/__init__.py imports nothing heavy: no torch here

        return __version__


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="start N workers of a training script, here or on the hosts of a hostfile",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(parser)
    parser.set_defaults(handler=_run)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    # These modules import only the standard library at the top: `bunsan run` stays free of torch.
    from bunsan.bench import comm_bench, compare, netns, peers, throughput, tta

    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: compare algorithms, synthetic throughput, collective bandwidth",
        description="Benchmarks that print a table and write JSON and PNG plots. Run 'bunsan bench BENCHMARK --help'.",
    )
    benchmarks = parser.add_subparsers(
        dest="benchmark", metavar="BENCHMARK", parser_class=ArgumentParser, required=True
    )
    compare_parser = _add_module(benchmarks, "compare", compare, _COMPARE_HELP)
    netns.add_arguments(compare_parser)  # --network: the jobs' workers on a shaped network
    for name, module, summary in (
        ("throughput", throughput, "images/s per worker and in total on synthetic data, scaling efficiency"),
        ("comm", comm_bench, "all-reduce and all-gather bus bandwidth over message sizes, bunsan vs torch"),
        ("tta", tta, "time-to-accuracy of every setting of a compare record; auto against the best"),
        ("peers", peers, "bunsan's DDP hooks and averagers side by side with torch's: bytes, step time, error"),
    ):
        _add_module(benchmarks, name, module, summary)


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    from bunsan.launch import doctor  # standard library only at the top, as `run`

    epilog = "examples:\n  bunsan doctor --hostfile hosts --data /data/train.bin\n  bunsan doctor -H node1,node2 --port 29500"
    _add_module(subparsers, "doctor", doctor, "check the hosts of a hostfile before a multi-host job", epilog)


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    from bunsan.bench import plan  # standard library only at the top, as `run`

    summary = "predict step time, scaling efficiency and bytes of every algorithm at 8 to 256 workers"
    _add_module(subparsers, "plan", plan, summary)


def _add_module(
    subparsers: argparse._SubParsersAction, name: str, module: Any, summary: str, epilog: str | None = None
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` of a module that has ``DESCRIPTION``, ``add_arguments`` and ``run`` (its handler)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=module.DESCRIPTION,
        epilog=module.EPILOG if epilog is None else epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)
    return parser


# Subcommands in the order `bunsan --help` lists them.
_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_run, _add_bench, _add_doctor, _add_plan)


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
            message = f"unrecognized option {quoted(unknown[0])}; see the options with --help"
            _subparser(parser, args.subcommand).error(message)
        if args.subcommand is None:
            parser.error("no command given; try 'bunsan run -np 2 train.py', or 'bunsan --help' for the commands")
    except UsageError as err:
        print(f"{err.prog}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help and --version
        return exit_.code if isinstance(exit_.code, int) else 0
    try:
        # A subcommand that needs an optional extra (bunsan bench: matplotlib and the data sets) says so
        # in one sentence before it starts, rather than in a traceback at its end.
        _extras.check_command(args.subcommand)
        return int(args.handler(args))
    except _extras.MissingExtraError as err:
        print(f"bunsan: error: {err}", file=sys.stderr)  # the sentence names the command
        return 2


def _master_addr(config: LaunchConfig, all_local: bool, rank0_host: str) -> str:
    if config.master_addr is not None:
        return config.master_addr
    return "127.0.0.1" if all_local else rank0_host


def _ssh_options(config: LaunchConfig) -> Any:
    from bunsan.launch.ssh_plan import SshOptions

    return SshOptions(config.ssh_port, config.ssh_identity, config.ssh_host_key_checking, config.ssh_options)


def _read_hosts(config: LaunchConfig) -> list[Any] | None:
    from bunsan.launch import hosts as hostlib

    if config.hostfile is not None:
        return hostlib.read_hostfile(config.hostfile)
    if config.hosts is not None:
        return hostlib.parse_hosts(config.hosts)
    return None


def _run(args: argparse.Namespace) -> int:
    """``bunsan run``: plan the job, then print it (``--dry-run``), clean up (``--cleanup``) or run it."""
    from bunsan.launch import cleanup, local, ssh, ssh_plan
    from bunsan.launch import hosts as hostlib
    from bunsan.launch import plan as jobs
    from bunsan.launch.config import parse_env_file, resolve_exports

    def fail(message: str) -> int:
        print(f"bunsan run: error: {message}", file=sys.stderr)
        return 2

    hostname = socket.gethostname()

    def is_local(name: str) -> bool:
        return hostlib.is_local_host(name, hostname)

    try:
        config = config_from_namespace(args, os.environ)
        hosts = _read_hosts(config)
        if config.cleanup:
            return cleanup.run_cleanup(
                config.job_id,
                [h.name for h in hosts] if hosts is not None else None,
                is_local=is_local,
                ssh=_ssh_options(config) if _any_ssh_option(config) else None,
                remote_python=config.remote_python,
                stdout=sys.stdout,
                stderr=sys.stderr,
            )
        if hosts is None:
            hosts = [hostlib.Host("localhost", config.nproc or 1)]
        slots = hostlib.assign_slots(hosts, config.nproc)
        file_env: dict[str, str] = {}
        if config.env_file is not None:
            try:
                with open(config.env_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as err:
                raise ValueError(f"cannot read --env-file {quoted(config.env_file)} ({err.strerror})") from None
            file_env = parse_env_file(text, config.env_file)
        exports = resolve_exports(config.exports, os.environ, file_env)
        used = list(dict.fromkeys(slot.host for slot in slots))
        local_names = [name for name in used if is_local(name)]
        remote = [name for name in used if name not in local_names]
        if len(local_names) > 1:
            raise ValueError(
                f"hosts {quoted(local_names[0])} and {quoted(local_names[1])} are both this machine; "
                "list it once with all its slots"
            )
        if remote:
            plans = ssh_plan.plan_hosts(slots, config.command, is_local, config.remote_python, config.remote_cwd)
        else:
            argv = jobs.worker_command(config.command)
        here = sum(1 for slot in slots if slot.host in local_names)  # remote hosts: their agent checks
        warning = (
            hostlib.check_oversubscription(
                here, hostlib.usable_cores(), local_names[0] if here else "", config.oversubscribe
            )
            if here
            else None
        )
    except ValueError as err:
        return fail(str(err))
    if warning is not None and not config.dry_run:
        print(f"bunsan run: warning: {warning}", file=sys.stderr, flush=True)

    job_id = config.job_id or jobs.new_job_id()
    base_env = {**os.environ, **exports}
    if config.dry_run:
        master_port = config.master_port or jobs.find_free_port()
        master_addr = _master_addr(config, not remote, slots[0].host)
        if remote:
            by_host = {plan.host: plan.argv for plan in plans}
            specs = [jobs.WorkerSpec(slot.rank, slot.local_rank, slot.host, by_host[slot.host], {}) for slot in slots]
        else:
            specs = jobs.plan_workers(slots, argv, base_env, master_addr, master_port, job_id)
        how = "" if not remote else " (over ssh; the address and the port are checked when the job starts)"
        print(
            f"bunsan run: dry run of job {job_id}: {len(specs)} worker(s) on {len(used)} host(s), "
            f"MASTER_ADDR={master_addr} MASTER_PORT={master_port}{how}"
        )
        print(jobs.format_plan(specs))
        return 0

    ssh_options = _ssh_options(config)
    if remote:
        # A record for `bunsan run --cleanup`, should a host become unreachable. A job on this machine
        # alone needs none: PR_SET_PDEATHSIG and the janitor end it whatever happens to the launcher.
        record = cleanup.launcher_record(
            job_id, used, local_names, ssh_options, config.remote_python or sys.executable, config.command
        )
        cleanup.write_job_record(record)

    def say(message: str) -> None:
        print(f"bunsan run: {message}", file=sys.stderr, flush=True)

    def attempt(restart: int) -> jobs.JobOutcome:
        if remote:
            return ssh.run_hosts(
                plans,
                job_id,
                env=exports,
                ssh=ssh_options,
                restart=restart,
                master_addr=config.master_addr,
                master_port=config.master_port,
                tag_output=config.tag_output,
                oversubscribe=config.oversubscribe,
            )
        # A fresh port per attempt: the last attempt's store may linger in TIME_WAIT.
        port = config.master_port or jobs.find_free_port()
        specs = jobs.plan_workers(
            slots, argv, base_env, _master_addr(config, True, slots[0].host), port, job_id, restart
        )
        return local.run_job(specs, job_id, tag_output=config.tag_output)

    if config.min_np is not None:  # elastic: goes on without a lost worker, grows (bunsan.launch.elastic_hosts)
        from bunsan.launch import elastic_hosts

        try:
            code = elastic_hosts.run_from_config(config, hosts, exports, base_env, job_id, is_local, ssh_options, say)
        except ValueError as err:
            return fail(str(err))
        if remote:
            cleanup.remove_job_record(job_id)
        return code
    outcome = local.run_attempts(attempt, config.max_restarts, say)
    if outcome.unconfirmed:
        say(
            f"could not confirm that every worker of job {job_id} ended on {', '.join(outcome.unconfirmed)}; "
            f"run: bunsan run --cleanup --job-id {job_id}"
        )
    else:
        cleanup.remove_job_record(job_id)
    return outcome.code


def _any_ssh_option(config: LaunchConfig) -> bool:
    return any(
        value is not None for value in (config.ssh_port, config.ssh_identity, config.ssh_host_key_checking)
    ) or bool(config.ssh_options)
