"""The MoE expert ops over packed weights (moe_experts_q4/q5/q6/w8/fp8 and the mixed pair moe_experts_q4_q5: gate_up
q4, down q5, rowtile128-v1; the split decode form moe_gate_up_<fmt> + moe_down_<fmt>; the grouped prefill form
moe_align + moe_gate_up_grouped_<fmt> + moe_down_grouped_<fmt> + moe_sum) on the GPU against the
reference backend run on cloned GPU tensors (decode, then fp32 math), with the contracts' tolerance (bf16_reduction):
the route table and every route instance by name, at the Qwen3.6-35B-A3B shape and at small shapes whose expert
slices start mid-tile; a poisoned-bytes check that only the selected experts are read; ids outside [0, E);
CUDA-graph capture at T=1. Skips cleanly without a GPU (the conftest marks `gpu` tests)."""
import numpy as np
import pytest
import torch

from ninfer.runtime import formats
from ninfer.runtime.contracts import ContractError
from ninfer.runtime.decode_graph import capture
from ninfer.runtime.manifest import RouteError, evaluate
from ninfer.runtime.reference_quant import MOE_PAIRS, PACKED, moe_op
from ninfer.runtime.tolerance import compare
from tests.gpu.graphs import replay_then_eager

pytestmark = pytest.mark.gpu

