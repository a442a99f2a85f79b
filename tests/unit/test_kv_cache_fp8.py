"""The FP8 (E4M3) KV cache on the reference backend: the codes' layout and rounding (the contract the kernels of
tests/gpu/test_attention_fp8_gpu.py are held to), and the engine with kv_cache_dtype fp8 against the same engine
with the model-dtype cache."""
import pytest
import torch

from ninfer.runtime import reference as R
from ninfer.runtime.engine import Engine, EngineError


def test_positions_are_the_contracts_permutation():
    """kperm / vperm of specs/ops/kv_cache_write_fp8.yaml, block by block."""
    for v, perm in ((False, lambda i: 4 * ((i % 8) // 2) + 2 * (i // 8) + i % 2), (True, lambda i: 2 * (i % 8) + i // 8)):
        pos = R.fp8_kv_positions(48, v)
        assert sorted(pos.tolist()) == list(range(48))
        assert pos.tolist() == [16 * (d // 16) + perm(d % 16) for d in range(48)]


def test_codes_round_to_nearest_and_saturate():
    x = torch.tensor([[0.0, 1.0, -1.0, 1.0625, 1.1875, 448.0, 460.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -11, 3.0,
                       -0.3, 100.0, 0.017, 7.5]])
    codes = R.fp8_kv_codes(x, 1.0, v=False)
    back = R.fp8_kv_values(codes, 1.0, v=False)
    # 1.0625 is halfway between 1 and 1.125: to even (1.0); 1.1875 halfway between 1.125 and 1.25: to even (1.25)
    assert back[0, :11].tolist() == [0.0, 1.0, -1.0, 1.0, 1.25, 448.0, 448.0, 448.0, -448.0, 2.0 ** -9, 0.0]
    assert not back.isnan().any()
    assert torch.equal(back, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())   # to the nearest E4M3 value
    scaled = R.fp8_kv_values(R.fp8_kv_codes(x, 0.25, v=True), 0.25, v=True)
    assert torch.equal(scaled, (x / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.25)


def test_write_then_attend_reads_back_what_was_written():
    """kv_cache_write_fp8 then paged_attention_fp8 equals paged_attention over the rounded K and V."""
    gen = torch.Generator().manual_seed(0)
    T, NH, NKV, D, BS = 20, 4, 2, 32, 8
    k, v, q = torch.randn(T, NKV, D, generator=gen), torch.randn(T, NKV, D, generator=gen), torch.randn(T, NH, D, generator=gen)
    caches = [torch.full((4, BS, NKV, D), 0x7F, dtype=torch.uint8) for _ in range(2)]
    slots = torch.tensor([(p // BS) * BS + p % BS for p in range(T)], dtype=torch.int32)
    out = R.kv_cache_write_fp8(k, v, slots, *caches, k_scale=0.5, v_scale=2.0)
    table, seq, pos = torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.zeros(T, dtype=torch.int32), torch.arange(T)
    got = R.paged_attention_fp8(q, out["k_cache"], out["v_cache"], table, seq, pos, 0.2, k_scale=0.5, v_scale=2.0)["o"]
    kr = (k / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    vr = (v / 2.0).to(torch.float8_e4m3fn).float() * 2.0
    kc, vc = torch.zeros(4, BS, NKV, D), torch.zeros(4, BS, NKV, D)
    kc.view(-1, NKV, D)[:T], vc.view(-1, NKV, D)[:T] = kr, vr
    want = R.paged_attention(q, kc, vc, table, seq, pos, 0.2)["o"]
    assert torch.allclose(got, want, atol=1e-6)


@pytest.fixture(scope="module")
def engines(demo_artifact):
    pair = {d: Engine(demo_artifact, backend="reference", max_context=96, max_seqs=2, prefill_chunk=16,
                      kv_cache_dtype=d) for d in ("auto", "fp8")}
    yield pair
    for e in pair.values():
        e.close()


def test_engine_with_the_fp8_cache_follows_the_model_dtype_cache(engines):
    """Logits of a 40-token prompt in three prefill chunks and of four decode steps: within 3 % (relative L2) of the
    fp32 cache's (E4M3 keeps 3 mantissa bits: each K and V element rounds by up to 2^-4 of itself, ~1.8 % rms; the
    demo model measured 1.4 %); the cache holds codes (uint8), and lanes and pages go back to the pool."""
    assert engines["fp8"].kv_cache_dtype == "fp8_e4m3" and engines["auto"].kv_cache_dtype == "auto"
    kc, _ = next(iter(engines["fp8"].cache.kv.values()))
    assert kc.dtype == torch.uint8
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(40)]
    logits = {}
    for name, eng in engines.items():
        seq = eng.open(prompt, max_new=8)
        try:
            rows = [eng._step([seq], [(a, min(a + 16, 40))]) for a in range(0, 40, 16)]
            for t in (101, 202, 303, 404):
                seq.tokens.append(t)
                rows.append(eng._step([seq], [(len(seq.tokens) - 1, len(seq.tokens))]))
            logits[name] = torch.cat(rows)
        finally:
            eng.release(seq)
        assert eng.cache.in_use == (0, 0)
    assert kc.any(), "nothing was written to the fp8 cache"
    a, b = logits["fp8"], logits["auto"]
    assert not torch.equal(a, b)   # the codes do round
    assert (a - b).norm() / b.norm() < 0.03, float((a - b).norm() / b.norm())


def test_unknown_kv_cache_dtype_is_refused(demo_artifact):
    with pytest.raises(EngineError, match=r"kv_cache_dtype 'fp16' is not one of auto, fp8, fp8_e4m3"):
        Engine(demo_artifact, backend="reference", max_context=32, max_seqs=1, kv_cache_dtype="fp16")
