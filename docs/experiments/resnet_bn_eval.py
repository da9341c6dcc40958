"""ResNet-20 on digits32 with exact DataParallelSGD: each epoch's test error in eval mode (the running
batch-norm statistics, as `bunsan bench compare` evaluates) and with the statistics recomputed over the
training set on a copy of the model (Wu and Johnson 2021, "Rethinking 'Batch' in BatchNorm").

    bunsan run -np 2 docs/experiments/resnet_bn_eval.py SEED LR

Global batch 64, 10 epochs: the campaign's ResNet-20 setting (docs/experiments/plan.md, "ResNet-20: exact SGD's test
error does not level off"); its eval-mode curve is the campaign's exact curve at the same seed.
"""

import copy
import sys

import torch
import torch.nn.functional as F

import bunsan
from bunsan import datasets
from bunsan.bench.job import build_model, evaluate

seed, lr = int(sys.argv[1]), float(sys.argv[2])
bunsan.init()
torch.set_num_threads(1)
torch.manual_seed(seed)
info = datasets.info("digits32")
tr, te = datasets.load("digits32", "train"), datasets.load("digits32", "test")
model = build_model("resnet20", info)
model, opt = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=lr), bunsan.DataParallelSGD())
loader = bunsan.data.loader(tr, batch_size=64 // bunsan.size(), shuffle=True, seed=seed)
x_all, _ = tr.tensors


def precise(m: torch.nn.Module) -> torch.nn.Module:
    """A copy whose batch-norm statistics are the training set's (cumulative averages, 64 at a time)."""
    m = copy.deepcopy(m)
    for mod in m.modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            mod.reset_running_stats()
            mod.momentum = None
    m.train()
    with torch.no_grad():
        for i in range(0, len(x_all), 64):
            m(x_all[i : i + 64])
    return m


for epoch in range(10):
    model.train()
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if bunsan.rank() == 0:
        e, _ = evaluate(model, te)
        p, _ = evaluate(precise(model), te)
        print(f"epoch {epoch + 1}: eval-mode {100 * e:.1f}%  recomputed-BN {100 * p:.1f}%", flush=True)
bunsan.finalize()
