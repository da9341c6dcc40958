"""SegmentCodec: many segments coded in one call, in the per-segment payload layout."""

from __future__ import annotations

import pytest
import torch

from bunsan.algorithms.data_parallel.stripes import coded_per_bucket
from bunsan.compression import Quantizer
from bunsan.compression.rotation import RotatedQuantizer
from bunsan.compression.segments import SegmentCodec, batches

# full chunks, a short tail, exactly one chunk, a single element, a tail of 3, and the last
# segment ending at the payload's end (a short chunk's unread bytes must not index past it)
LENGTHS = [700, 1024, 1, 1300, 3, 1900, 512, 37]


def _layout(quantizer: Quantizer, lengths=LENGTHS, gap: int = 5):
    segments, lo, at = [], 0, 0
    for length in lengths:
        segments.append((lo, length, at))
        lo += length + gap  # values between segments belong to nobody
        at += quantizer.payload_bytes(length)
    return segments, lo, at


def _per_segment(quantizer, segments, x, residual, size):
    payload = torch.zeros(size, dtype=torch.uint8)
    for lo, length, at in segments:
        out = payload[at : at + quantizer.payload_bytes(length)]
        quantizer.encode_with_feedback(x[lo : lo + length], residual[lo : lo + length], out=out)
    return payload


def _decoded(quantizer, segments, payload, numel):
    out = torch.full((numel,), 7.0)
    for lo, length, at in segments:
        quantizer.decode(payload[at : at + quantizer.payload_bytes(length)], length, out=out[lo : lo + length])
    return out


CODECS = [Quantizer(b) for b in (1, 2, 3, 4, 8, 12, 16)] + [
    RotatedQuantizer(1, chunk_size=1024),  # DataParallelSGD's rotated default
    RotatedQuantizer(1),
    RotatedQuantizer(2),
]


@pytest.mark.parametrize("q", CODECS, ids=repr)
def test_one_call_writes_the_per_segment_layout_with_exact_error_feedback(q):
    bits = q.bits
    segments, numel, size = _layout(q)
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g) * 3
    start = torch.randn(numel, generator=g) * 0.1
    reference = _per_segment(q, segments, x, start.clone(), size)
    residual = start.clone()
    payload = torch.zeros(size, dtype=torch.uint8)
    codec = SegmentCodec(q, segments, "cpu")
    codec.encode(x, payload, residual)
    # the per-segment decoder reads the one-call payload; the one-call decoder agrees with it bit for bit
    mine = _decoded(q, segments, payload, numel)
    out = torch.full((numel,), 7.0)
    codec.decode(payload, out)
    assert torch.equal(out, mine)
    # error feedback is exact: the residual is v - decode(payload), bit for bit, in the segments only
    inside = torch.zeros(numel, dtype=torch.bool)
    for lo, length, _ in segments:
        inside[lo : lo + length] = True
    assert torch.equal(residual[inside], ((x + start) - mine)[inside])
    assert torch.equal(residual[~inside], start[~inside])  # nobody's values are left alone
    assert torch.equal(out[~inside], torch.full_like(out[~inside], 7.0))
    # against the per-segment call: the same values up to a last-bit difference in a chunk's two parameters
    theirs = _decoded(q, segments, reference, numel)
    scale = (x + start)[inside].abs().max()
    assert (mine - theirs)[inside].abs().max() <= 1e-5 * scale
    for _, length, at in segments:  # the codes byte for byte; the parameters to float32 rounding
        params, end = at + q.params_bytes(length), at + q.payload_bytes(length)
        assert torch.equal(payload[params:end], reference[params:end])
        torch.testing.assert_close(
            payload[at:params].clone().view(torch.float32),
            reference[at:params].clone().view(torch.float32),
            rtol=1e-5,
            atol=1e-7,
        )


def test_padding_does_not_change_a_payload():
    """The owner encodes decoded rows, whose padding holds each chunk's offset: the means ignore it."""
    for bits in (1, 2, 8):
        q = Quantizer(bits)
        segments, numel, size = _layout(q)
        codec = SegmentCodec(q, segments, "cpu")
        rows = codec.gather(torch.randn(numel, generator=torch.Generator().manual_seed(bits)))
        clean = torch.zeros(size, dtype=torch.uint8)
        codec.encode_rows(rows, clean)
        dirty_rows = rows.clone()
        dirty_rows[codec.full_rows :] += 50.0 * ~codec._mask[codec.full_rows :]
        dirty = torch.zeros(size, dtype=torch.uint8)
        codec.encode_rows(dirty_rows, dirty)
        assert torch.equal(clean, dirty), bits


