"""CNTK's distributed MNIST sample (``training_session`` with checkpoints, cross-validation
control and a final test), translated to bunsan.

What carries over from the CNTK 2 sample, setting by setting:

* the ConvNet: conv 5x5/32 (padded), max-pool 2, conv 3x3/48, max-pool 2, conv 3x3/64,
  dense 96, dropout 0.5, dense 10, ReLU everywhere;
* the learning rate 0.001 *per sample* (``UnitType.sample``): bunsan sets the optimizer's
  lr to 0.001 x the global minibatch at every step;
* momentum as a time constant, ``[0] * 5 + [1024]`` samples per data sweep;
* the global minibatch schedule ``[256] * 6 + [512] * 9 + [1024] * 7 + [2048] * 8 + [4096]``,
  one entry per sweep, split across the workers;
* a cross-validation every 3 sweeps whose callback halves the learning rate when the
  error improved by less than 5 % (relative) and stops training after the 6th cut;
* a checkpoint every sweep, and a test at the end.

It trains on scikit-learn's 8x8 digits by default (no download), or on MNIST's IDX
files from a local directory::

    bunsan run -np 2 examples/cntk_mnist.py
    bunsan run -np 2 examples/cntk_mnist.py --mnist ~/data/mnist --max-epochs 50

As in the CNTK sample, 10 % of the training set, drawn with a fixed seed, is held out
for the cross-validation.
"""

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import bunsan
from bunsan.datasets import digits
from bunsan.datasets.idx import mnist_idx
from bunsan.models import MNISTConvNet
from bunsan.train import Checkpoint, CrossValidation, Test, TrainingSession, classification_error, schedule


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mnist", metavar="DIR", help="directory of MNIST IDX files (default: the bundled digits)")
parser.add_argument("--max-epochs", type=int, default=50, help="CNTK epochs of --sweeps-per-epoch sweeps (default 50)")
parser.add_argument(
    "--sweeps-per-epoch",
    type=int,
    default=None,
    help="data sweeps in one CNTK epoch, the unit of every schedule (default 1 on MNIST, 10 on digits)",
)
parser.add_argument("--algorithm", default="data_parallel", help=f"one of {bunsan.algorithms.names()}")
parser.add_argument(
    "--block-size", type=int, default=None, help="samples per worker in a block, for block_momentum and model_averaging"
)
parser.add_argument(
    "--checkpoint",
    default=os.path.join(tempfile.gettempdir(), "bunsan-cntk-mnist", "mnist.pt"),
    help="checkpoint file pattern (shared by every worker)",
)
parser.add_argument("--restore", action="store_true", help="continue from the newest checkpoint (CNTK: restore=False)")
parser.add_argument("--log-csv", default=None, help="write one CSV row per epoch here")
args = parser.parse_args()

bunsan.init()
torch.manual_seed(0)

# The data: (x, y) with x float32 (N, 1, H, W) in [0, 1]; 10 % of train held out for cross-validation.
if args.mnist:
    train_all, test_set = mnist_idx(args.mnist, "train"), mnist_idx(args.mnist, "test")
else:
    train_all, test_set = digits("train"), digits("test")
x, y = train_all.tensors
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))  # the same on every rank
held_out = len(y) // 10
train_set = TensorDataset(x[order[held_out:]], y[order[held_out:]])
cv_set = TensorDataset(x[order[:held_out]], y[order[:held_out]])
# One CNTK "epoch" is epoch_size samples, the unit of every schedule and frequency below. On MNIST
# it is one sweep of the 54000 training images, as in the CNTK sample; the 1294 training digits
# would give 5 steps per epoch, so there it is 10 sweeps.
sweeps = args.sweeps_per_epoch or (1 if args.mnist else 10)
epoch_size = sweeps * len(train_set)

model = MNISTConvNet(image_size=x.shape[-1]).to(bunsan.device())  # the sample's ConvNet, bunsan.models
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr and momentum come from the schedules below
lr_per_sample = 0.001
log = print if bunsan.is_main() else (lambda *a, **k: None)


def adjust_learning_rate(index, average_error, samples, minibatches):
    """Halve the rate unless the error improved by 5 % (relative); stop after the 6th cut.

    It runs on every rank with the same all-reduced error; rank 0's outcome is then
    applied everywhere. ``prev_metric`` lives in ``session.extra_state`` so that it
    survives a restart from a checkpoint.
    """
    prev_metric = session.extra_state.get("prev_metric", 1.0)  # at the very beginning the error is 100 %
    if (prev_metric - average_error) / prev_metric < 0.05:
        session.learning_rate_per_sample /= 2
        if session.learning_rate_per_sample < lr_per_sample / (2**7 - 0.1):  # done after the 6th cut
            log(f"Learning rate {session.learning_rate_per_sample:.3g} too small. Training complete.")
            return False
        log(
            f"Improvement of metric from {prev_metric:.3f} to {average_error:.3f} insufficient. "
            f"Halving learning rate to {session.learning_rate_per_sample:.3g}."
        )
    session.extra_state["prev_metric"] = average_error
    return True


algorithm = bunsan.algorithms.create(args.algorithm, **({"block_size": args.block_size} if args.block_size else {}))
session = TrainingSession(
    model,
    F.cross_entropy,
    optimizer,
    algorithm,
    train_set,
    minibatch_size=schedule([256] * 6 + [512] * 9 + [1024] * 7 + [2048] * 8 + [4096], epoch_size=epoch_size),
    max_samples=args.max_epochs * epoch_size,
    metrics={"error": classification_error},
    learning_rate_per_sample=lr_per_sample,
    momentum_time_constant=schedule([0] * 5 + [1024], epoch_size=epoch_size),  # 5 sweeps without momentum
    checkpoint=Checkpoint(args.checkpoint, every=epoch_size, restore=args.restore),
    cross_validation=CrossValidation(cv_set, every=3 * epoch_size, callback=adjust_learning_rate, minibatch_size=256),
    test=Test(test_set, minibatch_size=1024),
    log_csv=args.log_csv,
)
summary = session.train()

final = summary.epochs[-1]
log(f"final training loss {final.loss:.4f}, error {final.metrics['error']:.4f} over {final.samples} samples")
log(
    f"test error {summary.test.metrics['error']:.4f} -> accuracy {1 - summary.test.metrics['error']:.4f} "
    f"on {summary.test.samples} samples; {summary.samples_per_s:.0f} samples/s; "
    f"{summary.bytes_per_sample:.0f} bytes sent per sample per worker"
)

# Predictions for a small subsample of the test set, as the CNTK sample prints them.
model.eval()
with torch.no_grad():
    x_check, y_check = test_set.tensors[0][::15][:25], test_set.tensors[1][::15][:25]
    predicted = model(x_check.to(bunsan.device())).argmax(1).cpu()
log("Label    :", y_check.tolist())
log("Predicted:", predicted.tolist())
bunsan.finalize()
