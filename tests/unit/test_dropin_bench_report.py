"""make bench-docs (bunsan.bench.report): markers, renderers, the dry run; nothing is measured here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bunsan.bench import doc_tables, report

ROOT = Path(__file__).resolve().parents[2]


def test_replace_block_replaces_only_between_the_markers():
    text = "intro\n<!-- bench:t -->\n| old |\n<!-- /bench:t -->\noutro\n"
    new = report.replace_block(text, "t", "| new |\n")
    assert new == "intro\n<!-- bench:t -->\n| new |\n<!-- /bench:t -->\noutro\n"
    assert report.replace_block(new, "t", "| new |") == new  # idempotent


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no markers here", "0 copies of '<!-- bench:t -->'"),
        ("<!-- bench:t -->\n<!-- bench:t -->\n<!-- /bench:t -->", "2 copies"),
        ("<!-- /bench:t -->\n<!-- bench:t -->", "comes before"),
    ],
)
def test_replace_block_refuses_broken_markers(text, message):
    with pytest.raises(ValueError, match=message):
        report.replace_block(text, "t", "x", where="README.md")


def test_every_block_has_its_markers_once_and_every_marker_has_a_block():
    names = {b.name for b in report.blocks()}
    for path in ("README.md", "docs/benchmarks.md"):
        text = (ROOT / path).read_text()
        found = report.block_names(text)
        assert len(found) == len(set(found)), f"{path} repeats a block"
        assert set(found) <= names, f"{path} has markers of no block: {set(found) - names}"
        expected = {b.name for b in report.blocks() if b.file == path}
        assert set(found) == expected, f"{path}: markers {sorted(found)}, blocks {sorted(expected)}"
        for name in found:  # each is a valid pair
            report.replace_block(text, name, "x", where=path)


def test_the_readme_holds_one_block_and_the_benchmarks_page_every_other():
    every = report.blocks()
    assert [b.name for b in every if b.file == "README.md"] == ["ddp-overhead"]
    assert all(b.file == "docs/benchmarks.md" for b in every if b.name != "ddp-overhead")
    assert len({b.name for b in every}) == len(every)


def test_dry_run_lists_every_block_and_command_and_runs_nothing(capsys, tmp_path):
    assert report.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for block in report.blocks():
        assert block.name in out
        for command in block.commands:
            assert command.split()[1] in out
    assert "estimated" in out and "min in all" in out
    assert list(tmp_path.iterdir()) == []


def test_unknown_block_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--dry-run", "--only", "nonsense"])
    assert exit_info.value.code == 2 and "unknown blocks ['nonsense']" in capsys.readouterr().err


def test_commands_run_with_this_interpreter(tmp_path):
    import sys

    argv = report.argv_of("bunsan run -np 2 python -m bunsan.bench.ddp_overhead --json {out}/x.json", tmp_path)
    assert argv == [
        sys.executable,
        "-m",
        "bunsan",
        "run",
        "-np",
        "2",
        sys.executable,
        "-m",
        "bunsan.bench.ddp_overhead",
        "--json",
        f"{tmp_path}/x.json",
    ]


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def test_job_table_picks_columns_and_rows(tmp_path):
    _write(tmp_path / "c.json", {"columns": ["size", "op", "x"], "table": [["1KB", "a", "1"], ["1MB", "b", "2"]]})
    header, rows = doc_tables.job_table(
        tmp_path / "c.json",
        ["op", "size"],
        keep=lambda row, cells: cells["size"] == "1MB",
        prefix=[("link", "1 Gbit/s")],
    )
    assert header == ["link", "op", "size"] and rows == [["1 Gbit/s", "b", "1MB"]]
    with pytest.raises(ValueError, match="no columns"):
        doc_tables.job_table(tmp_path / "c.json", ["nope"])


def test_render_only_rewrites_the_tables_with_a_stamp(tmp_path):
    # A copy of the README's structure with one block, its record fabricated in the benchmark's format.
    doc = tmp_path / "README.md"
    doc.write_text("before\n<!-- bench:ddp-overhead -->\n| stale |\n<!-- /bench:ddp-overhead -->\nafter\n")
    _write(
        tmp_path / "out" / "ddp_overhead.json",
        {
            "workers": 2,
            "results": [
                {
                    "model": "resnet20",
                    "tensors": 65,
                    "batch": 32,
                    "ddp_ms": 100.0,
                    "bunsan_ms": 101.0,
                    "ratio": 1.01,
                    "ratio_min": 0.99,
                    "ratio_max": 1.03,
                    "max_param_diff": 0.0,
                }
            ],
        },
    )
    chosen = [b for b in report.blocks() if b.name == "ddp-overhead"]
    assert report.run(chosen, tmp_path / "out", render_only=True, timeout_s=10, root=tmp_path) == 0
    text = doc.read_text()
    assert "| stale |" not in text and text.startswith("before\n") and text.endswith("after\n")
    assert "| resnet20 | 65 | 32 | 100.000 | 101.000 | 1.010 | 0.990-1.030 | 0 |" in text
    line = text.splitlines()[-3]  # the stamp, then the closing marker and "after"
    match = report.STAMP_RE.fullmatch(line)
    assert match and match["name"] == "ddp-overhead" and "load average not recorded" in line
    # A stamp the measuring run kept in --out is the one a later --render-only writes.
    kept = report.stamp("ddp-overhead", "1a2b3c4", "2026-11-29", "2 cores, x86_64, torch 2.5.1", (0.1, 1.9), 146)
    (tmp_path / "out" / "ddp-overhead.stamp").write_text(kept + "\n")
    assert report.run(chosen, tmp_path / "out", render_only=True, timeout_s=10, root=tmp_path) == 0
    assert doc.read_text().splitlines()[-3] == kept


def test_stamp_names_the_command_commit_date_machine_load_and_duration():
    machine = report.describe_machine(2, "  AMD EPYC 7B13 (x);<b>  ", "x86_64", "2.5.1")
    assert machine == "2 cores (AMD EPYC 7B13 x b), x86_64, torch 2.5.1"
    line = report.stamp("quantized", "1a2b3c4", "2026-11-29", machine, (0.123, 1.95), 146.4, dirty=True)
    assert line == (
        "<sub>generated by `python -m bunsan.bench.report --only quantized` at commit 1a2b3c4 + uncommitted changes"
        " on 2026-11-29; machine: 2 cores (AMD EPYC 7B13 x b), x86_64, torch 2.5.1; load average 0.12 at the start,"
        " 1.95 at the end; took 146 s</sub>"
    )
    match = report.STAMP_RE.fullmatch(line)
    assert match and match.group("name", "commit", "dirty", "date", "load_start", "seconds") == (
        "quantized",
        "1a2b3c4",
        " + uncommitted changes",
        "2026-11-29",
        "0.12",
        "146",
    )
    assert report.STAMP_RE.fullmatch(report.stamp("x", "unknown", "2026-11-29", report.machine()))
    assert report.describe_machine(None, None, "", None) == "? cores, unknown architecture, torch not installed"


@pytest.mark.parametrize(
    ("others", "load", "warned"),
    [(0.1, 9.0, False), (0.3, 0.0, True), (None, 1.0, False), (None, 1.5, True), (None, None, False)],
)
def test_under_load_counts_other_processes_else_the_load_at_the_start(others, load, warned):
    assert (report.under_load(2, others, load) is not None) == warned


def test_a_block_that_cannot_render_keeps_its_table_and_fails(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("<!-- bench:async-bench -->\n| kept |\n<!-- /bench:async-bench -->\n")
    chosen = [b for b in report.blocks() if b.name == "async-bench"]
    assert report.run(chosen, tmp_path / "out", render_only=True, timeout_s=10, root=tmp_path) == 1
    assert "| kept |" in doc.read_text()


def test_accuracy_rows_in_the_readme_order(tmp_path):
    for run, (_, _, labels) in doc_tables.ACCURACY_RUNS.items():
        configs = [
            {"label": label, "status": "ok", "test_error": 0.1 + i / 100, "bytes_sent_per_sample": 48.1, "wall_s": 3.0}
            for i, label in enumerate(labels)
        ]
        _write(tmp_path / run / "compare.json", {"configs": configs})
    table = doc_tables.render_accuracy(tmp_path).splitlines()
    assert len(table) == 2 + len(doc_tables.ACCURACY_ORDER) == 21
    assert table[2] == "| data_parallel | 0.05, 0.9 | 10.0% | 48.1 | 3.0 s |"
    assert table[3].startswith("| block_momentum block 256, ζ=0.5 | 0.05, 0.9 |")
    assert table[-1].startswith("| data_parallel bits=1, rotate, warm start 40,000 | 0.05, 0.9 | 11.0% |")
    covered = {(run, i) for run, i in doc_tables.ACCURACY_ORDER}
    assert covered == {(run, i) for run, (_, _, labels) in doc_tables.ACCURACY_RUNS.items() for i in range(len(labels))}


def test_a_run_stamps_its_table_with_the_load_and_keeps_the_stamp(tmp_path, capsys):
    (tmp_path / "README.md").write_text("<!-- bench:t -->\n| old |\n<!-- /bench:t -->\n")
    block = report.Block("t", "README.md", ("python -c pass",), lambda out: "| new |", 0)
    assert report.run([block], tmp_path / "out", render_only=False, timeout_s=60, root=tmp_path) == 0
    line = (tmp_path / "README.md").read_text().splitlines()[-2]
    match = report.STAMP_RE.fullmatch(line)
    assert match and match["name"] == "t" and match["load_start"] and match["seconds"]
    assert (tmp_path / "out" / "t.stamp").read_text() == line + "\n"
    printed = capsys.readouterr().out
    assert "| new |" in printed and line in printed and "other processes used" in printed


def test_defaults_table_gives_each_seed_the_mean_and_the_difference_from_exact(tmp_path):
    errors = {  # per setting, seeds 0 / 1 / 2; the last setting fails at seed 1
        "data_parallel": (0.08, 0.10, 0.12),
        "data_parallel:bits=1": (0.09, 0.11, 0.13),
        "block_momentum:block_size=1024": (0.10, 0.10, 0.10),
        "block_momentum:block_size=1024,block_learning_rate=1.0": (0.20, 0.20, 0.26),
        "model_averaging:block_size=1024": (0.08, None, 0.09),
    }
    for seed in doc_tables.DEFAULTS_SEEDS:
        configs = [
            {"label": label, "status": "ok", "test_error": e[seed]} if e[seed] is not None else {"label": label}
            for label, e in errors.items()
        ]
        (tmp_path / f"defaults-s{seed}").mkdir()
        (tmp_path / f"defaults-s{seed}" / "compare.json").write_text(json.dumps({"configs": configs}))
    rows = [line.split(" | ") for line in doc_tables.render_defaults(tmp_path).splitlines()[2:]]
    assert [r[2:] for r in rows] == [
        ["10.00%", "- |"],
        ["11.00%", "+1.00 |"],
        ["10.00%", "+0.00 |"],
        ["22.00%", "+12.00 |"],
        ["-", "- |"],
    ]
    assert rows[0][1] == "8.0 / 10.0 / 12.0" and rows[4][1] == "8.0 / failed / 9.0"
    assert "`data_parallel:bits=1`" in rows[1][0]
    (block,) = [b for b in report.blocks() if b.name == "defaults"]
    assert [c.split("--seed ")[1].split()[0] for c in block.commands] == ["0", "1", "2"]
    assert all(" ".join(doc_tables.DEFAULTS_SETTINGS) in c for c in block.commands)


def test_the_elastic_table_sets_the_ways_of_losing_a_worker_side_by_side(tmp_path):
    import json

    from bunsan.bench.elastic_table import render_elastic

    (tmp_path / "elastic").mkdir()
    base = {"code": 0, "replicas_equal": True, "left": 0, "redone_steps": 1, "wall_s": 30.0, "test_error": 0.09}
    for kill, extra in {
        "none": {"redone_steps": 0},
        "one": {"recovery_s": 1.0},
        "second": {"recovery_s": 2.0, "code": 1},
        "rejoin": {"recovery_s": 1.5, "rejoined_s": 3.0},
        "restart": {"recovery_s": 9.0, "redone_steps": 24},
    }.items():
        records = [{**base, **extra}, {**base, **extra, "test_error": 0.11, "wall_s": 40.0}]
        (tmp_path / "elastic" / f"{kill}.json").write_text(json.dumps(records))
    lines = render_elastic(tmp_path).splitlines()
    assert len(lines) == 2 + 5
    assert lines[2].startswith("| uninterrupted") and "| 0 / 0 |" in lines[2] and "| 10.00 (9.00-11.00) |" in lines[2]
    assert "| 0 of 2 |" in lines[4] and "| 2.00 / 2.00 |" in lines[4]  # exit 1: not counted
    assert "| 3.00 / 3.00 |" in lines[5] and "| 24 / 24 |" in lines[6] and "| 35.0 |" in lines[6]
