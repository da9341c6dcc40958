"""What a script ported from torch's DataLoader, DistributedSampler or Horovod expects, single process."""

from __future__ import annotations

import copy
import logging
import os
import pickle
import platform
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import bunsan
from bunsan.data import Partition, loader


def _dataset(n: int = 23) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


# ---------------------------------------------------------------- bunsan.data.loader reads like a DataLoader


def test_loader_has_the_dataloader_attributes_a_script_reads():
    data = _dataset(23)
    train = loader(data, batch_size=4, rank=1, world_size=2, num_workers=0, pin_memory=False)
    assert train.dataset is data and len(train.dataset) == 23  # pytorch/examples: len(train_loader.dataset)
    assert train.batch_size == 4
    assert train.sampler is train.partition and isinstance(train.sampler, Partition)
    assert len(train) == 3  # ceil(12 / 4): shard of ceil(23 / 2) = 12
    assert train.num_workers == 0 and train.pin_memory is False and train.timeout == 0
    assert train.collate_fn is train.dataloader.collate_fn
    assert train.drop_last is False
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        train.nonsense  # noqa: B018


def test_loader_survives_copy_and_pickle():
    train = loader(_dataset(10), batch_size=2, rank=0, world_size=1)
    for clone in (copy.deepcopy(train), pickle.loads(pickle.dumps(train))):
        assert len(clone.dataset) == 10 and clone.num_workers == 0
        assert [len(x) for x, _ in clone] == [2] * 5


# ---------------------------------------------------------------- Partition in place of DistributedSampler


def test_partition_as_the_sampler_of_a_plain_dataloader_covers_the_data_once_per_epoch():
    data = TensorDataset(torch.arange(20))
    seen = {}
    for epoch in (0, 1):
        indices = []
        for rank in range(2):
            sampler = Partition(data, num_replicas=2, rank=rank, shuffle=True, seed=5)
            sampler.set_epoch(epoch)
            plain = DataLoader(data, batch_size=3, sampler=sampler)
            got = [int(i) for (batch,) in plain for i in batch]
            assert len(got) == len(sampler) == sampler.shard_size == 10
            indices.append(got)
        assert sorted(indices[0] + indices[1]) == list(range(20))
        seen[epoch] = indices[0]
    assert seen[0] != seen[1]  # set_epoch reshuffles


def test_partition_has_distributed_sampler_attributes():
    data = _dataset(23)
    sampler = Partition(data, rank=2, num_replicas=4, drop_last=False)
    reference = torch.utils.data.DistributedSampler(data, num_replicas=4, rank=2, drop_last=False)
    assert sampler.num_replicas == reference.num_replicas == 4
    assert sampler.total_size == reference.total_size == 24
    assert sampler.shard_size == reference.num_samples == len(sampler) == len(reference)
    assert sampler.dataset is data
    assert Partition(10, rank=0, world_size=2).dataset is None
    with pytest.raises(ValueError, match="disagree"):
        Partition(data, rank=0, world_size=2, num_replicas=4)


# ---------------------------------------------------------------- bunsan.print, rank_zero_only, RankFilter


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    # Before init, the rank comes from the launcher's variables.
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def test_print_only_on_rank_zero(monkeypatch, capsys):
    bunsan.print("from rank 0", end="!\n")
    assert capsys.readouterr().out == "from rank 0!\n"
    _as_rank(monkeypatch, 1)
    bunsan.print("from rank 1")
    assert capsys.readouterr().out == ""
    bunsan.print("everyone", rank=None)
    bunsan.print("rank one", rank=1)
    assert capsys.readouterr().out == "everyone\nrank one\n"
    with pytest.raises(TypeError, match="rank must be an int"):
        bunsan.print("x", rank="0")


def test_print_is_not_star_exported():
    namespace: dict = {}
    exec("from bunsan import *", namespace)
    assert "print" not in namespace and "evaluate" in namespace


def test_rank_zero_only(monkeypatch):
    @bunsan.rank_zero_only
    def answer(x):
        return x + 1

    assert answer(1) == 2
    _as_rank(monkeypatch, 1)
    assert answer(1) is None
    with pytest.raises(TypeError):
        bunsan.rank_zero_only(3)


