"""Every command and code snippet of README.md is run, so a renamed flag or function fails CI.

The README's fenced blocks are read here and each one is checked by what it is:

* ``diff``: equals the real ``diff`` of the two example scripts.
* ``bash``: every command line must match one entry of :data:`COMMANDS`; the entry either runs the
  command as written (on the bundled data) or names the test that runs it and checks that test
  exists. A command with no entry fails the test: a new README command needs a test first.
* ``python``: run as written inside a 2-worker job, between a prelude that defines what the
  snippet uses (a small model, an optimizer, data) and a few training steps after it.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TIMEOUT_S = 240


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block of ``text``, in order. Pure."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```\s*$", text, re.M | re.S)]


def command_lines(body: str) -> list[str]:
    """The commands of a shell block: one a line, trailing ``# comments`` and blank lines dropped. Pure."""
    lines = []
    for line in body.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            lines.append(shlex.join(words))
    return lines


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return env


def _argv(command: str) -> list[str]:
    """The README's command as this interpreter runs it (``bunsan``, ``torchrun`` and ``python`` from its venv)."""
    words = shlex.split(command)
    head = {
        "bunsan": [sys.executable, "-m", "bunsan"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "python": [sys.executable],
    }.get(words[0], [words[0]])
    rest = [sys.executable if w == "python" else w for w in words[1:]]
    return head + rest


def _run(command: str) -> str:
    proc = subprocess.run(
        _argv(command),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"README command failed: {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _runs_the_digits_example(command: str) -> None:
    out = _run(command)
    accuracy = float(re.findall(r"final test accuracy ([0-9.]+)", out)[-1])
    assert accuracy > 0.9, out  # 12 epochs of the digits CNN; chance is 0.1


def _launcher(name: str) -> Callable[[str], None]:
    def check(command: str) -> None:
        if name != "torchrun" and shutil.which(name) is None:  # torchrun is torch's module, always here
            pytest.skip(f"{name} is not installed here; the launcher's variables are tested in test_runtime_env.py")
        if name == "mpirun":  # OpenMPI refuses root without the flag, and counts cores, not hardware threads
            command = command.replace("mpirun ", "mpirun --allow-run-as-root --oversubscribe -x PYTHONPATH ", 1)
        _runs_the_digits_example(command)

    return check


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _extras_exist(command: str) -> None:
    wanted = re.findall(r"\[([a-z,]+)\]", command)
    extras = _pyproject()["project"]["optional-dependencies"]
    for group in wanted:
        for extra in group.split(","):
            assert extra in extras, f"README installs bunsan[{extra}], which pyproject.toml does not define"
    _delegated("tests/packaging/test_wheel.py")(command)


def _torch_pin(command: str) -> None:
    makefile = (ROOT / "Makefile").read_text()
    spec = shlex.split(command)[2]
    assert f"TORCH_SPEC ?= {spec}" in makefile, f"README pins {spec}, the Makefile another torch"
    _delegated("tests/packaging/test_wheel.py")(command)


def _make_target(command: str) -> None:
    target = shlex.split(command)[1]
    recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None, f"the Makefile has no target {target!r}"
    if target == "demo":  # the demo's own command is run by the bunsan run entry below
        assert "bunsan run -np 2 examples/train_digits_distributed.py" in recipe.group(1)


def _delegated(test_file: str, name_contains: str = "def test_") -> Callable[[str], None]:
    def check(command: str) -> None:
        path = ROOT / test_file
        assert path.is_file() and name_contains in path.read_text(), f"{command!r} is run by {test_file}, missing"

    return check


def _plan(command: str) -> None:
    out = _run(command)
    assert "exact" in out and "1-bit" in out and "block_momentum" in out, out


# (pattern, check): the first pattern that matches a README command decides how it is tested.
COMMANDS: list[tuple[str, Callable[[str], None]]] = [
    (r"pip install torch==\S+", _torch_pin),
    (r"pip install \.$", _delegated("tests/packaging/test_wheel.py")),
    (r"pip install '\.\[[a-z,]+\]'", _extras_exist),
    (r"make (demo|test)", _make_target),
    (r"bunsan run -np 2 examples/train_digits_distributed\.py", _runs_the_digits_example),
    (r"torchrun --nproc-per-node 2 examples/train_digits_distributed\.py", _launcher("torchrun")),
    (r"mpirun -np 2 python examples/train_digits_distributed\.py", _launcher("mpirun")),
    (r"srun -n 2 python examples/train_digits_distributed\.py", _launcher("srun")),
    (r"bunsan plan ", _plan),
]


def _readme_commands() -> list[str]:
    return [c for lang, body in fenced_blocks(README.read_text()) if lang == "bash" for c in command_lines(body)]


def test_every_readme_block_has_a_known_language():
    languages = {lang for lang, _ in fenced_blocks(README.read_text())}
    assert languages <= {"bash", "diff", "python"}, languages


def test_every_readme_command_has_a_test():
    commands = _readme_commands()
    assert len(commands) >= 8, commands
    uncovered = [c for c in commands if not any(re.match(p, c) for p, _ in COMMANDS)]
    assert not uncovered, f"README commands no test runs: {uncovered}; add an entry to COMMANDS"


@pytest.mark.timeout(TIMEOUT_S * 2)
@pytest.mark.parametrize("command", _readme_commands())
def test_readme_command_runs(command):
    check = next(check for pattern, check in COMMANDS if re.match(pattern, command))
    check(command)


def test_readme_diff_is_the_real_diff():
    diffs = [body for lang, body in fenced_blocks(README.read_text()) if lang == "diff"]
    assert len(diffs) == 1
    proc = subprocess.run(
        ["diff", "examples/train_digits.py", "examples/train_digits_distributed.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr  # diff exits 1 when the files differ
    assert diffs[0] == proc.stdout


_PRELUDE = """
import torch, bunsan
bunsan.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
"""
_AFTER = """
x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
for step in range(4):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x[bunsan.rank()::bunsan.size()]), y[bunsan.rank()::bunsan.size()]).backward()
    optimizer.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(bunsan.size())]
torch.distributed.all_gather(gathered, flat)
assert all(torch.equal(g, gathered[0]) for g in gathered), "replicas differ"
bunsan.print("README snippet ok")
bunsan.finalize()
"""


@pytest.mark.timeout(TIMEOUT_S)
def test_readme_python_snippets_run(tmp_path):
    snippets = [body for lang, body in fenced_blocks(README.read_text()) if lang == "python"]
    assert snippets
    for i, snippet in enumerate(snippets):
        ast.parse(snippet)
        script = tmp_path / f"snippet_{i}.py"
        script.write_text(_PRELUDE + snippet + _AFTER)
        out = _run(f"bunsan run -np 2 python {script}")
        assert "README snippet ok" in out, out


def test_command_lines_and_blocks_parse_as_the_readme_writes_them():
    text = "x\n```bash\nbunsan run -np 2 a.py   # comment\n\n# only a comment\n```\n```python\nprint(1)\n```\n"
    blocks = fenced_blocks(text)
    assert blocks == [("bash", "bunsan run -np 2 a.py   # comment\n\n# only a comment\n"), ("python", "print(1)\n")]
    assert command_lines(blocks[0][1]) == ["bunsan run -np 2 a.py"]
