"""The Hopper prefill GEMMs with the codes decoded inside them: the `wgmma_rs` routes of linear_q4 / q5 / q6 and
linear_swiglu_q4 (codegen/templates/linear_wgmma_rs.cu.j2: the weights as wgmma's register operand).

Every tile against the reference (the op's tolerance, linear_tc) at T around its tile boundaries, on whole
128-row tiles and K % 512 == 0 (the routes' constraints), and against what it replaces, dequant_q4 into a bf16
matrix, then linear / linear_swiglu: the weights are the same bf16 values, only the fp32 sums run in another
order, so the two stay within one bf16 rounding (a wrong code or scale is off by far more). GPU only."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ninfer.runtime import formats

ROOT = Path(__file__).resolve().parents[2]
TS = [1, 16, 17, 32, 33, 64, 65, 127, 128, 129, 255, 256, 257, 300]   # the 16-, 32-, 64- and 256-token tiles' edges


def wgmma_tiles(op: str) -> list[str]:
    """The `route.tile` instances of the op's wgmma_rs routes (wgmma_rs, wgmma_rs_persist)."""
    spec = yaml.safe_load((ROOT / "specs" / "routes" / f"{op}.yaml").read_text())
    return sorted(f"{r['name']}.{t}" for r in spec["routes"] if r["name"].startswith("wgmma_rs") for t in r["tiles"])


def admitted(be, op: str, tile: str, names: str, shapes: list[tuple]) -> list[tuple]:
    """The shapes (dims `names`, e.g. "NK") whose every constraint of the tile holds; at least two of them."""
    from ninfer.runtime.manifest import evaluate
    kernel = be.manifest.kernel(be.device.arch, op, tile, "bf16")
    ok = [s for s in shapes if all(evaluate(c, {**dict(zip(names, s)), "T": 1}) for c in kernel.constraints)]
    assert len(ok) >= 2, f"{op} {tile}: its constraints admit {ok} of {shapes}"
    return ok


def packed(n: int, k: int, seed: int, fmt: str = "q4") -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(formats.encode(fmt, (rng.standard_normal((n, k)) * 0.05).astype(np.float32))).cuda()


