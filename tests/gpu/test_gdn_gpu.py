"""Gated DeltaNet kernels on the GPU (gdn_conv, gdn_gates, gdn_delta_rule, gdn_gated_norm) against the
reference backend run on cloned GPU tensors (fp32 math, one rounding into each output), with each op's
named tolerance: several sequences of different run lengths (empty, 1, 2, 3 tokens and longer), states
carried across consecutive calls (chunked prefill, then decode, then more prefill), the Qwen3.6-27B and
35B-A3B shapes, the tiny test-model shape and a small odd one, every span boundary of the route tables,
and every route instance called directly. Skips cleanly without a GPU (the `gpu` marker)."""
import pytest
import torch
import torch.nn.functional as F

from ninfer.runtime.decode_graph import capture
from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.manifest import RouteError, evaluate
from ninfer.runtime.tolerance import compare
from tests.gpu.gdn import check_against_reference, check_state_carried
from tests.ops_cases import boundary_ts, gpu_kernels

pytestmark = pytest.mark.gpu

# name: (HK key heads, HV value heads, DK, DV); conv channels C = 2*HK*DK + HV*DV.
SHAPES = {
    "27b": (16, 48, 128, 128),     # C = 10240
    "35b": (16, 32, 128, 128),     # C = 8192
    "tiny": (2, 4, 32, 32),        # C = 256
    "odd": (1, 3, 96, 40),         # C = 312: DK < 128 (padded rows), DV not a multiple of the block's columns
}
KW = 4
GDN_OPS = ("gdn_conv", "gdn_gates", "gdn_delta_rule", "gdn_gated_norm")
# Run-length patterns: several sequences, incl. empty runs and runs shorter than the conv state (KW-1 = 3).
RUNS = [[1], [2], [3], [1, 2, 3], [3, 0, 1, 2, 5], [7, 1, 16, 2], [1] * 33, [64, 1, 3, 2], [200, 57]]


def channels(shape):
    hk, hv, dk, dv = shape
    return 2 * hk * dk + hv * dv


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


