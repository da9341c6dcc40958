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
``ALGORITHM=name:K``: ``block_momentum`` or ``model_averaging`` in blocks of ``K`` batches per worker; each
block's batches are logged when it commits (the member's commit hook), forgotten when it is dropped;
``bits:K``: ``DataParallelSGD(bits=K)``, a step per batch.
``SCALER=1``: a ``GradScaler`` (registered for joiners) scales the loss, unscales before clipping;
``INF_STEP``: slot 0 makes its loss infinite once, at that step, so every worker skips it.
``KILL_IN_CONNECT``: that slot's first worker SIGKILLs itself when it starts connecting to a new quorum's
group after the first (the others wait for it until ``BUNSAN_ELASTIC_CONNECT_TIMEOUT``).
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
    batch = int(os.environ.get("BATCH", "20"))
    algorithm, _, blocks = os.environ.get("ALGORITHM", "").partition(":")
    if algorithm == "bits":  # DataParallelSGD(bits=K): a step per batch, as exact
        model, optimizer = bunsan.distribute(model, optimizer, bunsan.DataParallelSGD(bits=int(blocks)))
        algorithm = ""
    else:
        options = {"block_size": int(blocks) * batch} if algorithm else {}
        model, optimizer = bunsan.distribute(model, optimizer, algorithm or None, **options)
    loader = bunsan.data.loader(data, batch_size=batch, shuffle=True)
    member = bunsan.elastic.current()
    in_block: list[dict] = []  # a block's batches until it commits
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
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if os.environ.get("SCALER") else None
    if scaler is not None:
        bunsan.elastic.register("scaler", scaler)
    inf_step = int(os.environ.get("INF_STEP", "-1"))
    if first_start and bunsan.rank() == int(os.environ.get("KILL_IN_CONNECT", "-1")):
        connect = member._group._create_pg

        def die_connecting(*args):
            if member.step_count() > 0:  # a quorum after the first: the group is being rebuilt
                os.kill(os.getpid(), signal.SIGKILL)
            return connect(*args)

        member._group._create_pg = die_connecting
    with open(log_dir / f"{member.replica}.jsonl", "w") as log:

        def block_committed() -> None:
            for record in in_block:
                log.write(json.dumps({**record, "step": member.step_count()}) + "\n")
            log.flush()
            in_block.clear()

        if algorithm:
            member.on_commit(block_committed)
            member.on_drop(in_block.clear)
        for epoch in bunsan.epochs(int(os.environ.get("EPOCHS", "2"))):
            for xb, yb, ids in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                if kill and member.step_count() == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)  # before its backward: the others' exchange fails
                if algorithm:  # before step(), which may end the block
                    in_block.append({"epoch": epoch, "ids": ids.tolist()})
                if member.step_count() == inf_step and bunsan.rank() == 0 and first_start:
                    loss, inf_step = loss * float("inf"), -1  # the averaged gradient is infinite on every worker
                (loss if scaler is None else scaler.scale(loss)).backward()
                if scaler is not None:
                    scaler.unscale_(optimizer)
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # sees the global batch's gradient
                if scaler is None:
                    optimizer.step()
                else:
                    scaler.step(optimizer)  # skips the step if the averaged gradient is not finite
                    scaler.update()
                if not optimizer.committed and first_start and bunsan.rank() == kill_on_drop:
                    os.kill(os.getpid(), signal.SIGKILL)  # a second death while the group is rebuilt
                if optimizer.committed and not algorithm:
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