def test_rank_filter(monkeypatch):
    def record(level):
        return logging.LogRecord("x", level, __file__, 1, "message", None, None)

    only_zero, strict, everyone = bunsan.RankFilter(), bunsan.RankFilter(min_level=None), bunsan.RankFilter(ranks=None)
    info = record(logging.INFO)
    assert only_zero.filter(info) and info.rank == 0
    _as_rank(monkeypatch, 1)
    info, warning = record(logging.INFO), record(logging.WARNING)
    assert not only_zero.filter(info) and info.rank == 1
    assert only_zero.filter(warning)  # warnings of every rank pass by default
    assert not strict.filter(record(logging.WARNING))
    assert everyone.filter(record(logging.INFO))
    assert bunsan.RankFilter(ranks=[1]).filter(record(logging.INFO))
    with pytest.raises(ValueError, match="ranks"):
        bunsan.RankFilter(ranks=[-1])
    with pytest.raises(TypeError, match="ranks"):
        bunsan.RankFilter(ranks="0")


# ---------------------------------------------------------------- evaluate and all_reduce_metrics, one process


def test_evaluate_equals_the_sums_computed_by_hand():
    torch.manual_seed(0)
    data = _dataset(23)
    model = torch.nn.Linear(4, 3)
    x, y = data.tensors
    with torch.no_grad():
        out = model(x)
    expected_loss = float(F.cross_entropy(out, y))
    expected_accuracy = float((out.argmax(1) == y).double().mean())
    model.train()
    for source in (data, (x, y), DataLoader(data, batch_size=5), loader(data, batch_size=5)):
        result = bunsan.evaluate(model, source, loss_fn=F.cross_entropy)
        assert result["samples"] == 23
        assert result["loss"] == pytest.approx(expected_loss, rel=1e-6)
        assert result["accuracy"] == pytest.approx(expected_accuracy, abs=1e-12)
    assert model.training  # put back in its mode
    errors = bunsan.evaluate(model, data, ["error"], batch_size=7)
    assert set(errors) == {"error", "samples"} and errors["error"] == pytest.approx(1 - expected_accuracy)
    custom = bunsan.evaluate(model, data, {"top": lambda o, t: (o.argmax(1) == t).float()})
    assert custom["top"] == pytest.approx(expected_accuracy)


def test_evaluate_refuses_bad_input():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="unknown metric"):
        bunsan.evaluate(model, _dataset(), ["precision"])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        bunsan.evaluate("model", _dataset())
    with pytest.raises(ValueError, match="batch_size"):
        bunsan.evaluate(model, _dataset(), batch_size=0)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        bunsan.evaluate(model, _dataset(), batch_size=2.0)


def test_all_reduce_metrics_alone_returns_floats():
    assert bunsan.all_reduce_metrics({"loss": torch.tensor(2.5), "correct": 7}) == {"correct": 7.0, "loss": 2.5}
    with pytest.raises(TypeError, match="must be a number"):
        bunsan.all_reduce_metrics({"loss": "2.5"})
    with pytest.raises(ValueError, match="one number per name"):
        bunsan.all_reduce_metrics({"loss": torch.ones(2)})
    with pytest.raises(TypeError, match="mapping"):
        bunsan.all_reduce_metrics([1.0])


# ---------------------------------------------------------------- Horovod's broadcasts, one process


def test_broadcasts_alone_change_nothing_and_check_their_input():
    model = torch.nn.Linear(3, 2)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for params in (model, model.state_dict(), model.named_parameters(), model.parameters()):
        bunsan.broadcast_parameters(params, root_rank=0)
    bunsan.broadcast_optimizer_state(optimizer, root_rank=0)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    with pytest.raises(TypeError, match="params must"):
        bunsan.broadcast_parameters(3)
    with pytest.raises(ValueError, match="root_rank"):
        bunsan.broadcast_parameters(model, root_rank=1)
    with pytest.raises(TypeError, match="optimizer"):
        bunsan.broadcast_optimizer_state(model)


# ---------------------------------------------------------------- intra-op threads of a lone process


_THREADS_SCRIPT = """
import os, torch, bunsan
from bunsan import _allocator
torch.set_num_threads(3)
bunsan.init()                      # a lone `python script.py`
lone, lone_malloc = torch.get_num_threads(), _allocator.tuned()
bunsan.finalize()
os.environ.update(RANK="0", WORLD_SIZE="1", BUNSAN_LAUNCHER="bunsan")
bunsan.init()                      # what `bunsan run -np 1` sets
print(lone, torch.get_num_threads(), lone_malloc, _allocator.tuned())
bunsan.finalize()
"""


