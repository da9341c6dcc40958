"""Issue 15 across two "hosts" (network namespaces with sshd, tests/helpers/hosts.py).

* Item 9: rank 0 on the first host raises; rank 1 on the second host, told to
  stop, exits first; the launcher still names rank 0 and exits 1.
* Item 5: rank 0's store listens on its host's address, not on every interface.
* Item 8: a host with absurdly many slots is refused by its own agent, in one line.

Slow (sshd, two hosts, torch on both): run sparingly.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests.helpers.hosts import HostsUnavailable, start_hosts
from tests.launch.test_multihost import _bunsan, _stop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces and /proc: Linux only")

_RAISE = """
    import os, sys, time
    import torch
    import bunsan
    from bunsan.comm import all_reduce
    from tests.launch.edges import listening_addresses

    bunsan.init(timeout_s=60)
    all_reduce(torch.ones(1))
    if bunsan.rank() == 0:
        print("rank 0 listens on", " ".join(listening_addresses([os.getpid()])), flush=True)
        time.sleep(0.2)
        raise RuntimeError("boom on rank 0")
    all_reduce(torch.ones(1))
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("hosts")
    try:
        started = start_hosts(base / "ssh", count=2)
    except HostsUnavailable as err:
        pytest.skip(f"no test hosts: {err}")
    try:
        yield started
    finally:
        started.close()


@pytest.mark.timeout(150)
def test_rank_0_raising_on_one_host_is_named_though_rank_1_exits_first(hosts, tmp_path):
    script = tmp_path / "raise.py"
    script.write_text(textwrap.dedent(_RAISE))
    launcher = _bunsan(
        hosts, tmp_path, "run", "-x", "PYTHONPATH", "-H", ",".join(f"{h}:1" for h in hosts.names), str(script)
    )
    try:
        out, err = launcher.communicate(timeout=120)
    finally:
        _stop(launcher, None)
    assert launcher.returncode == 1, out + err
    lines = [line for line in err.splitlines() if line.startswith("bunsan run: ")]
    assert f"rank 0 on host {hosts.names[0]} failed first (RuntimeError: boom on rank 0)" in lines[-1], err
    listening = next(line for line in out.splitlines() if line.startswith("rank 0 listens on"))
    addresses = {a.rsplit(":", 1)[0] for a in listening.split()[4:]}
    assert addresses and not addresses & {"0.0.0.0", "::"}, listening  # the store: rank 0's host address only


@pytest.mark.timeout(120)
def test_an_agent_refuses_absurdly_many_workers_for_its_host(hosts, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit('must not run')\n")
    launcher = _bunsan(hosts, tmp_path, "run", "-H", f"{hosts.names[1]}:100000", "--dry-run", str(script))
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err  # a dry run does not ask the hosts
    launcher = _bunsan(hosts, tmp_path, "run", "-H", f"{hosts.names[1]}:100000", str(script))
    try:
        out, err = launcher.communicate(timeout=100)
    finally:
        _stop(launcher, None)
    assert launcher.returncode == 2, out + err
    assert "100000 workers on" in err and "--oversubscribe" in err, err
    assert err.count("\n") <= 3, err
