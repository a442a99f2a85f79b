"""gdn_delta_rule's chunked (WY) routes (chunked: one kernel; chunked_scan: the chunk matrices in a pre kernel,
then the state scan) on the GPU against the reference backend run on cloned GPU tensors, under
the op's gdn_state_fp32 preset for the outputs o and the final state: one long sequence (exactly 64, 65, 127,
128 and 1000 tokens), several sequences of mixed lengths (empty, 1, 63, 64, 65, ...), the Qwen3.6-27B shape
(HV=48, HK=16, DK=DV=128) and small odd ones (DK < 128, DV not a multiple of the block's columns), a nonzero
initial state, realistic gates, states carried across calls that alternate routes, and the route table at its
recurrent -> chunked boundary. GPU tests skip cleanly without a GPU (the `gpu` marker).

`chunked_gdn` is the chunked algebra in plain torch and `chunked_scan_gdn` the chunked_scan route's split of it;
the CPU test below checks both against the token recurrence (the op's reference), which is what the kernels'
derivations rest on."""
import pytest
import torch
import torch.nn.functional as F

from ninfer.runtime import reference
from tests.gpu.gdn import check_against_reference, check_state_carried

gpu = pytest.mark.gpu

# name: (HK key heads, HV value heads, DK, DV); conv channels C = 2*HK*DK + HV*DV.
SHAPES = {
    "27b": (16, 48, 128, 128),
    "small": (2, 6, 64, 48),       # DK < 128, DV = 48: the second 32-column slice is half empty
    "odd": (1, 3, 96, 40),
    "ragged": (1, 2, 126, 34),     # DK not a multiple of 8 or 16, DV not a multiple of 8
}
ROUTES = ["chunked.v32", "chunked.v16", "chunked_scan.v32", "chunked_scan.v16", "chunked_scan.v16o3"]


# ------------------------------------------------------------------------------ the chunked algebra, CPU

