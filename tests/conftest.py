"""Shared fixtures: a warm gloo worker pool per test module, and hygiene checks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.workers import WorkerPool

# The test process itself runs small single-process checks: one thread, as the workers.
torch.set_num_threads(1)

# This suite tests the Gloo path, also on a machine with a GPU, where bunsan's default backend is
# NCCL: its own processes and every job it starts inherit the variable. NCCL needs a GPU per rank
# (it refuses two ranks on one GPU); the tests marked gpu (`pytest -m gpu`) name NCCL themselves.
# On one H200 without this, 27 of the suite's tests failed on NCCL: jobs of 2 ranks on its one GPU,
# and single-process tests that expect the Gloo world of a CPU machine (docs/experiments/plan.md, "On a GPU").
os.environ.setdefault("BUNSAN_BACKEND", "gloo")


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory):
    """Two gloo ranks shared by every test in one module: seconds to start, ms per test."""
    pool = WorkerPool(tmp_path_factory.mktemp("rendezvous"), world_size=2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def workers4(tmp_path_factory: pytest.TempPathFactory):
    """Four gloo ranks, for the few tests whose claim is about scaling past two."""
    pool = WorkerPool(tmp_path_factory.mktemp("rendezvous4"), world_size=4)
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def no_process_group_left():
    """In-process tests must not leave a process group for the next test."""
    yield
    from bunsan import runtime

    if runtime.is_initialized():
        runtime.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()


# Variables that pytest, torch or Lightning set themselves (torch sets the inductor cache directory
# the first time an optimizer is built; `import lightning` sets PYTORCH_NVML_BASED_CUDA_CHECK;
# OpenMP runtimes set KMP_*).
_SET_BY_OTHERS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"}


@pytest.fixture(autouse=True)
def no_leaked_environment():
    """Fail a test that leaves new or changed environment variables behind."""
    before = dict(os.environ)
    yield
    changed = sorted(
        k
        for k in os.environ.keys() | before.keys()
        if os.environ.get(k) != before.get(k) and k not in _SET_BY_OTHERS and not k.startswith("KMP_")
    )
    os.environ.clear()
    os.environ.update(before)
    assert not changed, f"test leaked environment variables: {changed}"
