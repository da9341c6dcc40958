"""An elastic job that grows (--max-np, --host-discovery-script): the script's output, the options' checks and the
pool's arithmetic, without processes but the discovery scripts themselves. The job that grows with the real
torchft is tests/launch/test_elastic.py."""

from __future__ import annotations

import time

import pytest

from bunsan.launch import discovery
from bunsan.launch.config import LaunchConfig, parse_run_args
from bunsan.launch.discovery import DiscoveryError, free_slots, grow_count, parse_discovery, place, run_discovery
from bunsan.launch.elastic import Growth, _fill, _on_lost, _Slots
from bunsan.launch.elastic_hosts import _addresses
from bunsan.launch.hosts import Host
from bunsan.launch.plan import WorkerSpec


def test_the_scripts_lines_are_hosts_with_slots_and_a_bare_host_has_one():
    text = "node1:4\n\n  node2  \nroot@10.0.0.3:2\n"
    assert parse_discovery(text) == [Host("node1", 4), Host("node2", 1), Host("root@10.0.0.3", 2)]
    assert parse_discovery("") == []


@pytest.mark.parametrize(
    "text, message",
    [
        ("node1 slots=4\n", r"printed 'node1 slots=4' on line 1; expected HOST:SLOTS"),
        ("node1:4\nnode1:2\n", "listed host 'node1' twice"),
        ("node1:0\n", "gave host 'node1' 0 slots"),
        ("node1:x\n", "expected HOST:SLOTS"),
        ("a" * 300 + "\n", "expected HOST:SLOTS"),
    ],
)
def test_garbage_from_the_script_is_one_sentence(text, message):
    with pytest.raises(DiscoveryError, match=message):
        parse_discovery(text)


def _script(tmp_path, body: str, mode: int = 0o755):
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(mode)
    return str(path)


def test_the_script_is_run_and_its_failures_are_one_sentence(tmp_path):
    assert run_discovery(_script(tmp_path, "echo localhost:3")) == [Host("localhost", 3)]
    with pytest.raises(DiscoveryError, match=r"exited with code 3 \(no hosts\)"):
        run_discovery(_script(tmp_path, "echo no hosts >&2; exit 3"))
    with pytest.raises(DiscoveryError, match=r"cannot be run .*; it must be an executable file"):
        run_discovery(_script(tmp_path, "echo a", mode=0o644))
    with pytest.raises(DiscoveryError, match="did not finish within 0 s"):
        run_discovery(_script(tmp_path, "sleep 5"), timeout_s=0.2)
    with pytest.raises(DiscoveryError, match="cannot be run"):
        run_discovery(str(tmp_path / "missing.sh"))


def test_free_slots_placement_and_growth_count():
    pool = [Host("a", 2), Host("b", 3)]
    assert free_slots(pool, {"a": 1, "gone": 4}) == ["a", "b", "b", "b"]
    assert place(pool, {"a": 2}) == "b"
    assert place(pool, {"a": 1, "b": 1}, prefer="b") == "b"  # a lost worker goes back to its own host
    assert place(pool, {"a": 1}, prefer="gone") == "a"  # unless that host left the pool
    assert place(pool, {"a": 2, "b": 3}) is None
    assert grow_count(6, running=4, lost=0, pool=pool, by_host={"a": 2, "b": 2}) == 1  # one slot free
    assert grow_count(6, running=2, lost=0, pool=pool, by_host={"a": 2}) == 3  # three free, up to --max-np
    assert grow_count(4, running=2, lost=1, pool=pool, by_host={"a": 2}) == 1  # a worker lost for good counts
    assert grow_count(4, running=4, lost=0, pool=pool, by_host={"a": 2, "b": 2}) == 0


class _Running:
    returncode = None
    pid = -1

    def poll(self):
        return None


def _slots(count: int, restarts: int = 0) -> _Slots:
    specs = [WorkerSpec(i, i, "a", ("t",), {}) for i in range(count)]
    slots = _Slots(specs, restarts, "j", "/nonexistent")
    slots.running = {i: _Running() for i in range(count)}
    return slots


def _starter(slots: _Slots, started: list):
    def start(rank: int, host: str) -> None:
        slots.hosts[rank], slots.local[rank] = host, slots.local_rank(host)
        slots.running[rank] = _Running()
        started.append((rank, host, slots.local[rank]))

    return start


def test_the_group_grows_onto_free_slots_up_to_max_np_with_new_slot_numbers():
    slots, started, said = _slots(2), [], []
    growth = Growth([Host("a", 2), Host("b", 2)], max_np=3)
    _fill(slots, _starter(slots, started), growth, said.append)
    assert started == [(2, "b", 0)]
    assert said == ["the group grows: rank 2 starts on b (3 running, --max-np 3)"]
    growth.max_np = 6
    _fill(slots, _starter(slots, started), growth, said.append)
    assert started[1:] == [(3, "b", 1)]  # the pool's slots are all taken


