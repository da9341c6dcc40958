"""One-process simulation of DataParallelSGD(bits=1) on MNIST-1D, to ask *why* 1 bit
fails with heavy SGD momentum (docs/experiments/design-notes.md, "1 bit and heavy momentum").

N simulated workers take interleaved shares of each global minibatch. Each quantizes
its mean-scaled gradient with its own residual (stage 1); the decoded sum is quantized
again with a second residual (stage 2, the stripe owner's re-quantization), and the
result goes to torch.optim.SGD. This is the arithmetic of the real striped exchange
without the processes, so variants the package does not ship can be tried in a minute:

  --mode exact | after | local | owner
                                 exact averaging; momentum applied by the optimizer
                                 after decompression; momentum taken per worker before
                                 compression (Zheng et al. 2019); momentum taken by the
                                 stripe owner on the decoded mean gradient, then the
                                 momentum compressed (stage 2) and applied as it is
  --codec twomeans | rotated | scaledsign | dither | none
                                 Seide et al. 2014's two means per chunk (the package's
                                 codec); the same after a random rotation of each chunk
                                 (the package's rotate=True); sign times the chunk's mean
                                 |x| (Karimireddy et al. 2019, "Error Feedback Fixes
                                 SignSGD"); unbiased stochastic rounding between the two
                                 means; no quantization (must reproduce --mode exact)
  --stages 1 | 2                 without / with the owner's second quantization
  --vary-signs                   with --codec rotated: new random signs every step
  --bits, --owner-bits (stage 2), --chunk, --warm (epochs of exact averaging first)

Run from the repository root, e.g. (about a minute each on one core):

  .venv/bin/python docs/experiments/one_bit_momentum.py --mode after --momentum 0.9 --lr 0.05 --warm 10
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bunsan.compression import Quantizer
from bunsan.compression.rotation import RotatedQuantizer
from bunsan.datasets import mnist1d
from bunsan.models import MNIST1DCNN


def chunked(values: torch.Tensor, chunk: int, fn) -> torch.Tensor:
    out = torch.empty_like(values)
    for start in range(0, values.numel(), chunk):
        out[start : start + chunk] = fn(values[start : start + chunk])
    return out


def two_means(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pos = c >= 0
    hi = c[pos].mean() if pos.any() else c.new_zeros(())
    lo = c[~pos].mean() if (~pos).any() else c.new_zeros(())
    return lo, hi


def dither(c: torch.Tensor) -> torch.Tensor:
    lo, hi = two_means(c)
    if hi <= lo:
        return torch.where(c >= 0, hi, lo)
    up = ((c - lo) / (hi - lo)).clamp(0, 1)
    return torch.where(torch.rand_like(c) < up, hi, lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--mode", choices=["exact", "after", "local", "owner"], default="local")
    ap.add_argument("--codec", choices=["twomeans", "scaledsign", "dither", "rotated", "none"], default="twomeans")
    ap.add_argument("--stages", type=int, choices=[1, 2], default=2)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument(
        "--local-beta",
        type=float,
        default=None,
        help="with --mode local: the workers' momentum while quantizing, the gradient scaled by "
        "(1 - local_beta) / (1 - momentum) so that the steady step lr / (1 - momentum) is kept",
    )
    ap.add_argument("--owner-bits", type=int, default=None, help="bits of stage 2 (default: --bits)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warm", type=int, default=0, help="epochs of exact averaging first")
    ap.add_argument("--batch", type=int, default=128, help="global minibatch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vary-signs",
        action="store_true",
        help="with --codec rotated: new random signs every step (the package keeps them fixed)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    n = a.workers
    quantizer = Quantizer(a.bits, a.chunk)
    rotated_quantizer = RotatedQuantizer(a.bits, a.chunk) if a.codec == "rotated" else None
    owner_bits = a.owner_bits or a.bits
    owner_quantizer = (RotatedQuantizer if a.codec == "rotated" else Quantizer)(owner_bits, a.chunk)

    drop = [0.0, 0]  # sum of ||v - C(v)||^2 / ||v||^2 over stage-1 encodes, and their count

    def compress(x: torch.Tensor, residual: torch.Tensor, stage1: bool = False) -> torch.Tensor:
        v = x + residual
        if a.codec in ("twomeans", "rotated"):
            codec = quantizer if rotated_quantizer is None else rotated_quantizer
            if not stage1:
                codec = owner_quantizer
            out = codec.decode(codec.encode_with_feedback(x, residual), x.numel())
            if stage1 and v.norm() > 0:
                drop[0] += float((v - out).norm() ** 2 / v.norm() ** 2)
                drop[1] += 1
            return out
        if a.codec == "scaledsign":
            out = chunked(v, a.chunk, lambda c: c.abs().mean() * torch.where(c >= 0, 1.0, -1.0))
        elif a.codec == "dither":
            out = chunked(v, a.chunk, dither)
        else:
            out = v.clone()
        residual.copy_(v - out)
        if stage1 and v.norm() > 0:
            drop[0] += float((v - out).norm() ** 2 / v.norm() ** 2)
            drop[1] += 1
        return out

    train, test = mnist1d("train"), mnist1d("test")
    x_all, y_all = train.tensors
    model = MNIST1DCNN()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=a.lr, momentum=a.momentum)
    worker_res = [[torch.zeros(p.numel()) for p in params] for _ in range(n)]
    owner_res = [torch.zeros(p.numel()) for p in params]
    worker_mom = [[torch.zeros(p.numel()) for p in params] for _ in range(n)]
    owner_mom = [torch.zeros(p.numel()) for p in params]
    for epoch in range(a.epochs):
        quantized = a.mode != "exact" and epoch >= a.warm
        local = quantized and a.mode == "local"
        owner = quantized and a.mode == "owner"
        if owner and epoch == a.warm and a.warm > 0:  # continue from the global momentum
            for k, p in enumerate(params):
                owner_mom[k] = opt.state[p]["momentum_buffer"].reshape(-1).clone()
        if local and epoch == a.warm and a.warm > 0:  # continue from the global momentum
            for w in range(n):
                for k, p in enumerate(params):
                    worker_mom[w][k] = opt.state[p]["momentum_buffer"].reshape(-1).clone()
        perm = torch.randperm(len(y_all))
        for i in range(0, len(y_all) - a.batch + 1, a.batch):
            idx = perm[i : i + a.batch]
            grads = []
            for w in range(n):
                model.zero_grad()
                F.cross_entropy(model(x_all[idx[w::n]]), y_all[idx[w::n]]).backward()
                grads.append([p.grad.reshape(-1).clone() for p in params])
            if a.vary_signs and rotated_quantizer is not None:  # the same new signs on every worker
                rotated_quantizer = RotatedQuantizer(a.bits, a.chunk, seed=epoch * 100_000 + i)
            for k, p in enumerate(params):
                if not quantized:
                    g = sum(gr[k] for gr in grads) / n
                else:
                    sent = []
                    for w in range(n):
                        u = grads[w][k]
                        if local and a.local_beta is not None:
                            scale = (1 - a.local_beta) / (1 - a.momentum)
                            u = worker_mom[w][k].mul_(a.local_beta).add_(u, alpha=scale)
                        elif local:
                            u = worker_mom[w][k].mul_(a.momentum).add_(u)
                        sent.append(compress(u / n, worker_res[w][k], stage1=True))
                    g = sum(sent)
                    if owner:
                        g = owner_mom[k].mul_(a.momentum).add_(g)
                    if a.stages == 2:
                        g = compress(g, owner_res[k])
                p.grad = g.view_as(p).clone()
            if local or owner:
                for group in opt.param_groups:
                    group["momentum"] = 0.0
            opt.step()
            for group in opt.param_groups:
                group["momentum"] = a.momentum
        with torch.no_grad():
            err = (model(test.tensors[0]).argmax(1) != test.tensors[1]).float().mean().item()
        res = sum(float(r.norm() ** 2) for r in owner_res) ** 0.5
        lost = f"  stage-1 relative squared error {drop[0] / drop[1]:.2f}" if drop[1] else ""
        drop[0], drop[1] = 0.0, 0
        print(f"epoch {epoch:2d}  test error {100 * err:5.1f}%  owner residual norm {res:.3g}{lost}", flush=True)


if __name__ == "__main__":
    main()
