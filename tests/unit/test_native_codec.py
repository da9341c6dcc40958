"""bunsan.compression.native: the C 1-bit kernels agree with the torch path they replace."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from bunsan.compression import Quantizer, RotatedQuantizer, native

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler: the codec runs on torch operations"
)


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "available", lambda: False)


@needs_compiler
def test_the_kernels_build_where_a_compiler_exists():
    assert native.available(), native.unavailable_reason()


@needs_compiler
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 511, 512, 1000, 3 * 512 + 5, 70_001])
@pytest.mark.parametrize("chunk_size", [8, 64, 512])
def test_native_encode_matches_torch_and_decodes_bit_for_bit(monkeypatch, numel, chunk_size):
    quantizer = Quantizer(1, chunk_size)
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 4  # heavy-tailed
    x[: min(numel, 3)] = 0.0  # zeros are non-negative: code 1
    residual = torch.randn(numel, generator=g) * 0.1
    fast_residual = residual.clone()
    fast = quantizer.encode_with_feedback(x, fast_residual)
    fast_plain = quantizer.encode(x + residual)
    fast_decoded = quantizer.decode(fast, numel)
    _torch_path(monkeypatch)
    slow_residual = residual.clone()
    slow = quantizer.encode_with_feedback(x, slow_residual)
    chunks = quantizer.num_chunks(numel)
    # The codes are identical; the chunk means may differ in their last bits (another summation order).
    assert torch.equal(fast[8 * chunks :], slow[8 * chunks :])
    assert torch.equal(fast_plain, fast)  # encode(v) and encode_with_feedback(x, r) with v = x + r
    fast_params, slow_params = quantizer.chunk_params(fast, numel), quantizer.chunk_params(slow, numel)
    for a, b in zip(fast_params, slow_params):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    # Decoding one payload gives the same bits on both paths, and each residual is exactly v - decode.
    assert torch.equal(quantizer.decode(fast, numel), fast_decoded)
    assert torch.equal(fast_residual, (x + residual) - fast_decoded)
    assert torch.equal(slow_residual, (x + residual) - quantizer.decode(slow, numel))


@needs_compiler
def test_decode_add_is_the_sum_rounded_as_torch_rounds_it(monkeypatch):
    quantizer = Quantizer(1)
    g = torch.Generator().manual_seed(3)
    numel = 5000
    payloads = [quantizer.encode(torch.randn(numel, generator=g)) for _ in range(3)]
    total = torch.zeros(numel)
    for payload in payloads:
        quantizer.decode_add(payload, numel, total)
    _torch_path(monkeypatch)
    expected = torch.zeros(numel)
    for payload in payloads:
        expected.add_(quantizer.decode(payload, numel))
    assert torch.equal(total, expected)


@needs_compiler
def test_native_handles_unaligned_payloads_and_half_inputs():
    quantizer = Quantizer(1)
    x = torch.randn(1300, generator=torch.Generator().manual_seed(5))
    size = quantizer.payload_bytes(x.numel())
    storage = torch.zeros(size + 3, dtype=torch.uint8)
    payload = quantizer.encode(x, out=storage[3:])  # params at an address that is not 4-byte aligned
    assert torch.equal(payload, quantizer.encode(x))
    residual_a, residual_b = torch.zeros(1300), torch.zeros(1300)
    quantizer.encode_with_feedback(x.half(), residual_a)
    quantizer.encode_with_feedback(x.half().float(), residual_b)
    assert torch.equal(residual_a, residual_b)
    strided = torch.randn(2600, generator=torch.Generator().manual_seed(6))[::2]  # not contiguous
    assert torch.equal(quantizer.encode(strided), quantizer.encode(strided.contiguous()))


@needs_compiler
@pytest.mark.parametrize("numel", [1, 8, 100, 512, 1000, 5 * 512 + 37])
def test_native_rotated_codec_matches_the_torch_rotation(monkeypatch, numel):
    codec = RotatedQuantizer(1)
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 4
    residual = torch.randn(numel, generator=g) * 0.1
    fast_residual = residual.clone()
    fast = codec.encode_with_feedback(x, fast_residual)
    fast_decoded = codec.decode(fast, numel)
    added = torch.ones(numel)
    codec.decode_add(fast, numel, added)
    _torch_path(monkeypatch)
    # The torch path decodes the native payload to the same bits, and the residual is exactly v - decode.
    assert torch.equal(codec.decode(fast, numel), fast_decoded)
    assert torch.equal(fast_residual, (x + residual) - fast_decoded)
    assert torch.equal(added, torch.ones(numel) + fast_decoded)
    slow_residual = residual.clone()
    slow = codec.encode_with_feedback(x, slow_residual)
    chunks = codec.inner.num_chunks(codec.padded_numel(numel))
    assert torch.equal(fast[8 * chunks :], slow[8 * chunks :])  # the same codes
    torch.testing.assert_close(
        fast[: 8 * chunks].view(torch.float32), slow[: 8 * chunks].view(torch.float32), rtol=2e-6, atol=1e-7
    )


@needs_compiler
@pytest.mark.parametrize("rotate", [False, True])
def test_decode_sum_is_the_same_on_both_paths_and_near_the_sum_of_decodes(monkeypatch, rotate):
    codec = RotatedQuantizer(1, 1024) if rotate else Quantizer(1)
    numel = 3 * 1024 + 300
    g = torch.Generator().manual_seed(11)
    payloads = [codec.encode(torch.randn(numel, generator=g)) for _ in range(3)]
    fast = codec.decode_sum(payloads, numel, torch.empty(numel))
    separate = sum(codec.decode(p, numel) for p in payloads)
    torch.testing.assert_close(fast, separate, rtol=1e-5, atol=1e-5)  # rotated: summed before rotating back
    _torch_path(monkeypatch)
    assert torch.equal(codec.decode_sum(payloads, numel, torch.empty(numel)), fast)


@needs_compiler
def test_the_sse2_and_avx2_builds_give_the_same_bits(monkeypatch):
    """The AVX2 build (chosen where the CPU has it) and the SSE2 baseline do the same IEEE operations."""
    codec = RotatedQuantizer(1, 1024)
    numel = 5 * 1024 + 77
    g = torch.Generator().manual_seed(21)
    x, residual = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    if not native._has_avx2():
        pytest.skip("this CPU has no AVX2: only the SSE2 build runs here")
    results = []
    for extra in ([], ["-mavx2"]):
        try:
            library = native._compile_with(extra)
        except Exception as e:  # a compiler without -mavx2: nothing to compare
            pytest.skip(f"no {extra} build: {e}")
        monkeypatch.setattr(native, "_library", library)
        r = residual.clone()
        payload = codec.encode_with_feedback(x, r)
        results.append((payload, r, codec.decode(payload, numel)))
    (p0, r0, d0), (p1, r1, d1) = results
    assert torch.equal(p0, p1) and torch.equal(r0, r1) and torch.equal(d0, d1)


@needs_compiler
@pytest.mark.parametrize("rotate", [False, True])
def test_decode_sum_then_takes_pieces_out_of_momentum_units_on_both_paths(monkeypatch, rotate):
    """The pieces (lo, hi, b, a, divisor): out[lo:hi] = (sum - a * b) / divisor, elsewhere the plain sum."""
    codec = RotatedQuantizer(1, 1024) if rotate else Quantizer(1)
    numel = 3 * 1024 + 300
    g = torch.Generator().manual_seed(12)
    payloads = [codec.encode(torch.randn(numel, generator=g)) for _ in range(2)]
    # Pieces that start and end inside chunks, one spanning two chunks, and a gap between them.
    b1, b2 = torch.randn(700, generator=g), torch.randn(1000, generator=g)
    then = [(100, 800, b1, 0.5, 0.25), (1500, 2500, b2, 0.81, 1.9)]
    fast = codec.decode_sum(payloads, numel, torch.empty(numel), then=then)
    plain = codec.decode_sum(payloads, numel, torch.empty(numel))
    expected = plain.clone()
    for lo, hi, b, a, divisor in then:
        expected[lo:hi].sub_(b, alpha=a).div_(divisor)
    assert torch.equal(fast, expected)  # rounded as torch's sub_ with alpha, then div_: the same bits
    assert torch.equal(fast[:100], plain[:100]) and torch.equal(fast[800:1500], plain[800:1500])
    _torch_path(monkeypatch)
    assert torch.equal(codec.decode_sum(payloads, numel, torch.empty(numel), then=then), fast)


@needs_compiler
def test_axpby_is_torch_arithmetic_in_one_pass(monkeypatch):
    from bunsan.algorithms.data_parallel.momentum import lincomb

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(10_003, generator=g), torch.randn(10_003, generator=g)
    out, scaled = torch.empty_like(x), torch.empty_like(x)
    lincomb(x, 0.9, y, 0.1, out, scaled, 2.0)  # the bits of the torch operations it replaces:
    assert torch.equal(out, torch.mul(x, 0.9).add_(y, alpha=0.1)) and torch.equal(scaled, out / 2.0)
    lincomb(None, 0.0, y, 0.3, out)
    assert torch.equal(out, 0.3 * y)
    same = x.clone()
    lincomb(same, 1.0, y, -0.5, same, same, 0.7)  # every argument the same tensor as out: read before written
    assert torch.equal(same, x.clone().sub_(y, alpha=0.5).div_(0.7))
    fast = torch.empty_like(x)
    lincomb(x, 0.9, y, 0.1, fast)
    fast_into_y = y.clone()
    lincomb(x, 0.9, fast_into_y, 0.1, fast_into_y)  # out is y: y is read before it is written
    _torch_path(monkeypatch)
    slow = torch.empty_like(x)
    lincomb(x, 0.9, y, 0.1, slow)
    assert torch.equal(slow, fast)
    slow_into_y = y.clone()
    lincomb(x, 0.9, slow_into_y, 0.1, slow_into_y)
    assert torch.equal(slow_into_y, fast) and torch.equal(fast_into_y, fast)
