"""The FP8 (E4M3) KV cache's kernels on the GPU (kv_cache_write_fp8, paged_attention_fp8,
paged_attention_split_fp8) against the reference backend on cloned GPU tensors, with each contract's named
tolerance (the write: bit-exact codes).

The caches of the attention cases are the bf16 cases of test_attention_gpu turned into codes by the reference
writer, and the same trap: every slot no sequence has written, and the block tables' pad page, hold the E4M3 NaN
code, so a kernel that reads a key beyond a token's position fails. Skips cleanly without a GPU."""
import pytest
import torch

from ninfer.runtime.reference import fp8_kv_codes
from ninfer.runtime.tolerance import compare
from tests.gpu.test_attention_gpu import (PAGE5, PAGE32, REAL_27B, REAL_35B, ROUTE_SCENARIOS, TINY, _check, admitted,
                                          attention_inputs, check_split, layouts, table_cases)

pytestmark = pytest.mark.gpu

NAN_CODE = 0x7F   # E4M3 NaN
# (k_scale, v_scale): the default, and scales that are not powers of two
SCALES = [(1.0, 1.0), (0.37, 2.5)]
FP8_PROBLEMS = [REAL_27B, REAL_35B, TINY, PAGE32, (12, 3, 128, 8), PAGE5]   # the routes take D == their dmax


# ---- kv_cache_write_fp8 -------------------------------------------------------------------------------

@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("T", [1, 2, 16, 17, 500])
@pytest.mark.parametrize("problem", [(4, 256, 16), (2, 256, 16), (2, 64, 16), (1, 16, 8), (3, 48, 32)], ids=str)
def test_kv_cache_write_fp8(be, ref, problem, T, scales):
    """Codes bit-exact with the reference: values spread from E4M3's subnormals to past its 448 (saturation)."""
    NKV, D, BS = problem
    gen = torch.Generator(device="cuda").manual_seed(T + 7 * D)
    NB = (T + BS - 1) // BS + 3
    slots = torch.randperm(NB * BS, device="cuda", generator=gen)[:T].to(torch.int32)
    slots[1::4] = -1   # padding tokens write nothing
    mag = lambda *s: torch.exp2(torch.rand(*s, device="cuda", generator=gen) * 24 - 12)  # noqa: E731  2^-12 .. 2^12
    r = lambda *s: (torch.randn(*s, device="cuda", generator=gen).sign() * mag(*s)).bfloat16()  # noqa: E731
    codes = lambda: torch.randint(0, 256, (NB, BS, NKV, D), device="cuda", dtype=torch.uint8, generator=gen)  # noqa: E731
    ts = dict(k=r(T, NKV, D), v=r(T, NKV, D), slot_mapping=slots, k_cache=codes(), v_cache=codes())
    ks, vs = scales
    _check(be, ref, "kv_cache_write_fp8", ts, dict(k_scale=ks, v_scale=vs), exact=("k_cache", "v_cache"))


# ---- paged_attention_fp8 ------------------------------------------------------------------------------

def fp8_inputs(problem, seqs, gen, scales):
    """attention_inputs with its caches as codes (k / k_scale, v / v_scale); NaN stays the NaN code."""
    ts = attention_inputs(problem, seqs, gen)
    for name, scale, v in (("k_cache", scales[0], False), ("v_cache", scales[1], True)):
        c = ts[name]
        codes = fp8_kv_codes(torch.nan_to_num(c.float()) * scale, scale, v)   # the values times scale: codes ~N(0, 1)
        codes[c.isnan()] = NAN_CODE
        ts[name] = codes
    return ts


