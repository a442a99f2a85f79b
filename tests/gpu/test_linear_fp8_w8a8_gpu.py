"""FP8 weights on FP8 tensor cores (W8A8): quant_fp8_per_token (codegen/templates/quant_fp8_per_token.cu.j2) and the
E4M3 GEMM linear_fp8_w8a8 (wgmma on sm_90a: linear_wgmma_fp8.cu.j2; mma.sync on sm_89 / sm_120a: linear_mma_sync.cu.j2
read as bytes), every route instance this GPU builds against the reference: the quantizer bit for bit (tolerance
exact), the GEMM within linear_tc (its contract is on the codes, so only fp32 summation order separates them), both
with NaN guards past their outputs; the chain against linear_fp8 (bf16 activations), which it may differ from by the
activations' E4M3 rounding alone. GPU only."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ninfer.runtime import formats

ROOT = Path(__file__).resolve().parents[2]
TS = [1, 2, 127, 128, 129, 255, 256, 257, 300]
pytestmark = pytest.mark.gpu


def instances(op: str) -> list[str]:
    spec = yaml.safe_load((ROOT / "specs" / "routes" / f"{op}.yaml").read_text())
    return sorted(f"{r['name']}.{t}" for r in spec["routes"] for t in r["tiles"])


def kernel(be, op: str, tile: str):
    """This GPU's kernel of the route instance (skips where the route is not built for its arch)."""
    k = next((k for k in be.manifest.kernels.values()
              if k.op == op and k.instance == tile and k.arch == be.device.arch), None)
    if k is None:
        pytest.skip(f"{op} {tile} is not built for {be.device.arch}")
    return k


def admits(k, **dims) -> bool:
    from ninfer.runtime.manifest import evaluate
    return all(evaluate(c, dims) for c in k.constraints)