def chunked_gdn(qkv, g, beta, query_start, slots, state, num_k_heads, scale, eps, chunk=64):
    """gdn_delta_rule in the chunked WY form, in the dtype of `state` (fp32 or fp64). Per chunk of a run, with
    G_i = g_0 + ... + g_i:  A_ij = beta_i (k_i.k_j) e^{G_i-G_j} (j < i),  U = (I + A)^-1 diag(beta)(V - e^G (K S)),
    o_i = e^{G_i} q_i S + sum_{j<=i} (q_i.k_j) e^{G_i-G_j} U_j,  S' = e^{G_last} S + sum_j e^{G_last-G_j} k_j U_j."""
    state = state.clone()
    wide = state.dtype
    T = qkv.shape[0]
    hv, dk, dv = state.shape[1:]
    hk = num_k_heads

    def l2(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)

    x = qkv.to(wide)
    q = l2(x[:, : hk * dk].reshape(T, hk, dk)).repeat_interleave(hv // hk, dim=1) * scale
    k = l2(x[:, hk * dk: 2 * hk * dk].reshape(T, hk, dk)).repeat_interleave(hv // hk, dim=1)
    v = x[:, 2 * hk * dk:].reshape(T, hv, dv)
    o = torch.zeros(T, hv, dv, dtype=wide)
    qs = query_start.tolist()
    for s in range(len(qs) - 1):
        a, b, slot = qs[s], qs[s + 1], int(slots[s])
        S = state[slot]                                                   # [HV, DK, DV]
        for c0 in range(a, b, chunk):
            c1 = min(c0 + chunk, b)
            n = c1 - c0
            K, Q, V = (t[c0:c1].transpose(0, 1) for t in (k, q, v))      # [HV, n, D]
            G = g[c0:c1].T.to(wide).cumsum(-1)                            # [HV, n]
            bt = beta[c0:c1].T.to(wide)
            incl = torch.ones(n, n, dtype=torch.bool).tril()
            E = torch.exp((G[:, :, None] - G[:, None, :]).masked_fill(~incl, float("-inf")))  # 0 above the diagonal
            A = bt[:, :, None] * (K @ K.mT) * E * (~torch.eye(n, dtype=torch.bool))
            R = bt[:, :, None] * (V - torch.exp(G)[:, :, None] * (K @ S))
            U = torch.linalg.solve_triangular(torch.eye(n, dtype=wide) + A, R, upper=False, unitriangular=True)
            o[c0:c1] = (torch.exp(G)[:, :, None] * (Q @ S) + ((Q @ K.mT) * E) @ U).transpose(0, 1)
            S = torch.exp(G[:, -1])[:, None, None] * S + K.mT @ (torch.exp(G[:, -1:] - G)[:, :, None] * U)
        state[slot] = S
    return o, state


def chunked_scan_gdn(qkv, g, beta, query_start, slots, state, num_k_heads, scale, eps, chunk=64, pieces=False):
    """The chunked_scan route's split of the same algebra: per chunk, from q, k, g and beta only,
    T' = (I + A)^-1 diag(beta), P = (Q K^T) o e^{G_i-G_j} (j <= i), ek = e^G rk, eq = e^G rq, dk = rk e^{G_last-G},
    eL = e^{G_last} (raw rows, norms as scales); then the scan R' = V - ek (K S), U = T' R', o = eq (Q S) + P U,
    S' = eL S + K^T (dk U). pieces=True rounds every fp32 factor of a product as the kernel does (bf16 hi + lo,
    three of the four products) and k, q to bf16 raw rows."""
    state = state.clone()
    wide = state.dtype
    T = qkv.shape[0]
    hv, dk, dv = state.shape[1:]
    hk = num_k_heads

    def split(x):  # x ~ hi + lo as bf16 pieces
        hi = x.to(torch.bfloat16).to(wide)
        return hi, (x - hi).to(torch.bfloat16).to(wide)

    def mul3(a, b):  # the kernel's fp32 x fp32 product on bf16 tensor cores
        if not pieces:
            return a @ b
        (ah, al), (bh, bl) = split(a), split(b)
        return ah @ bh + ah @ bl + al @ bh

    x = qkv.to(wide)
    raw_q = x[:, : hk * dk].reshape(T, hk, dk).repeat_interleave(hv // hk, dim=1)
    raw_k = x[:, hk * dk: 2 * hk * dk].reshape(T, hk, dk).repeat_interleave(hv // hk, dim=1)
    rq = torch.rsqrt((raw_q * raw_q).sum(-1) + eps) * scale            # [T, HV]
    rk = torch.rsqrt((raw_k * raw_k).sum(-1) + eps)
    v = x[:, 2 * hk * dk:].reshape(T, hv, dv)
    o = torch.zeros(T, hv, dv, dtype=wide)
    qs = query_start.tolist()
    for s in range(len(qs) - 1):
        a, b, slot = qs[s], qs[s + 1], int(slots[s])
        S = state[slot]
        for c0 in range(a, b, chunk):
            c1 = min(c0 + chunk, b)
            n = c1 - c0
            K, Q, V = (t[c0:c1].transpose(0, 1) for t in (raw_k, raw_q, v))
            RK, RQ = rk[c0:c1].T, rq[c0:c1].T                              # [HV, n]
            G = g[c0:c1].T.to(wide).cumsum(-1)
            bt = beta[c0:c1].T.to(wide)
            incl = torch.ones(n, n, dtype=torch.bool).tril()
            E = torch.exp((G[:, :, None] - G[:, None, :]).masked_fill(~incl, float("-inf")))
            A = (bt * RK)[:, :, None] * RK[:, None, :] * (K @ K.mT) * E * (~torch.eye(n, dtype=torch.bool))
            Tp = torch.linalg.inv(torch.eye(n, dtype=wide) + A) * bt[:, None, :]
            P = RQ[:, :, None] * RK[:, None, :] * (Q @ K.mT) * E
            ek, eq = torch.exp(G) * RK, torch.exp(G) * RQ
            dkk, eL = RK * torch.exp(G[:, -1:] - G), torch.exp(G[:, -1])
            Rp = V - ek[:, :, None] * mul3(K, S)
            U = mul3(Tp, Rp)
            o[c0:c1] = (eq[:, :, None] * mul3(Q, S) + mul3(P, U)).transpose(0, 1)
            S = eL[:, None, None] * S + mul3(K.mT, dkk[:, :, None] * U)
        state[slot] = S
    return o, state


def cpu_inputs(shape, runs, seed, dtype=torch.float32):
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    T = sum(runs)
    qs = torch.tensor([0, *torch.tensor(runs).cumsum(0).tolist()], dtype=torch.int32)
    NS = len(runs) + 2
    slots = torch.randperm(NS, generator=gen)[: len(runs)].to(torch.int32)
    qkv = torch.randn(T, 2 * hk * dk + hv * dv, generator=gen).bfloat16()
    A_log = torch.rand(hv, generator=gen) * 1.6 - 1.0
    g = (-torch.exp(A_log) * F.softplus(torch.randn(T, hv, generator=gen) * 1.5)).clamp(min=-5.0)
    beta = torch.sigmoid(torch.randn(T, hv, generator=gen))
    state = torch.randn(NS, hv, dk, dv, generator=gen).to(dtype) * 0.5
    return qkv, g, beta, qs, slots, state


@pytest.mark.parametrize("wide", [torch.float32, torch.float64], ids=str)
def test_chunked_algebra_matches_recurrence_cpu(wide):
    """The chunked form equals the token recurrence (runs of 0, 1, 63, 64, 65 and 130 tokens, nonzero state)."""
    hk, hv, dk, dv = 1, 2, 32, 16
    qkv, g, beta, qs, slots, state = cpu_inputs((hk, hv, dk, dv), [0, 1, 63, 64, 65, 130], seed=1, dtype=wide)
    args = dict(query_start=qs, slots=slots, num_k_heads=hk, scale=dk ** -0.5, eps=1e-6)
    ref = reference.gdn_delta_rule(qkv.to(wide), g.to(wide), beta.to(wide), state=state, **args)
    tol = 1e-5 if wide == torch.float32 else 1e-12
    for form in (chunked_gdn, chunked_scan_gdn):
        o, st = form(qkv, g, beta, state=state, **args)
        assert (o - ref["o"]).abs().max() <= tol, form.__name__
        assert (st - ref["state"]).abs().max() <= tol, form.__name__
        assert torch.equal(st[slots[0].long()], state[slots[0].long()])  # the empty run leaves its slot as is


# ----------------------------------------------------------------------------------------------- GPU

def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def delta_inputs(shape, runs, seed, state=None, slots=None, gates="real"):
    """Random bf16 q/k/v, a nonzero fp32 initial state, distinct random slots, o poisoned with NaN.
    gates="real": g = -exp(A_log) * softplus(a + dt_bias) in [-5, 0), beta = sigmoid(b) in (0, 1);
    "long": g in (-0.02, 0] with beta near 1 and keys sharing a common direction (ill-conditioned I + A);
    "fast": g down to -30 per token (decays underflow inside a chunk)."""
    hk, hv, dk, dv = shape
    gn = gen(seed)
    qs = [0]
    for n in runs:
        qs.append(qs[-1] + n)
    S = len(runs)
    NS = S + 3
    T = qs[-1]
    if slots is None:
        slots = torch.randperm(NS, device="cuda", generator=gn)[:S].to(torch.int32)
    if state is None:
        state = torch.randn(NS, hv, dk, dv, device="cuda", generator=gn) * 0.5
    C = 2 * hk * dk + hv * dv
    qkv = torch.randn(T, C, device="cuda", generator=gn)
    A_log = torch.rand(hv, device="cuda", generator=gn) * 1.6 - 1.0
    dt_bias = torch.randn(hv, device="cuda", generator=gn) * 0.5
    g = (-torch.exp(A_log) * F.softplus(torch.randn(T, hv, device="cuda", generator=gn) + dt_bias)).clamp(min=-5.0)
    beta = torch.sigmoid(torch.randn(T, hv, device="cuda", generator=gn))
    if gates == "long":
        g = -torch.rand(T, hv, device="cuda", generator=gn) * 0.02
        beta = torch.sigmoid(torch.randn(T, hv, device="cuda", generator=gn) + 3.0)
        common = torch.randn(hk * dk, device="cuda", generator=gn)
        qkv[:, hk * dk: 2 * hk * dk] = 3.0 * common + 0.3 * qkv[:, hk * dk: 2 * hk * dk]
    elif gates == "fast":
        g = -torch.rand(T, hv, device="cuda", generator=gn) * 30.0
    return {"qkv": qkv.bfloat16(), "g": g.contiguous(), "beta": beta.contiguous(),
            "query_start": torch.tensor(qs, dtype=torch.int32, device="cuda"), "slots": slots, "state": state,
            "o": torch.full((T, hv, dv), float("nan"), dtype=torch.bfloat16, device="cuda"),
            "num_k_heads": hk, "scale": dk ** -0.5}


def check(be, ts, route=None, what=""):
    """Run the kernel and the reference (cloned tensors); compare o and state under gdn_state_fp32."""
    return check_against_reference(be, "gdn_delta_rule", ts, route, what)[0]


@gpu
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 127, 128, 1000])
def test_one_sequence_27b(be, route, T):
    assert check(be, delta_inputs(SHAPES["27b"], [T], seed=T), route=route, what=f"27b T={T}") == route


@gpu
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("runs", [[0, 1, 63, 64, 65], [130, 0, 2, 1, 64], [1, 1, 1], [200, 57]],
                         ids=lambda r: "runs" + "_".join(map(str, r)))
def test_mixed_sequences(be, route, shape, runs):
    ts = delta_inputs(SHAPES[shape], runs, seed=sum(runs) * 7 + len(runs))
    check(be, ts, route=route, what=f"{shape} runs={runs}")


@gpu
@pytest.mark.parametrize("route", ["chunked.v32", "chunked_scan.v32"])
@pytest.mark.parametrize("gates", ["long", "fast"])
@pytest.mark.parametrize("shape", ["27b", "odd"])
def test_gate_extremes(be, route, gates, shape):
    check(be, delta_inputs(SHAPES[shape], [300, 33], seed=5, gates=gates), route=route,
          what=f"{shape} gates={gates}")


@gpu
@pytest.mark.parametrize("route", ["chunked.v32", "chunked_scan.v32"])
def test_empty_runs_and_unused_slots_untouched(be, route):
    """Slots not named by the call, and those of empty runs, keep their exact bits."""
    runs = [70, 0, 0, 5]
    ts = delta_inputs(SHAPES["small"], runs, seed=9)
    before = ts["state"].clone()
    be.run("gdn_delta_rule", route=route, **ts)
    torch.cuda.synchronize()
    used = {int(s) for s, n in zip(ts["slots"].tolist(), runs) if n > 0}
    for slot in range(before.shape[0]):
        if slot not in used:
            assert torch.equal(ts["state"][slot], before[slot]), f"slot {slot} changed"


@gpu
@pytest.mark.parametrize("shape", ["27b", "small"])
def test_state_carried_across_routes(be, shape):
    """Prefill in two calls (chunked), decode steps (recurrent), more prefill: the state one route writes is
    what the next reads; kernel and reference states evolve independently and are compared after each call."""
    sh = SHAPES[shape]
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device="cuda")
    state = torch.randn(6, sh[1], sh[2], sh[3], device="cuda", generator=gen(11)) * 0.5
    state[slots.long()] = 0  # new sequences
    check_state_carried(be, lambda runs, **kw: delta_inputs(sh, runs, **kw), state, slots,
                        [[100, 64, 37], [2, 70, 30], [1, 1, 1], [1, 1, 1], [65, 1, 129]], shape)


@gpu
def test_forced_route_at_every_T(be, monkeypatch):
    """NINFER_ROUTES (CudaBackend.forced) puts the op on one route instance whatever the table says."""
    monkeypatch.setattr(type(be), "forced", {"gdn_delta_rule": "chunked.v16"})
    for runs in ([5], [300]):
        assert check(be, delta_inputs(SHAPES["small"], runs, seed=3), what=f"forced runs={runs}") == "chunked.v16"


def chunked_boundary(be, shape):
    """The first T of a chunked span in the table this GPU resolves through (the recurrent -> chunked boundary)."""
    hk, hv, dk, dv = SHAPES[shape]
    spans = be.manifest.table(be.device.arch, "gdn_delta_rule", "bf16", {"HV": hv, "DK": dk, "DV": dv}, be.device.name)
    starts = [lo for lo, _, use in spans if use.startswith("chunked")]
    assert starts, f"no chunked span in the table: {spans}"
    return starts[0]


@gpu
@pytest.mark.parametrize("shape", ["27b", "odd"])
@pytest.mark.parametrize("delta", [-1, 0, 1])
@pytest.mark.parametrize("mixed", [False, True], ids=["one_run", "mixed_runs"])
def test_route_table_boundary(be, shape, delta, mixed):
    """No route= argument: T = b-1 takes a non-chunked route, T = b and b+1 the chunked one; both match."""
    b = chunked_boundary(be, shape)
    T = b + delta
    runs = [T] if not mixed else [1, 2, T - 3 - T // 3, T // 3]
    used = check(be, delta_inputs(SHAPES[shape], runs, seed=T * 3 + mixed), what=f"{shape} T={T} runs={runs}")
    assert used.startswith("chunked") == (T >= b), used
