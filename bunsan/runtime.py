"""Start and stop a bunsan job: where am I, who else is there, which device.

:func:`init` reads the variables that the usual launchers set, creates the torch.distributed world, and
arranges that an uncaught exception on any rank ends the whole job within seconds (see :mod:`bunsan.comm.group`).
It is idempotent, and a lone ``python train.py`` works too: a world of size 1 where every collective is the identity.

Which launcher started the process, and what it says, is :mod:`bunsan.environment`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bunsan import _allocator, _cores, comm
from bunsan._validate import check_choice, check_number
from bunsan.comm import group as _group
from bunsan.comm import inspector as _inspector
from bunsan.environment import (
    DEFAULT_PORT,
    WorldInfo,
    detect_environment,
    parse_slurm_nodelist,
    parse_slurm_tasks_per_node,
)
from bunsan.errors import BunsanError, CommunicationError, ConfigurationError

__all__ = [
    "WorldInfo",
    "detect_environment",
    "device",
    "finalize",
    "init",
    "is_initialized",
    "is_main",
    "local_rank",
    "local_size",
    "parse_slurm_nodelist",
    "parse_slurm_tasks_per_node",
    "rank",
    "session",
    "size",
    "track_optimizer",
]


class _State:
    info: WorldInfo | None = None
    backend: str | None = None
    device: torch.device = torch.device("cpu")
    failed = False
    owns_world = False  # False when the user created the process group themselves
    previous_excepthook: Callable[[type[BaseException], BaseException, types.TracebackType | None], Any] | None = None


_state = _State()
_usable_cores = _cores.usable_cores  # the cores this process may run on
_SOLO = WorldInfo("none", 0, 1, 0, 1, None, DEFAULT_PORT, "solo")  # what a process is before init()


def _resolve_master(info: WorldInfo) -> str:
    if info.master_addr is not None:
        return info.master_addr
    try:
        from mpi4py import MPI  # type: ignore[import-not-found]  # optional: only MPI jobs across hosts need it
    except ImportError:
        raise ConfigurationError(
            f"bunsan cannot tell which host is rank 0 under {info.launcher} across several hosts: "
            "set MASTER_ADDR (e.g. `mpirun -x MASTER_ADDR=<rank 0's host> ...`) or install mpi4py"
        ) from None
    return MPI.COMM_WORLD.bcast(socket.gethostname() if info.rank == 0 else None, root=0)


def init(backend: str | None = None, timeout_s: float | None = None, stall_s: float | None = None) -> WorldInfo:
    """Join the job: create the process group, pick the device. Idempotent. Collective.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default ``BUNSAN_BACKEND`` or nccl when a
            CUDA device is present, else gloo.
        timeout_s: how long a collective may wait for the other ranks before it
            raises; default ``BUNSAN_TIMEOUT`` or 300 s.
        stall_s: after this long in one collective, the lowest waiting rank prints
            once which ranks have not reached it and what each is doing, and keeps
            waiting; default ``BUNSAN_STALL_S`` or 60 s (see :mod:`bunsan.comm.inspector`).

    Returns:
        This process's :class:`WorldInfo`.

    On CPU each worker of a job of several (or of any job ``bunsan run`` started)
    uses one intra-op thread unless ``OMP_NUM_THREADS`` is set: several workers on
    one machine each using every core slow each other down (docs/experiments/design-notes.md,
    "Launcher, runtime and CLI"). A lone process keeps torch's default. The same
    workers keep memory freed by a step for the next one (glibc malloc's thresholds
    fixed, :mod:`bunsan._allocator`; ``BUNSAN_MALLOC_TUNING=0`` turns it off).
    """
    if _state.info is not None:
        return _state.info
    if os.environ.get("BUNSAN_ELASTIC_LIGHTHOUSE"):  # bunsan run --min-np: torchft's quorum per step
        from bunsan import elastic

        _state.info, _state.backend = elastic.start(backend or "gloo"), backend or "gloo"
        return _state.info
    if comm.is_initialized():  # the user made the group; adopt it
        size_ = comm.get_world_size()
        env = detect_environment()
        local_rank_ = env.local_rank if env.world_size == size_ else 0
        local_size_ = env.local_world_size if env.world_size == size_ else 1
        _state.info = WorldInfo("external", comm.get_rank(), size_, local_rank_, local_size_, None, 0, "external")
        _state.backend = comm.get_backend()
        _state.device = torch.device("cuda", local_rank_) if _state.backend == "nccl" else torch.device("cpu")
        if _state.backend == "gloo" and size_ > 1:
            _allocator.tune()  # as for the workers init() starts (bunsan/_allocator.py)
        return _state.info

    info = detect_environment()
    backend, timeout_s, stall_s = _group.world_settings(backend, timeout_s, stall_s)
    check_choice("backend", backend, ("gloo", "nccl"), hint="gloo on CPU, nccl on CUDA")
    if backend == "nccl" and not _group.cuda_available():
        raise ConfigurationError("backend 'nccl' needs a CUDA device, and none is visible; use backend='gloo'")
    timeout_s = check_number("timeout_s", timeout_s, minimum=0, min_inclusive=False, hint="seconds")
    _inspector.configure(rank=info.rank, world_size=info.world_size, stall_s=stall_s)

    if backend == "nccl":
        _state.device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(_state.device)
    else:
        _state.device = torch.device("cpu")
        # Several workers sharing a machine must not each use every core; a lone
        # `python script.py` (a job of one that no launcher started) keeps torch's
        # default threads. `bunsan run -np 1` still gets one thread, as documented.
        if "OMP_NUM_THREADS" not in os.environ and (info.world_size > 1 or info.launcher == "bunsan"):
            torch.set_num_threads(1)
        if info.world_size > 1 or info.launcher == "bunsan":
            _allocator.tune()  # no page faults from memory handed back between steps (bunsan/_allocator.py)

    master = _resolve_master(info) if info.world_size > 1 else "127.0.0.1"
    _group.create_world(
        backend=backend,
        rank=info.rank,
        world_size=info.world_size,
        master_addr=master,
        master_port=info.master_port,
        timeout_s=timeout_s,
        job_id=info.job_id,
        agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        # `bunsan run` ends every process of the job itself; other launchers need the janitor.
        guard_tree=info.launcher != "bunsan",
        all_local=info.local_world_size == info.world_size,
    )
    _state.info, _state.backend, _state.owns_world, _state.failed = info, backend, True, False
    if info.world_size > 1:
        _state.previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
        if info.launcher != "bunsan":
            _install_sigterm_hook()
    atexit.register(_finalize_at_exit)
    return info


def _install_sigterm_hook() -> None:
    """Under torchrun and the like: on the launcher's SIGTERM, name the rank that vanished and end our children.

    torchrun stops the survivors of a dead worker within a tenth of a second, often
    before their collective has even failed, so without this no line would name
    the rank that died, and children outside the worker's process group would
    stay. Installed only where SIGTERM has its default action.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: object) -> None:
    info = _state.info
    if info is not None and info.world_size > 1:
        where = f"rank {info.rank} of {info.world_size}"
        earlier = _group.abort_reason()
        if earlier is not None and earlier[0] != info.rank:
            # a peer's watch may have written the note of a silent death a moment before the launcher's signal
            why = f"rank {earlier[0]} {_group.peer_failure(earlier[1], traceback=False)}"
        else:
            # Only a rank dead already: the launcher sends SIGTERM to every rank at
            # once, and a peer that got it first is not a silent death (it says so).
            dead = _group.dead_ranks(wait_s=0, local_wait_s=0.5)
            why = (
                f"rank {dead[0]} {_group.SILENT_DEATH} (its process is gone: killed by a signal or out of memory?)"
                if dead
                else ""
            )
        _group.mark_finished()
        if why:
            sys.stderr.write(f"[bunsan] {where}: stopped by the launcher (SIGTERM) because {why}\n")
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stdout.flush()
        _group.end_children()
    # Die of SIGTERM, as without this hook: the launcher reads the same exit status.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_for_peer(where: str, peer: int, why: str, exc: BaseException) -> None:
    """This rank failed because rank ``peer`` did: say so in one line, tell the launcher, end."""
    sys.stderr.write(
        f"[bunsan] {where}: stopping because rank {peer} {why}; here: {type(exc).__name__}: "
        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}\n"
    )
    _group.report("stopped", peer=peer, what=f"rank {peer} {why}"[:300])
    _group.end_process(1)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
    """End the whole job: print this rank's traceback, tell the others, exit now."""
    _state.failed = True
    _group.silence_watch()  # this rank failed: its watch must not name a peer's exit as the cause
    info = _state.info
    where = f"rank {info.rank} of {info.world_size}" if info else "a rank"
    broken = isinstance(exc, CommunicationError) or _group.is_backend_error(exc)
    earlier = _group.abort_reason()
    if earlier is not None and info is not None and earlier[0] != info.rank and broken:
        # Our collective broke because another rank failed first (an error of our own is reported as ours)
        _stop_for_peer(where, earlier[0], _group.peer_failure(earlier[1]), exc)
    if info is not None and broken:
        # A peer that died without a word (SIGKILL, OOM) broke the collective: name it (issue 15).
        dead = _group.dead_ranks()
        if dead:
            why = f"{_group.SILENT_DEATH} (its process is gone: killed by a signal or out of memory?)"
            _group.signal_abort(why, failed=dead[0])
            _stop_for_peer(where, dead[0], why, exc)
    # bunsan's own errors already say what the backend said: skip the chained traceback.
    chain = not isinstance(exc, BunsanError)
    text = "".join(traceback.format_exception(exc_type, exc, tb, chain=chain))
    sys.stderr.write(f"[bunsan] {where} failed; ending the job.\n{text}")
    sys.stderr.flush()
    sys.stdout.flush()
    what = f"{exc_type.__name__}: {exc}"[:200]
    _group.report("raised", what=what)  # before the abort key: the launcher knows the cause first
    _group.signal_abort(what)
    if info is not None and info.rank == 0:
        time.sleep(1.0)  # rank 0 hosts the store: let the others read why before it goes
    # A normal interpreter shutdown could block in the process group's teardown
    # while the other ranks sit in a collective: leave at once (after ending our children).
    _group.end_process(1)


