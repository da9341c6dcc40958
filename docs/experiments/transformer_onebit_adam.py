"""A small transformer trained with AdamW under exact and 1-bit data parallelism.

The task is next-token prediction on sequences drawn from a random second-order
Markov chain over 16 tokens, so the best possible held-out loss is known: the
cross-entropy of the chain's own conditional probabilities on the held-out
sequences ("oracle"). Each setting reports its held-out loss and its excess over
that oracle; the question is whether 1 bit's excess stays near exact training's.

Model and training (as a user would write them): token and position embeddings,
a 2-layer ``nn.TransformerEncoder`` (d=64, 4 heads, causal mask), AdamW (lr 1e-2,
betas (0.9, 0.98), weight decay 0.01), gradient clipping at 1.0, a linear
learning-rate warm-up over the first 10% of steps and a cosine decay to zero,
200 steps, 32 sequences per worker per step.

Settings, trained one after another in the same job from the same initial model
on the same batches:

* ``exact``: ``DataParallelSGD()``;
* ``1 bit``: ``DataParallelSGD(bits=1, warm_start=<the learning-rate warm-up's samples>)``:
  exact averaging through the warm-up, then Adam's variance frozen and the momentum
  compressed with error feedback (bunsan.algorithms.onebit_adam; the freeze point
  as 0/1 Adam advises);
* ``1 bit, Adam on decoded gradients``: ``local_momentum=False``, so AdamW runs on
  the quantized average gradient (what bunsan did before; for contrast).

More rows with ``--settings``: ``1bit_beta1`` (the workers' beta1 not capped,
``quantized_momentum=None``), ``1bit_plain`` (unrotated chunks of 512),
``frozen16`` (16 bits with the frozen variance: the cost of the freeze alone).

Clipping is written as a user writes it, ``clip_grad_norm_`` between backward and
step; which gradients it reaches depends on when DataParallelSGD completes its
exchange (it was started during backward from the gradients as they came), the
same for every row.

Run (20-40 s per setting here, under load)::

    bunsan run -np 2 python docs/experiments/transformer_onebit_adam.py
    bunsan run -np 2 python docs/experiments/transformer_onebit_adam.py --seed 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import bunsan
from bunsan.algorithms.data_parallel import DataParallelSGD

VOCAB, LENGTH = 16, 32


def markov_chain(seed: int) -> torch.Tensor:
    """(VOCAB, VOCAB, VOCAB): probabilities of the next token given the last two, peaked (softmax of 3 N(0, 1))."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g), dim=-1)


def sample_sequences(chain: torch.Tensor, count: int, g: torch.Generator) -> torch.Tensor:
    tokens = torch.empty(count, LENGTH + 1, dtype=torch.long)
    tokens[:, :2] = torch.randint(0, VOCAB, (count, 2), generator=g)
    for t in range(2, LENGTH + 1):
        probabilities = chain[tokens[:, t - 2], tokens[:, t - 1]]
        tokens[:, t] = torch.multinomial(probabilities, 1, generator=g).squeeze(1)
    return tokens


def oracle_loss(chain: torch.Tensor, tokens: torch.Tensor) -> float:
    """Mean cross-entropy of the chain itself on the predictable positions (2..LENGTH)."""
    p = chain[tokens[:, : LENGTH - 1], tokens[:, 1:LENGTH]]  # the context of targets 2..LENGTH
    target = tokens[:, 2 : LENGTH + 1]
    return float(-torch.log(p.gather(-1, target.unsqueeze(-1)).squeeze(-1)).mean())


class TinyTransformer(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.position = nn.Parameter(torch.randn(LENGTH, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LENGTH), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.encoder(h, mask=self.mask, is_causal=True))


def loss_on(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss on positions 2..LENGTH (the first two have no full context, as for the oracle)."""
    logits = model(tokens[:, :LENGTH])
    return F.cross_entropy(logits[:, 1:].reshape(-1, VOCAB), tokens[:, 2:].reshape(-1))


def train(
    label: str, algorithm: DataParallelSGD, args: argparse.Namespace, chain: torch.Tensor, held_out: torch.Tensor
) -> dict[str, float]:
    torch.manual_seed(args.seed)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    model, optimizer = bunsan.distribute(model, optimizer, algorithm)
    warm = max(1, round(args.steps * args.warm_fraction))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer,
        lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (args.steps - warm))),
    )
    g = torch.Generator().manual_seed(1000 * args.seed + bunsan.rank())  # each worker its own sequences
    start = time.perf_counter()
    for _ in range(args.steps):
        tokens = sample_sequences(chain, args.batch, g)
        optimizer.zero_grad()
        loss_on(model, tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        held = float(loss_on(model, held_out))
    return {
        "setting": label,
        "held_out_loss": held,
        "seconds": seconds,
        "bytes_per_step": algorithm.stats().get("bytes_sent_per_step", float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="sequences per worker per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here (rank 0)")
    parser.add_argument(
        "--settings",
        default="exact,1bit,decoded",
        help="which of exact, 1bit, 1bit_beta1, 1bit_plain, frozen16, decoded to train",
    )
    parser.add_argument("--warm-fraction", type=float, default=0.1, help="learning-rate warm-up, fraction of steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bunsan.init()
    chain = markov_chain(args.seed)
    held_out = sample_sequences(chain, 2000, torch.Generator().manual_seed(999))
    best = oracle_loss(chain, held_out)
    warm_samples = max(1, round(args.steps * args.warm_fraction)) * args.batch * bunsan.size()
    settings = {
        "exact": ("exact", lambda: DataParallelSGD()),
        "1bit": ("1 bit", lambda: DataParallelSGD(bits=1, warm_start=warm_samples)),
        "1bit_beta1": (
            "1 bit, workers' beta1 not capped",
            lambda: DataParallelSGD(bits=1, warm_start=warm_samples, quantized_momentum=None),
        ),
        "1bit_plain": (
            "1 bit, unrotated chunks of 512",
            lambda: DataParallelSGD(bits=1, warm_start=warm_samples, rotate=False, chunk_size=512),
        ),
        "frozen16": ("16 bits, frozen variance", lambda: DataParallelSGD(bits=16, warm_start=warm_samples)),
        "decoded": (
            "1 bit, Adam on decoded gradients",
            lambda: DataParallelSGD(bits=1, warm_start=warm_samples, local_momentum=False),
        ),
    }
    chosen = [settings[name] for name in args.settings.split(",")]
    rows = [train(label, make(), args, chain, held_out) for label, make in chosen]
    if bunsan.is_main():
        exact_excess = rows[0]["held_out_loss"] - best
        print(
            f"transformer (2 layers, d=64), AdamW, {args.steps} steps, {bunsan.size()} workers x {args.batch} "
            f"sequences, seed {args.seed}; oracle held-out loss {best:.4f}"
        )
        print(f"{'setting':<34} {'held-out loss':>13} {'excess':>8} {'excess / exact':>14} {'s':>6}")
        for row in rows:
            row["excess"] = row["held_out_loss"] - best
            row["excess_vs_exact"] = row["excess"] / exact_excess if exact_excess > 0 else float("nan")
            print(
                f"{row['setting']:<34} {row['held_out_loss']:>13.4f} {row['excess']:>8.4f} "
                f"{row['excess_vs_exact']:>14.2f} {row['seconds']:>6.1f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"oracle": best, "rows": rows, "args": vars(args)}, f, indent=1)
    bunsan.finalize()


if __name__ == "__main__":
    main()