def nan_like(shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def sequences(runs, g, spare=3):
    """query_start [S+1] from run lengths, and distinct random state slots out of S + spare."""
    qs = [0]
    for n in runs:
        qs.append(qs[-1] + n)
    S = len(runs)
    perm = torch.randperm(S + spare, device="cuda", generator=g)[:S].to(torch.int32)
    return torch.tensor(qs, dtype=torch.int32, device="cuda"), perm, S + spare


def runs_for(T):
    """A mix of sequences summing to T: decode-like for small T, a few prefill runs of different lengths beyond."""
    if T <= 8:
        return [1] * T
    if T <= 40:
        return [1, 2, 3, T - 6]
    return [1, 2, 3, (T - 6) // 3, T - 6 - (T - 6) // 3]


# ---------------------------------------------------------------------------------------------- inputs

def conv_inputs(shape, runs, seed):
    g = gen(seed)
    C = channels(shape)
    qs, slots, NS = sequences(runs, g)
    T = int(qs[-1])
    return {"x": randn(g, T, C), "w": randn(g, C, KW, scale=0.5), "query_start": qs, "slots": slots,
            "conv_state": randn(g, NS, C, KW - 1), "y": nan_like((T, C))}


def gates_inputs(hv, T, seed):
    g = gen(seed)
    return {"ba": randn(g, T, 2 * hv),
            "A_log": randn(g, hv, dtype=torch.float32), "dt_bias": randn(g, hv, dtype=torch.float32),
            "g": nan_like((T, hv), torch.float32), "beta": nan_like((T, hv), torch.float32)}


def delta_inputs(shape, runs, seed, state=None, slots=None):
    hk, hv, dk, dv = shape
    g = gen(seed)
    qs, new_slots, NS = sequences(runs, g)
    T = int(qs[-1])
    if slots is None:
        slots = new_slots
    if state is None:
        state = randn(g, NS, hv, dk, dv, scale=0.5, dtype=torch.float32)
    # Realistic gates: log-decay g <= 0 (some near 0: long memory), beta in (0, 1).
    gl = -F.softplus(torch.randn(T, hv, device="cuda", generator=g) * 2.0 - 1.0)
    beta = torch.sigmoid(torch.randn(T, hv, device="cuda", generator=g))
    return {"qkv": randn(g, T, channels(shape)), "g": gl.contiguous(), "beta": beta.contiguous(),
            "query_start": qs, "slots": slots, "state": state, "o": nan_like((T, hv, dv)),
            "num_k_heads": hk, "scale": dk ** -0.5}


def norm_inputs(hv, dv, T, seed):
    g = gen(seed)
    return {"o": randn(g, T, hv, dv), "z": randn(g, T, hv, dv), "w": randn(g, dv, scale=0.5) + 1,
            "y": nan_like((T, hv, dv)), "eps": 1e-6}


# ------------------------------------------------------------------------------------------------ gdn_conv

@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("runs", RUNS, ids=lambda r: "runs" + "_".join(map(str, r[:6])) + ("_..." if len(r) > 6 else ""))
def test_gdn_conv_sequences(be, shape, runs):
    ts = conv_inputs(SHAPES[shape], runs, seed=sum(runs) * 31 + len(runs))
    _, ref = check_against_reference(be, "gdn_conv", ts, what=f"{shape} runs={runs}")
    assert torch.equal(ts["conv_state"], ref["conv_state"])  # raw bf16 inputs are moved, never rounded


@pytest.mark.parametrize("shape", ["27b", "tiny"])
def test_gdn_conv_state_carried(be, shape):
    """Chunked prefill (two chunks), then two decode steps, on the same slots; GPU and reference states
    evolve independently and are compared after every call."""
    sh = SHAPES[shape]
    C = channels(sh)
    g = gen(5)
    NS = 6
    slots = torch.tensor([4, 1, 3], dtype=torch.int32, device="cuda")
    st = randn(g, NS, C, KW - 1)
    st[slots.long()] = 0  # new sequences start from zeroed slots
    ref_st = st.clone()
    w = randn(g, C, KW, scale=0.5)
    for i, runs in enumerate([[5, 2, 9], [1, 3, 40], [1, 1, 1], [1, 1, 1]]):
        qs = torch.tensor([0, *torch.tensor(runs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        T = sum(runs)
        x = randn(g, T, C)
        y, ref_y = nan_like((T, C)), nan_like((T, C))
        be.run("gdn_conv", x=x, w=w, query_start=qs, slots=slots, conv_state=st, y=y)
        ReferenceBackend(be.manifest).run("gdn_conv", x=x, w=w, query_start=qs, slots=slots, conv_state=ref_st, y=ref_y)
        torch.cuda.synchronize()
        preset = be.manifest.tolerances["bf16_reduction"]
        v = compare(y, ref_y, preset, f"gdn_conv call {i} runs={runs}")
        assert v, v.detail
        assert torch.equal(st, ref_st), f"conv_state differs after call {i}"


# ----------------------------------------------------------------------------------------------- gdn_gates

@pytest.mark.parametrize("hv", [48, 32, 4, 3])
@pytest.mark.parametrize("T", [1, 2, 17, 257, 1000])
def test_gdn_gates(be, hv, T):
    check_against_reference(be, "gdn_gates", gates_inputs(hv, T, seed=hv * 1000 + T), what=f"HV={hv} T={T}")


def test_gdn_gates_softplus_threshold(be):
    """Large a + dt_bias takes softplus's linear branch (torch threshold 20), small ones its log1p(exp) branch."""
    ts = gates_inputs(8, 64, seed=3)
    ts["ba"][:, 8:] = (torch.linspace(-40, 40, 64 * 8, device="cuda").reshape(64, 8)).bfloat16()   # a
    check_against_reference(be, "gdn_gates", ts, what="threshold sweep")


# ------------------------------------------------------------------------------------------ gdn_gated_norm

@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("T", [1, 5, 64, 300])
def test_gdn_gated_norm(be, shape, T):
    _, hv, _, dv = SHAPES[shape]
    check_against_reference(be, "gdn_gated_norm", norm_inputs(hv, dv, T, seed=T * 7 + hv), what=f"{shape} T={T}")


# ------------------------------------------------------------------------------------------ gdn_delta_rule

@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("runs", RUNS, ids=lambda r: "runs" + "_".join(map(str, r[:6])) + ("_..." if len(r) > 6 else ""))
def test_gdn_delta_rule_sequences(be, shape, runs):
    ts = delta_inputs(SHAPES[shape], runs, seed=sum(runs) * 17 + len(runs))
    check_against_reference(be, "gdn_delta_rule", ts, what=f"{shape} runs={runs}")


@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_gdn_delta_rule_state_carried(be, shape):
    """Chunked prefill (two chunks of different lengths), decode steps, then another prefill chunk, on the
    same slots: the fp32 state the kernel writes back is what the next call reads."""
    sh = SHAPES[shape]
    g = gen(11)
    state = randn(g, 5, sh[1], sh[2], sh[3], scale=0.5, dtype=torch.float32)
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device="cuda")
    state[slots.long()] = 0  # new sequences
    check_state_carried(be, lambda runs, **kw: delta_inputs(sh, runs, **kw), state, slots,
                        [[37, 64, 5], [2, 1, 30], [1, 1, 1], [1, 1, 1], [10, 1, 3]], shape)


def test_gdn_delta_rule_unused_slots_untouched(be):
    """Slots not named by the call keep their exact bits; empty runs leave their slot as is."""
    ts = delta_inputs(SHAPES["tiny"], [3, 0, 2], seed=9)
    before = ts["state"].clone()
    be.run("gdn_delta_rule", **ts)
    torch.cuda.synchronize()
    used = {int(s) for s, n in zip(ts["slots"].tolist(), [3, 0, 2]) if n > 0}
    for slot in range(before.shape[0]):
        if slot not in used:
            assert torch.equal(ts["state"][slot], before[slot]), f"slot {slot} changed"


# ------------------------------------------------------------------------------- route tables and routes

def op_inputs(op, shape, T, seed):
    hk, hv, dk, dv = SHAPES[shape]
    if op == "gdn_conv":
        return conv_inputs(SHAPES[shape], runs_for(T), seed)
    if op == "gdn_gates":
        return gates_inputs(hv, T, seed)
    if op == "gdn_delta_rule":
        return delta_inputs(SHAPES[shape], runs_for(T), seed)
    return norm_inputs(hv, dv, T, seed)


def problem_of(op, shape):
    hk, hv, dk, dv = SHAPES[shape]
    return {"gdn_conv": {"C": channels(SHAPES[shape]), "KW": KW}, "gdn_gates": {"HV": hv},
            "gdn_delta_rule": {"HV": hv, "DK": dk, "DV": dv}, "gdn_gated_norm": {"HV": hv, "DV": dv}}[op]


def table_cases():
    from ninfer.runtime.cuda import device, gpu_available
    from ninfer.runtime.manifest import Manifest
    if not gpu_available():
        return []
    m, arch = Manifest.load(), device().arch
    cases = []
    for op in GDN_OPS:
        for shape in ("27b", "35b", "tiny"):
            for T in boundary_ts(m.table(arch, op, "bf16", problem_of(op, shape))):
                cases.append((op, shape, T))
    return cases


def route_cases():
    cases = []
    for k in gpu_kernels(GDN_OPS):
        for shape in SHAPES:
            for T in (1, 3, 64, 300):
                env = {"T": T, **problem_of(k.op, shape), "C": channels(SHAPES[shape]), "KW": KW,
                       "DK": SHAPES[shape][2], "DV": SHAPES[shape][3], "HV": SHAPES[shape][1]}
                if all(evaluate(c, env) for c in k.constraints):
                    cases.append((k.op, k.instance, shape, T))
    return cases


@pytest.mark.parametrize("op,shape,T", table_cases(), ids=lambda v: str(v))
def test_table_routes_at_span_boundaries(be, op, shape, T):
    check_against_reference(be, op, op_inputs(op, shape, T, seed=T * 3 + 1), what=f"{shape} T={T}")


@pytest.mark.parametrize("op,route,shape,T", route_cases(), ids=lambda v: str(v))
def test_every_route(be, op, route, shape, T):
    used, _ = check_against_reference(be, op, op_inputs(op, shape, T, seed=T * 5 + 2), route=route,
                                      what=f"{shape} T={T}")
    assert used == route


def test_bad_calls_on_gpu(be):
    g = gen(1)
    ts = conv_inputs(SHAPES["tiny"], [2, 3], seed=1)
    ts["w"] = randn(g, channels(SHAPES["tiny"]), 3)
    ts["conv_state"] = randn(g, ts["conv_state"].shape[0], channels(SHAPES["tiny"]), 2)
    with pytest.raises(RouteError, match=r"gdn_conv: route chunk\.\w+ \(sm_\w+\) requires KW == 4"):
        be.plan("gdn_conv", **ts)
    ts = delta_inputs((1, 2, 256, 32), [2], seed=2)
    with pytest.raises(RouteError, match=r"gdn_delta_rule: route recurrent\.\w+ \(sm_\w+\) requires DK <= 128"):
        be.plan("gdn_delta_rule", **ts)


def test_gdn_chain_cuda_graph(be):
    """conv -> gates -> delta rule -> gated norm (decode-shaped, 3 sequences) captured once and replayed on new
    inputs from the same starting states: bitwise equal to eager (the kernels are deterministic, read
    query_start/slots on the device and allocate nothing)."""
    hk, hv, dk, dv = SHAPES["35b"]
    C = channels(SHAPES["35b"])
    g = gen(21)
    runs = [1, 1, 1]
    qs, slots, NS = sequences(runs, g)
    T = len(runs)
    x, ba, z = randn(g, T, C), randn(g, T, 2 * hv), randn(g, T, hv, dv)
    conv_w, norm_w = randn(g, C, KW, scale=0.5), randn(g, dv, scale=0.5) + 1
    A_log, dt_bias = randn(g, hv, dtype=torch.float32), randn(g, hv, dtype=torch.float32)
    conv_state, state = randn(g, NS, C, KW - 1), randn(g, NS, hv, dk, dv, scale=0.5, dtype=torch.float32)
    qkv, o, y = nan_like((T, C)), nan_like((T, hv, dv)), nan_like((T, hv, dv))
    gl, beta = nan_like((T, hv), torch.float32), nan_like((T, hv), torch.float32)
    plans = [be.plan("gdn_conv", x=x, w=conv_w, query_start=qs, slots=slots, conv_state=conv_state, y=qkv),
             be.plan("gdn_gates", ba=ba, A_log=A_log, dt_bias=dt_bias, g=gl, beta=beta),
             be.plan("gdn_delta_rule", qkv=qkv, g=gl, beta=beta, query_start=qs, slots=slots, state=state, o=o,
                     num_k_heads=hk, scale=dk ** -0.5),
             be.plan("gdn_gated_norm", o=o, z=z, w=norm_w, y=y)]
    cs0, st0 = conv_state.clone(), state.clone()

    def step():
        for p in plans:
            p()

    warm = torch.cuda.CUDAGraph()
    with torch.cuda.graph(warm):
        pass
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # the launch path allocates nothing
    graph = capture(step)
    for trial in range(3):
        for t in (x, ba, z):
            t.copy_(randn(g, *t.shape))
        conv_state.copy_(cs0)
        state.copy_(st0)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in (y, qkv, o, gl, beta, conv_state, state)]
        conv_state.copy_(cs0)
        state.copy_(st0)
        step()
        torch.cuda.synchronize()
        for name, r, e in zip(("y", "qkv", "o", "g", "beta", "conv_state", "state"), replayed,
                              (y, qkv, o, gl, beta, conv_state, state)):
            assert torch.equal(r, e), f"replay {trial}: {name} differs from eager"
