"""Gated-attention kernels on the GPU (attn_qk_prep, kv_cache_write, paged_attention, paged_attention_split,
paged_attention_verify, merge_attn_states) against the reference backend run on cloned GPU tensors (fp32 math), compared with each
contract's named tolerance.

paged_attention cases are built like the engine's steps (pages of a shared pool in shuffled order, block
tables padded with a spare page), with two traps: every cache slot no sequence has written, and the pad
page, hold NaN, so a kernel that reads (or multiplies by zero) a key beyond a token's position fails.
Skips cleanly without a GPU (the conftest skips the `gpu` marker)."""
import pytest
import torch

from ninfer.runtime.manifest import RouteError
from ninfer.runtime.tolerance import compare
from tests.ops_cases import boundary_ts, gpu_kernels

pytestmark = pytest.mark.gpu

# (NH, NKV, D, BS): the real Qwen3.6-27B and 35B-A3B attention shapes, the tiny test models, odd ones
REAL_27B = (24, 4, 256, 16)
REAL_35B = (16, 2, 256, 16)
TINY = (4, 2, 64, 16)
PAGE32 = (24, 4, 256, 32)   # two 16-key chunks per page
PAGE5 = (6, 2, 128, 5)      # pages that do not hold whole 16-key chunks (the shuffled-slot load path)
ATTN_PROBLEMS = [REAL_27B, REAL_35B, TINY, (12, 3, 128, 8), (6, 1, 64, 32), (16, 2, 64, 64), (8, 8, 256, 16)]


def _check(be, ref, op, tensors, params, route=None, exact=()):
    """Run op on the GPU (table route or `route`) and on the reference backend (clones); compare outputs and states."""
    contract = be.contract(op)
    mine = {k: v.clone() for k, v in tensors.items()}
    theirs = {k: v.clone() for k, v in tensors.items()}
    plan = be.plan(op, route=route, **mine, **params)
    plan()
    torch.cuda.synchronize()
    ref.run(op, **theirs, **params)
    preset = be.manifest.tolerances[contract["tolerance"]]
    dims = {k: tuple(v.shape) for k, v in tensors.items()}
    for name in [*contract["outputs"], *contract["states"]]:
        v = compare(mine[name], theirs[name], preset, f"{op}.{name} via {plan.kernel.instance} {dims}")
        assert v, v.detail
        if name in exact:
            assert torch.equal(mine[name], theirs[name]), f"{op}.{name} is not an exact copy"
    return plan.kernel.instance


def _table_ts(op, problem, fallback):
    from ninfer.runtime.cuda import device, gpu_available
    from ninfer.runtime.manifest import Manifest
    if not gpu_available():
        return fallback
    return boundary_ts(Manifest.load().table(device().arch, op, "bf16", problem))


def _instances(op):
    return sorted(k.instance for k in gpu_kernels({op}))


# ---- attn_qk_prep -------------------------------------------------------------------------------------

def qk_prep_inputs(T, NH, NKV, D, gen, max_pos=100_000):
    W = 2 * NH * D + 2 * NKV * D
    r = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=gen) * scale).bfloat16()  # noqa: E731
    nan = lambda *s: torch.full(s, float("nan"), device="cuda").bfloat16()  # noqa: E731
    return dict(qkv=r(T, W, scale=2.0),
                positions=torch.randint(0, max_pos, (T,), device="cuda", dtype=torch.int32, generator=gen),
                q_norm=r(D, scale=0.5), k_norm=r(D, scale=0.5),
                q=nan(T, NH, D), gate=nan(T, NH, D), k=nan(T, NKV, D), v=nan(T, NKV, D))


QK_PROBLEMS = [  # NH, NKV, D, rotary_dim, theta
    (24, 4, 256, 64, 1.0e7), (16, 2, 256, 64, 1.0e7), (4, 2, 64, 16, 1.0e7), (3, 1, 136, 34, 1.0e4),
    (6, 3, 128, 128, 1.0e6), (2, 2, 512, 256, 5.0e5)]


@pytest.mark.parametrize("T", _table_ts("attn_qk_prep", {"NH": 24, "NKV": 4, "D": 256}, [1]) + [7, 64, 1000, 4096])
@pytest.mark.parametrize("problem", QK_PROBLEMS, ids=str)
def test_attn_qk_prep(be, ref, problem, T):
    NH, NKV, D, R, theta = problem
    gen = torch.Generator(device="cuda").manual_seed(T * 31 + D)
    ts = qk_prep_inputs(T, NH, NKV, D, gen, max_pos=100_000 if T < 1000 else 9000)
    _check(be, ref, "attn_qk_prep", ts, dict(theta=theta, rotary_dim=R, eps=1e-6), exact=("gate", "v"))


