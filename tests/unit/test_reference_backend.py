"""The reference backend runs every op through the same dispatch interface (CPU, CI)."""
import pytest
import torch

from ninfer.runtime.contracts import ContractError
from ninfer.runtime.dispatch import ReferenceBackend, backend
from ninfer.runtime.tolerance import compare
from tests.ops_cases import PROBLEMS, make_inputs, oracle


@pytest.fixture(scope="module")
def be():
    return ReferenceBackend()


@pytest.mark.parametrize("op", sorted(PROBLEMS))
@pytest.mark.parametrize("T", [1, 7, 33])
def test_op_matches_fp64_oracle(be, op, T):
    contract = be.contract(op)
    gen = torch.Generator().manual_seed(hash((op, T)) % 2**31)
    dims = {"T": T, **PROBLEMS[op][0]}
    ts = make_inputs(contract, dims, "cpu", gen)
    params = {k: v["default"] for k, v in contract["params"].items()}
    be.run(op, **ts)
    ref = oracle(op, contract, ts, params)
    preset = be.manifest.tolerances[contract["tolerance"]]
    for name in contract["outputs"]:
        v = compare(ts[name], ref[name], preset, f"{op} T={T} {name}")
        assert v, v.detail


def test_embedding_out_of_range_ids_give_zero_rows(be):
    table = torch.randn(10, 16).bfloat16()
    ids = torch.tensor([3, -1, 10, 9], dtype=torch.int32)
    y = torch.full((4, 16), float("nan")).bfloat16()
    be.run("embedding", ids=ids, table=table, y=y)
    assert torch.equal(y[0], table[3]) and torch.equal(y[3], table[9])
    assert (y[1] == 0).all() and (y[2] == 0).all()


