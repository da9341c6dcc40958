"""Issue 67: elastic jobs under ``bunsan run --min-np`` with the real torchft (its lighthouse and quorum).

Each job runs tests/launch/elastic_job.py on 2 or 3 workers of this machine: a worker SIGKILLs itself in the
middle of a step, and the others must go on, end with equal replicas, and between them train every sample
of every epoch exactly once; with ``--max-restarts`` a new worker joins with a live peer's state; with fewer
workers than ``--min-np`` left, the job ends with one sentence. Every process of a job carries a tag in its
environment, so what a job leaves behind is found in /proc (tests/launch/edges.py).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch import edges

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux only"),
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("torchft") is None, reason="needs torchft: pip install 'bunsan[elastic]'"
    ),
]

JOB = Path(__file__).with_name("elastic_job.py")
SAMPLES, BATCH = 600, 20


@dataclass
class Job:
    code: int
    output: str
    left: list[str]
    finals: list[dict]
    logs: dict[str, list[dict]]

    def launcher_lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("bunsan run: ")]


def run_job(tmp_path: Path, np: int, min_np: int, timeout_s: float = 150, *options: str, **env: str) -> Job:
    tag = uuid.uuid4().hex
    logs = tmp_path / "logs"
    logs.mkdir()
    environment = edges._env(tag, LOG_DIR=str(logs), **env)
    command = [sys.executable, "-m", "bunsan", "run", "-np", str(np), "--min-np", str(min_np), "--oversubscribe"]
    process = subprocess.Popen(
        [*command, *options, sys.executable, str(JOB)],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    left = edges.left_behind(tag, wait_s=8.0)
    edges.kill_tagged(tag)
    finals = [json.loads(p.read_text()) for p in sorted(logs.glob("final-*.json"))]
    steps = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in sorted(logs.glob("*.jsonl"))}
    return Job(process.returncode, output, left, finals, steps)


def assert_every_sample_once(job: Job, workers: int, epochs: int, blocks: bool = False) -> None:
    """Every epoch's committed steps, over every worker that ever ran, train each of its samples once
    (``blocks``: a step is a block of several global batches)."""
    global_batch = BATCH * workers
    per_epoch = (SAMPLES // global_batch) * global_batch + (SAMPLES % global_batch)
    by_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    by_step: dict[int, int] = collections.Counter()
    for records in job.logs.values():
        for record in records:
            by_epoch[record["epoch"]].update(record["ids"])
            by_step[record["step"]] += len(record["ids"])
    assert sorted(by_epoch) == list(range(epochs)), sorted(by_epoch)
    for epoch, counts in by_epoch.items():
        assert set(counts.values()) == {1}, (epoch, [i for i, n in counts.items() if n != 1][:10])
        assert len(counts) == per_epoch, (epoch, len(counts))
    if not blocks:
        assert set(by_step.values()) <= {global_batch, SAMPLES % global_batch}, by_step


def outputs_of(jobs: list, timeout_s: float = 200) -> list[str]:
    """Each job's output once it ends; past ``timeout_s`` every job is killed (the assertions then say why)."""
    try:
        return [job.communicate(timeout=timeout_s)[0] for job in jobs]
    except subprocess.TimeoutExpired:
        for job in jobs:
            job.kill()
        return [job.communicate()[0] for job in jobs]


def assert_restarted_worker_joined(jobs: list, outputs: list[str], logs: Path, tag: str) -> None:
    """Two torchruns, the second's worker killed and restarted: both end 0 and equal, every sample once."""
    assert [job.returncode for job in jobs] == [0, 0], outputs
    assert "joined at step" in outputs[1], outputs[1]
    finals = [json.loads(p.read_text()) for p in sorted(logs.glob("final-*.json"))]
    assert len(finals) == 2 and finals[0]["digest"] == finals[1]["digest"], finals
    steps = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in logs.glob("*.jsonl")}
    assert_every_sample_once(Job(0, "", [], finals, steps), workers=2, epochs=10)
    assert edges.left_behind(tag, wait_s=8.0) == []


