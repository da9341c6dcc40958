"""Where the tensors of bunsan's own small collectives live, and the error when one is on the wrong device."""

from __future__ import annotations

import torch

from bunsan import comm
from bunsan.algorithms.measure import median_time, synchronize
from bunsan.comm import collectives


def test_without_a_process_group_tensors_live_on_the_cpu():
    assert comm.tensor_device() == torch.device("cpu")


def test_nccl_groups_get_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(collectives, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.tensor_device() == torch.device("cuda", 3)
    monkeypatch.setattr(collectives, "get_backend", lambda group=None: "gloo")
    assert collectives.tensor_device() == torch.device("cpu")


def test_a_tensor_on_the_wrong_device_is_named_as_such_not_as_a_dead_peer():
    # what NCCL's process group raised on one H200 for a CPU tensor (docs/experiments/gpu_check.py at f879e08)
    error = collectives._communication_error(
        "all_reduce", 350, RuntimeError("No backend type associated with device type cpu")
    )
    text = str(error)
    assert "another rank died" not in text
    assert "NCCL moves only CUDA tensors" in text and "bunsan.comm.tensor_device(group)" in text
    assert text.endswith("Backend said: No backend type associated with device type cpu")


def test_synchronize_waits_only_for_a_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    synchronize(None)
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    assert calls == []
    synchronize("cuda:1")
    assert calls == ["cuda:1"]
    # a timing on a CUDA device waits before it starts and after each call
    calls.clear()
    median_time(lambda: None, 3, "cuda:0")
    assert calls == ["cuda:0"] * 4


def test_a_group_of_one_exchanges_nothing_and_never_calls_the_backend(monkeypatch):
    # a lone process on a GPU machine runs on NCCL, which refuses a CPU tensor even alone: in a world of
    # one an all-reduce or a broadcast is already its own result, and the backend is never asked
    def no_backend(*args, **kwargs):
        raise AssertionError("a group of one called its backend")

    monkeypatch.setattr(collectives, "_call", no_backend)
    traffic = comm.Traffic()
    x = torch.arange(4.0)
    assert comm.all_reduce(x, traffic=traffic) is None
    assert comm.all_reduce(x, op="max", async_op=True) is None  # no work handle; comm.wait(None) returns
    comm.wait(None)
    comm.broadcast_tensors([x, torch.ones(2, dtype=torch.int64)], traffic=traffic)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (traffic.sent, traffic.received) == (0, 0)
