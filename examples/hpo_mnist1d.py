"""Search MNIST-1D training settings with Optuna; every trial trains on all workers.

    bunsan run -np 2 examples/hpo_mnist1d.py --trials 16 --epochs 12 --out runs/hpo_mnist1d

Rank 0 drives the study; each trial's parameters (the parallel SGD algorithm
and its options, the learning rate per sample, the global minibatch) reach every
worker, and the trial trains distributed with a TrainingSession. After each epoch
the validation error (all-reduced, the same on every worker) is reported, and
the pruner on rank 0 stops unpromising trials on every worker at once. The
validation set is 800 samples held out of MNIST-1D's training set; the test set
is scored once per trial, never searched on. Rank 0 prints the trials and the
best one and writes the study's plots as PNG files to --out.

Optuna is an optional extra: pip install 'bunsan[hpo,data]'. Add
``--storage sqlite:///hpo.db --study-name mnist1d`` to keep the study in a file
and go on with it in a later run.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import bunsan
from bunsan import hpo
from bunsan.datasets import mnist1d
from bunsan.models import MNIST1DCNN
from bunsan.train import CrossValidation, Test, TrainingSession, classification_error

try:
    import optuna
except ImportError:
    raise SystemExit(f"this example needs Optuna, an optional extra: {hpo.INSTALL_HINT}") from None

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--trials", type=int, default=16, help="trials to run (default 16)")
parser.add_argument("--epochs", type=int, default=12, help="training epochs per trial at most (default 12)")
parser.add_argument("--out", default="runs/hpo_mnist1d", help="directory of the plots (default runs/hpo_mnist1d)")
parser.add_argument("--storage", default=None, help="Optuna storage URL, e.g. sqlite:///hpo.db (default: memory)")
parser.add_argument("--study-name", default=None, help="the study's name; with --storage, the study to go on with")
parser.add_argument(
    "--seed", type=int, default=0, help="seed of every trial's model, and of the sampler without --storage (default 0)"
)
args = parser.parse_args()

bunsan.init()
log = print if bunsan.is_main() else (lambda *a, **k: None)
if not bunsan.is_main():
    optuna.logging.set_verbosity(optuna.logging.WARNING)

# 3200 samples to train on and 800 to validate, the same split on every worker.
x, y = mnist1d("train").tensors
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
train_set = TensorDataset(x[order[800:]], y[order[800:]])
validation_set = TensorDataset(x[order[:800]], y[order[:800]])
test_set = mnist1d("test")


def objective(trial):
    """One trial, on every worker: the suggest_* calls below run in the same order everywhere."""
    minibatch = hpo.suggest_minibatch_size(trial, (32, 64, 128, 256))
    lr = hpo.suggest_learning_rate_per_sample(trial, 3e-4, 1e-2)
    # Blocks of whole minibatches (up to 1024 samples per worker); warm start up to 2 epochs.
    algorithm = hpo.suggest_algorithm(
        trial,
        bits=(1, 4, 8, 32),
        warm_start=(0, 6400),
        block_size=(64, 1024),
        block_momentum=(0.0, 0.9),
        minibatch_size=minibatch,
    )
    torch.manual_seed(args.seed)  # the same initial model on every worker, in every trial
    model = MNIST1DCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)  # lr is set from lr per sample
    pruned = False

    def after_epoch(index, error, samples, minibatches):
        # Runs on every worker with the same all-reduced error; should_prune() is rank 0's decision.
        nonlocal pruned
        trial.report(error, index)
        pruned = trial.should_prune()
        return not pruned  # False stops the session at once

    session = TrainingSession(
        model,
        F.cross_entropy,
        optimizer,
        algorithm.create(),
        train_set,
        minibatch_size=minibatch,
        max_epochs=args.epochs,
        metrics={"error": classification_error},
        learning_rate_per_sample=lr,
        cross_validation=CrossValidation(validation_set, callback=after_epoch),
        test=Test(test_set),
        progress=False,
        seed=args.seed,
    )
    summary = session.train()
    trial.set_user_attr("test_error", summary.test.error)
    trial.set_user_attr("seconds", round(summary.seconds, 2))
    trial.set_user_attr("algorithm", str(algorithm))
    log(
        f"trial {trial.number}: {algorithm}, lr/sample {lr:.2e}, minibatch {minibatch}: "
        f"validation error {summary.cross_validations[-1].error:.4f} after {len(summary.cross_validations)} "
        f"epoch(s){' (pruned)' if pruned else ''}, {summary.seconds:.1f} s"
    )
    if pruned:
        raise optuna.TrialPruned()
    return summary.cross_validations[-1].error


start = time.perf_counter()
study = hpo.optimize(
    objective,
    args.trials,
    storage=args.storage,
    study_name=args.study_name,
    # A study kept in --storage samples from a fresh seed: a fixed one would repeat the first parameters.
    sampler=optuna.samplers.TPESampler(seed=None if args.storage else args.seed, n_startup_trials=6),
    pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=3),
)
elapsed = time.perf_counter() - start

if bunsan.is_main():
    log(f"\n{'trial':>5}  {'state':<8}  {'val err':>7}  {'test err':>8}  {'s':>5}  settings")
    for t in study.trials:
        value = f"{t.value:.4f}" if t.value is not None else "-"
        test = f"{t.user_attrs['test_error']:.4f}" if "test_error" in t.user_attrs else "-"
        lr = t.params.get("learning_rate_per_sample", float("nan"))
        log(
            f"{t.number:>5}  {t.state.name:<8}  {value:>7}  {test:>8}  {t.user_attrs.get('seconds', 0):>5}  "
            f"{t.user_attrs.get('algorithm', '?')}, lr/sample {lr:.2e}, minibatch {t.params.get('minibatch_size')}"
        )
    if any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
        best = study.best_trial
        log(
            f"\nbest trial {best.number}: validation error {best.value:.4f}, test error "
            f"{best.user_attrs['test_error']:.4f}, {best.user_attrs['algorithm']}, params {best.params}"
        )
    else:
        log("\nno trial completed")
    log(
        f"this run: {args.trials} trials on {bunsan.size()} workers in {elapsed:.1f} s "
        f"({len(study.trials)} in the study)"
    )
    written = hpo.save_plots(study, args.out)
    log("plots: " + ", ".join(str(path) for path in written.values()))
bunsan.finalize()
