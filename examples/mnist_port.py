"""pytorch/examples' MNIST script (mnist/main.py), ported to bunsan: what a user changes.

The upstream script trains a two-convolution network with Adadelta and a StepLR
schedule, logs every ``--log-interval`` batches and tests after every epoch. This
is our own rewrite of it with the same structure, command-line flags, defaults and
network. Every line a user changes to make their copy of the upstream script
distributed ends with ``# [bunsan]``; there are 9 of them:

* required (4): ``import bunsan``; ``bunsan.init()``; ``torch.utils.data.DataLoader``
  becomes ``bunsan.data.loader`` for the training set; one ``bunsan.distribute`` line.
* for output and files (4): ``print`` becomes ``bunsan.print`` (rank 0 only) in
  three places; the model is saved by rank 0 only.
* for GPUs (1): ``torch.device("cuda")`` becomes ``bunsan.device()`` (this worker's GPU).

Everything else, ``len(train_loader.dataset)``, ``len(train_loader)``, the
learning-rate scheduler on the optimizer, ``--dry-run``'s ``break`` (taken on
every rank alike), stays as it was. The test loop is unchanged too: every worker
tests the whole test set with identical replicas; ``bunsan.evaluate(model,
test_set)`` would split it instead.

Data: torchvision is not needed and nothing is downloaded. ``--data DIR`` reads the
real MNIST IDX files from DIR; without it, scikit-learn's 8x8 digits are upscaled
to 28x28 and written as MNIST IDX files to a temporary directory, so the script
reads the same format with the same shapes (1,437 training and 360 test images).

Runs unchanged as::

    python examples/mnist_port.py --epochs 2
    bunsan run -np 2 examples/mnist_port.py --epochs 2
    torchrun --nproc-per-node 2 examples/mnist_port.py --epochs 2
    mpirun -np 2 python examples/mnist_port.py --epochs 2      # as root: mpirun --allow-run-as-root ...
"""

import argparse
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset

import bunsan  # [bunsan]
from bunsan.datasets import digits
from bunsan.datasets.idx import mnist_idx, write_idx

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the upstream script's normalization


class Net(nn.Module):
    """Two 3x3 convolutions (32, 64 channels), max-pool, dropout, two dense layers: upstream's network."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.drop_conv = nn.Dropout(0.25)
        self.drop_dense = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * 12 * 12, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.drop_conv(x).flatten(1)
        x = self.drop_dense(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def offline_mnist_files(directory):
    """Write digits, upscaled to MNIST's 28x28 bytes, as the four MNIST IDX files in ``directory``."""
    names = {
        "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    }
    for split, (images_name, labels_name) in names.items():
        x, y = digits(split).tensors
        big = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
        write_idx(f"{directory}/{images_name}", (big.squeeze(1) * 255).round().clamp(0, 255).to(torch.uint8))
        write_idx(f"{directory}/{labels_name}", y.to(torch.uint8))


def mnist(directory, split):
    x, y = mnist_idx(directory, split).tensors
    return TensorDataset((x - MNIST_MEAN) / MNIST_STD, y)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            bunsan.print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} "  # [bunsan]
                f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
            )
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    test_loss /= len(test_loader.dataset)
    n = len(test_loader.dataset)
    bunsan.print(
        f"\nTest set: Average loss: {test_loss:.4f}, "  # [bunsan]
        f"Accuracy: {correct}/{n} ({100.0 * correct / n:.0f}%)\n"
    )


def main():
    parser = argparse.ArgumentParser(description="MNIST example of pytorch/examples, ported to bunsan")
    parser.add_argument("--batch-size", type=int, default=64, help="training batch (per worker)")
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7, help="learning-rate decay per epoch")
    parser.add_argument("--no-cuda", action="store_true", default=False)
    parser.add_argument("--dry-run", action="store_true", default=False, help="one batch per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-model", action="store_true", default=False)
    parser.add_argument("--data", help="directory of the MNIST IDX files (default: upscaled digits, offline)")
    args = parser.parse_args()
    bunsan.init()  # [bunsan]
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    torch.manual_seed(args.seed)
    device = bunsan.device() if use_cuda else torch.device("cpu")  # [bunsan]
    bunsan.print(f"Using device: {device}\n")  # [bunsan]

    train_kwargs = {"batch_size": args.batch_size}
    test_kwargs = {"batch_size": args.test_batch_size}
    if use_cuda:
        train_kwargs.update(num_workers=1, pin_memory=True, shuffle=True)
        test_kwargs.update(num_workers=1, pin_memory=True, shuffle=True)

    with tempfile.TemporaryDirectory() as scratch:
        directory = args.data
        if directory is None:
            offline_mnist_files(scratch)
            directory = scratch
        train_set, test_set = mnist(directory, "train"), mnist(directory, "test")
    train_loader = bunsan.data.loader(train_set, **train_kwargs)  # [bunsan]
    test_loader = torch.utils.data.DataLoader(test_set, **test_kwargs)

    model = Net().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    model, optimizer = bunsan.distribute(model, optimizer)  # [bunsan]
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model and bunsan.is_main():  # [bunsan]
        torch.save(model.state_dict(), "mnist_cnn.pt")


if __name__ == "__main__":
    main()
