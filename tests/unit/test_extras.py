"""Optional extras: what needs a missing one says which, in one sentence; the rest works without them.

A package is made missing by ``sys.modules[name] = None`` (then ``import name`` raises
ImportError and ``importlib.util.find_spec`` finds nothing), as on a machine without it.
tests/packaging/test_wheel.py checks the same on a real install of the core alone.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bunsan import _extras, cli
from bunsan._extras import MissingExtraError
from bunsan.errors import BunsanError

REPO = Path(__file__).resolve().parents[2]
OPTIONAL_MODULES = ("sklearn", "matplotlib", "mnist1d", "tqdm", "optuna", "tensorboard", "lightning", "transformers")


def _hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_the_error_is_one_sentence_naming_the_extra_and_an_import_error(monkeypatch):
    _hide(monkeypatch, "sklearn", "mnist1d")
    with pytest.raises(MissingExtraError) as caught:
        _extras.check("bunsan bench", ["sklearn", "mnist1d"], "bench")
    assert str(caught.value) == (
        "bunsan bench needs scikit-learn and mnist1d, which are not installed: pip install 'bunsan[bench]'"
    )
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, BunsanError)
    assert caught.value.name == "sklearn"
    assert "\n" not in str(caught.value)


def test_require_imports_what_is_there_and_names_the_extra_of_what_is_not(monkeypatch):
    assert _extras.require("json", "x", "data") is sys.modules["json"]
    assert _extras.available("json") and not _extras.available("no_such_module_of_bunsan")
    _hide(monkeypatch, "tqdm")
    assert not _extras.available("tqdm") and not _extras.available("tqdm.auto")  # a hidden parent hides its modules
    with pytest.raises(
        MissingExtraError, match=r"^the bar needs tqdm, which is not installed: pip install 'bunsan\[progress\]'$"
    ):
        _extras.require("tqdm.auto", "the bar", "progress")
    with pytest.raises(ValueError, match="unknown extra 'nope'"):
        _extras.install_hint("nope")


def test_extras_table_mirrors_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def distributions(extra: str) -> set[str]:
        found: set[str] = set()
        for requirement in declared[extra]:
            name = requirement.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
            if name == "bunsan":  # a self reference: bunsan[data,...]
                for inner in requirement.split("[")[1].split("]")[0].split(","):
                    found |= distributions(inner.strip())
            else:
                found.add(name)
        return found

    for extra, names in {**_extras.EXTRAS, **_extras.FRAMEWORKS}.items():
        assert distributions(extra) == set(names), extra
    assert distributions("all") == set().union(*map(set, _extras.EXTRAS.values()))
    assert set(declared) == {*_extras.EXTRAS, *_extras.FRAMEWORKS, "all", "test"}
    # the suite's extra: everything but tensorboard, whose one test hides it
    assert {"scikit-learn", "mnist1d", "matplotlib", "optuna", "tqdm"} <= distributions("test")


def test_trainer_integrations_name_their_extra(monkeypatch):
    from bunsan.integrations import fabric, lightning, transformers

    _hide(monkeypatch, "lightning", "transformers")
    for module in (fabric, lightning, transformers):
        monkeypatch.setattr(module, "_built", {})
    with pytest.raises(
        MissingExtraError, match=r"^bunsan.integrations.lightning needs lightning, .*'bunsan\[lightning\]'$"
    ):
        lightning.QuantizedDDPStrategy  # noqa: B018 - the class is built on first use
    with pytest.raises(
        MissingExtraError, match=r"^bunsan.integrations.fabric needs lightning, .*'bunsan\[lightning\]'$"
    ):
        fabric.QuantizedFabricStrategy  # noqa: B018
    with pytest.raises(
        MissingExtraError, match=r"^bunsan.integrations.transformers needs transformers, .*'bunsan\[transformers\]'$"
    ):
        transformers.QuantizedHookCallback  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'Other'"):
        lightning.Other  # noqa: B018


def test_bundled_data_sets_name_the_data_extra(monkeypatch):
    from bunsan.datasets import bundled

    _hide(monkeypatch, "sklearn")
    bundled._digits_arrays.cache_clear()  # a load earlier in this process would answer from the cache
    for load in (bundled.digits, bundled.digits32):
        with pytest.raises(MissingExtraError) as caught:
            load()
        assert str(caught.value) == (
            "bunsan.datasets.digits() needs scikit-learn, which is not installed: pip install 'bunsan[data]'"
        )
    _hide(monkeypatch, "mnist1d")
    monkeypatch.setattr(bundled, "_mnist1d_memory", {})
    with pytest.raises(MissingExtraError) as caught:
        bundled.mnist1d(disk_cache=False)
    assert str(caught.value) == (
        "bunsan.datasets.mnist1d() needs mnist1d, which is not installed: pip install 'bunsan[data]'"
    )


def test_progress_bar_without_tqdm_falls_back_to_lines_unless_forced(monkeypatch):
    from bunsan.train.callbacks import ProgressPrinter

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert ProgressPrinter(stream=Terminal())._use_bar()  # tqdm installed: a terminal gets the bar
    _hide(monkeypatch, "tqdm")
    assert not ProgressPrinter(stream=Terminal())._use_bar()  # without tqdm: the lines only
    assert not ProgressPrinter(bar=False)._use_bar()
    with pytest.raises(
        MissingExtraError, match=r"needs tqdm, which is not installed: pip install 'bunsan\[progress\]'$"
    ):
        ProgressPrinter(bar=True)


def test_plots_name_their_extra(monkeypatch, tmp_path):
    from bunsan import hpo
    from bunsan.bench import plots

    _hide(monkeypatch, "matplotlib")
    with pytest.raises(MissingExtraError, match=r"^a benchmark plot needs matplotlib, .*'bunsan\[bench\]'$"):
        plots.new_figure(1)
    with pytest.raises(MissingExtraError, match=r"^bunsan.hpo.save_plots\(\) needs matplotlib, .*'bunsan\[hpo\]'$"):
        hpo.save_plots(None, tmp_path)  # checked before the study is read
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "hidden", "sentence"),
    [
        (
            ["bench", "compare", "--dry-run"],
            ("matplotlib",),
            "bunsan bench needs matplotlib, which is not installed: pip install 'bunsan[bench]'",
        ),
        (
            ["bench", "throughput", "--dry-run"],
            ("sklearn", "mnist1d"),
            "bunsan bench needs scikit-learn and mnist1d, which are not installed: pip install 'bunsan[bench]'",
        ),
    ],
    ids=["bench-compare", "bench-throughput"],
)
def test_cli_says_which_extra_in_one_line_and_exits_2(monkeypatch, capsys, argv, hidden, sentence):
    _hide(monkeypatch, *hidden)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"bunsan: error: {sentence}\n"


def test_plan_runs_without_matplotlib_and_says_where_the_plot_went(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "matplotlib")
    png = tmp_path / "plan.png"
    argv = ["plan", "--compute-ms", "100", "--params", "1000000", "--workers", "2,4", "--png", str(png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "exact" in out and not png.exists()
    assert "PNG: none, matplotlib is not installed (pip install 'bunsan[bench]' draws it)" in out


def test_version(monkeypatch, capsys):
    from importlib import metadata

    import bunsan

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"bunsan {metadata.version('bunsan')}\n"

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)  # a source tree on sys.path, not installed
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"bunsan {bunsan.__version__}\n"


def test_every_module_imports_without_any_optional_package():
    """Training, the launcher and the CLI need torch and numpy only: every module of bunsan imports without extras."""
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys

        class Missing:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in {OPTIONAL_MODULES!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

        sys.meta_path.insert(0, Missing())
        import bunsan
        for module in pkgutil.walk_packages(bunsan.__path__, "bunsan."):
            importlib.import_module(module.name)
        from bunsan import cli
        assert cli.main(["run", "--dry-run", "-np", "2", "examples/train_digits_distributed.py"]) == 0
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), result.stdout + result.stderr


def test_a_benchmark_started_as_python_m_names_its_extra(monkeypatch, capsys):
    from bunsan.bench import compare

    _hide(monkeypatch, "matplotlib")
    assert compare.main(["--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "bunsan bench compare: error: bunsan bench needs matplotlib, which is not installed: pip install 'bunsan[bench]'\n"
    )
