"""Host lists, hostfiles, slot assignment and the ssh fan-out's commands and protocol: pure, no processes."""

from __future__ import annotations

import json

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
from bunsan.launch.remote import AgentInit, Frame, FrameDecoder, encode_frame
from bunsan.launch.ssh_plan import SshOptions, agent_command, master_address, plan_hosts, remote_command, ssh_command

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
    with pytest.raises(ValueError, match=r"hosts.txt lists no hosts"):
        parse_hostfile("# nothing yet\n\n", "hosts.txt")


def test_read_hostfile_names_the_path(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1 slots=2\nnode2 slots=2 # ok\nnode3 slots=\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: cannot read 'node3 slots='"):
        read_hostfile(path)
    path.write_text("node1 slots=2\n")
    assert read_hostfile(path) == [Host("node1", 2)]


def test_read_hostfile_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read hostfile .*missing.*No such file"):
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


# A user name asks for an ssh login, even to this machine.
@pytest.mark.parametrize("name", ["node1", "10.0.0.1", "box8", "box7x", "0.0.0.0", "root@localhost", "me@127.0.0.2"])
def test_is_local_host_false(name):
    assert not is_local_host(name, hostname="box7.lab.example")


def test_hostfile_with_user_names_and_addresses():
    assert parse_hostfile("root@10.213.0.11 slots=2\nme@node-b:3\n") == [
        Host("root@10.213.0.11", 2),
        Host("me@node-b", 3),
    ]


# ---------------------------------------------------------------------------
# The ssh fan-out: commands and choices, no processes


def test_ssh_command_is_batch_mode_without_a_terminal():
    argv = ssh_command("node1", "exec true", SshOptions())
    assert argv[0] == "ssh" and argv[-3:] == ["--", "node1", "exec true"]
    options = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-o"]
    assert "BatchMode=yes" in options  # never a password prompt
    assert "-T" in argv  # no pseudo terminal: byte-exact output, stderr apart
    assert not any(o.startswith("StrictHostKeyChecking") for o in options)  # left to the user's ssh config
    assert "-p" not in argv and "-i" not in argv


def test_ssh_command_options():
    options = SshOptions(port=2222, identity="/keys/id", host_key_checking="no", options=("ConnectionAttempts=3",))
    argv = ssh_command("root@10.0.0.2", "exec true", options)
    assert argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-i") + 1] == "/keys/id"
    given = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-o"]
    assert {"StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "ConnectionAttempts=3"} <= set(given)
    checked = ssh_command("n", "x", SshOptions(host_key_checking="accept-new"))
    assert "StrictHostKeyChecking=accept-new" in checked and "UserKnownHostsFile=/dev/null" not in checked
    with pytest.raises(ValueError, match="must be one of yes, accept-new, no"):
        SshOptions(host_key_checking="maybe")


def test_remote_commands_quote_everything():
    assert agent_command("/opt/my env/bin/python", "abc123") == (
        "exec env BUNSAN_JOB_ID=abc123 '/opt/my env/bin/python' -m bunsan.launch.remote"
    )
    assert remote_command("/usr/bin/python3", "bunsan.launch.cleanup", ["--job-id", "a;b"]) == (
        "exec /usr/bin/python3 -m bunsan.launch.cleanup --job-id 'a;b'"
    )


@pytest.mark.parametrize(
    ("rank0", "rank0_local", "connections", "expected"),
    [
        # Rank 0 remote: the address the launcher reached it at (server side of its ssh connection).
        ("node1", False, {"node1": "10.0.0.9 50000 10.0.0.1 22", "node2": "10.0.0.9 50001 10.0.0.2 22"}, "10.0.0.1"),
        ("root@node1", False, {"root@node1": "10.0.0.9 50000 10.0.0.1 22"}, "10.0.0.1"),
        # Reached through a tunnel (loopback) or unknown: the host name, without the user.
        ("root@node1", False, {"root@node1": "127.0.0.1 50000 127.0.0.1 2222"}, "node1"),
        ("node1", False, {}, "node1"),
        # Rank 0 here: this machine as the first remote host sees it (client side).
        ("localhost", True, {"node2": "10.0.0.9 50001 10.0.0.2 22"}, "10.0.0.9"),
    ],
)
def test_master_address(rank0, rank0_local, connections, expected):
    assert master_address(rank0, rank0_local, connections) == expected


def test_plan_hosts_groups_slots_and_resolves_commands_per_host(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    slots = assign_slots([Host("localhost", 1), Host("node2", 2)])
    plans = plan_hosts(slots, ["train.py", "--lr", "1"], lambda h: h == "localhost", "/remote/python", "/remote/dir")
    here, there = plans
    assert (here.host, here.group_rank, here.local, here.slots) == ("localhost", 0, True, ((0, 0, 3, 1),))
    assert here.argv[1:] == ("-u", "train.py", "--lr", "1") and here.cwd == str(tmp_path)
    assert (there.group_rank, there.local, there.slots) == (1, False, ((1, 0, 3, 2), (2, 1, 3, 2)))
    assert there.argv == ("/remote/python", "-u", "train.py", "--lr", "1")
    assert (there.python, there.cwd, there.script) == ("/remote/python", "/remote/dir", "train.py")
    # A script missing here is the remote agent's to check, in its own directory.
    plans = plan_hosts(assign_slots([Host("node2", 1)]), ["elsewhere.py"], lambda h: False)
    assert plans[0].script == "elsewhere.py"


# ---------------------------------------------------------------------------
# The agent's protocol


def test_frames_survive_any_chunking():
    stream = (
        encode_frame("o", 3, b"line one\nline two\n")
        + encode_frame("s", -1, b'{"event": "ready"}')
        + encode_frame("e", 0, b"")
        + encode_frame("m", -1, "caf\u00e9".encode())
    )
    expected = [
        Frame("o", 3, b"line one\nline two\n"),
        Frame("s", -1, b'{"event": "ready"}'),
        Frame("e", 0, b""),
        Frame("m", -1, "caf\u00e9".encode()),
    ]
    for size in (1, 2, 7, len(stream)):
        decoder = FrameDecoder()
        frames = [f for i in range(0, len(stream), size) for f in decoder.feed(stream[i : i + size])]
        assert frames == expected
        assert decoder.rest() == b""


def test_frame_decoder_passes_on_what_is_not_a_frame():
    decoder = FrameDecoder()
    frames = decoder.feed(b"Welcome to node1!\n" + encode_frame("o", 1, b"x\n"))
    assert frames == [Frame("?", -1, b"Welcome to node1!\n"), Frame("o", 1, b"x\n")]


def test_agent_init_round_trip():
    init = AgentInit(
        job_id="j1",
        group_rank=1,
        hosts=2,
        restart=3,
        cwd="/w",
        argv=["/py", "-u", "t.py"],
        script="t.py",
        env={"A": "1"},
        slots=[[2, 0, 4, 2], [3, 1, 4, 2]],
        check_port=None,
    )
    message = json.loads(init.to_line())
    assert message["op"] == "init"
    assert AgentInit.from_message(message) == init
    assert init.host_job_id == "j1.h1"