# (gate_up format, down format) of every packed expert op: the five same-format ops and the recipes' default q4/q5
PAIRS = list(MOE_PAIRS)
PAIR_IDS = [moe_op(g, d).removeprefix("moe_experts_") for g, d in PAIRS]
# (H, E, I, K): Qwen3.6-35B-A3B; an odd one (expert slices of 2I = 80 and H = 72 rows start mid-tile, H and I
# not multiples of 128); a small one with whole-tile slices.
REAL = {"H": 2048, "E": 256, "I": 512, "K": 8}
ODD = {"H": 72, "E": 6, "I": 40, "K": 2}
SMALL = {"H": 128, "E": 8, "I": 64, "K": 1}
CASES = [(REAL, 1), (REAL, 4)] + [(s, T) for s in (ODD, SMALL) for T in (1, 2, 8, 33)]
# Encoding all 256 real-shape experts on the CPU takes minutes (fp8 most), so that shape encodes 37 distinct
# experts and repeats their bytes (its slices are whole 128-row tiles): expert e has the weights of e % 37.
DISTINCT = 37


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def nan_like(shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def name(shape):
    return "H{H}-E{E}-I{I}-K{K}".format(**shape)


_FLOATS: dict = {}
_PACKED: dict = {}


def floats(shape: dict) -> dict:
    """The float weights of a shape, N(0, 1) * 0.05, whatever formats encode them: {"gate_up": [n*2I, H],
    "down": [n*H, I]} for the n = min(E, DISTINCT) distinct experts."""
    key = name(shape)
    if key not in _FLOATS:
        H, E, I = shape["H"], shape["E"], shape["I"]
        rng = np.random.default_rng(H * 7919 + E * 31 + I)
        n = min(E, DISTINCT)
        gu = rng.standard_normal((n * 2 * I, H), dtype=np.float32) * np.float32(0.05)
        dn = rng.standard_normal((n * H, I), dtype=np.float32) * np.float32(0.05)
        _FLOATS[key] = {"gate_up": gu, "down": dn}
    return _FLOATS[key]


def packed_matrix(fmt: str, which: str, shape: dict) -> torch.Tensor:
    """One matrix (gate_up: packed [E*2I, H], down: packed [E*H, I]) encoded in fmt, on the GPU; cached per
    (fmt, matrix, shape), so the q4 gate_up and the q5 down of the pair op are those of moe_experts_q4 / _q5."""
    key = (fmt, which, name(shape))
    if key not in _PACKED:
        H, E, I = shape["H"], shape["E"], shape["I"]
        n = min(E, DISTINCT)
        b = formats.encode(fmt, floats(shape)[which])
        if n < E:
            assert (2 * I) % 128 == 0 and H % 128 == 0, "repeating expert bytes needs whole-tile expert slices"
            b = b.reshape(n, -1)[np.arange(E) % n].reshape(-1)
        rows, cols = (E * 2 * I, H) if which == "gate_up" else (E * H, I)
        assert b.size == formats.nbytes(fmt, (rows, cols))
        _PACKED[key] = torch.from_numpy(np.ascontiguousarray(b)).cuda()
    return _PACKED[key]


def packed(gfmt: str, dfmt: str, shape: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up bytes in gfmt and down bytes in dfmt, on the GPU."""
    return packed_matrix(gfmt, "gate_up", shape), packed_matrix(dfmt, "down", shape)


def routing(T, E, K, g):
    """K distinct experts per token, as the router gives, and softmax weights."""
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(-1)[:, :K].to(torch.int32).contiguous()
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1).contiguous()
    return ids, w


def reroute(ins, shape, g):
    """New x and routing for one token, written into the captured buffers."""
    ins["x"].copy_(torch.randn(1, shape["H"], device="cuda", generator=g).bfloat16())
    ids, w = routing(1, shape["E"], shape["K"], g)
    ins["ids"].copy_(ids)
    ins["weights"].copy_(w)


def inputs(pair, shape, T, seed):
    g = gen(seed)
    gate_up, down = packed(*pair, shape)
    x = torch.randn(T, shape["H"], device="cuda", generator=g).bfloat16()
    ids, w = routing(T, shape["E"], shape["K"], g)
    return {"x": x, "gate_up": gate_up, "down": down, "weights": w, "ids": ids}


def reference(ref, op, ins, shape):
    ry = nan_like(tuple(ins["x"].shape))
    ref.run(op, **{k: v.clone() for k, v in ins.items()}, y=ry, E=shape["E"], I=shape["I"])
    return ry


def check(be, op, got, want, what):
    v = compare(got, want, be.manifest.tolerances[be.contract(op)["tolerance"]], what)
    assert v, v.detail


def run_case(be, op, shape, ins, want, route=None):
    T = ins["x"].shape[0]
    y = nan_like((T, shape["H"]))
    plan = be.plan(op, route=route, **ins, y=y, E=shape["E"], I=shape["I"])
    plan()
    torch.cuda.synchronize()
    check(be, op, y, want, f"{op} {name(shape)} T={T} via {plan.kernel.instance}")
    return plan.kernel.instance, y


def instances(be, op):
    return sorted(k.instance for k in be.manifest.kernels.values() if k.arch == be.device.arch and k.op == op)


def admissible(be, op, instance, dims):
    k = be.manifest.kernel(be.device.arch, op, instance, "bf16")
    return all(evaluate(c, dims) for c in k.constraints)


@pytest.mark.parametrize("shape,T", CASES, ids=[f"{name(s)}-T{T}" for s, T in CASES])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_table_and_every_route(be, ref, pair, shape, T):
    """The route the table picks, then every route instance of this GPU by name, on the same inputs."""
    op = moe_op(*pair)
    ins = inputs(pair, shape, T, seed=T * 131 + shape["H"])
    want = reference(ref, op, ins, shape)
    _, first = run_case(be, op, shape, ins, want)
    dims = {"T": T, **shape}
    todo = instances(be, op)
    assert todo and all(admissible(be, op, inst, dims) for inst in todo), "every route admits these shapes"
    for inst in todo:
        got, y = run_case(be, op, shape, ins, want, route=inst)
        assert got == inst
        # one block or a cluster per token: the same tiles and the same fp32 operations in the same order
        assert torch.equal(y, first), f"{op} {name(shape)} T={T}: {inst} differs bitwise from the table's route"


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("shape", [SMALL, REAL], ids=["small", "35b"])
def test_only_selected_experts_are_read(be, ref, pair, shape):
    """Every byte of the experts no token selects is 0xFF (NaN scales): the output stays finite and right."""
    op = moe_op(*pair)
    H, E, I, K = (shape[d] for d in ("H", "E", "I", "K"))
    T = 2 if shape is SMALL else 1
    ins = inputs(pair, shape, T, seed=99 + E)
    want = reference(ref, op, ins, shape)
    gfmt, dfmt = pair
    pg, pd = formats.nbytes(gfmt, (2 * I, H)), formats.nbytes(dfmt, (H, I))  # bytes per expert (whole tiles)
    used = set(ins["ids"].flatten().tolist())
    gate_up, down = ins["gate_up"].clone(), ins["down"].clone()
    for e in range(E):
        if e not in used:
            gate_up[e * pg:(e + 1) * pg] = 0xFF
            down[e * pd:(e + 1) * pd] = 0xFF
    poisoned = {**ins, "gate_up": gate_up, "down": down}
    for inst in instances(be, op):
        y = nan_like((T, H))
        be.run(op, route=inst, **poisoned, y=y, E=E, I=I)
        torch.cuda.synchronize()
        check(be, op, y, want, f"{op} {name(shape)} poisoned unselected experts via {inst}")


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("shape", [REAL, ODD], ids=["35b", "odd"])
def test_cuda_graph_t1(be, ref, pair, shape):
    """The T=1 decode launch captured once and replayed on new x and new routing: equal to eager, close to the
    reference."""
    op = moe_op(*pair)
    ins = inputs(pair, shape, 1, seed=7 + shape["H"])
    y = nan_like((1, shape["H"]))
    plan = be.plan(op, **ins, y=y, E=shape["E"], I=shape["I"])
    graph = capture(plan)
    g = gen(1234)
    for trial in range(3):
        reroute(ins, shape, g)
        y.fill_(float("nan"))
        replayed, = replay_then_eager(graph, plan, y)
        assert torch.equal(replayed, y), f"{op} replay {trial} differs from eager"
        check(be, op, replayed, reference(ref, op, ins, shape), f"{op} {name(shape)} graph replay {trial}")


def test_bad_calls_are_clear_errors(be):
    ins = inputs(("q4", "q4"), SMALL, 2, seed=5)
    with pytest.raises(ContractError, match="pass them by name"):
        be.plan("moe_experts_q4", **ins, y=nan_like((2, 128)))
    H, E, I = 76, 4, 64  # H % 8 != 0
    gb = torch.zeros(formats.nbytes("q4", (E * 2 * I, H)), dtype=torch.uint8, device="cuda")
    db = torch.zeros(formats.nbytes("q4", (E * H, I)), dtype=torch.uint8, device="cuda")
    bad = {**ins, "x": torch.randn(2, H, device="cuda").bfloat16(), "gate_up": gb, "down": db}
    with pytest.raises(RouteError, match=r"moe_experts_q4: route \w+\.\w+ \(sm_\w+\) requires H % 8 == 0"):
        be.plan("moe_experts_q4", **bad, y=nan_like((2, H)), E=E, I=I)
    # the pair op sized by its own byte counts: down packed as q4 instead of q5 is refused by the contract
    with pytest.raises(ContractError, match=r"moe_experts_q4_q5: the contract requires WD == "):
        be.plan("moe_experts_q4_q5", **ins, y=nan_like((2, 128)), E=SMALL["E"], I=SMALL["I"])


# ---- the split form: moe_gate_up_<fmt> (h = silu(gate) * up per slot), then moe_down_<fmt> ---------------------------
SPLIT_CASES = [(REAL, 1), (REAL, 8), (REAL, 16)] + [(s, T) for s in (ODD, SMALL) for T in (1, 2, 8, 33)]


def split_reference(ref, fmt, ins, shape):
    """(h, y) of the reference backend: h from moe_gate_up_<fmt>, y from moe_down_<fmt> over that h."""
    T, K, I, E = ins["x"].shape[0], shape["K"], shape["I"], shape["E"]
    h = torch.full((T, K, I), float("nan"), device="cuda")
    ref.run(f"moe_gate_up_{fmt}", x=ins["x"].clone(), gate_up=ins["gate_up"].clone(), ids=ins["ids"].clone(), h=h, E=E)
    y = nan_like((T, shape["H"]))
    ref.run(f"moe_down_{fmt}", h=h.clone(), down=ins["down"].clone(), weights=ins["weights"].clone(),
            ids=ins["ids"].clone(), y=y, E=E)
    return h, y


def run_split(be, fmt, ins, shape, h_in=None, gu_route=None, dn_route=None):
    """h and y on the GPU: moe_down reads h_in when given (its own check), else the h just computed."""
    T, K, I, E = ins["x"].shape[0], shape["K"], shape["I"], shape["E"]
    h = torch.full((T, K, I), float("nan"), device="cuda")
    be.run(f"moe_gate_up_{fmt}", route=gu_route, x=ins["x"], gate_up=ins["gate_up"], ids=ins["ids"], h=h, E=E)
    y = nan_like((T, shape["H"]))
    be.run(f"moe_down_{fmt}", route=dn_route, h=h if h_in is None else h_in, down=ins["down"], weights=ins["weights"],
           ids=ins["ids"], y=y, E=E)
    torch.cuda.synchronize()
    return h, y


@pytest.mark.parametrize("shape,T", SPLIT_CASES, ids=[f"{name(s)}-T{T}" for s, T in SPLIT_CASES])
@pytest.mark.parametrize("fmt", PACKED)
def test_split_every_route(be, ref, fmt, shape, T):
    """Each half against its reference (down over the reference h), for the table's route and every instance by
    name; the two halves together against the single-op reference moe_experts_<fmt>."""
    ins = inputs((fmt, fmt), shape, T, seed=T * 17 + shape["H"])
    want_h, want_y = split_reference(ref, fmt, ins, shape)
    gu, dn = f"moe_gate_up_{fmt}", f"moe_down_{fmt}"
    routes = [(None, None)] + [(g, None) for g in instances(be, gu)] + [(None, d) for d in instances(be, dn)]
    for gr, dr in routes:
        h, y = run_split(be, fmt, ins, shape, h_in=want_h, gu_route=gr, dn_route=dr)
        check(be, gu, h, want_h, f"{gu} {name(shape)} T={T} via {gr or 'table'}")
        check(be, dn, y, want_y, f"{dn} {name(shape)} T={T} via {dr or 'table'} (reference h)")
    _, y = run_split(be, fmt, ins, shape)
    check(be, moe_op(fmt, fmt), y, reference(ref, moe_op(fmt, fmt), ins, shape), f"{gu} + {dn} {name(shape)} T={T}")


@pytest.mark.parametrize("fmt", PACKED)
def test_split_skips_ids_outside_the_experts(be, ref, fmt):
    """A slot whose id is -1 or E gets h = 0 and adds nothing to y; the others are as the reference."""
    shape, T = ODD, 3
    ins = inputs((fmt, fmt), shape, T, seed=3)
    ins["ids"][0, 1] = -1
    ins["ids"][2, 0] = shape["E"]
    want_h, want_y = split_reference(ref, fmt, ins, shape)
    h, y = run_split(be, fmt, ins, shape)
    assert (h[0, 1] == 0).all() and (h[2, 0] == 0).all()
    check(be, f"moe_gate_up_{fmt}", h, want_h, f"moe_gate_up_{fmt} with ids -1 and E")
    check(be, f"moe_down_{fmt}", y, want_y, f"moe_down_{fmt} with ids -1 and E")


@pytest.mark.parametrize("fmt", PACKED)
def test_split_reads_only_selected_experts(be, ref, fmt):
    """Every byte of the experts no token selects is 0xFF (NaN scales): h and y stay finite and right."""
    shape = REAL
    H, E, I = shape["H"], shape["E"], shape["I"]
    ins = inputs((fmt, fmt), shape, 2, seed=41)
    want_h, want_y = split_reference(ref, fmt, ins, shape)
    pg, pd = formats.nbytes(fmt, (2 * I, H)), formats.nbytes(fmt, (H, I))
    used = set(ins["ids"].flatten().tolist())
    gate_up, down = ins["gate_up"].clone(), ins["down"].clone()
    for e in range(E):
        if e not in used:
            gate_up[e * pg:(e + 1) * pg] = 0xFF
            down[e * pd:(e + 1) * pd] = 0xFF
    h, y = run_split(be, fmt, {**ins, "gate_up": gate_up, "down": down}, shape)
    check(be, f"moe_gate_up_{fmt}", h, want_h, f"moe_gate_up_{fmt} poisoned unselected experts")
    check(be, f"moe_down_{fmt}", y, want_y, f"moe_down_{fmt} poisoned unselected experts")


def test_split_cuda_graph_t1(be, ref):
    """Both launches captured once and replayed on new x and routing: equal to eager, close to the reference."""
    fmt, shape = "q4", REAL
    ins = inputs((fmt, fmt), shape, 1, seed=77)
    h = torch.full((1, shape["K"], shape["I"]), float("nan"), device="cuda")
    y = nan_like((1, shape["H"]))
    gu = be.plan(f"moe_gate_up_{fmt}", x=ins["x"], gate_up=ins["gate_up"], ids=ins["ids"], h=h, E=shape["E"])
    dn = be.plan(f"moe_down_{fmt}", h=h, down=ins["down"], weights=ins["weights"], ids=ins["ids"], y=y, E=shape["E"])

    def both():
        gu()
        dn()
    graph = capture(both)
    g = gen(4321)
    for trial in range(3):
        reroute(ins, shape, g)
        y.fill_(float("nan"))
        replayed, = replay_then_eager(graph, both, y)
        assert torch.equal(replayed, y), f"replay {trial} differs from eager"
        _, want_y = split_reference(ref, fmt, ins, shape)
        check(be, f"moe_down_{fmt}", replayed, want_y, f"split graph replay {trial}")


# ---- the grouped form: moe_align, moe_gate_up_grouped_<fmt>, moe_down_grouped_<fmt>, moe_sum -------------------------
GROUPED_CASES = [(REAL, 64), (REAL, 300)] + [(s, T) for s in (ODD, SMALL) for T in (1, 9, 300)]


def align(be, ids, E):
    order, offsets = torch.empty_like(ids), torch.empty(E, dtype=torch.int32, device=ids.device)
    be.run("moe_align", ids=ids, order=order, offsets=offsets)
    return order, offsets


@pytest.mark.parametrize("T,E,K", [(1, 256, 8), (7, 256, 8), (300, 256, 8), (4096, 256, 8), (1024, 512, 10), (33, 6, 2)])
def test_moe_align_is_the_reference_exactly(be, ref, T, E, K):
    """The stable sort by expert, ids outside [0, E) last (a few planted), bit for bit."""
    g = gen(T + E)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(-1)[:, :K].to(torch.int32).contiguous()
    ids[0, 0] = -1
    ids[T // 2, K - 1] = E
    got, want = align(be, ids, E), align(ref, ids.clone(), E)
    assert torch.equal(got[1], want[1]), "offsets"
    assert torch.equal(got[0], want[0]), "order"


@pytest.mark.parametrize("shape,T", GROUPED_CASES, ids=[f"{name(s)}-T{T}" for s, T in GROUPED_CASES])
@pytest.mark.parametrize("fmt", PACKED)
def test_grouped_every_route(be, ref, fmt, shape, T):
    """Each grouped op against its reference (down over the reference h, moe_sum over the reference ys), the
    table's route and every instance by name; the whole form (moe_align on the GPU too) against moe_experts_<fmt>."""
    ins = inputs((fmt, fmt), shape, T, seed=T * 29 + shape["H"])
    if T > 1:  # a slot no expert owns
        ins["ids"][T - 1, 0] = -1
    K, I, H, E = shape["K"], shape["I"], shape["H"], shape["E"]
    order, offsets = align(ref, ins["ids"].clone(), E)
    gu, dn = f"moe_gate_up_grouped_{fmt}", f"moe_down_grouped_{fmt}"
    want_h = torch.full((T, K, I), float("nan"), device="cuda")
    ref.run(gu, x=ins["x"].clone(), gate_up=ins["gate_up"].clone(), order=order, offsets=offsets, h=want_h)
    want_ys = torch.full((T, K, H), float("nan"), device="cuda")
    ref.run(dn, h=want_h.clone(), down=ins["down"].clone(), weights=ins["weights"].clone(), order=order,
            offsets=offsets, ys=want_ys)
    for route in [None, *instances(be, gu)]:
        h = torch.full((T, K, I), float("nan"), device="cuda")
        be.run(gu, route=route, x=ins["x"], gate_up=ins["gate_up"], order=order, offsets=offsets, h=h)
        torch.cuda.synchronize()
        check(be, gu, h, want_h, f"{gu} {name(shape)} T={T} via {route or 'table'}")
    for route in [None, *instances(be, dn)]:
        ys = torch.full((T, K, H), float("nan"), device="cuda")
        be.run(dn, route=route, h=want_h, down=ins["down"], weights=ins["weights"], order=order, offsets=offsets, ys=ys)
        torch.cuda.synchronize()
        check(be, dn, ys, want_ys, f"{dn} {name(shape)} T={T} via {route or 'table'} (reference h)")
    y, want_y = nan_like((T, H)), nan_like((T, H))
    be.run("moe_sum", ys=want_ys, y=y)
    ref.run("moe_sum", ys=want_ys.clone(), y=want_y)
    torch.cuda.synchronize()
    check(be, "moe_sum", y, want_y, f"moe_sum {name(shape)} T={T}")

    go, gf = align(be, ins["ids"], E)
    h = torch.full((T, K, I), float("nan"), device="cuda")
    be.run(gu, x=ins["x"], gate_up=ins["gate_up"], order=go, offsets=gf, h=h)
    ys = torch.full((T, K, H), float("nan"), device="cuda")
    be.run(dn, h=h, down=ins["down"], weights=ins["weights"], order=go, offsets=gf, ys=ys)
    be.run("moe_sum", ys=ys, y=y)
    torch.cuda.synchronize()
    single = {**ins, "weights": ins["weights"].clone(), "ids": ins["ids"].clamp(0, E - 1)}
    single["weights"][ins["ids"] < 0] = 0
    check(be, moe_op(fmt, fmt), y, reference(ref, moe_op(fmt, fmt), single, shape), f"grouped form {name(shape)} T={T}")
