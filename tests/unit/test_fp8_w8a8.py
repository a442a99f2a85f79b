"""FP8 weights on FP8 tensor cores (W8A8) on the reference backend: quant_fp8_per_token is the fp8 format's per-row
rule applied to each token (the numpy codec, byte for byte), linear_fp8_w8a8 is the product of the two code
matrices and their scales, and the model's prefill takes them where FP8_W8A8_MIN_T asks."""
import numpy as np
import pytest
import torch

from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.format_fp8 import E4M3_VALUES, e4m3_encode
from ninfer.runtime.formats import decode, encode
from ninfer.runtime.weights import random_packed
from tests.unit.test_packed_weights import recording


def numpy_quant(x: np.ndarray):
    """The per-row rule of specs/formats.md §3.2 with the numpy codec (runtime/format_fp8.py)."""
    amax = np.abs(x).max(-1)
    s = np.where(amax > 0, np.maximum((amax / np.float32(448)).astype(np.float32), np.float32(2.0 ** -100)), 0)
    s = s.astype(np.float32)
    inv = np.zeros_like(s)
    np.divide(np.float32(1), s, out=inv, where=s > 0)
    codes = e4m3_encode(np.clip(x * inv[:, None], -448, 448))
    return codes | (np.signbit(x * inv[:, None]) & (codes == 0)).astype(np.uint8) << 7, s   # -0 keeps its sign


def test_quant_is_the_format_rule_per_token():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 264, generator=g) * torch.tensor([1, 1e-3, 300, 1e-30, 0, 1])[:, None]
    x[5, :40] = -0.0
    x[0, 3] = 1e-6   # a code that underflows to zero, with the sign kept
    x[0, 4] = -1e-6
    x = x.bfloat16()
    q, s = torch.empty(6, 264, dtype=torch.uint8), torch.empty(6)
    ReferenceBackend().run("quant_fp8_per_token", x=x, q=q, s=s)
    want_q, want_s = numpy_quant(x.float().numpy())
    assert np.array_equal(s.numpy(), want_s) and s[4] == 0 and s[3] > 0
    assert np.array_equal(q.numpy(), want_q)
    assert q[0, 3] == 0x00 and q[0, 4] == 0x80 and ((q[4] & 0x7F) == 0).all()   # an all-zero row: s = 0, codes ±0
    xf, sf = x.float().numpy(), s.numpy()[:, None]
    back = E4M3_VALUES[q.numpy()] * sf   # within half an E4M3 step of x
    assert np.all(np.abs(back - xf) <= np.abs(xf) * 2.0 ** -4 + sf * 2.0 ** -10)


def test_w8a8_is_the_product_of_the_codes_and_scales():
    g = torch.Generator().manual_seed(1)
    w = np.random.default_rng(1).standard_normal((256, 200)).astype(np.float32) * 0.05
    packed = torch.from_numpy(encode("fp8", w))
    x = torch.randn(9, 200, generator=g).bfloat16()
    be = ReferenceBackend()
    q, s = torch.empty(9, 200, dtype=torch.uint8), torch.empty(9)
    be.run("quant_fp8_per_token", x=x, q=q, s=s)
    y = torch.empty(9, 256)
    be.run("linear_fp8_w8a8", xq=q, xs=s, w=packed, y=y)
    xd = torch.from_numpy(E4M3_VALUES[q.numpy()]).double() * s.double()[:, None]
    want = xd @ torch.from_numpy(decode("fp8", encode("fp8", w), w.shape)).double().T
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6)
    exact = x.double() @ torch.from_numpy(w).double().T   # what the activations' and weights' codes lose together
    assert (y.double() - exact).norm() / exact.norm() < 0.06


def test_w8a8_refuses_a_wrong_byte_count():
    w = torch.from_numpy(encode("fp8", np.ones((128, 64), np.float32)))
    with pytest.raises(ValueError, match="requires WB =="):
        ReferenceBackend().run("linear_fp8_w8a8", xq=torch.zeros(2, 64, dtype=torch.uint8), xs=torch.ones(2),
                               w=w[:-256], y=torch.empty(2, 128))


def test_prefill_takes_the_fp8_tensor_cores_where_asked(monkeypatch):
    """Off (FP8_W8A8_MIN_T None): fp8 prefill decodes the matrix for the bf16 GEMM. With FP8_W8A8_MIN_T (256 by
    default) the MLP's linears run quant_fp8_per_token + linear_fp8_w8a8 (the [gate | up] projection unfused, its
    activation after it) from that many tokens, and stay on the packed GEMV below it; the result is the bf16 path's
    within the activations' E4M3 rounding."""
    from ninfer.runtime.models import blocks
    calls = []
    Spy = recording(calls)
    g = torch.Generator().manual_seed(2)
    mlp = blocks.DenseMLP({"mlp.gate_up": random_packed("fp8", (256, 192), "cpu", g, 0.05),
                           "mlp.down": random_packed("fp8", (192, 128), "cpu", g, 0.05)}, "mlp.")
    T = blocks.DEQUANT_MIN_T
    x = torch.randn(T, 192, generator=g)
    assert blocks.FP8_W8A8_MIN_T == 256
    monkeypatch.setattr(blocks, "FP8_W8A8_MIN_T", None)
    dense = mlp(Spy(), x)
    assert calls == ["dequant_fp8", "linear_swiglu", "dequant_fp8", "linear"]
    monkeypatch.setattr(blocks, "FP8_W8A8_MIN_T", 16)
    calls.clear()
    y = mlp(Spy(), x)
    assert calls == ["quant_fp8_per_token", "linear_fp8_w8a8", "silu_and_mul", "quant_fp8_per_token", "linear_fp8_w8a8"]
    assert (y - dense).norm() / dense.norm() < 0.08
    calls.clear()
    mlp(Spy(), x[:15])
    assert calls == ["linear_fp8", "silu_and_mul", "linear_fp8"]
    calls.clear()
    blocks.linear(Spy(), x, random_packed("q4", (128, 192), "cpu", g, 0.05))   # other formats: unchanged
    assert calls == ["dequant_q4", "linear"]