@pytest.mark.parametrize("route", _instances("attn_qk_prep"))
@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("problem", QK_PROBLEMS, ids=str)
def test_attn_qk_prep_every_route(be, ref, route, problem, T):
    """Every route instance at a count of jobs that does and does not fill its blocks."""
    NH, NKV, D, R, theta = problem
    gen = torch.Generator(device="cuda").manual_seed(T * 17 + D)
    ts = qk_prep_inputs(T, NH, NKV, D, gen)
    assert _check(be, ref, "attn_qk_prep", ts, dict(theta=theta, rotary_dim=R, eps=1e-6), route=route,
                  exact=("gate", "v")) == route


def test_attn_qk_prep_positions_in_order(be, ref):
    """A prefill chunk: positions 5000..6023, as the engine sends them."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    ts = qk_prep_inputs(1024, 24, 4, 256, gen)
    ts["positions"] = torch.arange(5000, 6024, device="cuda", dtype=torch.int32)
    _check(be, ref, "attn_qk_prep", ts, dict(theta=1.0e7, rotary_dim=64, eps=1e-6), exact=("gate", "v"))


# ---- kv_cache_write -----------------------------------------------------------------------------------

@pytest.mark.parametrize("T", _table_ts("kv_cache_write", {"NKV": 4, "D": 256, "BS": 16}, [1]) + [16, 500])
@pytest.mark.parametrize("problem", [(4, 256, 16), (2, 256, 16), (2, 64, 16), (1, 8, 8), (3, 40, 32)], ids=str)
def test_kv_cache_write(be, ref, problem, T):
    NKV, D, BS = problem
    gen = torch.Generator(device="cuda").manual_seed(T + 7 * D)
    NB = (T + BS - 1) // BS + 3
    slots = torch.randperm(NB * BS, device="cuda", generator=gen)[:T].to(torch.int32)
    slots[1::4] = -1   # padding tokens write nothing
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    ts = dict(k=r(T, NKV, D), v=r(T, NKV, D), slot_mapping=slots, k_cache=r(NB, BS, NKV, D), v_cache=r(NB, BS, NKV, D))
    _check(be, ref, "kv_cache_write", ts, {}, exact=("k_cache", "v_cache"))


# ---- paged_attention ----------------------------------------------------------------------------------

def attention_inputs(problem, seqs, gen, shuffle=False):
    """seqs: [(L, n)]: sequence s holds positions 0..L-1 in the cache and queries its n newest (L-n..L-1).
    Pages come from one shuffled pool; unwritten slots and the block tables' pad page hold NaN."""
    NH, NKV, D, BS = problem
    npages = [(L + BS - 1) // BS for L, _ in seqs]
    MB = max(npages) + 1
    NB = sum(npages) + 2
    perm = torch.randperm(NB, device="cuda", generator=gen).cpu()
    pad = int(perm[-1])
    table = torch.full((len(seqs), MB), pad, dtype=torch.int32)
    slots, tok_seq, pos, k = [], [], [], 0
    for s, ((L, n), npg) in enumerate(zip(seqs, npages)):
        table[s, :npg] = perm[k:k + npg].to(torch.int32)
        k += npg
        slots += [int(table[s, p // BS]) * BS + p % BS for p in range(L)]
        tok_seq += [s] * n
        pos += range(L - n, L)
    k_cache = torch.full((NB, BS, NKV, D), float("nan"), device="cuda").bfloat16()
    v_cache = torch.full_like(k_cache, float("nan"))
    idx = torch.tensor(slots, device="cuda", dtype=torch.long)
    k_cache.view(-1, NKV, D)[idx] = torch.randn(len(slots), NKV, D, device="cuda", generator=gen).bfloat16()
    v_cache.view(-1, NKV, D)[idx] = torch.randn(len(slots), NKV, D, device="cuda", generator=gen).bfloat16()
    tok_seq = torch.tensor(tok_seq, dtype=torch.int32)
    pos = torch.tensor(pos, dtype=torch.int32)
    if shuffle:
        p = torch.randperm(len(pos), generator=torch.Generator().manual_seed(len(pos)))
        tok_seq, pos = tok_seq[p], pos[p]
    T = len(pos)
    return dict(q=torch.randn(T, NH, D, device="cuda", generator=gen).bfloat16(), k_cache=k_cache, v_cache=v_cache,
                block_table=table.cuda(), token_seq=tok_seq.cuda(), positions=pos.cuda(),
                o=torch.full((T, NH, D), float("nan"), device="cuda").bfloat16())


def check_attention(be, ref, problem, seqs, seed, route=None, shuffle=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ts = attention_inputs(problem, seqs, gen, shuffle)
    return _check(be, ref, "paged_attention", ts, dict(scale=problem[2] ** -0.5), route=route)


def layouts(T, BS, seed):
    """Three step shapes of T tokens: a decode batch (T sequences, one token each, different lengths),
    a prefill chunk (one sequence, T tokens after a cached prefix), and a mixed batch."""
    import random
    rnd = random.Random(seed)
    longest = 1500 if T <= 16 else 400
    decode = [(rnd.choice([1, BS - 1, BS, BS + 1, 3 * BS, rnd.randint(1, longest)]), 1) for _ in range(T)]
    chunk = [(T + rnd.choice([0, 1, BS - 1, 2 * BS + 3, 700]), T)]
    mixed, left = [], T
    while left:
        n = min(left, rnd.choice([1, 1, 2, 5, 17, 40, 64]))
        mixed.append((n + rnd.randint(0, 300), n))
        left -= n
    return {"decode": decode, "chunk": chunk, "mixed": mixed}


def table_cases(op="paged_attention", problems=ATTN_PROBLEMS):
    cases = []
    for problem in problems:
        NH, NKV, D, BS = problem
        for T in _table_ts(op, {"NH": NH, "NKV": NKV, "D": D, "BS": BS}, [1]):
            for name in ("decode", "chunk", "mixed"):
                if T == 1 and name != "decode":
                    continue
                cases.append((problem, T, name))
    return cases


@pytest.mark.parametrize("problem,T,layout", table_cases(), ids=str)
def test_paged_attention_table(be, ref, problem, T, layout):
    seqs = layouts(T, problem[3], seed=T)[layout]
    assert sum(n for _, n in seqs) == T
    check_attention(be, ref, problem, seqs, seed=T * 13 + problem[2])


ROUTE_SCENARIOS = {
    "decode_1_8k": [(8192, 1)],
    "decode_batch": [(1, 1), (15, 1), (16, 1), (17, 1), (33, 1), (2049, 1), (3000, 1)],
    "verify": [(1200, 4), (517, 4), (64, 4)],
    "prefill_2seq": [(300, 300), (77, 77)],
    "chunk_after_prefix": [(2500, 200)],
    "mixed": [(40, 3), (1000, 1), (129, 60), (5, 5), (2000, 2)],
}


def admitted(op, problems=(REAL_27B, REAL_35B, TINY, PAGE32, PAGE5)):
    """(route instance, problem) for every route instance of op and every problem its constraints admit (e.g.
    the dfix routes: D == 256 only)."""
    from ninfer.runtime.manifest import evaluate
    kernels = {k.instance: k for k in gpu_kernels({op})}
    return [(inst, problem) for inst in sorted(kernels) for problem in problems
            if all(evaluate(c, dict(zip(("NH", "NKV", "D", "BS"), problem), T=1)) for c in kernels[inst].constraints)]


def route_cases():
    return [(inst, problem, name) for inst, problem in admitted("paged_attention") for name in ROUTE_SCENARIOS]


@pytest.mark.parametrize("route,problem,scenario", route_cases(), ids=str)
def test_paged_attention_every_route(be, ref, route, problem, scenario):
    seqs = ROUTE_SCENARIOS[scenario]
    assert check_attention(be, ref, problem, seqs, seed=len(scenario) + problem[0], route=route) == route


@pytest.mark.parametrize("problem", [REAL_27B, REAL_35B, TINY, PAGE32, PAGE5], ids=str)
@pytest.mark.parametrize("seqs", [
    [(16, 1), (17, 1), (32, 1), (33, 1), (1, 1)],                # positions on both sides of page boundaries
    [(4000, 1), (3001, 1), (2048, 2), (4096, 3)],               # contexts of a few thousand tokens
    [(37, 37), (100, 100), (1, 1), (250, 60), (64, 64)],        # several prompts of different lengths in one step
    [(3100, 1024)],                                              # a 1024-token prefill chunk after a 2076-token prefix
], ids=["page_edges", "long", "prompts", "chunk1024"])
def test_paged_attention_scenarios(be, ref, problem, seqs):
    check_attention(be, ref, problem, seqs, seed=sum(n for _, n in seqs))


@pytest.mark.parametrize("T", [3, 20, 150])
def test_paged_attention_tokens_out_of_order(be, ref, T):
    """The contract does not require a sequence's tokens to be contiguous or sorted."""
    seqs = layouts(T, 16, seed=T)["mixed"]
    check_attention(be, ref, REAL_27B, seqs, seed=T, shuffle=True)


def test_paged_attention_bad_head_dim(be):
    q = torch.randn(2, 4, 272, device="cuda").bfloat16()
    kv = torch.randn(3, 16, 2, 272, device="cuda").bfloat16()
    i32 = lambda v: torch.tensor(v, device="cuda", dtype=torch.int32)  # noqa: E731
    with pytest.raises(RouteError, match=r"requires D <= 256, which fails for .*D=272"):
        be.plan("paged_attention", q=q, k_cache=kv, v_cache=kv.clone(), block_table=i32([[0, 1]]),
                token_seq=i32([0, 0]), positions=i32([3, 4]), o=torch.empty_like(q), scale=0.06)


# ---- paged_attention_split + merge_attn_states (flash decoding) ----------------------------------------

def split_cases():
    """Every split route instance on every problem it admits, at split counts from one to more splits than a short
    sequence has chunks (empty splits); the step shapes decode meets (one token or a few per sequence, and the mixed
    batch with its 60-token chunk), not the long prompts (the model splits steps of up to 8 tokens)."""
    return [(inst, problem, name, ks) for inst, problem in admitted("paged_attention_split")
            for name in ("decode_1_8k", "decode_batch", "verify", "mixed") for ks in (1, 7, 64)]


def check_split(be, ref, problem, seqs, ks, seed, route=None, op="paged_attention_split", make=attention_inputs,
                extra=None):
    """op (paged_attention_split, or its _fp8 form with make's caches and extra's scales; route or table) against
    the reference partials: the same empty splits (m = -inf, l = 0, O = 0), m / l / O within attention_bf16
    elsewhere; then merge_attn_states on the GPU partials against the reference attention times sigmoid(gate)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ts = make(problem, seqs, gen)
    o = ts.pop("o")
    T, NH, D = ts["q"].shape
    nan = lambda *s: torch.full(s, float("nan"), device="cuda")  # noqa: E731
    got = dict(part_o=nan(T, NH, ks, D), m=nan(T, NH, ks), l=nan(T, NH, ks))
    want = {k: nan(*v.shape) for k, v in got.items()}
    params = dict(scale=D ** -0.5, **(extra or {}))
    plan = be.plan(op, route=route, **{k: v.clone() for k, v in ts.items()}, **got, **params)
    plan()
    torch.cuda.synchronize()
    ref.run(op, **{k: v.clone() for k, v in ts.items()}, **want, **params)
    what = f"via {plan.kernel.instance} KS={ks} seqs={seqs} {extra or ''}"
    empty = want["m"] == float("-inf")
    assert torch.equal(got["m"] == float("-inf"), empty), f"empty splits differ {what}"
    assert not got["l"][empty].any() and not got["part_o"][empty].any(), f"an empty split has l or O != 0 {what}"
    preset = be.manifest.tolerances["attention_bf16"]
    for name in ("m", "l", "part_o"):
        v = compare(got[name][~empty], want[name][~empty], preset, f"{op}.{name} {what}")
        assert v, v.detail
    gate = torch.randn(T, NH, D, device="cuda", generator=gen).bfloat16()
    be.run("merge_attn_states", **got, gate=gate, o=o)
    torch.cuda.synchronize()
    attn = torch.empty_like(o)
    full = "paged_attention" if op == "paged_attention_verify" else op.replace("_split", "")
    ref.run(full, **ts, o=attn, **{k: v for k, v in params.items() if k != "L"})
    expect = (attn.float() * torch.sigmoid(gate.float())).bfloat16()
    assert (v := compare(o, expect, preset, f"split + merge {what}")), v.detail
    return plan.kernel.instance


@pytest.mark.parametrize("route,problem,scenario,ks", split_cases(), ids=str)
def test_paged_attention_split_every_route(be, ref, route, problem, scenario, ks):
    seqs = ROUTE_SCENARIOS[scenario]
    assert check_split(be, ref, problem, seqs, ks, seed=len(scenario) + ks, route=route) == route


def verify_lanes(L):
    """Lanes of L tokens (a verify step of K = L - 1 drafts): long contexts, a lane across the 32-key chunk boundary
    (its earlier tokens see one chunk fewer than the lane's cut), one just past a chunk start, one from position 0."""
    return [(1200, L), (517, L), (33, L), (17, L), (L, L)]


@pytest.mark.parametrize("route,problem", admitted("paged_attention_verify"), ids=str)
@pytest.mark.parametrize("L", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("ks", [1, 7, 64])
def test_paged_attention_verify_every_route(be, ref, route, problem, L, ks):
    """Each route on lanes of L tokens (R = min(L, 16 // G) of them a block: 27B 2, TINY 8, odd L leave a block one
    token), split counts from one to more splits than a lane has chunks: partials against the reference's (the
    lane's cut, each token's own keys), merged against paged_attention."""
    assert check_split(be, ref, problem, verify_lanes(L), ks, seed=L * 100 + ks, route=route,
                       op="paged_attention_verify", extra={"L": L}) == route


@pytest.mark.parametrize("problem", [REAL_27B, REAL_35B], ids=str)
@pytest.mark.parametrize("L", [2, 4])
def test_paged_attention_verify_table(be, ref, problem, L):
    """The table's choice for verify steps of 1..8 lanes of L tokens at the split counts the model uses."""
    from ninfer.runtime.models.blocks import attn_splits
    r = min(L, 16 // (problem[0] // problem[1]))
    for lanes in (1, 3, 8):
        check_split(be, ref, problem, [(2000 + 37 * i, L) for i in range(lanes)],
                    attn_splits(lanes * -(-L // r), problem[1]), seed=lanes, op="paged_attention_verify", extra={"L": L})


@pytest.mark.parametrize("problem", ATTN_PROBLEMS, ids=str)
def test_paged_attention_split_table(be, ref, problem):
    """The table's choice at the split counts the model uses (blocks.attn_splits) for decode batches of 1..8."""
    from ninfer.runtime.models.blocks import attn_splits
    for T in (1, 2, 3, 8):
        seqs = layouts(T, problem[3], seed=T)["decode"]
        check_split(be, ref, problem, seqs, attn_splits(T, problem[1]), seed=T)


def test_merge_attn_states(be, ref):
    """Every route (and the table's) on random partials (some splits empty, one per row at least), with the output
    gate: D 256 and 64, from one split to more splits than a block has threads."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for T, NH, ks, D in ((1, 16, 64, 256), (3, 24, 7, 256), (8, 4, 1, 64), (2, 6, 33, 64), (1, 2, 200, 256)):
        m = torch.randn(T, NH, ks, device="cuda", generator=gen) * 8
        empty = torch.rand(T, NH, ks, device="cuda", generator=gen) < 0.3
        empty[..., 0] = False
        m[empty] = float("-inf")
        l = torch.where(empty, 0.0, 1 + torch.rand(T, NH, ks, device="cuda", generator=gen) * 20)
        part_o = torch.where(empty[..., None], 0.0, torch.randn(T, NH, ks, D, device="cuda", generator=gen))
        ts = dict(part_o=part_o, m=m, l=l, gate=torch.randn(T, NH, D, device="cuda", generator=gen).bfloat16(),
                  o=torch.full((T, NH, D), float("nan"), device="cuda").bfloat16())
        for inst in [None, *_instances("merge_attn_states")]:
            got = _check(be, ref, "merge_attn_states", ts, {}, route=inst)
            assert inst is None or got == inst


# ---- the GatedAttention chain, eager and CUDA-graph replayed ------------------------------------------

def test_gated_attention_chain_and_graph_replay(be, ref):
    """attn_qk_prep -> kv_cache_write -> paged_attention for a prefill then decode steps (27B shape),
    against the reference chain; then the decode step captured in a CUDA graph and replayed."""
    NH, NKV, D, BS, R = 24, 4, 256, 16, 64
    gen = torch.Generator(device="cuda").manual_seed(11)
    NB, MB = 40, 20
    kc0 = torch.randn(NB, BS, NKV, D, device="cuda", generator=gen).bfloat16()
    vc0 = torch.randn(NB, BS, NKV, D, device="cuda", generator=gen).bfloat16()
    caches = {"gpu": (kc0, vc0), "ref": (kc0.clone(), vc0.clone())}
    table = torch.randperm(NB, device="cuda", generator=gen)[:2 * MB].to(torch.int32).view(2, MB)
    qn, kn = (torch.randn(D, device="cuda", generator=gen) * 0.3).bfloat16(), (torch.randn(D, device="cuda", generator=gen) * 0.3).bfloat16()
    params = dict(theta=1.0e7, rotary_dim=R, eps=1e-6)

    def step(backend, which, qkv, positions, token_seq):
        T = qkv.shape[0]
        slot = table.long()[token_seq.long(), positions.long() // BS] * BS + positions.long() % BS
        q, gate = (torch.empty(T, NH, D, device="cuda").bfloat16() for _ in range(2))
        k, v = (torch.empty(T, NKV, D, device="cuda").bfloat16() for _ in range(2))
        backend.run("attn_qk_prep", qkv=qkv, positions=positions, q_norm=qn, k_norm=kn, q=q, gate=gate, k=k, v=v, **params)
        backend.run("kv_cache_write", k=k, v=v, slot_mapping=slot.to(torch.int32), k_cache=caches[which][0], v_cache=caches[which][1])
        o = torch.empty_like(q)
        backend.run("paged_attention", q=q, k_cache=caches[which][0], v_cache=caches[which][1], block_table=table,
                    token_seq=token_seq, positions=positions, o=o, scale=D ** -0.5)
        return o

    W = 2 * NH * D + 2 * NKV * D
    i32 = lambda v: torch.tensor(v, device="cuda", dtype=torch.int32)  # noqa: E731
    preset = be.manifest.tolerances["attention_bf16"]
    # prefill: sequence 0 with 150 tokens, sequence 1 with 37
    lens = [150, 37]
    qkv = torch.randn(sum(lens), W, device="cuda", generator=gen).bfloat16()
    positions, token_seq = i32(list(range(150)) + list(range(37))), i32([0] * 150 + [1] * 37)
    a, b = step(be, "gpu", qkv, positions, token_seq), step(ref, "ref", qkv.clone(), positions, token_seq)
    assert (v := compare(a, b, preset, "prefill o")), v.detail
    for _ in range(3):   # decode steps, both sequences
        qkv = torch.randn(2, W, device="cuda", generator=gen).bfloat16()
        positions, token_seq = i32(lens), i32([0, 1])
        a, b = step(be, "gpu", qkv, positions, token_seq), step(ref, "ref", qkv.clone(), positions, token_seq)
        assert (v := compare(a, b, preset, f"decode o at {lens}")), v.detail
        lens = [n + 1 for n in lens]

    # the decode step as a CUDA graph of the three plans, replayed at a later position
    T = 2
    qkv = torch.empty(T, W, device="cuda").bfloat16()
    positions, token_seq = i32(lens), i32([0, 1])
    slot = torch.empty(T, device="cuda", dtype=torch.int32)
    q, gate = (torch.empty(T, NH, D, device="cuda").bfloat16() for _ in range(2))
    k, v = (torch.empty(T, NKV, D, device="cuda").bfloat16() for _ in range(2))
    o = torch.empty_like(q)
    kc, vc = caches["gpu"]
    plans = [be.plan("attn_qk_prep", qkv=qkv, positions=positions, q_norm=qn, k_norm=kn, q=q, gate=gate, k=k, v=v, **params),
             be.plan("kv_cache_write", k=k, v=v, slot_mapping=slot, k_cache=kc, v_cache=vc),
             be.plan("paged_attention", q=q, k_cache=kc, v_cache=vc, block_table=table, token_seq=token_seq,
                     positions=positions, o=o, scale=D ** -0.5)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        qkv.copy_(torch.randn(T, W, device="cuda", generator=gen).bfloat16())
        slot.copy_((table.long()[[0, 1], positions.long() // BS] * BS + positions.long() % BS).to(torch.int32))
        for p in plans:   # warm-up (writes the cache at these positions, as the replay will)
            p()
        with torch.cuda.graph(graph, stream=s):
            for p in plans:
                p()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        new = torch.randn(T, W, device="cuda", generator=gen).bfloat16()
        qkv.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        replayed = o.clone()
        expect = step(ref, "ref", new.clone(), positions, token_seq)
        assert (v := compare(replayed, expect, preset, "graph replay o")), v.detail
        positions.add_(1)
        slot.copy_((table.long()[[0, 1], positions.long() // BS] * BS + positions.long() % BS).to(torch.int32))