def check(be, op: str, tile: str, w: torch.Tensor, T: int, dims: dict, seed: int) -> list[str]:
    """The route against the reference (tolerance) and against dequant_<fmt> + the dense op."""
    from ninfer.runtime.dispatch import ReferenceBackend
    from ninfer.runtime.tolerance import compare
    swiglu = op == "linear_swiglu_q4"
    rows, K = (2 * dims["I"], dims["K"]) if swiglu else (dims["N"], dims["K"])
    cols = dims["I"] if swiglu else dims["N"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, K, device="cuda", generator=gen).bfloat16()
    guarded = torch.full((T * cols + 256,), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = guarded[:T * cols].view(T, cols)           # NaNs after y catch stores past [T, cols]
    plan = be.plan(op, route=tile, x=x, w=w, y=y)
    assert plan.kernel.instance == tile
    plan()
    yref = torch.empty_like(y)
    ReferenceBackend(be.manifest).run(op, x=x.clone(), w=w.clone(), y=yref)
    dense = torch.empty(rows, K, device="cuda", dtype=torch.bfloat16)
    be.run(f"dequant_{op.rsplit('_', 1)[1]}", w=w, y=dense)
    ydense = torch.empty_like(y)
    be.run("linear_swiglu" if swiglu else "linear", route="wgmma.m128n256k64s4c2", x=x, w=dense, y=ydense)
    torch.cuda.synchronize()
    where = f"{op} {tile} T={T} {dims}"
    bad = []
    if not guarded[T * cols:].isnan().all():
        bad.append(f"{where}: wrote past the end of y")
    v = compare(y, yref, be.manifest.tolerances[be.contract(op)["tolerance"]], where)
    if not v:
        bad.append(v.detail)
    # one bf16 rounding apart (2^-8 relative), and cancellation near 0: from dequant_<fmt>'s bf16 weights + the dense
    # GEMM, or for late-scale tiles (weights s * code in fp32, never rounded) from the fp32 product with those weights
    other, what = ydense, "dequant + dense GEMM"
    if plan.kernel.tile_params.get("ls", 0):   # a late-scale tile
        from ninfer.runtime.reference_quant import unpack
        yf = x.float() @ unpack(op.rsplit("_", 1)[1], w, rows, K).T
        other, what = (yf[:, :cols] * torch.sigmoid(yf[:, :cols]) * yf[:, cols:] if swiglu else yf), "the fp32 product"
    diff = (y.float() - other.float()).abs()
    if not bool((diff <= 2.0 ** -7 * other.float().abs() + 1e-3 * other.float().abs().max()).all()):
        bad.append(f"{where}: differs from {what} at {int((diff > 0).sum())} of {y.numel()} "
                   f"(max {diff.max().item():.3e})")
    return bad


@pytest.mark.gpu
@pytest.mark.parametrize("op,tile", [(f"linear_{f}", t) for f in ("q4", "q5", "q6") for t in wgmma_tiles(f"linear_{f}")])
def test_linear_every_wgmma_tile(be, op, tile):
    """Every shape the tile's constraints admit: K of 1..7 units of 512 (split-K tiles: uneven shares of them)."""
    shapes = admitted(be, op, tile, "NK", [(128, 512), (384, 1024), (640, 1536), (256, 2048), (384, 3584)])
    bad = []
    for N, K in shapes:
        w = packed(N, K, seed=N + K, fmt=op.rsplit("_", 1)[1])
        for T in TS:
            bad += check(be, op, tile, w, T, {"N": N, "K": K}, seed=T * 7 + N)
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", wgmma_tiles("linear_swiglu_q4"))
def test_linear_swiglu_q4_every_wgmma_tile(be, tile):
    """Every shape the tile's constraints admit (split-K tiles: K of 2 units and more)."""
    shapes = admitted(be, "linear_swiglu_q4", tile, "IK", [(128, 512), (384, 1024), (256, 1536)])
    bad = []
    for I, K in shapes:
        w = packed(2 * I, K, seed=I + K)
        for T in TS:
            bad += check(be, "linear_swiglu_q4", tile, w, T, {"I": I, "K": K}, seed=T * 5 + I)
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
def test_real_27b_shapes(be):
    """The 27B MLP (gate_up 2 x 17408 x 5120, down 5120 x 17408) and GDN out (5120 x 6144) at a prefill chunk, in
    every format with a wgmma_rs route."""
    bad = []
    w = packed(2 * 17408, 5120, seed=1)
    for tile in wgmma_tiles("linear_swiglu_q4"):
        bad += check(be, "linear_swiglu_q4", tile, w, 1000, {"I": 17408, "K": 5120}, seed=2)
    for fmt in ("q4", "q5", "q6"):
        for N, K in [(5120, 17408), (5120, 6144)]:
            w = packed(N, K, seed=N + K, fmt=fmt)
            for tile in wgmma_tiles(f"linear_{fmt}"):
                bad += check(be, f"linear_{fmt}", tile, w, 1000, {"N": N, "K": K}, seed=3)
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
def test_takes_packed_follows_the_table_and_constraints(be):
    """The model skips the dequant pass only where the table resolves a wgmma_rs route whose constraints hold."""
    assert not be.takes_packed("linear_q4", N=300, K=512, T=4096)      # not whole 128-row tiles
    assert not be.takes_packed("linear_q4", N=5120, K=5120, T=1)       # decode: a GEMV route
    assert be.takes_packed("linear_swiglu_q4", I=17408, K=5120, T=4096)   # its one table: wgmma_rs at every T
    assert not be.takes_packed("linear_swiglu_q4", I=200, K=512, T=4096)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4", "q5", "q6"])
def test_row_split_views(be, fmt):
    """A GDN layer's fused [qkv | z] matrix is projected for prefill through split_rows' two views of its storage
    (no copy of the [T, N] output). Both prefill paths over a view equal their rows of the fused matrix's result
    bit for bit: dequant_<fmt> into a scratch, and every wgmma_rs tile."""
    from ninfer.runtime.weights import PackedWeight, split_rows
    n1, n2, K = 384, 256, 2048   # K >= 512 x ks: every wgmma_rs_splitk tile admits it
    fused = PackedWeight(packed(n1 + n2, K, seed=11, fmt=fmt), fmt, (n1 + n2, K))
    top, bottom = split_rows(fused, n1)
    parts = lambda whole: (whole[:n1], whole[n1:])  # noqa: E731
    dense = [torch.empty(w.matrix, device="cuda", dtype=torch.bfloat16) for w in (fused, top, bottom)]
    for w, y in zip((fused, top, bottom), dense):
        be.run(f"dequant_{fmt}", w=w.data, y=y)
    assert all(torch.equal(a, b) for a, b in zip(dense[1:], parts(dense[0])))
    x = torch.randn(300, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).bfloat16()
    for tile in wgmma_tiles(f"linear_{fmt}"):
        ys = []
        for w in (fused, top, bottom):
            y = torch.empty(300, w.matrix[0], device="cuda", dtype=torch.bfloat16)
            be.run(f"linear_{fmt}", route=tile, x=x, w=w.data, y=y)
            ys.append(y)
        assert torch.equal(ys[1], ys[0][:, :n1]) and torch.equal(ys[2], ys[0][:, n1:]), tile