class _Tracked:
    """A DistributedOptimizer's algorithm, which finalize() joins unless the script did."""

    def __init__(self, optimizer: Any) -> None:
        self.ref = weakref.ref(optimizer)
        # The algorithm is held until it is joined: in the usual `def main(): ...`
        # the optimizer and the model are gone when finalize() runs at exit, and
        # the join (the last partial block, answering a peer's exchanges, the
        # parameter server's threads) is still owed.
        self.algorithm: Any = getattr(optimizer, "algorithm", None)


_optimizers: list[_Tracked] = []


def track_optimizer(optimizer: Any) -> None:
    """Remember ``optimizer`` (a :class:`bunsan.DistributedOptimizer`) for :func:`finalize`.

    Called by its constructor. The optimizer itself is held weakly, its
    algorithm until it has joined; ``optimizer.join`` is wrapped so that a join
    the script makes is not repeated, and so that a stall report can say "in join".
    """
    entry = _Tracked(optimizer)
    _optimizers[:] = [e for e in _optimizers if e.algorithm is not None]
    _optimizers.append(entry)
    join = type(optimizer).join
    if getattr(entry.algorithm, "name", "") == "data_parallel":
        # Its every step communicates, so its step count tags each collective for the
        # out-of-step comparison. Block and asynchronous algorithms legitimately
        # communicate after different numbers of steps on different ranks.
        _inspector.count_steps_of(entry.algorithm)

    def tracked_join(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _inspector.activity("in join"):
            result = join(self, *args, **kwargs)
        entry.algorithm = None  # joined: nothing owed
        return result

    optimizer.join = types.MethodType(tracked_join, optimizer)


def _join_optimizers() -> None:
    """Collective: join every tracked algorithm that the script did not join, in creation order.

    A rank whose data ended first keeps answering the others' exchanges here
    until every rank has joined (what ``optimizer.join()`` after the loop does),
    and block algorithms finish their last partial block, so every replica ends
    equal. The order is the order of creation, the same on every rank.
    """
    for entry in list(_optimizers):
        algorithm, entry.algorithm = entry.algorithm, None
        if algorithm is not None:
            with _inspector.activity(_inspector.FINALIZE_JOIN):
                algorithm.join()
    _optimizers.clear()


def _check_in_step() -> None:
    """Collective: raise on every rank unless every rank made the same number of world collectives.

    The last chance to see collectives that went out of step without a hang
    (a rank that skipped one pairs this gather with another collective, and the
    peers' published states name it; see :mod:`bunsan.comm.inspector`).
    """
    n = comm.get_world_size()
    mismatch = _inspector.compare_at_end(timeout_s=30.0)
    if mismatch is not None:
        raise CommunicationError(mismatch)
    device = comm.tensor_device()  # NCCL moves only CUDA tensors
    mine = torch.tensor([_inspector.collectives_in_world()], dtype=torch.int64, device=device)
    counts = torch.empty(n, dtype=torch.int64, device=device)
    comm.all_gather_into(counts, mine)
    values = counts.tolist()
    if len(set(values)) > 1:
        by_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(values))
        raise CommunicationError(
            f"collectives went out of step: at finalize() the ranks had made different numbers of collectives "
            f"({by_rank}); a rank skipped or added one (e.g. skipped optimizer.step() on one rank only), so the "
            "models are not what the other ranks think"
        )


