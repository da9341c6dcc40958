"""The shape of the code: modules and functions short enough to read whole, and code comments that state
rules, not history.

The rules (CONTRIBUTING.md; issue 65): no module under bunsan/ over 500 lines and no function over
100, except the allow-lists below, each entry with its reason and the issue that will split it; no
function of the auto package over 80 lines; and in the auto package's comments and strings no commit
hash, run number, ``predict-N`` label, date or citation of the lab notebook (docs/plan.md,
docs/experiments/plan.md): the history stays in the notebook, the code says the rule. An entry that is
no longer needed fails too, so the lists only shrink.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bunsan"
AUTO = PACKAGE / "algorithms" / "auto"

MODULE_LINES, FUNCTION_LINES, AUTO_FUNCTION_LINES = 500, 100, 80

# module -> why it is still long, and the issue that will split it
LONG_MODULES = {
    "algorithms/measure.py": "the job's probes (network, codec, copy, fixed costs) and core-sharing timings "
    "of tools/predict.py (issue 65: the campaign's part out of the package)",
    "bench/plan.py": "bunsan plan's CLI, its sources of profile and network and the --job replay (issue 65: "
    "the sources apart from the CLI)",
    "comm/group.py": "process-group life cycle, failure reports and the abort channel together (issue 65's "
    "shape rule, a follow-up)",
    "compression/quantize.py": "the N-bit codec's packing, encode and decode paths for CPU and GPU (issue "
    "65's shape rule, a follow-up)",
}
# "module:function" -> why it is still long, and the issue that will split it
LONG_FUNCTIONS = {
    "bench/report.py:blocks": "make bench-docs' block writer (issue 65's shape rule, a follow-up)",
    "cli.py:_run": "bunsan run's argument handling (issue 65's shape rule, a follow-up)",
    "hpo/search.py:optimize": "the search loop with its pruning and records (issue 65's shape rule, a follow-up)",
    "launch/local.py:run_job": "the launcher's watch loop (issue 65's shape rule, a follow-up)",
    "train/session.py:TrainingSession.__init__": "the session's validated arguments (issue 65's shape rule, "
    "a follow-up)",
    "train/session.py:TrainingSession.train": "the training loop with its callbacks (issue 65's shape rule, "
    "a follow-up)",
}

_spec = importlib.util.spec_from_file_location("check_docs", ROOT / "tools" / "check_docs.py")
assert _spec and _spec.loader
check_docs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_docs", check_docs)
_spec.loader.exec_module(check_docs)

_NOTEBOOK = re.compile(r"docs/(?:experiments/)?plan\.md")
_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _functions(path: Path) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of every function and method in ``path``, nested ones included."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                found.append((f"{prefix}{child.name}", child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_module_over_500_lines_but_the_reasoned_few():
    long = {_name(p): len(p.read_text().splitlines()) for p in _modules()}
    long = {name: n for name, n in long.items() if n > MODULE_LINES}
    assert set(long) - set(LONG_MODULES) == set(), f"modules over {MODULE_LINES} lines: {long}"
    assert set(LONG_MODULES) - set(long) == set(), "no longer long: take them off LONG_MODULES"


def test_no_function_over_100_lines_but_the_reasoned_few():
    long = {f"{_name(p)}:{name}": n for p in _modules() for name, n in _functions(p) if n > FUNCTION_LINES}
    assert set(long) - set(LONG_FUNCTIONS) == set(), f"functions over {FUNCTION_LINES} lines: {long}"
    assert set(LONG_FUNCTIONS) - set(long) == set(), "no longer long: take them off LONG_FUNCTIONS"


def test_the_auto_package_has_no_function_over_80_lines():
    long = {
        f"{_name(p)}:{name}": n
        for p in sorted(AUTO.glob("*.py"))
        for name, n in _functions(p)
        if n > AUTO_FUNCTION_LINES
    }
    assert long == {}


def _prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and string literal (docstrings included) of ``path``."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            found += [(token.start[0] + i, line) for i, line in enumerate(token.string.splitlines())]
    return found


@pytest.mark.parametrize("path", sorted(AUTO.glob("*.py")), ids=lambda p: p.name)
def test_the_auto_package_states_rules_not_history(path):
    prose = _prose(path)
    problems = [f"{path.name}:{line}: {what}" for line, what in check_docs.check_words([t for _, t in prose], set())]
    for line, text in prose:
        if _NOTEBOOK.search(text):
            problems.append(f"{path.name}:{line}: cites the lab notebook ({text.strip()[:60]})")
        if _DATE.search(text):
            problems.append(f"{path.name}:{line}: a date ({text.strip()[:60]})")
    assert problems == []


def test_the_prose_check_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Measured in run 60 (docs/experiments/plan.md)."""\n# until 2026-11-28, at 53c86f5\nX = 1\n')
    prose = [t for _, t in _prose(bad)]
    found = check_docs.check_words(prose, set())
    assert len(found) == 2  # the run number and the commit hash
    assert any(_NOTEBOOK.search(t) for t in prose) and any(_DATE.search(t) for t in prose)
