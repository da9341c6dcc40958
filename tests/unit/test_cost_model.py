"""The cost model's arithmetic, against values worked out by hand (comments show the sums)."""

import math
from dataclasses import replace

import pytest
import torch

from bunsan.algorithms import async_model as am
from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.cost_model import Candidate, Network, Profile


def test_ring_allreduce_time_and_bytes():
    net = Network(latency_s=1e-5, bandwidth=1e9)
    # 2 * 3/4 * 1e6 / 1e9 = 1.5e-3 s on the wire, plus 2 * 3 * 1e-5 = 6e-5 s of latency
    assert cm.ring_allreduce_time(1e6, 4, net) == pytest.approx(1.56e-3)
    assert cm.ring_allreduce_bytes(1e6, 4) == pytest.approx(1.5e6)
    assert cm.ring_allreduce_time(1e6, 1, net) == 0.0


def test_quantized_payload_matches_the_codec():
    # 1000 elements, 1 bit, chunks of 512: 2 chunks x 8 bytes + ceil(1000 / 8) = 16 + 125
    assert cm.quantized_payload_bytes(1000, 1, 512) == 141
    from bunsan.compression import DEFAULT_CHUNK_SIZE, Quantizer

    assert cm.DEFAULT_CHUNK_SIZE == DEFAULT_CHUNK_SIZE
    for numel in (1, 511, 512, 513, 10_000):
        for bits in (1, 2, 4, 8, 16):
            assert cm.quantized_payload_bytes(numel, bits) == Quantizer(bits).payload_bytes(numel)


def test_striped_exchange():
    net = Network(latency_s=1e-5, bandwidth=1e6)
    # stripe of 4096 / 4 = 1024 elements at 1 bit: 2 chunks x 8 + 128 = 144 bytes;
    # all-to-all 3 x (1e-5 + 144e-6) = 4.62e-4 s, the all-gather the same
    assert cm.striped_exchange_time(4096, 1, 4, net) == pytest.approx(9.24e-4)
    assert cm.striped_exchange_bytes(4096, 1, 4) == 2 * 3 * 144
    # 9 chunks (many small tensors) over 4 stripes: the largest has 3 chunks: 24 + 128 bytes
    assert cm.stripe_bytes(4096, 1, 4, chunks=9) == 152
    slow_gather = Network(latency_s=0.0, bandwidth=1e6, gather_bandwidth=0.5e6)
    assert cm.striped_exchange_time(4096, 1, 4, slow_gather) == pytest.approx(2 * 3 * 144 / 0.5e6)


def test_exposed_communication_pipeline():
    # forward 1 s, backward 2 s, two equal buckets ready at 2 s and 3 s
    assert cm.exposed_communication(1.0, 2.0, [1, 1], lambda b: 0.5) == pytest.approx(0.5)  # 2 -> 2.5, 3 -> 3.5
    assert cm.exposed_communication(1.0, 2.0, [1, 1], lambda b: 1.5) == pytest.approx(2.0)  # 2 -> 3.5 -> 5
    assert cm.exposed_communication(1.0, 2.0, [], lambda b: 1.0) == 0.0


def test_bucket_sizes():
    mib = 2**20
    assert cm.bucket_sizes(60 * mib, 25 * mib) == [mib, 25 * mib, 25 * mib, 9 * mib]
    assert cm.bucket_sizes(100, 25 * mib) == [100]


