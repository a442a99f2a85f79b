"""Packed weights on the reference backend: the torch decoder equals the codecs byte for byte, random
packed weights (benchmarks) are valid layouts, and a model whose linears stay packed computes what the
same model with the weights decoded up front computes."""
import numpy as np
import pytest
import torch

from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.formats import decode, encode, nbytes
from ninfer.runtime.reference_quant import PACKED, unpack
from ninfer.runtime.weights import PackedWeight, random_packed

SHAPES = [(1, 8), (77, 200), (128, 128), (130, 328), (300, 72)]


def recording(calls: list):
    """A reference backend class whose instances append the name of every op they run to calls."""
    class Spy(ReferenceBackend):
        def run(self, op, **args):
            calls.append(op)
            super().run(op, **args)
    return Spy


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("n,k", SHAPES)
def test_unpack_equals_the_codec(fmt, n, k):
    x = np.random.default_rng(n * 1000 + k).standard_normal((n, k)).astype(np.float32)
    b = encode(fmt, x)
    assert np.array_equal(unpack(fmt, torch.from_numpy(b), n, k).numpy(), decode(fmt, b, (n, k)))


@pytest.mark.parametrize("fmt", PACKED)
def test_linear_op_is_decode_then_matmul(fmt):
    be = ReferenceBackend()
    w = np.random.default_rng(1).standard_normal((130, 200)).astype(np.float32) * 0.05
    x = torch.randn(5, 200, dtype=torch.float64)
    y = torch.empty(5, 130, dtype=torch.float32)
    be.run(f"linear_{fmt}", x=x.float(), w=torch.from_numpy(encode(fmt, w)), y=y)
    want = x @ torch.from_numpy(decode(fmt, encode(fmt, w), w.shape)).double().T
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)