@pytest.mark.parametrize("q", [Quantizer(1), RotatedQuantizer(1, chunk_size=1024)], ids=repr)
def test_sums_of_payloads_at_shifts(q):
    segments, numel, size = _layout(q)
    codec = SegmentCodec(q, segments, "cpu")
    g = torch.Generator().manual_seed(0)
    many = torch.zeros(3 * size, dtype=torch.uint8)
    for i in range(3):
        codec.encode(torch.randn(numel, generator=g), many, shift=i * size)
    decoded = codec.decode_rows(many, [0, size, 2 * size])
    # two in rank order (what both ranks of a pair compute): as the per-segment decode_sum, bit for bit
    two = codec.scatter(codec.decode_sum_rows(many, [0, size]), torch.zeros(numel))
    theirs = torch.zeros(numel)
    for lo, length, at in segments:
        end = at + q.payload_bytes(length)
        q.decode_sum([many[at:end], many[size + at : size + end]], length, theirs[lo : lo + length])
    assert torch.equal(two, theirs)
    three = codec.decode_sum_rows(many, [0, size, 2 * size])
    torch.testing.assert_close(
        codec.scatter(three, torch.zeros(numel)), codec.scatter(decoded.sum(0), torch.zeros(numel))
    )
    # each shift decodes its own payload, as the per-segment decoder reads it
    assert torch.equal(
        codec.scatter(decoded[2], torch.zeros(numel)),
        _decoded(q, segments, many[2 * size :], numel) * _mask(segments, numel),
    )


def _mask(segments, numel):
    inside = torch.zeros(numel)
    for lo, length, _ in segments:
        inside[lo : lo + length] = 1.0
    return inside


def test_half_precision_values_and_buffers():
    q = Quantizer(2)
    segments, numel, size = _layout(q)
    codec = SegmentCodec(q, segments, "cpu")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    payload = torch.zeros(size, dtype=torch.uint8)
    codec.encode(x, payload)
    reference = torch.zeros(size, dtype=torch.uint8)
    for lo, length, at in segments:
        q.encode(x[lo : lo + length], out=reference[at : at + q.payload_bytes(length)])
    assert (payload != reference).float().mean() < 0.01
    out = torch.zeros(numel, dtype=torch.bfloat16)
    codec.decode(payload, out)  # scatter casts to the buffer's type
    assert torch.equal(
        out, _decoded(q, segments, payload, numel).to(torch.bfloat16) * _mask(segments, numel).bfloat16()
    )


def test_which_codecs_batch_and_the_override(monkeypatch):
    assert batches(Quantizer(1)) and batches(Quantizer(8)) and batches(Quantizer(3, chunk_size=8))
    assert not batches(Quantizer(3, chunk_size=5))  # 15 bits a chunk: codes do not start on a byte
    assert batches(RotatedQuantizer(1)) and batches(RotatedQuantizer(1, chunk_size=1024))
    assert not batches(RotatedQuantizer(1, chunk_size=4))  # 4 bits a chunk
    assert not batches(object())
    with pytest.raises(ValueError, match="one segment per call"):
        SegmentCodec(Quantizer(3, chunk_size=5), [(0, 10, 0)], "cpu")
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("BUNSAN_CODEC_CALLS", raising=False)
    assert not coded_per_bucket(Quantizer(1), cpu) and coded_per_bucket(Quantizer(1), gpu)
    assert coded_per_bucket(RotatedQuantizer(1), gpu) and not coded_per_bucket(Quantizer(3, chunk_size=5), gpu)
    monkeypatch.setenv("BUNSAN_CODEC_CALLS", "bucket")
    assert coded_per_bucket(Quantizer(1), cpu)
    monkeypatch.setenv("BUNSAN_CODEC_CALLS", "segment")
    assert not coded_per_bucket(Quantizer(1), gpu)
    monkeypatch.setenv("BUNSAN_CODEC_CALLS", "always")
    with pytest.raises(ValueError, match="bucket or segment"):
        coded_per_bucket(Quantizer(1), cpu)


@pytest.mark.parametrize("q", [Quantizer(1), RotatedQuantizer(1)], ids=repr)
def test_an_empty_plan(q):
    codec = SegmentCodec(q, [], "cpu")
    payload = torch.zeros(0, dtype=torch.uint8)
    codec.encode(torch.zeros(4), payload, torch.zeros(4))
    assert codec.decode_rows(payload, [0]).shape == (1, 0, 512)
    assert codec.decode_sum_rows(payload, [0, 0, 0]).shape == (0, 512)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("q", [Quantizer(1), Quantizer(8), RotatedQuantizer(1, chunk_size=1024)], ids=repr)
def test_on_cuda_the_codes_are_the_cpu_codecs_and_feedback_is_exact(q):
    """Where the exchange runs it (a GPU): the one-call payload's codes are what the per-segment codec
    on the CPU writes, the CPU decodes it to the GPU's values, and nothing is lost."""
    segments, numel, size = _layout(q)
    g = torch.Generator().manual_seed(q.bits)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g) * 3
    reference = _per_segment(q, segments, x, torch.zeros(numel), size)
    residual = torch.zeros(numel, device="cuda")
    payload = torch.zeros(size, dtype=torch.uint8, device="cuda")
    codec = SegmentCodec(q, segments, "cuda")
    codec.encode(x.cuda(), payload, residual)
    out = torch.zeros(numel, device="cuda")
    codec.decode(payload, out)
    inside = _mask(segments, numel).bool()
    torch.testing.assert_close((out + residual).cpu()[inside], x[inside], rtol=1e-5, atol=1e-6)  # nothing lost
    for _, length, at in segments:
        params, end = at + q.params_bytes(length), at + q.payload_bytes(length)
        assert torch.equal(payload[params:end].cpu(), reference[params:end])
    mine = _decoded(q, segments, payload.cpu(), numel)
    torch.testing.assert_close(mine[inside], out.cpu()[inside], rtol=1e-6, atol=1e-7)