def packed(n: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(formats.encode("fp8", (rng.standard_normal((n, k)) * 0.05).astype(np.float32))).cuda()


def guarded(n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer of n elements followed by 256 poisoned ones (NaN, or 0x7F: an E4M3 NaN code) that must survive."""
    fill = float("nan") if dtype.is_floating_point else 0x7F
    buf = torch.full((n + 256,), fill, device="cuda", dtype=dtype)
    return buf[:n], buf[n:]


def quantize(be, x, route=None):
    T, K = x.shape
    q, q_tail = guarded(T * K, torch.uint8)
    s, s_tail = guarded(T, torch.float32)
    be.run("quant_fp8_per_token", route=route, x=x, q=q.view(T, K), s=s)
    return q.view(T, K), s, (q_tail == 0x7F).all() and s_tail.isnan().all()


@pytest.mark.parametrize("route", instances("quant_fp8_per_token"))
def test_quant_every_route_bit_exact(be, ref, route):
    kernel(be, "quant_fp8_per_token", route)
    g = torch.Generator(device="cuda").manual_seed(1)
    bad = []
    for K in (8, 200, 5120, 17408):
        for T in (1, 3, 129):
            x = torch.randn(T, K, device="cuda", generator=g) * torch.logspace(-30, 2, T, device="cuda")[:, None]
            x = x.bfloat16()
            if T == 3:
                x[1] = 0           # an all-zero row: scale 0, codes 0
                x[2, :4] = -0.0
            q, s, kept = quantize(be, x, route)
            q_ref, s_ref = torch.empty_like(q), torch.empty_like(s)
            ref.run("quant_fp8_per_token", x=x, q=q_ref, s=s_ref)
            torch.cuda.synchronize()
            where = f"{route} T={T} K={K}"
            if not kept:
                bad.append(f"{where}: wrote past q or s")
            if not torch.equal(s, s_ref):
                bad.append(f"{where}: scales differ at {int((s != s_ref).sum())} rows")
            if not torch.equal(q, q_ref):
                bad.append(f"{where}: codes differ at {int((q != q_ref).sum())} of {q.numel()}")
    assert not bad, "\n".join(bad)


def check_gemm(be, ref, tile, w, T, N, K, seed):
    from ninfer.runtime.tolerance import compare
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    xq, xs, _ = quantize(be, x)
    y, tail = guarded(T * N, torch.bfloat16)
    plan = be.plan("linear_fp8_w8a8", route=tile, xq=xq, xs=xs, w=w, y=y.view(T, N))
    assert plan.kernel.instance == tile
    plan()
    y_ref = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
    ref.run("linear_fp8_w8a8", xq=xq, xs=xs, w=w, y=y_ref)
    y_bf16 = torch.empty_like(y_ref)   # bf16 activations over the same weights
    be.run("linear_fp8", x=x, w=w, y=y_bf16)
    torch.cuda.synchronize()
    where = f"{tile} T={T} N={N} K={K}"
    bad = []
    if not tail.isnan().all():
        bad.append(f"{where}: wrote past the end of y")
    v = compare(y.view(T, N), y_ref, be.manifest.tolerances[be.contract("linear_fp8_w8a8")["tolerance"]], where)
    if not v:
        bad.append(v.detail)
    rel = ((y.view(T, N).float() - y_bf16.float()).norm() / y_bf16.float().norm()).item()
    if not rel < 0.06:   # E4M3 activations: ~2.5 % relative L2 on random data (tests/unit/test_fp8_w8a8.py)
        bad.append(f"{where}: {rel:.3f} relative L2 from linear_fp8 (bf16 activations)")
    return bad


@pytest.mark.parametrize("tile", instances("linear_fp8_w8a8"))
def test_w8a8_every_tile(be, ref, tile):
    k = kernel(be, "linear_fp8_w8a8", tile)
    bad = []
    # K: whole and partial 128-byte k-tiles; N: whole 128-row weight tiles, a short last one, an odd count
    for N, K in [(128, 128), (384, 1024), (640, 1552), (256, 208), (200, 208), (77, 208)]:
        if not admits(k, N=N, K=K, T=1):
            continue
        w = packed(N, K, seed=N + K)
        for T in TS:
            bad += check_gemm(be, ref, tile, w, T, N, K, seed=T * 7 + N)
    assert not bad, "\n".join(bad)


def test_w8a8_real_27b_shapes(be, ref):
    """The 27B MLP (gate_up 34816 x 5120, down 5120 x 17408) at a prefill chunk, every tile."""
    bad = []
    tiles = sorted(k.instance for k in be.manifest.kernels.values()
                   if k.op == "linear_fp8_w8a8" and k.arch == be.device.arch)
    for N, K in [(34816, 5120), (5120, 17408)]:
        w = packed(N, K, seed=N)
        for tile in tiles:
            bad += check_gemm(be, ref, tile, w, 1000, N, K, seed=3)
    assert not bad, "\n".join(bad)


def test_w8a8_over_row_split_views(be):
    """A GDN layer's [qkv | z] projection reads two views of one fused matrix (split_rows): each view's result equals
    its columns of the fused one bit for bit, on every tile."""
    from ninfer.runtime.weights import PackedWeight, split_rows
    n1, n2, K = 384, 256, 1024
    fused = PackedWeight(packed(n1 + n2, K, seed=11), "fp8", (n1 + n2, K))
    x = torch.randn(300, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).bfloat16()
    xq, xs, _ = quantize(be, x)
    for tile in sorted(k.instance for k in be.manifest.kernels.values()
                       if k.op == "linear_fp8_w8a8" and k.arch == be.device.arch):
        ys = []
        for w in (fused, *split_rows(fused, n1)):
            y = torch.empty(300, w.matrix[0], device="cuda", dtype=torch.bfloat16)
            be.run("linear_fp8_w8a8", route=tile, xq=xq, xs=xs, w=w.data, y=y)
            ys.append(y)
        assert torch.equal(ys[1], ys[0][:, :n1]) and torch.equal(ys[2], ys[0][:, n1:]), tile


def test_admits_follows_the_constraints(be):
    """The model takes the W8A8 path only where the table's route admits the problem."""
    assert be.admits("linear_fp8_w8a8", T=4096, N=17408, K=5120)
    assert not be.admits("linear_fp8_w8a8", T=4096, N=256, K=200)    # xq's rows: whole 16-byte chunks (K % 16)
    if be.device.arch == "sm_90a":   # wgmma: whole 128-row weight tiles
        assert not be.admits("linear_fp8_w8a8", T=4096, N=300, K=512)
