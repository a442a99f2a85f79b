"""The MoE ops on the GPU (moe_router, moe_topk, moe_experts, sigmoid_gate_add and its fusion with
the add-norm after it) against the reference backend run on cloned GPU tensors (fp32 math), with each contract's
named tolerance; route tables at every span boundary, every
route instance called by name, the Qwen3.6-35B-A3B / Qwen3-Next / tiny shapes, ties, repeated experts, aliasing,
and the SparseMoE chain captured in a CUDA graph. Skips cleanly without a GPU (the conftest marks `gpu` tests)."""
import pytest
import torch

from ninfer.runtime.contracts import ContractError
from ninfer.runtime.decode_graph import capture
from ninfer.runtime.manifest import RouteError, evaluate
from ninfer.runtime.tolerance import compare
from tests.gpu.graphs import replay_then_eager
from tests.ops_cases import boundary_ts

pytestmark = pytest.mark.gpu

# (H, E, I, K): Qwen3.6-35B-A3B, Qwen3-Next-80B-A3B, the tiny test models, and a small odd one.
QWEN36_35B = {"H": 2048, "E": 256, "I": 512, "K": 8}
QWEN3_NEXT = {"H": 2048, "E": 512, "I": 512, "K": 10}
TINY = {"H": 256, "E": 8, "I": 128, "K": 2}
ODD = {"H": 200, "E": 12, "I": 24, "K": 3}  # I/8 = 3 chunks, I not a multiple of the cluster size


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def nan_like(shape, dtype):
    if dtype == torch.int32:
        return torch.full(shape, -7, dtype=dtype, device="cuda")
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def check_outputs(be, op, got: dict, want: dict, what: str):
    contract = be.contract(op)
    preset = be.manifest.tolerances[contract["tolerance"]]
    for name in contract["outputs"]:
        if got[name].dtype == torch.int32:
            bad = (got[name] != want[name]).nonzero()
            assert bad.numel() == 0, f"{what}: {name} differs at {bad[:8].tolist()}: got {got[name][bad[:8, 0]].tolist()}, " \
                                     f"want {want[name][bad[:8, 0]].tolist()}"
        else:
            v = compare(got[name], want[name], preset, f"{what} {name}")
            assert v, v.detail


def span_ts(be, op, problem):
    """T = 1, b-1, b, b+1 for every span start b of this GPU's table, and an interior point of each span."""
    return boundary_ts(be.manifest.table(be.device.arch, op, "bf16", problem))


def instances(be, op):
    return sorted(k.instance for k in be.manifest.kernels.values() if k.arch == be.device.arch and k.op == op)


def admissible(be, op, instance, dims):
    k = be.manifest.kernel(be.device.arch, op, instance, "bf16")
    return all(evaluate(c, dims) for c in k.constraints)


# ------------------------------------------------------------------------------------------------- moe_router
# (E, H): Qwen3.6-35B-A3B, Qwen3-Next-80B-A3B, the tiny test models, and a small odd one (H/8 = 9 vectors).
ROUTER_SHAPES = [(256, 2048), (512, 2048), (8, 256), (10, 72)]


def router_case(be, ref, T, E, H, seed, route=None):
    g = gen(seed)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    logits = nan_like((T, E), torch.float32)
    plan = be.plan("moe_router", route=route, x=x, w=w, logits=logits)
    plan()
    torch.cuda.synchronize()
    rl = nan_like((T, E), torch.float32)
    ref.run("moe_router", x=x.clone(), w=w.clone(), logits=rl)
    what = f"moe_router T={T} E={E} H={H} via {plan.kernel.instance}"
    check_outputs(be, "moe_router", {"logits": logits}, {"logits": rl}, what)
    # stored in fp32, not rounded to bf16 (model_fp32 already refuses that; this names the failure)
    assert (logits != logits.bfloat16().float()).float().mean().item() > 0.5, f"{what}: logits look bf16-rounded"
    return plan.kernel.instance


@pytest.mark.parametrize("E,H", ROUTER_SHAPES)
def test_router_table(be, ref, E, H):
    for T in sorted({*span_ts(be, "moe_router", {"E": E, "H": H}), 1, 2, 7, 8, 9, 16, 17, 33, 1000, 1024}):
        router_case(be, ref, T, E, H, seed=T * 13 + E + H)


