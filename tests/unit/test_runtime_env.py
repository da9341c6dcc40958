"""Environment detection for every launcher bunsan runs under (pure, no processes)."""

from __future__ import annotations

import pytest

from bunsan.errors import ConfigurationError
from bunsan.runtime import detect_environment, parse_slurm_nodelist, parse_slurm_tasks_per_node


def test_lone_process():
    info = detect_environment({})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("none", 0, 1, 0, 1)


def test_bunsan_run_and_torchrun_variables():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "1234",
        "BUNSAN_LAUNCHER": "bunsan",
        "BUNSAN_JOB_ID": "abc",
    }
    info = detect_environment(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("bunsan", 3, 4, 1, 2)
    assert (info.master_addr, info.master_port, info.job_id) == ("node1", 1234, "abc.0")
    assert detect_environment({**env, "BUNSAN_RESTART": "2"}).job_id == "abc.2"  # a restart: fresh store keys
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "run7",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    info = detect_environment(env)
    assert info.launcher == "torchrun" and info.job_id == "run7.2" and info.local_world_size == 2


def test_torch_variables_without_master_addr_are_refused():
    with pytest.raises(ConfigurationError, match="MASTER_ADDR"):
        detect_environment({"RANK": "0", "WORLD_SIZE": "2"})


def test_openmpi_single_host_uses_loopback_and_job_port():
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_ess_base_jobid": "123456",
    }
    info = detect_environment(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.master_addr) == (
        "openmpi",
        1,
        2,
        1,
        "127.0.0.1",
    )
    assert info.master_port == 15000 + 123456 % 20000
    assert detect_environment({**env, "OMPI_COMM_WORLD_RANK": "0"}).master_port == info.master_port  # same on all ranks


def test_openmpi_multi_host_needs_master_addr_from_environment():
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    assert detect_environment(env).master_addr is None  # init() then asks mpi4py or says what to set
    info = detect_environment({**env, "MASTER_ADDR": "node0", "MASTER_PORT": "4000"})
    assert (info.master_addr, info.master_port) == ("node0", 4000)


def test_mpich_pmi_variables():
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}
    info = detect_environment(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("pmi", 2, 3, 2, 3)
    assert info.master_addr == "127.0.0.1"


def test_slurm_variables_and_master_from_node_list():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
        "SLURM_STEP_NODELIST": "gpu[07-09]",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
    }
    info = detect_environment(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 5, 6, 1, 2)
    assert info.master_addr == "gpu07" and info.master_port == 15000 + 4242 % 20000 and info.job_id == "4242.0"


def test_precedence_torch_variables_win_over_slurm():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "a",
        "MASTER_PORT": "1",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    assert detect_environment(env).launcher == "env"


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,7],cpu5", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("x[001-002],y", ["x001", "x002", "y"]),
    ],
)
def test_parse_slurm_nodelist(nodelist, hosts):
    assert parse_slurm_nodelist(nodelist) == hosts


def test_parse_slurm_tasks_per_node():
    assert parse_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigurationError):
        parse_slurm_tasks_per_node("two")


@pytest.mark.parametrize(
    "env",
    [{"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}],
)
def test_bad_values_are_one_clear_error(env):
    with pytest.raises(ConfigurationError):
        detect_environment(env)