def test_a_lone_process_keeps_its_threads_and_bunsan_run_sets_one():
    # One subprocess for both cases: a fresh interpreter costs seconds here.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "BUNSAN_LAUNCHER", "MASTER_ADDR")
    }
    out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # malloc's thresholds are fixed for the job's workers only, as the threads (glibc on Linux)
    tuned = str(sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")
    assert out.stdout.split()[-4:] == ["3", "1", "False", tuned]


def test_malloc_tuning_can_be_turned_off():
    script = "from bunsan import _allocator; print(_allocator.tune(), _allocator.tune(), _allocator.tuned())"
    env = {**os.environ, "BUNSAN_MALLOC_TUNING": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]


_OWN_GROUP_SCRIPT = """
import torch, torch.distributed as dist, bunsan
from bunsan import _allocator
dist.init_process_group("gloo")    # torchrun's variables, the script's own group (a ported DDP script)
before = _allocator.tuned()
if ADOPT:
    bunsan.init()                  # adopts the script's group
    before = (before, _allocator.tuned())
model = torch.nn.Linear(4, 2)
bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
print(before, _allocator.tuned())
dist.barrier()                     # neither rank tears its group down while the other still uses it
dist.destroy_process_group()
# What is tested ends above. Interpreter teardown once aborted in CI after both lines were printed
# ("terminate called without an active exception", SIGABRT; Gloo work objects destroyed during
# finalization do that, pytorch/pytorch#179291); whether anything bunsan keeps alive takes part is
# open (the closing note of 2026-11-28), so the exit here skips finalization.
import os, sys; sys.stdout.flush(); os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("adopt", [False, True], ids=["distribute", "init-then-distribute"])
def test_distribute_tunes_malloc_in_a_group_the_script_made(adopt):
    # Two workers whose group torch.distributed made, as under torchrun: bunsan.init() never ran (or
    # adopted that group), and the workers still keep freed memory for the next step (without it:
    # 4,000-8,800 page faults a ResNet-20 step at 2 workers).
    base = {k: v for k, v in os.environ.items() if k not in ("BUNSAN_LAUNCHER", "BUNSAN_MALLOC_TUNING")}
    tuned = str(sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")
    expected = f"(False, {tuned}) {tuned}" if adopt else f"False {tuned}"
    assert _two_workers(f"ADOPT = {adopt}\n" + _OWN_GROUP_SCRIPT, base) == [expected, expected]


_SHARED_CORES_SCRIPT = """
import os, warnings, torch, torch.distributed as dist, bunsan
from bunsan import runtime
dist.init_process_group("gloo")    # the script's own group, as under mp.spawn
before = torch.get_num_threads()
model = torch.nn.Linear(4, 2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
warned = [str(w.message) for w in caught if "intra-op threads" in str(w.message)]
print(before, torch.get_num_threads(), runtime._usable_cores(), len(warned), repr(warned[0] if warned else ""))
dist.barrier()                     # neither rank tears its group down while the other still uses it
dist.destroy_process_group()
# What is tested ends above. Interpreter teardown once aborted in CI after both lines were printed
# ("terminate called without an active exception", SIGABRT; Gloo work objects destroyed during
# finalization do that, pytorch/pytorch#179291); whether anything bunsan keeps alive takes part is
# open (the closing note of 2026-11-28), so the exit here skips finalization.
import os, sys; sys.stdout.flush(); os._exit(0)
"""


def _two_workers(script: str, env: dict[str, str]) -> list[str]:
    """Run ``script`` as ranks 0 and 1 of a Gloo group it makes itself; each one's last line."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return [out.strip().splitlines()[-1] for out, _ in outs]


@pytest.mark.parametrize("omp", [None, "cores"], ids=["threads-unset", "OMP_NUM_THREADS-set"])
def test_workers_of_a_scripts_own_group_share_the_hosts_cores(omp):
    # Two workers on one host whose group the script made (mp.spawn style): torch's default threads
    # each would oversubscribe the cores; distribute() gives each its share and says so once. With
    # OMP_NUM_THREADS set the threads are the user's: the warning only.
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "BUNSAN_LAUNCHER")}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if omp == "cores":
        base["OMP_NUM_THREADS"] = str(cores)
    lines = [line.split(" ", 4) for line in _two_workers(_SHARED_CORES_SCRIPT, base)]
    for rank, (before, after, seen_cores, warned, message) in enumerate(lines):
        before, after, seen_cores, warned = int(before), int(after), int(seen_cores), int(warned)
        oversubscribed = before > 1 and 2 * before > seen_cores
        expected = max(1, seen_cores // 2) if oversubscribed and omp is None else before
        assert after == expected
        assert warned == (1 if oversubscribed and rank == 0 else 0)  # once, on the host's lowest rank
        if warned:
            assert ("each now runs" in message) == (omp is None), message
