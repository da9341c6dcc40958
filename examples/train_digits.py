"""Train a small CNN on scikit-learn's bundled digits (8x8 images, 10 classes).

train_digits.py runs in one process. train_digits_distributed.py is its twin for a
job of several workers (``bunsan run -np 2 examples/train_digits_distributed.py``,
torchrun, mpirun or srun); ``diff`` shows the six lines that differ. Each worker
trains on its own share of every epoch with batch 32.
"""

import time

import torch
import torch.nn.functional as F

from bunsan.datasets import digits
from bunsan.models import DigitsCNN

torch.manual_seed(0)
train_set, test_set = digits("train"), digits("test")
model = DigitsCNN()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = torch.utils.data.DataLoader(train_set, batch_size=32, shuffle=True)
log = print


def accuracy(model, dataset):
    model.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


start = time.perf_counter()
for epoch in range(12):
    total, batches = 0.0, 0
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total, batches = total + loss.item(), batches + 1
    log(f"epoch {epoch + 1:2d}  loss {total / batches:.4f}  test accuracy {accuracy(model, test_set):.4f}")
elapsed = time.perf_counter() - start
log(f"final test accuracy {accuracy(model, test_set):.4f}  ({12 * len(train_set) / elapsed:.0f} samples/s)")
