"""The tables behind docs/reference/: what each environment variable means, and each algorithm page's example.

Kept apart from tools/gen_reference.py, which renders them; tests/unit/test_reference_docs.py checks
:data:`ENVIRONMENT` against the code in both directions.
"""

from __future__ import annotations

from typing import Any

# Each entry: "modules that read it | default | meaning". The test fails when bunsan/ mentions a BUNSAN_* name
# that neither this table nor the options' fallbacks have, when this table lists one bunsan/ no longer mentions,
# or when a module listed does not mention its name.
ENVIRONMENT: dict[str, str] = {
    "BUNSAN_BACKEND": "bunsan.comm.group | nccl where a CUDA device is visible, else gloo | process-group backend of `bunsan.init()` when its `backend` argument is not given",
    "BUNSAN_CACHE_DIR": "bunsan.compression.native, bunsan.datasets.bundled | ~/.cache/bunsan | where the compiled C codec and the generated MNIST-1D data set (`bunsan.datasets.mnist1d(cache_dir=...)` wins) are kept",
    "BUNSAN_CODEC_CALLS": "bunsan.algorithms.data_parallel.stripes | bucket on a GPU, segment on CPU | `bucket` or `segment`: the quantized exchange codes a bucket in one call per phase, or one call per segment; another value raises",
    "BUNSAN_CODEC_GRAPHS": "bunsan.algorithms.data_parallel.graphs | on, on a CUDA device | `0` turns off the capture of the quantized exchange's codec calls as CUDA graphs; `1` keeps it on where it applies (a CUDA device); another value raises",
    "BUNSAN_ELASTIC_DEBUG": "bunsan.elastic.member | | `1` keeps torchft's own logs (every quorum, every failure's traceback) in an elastic job; otherwise bunsan prints one line per event",
    "BUNSAN_ELASTIC_DIR": "bunsan.elastic.member, bunsan.launch.elastic | | set by `bunsan run --min-np`: where a worker marks that it has joined a quorum, so that one that has not joined when the job ends is stopped",
    "BUNSAN_ELASTIC_HOST": "bunsan.elastic.member | 127.0.0.1 | the address an elastic worker's store and quorum server listen on and advertise",
    "BUNSAN_ELASTIC_LIGHTHOUSE": "bunsan.elastic.member, bunsan.launch.elastic, bunsan.runtime | | set by `bunsan run --min-np`: the address of the job's lighthouse; `bunsan.init()` then joins the elastic job instead of creating a fixed group",
    "BUNSAN_ELASTIC_MIN_NP": "bunsan.elastic.member, bunsan.launch.elastic | | set by `bunsan run --min-np`: a step commits only with at least this many workers",
    "BUNSAN_ELASTIC_NP": "bunsan.elastic.member, bunsan.launch.elastic | | set by `bunsan run --min-np`: the job's starting size, which fixes the global batch (`batch_size` times it)",
    "BUNSAN_ELASTIC_REPLICA": "bunsan.elastic.member, bunsan.launch.elastic | | set by `bunsan run --min-np`: the worker's name in the quorum, new for every start of a slot",
    "BUNSAN_ELASTIC_CONNECT_TIMEOUT": "bunsan.elastic.member | 15 | seconds a worker of an elastic job waits for every member of a new quorum to connect; a member that died after the quorum formed is then given up, and the next quorum goes on without it",
    "BUNSAN_ELASTIC_TRACE": "bunsan.elastic.member | | a folder: each worker of an elastic job appends a line per step to `<its name>.trace` there (the time, the steps committed, whether this one committed, the members); for measuring recovery",
    "BUNSAN_HOSTFILE": "bunsan.bench._common | | the benchmarks remove it from their jobs' environment: their own `-np` decides",
    "BUNSAN_HOSTS": "bunsan.bench._common | | the benchmarks remove it from their jobs' environment: their own `-np` decides",
    "BUNSAN_HOST_JOB_ID": "bunsan.launch.plan, bunsan.launch.proctree, bunsan.launch.remote | | `<job id>.h<group rank>`, set by a remote host's agent for that host's workers: the agent ends only its own host's share of the job",
    "BUNSAN_JOB_ID": "bunsan.environment, bunsan.launch.proctree, bunsan.launch.cleanup | | the job's id (`--job-id`), carried by every process of the job: `bunsan run` and `bunsan run --cleanup` find the job's processes by it, and `bunsan.init()` keys the job's store by it",
    "BUNSAN_LAUNCHER": "bunsan.environment | | the launcher's name: `bunsan` under `bunsan run`, where `bunsan.init()` gives a CPU worker one intra-op thread even in a job of one and leaves ending the worker's processes to the launcher (`bunsan-netns` in the jobs of a benchmark's `--network`)",
    "BUNSAN_MALLOC_TUNING": "bunsan._allocator | 1 | `0` leaves glibc malloc alone; otherwise `bunsan.init()` and `bunsan.distribute()` fix the mmap and trim thresholds of CPU workers, so that memory a step frees stays in the process for the next one (Linux with glibc only)",
    "BUNSAN_NATIVE": "bunsan.compression.native | 1 | `0`: the quantization codec uses torch operations instead of compiling its C source",
    "BUNSAN_NPROC": "bunsan.bench._common | | the benchmarks remove it from their jobs' environment: their own `-np` decides",
    "BUNSAN_REPORT_FD": "bunsan.launch.plan, bunsan.comm.group | | the workers' end of the launcher's report pipe: a failing rank writes there, in one line, why it exits",
    "BUNSAN_RESTART": "bunsan.environment | 0 | the attempt: 0, then 1, 2, ... after each restart (`--max-restarts`); a script may read it, and `bunsan.init()` keys the store of each attempt by it",
    "BUNSAN_STALL_S": "bunsan.comm.group | 60 | seconds in one collective after which the lowest waiting rank prints which ranks have not reached it and what each is doing (`bunsan.init(stall_s=...)` wins)",
    "BUNSAN_TIMEOUT": "bunsan.comm.group, bunsan.launch.doctor | 300 | seconds a collective may wait before it fails (`bunsan.init(timeout_s=...)` wins); `bunsan doctor` passes it on to its all-reduce job",
    "BUNSAN_TREE": "bunsan.launch.treewatch | | set by `bunsan.init()` in a worker: every process the worker starts carries it, so that the worker's janitor ends them when the worker ends, under any launcher",
}
INTERNAL = frozenset(
    [
        "BUNSAN_ELASTIC_DIR",
        "BUNSAN_ELASTIC_LIGHTHOUSE",
        "BUNSAN_ELASTIC_MIN_NP",
        "BUNSAN_ELASTIC_NP",
        "BUNSAN_ELASTIC_REPLICA",
        "BUNSAN_HOST_JOB_ID",
        "BUNSAN_JOB_ID",
        "BUNSAN_LAUNCHER",
        "BUNSAN_REPORT_FD",
        "BUNSAN_RESTART",
        "BUNSAN_TREE",
    ]
)
STANDARD: dict[str, str] = {
    "CC": "bunsan.compression.native | cc | the C compiler that builds the quantization codec, once per machine",
    "GLOO_SOCKET_IFNAME": "bunsan.comm.rendezvous, bunsan.launch.remote | | left as set; otherwise set to the loopback interface when `MASTER_ADDR` is a loopback address, and by a remote host's agent to the interface that reaches `MASTER_ADDR`",
    "GROUP_RANK": "bunsan.launch.plan | | the worker's host index, set by `bunsan run` (torchrun's convention); bunsan does not read it",
    "LOCAL_RANK": "bunsan.environment | RANK | this worker's rank on its host; `bunsan run` and torchrun set it",
    "LOCAL_WORLD_SIZE": "bunsan.environment | WORLD_SIZE | workers on this host; `bunsan run` and torchrun set it",
    "MASTER_ADDR": "bunsan.environment, bunsan.runtime | 127.0.0.1 on one host | rank 0's address for the rendezvous; required with `RANK` and `WORLD_SIZE` above one worker; under MPI taken when set, else 127.0.0.1 when all ranks share a host, else rank 0's host name broadcast with mpi4py; under Slurm the first node of the step",
    "MASTER_PORT": "bunsan.environment | 29500 | rendezvous port; under Slurm and OpenMPI without it, a port derived from the launcher's job id, the same on every rank",
    "MKL_NUM_THREADS": "bunsan.bench._common | | set to `--threads` by the benchmarks for their jobs, as `OMP_NUM_THREADS`",
    "MPI_LOCALNRANKS": "bunsan.environment | PMI_SIZE | workers on this host, under MPICH/PMI",
    "MPI_LOCALRANKID": "bunsan.environment | 0 | this worker's rank on its host, under MPICH/PMI",
    "OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}": "bunsan.environment | | rank, size, local rank and local size under OpenMPI's mpirun (the local size defaults to the size, the local rank to 0)",
    "OMPI_MCA_ess_base_jobid": "bunsan.environment | | OpenMPI's job id (`OMPI_MCA_orte_ess_jobid` and `PMIX_NAMESPACE` are read too): keys the store and derives `MASTER_PORT`",
    "OMP_NUM_THREADS": "bunsan.runtime, bunsan.launch.plan, bunsan.bench._common | 1 per worker | intra-op threads: `bunsan run` sets 1 for its workers unless it is set; when it is not set, `bunsan.init()` gives a CPU worker of a job of several (or of `bunsan run`) one thread, and `bunsan.distribute()` shares a host's cores among the Gloo workers of a script's own group; when it is set, the threads are the user's (a warning where they oversubscribe the cores)",
    "PMI_JOBID": "bunsan.environment | | the job id under MPICH/PMI (else `PMIX_NAMESPACE`): keys the store and derives `MASTER_PORT`",
    "PMI_RANK": "bunsan.environment | | rank under MPICH/PMI (with `PMI_SIZE`)",
    "PMI_SIZE": "bunsan.environment | | number of workers under MPICH/PMI",
    "RANK": "bunsan.environment | | this worker's rank; with `WORLD_SIZE` it selects torchrun's convention, before MPI and Slurm; without any launcher's variables a process is a job of one; `bunsan run` and torchrun set it",
    "SLURM_JOB_ID": "bunsan.environment | 0 | with `SLURM_STEP_ID`: keys the store; derives `MASTER_PORT`",
    "SLURM_LOCALID": "bunsan.environment | 0 | this worker's rank on its node under srun",
    "SLURM_NODEID": "bunsan.environment | 0 | this node's index, to pick its count from the tasks per node",
    "SLURM_PROCID": "bunsan.environment | | rank under srun (with `SLURM_STEP_NUM_TASKS` or `SLURM_NTASKS`)",
    "SLURM_STEP_NODELIST": "bunsan.environment | | the step's nodes (else `SLURM_JOB_NODELIST`, `SLURM_NODELIST`); the first is rank 0's host unless `MASTER_ADDR` is set",
    "SLURM_STEP_NUM_TASKS": "bunsan.environment | SLURM_NTASKS | number of workers under srun",
    "SLURM_STEP_TASKS_PER_NODE": "bunsan.environment | SLURM_TASKS_PER_NODE | tasks per node, e.g. `2(x3),1`: this node's count is the local size",
    "SSH_CONNECTION": "bunsan.launch.remote | | read by a remote host's agent: its server side is rank 0's host address as the launcher reached it, the default `MASTER_ADDR` of a multi-host job",
    "TORCHELASTIC_RESTART_COUNT": "bunsan.environment | 0 | with `TORCHELASTIC_RUN_ID`: keys the store of each torchrun attempt",
    "TORCHELASTIC_RUN_ID": "bunsan.environment | | marks a torchrun launch; keys the store",
    "TORCHELASTIC_USE_AGENT_STORE": "bunsan.runtime | | `True`: join the store torchrun's agent runs instead of starting one",
    "WORLD_SIZE": "bunsan.environment | | number of workers (see `RANK`); `bunsan run` and torchrun set it",
    "XDG_CACHE_HOME": "bunsan.launch.cleanup | ~/.cache | the launcher keeps its job records, for `bunsan run --cleanup`, under `$XDG_CACHE_HOME/bunsan/jobs`",
}
# Example options of each algorithm page's "Selecting it"; the generator builds each, so a stale one fails.
EXAMPLES: dict[str, dict[str, Any]] = {
    "async": {"sync_period": 64, "lr_warmup": 4000},
    "auto": {"risk": "high"},
    "block_momentum": {"block_size": 1024},
    "data_parallel": {"bits": 1, "warm_start": 8000},
    "model_averaging": {"block_size": 1024},
}
