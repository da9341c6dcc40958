"""A training job SIGKILLed after a checkpoint, restarted with ``bunsan run``, ends where an
uninterrupted job ends, bit for bit.

Two real launches of 2 workers (about 5 s each here, mostly interpreter and torch
start-up). The first trains a reference run to the end, then the same run again
until its epoch-2 checkpoint exists, when rank 0 sends itself SIGKILL, so the
launcher tears the job down as after a crash. The second launch restores that
run and finishes it. The final parameters of the reference and of the restored
run are compared. (Each session seeds its model and restores every random state
it depends on, so the reference sharing a process with the killed run does not
change either.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers.environment import without_bunsan_settings

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
    import os, signal, sys

    import torch
    import torch.nn.functional as F
    from torch import nn

    import bunsan
    from bunsan.train import Callback, Checkpoint, TrainingSession, classification_error, schedule

    bunsan.init()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(67, 1, 6, 6, generator=g), torch.randint(0, 3, (67,), generator=g)


    class KillAfter(Callback):
        def __init__(self, epochs):
            self.epochs = epochs

        def on_epoch_end(self, session, epoch):
            if epoch.epoch + 1 == self.epochs and session.is_main:
                print("killing myself after epoch", self.epochs, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup, no finally


    def train(out, kill_after=0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2),
                              nn.Linear(144, 16), nn.ReLU(), nn.Linear(16, 3))
        session = TrainingSession(
            model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0), "data_parallel", (x, y),
            minibatch_size=schedule([16, 24], epoch_size=40), max_epochs=4, metrics={"error": classification_error},
            learning_rate_per_sample=0.02, momentum_time_constant=schedule([0, 64], epoch_size=60),
            checkpoint=Checkpoint(os.path.join(out, "ckpt", "run.pt"), every=40), callbacks=[KillAfter(kill_after)],
            progress=False,
        )
        summary = session.train()
        if bunsan.is_main():
            torch.save({"params": dict(model.state_dict()), "losses": [e.loss for e in summary.epochs],
                        "restored_from": summary.restored_from}, os.path.join(out, "final.pt"))


    if sys.argv[1] == "first":
        train("straight")  # the reference: never stops
        train("interrupted", kill_after=2)  # SIGKILLed after its epoch-2 checkpoint
    else:
        train("interrupted")  # restores and finishes
    bunsan.finalize()
"""


def _run(script: Path, cwd: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = without_bunsan_settings()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "bunsan", "run", "-np", "2", str(script), mode],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher's process hygiene needs Linux")
def test_killed_job_restores_and_ends_like_an_uninterrupted_one(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"

    killed = _run(script, tmp_path, "first")
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert "killing myself after epoch 2" in killed.stdout, killed.stdout + killed.stderr
    assert (straight / "final.pt").exists() and not (interrupted / "final.pt").exists()
    written = sorted(p.name for p in (interrupted / "ckpt").iterdir())
    assert "run.000000000132.pt" in written, written  # 2 epochs x 66 samples

    resumed = _run(script, tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    a = torch.load(interrupted / "final.pt", weights_only=True)
    b = torch.load(straight / "final.pt", weights_only=True)
    assert a["restored_from"].endswith("run.000000000132.pt") and b["restored_from"] is None
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    assert a["losses"] == b["losses"]
