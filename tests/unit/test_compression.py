"""bunsan.compression: bit packing, chunked quantization with error feedback."""

from __future__ import annotations

import pytest
import torch

from bunsan.compression import (
    DEFAULT_CHUNK_SIZE,
    Quantizer,
    pack_bits,
    packed_size,
    unpack_bits,
)

SIZES = [1, 7, 8, 9, 1000, 4097]
ALL_BITS = list(range(1, 17))


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference_pack(codes: list[int], bits: int) -> list[int]:
    """The documented layout, one Python integer at a time: code j at stream bits j*bits.., LSB first."""
    stream = sum(code << (j * bits) for j, code in enumerate(codes))
    return list(stream.to_bytes(packed_size(len(codes), bits), "little"))


# Bit packing


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_round_trips_every_size(bits):
    generator = _generator(bits)
    for numel in SIZES:
        codes = torch.randint(0, 2**bits, (numel,), generator=generator)
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_size(numel, bits) == -(-numel * bits // 8)
        unpacked = unpack_bits(packed, bits, numel)
        assert torch.equal(unpacked.long(), codes), f"bits={bits} numel={numel}"
        all_max = torch.full((numel,), 2**bits - 1)
        assert torch.equal(unpack_bits(pack_bits(all_max, bits), bits, numel).long(), all_max)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_layout_is_the_documented_little_endian_stream(bits):
    codes = torch.randint(0, 2**bits, (37,), generator=_generator(100 + bits))
    assert pack_bits(codes, bits).tolist() == _reference_pack(codes.tolist(), bits)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 12, 16])
def test_pack_accepts_any_int_dtype_and_out_buffers_at_any_offset(bits):
    codes = torch.randint(0, 2**bits, (1003,), generator=_generator(bits))
    expected = pack_bits(codes, bits)
    dtypes = [torch.int16, torch.int32, torch.int64] + ([torch.uint8] if bits <= 8 else [])
    for dtype in dtypes:
        assert torch.equal(pack_bits(codes.to(dtype).view(17, 59), bits), expected)
    # Buffers that start at odd offsets take the generic (non-word) paths.
    for offset in (0, 1, 3):
        storage = torch.zeros(offset + expected.numel(), dtype=torch.uint8)
        pack_bits(codes, bits, out=storage[offset:])
        assert torch.equal(storage[offset:], expected)
        out = torch.zeros(offset + codes.numel(), dtype=torch.int64)
        unpack_bits(storage[offset:], bits, codes.numel(), out=out[offset:])
        assert torch.equal(out[offset:], codes)


def test_pack_one_bit_accepts_bool_masks():
    mask = torch.rand(1001, generator=_generator()) > 0.5
    assert torch.equal(unpack_bits(pack_bits(mask, 1), 1, mask.numel()).bool(), mask)


