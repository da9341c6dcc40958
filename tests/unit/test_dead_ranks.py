"""bunsan.comm.group.dead_ranks when the store does not answer: this host's peers are checked without it."""

import subprocess
import sys
import types

import pytest

from bunsan.comm import group
from bunsan.launch import treewatch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux only")


class _SilentStore:
    """A store whose every call fails, as one whose server is being torn down."""

    def check(self, keys):
        raise RuntimeError("connection reset by peer")

    def get(self, key):
        raise RuntimeError("connection reset by peer")


def _world(monkeypatch, *, rank, peers, store_on_rank0=False):
    monkeypatch.setattr(group._world, "store", _SilentStore())
    monkeypatch.setattr(group._world, "world_size", 2)
    monkeypatch.setattr(group._world, "rank", rank)
    monkeypatch.setattr(group._world, "store_on_rank0", store_on_rank0)
    watch = types.SimpleNamespace(_local_peers=peers, poll_s=0.5) if peers is not None else None
    monkeypatch.setattr(group._world, "watchdog", watch)


@pytest.fixture
def process():
    child = subprocess.Popen(["sleep", "60"])
    yield child, treewatch.start_time(child.pid)
    child.kill()
    child.wait()


def test_a_killed_peer_is_found_from_the_watchs_pids_when_the_store_is_gone(monkeypatch, process):
    child, start = process
    child.kill()
    child.wait()  # reaped, as a launcher reaps the worker it saw die
    _world(monkeypatch, rank=0, peers={1: (child.pid, start)})
    assert group.dead_ranks(wait_s=0, local_wait_s=0.5) == [1]


def test_a_living_peer_without_a_store_gives_the_old_answers(monkeypatch, process):
    child, start = process
    _world(monkeypatch, rank=0, peers={1: (child.pid, start)})
    assert group.dead_ranks(wait_s=0, local_wait_s=0.1) is None  # cannot be told
    # under bunsan run rank 0 hosts the store: a silent store on rank 1 means rank 0 is gone
    _world(monkeypatch, rank=1, peers={0: (child.pid, start)}, store_on_rank0=True)
    assert group.dead_ranks(wait_s=0, local_wait_s=0.1) == [0]
    # before the watch has learned any peer: as before
    _world(monkeypatch, rank=0, peers=None)
    assert group.dead_ranks(wait_s=0, local_wait_s=0.1) is None
    _world(monkeypatch, rank=0, peers={})
    assert group.dead_ranks(wait_s=0, local_wait_s=0.1) is None