@pytest.mark.timeout(200)
def test_two_workers_with_clipping_and_a_grad_scaler_train_what_one_process_trains_on_the_global_batch(tmp_path):
    """The average is in place before backward() returns, so clipping sees the global batch's gradient, and
    GradScaler finds the same infinite average on every worker: all skip that step (the 6th) alike."""
    import torch
    import torch.nn.functional as F

    from tests.launch.elastic_job import data_and_model

    job = run_job(tmp_path, 2, 2, 150, EPOCHS="2", CLIP="0.05", SCALER="1", INF_STEP="5")
    assert job.code == 0, job.output
    data, model = data_and_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y, _ = data.tensors
    batches = 0
    for epoch in range(2):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        for start in range(0, SAMPLES, 2 * BATCH):
            index = order[start : start + 2 * BATCH]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[index]), y[index]) * (float("inf") if batches == 5 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(optimizer)
            scaler.update()
            batches += 1
    assert scaler.get_scale() == 2.0**7  # the one skipped step halved it
    trained = [torch.load(p) for p in sorted((tmp_path / "logs").glob("model-*.pt"))]
    assert len(trained) == 2
    for state in trained:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=2e-6)


@pytest.mark.timeout(200)
def test_rank_0_killed_mid_step_leaves_the_others_training_every_sample_once(tmp_path):
    """Rank 0 included: the rendezvous is the launcher's lighthouse, not rank 0's store."""
    job = run_job(tmp_path, 3, 2, 150, KILL_RANK="0", KILL_STEP="13")
    assert job.code == 0, job.output
    assert (
        "bunsan run: rank 0 was killed by SIGKILL (exit code 137); the other 2 go on (--min-np 2)"
        in job.launcher_lines()
    ), job.output
    assert "[bunsan] step 13 was dropped on every worker" in job.output
    assert "[bunsan] the job goes on with 2 workers (it had 3)" in job.output
    assert len(job.finals) == 2 and job.finals[0]["digest"] == job.finals[1]["digest"], job.finals
    assert {f["steps"] for f in job.finals} == {2 * 10}, job.finals  # 600 samples, global batch 60: 10 an epoch
    assert_every_sample_once(job, workers=3, epochs=2)
    assert job.left == []


@pytest.mark.timeout(200)
def test_a_second_death_while_the_group_is_rebuilt_leaves_the_last_worker_consistent(tmp_path):
    """Item 6: rank 2 dies as soon as rank 1's death drops a step; rank 0 trains on alone, nothing lost."""
    job = run_job(tmp_path, 3, 1, 150, KILL_RANK="1", KILL_STEP="7", KILL_ON_DROP="2")
    assert job.code == 0, job.output
    lines = job.launcher_lines()
    assert any(line.startswith("bunsan run: rank 1 was killed by SIGKILL") for line in lines), job.output
    assert any(line.startswith("bunsan run: rank 2 was killed by SIGKILL") for line in lines), job.output
    assert len(job.finals) == 1 and job.finals[0]["steps"] == 2 * 10, job.finals
    assert_every_sample_once(job, workers=3, epochs=2)
    assert job.left == []


@pytest.mark.timeout(250)
def test_a_restarted_worker_joins_with_a_live_peers_state(tmp_path):
    job = run_job(
        tmp_path, 2, 1, 200, "--max-restarts", "1", KILL_RANK="1", KILL_STEP="3", EPOCHS="10", STEP_SLEEP="0.1"
    )
    assert job.code == 0, job.output
    assert any("a new worker starts in its place" in line for line in job.launcher_lines()), job.output
    assert "joined at step" in job.output, job.output
    assert len(job.finals) == 2, job.output  # the survivor and the worker that joined
    assert job.finals[0]["digest"] == job.finals[1]["digest"], job.finals
    assert {f["steps"] for f in job.finals} == {10 * 15}, job.finals  # global batch 40: 15 steps an epoch
    assert_every_sample_once(job, workers=2, epochs=10)
    assert job.left == []