def finalize() -> None:
    """Leave the job cleanly. Collective on a normal end; safe to call twice.

    First joins every :class:`bunsan.DistributedOptimizer` of this process that
    the script did not join (so a rank whose data ended early answers the
    others' exchanges until all are done, and block algorithms average their
    last partial block), then checks that every rank made the same number of
    collectives, then destroys the process group.

    Called automatically at interpreter exit if the script does not call it.

    Raises:
        CommunicationError: the ranks' collectives went out of step, or a peer
            failed while this rank was joining.
    """
    if _state.info is None:
        return
    if _state.info.launcher == "elastic":  # bunsan.elastic: every committed step is already consistent
        from bunsan import elastic

        elastic.leave()
        _state.info = None
        return
    try:
        # Alone, or after the script destroyed the group itself, there is nobody to answer.
        if not _state.failed and comm.is_initialized() and comm.get_world_size() > 1:
            _inspector.set_activity(_inspector.IN_FINALIZE)
            _join_optimizers()
            if _state.owns_world:
                _check_in_step()
        _inspector.set_activity("finished")
    except BaseException as e:
        # The group is left as it is: pending work of collectives out of step can hang
        # its teardown. The exception reaches bunsan's excepthook, which prints it,
        # tells the other ranks and exits 1 at once (a script that catches it may
        # still print or save, then must exit).
        _state.failed = True
        _group.signal_abort(f"{type(e).__name__}: {e}"[:200])  # a peer still waiting ends too
        raise
    _leave()