def test_inplace_alias_allowed_only_where_declared(be):
    a, b = torch.randn(4, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    expect = (a.float() + b.float()).bfloat16()
    be.run("add", a=a, b=b, y=a)
    assert torch.equal(a, expect)
    with pytest.raises(ContractError, match="add: y shares memory with b, which the contract does not allow"):
        be.run("add", a=a, b=b, y=b)


@pytest.mark.parametrize("args,message", [
    (dict(x=torch.randn(4, 16).bfloat16(), w=torch.randn(8, 16).bfloat16(), y=torch.empty(4, 9).bfloat16()),
     "linear: argument y axis 1 gives N=9, but an earlier argument gave N=8 (shape ['T', 'N'])"),
    (dict(x=torch.randn(4, 16).bfloat16(), w=torch.randn(8, 16), y=torch.empty(4, 8).bfloat16()),
     "linear: argument w has dtype torch.float32, expected torch.bfloat16"),
    (dict(x=torch.randn(4, 16).bfloat16(), w=torch.randn(8, 16).bfloat16()),
     "linear: missing tensor(s) ['y'], unexpected -"),
    (dict(x=torch.randn(4, 16).bfloat16(), w=torch.randn(8, 16, 1).bfloat16(), y=torch.empty(4, 8).bfloat16()),
     "linear: argument w has shape (8, 16, 1), expected rank 2 ['N', 'K']"),
    (dict(x=torch.randn(16, 4).bfloat16().T, w=torch.randn(8, 16).bfloat16(), y=torch.empty(4, 8).bfloat16()),
     "linear: argument x must be contiguous"),
    (dict(x=torch.randn(0, 16).bfloat16(), w=torch.randn(8, 16).bfloat16(), y=torch.empty(0, 8).bfloat16()),
     "linear: T (tokens) must be >= 1, got 0"),
])
def test_mismatched_calls_name_the_argument(be, args, message):
    with pytest.raises(ContractError) as e:
        be.run("linear", **args)
    assert message in str(e.value)


def test_silu_and_mul_odd_width_is_refused(be):
    with pytest.raises(ContractError, match=r"silu_and_mul: argument x axis 1 is 9, expected a multiple of 2 \(2\*I\)"):
        be.run("silu_and_mul", x=torch.randn(2, 9).bfloat16(), y=torch.empty(2, 4).bfloat16())


def test_unknown_op_and_param(be):
    with pytest.raises(ContractError, match="unknown op 'gelu'"):
        be.run("gelu", x=torch.randn(2, 8))
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16()
    with pytest.raises(ContractError, match=r"rms_norm: unknown param\(s\) epsilon \(allowed: eps\)"):
        be.run("rms_norm", x=x, w=w, y=torch.empty_like(x), epsilon=1e-5)


def test_auto_backend_is_reference_without_gpu():
    from ninfer.runtime.cuda import gpu_available
    assert backend("auto").name == ("cuda" if gpu_available() else "reference")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        backend("tpu")


def test_moe_router_logits_are_fp32_and_moe_topk_reads_them(be):
    """The router logits are accumulated and stored in fp32 (a bf16 rounding flips near-tie top-k choices)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 72, generator=g).bfloat16(), (torch.randn(10, 72, generator=g) * 72 ** -0.5).bfloat16()
    logits = torch.full((5, 10), float("nan"))
    be.run("moe_router", x=x, w=w, logits=logits)
    v = compare(logits, x.double() @ w.double().T, be.manifest.tolerances[be.contract("moe_router")["tolerance"]])
    assert v, v.detail
    assert (logits != logits.bfloat16().float()).all()
    weights, ids = torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int32)
    be.run("moe_topk", logits=logits, weights=weights, ids=ids)
    assert torch.equal(ids, logits.topk(2, dim=-1).indices.int())
    with pytest.raises(ContractError, match="moe_topk: argument logits has dtype torch.bfloat16, expected torch.float32"):
        be.run("moe_topk", logits=logits.bfloat16(), weights=weights, ids=ids)


def test_sigmoid_gate_add_rms_norm_zc_is_the_gate_add_then_the_add_norm(be):
    """The fused op writes what sigmoid_gate_add then add_rms_norm_zc write (fp32: exactly), s in place of a."""
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(3, 64, generator=g) for _ in range(3))
    gate, w = torch.randn(3, 1, generator=g), torch.randn(64, generator=g) * 0.1
    m, s, y = b.clone(), a.clone(), torch.empty(3, 64)
    be.run("sigmoid_gate_add", a=m, b=c, g=gate, y=m)
    be.run("add_rms_norm_zc", a=s, b=m, w=w, s=s, y=y)
    s2, y2 = a.clone(), torch.empty(3, 64)
    be.run("sigmoid_gate_add_rms_norm_zc", a=s2, b=b, c=c, g=gate, w=w, s=s2, y=y2)
    assert torch.equal(s2, s) and torch.equal(y2, y)


@pytest.mark.parametrize("fmt", ["q4", "q6", "fp8"])
def test_moe_split_halves_compose_to_moe_experts(be, fmt):
    """moe_gate_up_<fmt> then moe_down_<fmt> (the decode form) computes moe_experts_<fmt>; a slot whose id is
    outside [0, E) gets h = 0 and adds nothing (as a valid slot of weight 0 would)."""
    import numpy as np

    from ninfer.runtime import formats
    T, H, E, I, K = 5, 72, 6, 40, 3
    rng = np.random.default_rng(11)
    gate_up = torch.from_numpy(formats.encode(fmt, rng.standard_normal((E * 2 * I, H), dtype=np.float32) * 0.1))
    down = torch.from_numpy(formats.encode(fmt, rng.standard_normal((E * H, I), dtype=np.float32) * 0.1))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(T)]).int()
    weights = torch.softmax(torch.randn(T, K, generator=torch.Generator().manual_seed(2)), -1)
    h = torch.full((T, K, I), float("nan"))
    y = torch.full((T, H), float("nan"))
    be.run(f"moe_gate_up_{fmt}", x=x, gate_up=gate_up, ids=ids, h=h, E=E)
    be.run(f"moe_down_{fmt}", h=h, down=down, weights=weights, ids=ids, y=y, E=E)
    want = torch.full((T, H), float("nan"))
    be.run(f"moe_experts_{fmt}", x=x, gate_up=gate_up, down=down, weights=weights, ids=ids, y=want, E=E, I=I)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)

    bad = ids.clone()
    bad[1, 2], bad[3, 0] = -1, E
    be.run(f"moe_gate_up_{fmt}", x=x, gate_up=gate_up, ids=bad, h=h, E=E)
    be.run(f"moe_down_{fmt}", h=h, down=down, weights=weights, ids=bad, y=y, E=E)
    assert (h[1, 2] == 0).all() and (h[3, 0] == 0).all()
    zeroed = weights.clone()
    zeroed[1, 2] = zeroed[3, 0] = 0
    be.run(f"moe_experts_{fmt}", x=x, gate_up=gate_up, down=down, weights=zeroed, ids=ids, y=want, E=E, I=I)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)


def test_moe_align_lists_the_pairs_by_expert_in_token_order(be):
    """order: the pairs t*K + k, expert by expert, each expert's in index order, ids outside [0, E) last;
    offsets[e]: the end of expert e's pairs (checked against a plain Python loop)."""
    E = 5
    ids = torch.tensor([[3, 0, 7], [0, 3, -1], [4, 0, 1], [1, 3, 5]], dtype=torch.int32)
    order, offsets = torch.empty_like(ids), torch.empty(E, dtype=torch.int32)
    be.run("moe_align", ids=ids, order=order, offsets=offsets)
    flat = ids.flatten().tolist()
    want = [p for e in range(E) for p, i in enumerate(flat) if i == e] + [p for p, i in enumerate(flat) if not 0 <= i < E]
    assert order.flatten().tolist() == want
    assert offsets.tolist() == [sum(1 for i in flat if 0 <= i <= e) for e in range(E)]


@pytest.mark.parametrize("fmt", ["q4", "w8"])
def test_moe_grouped_form_computes_moe_experts(be, fmt):
    """moe_align, moe_gate_up_grouped_<fmt>, moe_down_grouped_<fmt> and moe_sum (the prefill form) compute
    moe_experts_<fmt>; the pairs of ids outside [0, E) get h = 0 and ys = 0."""
    import numpy as np

    from ninfer.runtime import formats
    T, H, E, I, K = 6, 64, 5, 32, 2
    rng = np.random.default_rng(5)
    gate_up = torch.from_numpy(formats.encode(fmt, rng.standard_normal((E * 2 * I, H), dtype=np.float32) * 0.1))
    down = torch.from_numpy(formats.encode(fmt, rng.standard_normal((E * H, I), dtype=np.float32) * 0.1))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(10 + t))[:K] for t in range(T)]).int()
    weights = torch.softmax(torch.randn(T, K, generator=torch.Generator().manual_seed(4)), -1)
    ids[2, 1], ids[4, 0] = -1, E
    order, offsets = torch.empty_like(ids), torch.empty(E, dtype=torch.int32)
    be.run("moe_align", ids=ids, order=order, offsets=offsets)
    h = torch.full((T, K, I), float("nan"))
    be.run(f"moe_gate_up_grouped_{fmt}", x=x, gate_up=gate_up, order=order, offsets=offsets, h=h)
    ys = torch.full((T, K, H), float("nan"))
    be.run(f"moe_down_grouped_{fmt}", h=h, down=down, weights=weights, order=order, offsets=offsets, ys=ys)
    y = torch.full((T, H), float("nan"))
    be.run("moe_sum", ys=ys, y=y)
    assert (h[2, 1] == 0).all() and (h[4, 0] == 0).all() and (ys[2, 1] == 0).all() and (ys[4, 0] == 0).all()
    zeroed, valid = weights.clone(), ids.clamp(0, E - 1)
    zeroed[2, 1] = zeroed[4, 0] = 0
    want = torch.full((T, H), float("nan"))
    be.run(f"moe_experts_{fmt}", x=x, gate_up=gate_up, down=down, weights=zeroed, ids=valid, y=want, E=E, I=I)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)