@pytest.mark.timeout(200)
def test_block_momentum_on_two_workers_trains_what_its_equations_give_on_the_global_batches(tmp_path):
    """BMUF (Chen & Huo 2016) at N = 2 by hand: each worker's SGD on its half of each global batch, a block
    of 4 batches, the epoch's last block 3 (15 batches an epoch), Nesterov's look-ahead, momentum reset."""
    import torch
    import torch.nn.functional as F

    from tests.launch.elastic_job import data_and_model

    job = run_job(tmp_path, 2, 2, 150, EPOCHS="2", ALGORITHM="block_momentum:4")
    assert job.code == 0, job.output
    data, model = data_and_model()
    x, y, _ = data.tensors
    start = [p.detach().clone() for p in model.parameters()]
    global_model, momentum = [s.clone() for s in start], [torch.zeros_like(s) for s in start]
    bm0, rate = 0.5, 2**-0.5  # the defaults at 2 workers: 1 - 1/N and 1/sqrt(N)
    for epoch in range(2):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        batches = [order[i : i + 2 * BATCH] for i in range(0, SAMPLES, 2 * BATCH)]
        for first in range(0, len(batches), 4):
            block, changes = batches[first : first + 4], []
            for half in (0, 1):
                with torch.no_grad():
                    for p, s in zip(model.parameters(), start, strict=True):
                        p.copy_(s)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                for index in block:
                    part = index[half * BATCH : (half + 1) * BATCH]
                    optimizer.zero_grad()
                    F.cross_entropy(model(x[part]), y[part]).backward()
                    optimizer.step()
                changes.append([p.detach() - s for p, s in zip(model.parameters(), start, strict=True)])
            bm = bm0 ** (len(block) / 4)
            for i in range(len(start)):
                momentum[i] = bm * momentum[i] + (1 - bm) * 2 * rate * (changes[0][i] + changes[1][i]) / 2
                global_model[i] = global_model[i] + momentum[i]
                start[i] = global_model[i] + bm0 * momentum[i]
    trained = [torch.load(p) for p in sorted((tmp_path / "logs").glob("model-*.pt"))]
    assert len(trained) == 2
    for state in trained:
        for value, expected in zip(state.values(), start, strict=True):
            torch.testing.assert_close(value, expected, rtol=0, atol=2e-6)
    assert_every_sample_once(job, workers=2, epochs=2, blocks=True)


@pytest.mark.timeout(200)
def test_a_worker_killed_mid_block_leaves_the_others_training_the_block_again(tmp_path):
    """Model averaging in blocks of 3 batches on 3 workers; rank 0 dies at the first batch of the third block."""
    job = run_job(tmp_path, 3, 2, 150, ALGORITHM="model_averaging:3", KILL_RANK="0", KILL_STEP="2")
    assert job.code == 0, job.output
    assert "[bunsan] step 2 was dropped on every worker" in job.output
    assert len(job.finals) == 2 and job.finals[0]["digest"] == job.finals[1]["digest"], job.finals
    assert {f["steps"] for f in job.finals} == {2 * 4}, job.finals  # 10 batches an epoch: blocks of 3, 3, 3, 1
    assert_every_sample_once(job, workers=3, epochs=2, blocks=True)
    assert job.left == []


@pytest.mark.timeout(200)
def test_a_one_bit_job_killed_mid_step_goes_on_with_equal_replicas_and_every_sample_once(tmp_path):
    """Quantized SGD with error feedback and local momentum: the dead worker's residual goes with it."""
    job = run_job(tmp_path, 3, 2, 150, ALGORITHM="bits:1", KILL_RANK="1", KILL_STEP="9")
    assert job.code == 0, job.output
    assert "[bunsan] step 9 was dropped on every worker" in job.output
    assert len(job.finals) == 2 and job.finals[0]["digest"] == job.finals[1]["digest"], job.finals
    assert {f["steps"] for f in job.finals} == {2 * 10}, job.finals
    assert_every_sample_once(job, workers=3, epochs=2)
    assert job.left == []


