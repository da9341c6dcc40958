"""Host lists, hostfiles and slot assignment: pure functions, no processes."""

from __future__ import annotations

import pytest

from bunsan.launch.hosts import (
    Host,
    Slot,
    assign_slots,
    is_local_host,
    parse_hostfile,
    parse_hosts,
    read_hostfile,
)

# ---------------------------------------------------------------------------
# -H / --hosts


def test_parse_hosts_keeps_order_and_slots():
    assert parse_hosts("node1:4,node2:2") == [Host("node1", 4), Host("node2", 2)]


def test_parse_hosts_bare_name_is_one_slot_and_spaces_are_ignored():
    assert parse_hosts("node1, 10.0.0.7:3") == [Host("node1", 1), Host("10.0.0.7", 3)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("node1:four", "cannot read 'node1:four'"),
        ("node1:4,", "cannot read ''"),
        ("node1:-1", "cannot read 'node1:-1'"),
        ("node1:0", "has 0 slots"),
        ("a:1,b:2,a:3", "lists 'a' twice"),
    ],
)
def test_parse_hosts_rejects_bad_specs(spec, message):
    with pytest.raises(ValueError, match="--hosts") as info:
        parse_hosts(spec)
    assert message in str(info.value)


# ---------------------------------------------------------------------------
# Hostfiles


def test_parse_hostfile_reads_slots_comments_and_blank_lines():
    text = """\
# the cluster
node1 slots=4   # the fast one

node2 slots = 2
node3
node4:3
   # indented comment
"""
    assert parse_hostfile(text, "hosts") == [Host("node1", 4), Host("node2", 2), Host("node3", 1), Host("node4", 3)]


@pytest.mark.parametrize(
    ("text", "lineno", "message"),
    [
        ("node1 slots=4\nnode2 slots=two\n", 2, "cannot read 'node2 slots=two'"),
        ("# header\n\nnode1 slot=4\n", 3, "cannot read 'node1 slot=4'"),
        ("node1 slots=4 max_slots=8\n", 1, "expected 'HOST slots=N'"),
        ("node1 slots=0\n", 1, "has 0 slots"),
        ("node1 slots=2\nnode2\nnode1 slots=1\n", 3, "already listed on line 1"),
    ],
)
def test_parse_hostfile_errors_name_file_and_line(text, lineno, message):
    with pytest.raises(ValueError) as info:
        parse_hostfile(text, "cluster/hosts.txt")
    assert str(info.value).startswith(f"cluster/hosts.txt:{lineno}: ")
    assert message in str(info.value)


def test_parse_hostfile_without_hosts_is_an_error():
    with pytest.raises(ValueError, match="hosts.txt lists no hosts"):
        parse_hostfile("# nothing yet\n\n", "hosts.txt")


def test_read_hostfile_names_the_path(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1 slots=2\nnode2 slots=2 # ok\nnode3 slots=\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: cannot read 'node3 slots='"):
        read_hostfile(path)
    path.write_text("node1 slots=2\n")
    assert read_hostfile(path) == [Host("node1", 2)]


def test_read_hostfile_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read hostfile .*missing.*No such file"):
        read_hostfile(tmp_path / "missing")


# ---------------------------------------------------------------------------
# Slot assignment


def test_assign_slots_fills_hosts_in_order():
    slots = assign_slots([Host("a", 2), Host("b", 2)], 4)
    assert slots == [
        Slot("a", 0, 0, 4, 2, 0),
        Slot("a", 1, 1, 4, 2, 0),
        Slot("b", 2, 0, 4, 2, 1),
        Slot("b", 3, 1, 4, 2, 1),
    ]


def test_assign_slots_partial_last_host_and_unused_hosts():
    slots = assign_slots([Host("a", 2), Host("b", 4), Host("c", 4)], 3)
    assert [(s.host, s.rank, s.local_rank, s.local_world_size, s.group_rank) for s in slots] == [
        ("a", 0, 0, 2, 0),
        ("a", 1, 1, 2, 0),
        ("b", 2, 0, 1, 1),
    ]
    assert {s.world_size for s in slots} == {3}


def test_assign_slots_without_nproc_uses_every_slot():
    assert len(assign_slots([Host("a", 3), Host("b", 2)])) == 5


def test_assign_slots_more_ranks_than_slots_is_a_clear_error():
    with pytest.raises(ValueError, match=r"-np 5 is more than the 4 slot\(s\) of the hosts \(a:2, b:2\); lower -np"):
        assign_slots([Host("a", 2), Host("b", 2)], 5)


@pytest.mark.parametrize("nproc", [0, -1])
def test_assign_slots_rejects_non_positive_nproc(nproc):
    with pytest.raises(ValueError, match=f"-np must be >= 1, got {nproc}"):
        assign_slots([Host("a", 2)], nproc)


def test_assign_slots_needs_hosts():
    with pytest.raises(ValueError, match="no hosts"):
        assign_slots([], 1)


# ---------------------------------------------------------------------------
# Local or remote


@pytest.mark.parametrize(
    "name", ["localhost", "LOCALHOST", "127.0.0.1", "127.0.1.1", "::1", "box7", "box7.lab.example", "Box7"]
)
def test_is_local_host_true(name):
    assert is_local_host(name, hostname="box7.lab.example")


@pytest.mark.parametrize("name", ["node1", "10.0.0.1", "box8", "box7x", "0.0.0.0"])
def test_is_local_host_false(name):
    assert not is_local_host(name, hostname="box7.lab.example")