def _leave() -> None:
    if _state.info is None:
        return
    if _state.owns_world:
        _group.destroy_world(barrier=not _state.failed)
    if sys.excepthook is _excepthook:
        sys.excepthook = _state.previous_excepthook or sys.__excepthook__
    _state.info, _state.backend, _state.owns_world = None, None, False
    _state.device = torch.device("cpu")
    _optimizers.clear()
    with contextlib.suppress(Exception):
        atexit.unregister(_finalize_at_exit)


def _finalize_at_exit() -> None:
    """finalize() for a script that did not call it; a failure here must not exit 0."""
    where = f"rank {_state.info.rank}" if _state.info else "a rank"
    try:
        finalize()
    except BaseException as e:
        sys.stderr.write(f"[bunsan] {where} failed at exit in finalize(): {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


@contextlib.contextmanager
def session(backend: str | None = None, timeout_s: float | None = None) -> Iterator[WorldInfo]:
    """``with bunsan.session():`` runs :func:`init` and, on leaving, :func:`finalize`."""
    info = init(backend=backend, timeout_s=timeout_s)
    try:
        yield info
    except BaseException:
        _state.failed = True
        raise
    finally:
        if not _state.failed:
            finalize()


def is_initialized() -> bool:
    """Whether :func:`init` has run in this process (and :func:`finalize` has not)."""
    return _state.info is not None


def _info() -> WorldInfo | None:
    if _state.info is not None:
        return _state.info
    if comm.is_initialized():  # a group made by the user or a test harness
        return WorldInfo("external", comm.get_rank(), comm.get_world_size(), 0, 1, None, 0, "external")
    return None


def share_host_cores(group: Any = None) -> None:
    """Collective over ``group``: in a CPU job whose group the script made itself, no more intra-op threads
    on a host than it has cores (:func:`bunsan._cores.share`). Workers :func:`init` started are left alone."""
    if _state.info is None or _state.info.launcher == "external":
        _cores.share(group)


def _current() -> WorldInfo:
    """This process's place in the job; before :func:`init`, a lone process's."""
    return _info() or _SOLO


def rank() -> int:
    """This worker's rank, 0..size()-1 (0 before :func:`init`)."""
    return _current().rank


def size() -> int:
    """Number of workers in the job (1 before :func:`init`)."""
    return _current().world_size


def local_rank() -> int:
    """This worker's index among the workers on its host."""
    return _current().local_rank


def local_size() -> int:
    """Number of workers on this worker's host."""
    return _current().local_world_size


def is_main() -> bool:
    """True on rank 0: the one that prints, logs and writes shared files."""
    return rank() == 0


def device() -> torch.device:
    """The device this worker trains on: ``cuda:<local rank>`` with nccl, else the CPU."""
    return _state.device