def test_packed_op_refuses_a_wrong_byte_count():
    be = ReferenceBackend()
    w = torch.from_numpy(encode("q4", np.ones((130, 200), np.float32)))
    with pytest.raises(ValueError, match="requires WB =="):
        be.run("linear_q4", x=torch.randn(2, 200), w=w[:-256], y=torch.empty(2, 130))


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("n,k", [(256, 256), (130, 200)])
def test_random_packed_is_a_valid_layout(fmt, n, k):
    g = torch.Generator().manual_seed(0)
    pw = random_packed(fmt, (n, k), "cpu", g, std=0.02)
    assert pw.nbytes == nbytes(fmt, (n, k))
    kp = -(-k // 128) * 128      # the same bytes read as [n, kp] expose the pad lanes
    full = torch.from_numpy(decode(fmt, pw.data.numpy(), (n, kp)))
    assert torch.isfinite(full).all() and (full[:, k:] == 0).all()   # pad lanes decode to 0
    std = full[:, :k].std().item()
    assert 0.01 < std < 0.04, std


def test_packed_weight_checks_its_bytes():
    with pytest.raises(ValueError, match="expected"):
        PackedWeight(torch.zeros(10, dtype=torch.uint8), "q4", (128, 128))
    with pytest.raises(ValueError, match="no kernels read"):
        PackedWeight(torch.zeros(10, dtype=torch.uint8), "nvfp4", (128, 128))


@pytest.mark.parametrize("fmt", PACKED)
def test_dequant_op_is_the_exact_decode(fmt):
    w = np.random.default_rng(2).standard_normal((130, 200)).astype(np.float32)
    y = torch.empty(130, 200)
    ReferenceBackend().run(f"dequant_{fmt}", w=torch.from_numpy(encode(fmt, w)), y=y)
    assert torch.equal(y, torch.from_numpy(decode(fmt, encode(fmt, w), w.shape)))


def test_prefill_over_packed_weights_takes_the_dequant_path():
    """From DEQUANT_MIN_T tokens a packed linear decodes the matrix and runs the dense op: same result."""
    from ninfer.runtime.models import blocks
    calls = []
    Spy = recording(calls)
    g = torch.Generator().manual_seed(0)
    pw = random_packed("q4", (136, 200), "cpu", g, 0.05)
    x = torch.randn(blocks.DEQUANT_MIN_T, 200)
    y = blocks.linear(Spy(), x, pw)
    assert calls == ["dequant_q4", "linear"]
    small = blocks.linear(Spy(), x[:7], pw)
    assert calls[2:] == ["linear_q4"]
    assert torch.allclose(y[:7], small, rtol=1e-5, atol=1e-5)


def test_prefill_mlp_fuses_the_swiglu_up_projection(monkeypatch):
    """From SWIGLU_MIN_T tokens the MLP decodes [gate | up] once and runs linear_swiglu (the activation in the GEMM's
    epilogue) instead of linear + silu_and_mul; the values agree (fp32 here, so no rounding tells them apart)."""
    from ninfer.runtime.models import blocks
    calls = []
    Spy = recording(calls)
    g = torch.Generator().manual_seed(1)
    mlp = blocks.DenseMLP({"mlp.gate_up": random_packed("q4", (272, 192), "cpu", g, 0.05),
                           "mlp.down": random_packed("q4", (192, 136), "cpu", g, 0.05)}, "mlp.")
    t0 = blocks.SWIGLU_MIN_T
    x = torch.randn(t0, 192, generator=g)
    y = mlp(Spy(), x)
    assert calls == ["dequant_q4", "linear_swiglu", "dequant_q4", "linear"]
    monkeypatch.setattr(blocks, "SWIGLU_MIN_T", None)   # NINFER_SWIGLU_MIN_T=off
    calls.clear()
    unfused = mlp(Spy(), x)
    assert calls == ["dequant_q4", "linear", "silu_and_mul", "dequant_q4", "linear"]
    assert torch.allclose(y, unfused, rtol=1e-5, atol=1e-5)
    calls.clear()
    monkeypatch.undo()
    mlp(Spy(), x[:t0 - 1])                               # below it: the packed GEMV, then the activation
    assert calls == ["linear_q4", "silu_and_mul", "linear_q4"]


@pytest.mark.parametrize("route,fused", [("gemv_batch_s8", True), ("wgmma_rs_decode", True), ("wgmma_rs", False)])
def test_decode_mlp_fuses_the_swiglu_only_on_decode_sized_routes(route, fused):
    """Below SWIGLU_MIN_T the MLP runs linear_swiglu_q4 where its table sends T to a GEMV or wgmma_rs_decode route;
    on wgmma_rs (256-token prefill tiles) the projection's own decode route, then silu_and_mul."""
    from ninfer.runtime.models import blocks
    calls = []

    class Tabled(recording(calls)):
        def resolved_route(self, op, **dims):
            return route if op == "linear_swiglu_q4" else None
    g = torch.Generator().manual_seed(4)
    mlp = blocks.DenseMLP({"mlp.gate_up": random_packed("q4", (256, 512), "cpu", g, 0.05),
                           "mlp.down": random_packed("q4", (512, 128), "cpu", g, 0.05)}, "mlp.")
    x = torch.randn(32, 512, generator=g)
    assert 32 < blocks.SWIGLU_MIN_T
    y = mlp(Tabled(), x)
    assert calls == (["linear_swiglu_q4", "linear_q4"] if fused else ["linear_q4", "silu_and_mul", "linear_q4"])
    calls.clear()
    assert torch.allclose(y, mlp(recording(calls)(), x), rtol=1e-5, atol=1e-5)


def test_prefill_reads_packed_weights_where_the_route_decodes_them(monkeypatch):
    """Where the backend's route for a packed op decodes inside its GEMM (takes_packed: linear_q4 and
    linear_swiglu_q4 on wgmma_rs), the model runs those ops on the packed matrices instead of dequant_q4 + the
    dense op; the values agree."""
    from ninfer.runtime.models import blocks
    monkeypatch.setattr(blocks, "PACKED_PREFILL", True)
    calls = []

    class Fused(recording(calls)):
        def takes_packed(self, op, **dims):
            return op in ("linear_q4", "linear_swiglu_q4")
    g = torch.Generator().manual_seed(2)
    mlp = blocks.DenseMLP({"mlp.gate_up": random_packed("q4", (256, 512), "cpu", g, 0.05),
                           "mlp.down": random_packed("q4", (512, 128), "cpu", g, 0.05)}, "mlp.")
    x = torch.randn(blocks.SWIGLU_MIN_T, 512, generator=g)
    y = mlp(Fused(), x)
    assert calls == ["linear_swiglu_q4", "linear_q4"]
    calls.clear()
    assert torch.allclose(y, mlp(recording(calls)(), x), rtol=1e-5, atol=1e-5)
    assert calls == ["dequant_q4", "linear_swiglu", "dequant_q4", "linear"]


@pytest.mark.parametrize("fmt", PACKED)
def test_cat_rows_appends_whole_tiles(fmt):
    """[a; b] of two packed matrices (a on whole 128-row tiles) decodes to the rows of a, then of b; where
    appending bytes would not give that layout (a short tile in a, an object header, unequal widths or
    formats) cat_rows declines instead."""
    from ninfer.runtime.formats import get_format
    from ninfer.runtime.weights import cat_rows
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((256, 200), (77, 200)))
    pa, pb = (PackedWeight(torch.from_numpy(encode(fmt, m)), fmt, m.shape) for m in (a, b))
    joined = cat_rows(pa, pb)
    if get_format(fmt).header_bytes:
        assert joined is None
        return
    assert joined.shape == (333, 200)
    want = np.concatenate([decode(fmt, encode(fmt, a), a.shape), decode(fmt, encode(fmt, b), b.shape)])
    assert np.array_equal(unpack(fmt, joined.data, 333, 200).numpy(), want)
    assert cat_rows(pb, pa) is None                                        # 77 rows: a short tile inside
    c = rng.standard_normal((128, 136)).astype(np.float32)
    assert cat_rows(pa, PackedWeight(torch.from_numpy(encode(fmt, c)), fmt, c.shape)) is None   # widths differ
    other = "w8" if fmt != "w8" else "q4"
    assert cat_rows(pa, PackedWeight(torch.from_numpy(encode(other, b)), other, b.shape)) is None