def test_pack_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"bits must be an int >= 1 and <= 16"):
        pack_bits(torch.zeros(4, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"bits must be an int >= 1 and <= 16"):
        packed_size(4, 17)
    with pytest.raises(ValueError, match="integer dtype"):
        pack_bits(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="exactly 2 elements"):
        pack_bits(torch.zeros(4, dtype=torch.int64), 3, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="need 2"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 3, 4)
    with pytest.raises(ValueError, match="cannot hold 12-bit codes"):
        unpack_bits(torch.zeros(6, dtype=torch.uint8), 12, 4, out=torch.empty(4, dtype=torch.uint8))


def test_pack_empty():
    assert pack_bits(torch.zeros(0, dtype=torch.int64), 5).numel() == 0
    assert unpack_bits(torch.zeros(0, dtype=torch.uint8), 5, 0).numel() == 0


# Quantizer


@pytest.mark.parametrize("bits", ALL_BITS)
def test_quantizer_payload_size_is_exact_and_zeros_and_constants_decode_exactly(bits):
    quantizer = Quantizer(bits)
    for numel in [1, 7, 511, 512, 513, 1000, 3 * DEFAULT_CHUNK_SIZE + 5]:
        chunks = -(-numel // DEFAULT_CHUNK_SIZE)
        assert quantizer.payload_bytes(numel) == 8 * chunks + -(-numel * bits // 8)
        for value in (0.0, 0.1, -3.3, 1e-30, 12345.678):
            x = torch.full((numel,), value)
            payload = quantizer.encode(x)
            assert payload.dtype == torch.uint8 and payload.numel() == quantizer.payload_bytes(numel)
            decoded = quantizer.decode(payload, numel)
            assert decoded.dtype == torch.float32 and torch.equal(decoded, x), f"bits={bits} value={value}"


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8, 12, 16])
@pytest.mark.parametrize("chunk_size", [1, 3, 100, 512])
def test_quantizer_chunk_sizes_and_partial_last_chunk(bits, chunk_size):
    quantizer = Quantizer(bits, chunk_size=chunk_size)
    x = torch.randn(1037, generator=_generator(bits))
    payload = quantizer.encode(x)
    assert payload.numel() == quantizer.payload_bytes(x.numel())
    decoded = quantizer.decode(payload, x.numel())
    # Every entry lies within its chunk's [min, max]; 2 levels cannot beat the sign split.
    error = (decoded - x).norm() / x.norm()
    assert error < (0.8 if bits == 1 else 2.0 ** (1 - bits)), f"relative error {error:.3g}"
    if chunk_size == 1:  # one element per chunk: every width is exact
        assert torch.equal(decoded, x)


def test_one_bit_reconstruction_values_are_the_means_of_each_side():
    chunk_size = 64
    quantizer = Quantizer(1, chunk_size=chunk_size)
    x = torch.randn(5 * chunk_size + 20, generator=_generator())
    x[chunk_size : 2 * chunk_size] = x[chunk_size : 2 * chunk_size].abs()  # a chunk with no negative entry
    x[2 * chunk_size : 3 * chunk_size] = -x[2 * chunk_size : 3 * chunk_size].abs() - 0.1  # and one with no other
    payload = quantizer.encode(x)
    decoded = quantizer.decode(payload, x.numel())
    offset, step = quantizer.chunk_params(payload, x.numel())
    for j, chunk in enumerate(x.split(chunk_size)):
        non_negative, negative = chunk[chunk >= 0], chunk[chunk < 0]
        mean_pos = non_negative.double().mean().item() if non_negative.numel() else 0.0
        mean_neg = negative.double().mean().item() if negative.numel() else 0.0
        assert offset[j].item() == pytest.approx(mean_neg, rel=1e-6, abs=1e-7)
        assert (offset[j] + step[j]).item() == pytest.approx(mean_pos, rel=1e-6, abs=1e-7)
        expected = torch.where(chunk >= 0, torch.tensor(mean_pos), torch.tensor(mean_neg)).float()
        torch.testing.assert_close(decoded[j * chunk_size : j * chunk_size + chunk.numel()], expected)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_error_feedback_telescopes(bits):
    """sum_k decode(payload_k) + final residual == sum_k x_k: nothing is lost, only delayed."""
    quantizer = Quantizer(bits)
    numel = 2 * DEFAULT_CHUNK_SIZE + 77
    generator = _generator(bits)
    residual = torch.zeros(numel)
    sent, received = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for _ in range(50):
        x = torch.randn(numel, generator=generator)
        v = x + residual
        payload = quantizer.encode_with_feedback(x, residual)
        decoded = quantizer.decode(payload, numel)
        assert torch.equal(residual, v - decoded)  # exactly v - decode(payload), not just close
        sent += x
        received += decoded
    torch.testing.assert_close(received + residual, sent, rtol=0, atol=1e-4)


def test_error_feedback_accepts_half_inputs_and_any_shape():
    quantizer = Quantizer(2)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(3, 700, generator=_generator()).to(dtype)
        residual = torch.zeros(3, 700)
        payload = quantizer.encode_with_feedback(x, residual)
        decoded = quantizer.decode(payload, x.numel()).view_as(x)
        torch.testing.assert_close(decoded + residual, x.float(), rtol=0, atol=1e-6)
        # With a zero residual, feedback encodes exactly what encode() does.
        assert torch.equal(quantizer.encode(x), payload)


def _relative_mse(bits: int, x: torch.Tensor) -> float:
    quantizer = Quantizer(bits)
    decoded = quantizer.decode(quantizer.encode(x), x.numel())
    return ((decoded - x).square().sum() / x.square().sum()).item()


def test_error_decreases_with_bits_and_16_bits_is_near_exact():
    x = torch.randn(64 * DEFAULT_CHUNK_SIZE, generator=_generator())
    mse = {bits: _relative_mse(bits, x) for bits in (1, 2, 4, 8, 16)}
    assert mse[16] < mse[8] < mse[4] < mse[2] < mse[1]
    assert mse[1] == pytest.approx(1 - 2 / torch.pi, rel=0.05)  # sign quantization of a Gaussian
    assert mse[16] ** 0.5 < 1e-4


def _min_max_error(bits: int, x: torch.Tensor) -> torch.Tensor:
    """Per-chunk squared error of the baseline: 2**bits uniform levels over [min, max], round to nearest."""
    chunks = x.view(-1, DEFAULT_CHUNK_SIZE).double()
    low, high = chunks.amin(1, keepdim=True), chunks.amax(1, keepdim=True)
    step = (high - low) / (2**bits - 1)
    codes = torch.where(step > 0, (chunks - low) / step.clamp(min=1e-300), 0).round()
    return (low + codes * step - chunks).square().sum(1)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_clipped_levels_are_never_worse_than_min_max_per_chunk(bits):
    generator = _generator(bits)
    gaussian = torch.randn(32 * DEFAULT_CHUNK_SIZE, generator=generator)
    heavy_tailed = gaussian / torch.rand(gaussian.shape, generator=generator).clamp(min=1e-3).sqrt()
    far_from_zero = 1000 + 1e-3 * gaussian  # E[v^2] - E[v]^2 would cancel to nothing here
    sparse = torch.where(torch.rand(gaussian.shape, generator=generator) < 0.01, gaussian, torch.zeros(()))
    quantizer = Quantizer(bits)
    for x in (gaussian, heavy_tailed, far_from_zero, sparse):
        decoded = quantizer.decode(quantizer.encode(x), x.numel())
        error = (decoded - x).double().view(-1, DEFAULT_CHUNK_SIZE).square().sum(1)
        baseline = _min_max_error(bits, x)
        assert torch.all(error <= baseline * (1 + 1e-4) + 1e-9)
    # On Gaussian data clipping the tails pays clearly at 2 bits.
    baseline_mse = _min_max_error(2, gaussian).sum().item() / gaussian.double().square().sum().item()
    assert _relative_mse(2, gaussian) < 0.5 * baseline_mse


def test_one_bit_payload_compresses_float32_25x_at_the_default_chunk():
    numel = 1_000_000
    quantizer = Quantizer(1)
    payload = quantizer.encode(torch.randn(numel, generator=_generator()))
    assert payload.numel() == quantizer.payload_bytes(numel)
    assert 4 * numel / payload.numel() >= 25


def test_decode_reads_payloads_at_unaligned_offsets_and_into_out():
    quantizer = Quantizer(3)
    x = torch.randn(2000, generator=_generator())
    payload = quantizer.encode(x)
    gathered = torch.cat([torch.zeros(1, dtype=torch.uint8), payload])  # as after an all-gather of odd sizes
    out = torch.empty(40, 50)
    result = quantizer.decode(gathered[1:], x.numel(), out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out.view(-1), quantizer.decode(payload, x.numel()))
    buffer = torch.empty(quantizer.payload_bytes(x.numel()), dtype=torch.uint8)
    assert torch.equal(quantizer.encode(x, out=buffer), payload)


def test_quantizer_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"bits must be an int >= 1 and <= 16"):
        Quantizer(0)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        Quantizer(2, chunk_size=0)
    # The wrong type is a TypeError (bunsan._validate's rule), bool included.
    with pytest.raises(TypeError, match="bits must be an int"):
        Quantizer(2.0)
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        Quantizer(2, chunk_size=True)
    with pytest.raises(TypeError, match="bits must be an int"):
        packed_size(4, "8")
    quantizer = Quantizer(2)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        quantizer.encode(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="payload has 3 bytes"):
        quantizer.decode(torch.zeros(3, dtype=torch.uint8), 100)
    with pytest.raises(ValueError, match="residual must be a contiguous float32"):
        quantizer.encode_with_feedback(torch.zeros(4), torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual must match x"):
        quantizer.encode_with_feedback(torch.zeros(4), torch.zeros(5))


def test_quantizer_empty_tensor():
    quantizer = Quantizer(4)
    assert quantizer.payload_bytes(0) == 0
    assert quantizer.decode(quantizer.encode(torch.zeros(0)), 0).numel() == 0


@pytest.mark.parametrize(("bits", "chunk_size"), [(1, 512), (3, 512), (3, 100), (16, 512)])
def test_chunks_are_independent_across_cpu_blocks(bits, chunk_size):
    """A tensor long enough for several CPU blocks decodes as its chunk-aligned pieces do, bit for bit."""
    quantizer = Quantizer(bits, chunk_size=chunk_size)
    x = torch.randn(3 * (1 << 17) + 7, generator=_generator(bits))
    cut = 1000 * chunk_size
    pieces = [x[:cut], x[cut : 2 * cut], x[2 * cut :]]
    expected = torch.cat([quantizer.decode(quantizer.encode(piece), piece.numel()) for piece in pieces])
    assert torch.equal(quantizer.decode(quantizer.encode(x), x.numel()), expected)
