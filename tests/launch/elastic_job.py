"""The training script of the elastic tests (tests/launch/test_elastic.py), run under ``bunsan run --min-np``.

The README's loop with ``bunsan.epochs``: a small MLP on a synthetic set whose third tensor is each sample's
id. Every committed step appends its epoch and the ids this worker trained to ``$LOG_DIR/<replica>.jsonl``;
at the end each worker writes ``$LOG_DIR/final-<replica>.json`` (a digest of its parameters, the steps it
committed, the job's committed count). ``KILL_RANK``/``KILL_STEP``: that slot's first worker SIGKILLs itself
after the forward pass of its step ``KILL_STEP`` (mid-step: the others' exchange, in their backward, fails); ``KILL_ON_DROP``: that
slot's first worker SIGKILLs itself as soon as a step of its is dropped (a second death during the recovery);
``STEP_SLEEP``: seconds to wait after each step while the group is short of its starting size;
``GROW_TO``/``GROW_AT``: from committed step ``GROW_AT`` on, wait after each step (60 s at most) until the
quorum has ``GROW_TO`` members (a group that grows, tests/launch/test_elastic.py).
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

SAMPLES, FEATURES, CLASSES = 600, 8, 4


def data_and_model() -> tuple[torch.utils.data.TensorDataset, torch.nn.Module]:
    """The samples (with their ids) and the initial model, the same in every process."""
    torch.manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    data = torch.utils.data.TensorDataset(x, y, torch.arange(SAMPLES))
    return data, torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))


def main() -> None:
    bunsan.init()
    data, model = data_and_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = bunsan.distribute(model, optimizer)
    loader = bunsan.data.loader(data, batch_size=int(os.environ.get("BATCH", "20")), shuffle=True)
    member = bunsan.elastic.current()
    log_dir = Path(os.environ["LOG_DIR"])
    restart = os.environ.get("BUNSAN_RESTART") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    first_start = restart == "0"
    kill = first_start and bunsan.rank() == int(os.environ.get("KILL_RANK", "-1"))
    clip = float(os.environ.get("CLIP", "0"))
    kill_on_drop = int(os.environ.get("KILL_ON_DROP", "-1"))
    kill_step, pause = int(os.environ.get("KILL_STEP", "-1")), float(os.environ.get("STEP_SLEEP", "0"))
    grow_to, grow_at = int(os.environ.get("GROW_TO", "0")), int(os.environ.get("GROW_AT", "0"))
    grow_until = time.monotonic() + 60
    committed = 0
    with open(log_dir / f"{member.replica}.jsonl", "w") as log:
        for epoch in bunsan.epochs(int(os.environ.get("EPOCHS", "4"))):
            for xb, yb, ids in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                if kill and member.step_count() == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)  # before its backward: the others' exchange fails
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # sees the global batch's gradient
                optimizer.step()
                if not optimizer.committed and first_start and bunsan.rank() == kill_on_drop:
                    os.kill(os.getpid(), signal.SIGKILL)  # a second death while the group is rebuilt
                if optimizer.committed:
                    committed += 1
                    log.write(json.dumps({"epoch": epoch, "step": member.step_count(), "ids": ids.tolist()}) + "\n")
                    log.flush()
                if member.size() < member.start_size:
                    time.sleep(pause)  # short of a worker: give the restarted one time to join
                if member.step_count() >= grow_at and member.size() < grow_to and time.monotonic() < grow_until:
                    time.sleep(0.5)  # the group is to grow: give the new worker time to join
    digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    final = {"rank": bunsan.rank(), "digest": digest, "committed": committed, "steps": member.step_count()}
    (log_dir / f"final-{member.replica}.json").write_text(json.dumps(final))
    torch.save(model.state_dict(), log_dir / f"model-{member.replica}.pt")
    bunsan.finalize()


if __name__ == "__main__":
    main()