@pytest.mark.parametrize("fmt", PACKED)
def test_split_rows_undoes_cat_rows(fmt):
    """split_rows(cat_rows(a, b), rows of a) gives views of the joined storage equal to a's and b's bytes; a cut
    inside a 128-row tile (or at either end) is declined."""
    from ninfer.runtime.formats import get_format
    from ninfer.runtime.weights import cat_rows, split_rows
    if get_format(fmt).header_bytes:
        pytest.skip(f"{fmt} matrices carry a header: cat_rows declines them")
    rng = np.random.default_rng(4)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((256, 200), (77, 200)))
    pa, pb = (PackedWeight(torch.from_numpy(encode(fmt, m)), fmt, m.shape) for m in (a, b))
    joined = cat_rows(pa, pb)
    top, bottom = split_rows(joined, 256)
    assert (top.shape, bottom.shape) == ((256, 200), (77, 200))
    assert torch.equal(top.data, pa.data) and torch.equal(bottom.data, pb.data)
    assert top.data.data_ptr() == joined.data.data_ptr()                   # views, no copy
    assert split_rows(joined, 130) is None and split_rows(joined, 0) is None and split_rows(joined, 333) is None


def test_split_rows_of_float_tensors():
    from ninfer.runtime.weights import split_rows
    w = torch.randn(12, 6)
    top, bottom = split_rows(w, 4)
    assert torch.equal(top, w[:4]) and torch.equal(bottom, w[4:]) and bottom.data_ptr() == w[4:].data_ptr()
    assert split_rows(w, 3) is None       # 3 rows of 6 fp32 (72 bytes): the second view would not be 16-byte aligned
    assert split_rows(w, 12) is None


def test_cat_rows_of_float_tensors():
    from ninfer.runtime.weights import cat_rows
    a, b = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(cat_rows(a, b), torch.cat([a, b]))
    assert cat_rows(a, b.double()) is None and cat_rows(a, torch.randn(5, 9)) is None
