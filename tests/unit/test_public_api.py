"""Every name a public module exports exists and is bunsan's own."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import bunsan

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(bunsan.__path__, prefix="bunsan.")
    if not any(part.startswith("_") for part in name.split(".")[1:])
)


@pytest.mark.parametrize("module_name", MODULES)
def test_all_names_exist_and_belong_to_bunsan(module_name):
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{module_name} has no __all__"
    for name in exported:
        assert hasattr(module, name), f"{module_name}.__all__ names {name!r}, which does not exist"
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__.startswith("bunsan."), f"{module_name}.{name} comes from {obj.__module__}"


def test_top_level_names_of_the_contract():
    for name in [
        "init",
        "finalize",
        "session",
        "rank",
        "size",
        "local_rank",
        "local_size",
        "is_main",
        "device",
        "distribute",
        "DataParallelSGD",
        "DistributedOptimizer",
        "data",
        "datasets",
        "models",
    ]:
        assert name in bunsan.__all__


def test_comm_is_the_only_package_calling_torch_distributed():
    import pathlib
    import re

    root = pathlib.Path(bunsan.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("comm/"):
            continue
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if re.search(r"\bdist\.\w+\(|torch\.distributed\.(?!pipelining)\w+\(|import torch\.distributed as", code):
                offenders.append(f"{rel}: {line.strip()}")
    assert not offenders, "torch.distributed called outside bunsan.comm:\n" + "\n".join(offenders)


def _imports_of(path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# DESIGN.md: comm <- compression/algorithms/nn/parallel/data <- optim <- train <- bench/cli;
# launch/ imports nothing of the training side.
_FORBIDDEN = {
    "comm": (
        "bunsan.algorithms",
        "bunsan.optim",
        "bunsan.train",
        "bunsan.bench",
        "bunsan.runtime",
        "bunsan.data",
        "bunsan.nn",
    ),
    "compression": ("bunsan.comm", "bunsan.algorithms", "bunsan.optim", "bunsan.train", "bunsan.bench"),
    "algorithms": ("bunsan.optim", "bunsan.train", "bunsan.bench", "bunsan.cli", "bunsan.hpo"),
    "data": ("bunsan.algorithms", "bunsan.optim", "bunsan.train", "bunsan.bench"),
    "nn": ("bunsan.optim", "bunsan.train", "bunsan.bench"),
    "parallel": ("bunsan.optim", "bunsan.train", "bunsan.bench"),
    "train": ("bunsan.bench", "bunsan.cli", "bunsan.hpo"),
    "launch": (
        "torch",
        "bunsan.comm",
        "bunsan.algorithms",
        "bunsan.optim",
        "bunsan.train",
        "bunsan.runtime",
        "bunsan.data",
        "bunsan.nn",
        "bunsan.parallel",
        "bunsan.bench",
    ),
}


@pytest.mark.parametrize("package", sorted(_FORBIDDEN))
def test_lower_layers_never_import_higher_ones(package):
    import pathlib

    root = pathlib.Path(bunsan.__file__).parent / package
    offenders = []
    for path in root.rglob("*.py"):
        for name in _imports_of(path):
            if name in ("bunsan", "bunsan.__version__") and package == "launch":
                offenders.append(f"{path.name}: imports the bunsan package (its training-side re-exports)")
            elif any(name == bad or name.startswith(bad + ".") for bad in _FORBIDDEN[package]):
                offenders.append(f"{path.name}: {name}")
    assert not offenders, f"bunsan.{package} imports a higher layer:\n" + "\n".join(offenders)
