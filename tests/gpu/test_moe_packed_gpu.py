"""The MoE expert ops over packed weights (moe_experts_q4/q5/q6/w8/fp8 and the mixed pair moe_experts_q4_q5: gate_up
q4, down q5, rowtile128-v1) on the GPU against the reference backend run on cloned GPU tensors (decode, then fp32
math), with the contracts' tolerance (bf16_reduction):
the route table and every route instance by name, at the Qwen3.6-35B-A3B shape and at small shapes whose expert
slices start mid-tile; a poisoned-bytes check that only the selected experts are read; CUDA-graph capture at T=1.
The helpers here serve test_moe_forms_gpu.py too. Skips cleanly without a GPU (the conftest marks `gpu` tests)."""
import numpy as np
import pytest
import torch

from ninfer.runtime import formats
from ninfer.runtime.contracts import ContractError
from ninfer.runtime.decode_graph import capture
from ninfer.runtime.manifest import RouteError, evaluate
from ninfer.runtime.reference_quant import MOE_PAIRS, moe_op
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


def poison_unselected(ins, pair, shape) -> dict:
    """ins with every byte of the experts no token selects set to 0xFF (NaN scales); whole-tile expert slices."""
    H, E, I = shape["H"], shape["E"], shape["I"]
    pg, pd = formats.nbytes(pair[0], (2 * I, H)), formats.nbytes(pair[1], (H, I))  # bytes per expert
    used = set(ins["ids"].flatten().tolist())
    gate_up, down = ins["gate_up"].clone(), ins["down"].clone()
    for e in range(E):
        if e not in used:
            gate_up[e * pg:(e + 1) * pg] = 0xFF
            down[e * pd:(e + 1) * pd] = 0xFF
    return {**ins, "gate_up": gate_up, "down": down}


def check_replays(be, op, fn, y, ins, shape, seed, want, what):
    """fn's launches captured once, then replayed three times on new x and routing (reroute): each replay equal to
    the eager launches and within op's tolerance of want() (the reference on the current inputs)."""
    graph = capture(fn)
    g = gen(seed)
    for trial in range(3):
        reroute(ins, shape, g)
        y.fill_(float("nan"))
        replayed, = replay_then_eager(graph, fn, y)
        assert torch.equal(replayed, y), f"{what}: replay {trial} differs from eager"
        check(be, op, replayed, want(), f"{what} graph replay {trial}")


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
    poisoned = poison_unselected(ins, pair, shape)
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
    check_replays(be, op, plan, y, ins, shape, 1234, lambda: reference(ref, op, ins, shape), f"{op} {name(shape)}")


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