def check_fp8(be, ref, problem, seqs, seed, scales=(1.0, 1.0), route=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ts = fp8_inputs(problem, seqs, gen, scales)
    return _check(be, ref, "paged_attention_fp8", ts,
                  dict(scale=problem[2] ** -0.5, k_scale=scales[0], v_scale=scales[1]), route=route)


@pytest.mark.parametrize("problem,T,layout", table_cases("paged_attention_fp8", (REAL_27B, REAL_35B, TINY)), ids=str)
def test_paged_attention_fp8_table(be, ref, problem, T, layout):
    seqs = layouts(T, problem[3], seed=T)[layout]
    check_fp8(be, ref, problem, seqs, seed=T * 13 + problem[2], scales=SCALES[T % 2])


@pytest.mark.parametrize("route,problem,scenario", [(i, p, s) for i, p in admitted("paged_attention_fp8", FP8_PROBLEMS)
                                                    for s in ROUTE_SCENARIOS], ids=str)
def test_paged_attention_fp8_every_route(be, ref, route, problem, scenario):
    seqs = ROUTE_SCENARIOS[scenario]
    assert check_fp8(be, ref, problem, seqs, seed=len(scenario) + problem[0], scales=SCALES[len(scenario) % 2],
                     route=route) == route


def test_paged_attention_fp8_long_chunk(be, ref):
    """A 1024-token prefill chunk after a 2076-token prefix, and four prompts in one step (27B shape)."""
    check_fp8(be, ref, REAL_27B, [(3100, 1024)], seed=3)
    check_fp8(be, ref, REAL_27B, [(37, 37), (100, 100), (1, 1), (250, 60)], seed=4, scales=SCALES[1])


# ---- paged_attention_split_fp8 + merge_attn_states ----------------------------------------------------

def check_split_fp8(be, ref, problem, seqs, ks, seed, scales, route=None):
    return check_split(be, ref, problem, seqs, ks, seed, route, op="paged_attention_split_fp8",
                       make=lambda p, s, g: fp8_inputs(p, s, g, scales), extra=dict(k_scale=scales[0], v_scale=scales[1]))


@pytest.mark.parametrize("route,problem,scenario,ks", [
    (i, p, s, ks) for i, p in admitted("paged_attention_split_fp8", FP8_PROBLEMS)
    for s in ("decode_1_8k", "decode_batch", "verify", "mixed") for ks in (1, 7, 64)], ids=str)
def test_paged_attention_split_fp8_every_route(be, ref, route, problem, scenario, ks):
    seqs = ROUTE_SCENARIOS[scenario]
    assert check_split_fp8(be, ref, problem, seqs, ks, seed=len(scenario) + ks, scales=SCALES[ks % 2],
                           route=route) == route


@pytest.mark.parametrize("problem", [REAL_27B, REAL_35B, TINY], ids=str)
def test_paged_attention_split_fp8_table(be, ref, problem):
    """The table's choice at the split counts the model uses for decode batches of 1..8."""
    from ninfer.runtime.models.blocks import attn_splits
    for T in (1, 2, 3, 7, 8):
        seqs = layouts(T, problem[3], seed=T)["decode"]
        check_split_fp8(be, ref, problem, seqs, attn_splits(T, problem[1]), seed=T, scales=SCALES[T % 2])


def test_fp8_chain_write_then_attend(be, ref):
    """kv_cache_write_fp8 then paged_attention_fp8 over what it wrote (27B shape, a prefill then a decode step),
    GPU chain against the reference chain: the writer's layout is the readers' layout."""
    NH, NKV, D, BS = REAL_27B
    gen = torch.Generator(device="cuda").manual_seed(21)
    NB, MB = 40, 20
    caches = {w: [torch.full((NB, BS, NKV, D), NAN_CODE, device="cuda", dtype=torch.uint8) for _ in range(2)]
              for w in ("gpu", "ref")}
    table = torch.randperm(NB, device="cuda", generator=gen)[:2 * MB].to(torch.int32).view(2, MB)
    i32 = lambda v: torch.tensor(v, device="cuda", dtype=torch.int32)  # noqa: E731
    preset = be.manifest.tolerances["attention_bf16"]
    params = dict(k_scale=0.5, v_scale=1.5)

    def step(backend, which, positions, token_seq, q, k, v):
        slot = (table.long()[token_seq.long(), positions.long() // BS] * BS + positions.long() % BS).to(torch.int32)
        kc, vc = caches[which]
        backend.run("kv_cache_write_fp8", k=k, v=v, slot_mapping=slot, k_cache=kc, v_cache=vc, **params)
        o = torch.empty_like(q)
        backend.run("paged_attention_fp8", q=q, k_cache=kc, v_cache=vc, block_table=table, token_seq=token_seq,
                    positions=positions, o=o, scale=D ** -0.5, **params)
        return o

    r = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    for positions, token_seq in ((i32(list(range(150)) + list(range(37))), i32([0] * 150 + [1] * 37)),
                                 (i32([150, 37]), i32([0, 1]))):
        T = len(positions)
        q, k, v = r(T, NH, D), r(T, NKV, D), r(T, NKV, D)
        a = step(be, "gpu", positions, token_seq, q, k, v)
        b = step(ref, "ref", positions, token_seq, q.clone(), k.clone(), v.clone())
        assert (res := compare(a, b, preset, f"fp8 chain o at T={T}")), res.detail
        assert all(torch.equal(x, y) for x, y in zip(caches["gpu"], caches["ref"])), "the written codes differ"