def test_exact_prediction_with_and_without_overlap():
    mib = 2**20
    # 3 MiB of float32 gradients in three 1 MiB buckets; one bucket's all-reduce at 2 workers:
    # 2 * 1/2 * 1 MiB / (10 MiB/s) = 0.1 s. Compute 0.3 s: forward 0.1, backward 0.2.
    profile = Profile(compute_s=0.3, params=3 * mib // 4)
    net = Network(latency_s=0.0, bandwidth=10 * mib)
    exact = Candidate("data_parallel", {"bucket_size_mb": 1})
    p = cm.predict(profile, net, exact, 2)
    # ready at 0.1667, 0.2333, 0.3; done at 0.2667, 0.3667, 0.4667: 0.1667 s past backward
    assert p.exposed_s == pytest.approx(0.3 + 1 / 6 - 0.3, rel=1e-9)
    assert p.step_s == pytest.approx(0.4 + 1 / 15, rel=1e-9)
    assert p.efficiency == pytest.approx(0.3 / (0.4 + 1 / 15))
    assert p.bytes_per_step == pytest.approx(3 * mib)
    serial = cm.predict(profile, net, exact, 2, overlap=False)
    assert serial.step_s == pytest.approx(0.6)
    fp16 = cm.predict(profile, net, Candidate("data_parallel", {"compression": "fp16", "bucket_size_mb": 1}), 2)
    assert fp16.bytes_per_step == pytest.approx(1.5 * mib)
    # fp16 buckets are still cut at 1 MiB of gradients, each all-reduce half as long (0.05 s):
    # ready at 0.1667, 0.2333, 0.3; done at 0.2167, 0.2833, 0.35
    assert fp16.exposed_s == pytest.approx(0.05)
    alone = cm.predict(profile, net, exact, 1)
    assert alone.step_s == 0.3 and alone.bytes_per_step == 0 and alone.efficiency == 1.0


def test_quantized_prediction_adds_the_codec():
    profile = Profile(compute_s=1.0, params=1_000_000, encode_s_per_element=1e-9, decode_s_per_element=2e-9)
    net = Network(latency_s=0.0, bandwidth=1e12)
    p = cm.predict(profile, net, Candidate("data_parallel", {"bits": 1}), 4)
    # encode the gradient and the own stripe: 1e-9 * 1e6 * 1.25; decode 2 x the gradient: 2e-9 * 1e6 * 2
    # (+ the 16-byte count all-reduce, 2 * 3/4 * 16 / 1e12 s: nothing at 1 TB/s and no latency)
    assert p.codec_s == pytest.approx(1.25e-3 + 4e-3)
    assert p.step_s == pytest.approx(1.0 + 5.25e-3 + p.exposed_s)
    assert p.exposed_s < 1e-5  # the wire time is hidden in backward at 1 TB/s
    # 10 tensors in one bucket at 4 workers: 3 x (10 + 4) + 10 / 4 + 1 = 45.5 calls of 1e-4 s
    assert cm.codec_calls(10, 1, 4) == pytest.approx(45.5)
    calls = Profile(compute_s=1.0, params=1000, tensors=10, codec_call_s=1e-4)
    assert cm.predict(calls, net, Candidate("data_parallel", {"bits": 1}), 4).codec_s == pytest.approx(
        45.5e-4, rel=1e-3
    )
    # coded per bucket (a GPU): encode, decode of every rank's payload, encode of the sum, decode: 4 calls
    # per bucket; at 2 workers one encode and 4 decodes; rotated chunks alike
    assert cm.codec_calls(10, 1, 4, per_bucket=True) == 4 and cm.codec_calls(10, 3, 2, per_bucket=True) == 15
    batched = Profile(compute_s=1.0, params=1000, tensors=10, codec_call_s=1e-4, codec_per_bucket=True)
    assert cm.predict(batched, net, Candidate("data_parallel", {"bits": 1}), 4).codec_s == pytest.approx(4e-4, rel=1e-2)
    rotated = Candidate("data_parallel", {"bits": 1, "rotate": True})
    assert cm.predict(batched, net, rotated, 4).codec_s == pytest.approx(4e-4, rel=1e-2)


def test_two_workers_encode_every_element_once():
    # from 3 workers the owner encodes its summed stripe again: 1000 + 1000 / 4 elements; at 2 workers
    # each rank sends its first payload of the stripe it owns instead (no second quantization)
    assert cm.codec_elements(1000, 4) == (1250.0, 2000.0)
    assert cm.codec_elements(1000, 2) == (1000.0, 2000.0)
    assert cm.codec_elements(1000, 1) == (0.0, 0.0)
    # per segment, 10 tensors in 1 bucket: S = 12 segments encoded, their 2 x 12 payloads decoded
    assert cm.codec_call_counts(10, 1, 2) == (12.0, 24.0)
    net = Network(latency_s=0.0, bandwidth=1e12)
    profile = Profile(compute_s=1.0, params=10**6, encode_s_per_element=1e-9, decode_s_per_element=2e-9)
    eight = Candidate("data_parallel", {"bits": 8})
    # 1e-9 x 1e6 encoded + 2e-9 x 2e6 decoded (+ the count's 16-byte all-reduce: nothing at 1 TB/s)
    assert cm.predict(profile, net, eight, 2).codec_s == pytest.approx(1e-3 + 4e-3)
    assert cm.predict(profile, net, eight, 4).codec_s == pytest.approx(1.25e-3 + 4e-3)


def test_encode_and_decode_calls_are_priced_apart():
    # per segment, 10 tensors, 1 bucket, 4 workers: S = 10 + 4 = 14 segments; encode them all and the
    # own stripe (10 / 4 + 1), decode the received and the gathered ones (2 x 14)
    assert cm.codec_call_counts(10, 1, 4) == pytest.approx((14 + 3.5, 28))
    assert sum(cm.codec_call_counts(10, 1, 4)) == pytest.approx(cm.codec_calls(10, 1, 4))
    # per bucket: at 2 workers one encode and four decodes a bucket; from 3 workers two of each
    assert cm.codec_call_counts(10, 3, 2, per_bucket=True) == (3, 12)
    assert cm.codec_call_counts(10, 3, 8, per_bucket=True) == (6, 6)
    assert cm.codec_call_counts(10, 3, 1) == (0, 0)
    net = Network(latency_s=0.0, bandwidth=1e12)
    one_bit = Candidate("data_parallel", {"bits": 1})
    # an encode call 3e-4 s, a decode 1e-4 s (an encode costs 3 decodes): 1 x 3e-4 + 4 x 1e-4 at 2 workers,
    # where the mean (2e-4 for each of 5 calls) would price 1e-3
    split = Profile(
        compute_s=1.0,
        params=1000,
        tensors=10,
        codec_call_s=2e-4,
        encode_call_s=3e-4,
        decode_call_s=1e-4,
        codec_per_bucket=True,
    )
    assert cm.predict(split, net, one_bit, 2).codec_s == pytest.approx(7e-4, rel=1e-3)
    assert cm.predict(replace(split, encode_call_s=None, decode_call_s=None), net, one_bit, 2).codec_s == (
        pytest.approx(1e-3, rel=1e-3)
    )
    # at 4 workers two of each: 2 x 3e-4 + 2 x 1e-4, the same as the mean's 4 x 2e-4
    assert cm.predict(split, net, one_bit, 4).codec_s == pytest.approx(8e-4, rel=1e-2)
    # a width's own entry with its calls apart; a 4-entry one takes its mean call for both
    widths = Profile(compute_s=1.0, params=1000, codecs=((8, 4e-9, 1e-9, 2e-4, 3e-4, 1e-4), (2, 1e-9, 1e-9, 5e-5)))
    assert widths.codec(8) == (4e-9, 1e-9, 3e-4, 1e-4) and widths.codec(2) == (1e-9, 1e-9, 5e-5, 5e-5)
    # the model before the split, from the same measurement (1000 elements timed whole): every call at
    # the mean 2e-4, the per-element costs net of it (encode 0 + 3e-4 - 2e-4 over 1000: 1e-7 per element)
    before = cm.mean_call_profile(split, 1000)
    assert (before.encode_call_s, before.decode_call_s) == (None, None)
    assert before.encode_s_per_element == pytest.approx(1e-7) and before.decode_s_per_element == 0.0
    # (every element encoded once at 2 workers: cost_model.codec_elements)
    assert cm.predict(before, net, one_bit, 2).codec_s == pytest.approx(1e-3 + 1e-7 * 1000, rel=1e-3)
    # 8 bits: encode (4e-9 x 1000 + 3e-4 - 2e-4) / 1000; decode 1e-6 + 1e-4 - 2e-4 < 0: 0, as measure_codec clamps
    assert cm.mean_call_profile(widths, 1000).codecs[0] == (8, pytest.approx(1.04e-7), 0.0, pytest.approx(2e-4))
    assert cm.mean_call_profile(before, 1000) == before  # nothing split: unchanged
    # the mean comes from the two calls, not from a codec_call_s left at its default
    unset = cm.mean_call_profile(replace(split, codec_call_s=0.0), 1000)
    assert unset.codec_call_s == pytest.approx(2e-4) and unset.encode_s_per_element == pytest.approx(1e-7)
    with pytest.raises(ValueError, match="go together"):
        Profile(compute_s=1.0, params=1, encode_call_s=1e-4)
    with pytest.raises(ValueError, match="each codecs entry"):
        Profile(compute_s=1.0, params=1, codecs=((8, 1e-9, 1e-9, 1e-4, 1e-4),))


def test_block_algorithms_amortize_one_allreduce():
    profile = Profile(compute_s=0.1, params=1_000_000, batch=32)
    net = Network(latency_s=0.0, bandwidth=1e9)
    # block of 320 samples / 32 per step = 10 steps; all-reduce of 4e6 bytes at 2 workers: 4e-3 s
    for name in ("block_momentum", "model_averaging"):
        p = cm.predict(profile, net, Candidate(name, {"block_size": 320}), 2)
        assert p.step_s == pytest.approx(0.1004)
        assert p.bytes_per_step == pytest.approx(4e5)
    assert cm.block_steps(100, 32) == 4 and cm.block_steps(1, 32) == 1


def test_a_block_round_pays_its_passes_over_the_parameters():
    # one pass over 1e6 parameters: 1 ms; a round of model averaging makes 22/3, block momentum with its
    # Nesterov start 23/3, without it 22/3; a block of 10 steps: 4e-3 s of all-reduce + the passes, / 10
    profile = Profile(compute_s=0.1, params=1_000_000, batch=32, copy_s_per_element=1e-9)
    net = Network(latency_s=0.0, bandwidth=1e9)
    expected = {
        ("model_averaging", None): 0.1 + (4e-3 + 22e-3 / 3) / 10,
        ("block_momentum", None): 0.1 + (4e-3 + 23e-3 / 3) / 10,
        ("block_momentum", False): 0.1 + (4e-3 + 22e-3 / 3) / 10,
    }
    for (name, nesterov), step_s in expected.items():
        options = {"block_size": 320} if nesterov is None else {"block_size": 320, "nesterov": nesterov}
        assert cm.predict(profile, net, Candidate(name, options), 2).step_s == pytest.approx(step_s)
    # the round timed (a figure given, as plan --job reads from a record that holds one): 7 ms for its 1e6
    # elements, in place of the count at a copy's cost, for both algorithms; alone, a worker has no round
    timed = replace(profile, update_s_per_element=7e-9)
    for name in ("model_averaging", "block_momentum"):
        block = Candidate(name, {"block_size": 320})
        assert cm.predict(timed, net, block, 2).step_s == pytest.approx(0.1 + (4e-3 + 7e-3) / 10)
        assert cm.predict(timed, net, block, 1).step_s == pytest.approx(0.1)
    with pytest.raises(ValueError, match="block_momentum and model_averaging"):
        cm.block_round_passes(Candidate("data_parallel"))


@pytest.mark.parametrize(
    "algorithm,options", [("block_momentum", {}), ("block_momentum", {"nesterov": False}), ("model_averaging", {})]
)
def test_the_counted_passes_are_those_a_round_dispatches(algorithm, options):
    """The passes the cost model prices, against the memory traffic of the operations one round of the
    real algorithm dispatches (one process: the all-reduce moves nothing): each element read once, each
    written twice (the line is read before it is written, or was read by the operation itself), in
    float32 copies (3 elements moved per parameter)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import bunsan

    class Moved(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            schema = func._schema
            returns = schema.returns
            if "c10d" in schema.name or (returns and returns[0].alias_info and not returns[0].alias_info.is_write):
                return out  # a collective (counted as the network's) or a view (moves nothing)
            values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
            writes = False
            for arg, value in zip(schema.arguments, values):
                if isinstance(value, torch.Tensor):
                    written = arg.alias_info is not None and arg.alias_info.is_write
                    writes |= written
                    self.elements += value.numel() * (2 if written else 1)
            if not writes:  # a new tensor: written
                leaves = torch.utils._pytree.tree_leaves(out)
                self.elements += 2 * sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))
            return out

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = bunsan.distribute(model, optimizer, algorithm, block_size=4, **options)
    inner = optimizer.algorithm
    x, y = torch.randn(4, 300), torch.randint(0, 10, (4,))
    rounds = []
    block_round = inner._block_round

    def counted(*a, **k):
        with Moved() as moved:
            active = block_round(*a, **k)
        rounds.append(moved.elements)
        return active

    inner._block_round = counted
    for _ in range(3):  # a round after every step (blocks of one step); the first after the warm-up's
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert len(rounds) == 3
    passes = cm.block_round_passes(Candidate(algorithm, options))
    # the round's own tensors (its counts, the report) add a few dozen elements
    assert rounds[-1] / (3 * numel) == pytest.approx(passes, abs=0.01)


def test_every_exchange_travels_in_the_parameters_own_dtype():
    net = Network(latency_s=0.0, bandwidth=1e9)
    # bfloat16 parameters: 2 bytes an element. Exact at 2 workers after backward: an all-reduce of 2e6
    # bytes, 2 * 1/2 * 2e6 / 1e9 = 2e-3 s (4e-3 s in float32), 2e6 bytes sent a step
    bf16 = Profile(compute_s=0.1, params=1_000_000, batch=32, bytes_per_element=2)
    exact = cm.predict(bf16, net, Candidate("data_parallel"), 2, overlap=False)
    assert exact.step_s == pytest.approx(0.102) and exact.bytes_per_step == pytest.approx(2e6)
    # a block of 10 steps averages the bf16 parameters: 2e-3 s / 10 a step, 2e5 bytes
    block = cm.predict(bf16, net, Candidate("model_averaging", {"block_size": 320}), 2)
    assert block.step_s == pytest.approx(0.1002) and block.bytes_per_step == pytest.approx(2e5)
    # async: a remote worker's push of 2e6 bytes a step
    assert am.predict(bf16, net, Candidate("async"), 2).bytes_per_step == pytest.approx(2e6)
    # fp16 traffic of bf16 gradients halves nothing: the same 2e6 bytes
    fp16 = cm.predict(bf16, net, Candidate("data_parallel", {"compression": "fp16"}), 2, overlap=False)
    assert fp16.bytes_per_step == pytest.approx(2e6)
    # mixed: 3/4 of the elements in bfloat16, 1/4 in float32 -> 2.5 bytes an element, 2.5e6 bytes
    mixed = Profile(compute_s=0.1, params=1_000_000, bytes_per_element=2.5)
    assert mixed.gradient_bytes == 2_500_000
    with pytest.raises(ValueError, match="bytes_per_element"):
        Profile(compute_s=0.1, params=1, bytes_per_element=0.5)


def test_async_bottleneck_is_rank_zero():
    net = Network(latency_s=0.0, bandwidth=1e8)  # 4e6 bytes: 0.04 s per message
    # 2 workers: the worker's own push + pull, 0.1 + 0.08
    assert am.async_step(0.1, 4e6, 2, net, 1)[0] == pytest.approx(0.18)
    # 11 workers in step: a push (0.04), then 10 pulls sharing rank 0's link (0.4): 0.1 + 0.44
    assert am.async_step(0.1, 4e6, 11, net, 1)[0] == pytest.approx(0.54)
    assert am.async_step(0.1, 4e6, 11, net, 4)[0] == pytest.approx(0.21)  # 0.1 + 0.44 / 4
    # each pull on a core's own copy through memory (no shared link): rank 0 bounds the round, 10 x 0.04
    assert am.async_step(0.1, 4e6, 11, net, 1, convoy=False)[0] == pytest.approx(0.4)
    assert am.async_step(0.1, 4e6, 11, net, 4, convoy=False)[0] == pytest.approx(0.12)  # 0.1 + 0.08 / 4 > 0.1
    assert am.async_step(0.1, 4e6, 2, net, 1, convoy=False)[0] == pytest.approx(0.18)  # the same at 2 workers
    # the job's step at 11 workers: rank 0 at 0.1 s, ten remote workers at 0.54 s
    p = am.predict(Profile(compute_s=0.1, params=1_000_000), net, Candidate("async"), 11)
    assert p.step_s == pytest.approx(11 / (10 + 10 / 0.54)) and p.bytes_per_step == 4e6


def test_async_in_process_passes_over_the_model():
    net = Network(latency_s=0.0, bandwidth=1e8)  # 4e6 bytes: 0.04 s per message
    # one pass over 1e6 parameters: 1 ms; rank 0's worker makes 6 per push and pull, a remote 4, and
    # the server 2 for each remote push, between receiving it and replying (in the round trip)
    profile = Profile(compute_s=0.1, params=1_000_000, copy_s_per_element=1e-9)
    assert (am.ASYNC_OWN_PASSES, am.ASYNC_REMOTE_PASSES, am.ASYNC_SERVER_PASSES) == (6, 4, 2)
    assert am.async_step(0.1, 4e6, 2, net, 1, local_s=4e-3)[0] == pytest.approx(0.184)
    assert am.async_step(0.1, 4e6, 2, net, 1, apply_s=2e-3, local_s=4e-3)[0] == pytest.approx(0.186)
    p = am.predict(profile, net, Candidate("async"), 2)  # rank 0 at 0.106 s, the remote at 0.186 s
    assert p.step_s == pytest.approx(2 / (1 / 0.106 + 1 / 0.186))
    # a block round's timed work per element (update_s_per_element, plan --job) is not the server's
    timed = Profile(compute_s=0.1, params=1_000_000, copy_s_per_element=1e-9, update_s_per_element=5e-9)
    assert am.predict(timed, net, Candidate("async"), 2).step_s == pytest.approx(p.step_s)
    # a push every 4 steps (sync_period 128 at batch 32): the passes are amortized like the round trip
    every4 = am.predict(profile, net, Candidate("async", {"sync_period": 128}), 2)
    assert every4.step_s == pytest.approx(2 / (1 / 0.1015 + 1 / 0.1215))
    assert am.predict(profile, net, Candidate("async"), 1).step_s == pytest.approx(0.1)  # alone: no passes


def test_shared_compute_finds_the_cores_the_waiting_ranks_leave():
    # timed at 0.08 s with 2 ranks to a core: 0.04 s alone on one
    assert am.shared_compute(0.08, 2.0, lambda c: 0.5) == pytest.approx(0.04)  # half the ranks busy: a core each
    assert am.shared_compute(0.08, 2.0, lambda c: 0.75) == pytest.approx(0.06)
    assert am.shared_compute(0.08, 2.0, lambda c: 1.0) == pytest.approx(0.08)  # all busy: as timed
    assert am.shared_compute(0.08, 1.0, lambda c: 0.1) == 0.08  # a core each: nothing to gain
    # a share that grows with the compute, (1 + 3 c / (c + 0.01)) / 4: c = 0.02 (1 + 3 c / (c + 0.01)),
    # c^2 - 0.07 c - 0.0002 = 0, c = (0.07 + sqrt(0.0057)) / 2
    found = am.shared_compute(0.08, 2.0, lambda c: (1 + 3 * c / (c + 0.01)) / 4)
    assert found == pytest.approx((0.07 + math.sqrt(0.0057)) / 2, rel=1e-9)


def test_async_rank_zero_computes_alone_while_the_remotes_wait_on_the_link():
    # 4 ranks on 2 cores, timed at 0.08 s all busy; 4e6 bytes at 1e6 B/s: 4 s a message, so the
    # remotes take 16 s a step (a push, then 3 pulls on rank 0's link) and sit on the CPU 0.04 / 16 of it
    net = Network(latency_s=0.0, bandwidth=1e6)
    shared = Profile(compute_s=0.08, params=1_000_000, ranks_per_core=2.0)
    p = am.predict(shared, net, Candidate("async"), 4)
    assert p.step_s == pytest.approx(4 / (1 / 0.04 + 3 / 16.04))  # rank 0's worker at a core's speed
    assert p.compute_s == pytest.approx(0.04)
    alone = am.predict(Profile(compute_s=0.08, params=1_000_000), net, Candidate("async"), 4)
    assert alone.step_s == pytest.approx(4 / (1 / 0.08 + 3 / 16.08))
    # on a fast link every rank computes all the time: the compute stays as timed
    fast = am.predict(shared, Network(latency_s=0.0, bandwidth=1e12), Candidate("async"), 4)
    assert fast.compute_s == pytest.approx(0.08, rel=1e-3)
    # synchronous steps compute together: the share changes nothing there
    for candidate in (Candidate("data_parallel"), Candidate("block_momentum", {"block_size": 256})):
        assert (
            cm.predict(shared, net, candidate, 4).step_s
            == cm.predict(Profile(compute_s=0.08, params=1_000_000), net, candidate, 4).step_s
        )
    with pytest.raises(ValueError, match="ranks_per_core"):
        Profile(compute_s=0.08, params=10, ranks_per_core=0.5)


def test_global_batch_divides_the_compute():
    profile = Profile(compute_s=0.4, params=10, batch=128)
    assert profile.at_workers(4, global_batch=True).compute_s == pytest.approx(0.1)
    assert profile.at_workers(4, global_batch=True).batch == 32
    assert profile.at_workers(4).compute_s == 0.4


def test_predict_all_covers_every_pair():
    rows = am.predict_all(Profile(compute_s=0.1, params=1000), Network(1e-5, 1e9), am.default_candidates(), [1, 8])
    assert len(rows) == 2 * len(am.default_candidates())
    assert {r.workers for r in rows} == {1, 8}
    assert all(r.efficiency == 1.0 for r in rows if r.workers == 1)
    assert all(0 < r.efficiency < 1.0 for r in rows if r.workers == 8)


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="latency_s"):
        Network(latency_s=-1.0, bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        Network(latency_s=0.0, bandwidth=0.0)
    with pytest.raises(TypeError, match="params"):
        Profile(compute_s=0.1, params="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="params"):
        Profile(compute_s=0.1, params=0)
    with pytest.raises(ValueError, match="backward_fraction"):
        Profile(compute_s=0.1, params=1, backward_fraction=1.5)
    with pytest.raises(ValueError, match="knows algorithms"):
        Candidate("quantum")
    with pytest.raises(ValueError, match="workers"):
        am.predict(Profile(compute_s=0.1, params=1), Network(0.0, 1.0), Candidate("async"), 0)


def test_network_from_timings_recovers_alpha_and_beta():
    truth = Network(latency_s=2e-5, bandwidth=5e8, gather_bandwidth=2e8)
    sizes = [4, 4096, 2**20, 2**22]
    reduce = [(m, cm.ring_allreduce_time(m, 4, truth)) for m in sizes]
    gather = [(m, cm.allgather_time(m, 4, truth)) for m in sizes]
    fitted = cm.network_from_timings(reduce, 4, gather)
    assert fitted.latency_s == pytest.approx(2e-5, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(5e8, rel=1e-6)
    assert fitted.gather_bandwidth == pytest.approx(2e8, rel=1e-6)


def test_fit_line_by_hand_and_refusals():
    assert cm.fit_line([(0, 1), (1, 3), (2, 5)]) == pytest.approx((1.0, 2.0))
    assert cm.fit_line([(1, 1), (2, 3)]) == pytest.approx((0.0, 7 / 5))  # intercept -1 clipped: sum(xt)/sum(xx)
    with pytest.raises(ValueError, match="two or more distinct"):
        cm.fit_line([(1, 1), (1, 2)])
    with pytest.raises(ValueError, match="did not grow"):
        cm.fit_line([(1, 3), (2, 3)])


def test_stragglers():
    # steps: max(1, 3) = 3 and max(2, 2) = 2; mean of all four = 2, of the slowest = 2.5
    assert cm.compute_with_stragglers([[1.0, 2.0], [3.0, 2.0]]) == pytest.approx((2.0, 0.5))
    with pytest.raises(ValueError, match="same number"):
        cm.compute_with_stragglers([[1.0], [1.0, 2.0]])
    profile = Profile(compute_s=0.1, params=1000, batch=32, straggler_s=0.02)
    net = Network(latency_s=0.0, bandwidth=1e15)
    exact = cm.predict(profile, net, Candidate("data_parallel"), 2)
    assert exact.step_s == pytest.approx(0.12, rel=1e-6)  # waits for the slowest every step
    # a block of 128 / 32 = 4 steps waits once for a skew of 0.02 * sqrt(4): 0.04 / 4 per step
    block = cm.predict(profile, net, Candidate("model_averaging", {"block_size": 128}), 2)
    assert block.step_s == pytest.approx(0.11, rel=1e-6)
    assert am.predict(profile, net, Candidate("async"), 2).step_s == pytest.approx(0.1, rel=1e-3)  # no wait
    assert cm.predict(profile, net, Candidate("data_parallel"), 1).step_s == 0.1


def test_half_precision_traffic_pays_its_casts_and_its_own_bandwidth():
    mib = 2**20
    profile = Profile(compute_s=0.3, params=3 * mib // 4, cast_s_per_element=1e-8)
    net = Network(latency_s=0.0, bandwidth=10 * mib, half_bandwidth=5 * mib)
    p = cm.predict(profile, net, Candidate("data_parallel", {"compression": "fp16", "bucket_size_mb": 1}), 2)
    # half the bytes at half the bandwidth: each 1 MiB bucket's all-reduce takes 0.1 s as in fp32,
    # so the exposed part is the exact one (1/6 s); the casts add 1e-8 * 786432 s
    assert p.codec_s == pytest.approx(1e-8 * (3 * mib // 4))
    assert p.step_s == pytest.approx(0.3 + 1 / 6 + 1e-8 * (3 * mib // 4))


def test_codec_per_bit_width_and_measured_fixed_costs():
    # 1-bit codec 1 ns / element encode, 2 ns decode; 8-bit 4 and 1 ns, 1e-4 s per call
    profile = Profile(
        compute_s=1.0,
        params=1_000_000,
        encode_s_per_element=1e-9,
        decode_s_per_element=2e-9,
        codecs=((8, 4e-9, 1e-9, 1e-4),),
        fixed_s=(("exact", 2e-3), ("8-bit", 1e-3), ("block_momentum:320", 5e-4), ("async", 3e-4)),
    )
    assert profile.codec(8) == (4e-9, 1e-9, 1e-4, 1e-4) and profile.codec(1) == (1e-9, 2e-9, 0.0, 0.0)
    assert profile.fixed("exact") == 2e-3 and profile.fixed("fp16") == 0.0
    assert profile.fixed("async:sync_period=64") == 3e-4  # by algorithm where the label is not listed
    net = Network(latency_s=0.0, bandwidth=1e12)
    eight = cm.predict(profile, net, Candidate("data_parallel", {"bits": 8}, "8-bit"), 4)
    # encode 4e-9 * 1e6 * 1.25 + decode 1e-9 * 1e6 * 2, and 4 MB are two buckets (1 MiB first):
    # 1e-4 s x (3 x (1 + 2 x 4) + 1/4 + 2) calls
    assert eight.codec_s == pytest.approx(5e-3 + 2e-3 + 29.25e-4)
    # the fixed cost is part of what the exchange adds to the step
    assert eight.step_s == pytest.approx(1.0 + eight.codec_s + 1e-3 + (eight.exposed_s - 1e-3))
    assert eight.exposed_s >= 1e-3
    exact = cm.predict(profile, net, Candidate("data_parallel", {}, "exact"), 2)
    assert exact.step_s == pytest.approx(1.0 + 2e-3, abs=1e-5)
    block = cm.predict(profile, net, Candidate("block_momentum", {"block_size": 320}, "block_momentum:320"), 2)
    # a block of 10 steps: all-reduce of 4e6 bytes (4e-6 s at 1 TB/s) and the fixed 5e-4 s, once a block
    assert block.step_s == pytest.approx(1.0 + 4e-7 + 5e-5)
    # async: 2 workers, rank 0 at 1.0 s, the remote at 1.0 + 8e-6; rank 0's worker's fixed cost 3e-4 s,
    # the remote's none (no "async/remote" label): 2 / (1 / 1.0003 + 1 / 1.000008)
    run = am.predict(profile, net, Candidate("async"), 2)
    assert run.step_s == pytest.approx(2 / (1 / (1.0 + 3e-4) + 1 / (1.0 + 8e-6)))
    # with the remote's own, 5e-4 s, at 4 workers: 4 / (1 / 1.0003 + 3 / (remote + 5e-4))
    both = replace(profile, fixed_s=(("async", 3e-4), ("async/remote", 5e-4)))
    _, own, remote = am.async_rank_steps(both, net, Candidate("async"), 4)
    assert own == pytest.approx(1.0) and remote > 1.0
    assert am.async_fixed_labels("async") == ("async", "async/remote")
    run = am.predict(both, net, Candidate("async"), 4)
    assert run.step_s == pytest.approx(4 / (1 / (1.0 + 3e-4) + 3 / (remote + 5e-4)))
    # one worker: nothing is exchanged, nothing fixed is added
    assert cm.predict(profile, net, Candidate("data_parallel", {}, "exact"), 1).step_s == 1.0
    with pytest.raises(ValueError, match="codecs bits"):
        Profile(compute_s=1.0, params=1, codecs=((0, 1e-9, 1e-9, 0.0),))
    with pytest.raises(TypeError, match="fixed_s label"):
        Profile(compute_s=1.0, params=1, fixed_s=((1, 1e-3),))


def test_overlap_needs_a_spare_core_per_worker(monkeypatch):
    from bunsan.algorithms import measure
    from bunsan.launch import hosts

    monkeypatch.setattr(hosts, "usable_cores", lambda: 2)
    assert measure.can_overlap("cpu", 1) is True  # a core for compute, one for the backend's thread
    assert measure.can_overlap("cpu", 2) is False
    assert measure.can_overlap("meta", 8) is True  # an accelerator: the exchange leaves the compute alone
    assert measure.can_overlap("cpu", 2, over_memory=False) is True  # the backend's thread waits on a wire


def test_async_server_thread_takes_cpu_beside_the_ranks_without_a_spare_core():
    net = Network(latency_s=0.0, bandwidth=1e8)  # 4e6 bytes: 0.04 s per message
    profile = Profile(compute_s=0.1, params=1_000_000)
    # 3 workers, a core each: remotes at 0.1 + 0.08 = 0.18 s; the server thread works 2 x (push +
    # pull) = 0.16 s a round, exactly the time the 2 remotes spend off their cores: nothing slows
    p = am.predict(profile, net, Candidate("async"), 3, overlap=False)
    assert p.step_s == pytest.approx(3 / (1 / 0.1 + 2 / 0.18))
    # with a spare core the transfers are a link's: the remotes' 2 pulls share rank 0's, 0.1 + 0.04 + 0.08
    spared = am.predict(profile, net, Candidate("async"), 3, overlap=False, spare_core=True)
    assert spared.step_s == pytest.approx(3 / (1 / 0.1 + 2 / 0.22))
    # 4 ranks on 2 cores, 0.04 s alone (0.08 timed all busy). Spare core: the remotes (0.04 + 0.04
    # + 3 x 0.04 = 0.2 s) are on the CPU a fifth of the time: (1 + 3 / 5) / 4 < 1/2 of the ranks, 0.04
    shared = Profile(compute_s=0.08, params=1_000_000, ranks_per_core=2.0)
    spared = am.predict(shared, net, Candidate("async"), 4, overlap=False, spare_core=True)
    assert spared.compute_s == pytest.approx(0.04)
    assert spared.step_s == pytest.approx(4 / (1 / 0.04 + 3 / 0.2))
    # none spare: the server thread, busy 3 x 0.08 = 0.24 s of every remote step (so always), is one
    # more thread: c = 0.04 x 2 x (1 + 3 c / (c + 0.08) + 1) / 4, so c^2 - 0.02 c - 0.0032 = 0
    crowded = am.predict(shared, net, Candidate("async"), 4, overlap=False)
    c = (0.02 + math.sqrt(0.0132)) / 2
    assert crowded.compute_s == pytest.approx(c)
    assert crowded.step_s == pytest.approx(4 / (1 / c + 3 / (c + 0.08)))  # rank 0's worker pays no transfer
    assert am.predict(shared, net, Candidate("async"), 4, overlap=True, spare_core=False).step_s == pytest.approx(
        crowded.step_s
    )
    # a share above 1 slows every rank even with a core each; fewer ranks than cores count as a core each
    assert am.shared_compute(0.1, 1.0, lambda c: 1.25) == pytest.approx(0.125)
    assert am.shared_compute(0.1, 0.5, lambda c: 0.5) == pytest.approx(0.1)


def test_measure_codecs_one_entry_per_width():
    from bunsan.algorithms.measure import measure_codecs

    found = measure_codecs(4096, (8, 1, 8), repeats=1)
    assert [entry[0] for entry in found] == [1, 8]  # sorted, once each
    profile = Profile(compute_s=1.0, params=4096, codecs=found)
    for bits, encode, decode, call, encode_call, decode_call in found:
        assert profile.codec(bits) == (encode, decode, encode_call, decode_call)
        assert encode >= 0 and decode >= 0 and encode_call > 0 and decode_call > 0
        assert call == pytest.approx((encode_call + decode_call) / 2)  # the mean, for older readers


def test_measure_copy_times_one_float32_copy_per_element():
    import time

    from bunsan.algorithms.measure import measure_copy

    found = measure_copy(1_000_000, repeats=3)
    assert set(found) == {"copy_s_per_element"}
    # against the same copy timed here: within a factor that only a broken timing leaves (not a copy of
    # the capped size, or of something else)
    x, out = torch.randn(1_000_000), torch.empty(1_000_000)
    out.copy_(x)
    start = time.perf_counter()
    for _ in range(5):
        out.copy_(x)
    per_element = (time.perf_counter() - start) / 5 / 1_000_000
    assert per_element / 20 < found["copy_s_per_element"] < per_element * 20


def test_measure_core_copy_alone_is_a_copy_and_rejects_a_bad_share():
    from bunsan.algorithms.measure import measure_copy, measure_core_copy

    found = measure_core_copy(1_000_000, 2.0, repeats=3)  # no process group: this process's turn alone
    assert set(found) == {"core_copy_s_per_element"}
    copy = measure_copy(1_000_000, repeats=3)["copy_s_per_element"]
    assert copy / 20 < found["core_copy_s_per_element"] < copy * 20
    with pytest.raises(ValueError, match="ranks_per_core"):
        measure_core_copy(1000, 0.5)


def test_in_turns_runs_the_call_in_this_ranks_turn_and_returns_it():
    from bunsan.algorithms.measure import in_turns

    calls = []
    assert in_turns(lambda: calls.append(1) or [0.5], 2.0) == [0.5]  # no process group: one rank, turn 0
    assert calls == [1]  # once, whatever the turns
    with pytest.raises(ValueError, match="ranks_per_core"):
        in_turns(lambda: None, 0.9)


def test_async_passes_cost_the_copy_per_core_slowed_as_the_compute():
    net = Network(latency_s=0.0, bandwidth=1e8)  # 4e6 bytes: 0.04 s per message
    # 4 ranks on 2 cores, 0.08 s timed all busy (0.04 alone); a pass over the 1e6 parameters 5 ms timed
    # every rank at once, 2 ms with one rank per core. Spare core: the remotes (0.04 + 4 passes + push
    # + 3 pulls) wait most of their step, the share stays under 1/2, the compute at 0.04 alone
    timed = Profile(compute_s=0.08, params=1_000_000, ranks_per_core=2.0, copy_s_per_element=5e-9)
    per_core = replace(timed, core_copy_s_per_element=2e-9)
    compute, own, remote = am.async_rank_steps(per_core, net, Candidate("async"), 4, spare_core=True)
    assert compute == pytest.approx(0.04)
    assert own == pytest.approx(0.04 + 6 * 0.002)  # rank 0's six passes at the copy of a core alone
    assert remote == pytest.approx(0.04 + 2 * 0.002 + 4 * 0.002 + 0.04 + 3 * 0.04)  # apply + passes + trip
    # without the per-core copy: every pass at the copy timed all busy, as before
    _, own, remote = am.async_rank_steps(timed, net, Candidate("async"), 4, spare_core=True)
    assert own == pytest.approx(0.04 + 6 * 0.005)
    assert remote == pytest.approx(0.04 + 6 * 0.005 + 0.04 + 3 * 0.04)
    # a core each (ranks_per_core 1): the per-core copy is the copy timed all busy; the field is not read
    one_each = replace(per_core, ranks_per_core=1.0, compute_s=0.04)
    assert am.async_rank_steps(one_each, net, Candidate("async"), 4, spare_core=True)[1] == pytest.approx(0.07)
    # crowded (no spare core): the passes slow as the compute does, c / 0.04 the compute's slowdown
    compute, own, _ = am.async_rank_steps(per_core, net, Candidate("async"), 4, spare_core=False)
    assert compute > 0.04
    assert own == pytest.approx(compute + 6 * 0.002 * compute / 0.04)


def test_async_rank_0_worker_computes_at_the_compute_of_one_rank_per_core():
    net = Network(latency_s=0.0, bandwidth=1e8)  # 4e6 bytes: 0.04 s per message
    # 4 ranks on 2 cores, 0.08 s timed all busy; one rank per core computing at once timed 0.05 s (not
    # 0.08 / 2); a pass over the 1e6 parameters 2 ms
    timed = Profile(compute_s=0.08, params=1_000_000, ranks_per_core=2.0, copy_s_per_element=2e-9)
    per_core = replace(timed, core_compute_s=0.05)
    # spare core, the remotes waiting on the link: they compute at 0.04 (shared_compute); rank 0's worker
    # at the 0.05 timed on a core of its own, its six passes as before
    compute, own, remote = am.async_rank_steps(per_core, net, Candidate("async"), 4, spare_core=True)
    assert compute == pytest.approx(0.04)
    assert own == pytest.approx(0.05 + 6 * 0.002)
    assert remote == pytest.approx(am.async_rank_steps(timed, net, Candidate("async"), 4, spare_core=True)[2])
    assert am.async_rank_steps(timed, net, Candidate("async"), 4, spare_core=True)[1] == pytest.approx(0.04 + 0.012)
    # crowded (no spare core): the shared compute rises past 0.04; rank 0's worker's stays at 0.05 (its
    # passes at the copy timed all busy; with a per-core copy they slow as the shared compute does)
    compute, own, _ = am.async_rank_steps(per_core, net, Candidate("async"), 4, spare_core=False)
    assert compute > 0.04
    assert own == pytest.approx(0.05 + 6 * 0.002)
    copied = replace(per_core, core_copy_s_per_element=1e-9)
    compute, own, _ = am.async_rank_steps(copied, net, Candidate("async"), 4, spare_core=False)
    assert own == pytest.approx(0.05 + 6 * 0.001 * compute / 0.04)
    # the job's step: N / (1 / own + (N - 1) / remote), own with rank 0's fixed cost
    fixed = replace(per_core, fixed_s=(("async", 0.003),))
    _, own, remote = am.async_rank_steps(fixed, net, Candidate("async"), 4, spare_core=True)
    step = am.predict(fixed, net, Candidate("async"), 4, spare_core=True).step_s
    assert step == pytest.approx(4 / (1 / (0.062 + 0.003) + 3 / remote))
    # a core or more each (ranks_per_core 1), or one worker: the field is not read
    one_each = replace(per_core, ranks_per_core=1.0, compute_s=0.04)
    assert am.async_rank_steps(one_each, net, Candidate("async"), 4, spare_core=True)[1] == pytest.approx(0.052)
    assert am.async_rank_steps(per_core, net, Candidate("async"), 1)[1] == pytest.approx(0.08)
    # strong scaling divides it with the compute; a negative time is refused
    assert per_core.at_workers(4, global_batch=True).core_compute_s == pytest.approx(0.0125)
    with pytest.raises(ValueError, match="core_compute_s"):
        replace(per_core, core_compute_s=-1.0)


def test_a_token_bucket_passes_its_burst_after_an_idle_compute():
    # 100 Mbit/s = 12.5e6 B/s, tc tbf's 16 KiB burst: the bucket holds min(16384, 12.5e6 * idle) bytes
    net = Network(latency_s=0.0, bandwidth=12.5e6, burst_bytes=16384)
    assert cm.burst_credit(net, 32768, 0.01) == pytest.approx(16384 / 12.5e6)  # 1.31072 ms
    assert cm.burst_credit(net, 32768, 0.0005) == pytest.approx(6250 / 12.5e6)  # refilled 6250 B only
    assert cm.burst_credit(net, 1000, 0.01) == pytest.approx(1000 / 12.5e6)  # the whole message
    assert cm.burst_credit(net, 32768, 0.01, bandwidth=6.25e6) == pytest.approx(16384 / 6.25e6)
    assert cm.burst_credit(Network(0.0, 12.5e6), 32768, 0.01) == 0.0  # no bucket
    with pytest.raises(ValueError, match="burst_bytes"):
        Network(0.0, 12.5e6, burst_bytes=-1)


def test_the_burst_shortens_the_exchange_of_a_step_and_of_a_block():
    # 8192 float32 parameters (32 KB) at 2 workers: each rank sends 2 * 1/2 * 32768 = 32768 B a step,
    # 2.62144 ms at 12.5e6 B/s; after 2 ms of compute the bucket holds its 16 KiB (25,000 B refilled):
    # 1.31072 ms saved, so 2 + 2.62144 - 1.31072 = 3.31072 ms
    profile = Profile(compute_s=0.002, params=8192, batch=32)
    plain, bucket = Network(0.0, 12.5e6), Network(0.0, 12.5e6, burst_bytes=16384)
    exact = Candidate("data_parallel")
    assert cm.predict(profile, plain, exact, 2, overlap=False).step_s == pytest.approx(4.62144e-3)
    assert cm.predict(profile, bucket, exact, 2, overlap=False).step_s == pytest.approx(3.31072e-3)
    # a block of 256 samples = 8 steps: one exchange of 32768 B after 16 ms of compute, 1.31072 ms of it
    # saved: (2.62144 - 1.31072) / 8 = 0.16384 ms a step
    block = Candidate("model_averaging", {"block_size": 256})
    assert cm.predict(profile, bucket, block, 2).step_s == pytest.approx(2.16384e-3)
    # a burst larger than the message: its whole exchange passes at once, never below nothing
    huge = Network(0.0, 12.5e6, burst_bytes=1e9)
    assert cm.predict(profile, huge, exact, 2, overlap=False).step_s == pytest.approx(
        2e-3 + 32768 / 12.5e6 - 25000 / 12.5e6
    )
    assert cm.predict(Profile(compute_s=0.01, params=8192, batch=32), huge, exact, 2, overlap=False).step_s == (
        pytest.approx(0.01)
    )


def test_the_bucket_refills_over_the_steps_costs_off_the_wire_as_over_its_compute():
    # 0.5 ms of compute refills 6250 B of the 16 KiB bucket; the step's 1 ms of fixed costs (off the wire:
    # the link idles) fills it: 16384 B pass at once, 0.5 + 1 + 2.62144 - 1.31072 = 2.81072 ms (with the
    # compute alone refilling, 0.5 + 1 + 2.62144 - 0.5 = 3.62144)
    bucket = Network(0.0, 12.5e6, burst_bytes=16384)
    exact = Candidate("data_parallel")
    profile = Profile(compute_s=0.0005, params=8192, batch=32, fixed_s=((exact.label, 0.001),))
    assert cm.predict(profile, bucket, exact, 2, overlap=False).step_s == pytest.approx(2.81072e-3)
    # a fixed cost timed below nothing (the tiny model's step faster than priced) does not shorten the idle
    faster = replace(profile, fixed_s=((exact.label, -0.0002),))
    assert cm.predict(faster, bucket, exact, 2, overlap=False).step_s == pytest.approx(
        0.0005 - 0.0002 + 32768 / 12.5e6 - 6250 / 12.5e6
    )
    # a block of 8 steps: 4 ms of compute refill 50,000 B already; its fixed cost per block changes nothing
    block = Candidate("model_averaging", {"block_size": 256})
    blocked = replace(profile, fixed_s=((block.label, 0.001),))
    assert cm.predict(blocked, bucket, block, 2).step_s == pytest.approx(0.0005 + (2.62144e-3 - 1.31072e-3 + 0.001) / 8)


def test_async_push_and_pull_get_the_burst_of_their_links():
    # 32768 B messages at 12.5e6 B/s (2.62144 ms each) after 2 ms of compute, 16 KiB bursts
    net = Network(latency_s=0.0, bandwidth=12.5e6, burst_bytes=16384)
    # 2 workers: push and pull each 1.31072 ms shorter: 2 + 2 * (2.62144 - 1.31072) = 4.62144 ms
    assert am.async_step(0.002, 32768, 2, net, 1)[0] == pytest.approx(4.62144e-3)
    # 5 workers in step: a push (2.62144 - 1.31072), then 4 pulls sharing rank 0's link and its bucket
    # (10.48576 - 1.31072): 2 + 1.31072 + 9.17504 ms
    assert am.async_step(0.002, 32768, 5, net, 1)[0] == pytest.approx(12.48576e-3)
    # through memory: rank 0's round of 4 pulls, 10.48576 - 1.31072 = 9.17504 ms, above a worker's own
    # 2 + 2.62144 + 2.62144 - 1.31072 - 0.32768
    assert am.async_step(0.002, 32768, 5, net, 1, convoy=False)[0] == pytest.approx(9.17504e-3)
    # without a bucket, as before: 2 + 2 * 2.62144
    assert am.async_step(0.002, 32768, 2, Network(0.0, 12.5e6), 1)[0] == pytest.approx(7.24288e-3)


def test_exact_over_a_link_with_ranks_sharing_cores_waits_the_straggler_of_steps_started_together():
    net = cm.Network(1e-4, 1e9)
    profile = cm.Profile(compute_s=0.02, params=1000, straggler_s=0.010, synced_straggler_s=0.001, ranks_per_core=2.0)
    exact = cm.Candidate("data_parallel", {}, "exact")
    # one 4000-byte bucket after backward: 6 ring steps of (1e-4 + 1000 / 1e9) = 0.606 ms
    assert cm.ring_allreduce_time(4000, 4, net) == pytest.approx(6.06e-4)
    # over a link: 20 ms + the synced 1 ms + 0.606 ms
    assert cm.predict(profile, net, exact, 4, overlap=True).step_s == pytest.approx(0.021606)
    assert cm.exact_released_together(profile, exact, 4, True)
    # through memory (no overlap): the wait of steps run free, 10 ms
    assert cm.predict(profile, net, exact, 4, overlap=False).step_s == pytest.approx(0.030606)
    assert not cm.exact_released_together(profile, exact, 4, False)
    # each of these keeps the wait of steps run free: 9 ms more than the synced one
    others = {
        "fp16": (profile, cm.Candidate("data_parallel", {"compression": "fp16"}, "fp16"), 4),
        "8-bit": (profile, cm.Candidate("data_parallel", {"bits": 8}, "8-bit"), 4),
        "a core a rank": (replace(profile, ranks_per_core=1.0), exact, 4),
        "not timed": (replace(profile, synced_straggler_s=None), exact, 4),
    }
    for name, (p, candidate, n) in others.items():
        assert not cm.exact_released_together(p, candidate, n, True), name
        free = cm.predict(replace(p, synced_straggler_s=None), net, candidate, n, overlap=True).step_s
        assert cm.predict(p, net, candidate, n, overlap=True).step_s == pytest.approx(free), name
    free = cm.predict(replace(profile, straggler_s=0.001, synced_straggler_s=None), net, exact, 4).step_s
    assert free == pytest.approx(0.021606)  # the same as the free wait of 1 ms
    # one worker waits for nobody; a negative synced wait is refused
    assert not cm.exact_released_together(profile, exact, 1, True)
    with pytest.raises(ValueError, match="synced_straggler_s"):
        cm.Profile(compute_s=0.02, params=1000, synced_straggler_s=-0.001)


def test_the_synchronous_model_refuses_async_and_the_full_one_prices_every_algorithm():
    profile, net = Profile(compute_s=0.1, params=1_000_000), Network(1e-4, 1e9)
    with pytest.raises(ValueError, match="async_model.predict"):
        cm.predict(profile, net, Candidate("async"), 2)
    for candidate in am.default_candidates():
        if candidate.algorithm != "async":  # the full model hands the synchronous ones over unchanged
            assert am.predict(profile, net, candidate, 4) == cm.predict(profile, net, candidate, 4)


def test_auto_and_the_synchronous_model_never_import_the_async_pricing():
    import subprocess
    import sys

    code = (
        "import sys, bunsan.algorithms.auto, bunsan.algorithms.cost_model; "
        "print('bunsan.algorithms.async_model' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