def test_router_every_route(be, ref):
    for inst in instances(be, "moe_router"):
        for E, H in ROUTER_SHAPES:
            for T in (1, 3, 8, 9, 16, 17, 130, 300):
                if admissible(be, "moe_router", inst, {"T": T, "E": E, "H": H}):
                    assert router_case(be, ref, T, E, H, seed=5 * T + E, route=inst) == inst


def test_router_more_token_groups_than_grid_rows(be, ref):
    """grid.y is capped at 65535 token groups; past that each block walks several groups."""
    E, H = 10, 72
    for inst in instances(be, "moe_router"):
        tile = be.manifest.kernel(be.device.arch, "moe_router", inst, "bf16").data["tile_params"]
        if "tg" not in tile:
            continue   # the wgmma route: its grid rows are 128-token tiles (test_router_every_route)
        tg = tile["tg"]
        T = 65535 * tg + 2 * tg + 3
        assert router_case(be, ref, T, E, H, seed=99, route=inst) == inst


def test_router_in_cuda_graph(be, ref):
    """The decode routes replay from a CUDA graph on new x."""
    E, H = 256, 2048
    for T in (1, 8):
        g = gen(500 + T)
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
        logits = nan_like((T, E), torch.float32)
        plan = be.plan("moe_router", x=x, w=w, logits=logits)
        graph = capture(plan)
        x.copy_(torch.randn(T, H, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        rl = nan_like((T, E), torch.float32)
        ref.run("moe_router", x=x.clone(), w=w.clone(), logits=rl)
        check_outputs(be, "moe_router", {"logits": logits}, {"logits": rl}, f"moe_router graph T={T}")


# ---------------------------------------------------------------------------------------------------- moe_topk
def topk_case(be, ref, T, E, K, renormalize, logits, route=None):
    w, ids = nan_like((T, K), torch.float32), nan_like((T, K), torch.int32)
    plan = be.plan("moe_topk", route=route, logits=logits, weights=w, ids=ids, renormalize=renormalize)
    plan()
    torch.cuda.synchronize()
    rw, rids = nan_like((T, K), torch.float32), nan_like((T, K), torch.int32)
    ref.run("moe_topk", logits=logits.clone(), weights=rw, ids=rids, renormalize=renormalize)
    what = f"moe_topk T={T} E={E} K={K} renorm={renormalize} via {plan.kernel.instance}"
    check_outputs(be, "moe_topk", {"weights": w, "ids": ids}, {"weights": rw, "ids": rids}, what)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(T, device="cuda"), rtol=0, atol=1e-5)
    return plan.kernel.instance


TOPK_SHAPES = [(256, 8), (512, 10), (8, 2), (40, 3), (64, 32), (33, 32)]


@pytest.mark.parametrize("E,K", TOPK_SHAPES)
@pytest.mark.parametrize("renormalize", [1, 0])
def test_topk_table(be, ref, E, K, renormalize):
    for T in sorted({*span_ts(be, "moe_topk", {"E": E, "K": K}), 2, 3, 4, 5, 1000}):
        logits = torch.randn(T, E, device="cuda", generator=gen(T * 31 + E)) * 2
        topk_case(be, ref, T, E, K, renormalize, logits)


@pytest.mark.parametrize("E,K", [(256, 8), (512, 10), (8, 2), (40, 3)])
def test_topk_ties_lower_id_wins(be, ref, E, K):
    """Exactly equal logits (few distinct values, a constant row, a tie exactly at the K boundary)."""
    T = 37
    g = gen(E + K)
    logits = torch.randint(0, 4, (T, E), device="cuda", generator=g).float()
    logits[0] = 1.0                                   # every expert equal: ids 0..K-1
    logits[1] = 0.0
    logits[1, E - 1] = logits[1, E - 2] = 2.0         # the two largest at the top ids: E-2 before E-1
    logits[2] = 0.0
    logits[2, : K - 1] = 3.0                          # K-1 clear winners, then an all-way tie for the last slot
    for renormalize in (1, 0):
        topk_case(be, ref, T, E, K, renormalize, logits)
    w, ids = nan_like((T, K), torch.float32), nan_like((T, K), torch.int32)
    be.run("moe_topk", logits=logits, weights=w, ids=ids, renormalize=1)
    assert ids[0].tolist() == list(range(K))
    assert ids[1, :2].tolist() == [E - 2, E - 1]
    assert ids[2].tolist() == list(range(K))


def test_topk_every_route(be, ref):
    for inst in instances(be, "moe_topk"):
        for E, K in TOPK_SHAPES:
            for T in (1, 3, 4, 5, 129):
                if admissible(be, "moe_topk", inst, {"T": T, "E": E, "K": K}):
                    logits = torch.randn(T, E, device="cuda", generator=gen(7 * T + E))
                    assert topk_case(be, ref, T, E, K, 1, logits, route=inst) == inst


# -------------------------------------------------------------------------------------------------- moe_experts
def expert_inputs(T, H, E, I, K, seed, ids=None):
    g = gen(seed)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    down = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
    if ids is None:  # K distinct experts per token, as the router gives
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(-1)[:, :K].to(torch.int32).contiguous()
    w = torch.rand(T, K, device="cuda", generator=g) + 0.05
    w = (w / w.sum(-1, keepdim=True)).contiguous()
    return {"x": x, "gate_up": gate_up, "down": down, "weights": w, "ids": ids}


def experts_case(be, ref, dims, seed, ids=None, route=None):
    T, H, E, I, K = (dims[d] for d in ("T", "H", "E", "I", "K"))
    ins = expert_inputs(T, H, E, I, K, seed, ids)
    y = nan_like((T, H), torch.bfloat16)
    plan = be.plan("moe_experts", route=route, **ins, y=y)
    plan()
    torch.cuda.synchronize()
    ry = nan_like((T, H), torch.bfloat16)
    ref.run("moe_experts", **{k: v.clone() for k, v in ins.items()}, y=ry)
    check_outputs(be, "moe_experts", {"y": y}, {"y": ry}, f"moe_experts {dims} via {plan.kernel.instance}")
    return plan.kernel.instance


@pytest.mark.parametrize("shape", [TINY, ODD, QWEN36_35B], ids=["tiny", "odd", "35b"])
def test_experts_table(be, ref, shape):
    for T in span_ts(be, "moe_experts", {k: shape[k] for k in ("H", "E", "I", "K")}):
        experts_case(be, ref, {"T": T, **shape}, seed=T)


@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_experts_qwen36_35b(be, ref, T):
    experts_case(be, ref, {"T": T, **QWEN36_35B}, seed=1000 + T)


@pytest.mark.parametrize("T", [1, 5, 33])
def test_experts_qwen3_next(be, ref, T):
    experts_case(be, ref, {"T": T, **QWEN3_NEXT}, seed=2000 + T)


@pytest.mark.parametrize("T", [1, 2, 3, 7, 64, 300])
def test_experts_tiny(be, ref, T):
    experts_case(be, ref, {"T": T, **TINY}, seed=3000 + T)


@pytest.mark.parametrize("shape", [TINY, QWEN36_35B], ids=["tiny", "35b"])
def test_experts_shared_and_repeated_ids(be, ref, shape):
    """Every token routed to the same experts; one expert for all slots of a token (a repeated id adds twice)."""
    E, K = shape["E"], shape["K"]
    for T in (1, 6, 40):
        same = torch.arange(E - K, E, device="cuda", dtype=torch.int32).flip(0).repeat(T, 1).contiguous()
        experts_case(be, ref, {"T": T, **shape}, seed=4000 + T, ids=same)
        rep = torch.full((T, K), E // 2, device="cuda", dtype=torch.int32)
        rep[::2, 0] = 0
        experts_case(be, ref, {"T": T, **shape}, seed=5000 + T, ids=rep.contiguous())


def test_experts_every_route(be, ref):
    for inst in instances(be, "moe_experts"):
        for shape, ts in ((TINY, (1, 2, 9, 130)), (ODD, (1, 3)), (QWEN36_35B, (1, 4, 64))):
            for T in ts:
                if admissible(be, "moe_experts", inst, {"T": T, **shape}):
                    assert experts_case(be, ref, {"T": T, **shape}, seed=6000 + T, route=inst) == inst


# ---------------------------------------------------------------------------------------------- sigmoid_gate_add
def gate_add_case(be, ref, T, H, seed, inplace, route=None):
    g_ = gen(seed)
    a = torch.randn(T, H, device="cuda", generator=g_).bfloat16()
    b = torch.randn(T, H, device="cuda", generator=g_).bfloat16()
    g = (torch.randn(T, 1, device="cuda", generator=g_) * 3).bfloat16()
    ra = a.clone()
    y = a if inplace else nan_like((T, H), torch.bfloat16)
    plan = be.plan("sigmoid_gate_add", route=route, a=a, b=b, g=g, y=y)
    plan()
    torch.cuda.synchronize()
    ry = nan_like((T, H), torch.bfloat16)
    ref.run("sigmoid_gate_add", a=ra, b=b.clone(), g=g.clone(), y=ry)
    check_outputs(be, "sigmoid_gate_add", {"y": y}, {"y": ry},
                  f"sigmoid_gate_add T={T} H={H} inplace={inplace} via {plan.kernel.instance}")
    return plan.kernel.instance


@pytest.mark.parametrize("H", [2048, 264, 8])
def test_sigmoid_gate_add_table(be, ref, H):
    for T in sorted({*span_ts(be, "sigmoid_gate_add", {"H": H}), 2, 3, 129, 1000}):
        for inplace in (False, True):
            gate_add_case(be, ref, T, H, seed=T * 3 + H, inplace=inplace)


def test_sigmoid_gate_add_every_route(be, ref):
    for inst in instances(be, "sigmoid_gate_add"):
        for H in (2048, 264):
            for T in (1, 5, 257):
                if admissible(be, "sigmoid_gate_add", inst, {"T": T, "H": H}):
                    assert gate_add_case(be, ref, T, H, seed=T + H, inplace=True, route=inst) == inst


# --------------------------------------------------------------------------------------------------- bad calls
@pytest.mark.parametrize("H", [2048, 5120, 264])
def test_gate_add_norm_writes_what_the_two_ops_write(be, H):
    """sigmoid_gate_add_rms_norm_zc (s in place of a, as the model calls it) is bit-equal to sigmoid_gate_add then
    add_rms_norm_zc on the same norm route (its tile sets the sum's order), at every span boundary of its table."""
    spans = be.manifest.table(be.device.arch, "sigmoid_gate_add_rms_norm_zc", "bf16", {"H": H})
    for T in boundary_ts(spans):
        g = gen(40 + T + H)
        r = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()  # noqa: E731
        a, b, c, gate, w = r(T, H), r(T, H), r(T, H), r(T, 1), r(H) * 0.5
        s, y = a.clone(), nan_like((T, H), torch.bfloat16)
        plan = be.plan("sigmoid_gate_add_rms_norm_zc", a=s, b=b, c=c, g=gate, w=w, s=s, y=y)
        plan()
        s_pair, m, y_pair = a.clone(), b.clone(), nan_like((T, H), torch.bfloat16)
        be.run("sigmoid_gate_add", a=m, b=c, g=gate, y=m)
        be.plan("add_rms_norm_zc", route=plan.kernel.instance, a=s_pair, b=m, w=w, s=s_pair, y=y_pair)()
        torch.cuda.synchronize()
        what = f"sigmoid_gate_add_rms_norm_zc T={T} H={H} via {plan.kernel.instance}"
        assert torch.equal(s, s_pair), f"{what}: s differs from the pair's"
        assert torch.equal(y, y_pair), f"{what}: y differs from the pair's"


def test_bad_calls_are_clear_errors(be):
    logits = torch.randn(2, 600, device="cuda")
    w, ids = nan_like((2, 8), torch.float32), nan_like((2, 8), torch.int32)
    with pytest.raises(RouteError, match=r"moe_topk: route warp\.\w+ \(sm_\w+\) requires E <= \d+"):
        be.plan("moe_topk", logits=logits, weights=w, ids=ids)
    with pytest.raises(ContractError, match=r"moe_topk: argument logits has dtype torch.bfloat16, expected torch.float32"):
        be.plan("moe_topk", logits=logits[:, :256].bfloat16().contiguous(), weights=w, ids=ids)
    x, router = torch.randn(2, 252, device="cuda").bfloat16(), torch.randn(16, 252, device="cuda").bfloat16()
    with pytest.raises(RouteError, match=r"moe_router: route gemv\.\w+ \(sm_\w+\) requires H % 8 == 0"):
        be.plan("moe_router", x=x, w=router, logits=nan_like((2, 16), torch.float32))
    with pytest.raises(ContractError, match=r"moe_router: argument logits has dtype torch.bfloat16, expected torch.float32"):
        be.plan("moe_router", x=x, w=router, logits=nan_like((2, 16), torch.bfloat16))
    ins = expert_inputs(2, 256, 8, 128, 2, seed=1)
    ins["x"] = torch.randn(2, 252, device="cuda").bfloat16()
    ins["gate_up"] = torch.randn(8, 256, 252, device="cuda").bfloat16()
    ins["down"] = torch.randn(8, 252, 128, device="cuda").bfloat16()
    with pytest.raises(RouteError, match=r"moe_experts: route \w+\.\w+ \(sm_\w+\) requires H % 8 == 0"):
        be.plan("moe_experts", **ins, y=nan_like((2, 252), torch.bfloat16))


# ------------------------------------------------------------------------------------- the SparseMoE chain, graphed
@pytest.mark.parametrize("shape,T", [(QWEN36_35B, 1), (QWEN36_35B, 6), (TINY, 5)], ids=["35b-t1", "35b-t6", "tiny-t5"])
def test_sparse_moe_chain_in_cuda_graph(be, ref, shape, T):
    """moe_router (fp32 logits) -> moe_topk -> moe_experts -> (shared expert) -> sigmoid_gate_add, as
    runtime/models/blocks.py calls them, captured once and replayed on new x: equal to eager, and close to the
    reference chain."""
    H, E, I, K = (shape[d] for d in ("H", "E", "I", "K"))
    g = gen(77 + T)
    r = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).bfloat16()  # noqa: E731
    router, shared_gate = r(E, H, scale=H ** -0.5), r(1, H, scale=H ** -0.5)
    gate_up, down = r(E, 2 * I, H, scale=H ** -0.5), r(E, H, I, scale=I ** -0.5)
    x, shared = r(T, H), r(T, H)
    bufs = {"logits": nan_like((T, E), torch.float32), "weights": nan_like((T, K), torch.float32),
            "ids": nan_like((T, K), torch.int32), "y": nan_like((T, H), torch.bfloat16), "g": nan_like((T, 1), torch.bfloat16)}

    def plans(b, backend):
        return [backend.plan("moe_router", x=x, w=router, logits=b["logits"]),
                backend.plan("moe_topk", logits=b["logits"], weights=b["weights"], ids=b["ids"], renormalize=1),
                backend.plan("moe_experts", x=x, gate_up=gate_up, down=down, weights=b["weights"], ids=b["ids"], y=b["y"]),
                # N=1: the default linear table's mma spans need N % 8 == 0, so the gemv route (T <= 8) is named
                backend.plan("linear", route="gemv.t8", x=x, w=shared_gate, y=b["g"]),
                backend.plan("sigmoid_gate_add", a=b["y"], b=shared, g=b["g"], y=b["y"])]

    chain = plans(bufs, be)

    def step():
        for p in chain:
            p()

    graph = capture(step)
    for trial in range(2):
        x.copy_(r(T, H))
        replayed = dict(zip(bufs, replay_then_eager(graph, step, *bufs.values())))
        for k in bufs:
            assert torch.equal(replayed[k], bufs[k]), f"replay {trial}: {k} differs from eager"
        # Reference chain on the kernels' own router logits (a summation-order difference could flip a near-tie).
        rb = {k: nan_like(v.shape, v.dtype) for k, v in bufs.items()}
        ref.run("moe_router", x=x.clone(), w=router.clone(), logits=rb["logits"])
        check_outputs(be, "moe_router", bufs, rb, f"chain {shape} T={T} replay {trial}")
        rb["logits"].copy_(bufs["logits"])
        rb["g"].copy_(bufs["g"])
        ref.run("moe_topk", logits=rb["logits"], weights=rb["weights"], ids=rb["ids"], renormalize=1)
        check_outputs(be, "moe_topk", bufs, rb, f"chain {shape} T={T} replay {trial}")
        ref.run("moe_experts", x=x, gate_up=gate_up, down=down, weights=rb["weights"], ids=rb["ids"], y=rb["y"])
        ref.run("sigmoid_gate_add", a=rb["y"], b=shared, g=rb["g"], y=rb["y"])
        v = compare(bufs["y"], rb["y"], be.manifest.tolerances["bf16_reduction"], f"chain {shape} T={T} replay {trial} y")
        assert v, v.detail
