"""The residual add-norm inside the next q4 linear's prologue (add_rms_norm_zc_linear_q4 / _swiglu_q4, route
gemv_persist) on the GPU.

Every route instance at T = 1, its tmax, tmax + 1 and 2 tmax + 1 (one chunk of tokens, the next chunk's first,
three chunks) on odd shapes (a short last row tile) and the 27B's (in_qkvz 16384 x 5120, attention qkv 14336 x 5120,
MLP 17408 x 5120). Weights come from the real codec (formats.encode), a / b / norm_w are random bf16. s must be
bf16(a + b) bit for bit; x and y are compared with the fp64 oracle (the add-norm, then the linear over x before its
rounding) under the op's preset. Rows past T of s, x and y are NaN sentinels that must survive. Plus: one call
captured in a CUDA graph (replay equals eager bit for bit) and a 4-layer model at the 27B's widths with random q4
weights whose logits with the fused ops at every boundary match those with the two ops apart. Skips cleanly
without a GPU."""
import dataclasses

import numpy as np
import pytest
import torch

from ninfer.runtime.decode_graph import capture
from ninfer.runtime.formats import encode
from ninfer.runtime.manifest import Manifest
from ninfer.runtime.tolerance import compare
from tests.gpu.graphs import replay_then_eager
from tests.ops_cases import gpu_kernels, oracle

pytestmark = pytest.mark.gpu
OPS = ("add_rms_norm_zc_linear_q4", "add_rms_norm_zc_linear_swiglu_q4")
# (outputs, K): N for linear_q4, I for linear_swiglu_q4
PROBLEMS = {"add_rms_norm_zc_linear_q4": [(77, 1024), (300, 2048), (16384, 5120), (14336, 5120)],
            "add_rms_norm_zc_linear_swiglu_q4": [(68, 1024), (200, 2048), (17408, 5120)]}
_WEIGHTS = {}


@pytest.fixture(scope="module")
def be():
    from ninfer.runtime.dispatch import CudaBackend
    return CudaBackend()


def weight(rows, K):
    """Packed q4 bytes of a random [rows, K] matrix (cached: the 27B ones take seconds to encode)."""
    if (rows, K) not in _WEIGHTS:
        w = np.random.default_rng(rows * 7 + K).standard_normal((rows, K)).astype(np.float32) * 0.05
        _WEIGHTS[rows, K] = torch.from_numpy(encode("q4", w)).cuda()
    return _WEIGHTS[rows, K]


def inputs(op, n, K, T, seed):
    """a, b, norm_w, w and views of T rows of NaN-filled s, x, y, whose row T (past the views) is a sentinel."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    nan = lambda *s: torch.full(s, float("nan"), device="cuda", dtype=torch.bfloat16)[:T]  # noqa: E731
    return dict(a=(4 * r(T, K)).bfloat16(), b=r(T, K).bfloat16(), norm_w=(0.5 * r(K)).bfloat16(),
                w=weight(2 * n if "swiglu" in op else n, K), s=nan(T + 1, K), x=nan(T + 1, K), y=nan(T + 1, n))


def past(view):
    """The sentinel row after a view of the first T rows."""
    T, width = view.shape
    return view.as_strided((width,), (1,), view.storage_offset() + T * width)


def check(be, op, ts, route=None):
    contract = be.contract(op)
    plan = be.plan(op, route=route, **ts, eps=1e-6)
    plan()
    torch.cuda.synchronize()
    (T, K), n = ts["a"].shape, ts["y"].shape[1]
    assert torch.equal(ts["s"], ts["a"] + ts["b"]), "s is not bf16(a + b)"
    dims = {"T": T, "K": K, "I" if "swiglu" in op else "N": n}
    ref = oracle(op, contract, {k: v for k, v in ts.items() if k in contract["inputs"]}, {"eps": 1e-6, "dims": dims})
    preset = be.manifest.tolerances[contract["tolerance"]]
    for name in ("x", "y"):
        v = compare(ts[name], ref[name], preset, f"{op} {name} T={T} N={n} K={K} via {plan.kernel.instance}")
        assert v, v.detail
    for name in ("s", "x", "y"):
        assert torch.isnan(past(ts[name])).all(), f"{name} written past T"
    return plan.kernel.instance


def cases():
    out = []
    for k in gpu_kernels(OPS):
        tmax = k.data["tile_params"]["tmax"]
        for n, K in PROBLEMS[k.op]:
            if K % (128 * k.data["tile_params"]["warps"] * k.data["tile_params"]["unroll"]) == 0:
                out += [(k.op, k.instance, n, K, T) for T in sorted({1, tmax, tmax + 1, 2 * tmax + 1})]
    return out


@pytest.mark.parametrize("op,route,n,K,T", cases())
def test_every_route(be, op, route, n, K, T):
    ts = inputs(op, n, K, T, seed=T * 31 + n)
    assert check(be, op, ts, route=route) == route


def test_the_table_at_decode_sizes(be):
    """The op's own table (no route named) at T = 1 and 2 on the 27B shapes."""
    for op, (n, K) in (("add_rms_norm_zc_linear_q4", (16384, 5120)), ("add_rms_norm_zc_linear_swiglu_q4", (17408, 5120))):
        for T in (1, 2):
            check(be, op, inputs(op, n, K, T, seed=T))


