"""The wheel of this checkout, installed as a user installs it, into a virtual environment that has only torch.

One test, in a user's order: ``pip wheel . --no-deps -w DIR``; check what the wheel holds (every
module, the 1-bit codec's C source, only torch and numpy as requirements); ``python -m venv``; install
torch (``$TORCH_SPEC``, default ``torch==2.13.0``, as the Makefile); install the wheel with its
dependencies (numpy comes from the index); check that no optional extra came along; ``bunsan --version``;
a command and a function that need an extra say which, in one sentence; and ``bunsan run -np 2`` of a
script on synthetic tensors (exact and 1-bit DataParallelSGD, the codec compiled from the installed
source), from a directory outside the checkout so that the checkout is never imported.

pip's cache is reused; torch is installed with ``--no-compile`` (Python compiles what it imports
anyway), which makes the install several times faster.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# distributions of the extras (pyproject.toml): none of them may come with the core
OPTIONAL = ("scikit-learn", "matplotlib", "mnist1d", "tqdm", "optuna", "tensorboard", "lightning", "accelerate")

# The job: two models trained by two algorithms, replicas compared across ranks after each.
JOB = """\
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import bunsan
from bunsan.compression import native

prefix = Path(sys.prefix).resolve()
for path in (bunsan.__file__, native._SOURCE):  # the installed copy, not the checkout
    assert Path(path).resolve().is_relative_to(prefix), f"{path} is not under {prefix}"

bunsan.init()
torch.manual_seed(0)
inputs = torch.randn(512, 64)
labels = (inputs[:, :8].sum(1) > 0).long()
dataset = torch.utils.data.TensorDataset(inputs, labels)
sent = {}
for name, algorithm in (("exact", bunsan.DataParallelSGD()), ("1-bit", bunsan.DataParallelSGD(bits=1))):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = bunsan.distribute(model, optimizer, algorithm)
    for x, y in bunsan.data.loader(dataset, batch_size=32, shuffle=True):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = bunsan.comm.all_gather_object(flat)
    assert all(torch.equal(replicas[0], r) for r in replicas), f"{name}: the replicas differ"
    assert torch.isfinite(loss), f"{name}: loss {loss}"
    sent[name] = algorithm.stats()["bytes_sent_per_step"]
    bunsan.print(f"{name}: {algorithm.stats()['steps']} steps, loss {loss.item():.4f}, replicas equal")
assert native.available(), native.unavailable_reason()  # compiled from the wheel's onebit.c
assert sent["1-bit"] < sent["exact"] / 8, sent
print(f"rank {bunsan.rank()} ok", flush=True)
bunsan.finalize()
"""


def _environment(venv: Path, cache: Path) -> dict[str, str]:
    """This process's environment without what would leak the checkout or the suite's venv into the new one."""
    leaks = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")
    env = {k: v for k, v in os.environ.items() if k not in leaks and not k.startswith(("BUNSAN_", "PYTEST_"))}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        BUNSAN_BACKEND="gloo",  # two ranks on a CPU build of torch; on a GPU machine NCCL would need 2 GPUs
        BUNSAN_CACHE_DIR=str(cache),  # a fresh cache: the codec is compiled from the installed source
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{shlex.join(argv)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _build_wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    """``pip wheel . --no-deps`` in a copy of the checkout's package files (a stale build/ cannot leak in)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "setup.py", "setup.cfg", "MANIFEST.in"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "bunsan", source / "bunsan", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(wheels)], env, source)
    (wheel,) = wheels.glob("bunsan-*.whl")
    return wheel


def _check_wheel(wheel: Path) -> str:
    """Every module, the C source and the package's data are in the wheel; only torch and numpy are required.
    Returns the version."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata_name).decode()
    sources = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "bunsan").rglob("*")
        if p.suffix in (".py", ".c", ".json") and "__pycache__" not in p.parts
    }
    assert "bunsan/compression/onebit.c" in sources and "bunsan/bench/published.json" in sources
    assert not sources - names, f"missing from the wheel: {sorted(sources - names)}"
    headers = email.parser.HeaderParser().parsestr(metadata)  # the header fields; the README follows them
    core = {
        re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0]
        for requirement in headers.get_all("Requires-Dist", [])
        if "extra ==" not in requirement
    }
    assert core == {"torch", "numpy"}, f"core requirements: {sorted(core)}"
    extras = set(headers.get_all("Provides-Extra", []))
    assert {"data", "bench", "hpo", "progress", "tensorboard", "all", "test"} <= extras, extras
    return str(headers["Version"])


@pytest.mark.timeout(600)
def test_wheel_installs_with_torch_only_and_runs_a_two_worker_job(tmp_path: Path) -> None:
    venv, outside = tmp_path / "venv", tmp_path / "user"
    outside.mkdir()
    env = _environment(venv, tmp_path / "cache")

    wheel = _build_wheel(tmp_path, env)
    version = _check_wheel(wheel)

    _run([sys.executable, "-m", "venv", str(venv)], env, outside)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    torch_spec = shlex.split(os.environ.get("TORCH_SPEC", "torch==2.13.0"))
    _run([*pip, "--no-compile", *torch_spec], env, outside, timeout=400)
    _run([*pip, str(wheel)], env, outside)  # with its dependencies: numpy from the index

    listed = _run([python, "-m", "pip", "list", "--format=json"], env, outside).stdout
    installed = {entry["name"].lower().replace("_", "-") for entry in json.loads(listed)}
    assert {"bunsan", "torch", "numpy"} <= installed, installed
    assert not installed & set(OPTIONAL), f"the core pulled optional packages: {sorted(installed & set(OPTIONAL))}"

    bunsan = str(venv / "bin" / "bunsan")
    assert _run([bunsan, "--version"], env, outside).stdout.strip() == f"bunsan {version}"

    # What needs an extra says which one, in one sentence: a command (exit 2, no traceback) ...
    refused = subprocess.run(
        [bunsan, "bench", "compare", "--dry-run"], env=env, cwd=outside, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2, refused
    assert refused.stderr.strip().splitlines() == [
        "bunsan: error: bunsan bench needs matplotlib, scikit-learn and mnist1d, which are not installed: "
        "pip install 'bunsan[bench]'"
    ]
    # ... and a function.
    probe = "import bunsan.datasets\ntry:\n    bunsan.datasets.digits()\nexcept ImportError as e:\n    print(e)"
    assert _run([python, "-c", probe], env, outside).stdout.strip() == (
        "bunsan.datasets.digits() needs scikit-learn, which is not installed: pip install 'bunsan[data]'"
    )

    (outside / "job.py").write_text(JOB)
    job = _run([bunsan, "run", "-np", "2", "job.py"], env, outside, timeout=300)
    assert "rank 0 ok" in job.stdout and "rank 1 ok" in job.stdout, job.stdout + job.stderr
    assert list((tmp_path / "cache").glob("bunsan_onebit_*.so")), "the 1-bit codec was not compiled"