@pytest.mark.timeout(200)
def test_a_worker_that_dies_while_the_new_group_connects_is_given_up_and_the_job_goes_on(tmp_path):
    """Item 6: rank 1's death makes a new quorum of 0 and 2; rank 2 dies connecting to its group. Rank 0 waits
    for it until the connect timeout, drops the step, and trains on alone."""
    started = time.monotonic()
    job = run_job(
        tmp_path, 3, 1, 150, KILL_RANK="1", KILL_STEP="5", KILL_IN_CONNECT="2", BUNSAN_ELASTIC_CONNECT_TIMEOUT="3"
    )
    assert job.code == 0, job.output
    assert sum("was killed by SIGKILL" in line for line in job.launcher_lines()) == 2, job.output
    assert len(job.finals) == 1 and job.finals[0]["steps"] == 2 * 10, job.finals
    assert_every_sample_once(job, workers=3, epochs=2)
    assert job.left == [] and time.monotonic() - started < 100


@pytest.mark.timeout(120)
def test_a_lost_lighthouse_ends_the_job_in_one_sentence_not_a_hang(tmp_path):
    """No step can commit without the rendezvous: the launcher says so and stops the job at once."""
    import os
    import signal

    tag, logs = uuid.uuid4().hex, tmp_path / "logs"
    logs.mkdir()
    command = [sys.executable, "-m", "bunsan", "run", "-np", "2", "--min-np", "1", "--oversubscribe"]
    job = subprocess.Popen(
        [*command, sys.executable, str(JOB)],
        env=edges._env(tag, LOG_DIR=str(logs), EPOCHS="1000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.stat().st_size for p in logs.glob("*.jsonl")):
        time.sleep(0.1)  # a step has committed
    lighthouses = [
        pid for pid in edges.tagged(tag) if b"elastic/lighthouse.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(lighthouses) == 1
    os.kill(lighthouses[0], signal.SIGKILL)
    killed = time.monotonic()
    output = outputs_of([job], timeout_s=60)[0]
    assert job.returncode == 137, output
    assert (
        "bunsan run: the lighthouse (the job's rendezvous) was killed by SIGKILL (exit code 137); no step can commit "
        "without it: stopping the job" in output
    ), output
    assert time.monotonic() - killed < 15
    assert edges.left_behind(tag, wait_s=8.0) == []


@pytest.mark.timeout(200)
def test_fewer_workers_than_min_np_end_the_job_in_one_sentence(tmp_path):
    started = time.monotonic()
    job = run_job(tmp_path, 2, 2, 150, KILL_RANK="1", KILL_STEP="3", EPOCHS="1000")
    assert job.code == 137, job.output
    assert (
        "bunsan run: rank 1 was killed by SIGKILL (exit code 137), and 1 worker(s) are left, fewer than --min-np 2; "
        "stopping the job" in job.launcher_lines()
    ), job.output
    assert time.monotonic() - started < 120
    assert job.finals == []
    assert job.left == []


@pytest.mark.slow
@pytest.mark.timeout(250)
def test_under_torchrun_one_torchrun_per_worker_restarts_the_lost_one_and_it_joins(tmp_path):
    """torchrun's --max-restarts starts the lost worker again; the lighthouse is started by hand, as documented.

    Slow (``pytest -m slow``): the two-host test below runs the same path in every root run of the suite."""
    tag = uuid.uuid4().hex
    logs = tmp_path / "logs"
    logs.mkdir()
    base = edges._env(tag, LOG_DIR=str(logs), BUNSAN_ELASTIC_NP="2", BUNSAN_ELASTIC_MIN_NP="1", EPOCHS="10")
    base["STEP_SLEEP"] = "0.1"
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "bunsan.elastic.lighthouse", "--min-np", "1"],
        env=base,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        base["BUNSAN_ELASTIC_LIGHTHOUSE"] = lighthouse.stdout.readline().strip()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
        jobs = [
            subprocess.Popen(
                [*torchrun, "--max-restarts", "1", str(JOB)],
                env={**base, **extra},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for extra in ({}, {"KILL_RANK": "0", "KILL_STEP": "3"})
        ]
        outputs = outputs_of(jobs)
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    assert_restarted_worker_joined(jobs, outputs, logs, tag)


@pytest.mark.timeout(300)
def test_between_two_hosts_the_lost_worker_is_restarted_by_its_torchrun_and_joins(tmp_path):
    """Two network namespaces with their own host names (real hosts' names resolve to their addresses,
    which torchft's checkpoint server and Gloo rely on); the lighthouse runs in the launcher's namespace."""
    import shutil

    from tests.helpers.hosts import SUBNET, HostsUnavailable, start_hosts

    try:
        hosts = start_hosts(tmp_path / "ssh", count=2)
    except HostsUnavailable as err:
        pytest.skip(f"no test hosts: {err}")
    etc = [Path("/etc/netns") / ns for ns in hosts.namespaces]
    made_etc = not Path("/etc/netns").exists()
    try:
        if hosts.mode != "netns":
            pytest.skip("needs network namespaces (root)")
        names = "".join(f"{SUBNET}.{11 + i} elastic-h{i + 1}\n" for i in range(2))
        for folder in etc:  # `ip netns exec` shows /etc/netns/<ns>/hosts as the namespace's /etc/hosts
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        tag, logs = uuid.uuid4().hex, tmp_path / "logs"
        logs.mkdir()
        base = edges._env(tag, LOG_DIR=str(logs), BUNSAN_ELASTIC_NP="2", BUNSAN_ELASTIC_MIN_NP="1", EPOCHS="10")
        base["STEP_SLEEP"] = "0.1"
        lighthouse = subprocess.Popen(
            hosts.launcher(
                [sys.executable, "-m", "bunsan.elastic.lighthouse", "--min-np", "1", "--bind", f"{SUBNET}.1:0"]
            ),
            env=base,
            stdout=subprocess.PIPE,
            text=True,
        )
        base["BUNSAN_ELASTIC_LIGHTHOUSE"] = lighthouse.stdout.readline().strip()
        torchrun = f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 1 --max-restarts 1 {JOB}"
        jobs = []
        for i, (ns, extra) in enumerate(zip(hosts.namespaces, ({}, {"KILL_RANK": "0", "KILL_STEP": "3"}), strict=True)):
            env = {**base, **extra, "BUNSAN_ELASTIC_HOST": f"{SUBNET}.{11 + i}"}
            command = [
                "ip",
                "netns",
                "exec",
                ns,
                "unshare",
                "--uts",
                "sh",
                "-c",
                f"hostname elastic-h{i + 1}; exec {torchrun}",
            ]
            jobs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = outputs_of(jobs)
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
        assert_restarted_worker_joined(jobs, outputs, logs, tag)
    finally:
        hosts.close()
        for folder in etc:
            shutil.rmtree(folder, ignore_errors=True)
        if made_etc:
            shutil.rmtree("/etc/netns", ignore_errors=True)


@pytest.mark.timeout(200)
def test_the_group_grows_onto_the_slot_a_discovery_script_adds_and_the_new_worker_trains_in_step(tmp_path):
    """-np 2 --max-np 3: once the job trains, the script's output says garbage, then localhost:3; the third
    worker joins with a live peer's model, optimizer and loader state, and the job ends with three equal
    replicas, every sample once per epoch (the global batch stays 2 x 20), nothing left behind."""
    import threading

    pool = tmp_path / "pool"
    pool.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {pool}\n")
    script.chmod(0o755)

    def rewrite() -> None:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not any(p.stat().st_size for p in tmp_path.glob("logs/*.jsonl")):
            time.sleep(0.1)
        pool.write_text("not a host!\n")
        time.sleep(2.5)
        pool.write_text("localhost:3\n")

    threading.Thread(target=rewrite, daemon=True).start()
    options = ("--max-np", "3", "--host-discovery-script", str(script))
    job = run_job(tmp_path, 2, 1, 150, *options, EPOCHS="4", GROW_TO="3", GROW_AT="3")
    assert job.code == 0, job.output
    lines = job.launcher_lines()
    assert "bunsan run: the group grows: rank 2 starts on localhost (3 running, --max-np 3)" in lines, job.output
    assert any("printed 'not a host!' on line 1" in line and "goes on with the hosts it has" in line for line in lines)
    assert "[bunsan] the job goes on with 3 workers (it had 2)" in job.output, job.output
    assert "-2-0 joined at step" in job.output, job.output
    assert len(job.finals) == 3 and len({f["digest"] for f in job.finals}) == 1, job.finals
    assert {f["steps"] for f in job.finals} == {4 * 15}, job.finals  # global batch 40: 15 steps an epoch
    assert_every_sample_once(job, workers=2, epochs=4)
    assert job.left == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_between_two_hosts_over_ssh_the_group_grows_onto_the_host_the_script_adds(tmp_path):
    """The launcher in a namespace of its own, the workers on two hosts with sshd (tests/helpers/hosts.py):
    -np 1 --max-np 2 on host 1, then the discovery script adds host 2, whose worker starts over ssh and heals
    from host 1's. ``--remote-python`` gives each host its own host name (torchft's state transfer names the
    host it serves from; the hosts' /etc/hosts resolve them). Slow (``pytest -m slow``): about a minute."""
    import threading

    from tests.helpers.hosts import HostsUnavailable, start_hosts

    try:
        hosts = start_hosts(tmp_path / "ssh", count=2)
    except HostsUnavailable as err:
        pytest.skip(f"no test hosts: {err}")
    try:
        if hosts.mode != "netns":
            pytest.skip("needs network namespaces (root)")
        python = tmp_path / "python.sh"
        python.write_text(
            "#!/bin/sh\n"
            "addr=$(ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)\n"
            "name=$(getent hosts \"$addr\" | awk '{print $2}')\n"
            f"export PYTHONPATH={JOB.parents[2]}\n"
            f'exec unshare --uts sh -c \'hostname "$0" && exec "$@"\' "$name" {sys.executable} "$@"\n'
        )
        python.chmod(0o755)
        pool = tmp_path / "pool"
        pool.write_text(f"{hosts.names[0]}:1\n")
        script = tmp_path / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {pool}\n")
        script.chmod(0o755)
        tag, logs = uuid.uuid4().hex, tmp_path / "logs"
        logs.mkdir()

        def add_host() -> None:
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline and not any(p.stat().st_size for p in logs.glob("*.jsonl")):
                time.sleep(0.1)
            pool.write_text(f"{hosts.names[0]}:1\n{hosts.names[1]}:1\n")

        threading.Thread(target=add_host, daemon=True).start()
        exports = [
            f"-x{name}={value}" for name, value in dict(LOG_DIR=str(logs), EPOCHS="4", GROW_TO="2", GROW_AT="3").items()
        ]
        command = [sys.executable, "-m", "bunsan", "run", *hosts.ssh_args(), "-np", "1", "--min-np", "1"]
        command += ["--max-np", "2", "--host-discovery-script", str(script), "--remote-python", str(python)]
        process = subprocess.Popen(
            hosts.launcher([*command, *exports, f"-xEDGE_TAG={tag}", str(JOB)]),
            cwd=tmp_path,
            env=edges._env(tag),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = outputs_of([process], timeout_s=250)[0]
        left = edges.left_behind(tag, wait_s=8.0)
        finals = [json.loads(p.read_text()) for p in sorted(logs.glob("final-*.json"))]
        steps = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in logs.glob("*.jsonl")}
    finally:
        hosts.close()
    assert process.returncode == 0, output
    assert f"bunsan run: the group grows: rank 1 starts on {hosts.names[1]} (2 running, --max-np 2)" in output
    assert "-1-0 joined at step" in output, output
    assert len(finals) == 2 and finals[0]["digest"] == finals[1]["digest"], (finals, output)
    assert_every_sample_once(Job(0, "", [], finals, steps), workers=1, epochs=4)
    assert left == []
