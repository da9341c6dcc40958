"""``bunsan plan``: predict the step time, scaling efficiency and bytes of every algorithm at every worker count.

Input is a profile (``--model NAME`` measured here on one batch, ``--compute-ms`` and
``--params`` given, or ``--job FILE``: what ``algorithm="auto"`` measured in a job of the
user's own, read from its checkpoint) and a cluster (``--link``/``--latency`` given,
measured by a probe job over ``--hostfile``/``-H``, or with ``--job`` that job's own
network); the arithmetic is
:mod:`bunsan.algorithms.cost_model`. ``--published NAME`` runs one of the
published set-ups this model was checked against (:data:`PUBLISHED`, read from the package
data file ``published.json``).

This module imports no torch at the top: ``bunsan`` builds its
command-line parser from it without importing torch.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bunsan import _extras
from bunsan._table import format_table
from bunsan._validate import check_number
from bunsan.bench._common import check_at_least, check_positive, command_main, refuse, stop_with_parent
from bunsan.bench.netns_plan import parse_size
from bunsan.bench.specs import parse_workers

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "PUBLISHED",
    "Published",
    "add_arguments",
    "find_auto_decision",
    "format_plan",
    "job_profile",
    "load_published",
    "parse_latency",
    "parse_link",
    "plan_published",
    "plot_plan",
    "run",
]

PROG = "bunsan plan"
DEFAULT_LINK, DEFAULT_LATENCY = "10gbit", "10us"  # the cluster where none is given, probed or read from a job
DEFAULT_BATCH = 32

DESCRIPTION = """\
Predict, before running anything, the step time, the scaling efficiency
(compute / step, same work per worker) and the bytes each worker sends per step
of every bunsan algorithm at every worker count, from a profile of the model
(measured here with --model, given with --compute-ms and --params, or measured
by algorithm="auto" in your own job: --job CHECKPOINT) and a cluster (--link
and --latency, measured with --probe over a hostfile, or that job's network).
Hockney's alpha-beta model: ring all-reduce, striped quantized exchange,
overlap with backward, block amortization, rank 0's link for async SGD
(docs/experiments/plan.md). Prints a table, writes a PNG of efficiency against workers."""

EPILOG = """\
examples:
  bunsan plan --model resnet20 --batch 128 --workers 2,4,8,32,256 --link 10gbit --latency 50us
  bunsan plan --compute-ms 618 --params 44549160 --workers 8,64,512 --link 25gbit --latency 10us
  bunsan plan --published horovod-resnet101
  bunsan plan --model mlp --hostfile hosts --probe --workers 8,16
  bunsan plan --job checkpoint.pt --workers 4,16,64   (a job of yours that ran with "auto")"""

_LATENCY = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>ns|us|µs|ms|s)", re.IGNORECASE)
_LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_link(text: str) -> float:
    """``"25gbit"`` -> bytes per second (3.125e9). Units bit, kbit, mbit, gbit, tbit (SI, as tc reads them).

    Raises:
        ValueError: not a positive rate with one of those units.
    """
    from bunsan.bench.netns import parse_rate

    try:
        return parse_rate(text) / 8
    except ValueError as err:
        raise ValueError(f"--link: {err}") from None


def parse_latency(text: str) -> float:
    """``"10us"`` -> 1e-05 seconds. Units ns, us, ms, s.

    Raises:
        ValueError: not a number >= 0 with one of those units.
    """
    match = _LATENCY.fullmatch(text.strip())
    if not match:
        raise ValueError(f"--latency {text!r} is not a number with a unit ns, us, ms or s, e.g. --latency 10us")
    return float(match["number"]) * _LATENCY_UNITS[match["unit"].lower()]


@dataclass(frozen=True)
class Published:
    """A published scaling result and what the prediction assumes to reproduce it."""

    name: str
    what: str
    source: str
    compute_s: float
    compute_note: str  # where compute_s comes from
    params: int
    batch: int
    link: str
    latency: str
    network_note: str
    workers: tuple[int, ...]
    at: int  # the worker count of the published efficiency
    efficiency: float
    bucket_mb: float = 25.0
    overlap: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Published:
        """A record of ``published.json`` (its worker counts as a list)."""
        return cls(**{**record, "workers": tuple(record["workers"])})


def load_published(path: Path | None = None) -> dict[str, Published]:
    """The published set-ups by name, from ``path`` (default: ``published.json`` beside this module,
    shipped as package data): data with their sources and notes, not code."""
    text = (path or Path(__file__).with_name("published.json")).read_text(encoding="utf-8")
    return {p.name: p for p in (Published.from_dict(r) for r in json.loads(text)["setups"])}


PUBLISHED: dict[str, Published] = load_published()


def plan_published(name: str) -> tuple[Published, list[Any]]:
    """The predictions of exact data-parallel SGD for published set-up ``name`` at its worker counts."""
    from bunsan.algorithms import async_model as am
    from bunsan.algorithms import cost_model as cm

    if name not in PUBLISHED:
        raise ValueError(f"unknown published set-up {name!r}; choose one of {', '.join(sorted(PUBLISHED))}")
    case = PUBLISHED[name]
    profile = cm.Profile(compute_s=case.compute_s, params=case.params, batch=case.batch)
    network = cm.Network(parse_latency(case.latency), parse_link(case.link))
    exact = cm.Candidate("data_parallel", {"bucket_size_mb": case.bucket_mb}, "exact")
    return case, am.predict_all(profile, network, [exact], list(case.workers), overlap=case.overlap)


# -- output ----------------------------------------------------------------------------------------
COLUMNS = (
    "workers",
    "algorithm",
    "step (ms)",
    "compute (ms)",
    "comm (ms)",
    "exposed (ms)",
    "efficiency",
    "MB/step",
    "",
)


def format_plan(predictions: Sequence[Any]) -> str:
    """One row per (worker count, algorithm); ``*`` marks the fastest algorithm at each worker count."""
    best: dict[int, float] = {}
    for p in predictions:
        best[p.workers] = min(best.get(p.workers, float("inf")), p.step_s)
    rows = [
        [
            str(p.workers),
            p.label,
            f"{p.step_s * 1e3:.2f}",
            f"{p.compute_s * 1e3:.2f}",
            f"{p.communication_s * 1e3:.2f}",
            f"{p.exposed_s * 1e3:.2f}",
            f"{100 * p.efficiency:.1f}%",
            f"{p.bytes_per_step / 1e6:.3f}",
            "*" if p.step_s == best[p.workers] and p.workers > 1 else "",
        ]
        for p in predictions
    ]
    return format_table(COLUMNS, rows, right=set(COLUMNS) - {"algorithm", ""})


def _png(predictions: Sequence[Any], path: Path, title: str) -> str:
    """The plot's line of output: its path, or why there is none (matplotlib is optional)."""
    if not _extras.available("matplotlib"):
        return f"PNG: none, matplotlib is not installed ({_extras.install_hint('bench')} draws it)"
    return f"PNG: {plot_plan(predictions, path, title)}"


def plot_plan(predictions: Sequence[Any], path: Path, title: str = "") -> Path:
    """PNG of predicted efficiency (and step time) against workers, one line per algorithm."""
    from bunsan.bench.plots import new_figure, save_figure

    figure, (efficiency_axes, step_axes) = new_figure(2)
    labels = list(dict.fromkeys(p.label for p in predictions))
    for label in labels:
        mine = sorted((p for p in predictions if p.label == label), key=lambda p: p.workers)
        x = [p.workers for p in mine]
        efficiency_axes.plot(x, [100 * p.efficiency for p in mine], marker="o", label=label)
        step_axes.plot(x, [p.step_s * 1e3 for p in mine], marker="o", label=label)
    for axes, ylabel in ((efficiency_axes, "predicted scaling efficiency (%)"), (step_axes, "predicted step (ms)")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("workers")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
    step_axes.set_yscale("log")
    efficiency_axes.set_ylim(0, 105)
    efficiency_axes.legend(fontsize="small")
    if title:
        figure.suptitle(title, fontsize="medium")
    return save_figure(figure, path)


# -- a job's own measurement ------------------------------------------------------------------------
def _is_decision(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("measured"), dict) and "workers" in value


def find_auto_decision(document: Any, depth: int = 8) -> dict[str, Any] | None:
    """The decision of ``algorithm="auto"`` (:attr:`bunsan.Auto.decision`) inside ``document``: the
    decision itself, Auto's ``state_dict()``, a distributed optimizer's ``state_dict()`` (under
    ``"algorithm"``) or any checkpoint that holds one of them in its dicts and lists; ``None`` if
    there is none (or Auto had not decided yet when it was saved)."""
    if _is_decision(document):
        return dict(document)
    if depth <= 0:
        return None
    if isinstance(document, dict):
        if _is_decision(document.get("decision")):
            return dict(document["decision"])
        children: list[Any] = list(document.values())
    elif isinstance(document, (list, tuple)):
        children = list(document)
    else:
        return None
    for child in children:
        found = find_auto_decision(child, depth - 1)
        if found is not None:
            return found
    return None


def _load_job(path: str) -> Any:
    """A JSON file as it is; a :class:`bunsan.train.Checkpoint` file (a TrainingSession's) as the session
    reads it; anything else as ``torch.load`` reads it, tensors and plain types only."""
    text_path = Path(path)
    if not text_path.is_file():
        raise ValueError(f"--job {path}: no such file")
    if text_path.suffix == ".json":
        try:
            return json.loads(text_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--job {path}: not JSON ({err})") from None
    if text_path.suffix == ".jsonl":  # Auto(record=...): one record a line; the last holds the decision as it ended
        lines = [line for line in text_path.read_text().splitlines() if line.strip()]
        try:
            records = [json.loads(line) for line in lines]
        except json.JSONDecodeError as err:
            raise ValueError(f"--job {path}: not JSON lines ({err})") from None
        return records[::-1]  # the newest first: find_auto_decision takes the first decision it meets
    import pickle

    import torch

    from bunsan.errors import CheckpointError
    from bunsan.train.checkpoint import files

    with text_path.open("rb") as file:
        bunsan_checkpoint = file.read(len(files._MAGIC)) == files._MAGIC
    if bunsan_checkpoint:  # a TrainingSession's file: header and checksum, then the payload
        try:
            return files.read_file(text_path)
        except CheckpointError as err:
            raise ValueError(f"--job {path}: {err}") from None
    try:
        return torch.load(text_path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"--job {path}: torch.load(weights_only=True) cannot read it ({first}); save the optimizer's "
            "state_dict() or its 'algorithm' entry on its own, or json.dump(auto.decision)"
        ) from None


def job_profile(decision: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``(profile keywords, network keywords, summary)`` of what Auto measured in a job.

    The profile is one worker's at the job's worker count: the compute Auto measured (each rank's
    time outside the exchange) or inferred (the exact step less the exposed exchange predicted for
    it), the parameters, each worker's batch and, where the job measured them, the codec's speeds.
    The job's fixed costs per candidate and its wait for the slowest rank are left out: they were
    measured at its own worker count and on its own machine, and the plan predicts others.

    Raises:
        ValueError: the decision holds no compute or no network (Auto kept exact SGD where its
            network probe was inconclusive, so it predicted nothing).
    """
    measured = decision["measured"]
    missing = [k for k in ("compute_s", "params", "batch", "latency_s", "bandwidth") if k not in measured]
    if missing:
        raise ValueError(
            f"the job's Auto decision ({decision.get('label', '?')!r} at step {decision.get('step', '?')}) "
            f"has no {', '.join(missing)}: it decided without predicting (its network probe was inconclusive); "
            "give --compute-ms and --params instead"
        )
    compute_s = float(measured["compute_s"])
    check = decision.get("block_check") or {}
    # a decision at the first step predicted from that step's time, an upper bound of the compute (20
    # times the steady one on MNIST-1D's CNN), or at the second from twice its time; its block check,
    # where it ran, timed the local steps
    bound = bool(measured.get("first_step")) or "second_step_before_exchange_s" in measured
    from_check = bound and check.get("local_step_s") is not None
    if from_check:
        compute_s = float(check["local_step_s"])
    profile: dict[str, Any] = {
        "compute_s": compute_s,
        "params": int(measured["params"]),
        "batch": int(measured["batch"]),
    }
    for key in (
        "bytes_per_element",
        "encode_s_per_element",
        "decode_s_per_element",
        "codec_call_s",
        "encode_call_s",
        "decode_call_s",
        "cast_s_per_element",
        "copy_s_per_element",
        "update_s_per_element",
    ):
        if measured.get(key) is not None:  # a job of an older bunsan: the mean call for both
            profile[key] = float(measured[key])
    if measured.get("codecs"):
        profile["codecs"] = tuple(tuple(c) for c in measured["codecs"])
    for key in ("tensors", "chunks"):
        if measured.get(key) is not None:
            profile[key] = int(measured[key])
    if "codec_per_bucket" in measured:
        profile["codec_per_bucket"] = bool(measured["codec_per_bucket"])
    network = {
        "latency_s": float(measured["latency_s"]),
        "bandwidth": float(measured["bandwidth"]),
        "gather_bandwidth": measured.get("gather_bandwidth"),
        "half_bandwidth": measured.get("half_bandwidth"),
    }
    summary = (
        f"job: Auto at step {decision.get('step', '?')} on {decision['workers']} workers chose "
        f"{decision.get('label', '?')}; exact step {measured.get('exact_step_s', float('nan')) * 1e3:.2f} ms, "
        f"compute {profile['compute_s'] * 1e3:.2f} ms per step per worker (batch {profile['batch']}), "
        f"{profile['params']:,} parameters; network {network['bandwidth'] * 8 / 1e9:.3f} Gbit/s, "
        f"latency {network['latency_s'] * 1e6:.1f} us"
    )
    if from_check:
        which = "first step" if measured.get("first_step") else "second step"
        summary += (
            f" (its block check's local step: the decision, at its {which}, predicted from "
            f"{float(measured['compute_s']) * 1e3:.2f} ms, from that step's time)"
        )
    elif measured.get("first_step"):
        summary += " (from its first step's time, an upper bound: the job decided there and timed no step)"
    elif bound:
        summary += (
            f" (from its second step's time taken {float(measured.get('bound_margin', 2.0)):g} times, a bound: "
            "the job decided there and timed no whole step)"
        )
    trial = decision.get("trial") or {}
    if trial.get("local_step_s") is not None:  # Auto kept exact and tried a block algorithm near the bar
        summary += (
            f"; its trial of {trial.get('of', '?')} timed a local step of {float(trial['local_step_s']) * 1e3:.2f} ms "
            f"and a round of {float(trial['exchange_s']) * 1e3:.1f} ms ({trial.get('outcome', '?')}); the compute "
            "above is the exact steps', which per-step algorithms pay"
        )
    if measured.get("codec_measured") is False:  # decided at its first or second step, the codec unneeded
        which = "second" if "second_step_before_exchange_s" in measured else "first"
        summary += (
            f"; its codec was not measured (its {which} step settled a block algorithm without it): "
            "fp16 and the quantized rows are priced without codec time"
        )
    return profile, network, summary


# -- the command -----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``bunsan plan`` to ``parser``."""
    what = parser.add_argument_group("profile (one of)")
    what.add_argument("--model", help="a bunsan.models name: its compute per step is measured here on one batch")
    what.add_argument("--compute-ms", type=float, help="forward + backward + update of one step, one worker (ms)")
    what.add_argument("--params", type=int, help="trainable parameters (gradient elements), with --compute-ms")
    what.add_argument("--published", help=f"a published set-up: {', '.join(sorted(PUBLISHED))}")
    what.add_argument(
        "--job",
        metavar="FILE",
        help='what algorithm="auto" measured in a job of yours: a checkpoint or torch.save\'d optimizer '
        "state_dict(), a JSON of auto.decision, or the JSON lines of Auto(record=...), whose last record "
        "counts; its compute per worker, parameters, batch and codec, and "
        "its network unless --link, --latency or --probe is given",
    )
    parser.add_argument(
        "--batch", type=int, help=f"samples per worker per step; default {DEFAULT_BATCH} (with --job: the job's)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="with --model: where one worker computes, e.g. cuda (the step and the codec are timed there, "
        "synchronized); default %(default)s, one thread",
    )
    parser.add_argument(
        "--backward-fraction",
        type=float,
        help="share of the step in backward (default: measured with --model, else 2/3)",
    )
    parser.add_argument(
        "--codec-ns",
        type=float,
        default=0.0,
        help="with --compute-ms: quantization codec time per element, ns, each of encode and "
        "decode (--model measures it); default %(default)s",
    )
    parser.add_argument(
        "--global-batch",
        action="store_true",
        help="the global batch is fixed (--batch is split over the workers: strong scaling); "
        "default: --batch per worker (weak scaling)",
    )
    net = parser.add_argument_group("cluster")
    net.add_argument("--workers", default="2,4,8,16,32,64,128,256", help="worker counts; default %(default)s")
    net.add_argument(
        "--link", help=f"bandwidth of one worker's link, e.g. 25gbit; default {DEFAULT_LINK} (with --job: the job's)"
    )
    net.add_argument(
        "--latency", help=f"per-message latency, e.g. 10us; default {DEFAULT_LATENCY} (with --job: the job's)"
    )
    net.add_argument(
        "--burst",
        default="0",
        help="a token-bucket link's burst, e.g. 16kb (tc tbf; bunsan bench --network gives 1 ms of traffic, "
        "at least 16kb): bytes that pass at once after the compute; default %(default)s (none)",
    )
    net.add_argument("--hostfile", help="with --probe: measure alpha and beta by a probe job over these hosts")
    net.add_argument("-H", "--hosts", help="with --probe: hosts as NAME:SLOTS,... (bunsan run -H)")
    net.add_argument(
        "--probe",
        action="store_true",
        help="measure --link and --latency with a probe job (bunsan run over --hostfile/-H, or -np 2 here)",
    )
    parser.add_argument(
        "--block-size", type=int, default=1024, help="block algorithms' block, samples per worker; default %(default)s"
    )
    parser.add_argument("--no-overlap", action="store_true", help="exchange after backward, no overlap")
    parser.add_argument("--png", default="runs/plan/plan.png", help="the plot; default %(default)s")
    parser.add_argument("--json", help="also write the predictions to this file")


def _probe(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``python -m bunsan.bench.measure`` as a job; return rank 0's JSON line."""
    command = [sys.executable, "-m", "bunsan", "run"]
    if args.hostfile:
        command += ["--hostfile", args.hostfile]
    elif args.hosts:
        command += ["-H", args.hosts]
    else:
        command += ["-np", "2"]
    command += ["--", sys.executable, "-m", "bunsan.bench.measure"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, preexec_fn=stop_with_parent())
    if done.returncode != 0:
        raise RuntimeError(f"the probe job failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("the probe job printed no measurement")


def _measured_profile(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    import torch

    from bunsan import models
    from bunsan.algorithms.data_parallel.stripes import coded_per_bucket
    from bunsan.bench.measure import measure_codec, measure_codecs, measure_compute
    from bunsan.bench.synthetic import model_inputs
    from bunsan.compression import Quantizer

    if args.model not in models.names():
        raise ValueError(f"unknown model {args.model!r}; choose one of {', '.join(models.names())}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ValueError(f"--device must be cpu, cuda or cuda:N (where one worker computes), got {args.device!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is visible here")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as one worker of a CPU job runs
    kwargs, shape = model_inputs(args.model, None, 10)
    torch.manual_seed(0)
    model = models.create(args.model, **kwargs).to(device)
    # the batch of one worker at 1 worker (with --global-batch, the whole global batch)
    x, y = torch.randn(batch, *shape).to(device), torch.randint(0, 10, (batch,)).to(device)
    measured = measure_compute(model, x, y)
    measured.update(measure_codec(measured["params"], device=device))
    measured["codecs"] = measure_codecs(measured["params"], (8,), device=device)  # the candidates' other width
    measured["codec_per_bucket"] = coded_per_bucket(Quantizer(1), device)
    return measured


def _run_published(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """``bunsan plan --published NAME``: the set-up, its predictions and the published figure beside them."""
    try:
        case, predictions = plan_published(args.published)
    except ValueError as err:
        return refuse(PROG, str(err))
    say(
        f"{case.what}\nsource: {case.source}\ncompute: {case.compute_note}\nnetwork: {case.link}, "
        f"{case.latency}; {case.network_note}"
    )
    say(format_plan(predictions))
    at = next(p for p in predictions if p.workers == case.at)
    say(
        f"predicted efficiency at {case.at} workers: {100 * at.efficiency:.1f}%, published "
        f"{100 * case.efficiency:.1f}% ({100 * (at.efficiency - case.efficiency):+.1f} points)"
    )
    say(_png(predictions, Path(args.png), case.what))
    return 0


def _profile_source_problem(args: argparse.Namespace) -> str | None:
    """Why the profile's options do not name exactly one source (``None``: they do)."""
    given = args.compute_ms is not None or args.params is not None
    sources = (args.model is not None) + given + (args.job is not None)
    if sources != 1 or (given and (args.compute_ms is None or args.params is None)):
        return (
            "give one profile: --model NAME, both --compute-ms and --params, --job FILE (a job that ran with "
            "auto), or --published NAME"
        )
    if args.job is not None and args.batch is not None:
        return "--batch comes from the job with --job (each worker's batch there)"
    return None


def _job(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any] | None:
    """With ``--job``: what Auto measured in that job (profile, network, workers, overlap, exact's step)."""
    if args.job is None:
        return None
    decision = find_auto_decision(_load_job(args.job))
    if decision is None:
        raise ValueError(
            f"--job {args.job}: no decision of algorithm='auto' in it (saved before Auto decided, or "
            "not from a job that ran with auto)"
        )
    job_kwargs, job_network, job_summary = job_profile(decision)
    say(job_summary)
    return {
        "profile": job_kwargs,
        "network": job_network,
        "workers": int(decision["workers"]),
        # whether the job's exchange could overlap backward (not on CPU, where it takes the compute's core)
        "overlap": bool(decision["measured"].get("overlap", True)),
        "exact_step_s": float(decision["measured"].get("exact_step_s", 0.0)),
    }


def _burst(args: argparse.Namespace) -> float:
    """``--burst``, in bytes."""
    try:
        return float(parse_size(args.burst))
    except ValueError as error:
        raise ValueError(f"--burst {error}") from None


def _network(args: argparse.Namespace, job: dict[str, Any] | None, burst: float, say: Callable[[str], None]) -> Any:
    """The network: probed (``--probe``), the job's own (``--job`` without ``--link``/``--latency``), or given."""
    from bunsan.algorithms import cost_model as cm

    if args.probe:
        measured_net = _probe(args)
        network = cm.Network(
            measured_net["latency_s"],
            measured_net["bandwidth"],
            measured_net.get("gather_bandwidth"),
            measured_net.get("half_bandwidth"),
            burst_bytes=burst,
        )
        say(
            f"probe over {measured_net['workers']} workers: latency {network.latency_s * 1e6:.1f} us, "
            f"all-reduce bandwidth {network.bandwidth * 8 / 1e9:.3f} Gbit/s, all-gather "
            f"{network.gather_beta * 8 / 1e9:.3f} Gbit/s"
        )
        return network
    if args.hostfile or args.hosts:
        raise ValueError("--hostfile and -H are for --probe; add --probe to measure the network")
    if job is not None and args.link is None and args.latency is None:
        return cm.Network(**job["network"], burst_bytes=burst)  # the job's own, as Auto measured it
    return cm.Network(
        parse_latency(args.latency or DEFAULT_LATENCY), parse_link(args.link or DEFAULT_LINK), burst_bytes=burst
    )


_MEASURED_FIELDS = (
    "encode_s_per_element",
    "decode_s_per_element",
    "codec_call_s",
    "encode_call_s",
    "decode_call_s",
    "cast_s_per_element",
    "copy_s_per_element",
    "tensors",
    "chunks",
    "codecs",
    "codec_per_bucket",
)


def _profile(args: argparse.Namespace, batch: int, job: dict[str, Any] | None, say: Callable[[str], None]) -> Any:
    """One worker's profile at 1 worker: measured here (``--model``), the job's (``--job``) or given."""
    from bunsan.algorithms import cost_model as cm

    extra: dict[str, Any]
    if args.model is not None:
        measured = _measured_profile(args, batch)
        compute_s, params = measured["compute_s"], measured["params"]
        extra = {k: measured[k] for k in _MEASURED_FIELDS}
        backward = measured["backward_fraction"]
        where = "1 thread" if args.device == "cpu" else args.device
        say(
            f"measured {args.model}, batch {batch}, {where}: {compute_s * 1e3:.2f} ms per step "
            f"(forward {measured['forward_s'] * 1e3:.2f} ms), {params:,} parameters"
        )
    elif job is not None:
        extra = dict(job["profile"])
        compute_s, params, batch = extra.pop("compute_s"), extra.pop("params"), extra.pop("batch")
        # the plan's compute is one worker's at 1 worker: with the batch per worker fixed (weak scaling) the
        # job's per-worker compute; with --global-batch the job's whole global batch on one worker
        backward = 2 / 3
        if args.global_batch:
            compute_s, batch = compute_s * job["workers"], batch * job["workers"]
    else:
        check_positive("--compute-ms", args.compute_ms)
        compute_s, params, backward = args.compute_ms / 1e3, args.params, 2 / 3
        check_number("--codec-ns", args.codec_ns, minimum=0)
        extra = {"encode_s_per_element": args.codec_ns * 1e-9, "decode_s_per_element": args.codec_ns * 1e-9}
    if args.backward_fraction is not None:
        backward = args.backward_fraction
    return cm.Profile(compute_s=compute_s, params=params, batch=batch, backward_fraction=backward, **extra)


def _report(
    args: argparse.Namespace, profile: Any, network: Any, job: dict[str, Any] | None, say: Callable[[str], None]
) -> None:
    """Predict every algorithm at every worker count; print the table (and the check against ``--job``'s own
    step), write the PNG and the optional JSON."""
    from bunsan.algorithms import async_model as am

    workers = parse_workers(args.workers)
    candidates = am.default_candidates(args.block_size)
    overlap = not args.no_overlap and (job is None or job["overlap"])
    predictions = am.predict_all(profile, network, candidates, workers, global_batch=args.global_batch, overlap=overlap)
    scaling = "global batch fixed" if args.global_batch else "batch per worker fixed"
    params = profile.params
    say(
        f"{params:,} parameters, {profile.compute_s * 1e3:.2f} ms compute per step at 1 worker, batch "
        f"{profile.batch} ({scaling}); link {network.bandwidth * 8 / 1e9:.3f} Gbit/s, latency "
        f"{network.latency_s * 1e6:.1f} us; codec {profile.encode_s_per_element * 1e9:.2f} / "
        f"{profile.decode_s_per_element * 1e9:.2f} ns per element (encode / decode); efficiency = compute / step; "
        "* = fastest"
    )
    say(format_plan(predictions))
    if job is not None and "exact_step_s" in job:
        # the check against the job itself: exact at its own worker count, predicted and measured
        at = am.predict(
            profile.at_workers(job["workers"], global_batch=args.global_batch),
            network,
            candidates[0],
            job["workers"],
            overlap=overlap,
        )
        say(
            f"at the job's {job['workers']} workers: exact predicted {at.step_s * 1e3:.2f} ms a step, measured "
            f"{job['exact_step_s'] * 1e3:.2f} ms there (the difference: the framework's fixed cost per step, "
            "which the job measured at its own worker count and the plan does not carry"
            + (", and the network given instead of the job's)" if args.link or args.latency or args.probe else ")")
        )
    say(_png(predictions, Path(args.png), f"{args.model or ('job' if args.job else 'profile')}: {params:,} parameters"))
    if args.json:
        from bunsan.bench import write_json

        write_json(
            args.json,
            {"profile": vars(profile), "network": vars(network), "predictions": [p.as_dict() for p in predictions]},
        )
        say(f"JSON: {args.json}")


def run(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """``bunsan plan``: predictions table, PNG and optional JSON. 0 on success, 1 a probe failed, 2 on bad input."""
    if args.published is not None:
        return _run_published(args, say)
    problem = _profile_source_problem(args)
    if problem is not None:
        return refuse(PROG, problem)
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    try:
        parse_workers(args.workers)
        check_at_least(("--batch", batch, 1), ("--block-size", args.block_size, 1))
        burst = _burst(args)
        job = _job(args, say)
        network = _network(args, job, burst, say)
        profile = _profile(args, batch, job, say)
    except (ValueError, TypeError) as err:
        return refuse(PROG, str(err))
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    _report(args, profile, network, job, say)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bunsan.bench.plan``: the same as ``bunsan plan``."""
    return command_main(argv, PROG, DESCRIPTION, EPILOG, add_arguments, run, allow_abbrev=True)


if __name__ == "__main__":
    sys.exit(main())