def test_moe_form_thresholds_read_from_the_environment(monkeypatch):
    from ninfer.runtime.models.blocks import _env_tokens
    monkeypatch.delenv("NINFER_TEST_TOKENS", raising=False)
    assert _env_tokens("NINFER_TEST_TOKENS", 64) == 64
    for value, want in [("off", None), ("0", 0), ("17", 17)]:
        monkeypatch.setenv("NINFER_TEST_TOKENS", value)
        assert _env_tokens("NINFER_TEST_TOKENS", 64) == want
    monkeypatch.setenv("NINFER_TEST_TOKENS", "-1")
    with pytest.raises(ValueError, match=r"NINFER_TEST_TOKENS='-1': expected a token count"):
        _env_tokens("NINFER_TEST_TOKENS", 64)


@pytest.mark.parametrize("ks", [1, 3, 16])
def test_split_attention_and_merge_compose_to_gated_paged_attention(be, ks):
    """paged_attention_split's partials, combined by merge_attn_states, are paged_attention times sigmoid(gate); a split
    without keys (a 20-key sequence has 2 chunks) holds m = -inf, l = 0, O = 0."""
    g = torch.Generator().manual_seed(ks)
    nh, nkv, d, bs = 6, 2, 32, 16
    kc, vc = torch.randn(12, bs, nkv, d, generator=g), torch.randn(12, bs, nkv, d, generator=g)
    table = torch.randperm(12, generator=g)[:8].to(torch.int32).view(2, 4)
    cache = dict(q=torch.randn(3, nh, d, generator=g), k_cache=kc, v_cache=vc, block_table=table,
                 token_seq=torch.tensor([0, 1, 1], dtype=torch.int32), positions=torch.tensor([19, 40, 63], dtype=torch.int32),
                 scale=0.2)
    part = dict(part_o=torch.empty(3, nh, ks, d), m=torch.empty(3, nh, ks), l=torch.empty(3, nh, ks))
    be.run("paged_attention_split", **cache, **part)
    gate, o, attn = torch.randn(3, nh, d, generator=g), torch.empty(3, nh, d), torch.empty(3, nh, d)
    be.run("merge_attn_states", **part, gate=gate, o=o)
    be.run("paged_attention", **cache, o=attn)
    assert torch.allclose(o, attn * torch.sigmoid(gate), atol=1e-5)
    empty = part["m"][0] == float("-inf")
    assert empty.sum() == nh * max(0, ks - 2)   # token 0 sees 20 keys: 2 chunks
    assert not part["l"][0][empty].any() and not part["part_o"][0][empty].any()


