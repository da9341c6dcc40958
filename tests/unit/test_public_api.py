"""Every name a public module exports exists and is bunsan's own."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import bunsan
from bunsan.errors import MissingExtraError

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
        try:
            obj = getattr(module, name)
        except MissingExtraError as e:  # an integration whose framework is not installed here: it says how
            assert f"{module_name} needs" in str(e) and "pip install 'bunsan[" in str(e), str(e)
            continue
        except AttributeError:
            raise AssertionError(f"{module_name}.__all__ names {name!r}, which does not exist") from None
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


def test_top_level_all_is_every_export_but_print():
    # __all__ is a literal (so that linters and type checkers read it); it must stay the
    # lazily imported names of _EXPORTS, less bunsan.print (see bunsan/__init__.py).
    assert bunsan.__all__ == sorted(set(bunsan._EXPORTS) - {"print"})
    assert "print" in bunsan._EXPORTS and "print" in dir(bunsan)


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
    "algorithms": ("bunsan.optim", "bunsan.elastic", "bunsan.train", "bunsan.bench", "bunsan.cli", "bunsan.hpo"),
    "data": ("bunsan.algorithms", "bunsan.optim", "bunsan.train", "bunsan.bench"),
    # elastic sits beside optim: data and optim dispatch to it, so it imports neither (nor what is above);
    # it takes the algorithms' arithmetic (the block filter) from the layer below, which never imports it
    "elastic": ("bunsan.optim", "bunsan.data", "bunsan.train", "bunsan.bench", "bunsan.cli"),
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


def _bunsan_imports(path, module: str, known: set[str]) -> set[str]:
    """bunsan modules that ``module`` imports anywhere (functions included; not under TYPE_CHECKING).

    Imports inside functions count: deferring an import hides a cycle from Python, not from
    the design (issue 18: bench/job.py and bench/compare.py imported each other that way).
    """
    import ast

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field, None)
                    if isinstance(children, list):
                        visit(children)

    visit(ast.parse(path.read_text()).body)
    return {name for name in found if name in known and name != module}


def test_no_import_cycle_between_bunsan_modules():
    """bunsan's modules import each other as a DAG: no module reaches itself again through imports.

    A package's ``__init__`` re-exporting its submodules is an edge like any other, so a
    submodule must import its siblings directly, not through its own package.
    """
    import pathlib

    root = pathlib.Path(bunsan.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        paths[name] = path
    known = set(paths)
    graph = {name: _bunsan_imports(path, name, known) for name, path in paths.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(name: str, stack: list[str]) -> None:
        state[name] = 1
        stack.append(name)
        for child in sorted(graph[name]):
            if state.get(child) == 1:
                cycles.append([*stack[stack.index(child) :], child])
            elif child not in state:
                walk(child, stack)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [])
    assert not cycles, "import cycles among bunsan modules:\n" + "\n".join(" -> ".join(c) for c in cycles)