def test_cuda_graph_replay_equals_eager(be):
    op, T = "add_rms_norm_zc_linear_q4", 1
    ts = inputs(op, 14336, 5120, T, seed=3)
    plan = be.plan(op, **ts, eps=1e-6)
    graph = capture(plan)
    replayed = replay_then_eager(graph, plan, ts["s"], ts["x"], ts["y"])
    for got, name in zip(replayed, ("s", "x", "y")):
        assert torch.equal(got, ts[name]), f"{name}: replay differs from eager"


def test_a_model_at_27b_widths_computes_the_two_ops_apart(monkeypatch):
    """Four layers (3 GDN, 1 attention) at the 27B's widths with random q4 weights, vocabulary cut to 4096: prompt
    logits with every add-norm inside the next linear (NINFER_ADD_NORM_LINEAR=1: the fused ops at every T, in chunks
    of their tile's tokens) against the two ops apart, within model_bf16; decode steps run them inside the decode
    graph and give the eager steps' tokens."""
    from ninfer.runtime.engine import Engine
    from ninfer.runtime.models import blocks
    from ninfer.runtime.synthetic import SHAPES, random_weights
    cfg = dataclasses.replace(SHAPES["qwen3.6-27b"], layers=4, vocab=4096,
                              layer_types=["linear_attention"] * 3 + ["full_attention"], moe_layers=[False] * 4)
    weights = random_weights(cfg, "cuda", fmt="q4", seed=1)
    ids = torch.randint(0, cfg.vocab, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = {}
    for mode in ("0", "1"):
        monkeypatch.setattr(blocks, "ADD_NORM_LINEAR", mode)
        eng = Engine.from_weights(cfg, dict(weights), backend="cuda", max_context=64, max_seqs=2, prefill_chunk=16)
        runs[mode] = eng.score(ids).float().cpu()
        eng.close()
    preset = Manifest.load().tolerances["model_bf16"]
    v = compare(runs["1"], runs["0"], preset, "fused vs apart")
    assert v, v.detail
    tokens = {}
    for graphs in (True, False):
        eng = Engine.from_weights(cfg, dict(weights), backend="cuda", max_context=64, max_seqs=2, prefill_chunk=16,
                                  cuda_graphs=graphs)
        calls = []
        run = eng.be.run
        monkeypatch.setattr(eng.be, "run", lambda op, **kw: (calls.append(op), run(op, **kw))[1])
        tokens[graphs] = eng.generate([ids], max_new=8)[0].generated
        assert {"add_rms_norm_zc_linear_q4", "add_rms_norm_zc_linear_swiglu_q4"} <= set(calls)
        assert eng.cache.in_use == (0, 0)
        eng.close()
    assert tokens[True] == tokens[False]