@pytest.mark.parametrize("ks", [1, 3, 16])
def test_verify_attention_and_merge_compose_to_gated_paged_attention(be, ks):
    """paged_attention_verify over two lanes of 3 tokens, the second lane's tokens at 38..40 (3 chunks, a cut by its
    longest token): merged, paged_attention times sigmoid(gate); where a token's own keys stop before its lane's
    (token 3 has no key in the lane's last chunk) a split it has no keys in holds m = -inf, l = 0, O = 0; L = 1 is
    paged_attention_split; lanes that mix sequences are refused."""
    g = torch.Generator().manual_seed(ks)
    nh, nkv, d, bs = 6, 2, 32, 16
    kc, vc = torch.randn(12, bs, nkv, d, generator=g), torch.randn(12, bs, nkv, d, generator=g)
    table = torch.randperm(12, generator=g)[:8].to(torch.int32).view(2, 4)
    cache = dict(q=torch.randn(6, nh, d, generator=g), k_cache=kc, v_cache=vc, block_table=table,
                 token_seq=torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32),
                 positions=torch.tensor([5, 6, 7, 30, 31, 32], dtype=torch.int32), scale=0.2)
    part = dict(part_o=torch.empty(6, nh, ks, d), m=torch.empty(6, nh, ks), l=torch.empty(6, nh, ks))
    be.run("paged_attention_verify", **cache, **part, L=3)
    gate, o, attn = torch.randn(6, nh, d, generator=g), torch.empty(6, nh, d), torch.empty(6, nh, d)
    be.run("merge_attn_states", **part, gate=gate, o=o)
    be.run("paged_attention", **cache, o=attn)
    assert torch.allclose(o, attn * torch.sigmoid(gate), atol=1e-5)
    # token 3 (31 keys, 2 chunks) under its lane's cut (33 keys, 3 chunks): the third chunk's split(s) are empty for
    # it and not for token 5
    cut = [3 * (i + 1) // ks for i in range(ks)]   # chunk ends of the splits
    last = [i for i in range(ks) if cut[i] == 3 and (i == 0 or cut[i - 1] < 3)][0]   # the split with chunk 2
    if ks >= 3:
        assert (part["m"][3][:, last] == float("-inf")).all() and not part["l"][3][:, last].any()
        assert (part["m"][5][:, last] > float("-inf")).all()
    split = dict(part_o=torch.empty(6, nh, ks, d), m=torch.empty(6, nh, ks), l=torch.empty(6, nh, ks))
    be.run("paged_attention_split", **cache, **split)
    be.run("paged_attention_verify", **cache, **part, L=1)
    assert all(torch.equal(part[k], split[k]) for k in part)
    with pytest.raises(ValueError, match="constant over each lane"):
        be.run("paged_attention_verify", **cache, **part, L=2)


def test_forced_routes_parse_and_refuse_malformed_entries():
    from ninfer.runtime.dispatch import forced_routes
    assert forced_routes("") == {}
    assert forced_routes("gdn_delta_rule=chunked.v32, linear=wgmma.m128n256k64s4c2") == {
        "gdn_delta_rule": "chunked.v32", "linear": "wgmma.m128n256k64s4c2"}
    for bad in ("gdn_delta_rule", "gdn_delta_rule=chunked", "=chunked.v32"):
        with pytest.raises(ValueError, match="is not op=route.tile"):
            forced_routes(bad)