def test_a_lost_worker_restarts_on_its_host_and_one_lost_for_good_is_not_replaced_by_growth():
    slots, started, said = _slots(2, restarts=1), [], []
    growth = Growth([Host("a", 2)], max_np=2)
    del slots.running[1]
    _on_lost(slots, 1, 137, 0, 1, said.append)
    assert slots.waiting == [1] and slots.starts[1] == 1 and "(0 restart(s) left)" in said[0]
    _fill(slots, _starter(slots, started), growth, said.append)
    assert started == [(1, "a", 1)] and slots.waiting == []
    del slots.running[1]
    _on_lost(slots, 1, 1, 0, 1, said.append)  # no restart left
    assert slots.lost == 1 and said[-1] == "rank 1 exited with code 1; the other 1 go on (--min-np 1)"
    growth.pool = [Host("a", 4)]
    growth.max_np = 3
    _fill(slots, _starter(slots, started), growth, said.append)
    assert started[1:] == [(2, "a", 1)]  # --max-np 3 less the lost one


def test_a_restart_waits_for_a_free_slot_when_its_host_left_the_pool():
    slots, started, said = _slots(2, restarts=1), [], []
    growth = Growth([Host("b", 0)], max_np=4)
    del slots.running[0]
    _on_lost(slots, 0, 137, 0, 1, said.append)
    growth.pool = []
    _fill(slots, _starter(slots, started), growth, said.append)
    assert started == [] and slots.waiting == [0]
    growth.pool = [Host("c", 1)]
    _fill(slots, _starter(slots, started), growth, said.append)
    assert started == [(0, "c", 0)]


def test_the_pool_follows_the_script_and_a_failing_script_is_said_once():
    answers: list = [[Host("a", 1), Host("b", 1)], DiscoveryError("the script exited with code 1 (x)")]
    answers.append(answers[1])
    answers.append([Host("a", 2)])
    said: list[str] = []
    growth = Growth(
        [Host("a", 1)],
        4,
        discover=lambda: _raise_or(answers.pop(0) if len(answers) > 1 else answers[0]),
        interval_s=0.0,
    )
    for _ in range(4):
        growth.refresh(said.append)
        assert growth._asking is not None
        growth._asking.join(5)
    growth.refresh(said.append)
    assert growth.pool == [Host("a", 2)]
    assert said == [
        "the script exited with code 1 (x); the job goes on with the hosts it has",
        "host(s) b left the discovery script's list; their workers run on until they end",
    ]


def _raise_or(answer):
    if isinstance(answer, Exception):
        raise answer
    return answer


def test_the_options_parse_and_max_np_defaults_to_np():
    config = parse_run_args(["-np", "2", "--min-np", "1", "--max-np", "3", "--host-discovery-script", "d.sh", "t.py"])
    assert (config.max_np, config.host_discovery_script) == (3, "d.sh")
    assert parse_run_args(["-np", "2", "--min-np", "1", "t.py"]).max_np is None
    LaunchConfig(command=("t.py",), nproc=2, min_np=1, hostfile="hosts", max_np=4)  # a hostfile is the pool
    LaunchConfig(command=("t.py",), nproc=2, min_np=1, hosts="a:2,b:2", max_restarts=2)
    assert discovery.DISCOVERY_INTERVAL_S <= 5


def test_a_remote_worker_reaches_this_machine_where_the_ssh_connection_came_from():
    assert _addresses("root@node2", "10.0.0.1 5122 10.0.0.2 22") == ("10.0.0.1", "10.0.0.2")
    here, there = _addresses("node2", "")
    assert there == "node2" and here


def test_time_is_monotonic_for_the_interval():  # the interval does not jump with the wall clock
    growth = Growth([], 1, discover=lambda: [], interval_s=60.0)
    growth.refresh(lambda _: None)
    assert growth.next_at > time.monotonic() + 50


def test_a_remote_agent_tells_the_launcher_once_that_its_worker_joined_and_removes_the_folder_it_made(tmp_path):
    from bunsan.launch.remote import _JoinedMarks

    told = []

    class Outbox:
        def status(self, event, **fields):
            told.append((event, fields))

    folder = tmp_path / "marks"
    marks = _JoinedMarks(str(folder), Outbox())  # the launcher's folder is on another machine: made here
    assert folder.is_dir()
    (folder / "joined-j-2-0").write_text("1")
    marks.poll()
    marks.next_at = 0.0
    marks.poll()
    assert told == [("joined", {"replica": "j-2-0"})]
    marks.close()
    assert not folder.exists()
    _JoinedMarks(None, Outbox()).poll()  # a job that is not elastic: nothing to watch
