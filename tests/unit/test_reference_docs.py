"""docs/reference/ is what tools/gen_reference.py writes from the code, and that covers the code."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIX = "run python tools/gen_reference.py and commit docs/reference/"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return gen.pages()


def bunsan_names_in_code() -> dict[str, set[str]]:
    """``BUNSAN_*`` names in the string literals (docstrings aside) and keyword names of bunsan/ -> modules."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "bunsan").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, scopes) and n.body and isinstance(n.body[0], ast.Expr)
        }
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            texts = []
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                texts.append(node.value)
            if isinstance(node, ast.keyword) and node.arg:  # dict(BUNSAN_JOB_ID=...)
                texts.append(node.arg)
            for name in (m for text in texts for m in re.findall(r"\bBUNSAN_[A-Z0-9_]+\b", text)):
                found.setdefault(name, set()).add(module)
    return found


def test_committed_pages_are_what_the_generator_writes(pages):
    out = ROOT / "docs" / "reference"
    stale = [p for p, text in pages.items() if not (out / p).is_file() or (out / p).read_text("utf-8") != text]
    extra = sorted(
        p.relative_to(out).as_posix() for p in out.rglob("*.md") if p.relative_to(out).as_posix() not in pages
    )
    assert not stale and not extra, f"stale pages {stale}, pages nothing writes {extra}: {FIX}"


def test_pages_are_deterministic_and_marked(pages):
    for path, text in pages.items():
        assert text.startswith(gen.NOTE), f"{path} lacks the generated-page note"
        assert not re.search(r"0x[0-9a-f]{6,}", text), f"{path} shows a memory address"
        assert str(ROOT) not in text, f"{path} shows an absolute path"


def test_environment_table_matches_the_code():
    in_code = bunsan_names_in_code()
    known = set(gen.ENVIRONMENT) | set(gen.option_variables())
    missing = {name: sorted(mods) for name, mods in in_code.items() if name not in known}
    assert not missing, f"add these to ENVIRONMENT in tools/reference_tables.py, then {FIX}: {missing}"
    gone = sorted(set(gen.ENVIRONMENT) - set(in_code))
    assert not gone, (
        f"bunsan/ no longer mentions {gone}: drop them from ENVIRONMENT in tools/reference_tables.py, then {FIX}"
    )
    assert set(gen.ENVIRONMENT) >= gen.INTERNAL


def test_every_reader_listed_mentions_its_variable():
    for name, entry in {**gen.ENVIRONMENT, **gen.STANDARD}.items():
        readers = [r.strip() for r in entry.split("|")[0].split(",")]
        for module in readers:
            path = ROOT.joinpath(*module.split("."))
            source = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text("utf-8")
            assert name.split("{")[0] in source, f"{module} is listed as reading {name} but never mentions it"


def test_every_algorithm_has_a_page_with_every_argument(pages):
    from bunsan import algorithms

    classes = gen.algorithm_classes()
    assert sorted(classes) == algorithms.names()
    for name, cls in classes.items():
        page = pages.get(f"algorithms/{name}.md")
        assert page is not None, f"no page for algorithm {name!r}: {FIX}"
        for param in inspect.signature(cls).parameters:
            row = next((line for line in page.splitlines() if line.startswith(f"| `{param}` |")), None)
            assert row is not None, f"algorithms/{name}.md has no row for argument {param!r}: {FIX}"
            assert "(not documented)" not in row, f"{cls.__name__}'s docstring (Args:) does not describe {param!r}"
    assert all(f"algorithms/{name}.md" in pages["index.md"] for name in classes)


def test_every_command_and_option_is_on_the_cli_page(pages):
    from bunsan.cli import build_parser

    for parser, _ in gen._parsers(build_parser()):
        assert f"## `{parser.prog}`" in pages["cli.md"]
        for action in parser._actions:
            for flag in action.option_strings:
                assert f"`{flag}`" in pages["cli.md"], f"{parser.prog} {flag} is not on cli.md: {FIX}"


def test_clean_drops_figures_and_history_but_keeps_rules():
    text = (
        "Half the bytes (measured: 3.1 ms on an H200). Default 512; 2-5x faster at 4 workers. Must be a power of two."
    )
    assert gen.clean(text) == "Half the bytes. Default 512. Must be a power of two."
    assert gen.md("see :func:`~bunsan.comm.all_reduce` and ``x``") == "see `all_reduce` and `x`"


def test_args_section_and_units():
    doc = """Summary.

    Args:
        block_size: samples per worker in one block; best a
            multiple of the minibatch.
        warm_start: samples (all workers together) first.
        timeout_s: how long to wait.

    Raises:
        ValueError: never.
    """
    args = gen.args_section(doc)
    assert args == {
        "block_size": "samples per worker in one block; best a multiple of the minibatch.",
        "warm_start": "samples (all workers together) first.",
        "timeout_s": "how long to wait.",
    }
    assert [gen.unit(k, v) for k, v in args.items()] == [
        "samples per worker",
        "samples, all workers together",
        "seconds",
    ]
