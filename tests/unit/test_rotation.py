"""RotatedQuantizer: a rotation that is exactly undone, error feedback that loses nothing,
and less error than the plain codec on heavy-tailed chunks."""

from __future__ import annotations

import pytest
import torch

from bunsan.compression import Quantizer
from bunsan.compression.rotation import RotatedQuantizer, hadamard


def _heavy_tailed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4


def test_hadamard_is_orthonormal_and_its_own_inverse():
    x = torch.randn(3000, 64, dtype=torch.float64)  # 3000 rows: several cache blocks of 1024 rows
    y = hadamard(x)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1))  # orthonormal: lengths kept
    torch.testing.assert_close(hadamard(y), x)
    # against the dense Sylvester matrix
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 64:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    torch.testing.assert_close(y, x @ h.T / 8)
    signs = torch.randint(0, 2, (64,), dtype=torch.float64) * 2 - 1
    torch.testing.assert_close(hadamard(x, pre=signs), (x * signs) @ h.T / 8)
    torch.testing.assert_close(hadamard(hadamard(x, pre=signs), post=signs), x)


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="2-D"):
        hadamard(torch.zeros(16))
    with pytest.raises(ValueError, match="power-of-two chunk_size"):
        RotatedQuantizer(1, chunk_size=500)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        RotatedQuantizer(1, chunk_size=0)
    with pytest.raises(ValueError, match="bits must be an int"):
        RotatedQuantizer(0)
    codec = RotatedQuantizer(1)
    with pytest.raises(ValueError, match="x must be float32"):
        codec.encode(torch.arange(10))
    with pytest.raises(ValueError, match="residual must match x"):
        codec.encode_with_feedback(torch.zeros(10), torch.zeros(9))
    with pytest.raises(ValueError, match="out must have exactly 10 elements"):
        codec.decode(codec.encode(torch.zeros(10)), 10, out=torch.zeros(11))
    with pytest.raises(ValueError, match="payload has"):
        codec.decode(codec.encode(torch.zeros(10)), 700)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 5, 32, 160, 512, 513, 1600, 3072])
def test_error_feedback_loses_nothing_and_payload_size_is_known(bits, numel):
    codec = RotatedQuantizer(bits)
    residual = torch.zeros(numel)
    applied, true = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for step in range(6):
        x = _heavy_tailed(numel, step)
        payload = codec.encode_with_feedback(x, residual)
        assert payload.numel() == codec.payload_bytes(numel)
        applied += codec.decode(payload, numel).double()
        true += x.double()
    torch.testing.assert_close(applied + residual.double(), true, atol=1e-5, rtol=1e-5)


def test_payload_is_the_plain_codecs_on_whole_chunks_and_pads_only_the_tail():
    plain, rotated = Quantizer(1), RotatedQuantizer(1)
    assert rotated.payload_bytes(3 * 512) == plain.payload_bytes(3 * 512)
    assert rotated.payload_bytes(3 * 512 + 100) == plain.payload_bytes(3 * 512 + 128)
    assert rotated.padded_numel(0) == 0


def test_rotation_cuts_the_one_bit_error_on_heavy_tailed_chunks():
    x = _heavy_tailed(64 * 512, 0)
    plain, rotated = Quantizer(1), RotatedQuantizer(1)
    err_plain = ((plain.decode(plain.encode(x), x.numel()) - x).norm() ** 2 / x.norm() ** 2).item()
    err_rotated = ((rotated.decode(rotated.encode(x), x.numel()) - x).norm() ** 2 / x.norm() ** 2).item()
    assert err_plain > 0.7  # the two means of a heavy-tailed chunk fit few of its entries
    assert 0.3 < err_rotated < 0.4  # ~ 1 - 2/pi, the Gaussian optimum of one bit


def test_the_signs_are_part_of_the_format():
    x = torch.randn(700)
    payload = RotatedQuantizer(1).encode(x)
    # another instance (another process) decodes the same values; another seed does not
    assert torch.equal(RotatedQuantizer(1).decode(payload, 700), RotatedQuantizer(1).decode(payload, 700))
    assert not torch.equal(RotatedQuantizer(1, seed=1).decode(payload, 700), RotatedQuantizer(1).decode(payload, 700))
    out = torch.empty(700)
    assert torch.equal(RotatedQuantizer(1).decode(payload, 700, out=out), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", [1, 2])
def test_rotated_codec_on_cuda_matches_the_cpu_and_loses_nothing(bits):
    codec = RotatedQuantizer(bits)
    x = _heavy_tailed(5000, 7)
    residual = torch.zeros(5000, device="cuda")
    payload = codec.encode_with_feedback(x.cuda(), residual)
    decoded = codec.decode(payload, 5000)
    torch.testing.assert_close(decoded + residual, x.cuda(), atol=1e-6, rtol=1e-5)  # nothing lost
    cpu = codec.decode(payload.cpu(), 5000)
    torch.testing.assert_close(decoded.cpu(), cpu, atol=1e-6, rtol=1e-5)  # the same format on both devices
