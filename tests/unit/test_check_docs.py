"""tools/check_docs.py: each rule on small strings, the stamp round trip with bunsan.bench.report, the command."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from bunsan.bench import report

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_docs", ROOT / "tools" / "check_docs.py")
assert _spec and _spec.loader
check_docs = importlib.util.module_from_spec(_spec)
sys.modules["check_docs"] = check_docs
_spec.loader.exec_module(check_docs)

MACHINE = report.describe_machine(2, "AMD EPYC 7B13", "x86_64", "2.5.1")
STAMP = report.stamp("t", "1a2b3c4", "2026-11-29", MACHINE, (0.12, 1.95), 146)


def problems(text: str, path: str = "docs/page.md", files: tuple[str, ...] = ()) -> list[str]:
    """The problems as ``line: what``, links resolved against ``files``."""
    return [f"{line}: {what}" for line, what in check_docs.check_text(text, path, set(files).__contains__)]


def block(body: str, stamp: str = STAMP, name: str = "t") -> str:
    return f"<!-- bench:{name} -->\n{body}\n\n{stamp}\n<!-- /bench:{name} -->\n"


# -- a-c: commit hashes, HEAD, run numbers --------------------------------------------------------


def test_a_planted_commit_hash_fails_in_prose_and_in_code():
    assert problems("Fixed in 1eac4ea.\n") == ["1: commit hash '1eac4ea': no commit hashes outside docs/experiments/"]
    assert len(problems("```\ngit show 0129e1a5f3b2c4d6e7f8a9b0c1d2e3f4a5b6c7d8\n```\n")) == 1


@pytest.mark.parametrize(
    "text",
    [
        "1000000 samples, 12608 words",  # no letter
        "deadbeef, a facade, accede",  # no digit
        "the mask 0x1234abcd and 0xdeadbeef1",  # literals
        "abc1234_suffix, prefix_abc1234, abc1234def567Z",  # part of a longer word
        "sha256 " + "ab12" * 16,  # 64 characters: a digest
        "lr 1e100000",  # a float's exponent
        "see https://github.com/pytorch/pytorch/blob/1eac4ea0/torch/x.py and <https://x.org/a1b2c3d4>",
        "bunsan run --cleanup --job-id 3f2a91c04b7d11e8",  # the launcher's job ids are hex
        "a short a1b2c3 colour",  # 6 characters
    ],
)
def test_what_is_not_a_commit_hash(text):
    assert problems(text + "\n") == []


def test_a_commit_hash_inside_a_bench_block_is_allowed():
    assert problems(block("| 1eac4ea | HEAD | run 14 | predict-7 |")) == []


def test_head_as_a_whole_word_only():
    assert problems("Compare with HEAD~1.\n") == ["1: 'HEAD': say which version, or state the rule instead"]
    assert problems("ahead; Head; HEADER; head\n") == []


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("as run 14 showed", "'run 14'"),
        ("Run 3: slower", "'Run 3'"),
        ("runs 21 and 22", "'runs 21'"),
        ("runs 45-47 agree", "'runs 45-47'"),
        ("in run #5", "'run #5'"),
        ("run 24's seed", "'run 24'"),
    ],
)
def test_run_numbers_fail(text, found):
    assert problems(text + "\n") == [f"1: run number {found}: no run numbers outside docs/experiments/"]


@pytest.mark.parametrize(
    "text",
    ["run 2 workers", "Run 4 processes per host", "runs 3 times", "runs 1-bit Adam", "bunsan run -np 2", "runs/x"],
)
def test_counts_and_commands_are_not_run_numbers(text):
    assert problems(text + "\n") == []


def test_predict_labels_fail():
    assert problems("as predict-12 priced it\n") == ["1: 'predict-12': no predict-N labels outside docs/experiments/"]
    assert problems("bunsan.predict and predictor-2\n") == []


# -- d: the README's length ---------------------------------------------------------------------


def test_a_readme_of_201_lines_fails_200_pass():
    assert problems("x\n\n" * 100, "README.md") == []
    assert problems("x\n\n" * 100 + "x\n", "README.md") == ["201: README.md has 201 lines; at most 200"]
    assert problems("x\n\n" * 150, "docs/long.md") == []


# -- e: paragraphs ------------------------------------------------------------------------------

LONG = "paragraph of 16 lines (at most 15): split it or make it a list"


def test_a_paragraph_of_16_lines_fails_15_pass():
    assert problems("intro\n\n" + "prose\n" * 16) == [f"3: {LONG}"]
    assert problems("intro\n\n" + "prose\n" * 15) == []


def test_tables_code_lists_headings_comments_and_blocks_are_not_long_paragraphs():
    table = "| a | b |\n|---|---|\n" + "| 1 | 2 |\n" * 30
    code = "```python\n" + "x = 1\n" * 30 + "```\n"
    items = "- item\n  continued\n" * 10 + "1. first\n2) second\n"
    headed = "# Title\n" + "prose\n" * 10 + "## Part\n" + "prose\n" * 10
    comments = "prose\n" * 10 + "<!-- a\ncomment\n-->\n" + "prose\n" * 10 + "<!-- marker -->\n" + "prose\n" * 10
    generated = block("\n".join(["| 1 | 2 |"] * 10 + ["note"] * 20))
    assert problems("\n".join([table, code, items, headed, comments, generated])) == []


def test_a_long_list_item_fails():
    assert problems("- item\n" + "  more\n" * 15) == [f"1: {LONG}"]


def test_a_paragraph_is_counted_from_where_it_starts():
    lines = ["a", "b", "", "| t |", "c", "- d", "e", "# h", "```", "f", "```"]
    assert check_docs.paragraphs(lines, check_docs.fenced_lines(lines)) == [(0, 2), (4, 1), (5, 2)]


# -- f: generated blocks and their stamps -------------------------------------------------------


def test_a_block_with_a_new_stamp_passes_an_old_or_missing_stamp_fails():
    assert problems(block("| 1 |")) == []
    old = "<sub>generated by `make bench-docs` at commit 5a864a8 on 2026-11-24 in 23 s</sub>"
    regenerate = "regenerate it with make bench-docs (python -m bunsan.bench.report --only t)"
    assert problems(block("| 1 |", old)) == [f"4: bench block t has a stamp in an old format; {regenerate}"]
    assert problems(block("| 1 |", "")) == [f"2: bench block t does not end with its stamp line; {regenerate}"]
    assert problems(block("| 1 |", name="u")) == ["4: the stamp of bench block u names block t"]


def test_broken_markers_fail_and_markers_in_code_are_examples():
    assert problems("<!-- bench:t -->\n| 1 |\n") == ["1: bench block t has no closing marker <!-- /bench:t -->"]
    assert problems("<!-- /bench:t -->\n") == ["1: closing marker of bench block t without its opening marker"]
    assert problems("```\n<!-- bench:t -->\n| 1 |\n<!-- /bench:t -->\n```\n") == []


def test_the_stamp_round_trip():
    """What report.stamp writes, in every variant, is what the checker accepts (the one STAMP_RE)."""
    assert check_docs.STAMP_RE is report.STAMP_RE
    variants = [
        STAMP,
        report.stamp("t", "1a2b3c4", "2026-11-29", MACHINE, (0.12, 1.95), 146, dirty=True),
        report.stamp("t", "unknown", "2026-11-29", MACHINE),  # --render-only without a kept stamp
        report.stamp("t", "1a2b3c4", "2026-11-29", report.machine(), (12.5, 0.0), 0.4),  # this machine
        report.stamp("t", "1a2b3c4", "2026-11-29", report.describe_machine(None, "a;b<c>`d`", "", None)),
    ]
    for line in variants:
        assert problems(block("| 1 |", line)) == [], line


# -- g: links -----------------------------------------------------------------------------------


def test_relative_links_resolve_from_the_files_directory():
    text = "[a](../explanation/quantized.md#why) ![plot](img/x.png) [b](index.md)\n[ref]: ../../README.md\n"
    files = ("docs/explanation/quantized.md", "docs/how-to/img/x.png", "docs/how-to/index.md", "README.md")
    assert problems(text, "docs/how-to/page.md", files) == []
    assert problems("see [it](gpu.md).\n", "docs/how-to/page.md") == [
        "1: broken link 'gpu.md': there is no docs/how-to/gpu.md"
    ]


def test_links_not_checked_and_links_refused():
    text = "[w](https://example.org/x.md) [m](mailto:a@b.c) [top](#install) `[code](nowhere.md)`\n"
    assert problems(text + "```\n[code](nowhere.md)\n```\n\n[^1]: Tang et al. (2021)\n") == []
    assert problems("[a](/docs/index.md)\n") == ["1: link '/docs/index.md' is absolute; make it relative to this file"]
    assert problems("[a](../../x.md)\n") == ["1: link '../../x.md' leaves the repository"]


# -- the command --------------------------------------------------------------------------------


def test_the_command_prints_path_line_what_and_exits_1(tmp_path, capsys):
    bad, good = tmp_path / "bad.md", tmp_path / "good.md"
    bad.write_text("ok\n\nFixed in 1eac4ea, see [x](missing.md).\n")
    good.write_text(f"# Fine\n\nProse.\n\n{block('| 1 |')}")
    assert check_docs.main(["--files", str(good)]) == 0
    assert "1 files, no commit hashes" in capsys.readouterr().out
    assert check_docs.main(["--files", str(bad), str(good)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{bad}:3: broken link 'missing.md': there is no {tmp_path}/missing.md",
        f"{bad}:3: commit hash '1eac4ea': no commit hashes outside docs/experiments/",
    ]


def test_the_default_files_are_the_user_docs():
    files = [p.relative_to(ROOT).as_posix() for p in check_docs.default_files()]
    assert files[0] == "README.md" and not any(f.startswith("docs/experiments/") for f in files)
    assert all(f.endswith(".md") for f in files)
