"""The TrainingSession script of tests/launch/test_elastic_session.py: the same script under ``bunsan run --min-np``
(each worker an elastic member) and alone (``REF_DIR`` set: one process on the global batch, the reference).

A small MLP on a synthetic set whose second tensor is each sample's id; the session has a minibatch schedule
that changes after the first epoch, a per-sample learning rate, momentum as a time constant, a metric,
cross-validation at each epoch's end with a callback that halves the rate and keeps the best error (in
``extra_state`` and in its own ``state_dict``), checkpoints and a final test. A callback appends each
committed step's epoch and the ids this worker trained to ``$LOG_DIR/<replica>.jsonl``; at the end each
worker writes ``final-<replica>.json`` and ``model-<replica>.pt``. ``KILL_RANK``/``KILL_STEP``: that slot's
first worker SIGKILLs itself in its loss of the job's step ``KILL_STEP`` (mid-step); ``WAIT_JOIN``: while the
job is short of its starting size, a step ends only once a restarted worker is about to train (it writes
``ready-<replica>`` before ``train()``), and then ``STEP_SLEEP`` seconds later, time for it to join a quorum.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import bunsan
from bunsan.train import Callback, Checkpoint, CrossValidation, Test, TrainingSession, classification_error, schedule

SAMPLES, FEATURES, CLASSES, EPOCHS = 300, 8, 4, 3


def tensors(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    return x, torch.arange(n), (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


class Net(torch.nn.Module):
    """The model gets ``(x, ids)`` and remembers the ids of its last training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen = ids.tolist()
        return self.body(x)


class HalveAndKeepBest:
    """The cross-validation callback: halve the rate, keep the best error (its own state and extra_state)."""

    def __init__(self) -> None:
        self.session: TrainingSession | None = None
        self.best = float("inf")

    def __call__(self, index: int, error: float, samples: int, minibatches: int) -> bool:
        assert self.session is not None
        self.best = min(self.best, error)
        self.session.learning_rate_per_sample *= 0.5
        self.session.extra_state["best"] = self.best
        return True

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]


class LogSteps(Callback):
    def __init__(self, log, model: Net, out: Path) -> None:
        self.log, self.model, self.out = log, model, out
        self.wait, self.pause = bool(os.environ.get("WAIT_JOIN")), float(os.environ.get("STEP_SLEEP", "0"))

    def on_step_end(self, session: TrainingSession, samples: int) -> None:
        if self.log is not None:
            record = {"epoch": session.epoch, "step": session.steps, "ids": self.model.seen}
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        self.model.seen = []
        member = bunsan.elastic.current()
        if self.wait and member is not None and member.size() < member.start_size:
            deadline = time.monotonic() + 120  # short of a worker: give the restarted one time to join
            while not any(self.out.glob("ready-*")) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(self.pause)


def main() -> None:
    reference = os.environ.get("REF_DIR")
    if not reference:
        bunsan.init()
    member = bunsan.elastic.current()
    out = Path(reference or os.environ["LOG_DIR"])
    name = member.replica if member is not None else "reference"
    restart = os.environ.get("BUNSAN_RESTART") or "0"
    kill = member is not None and restart == "0" and bunsan.rank() == int(os.environ.get("KILL_RANK", "-1"))
    kill_step = int(os.environ.get("KILL_STEP", "-1"))
    torch.manual_seed(0)
    model = Net()

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if kill and model.training and member.step_count() == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # before the step's exchanges: the others' fail
        return F.cross_entropy(output, target)

    control = HalveAndKeepBest()
    with open(out / f"{name}.jsonl", "w") as log:
        session = TrainingSession(
            model,
            loss_fn,
            torch.optim.SGD(model.parameters(), lr=0.0),  # lr and momentum come from the schedules
            None,
            tensors(SAMPLES, seed=1),
            minibatch_size=schedule([40, 60], epoch_size=SAMPLES),  # 8 steps in epoch 0 (the last of 20), then 5
            max_epochs=EPOCHS,
            metrics={"error": classification_error},
            learning_rate_per_sample=0.004,
            momentum_time_constant=schedule([0, 200], epoch_size=SAMPLES),
            checkpoint=Checkpoint(out / "ckpt" / "run.pt", keep=None),
            cross_validation=CrossValidation(tensors(50, seed=2), callback=control, minibatch_size=16),
            test=Test(tensors(70, seed=3), minibatch_size=32),
            progress=member is not None,
            callbacks=[LogSteps(log, model, out)],
        )
        control.session = session
        if restart != "0":
            (out / f"ready-{name}").write_text("")
        summary = session.train()
    params = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    final = {
        "digest": hashlib.sha1(params).hexdigest(),
        "samples": summary.samples,
        "steps": summary.steps,
        "epoch_losses": [e.loss for e in summary.epochs],
        "epoch_errors": [e.metrics["error"] for e in summary.epochs],
        "cv_errors": [r.error for r in summary.cross_validations],
        "test_loss": summary.test.loss if summary.test else None,
        "lr": session.learning_rate_per_sample,
        "extra_state": session.extra_state,
        "best": control.best,
        "restored_from": session.restored_from,
        "dropped": summary.stats.get("dropped_steps", 0.0),
    }
    (out / f"final-{name}.json").write_text(json.dumps(final))
    torch.save(model.state_dict(), out / f"model-{name}.pt")
    if not reference:
        bunsan.finalize()


if __name__ == "__main__":
    main()
