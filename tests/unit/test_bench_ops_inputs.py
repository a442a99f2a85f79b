"""The inputs `ninfer-bench ops` and `ninfer-tune` time ops on (cli/bench_inputs.py), for the MoE expert ops and
dequant: built on the CPU here, the GPU uses the same code; and `ninfer-bench model --omit-op`'s dropped launches."""
import pytest
import torch

from ninfer.cli.bench import omit_launches
from ninfer.cli.bench_inputs import SAMPLING, _make_moe, by_name, contract_bytes, make_inputs, moe_sets, op_bytes
from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.formats import nbytes
from ninfer.runtime.manifest import Manifest
from ninfer.runtime.tolerance import compare

DIMS = {"T": 3, "H": 128, "E": 16, "I": 64, "K": 4}


def test_moe_inputs_follow_the_contract_and_rotate_only_the_routing():
    be = ReferenceBackend()
    rng = torch.Generator().manual_seed(0)
    for op in ("moe_experts", "moe_experts_q4_q5", "moe_gate_up_q4", "moe_down_q5", "moe_align", "moe_gate_up_grouped_q4",
               "moe_down_grouped_q5", "moe_sum"):
        contract = be.contract(op)
        base = _make_moe(torch, contract, op, dict(DIMS), rng)
        assert set(base) == set(contract["inputs"]) | set(contract["outputs"])
        # every token routes to K distinct experts (the grouped ops: moe_align's order of such ids)
        if "ids" in base:
            assert all(len(set(row)) == DIMS["K"] for row in base["ids"].tolist())
        if "order" in base:
            assert sorted(base["order"].flatten().tolist()) == list(range(DIMS["T"] * DIMS["K"]))
            assert int(base["offsets"][-1]) == DIMS["T"] * DIMS["K"]
        sets = moe_sets(torch, base, DIMS, rng, n=4)
        assert len(sets) == 4 and all(set(s) == set(base) for s in sets)
        for s in sets[1:]:
            for k in ("gate_up", "down"):
                if k in base:
                    assert s[k] is base[k]                      # the weights are shared, not copied
            fresh = [k for k in ("ids", "order", "x", "h", "ys") if k in base]
            assert fresh and not all(torch.equal(s[k], base[k]) for k in fresh)   # the routing is fresh
        # the op runs on these inputs and bench's shared MoE problem (the reference backend, as the cuda one on the GPU)
        be.run(op, **base, **by_name(contract, {d: DIMS[d] for d in ("H", "E", "I", "K")}))


def test_moe_bytes_count_only_the_chosen_experts():
    be = ReferenceBackend()
    rng = torch.Generator().manual_seed(1)
    op = "moe_experts_q4_q5"
    base = _make_moe(torch, be.contract(op), op, dict(DIMS), rng)
    chosen = base["ids"].unique().numel()
    per_expert = nbytes("q4", (2 * DIMS["I"], DIMS["H"])) + nbytes("q5", (DIMS["H"], DIMS["I"]))
    acts = sum(base[k].numel() * base[k].element_size() for k in ("x", "weights", "ids", "y"))
    assert op_bytes(op, base, DIMS) == chosen * per_expert + acts


def test_by_name_is_what_no_shape_carries():
    be = ReferenceBackend()
    moe = {d: DIMS[d] for d in ("H", "E", "I", "K")}
    assert by_name(be.contract("moe_experts_q4"), moe) == {"E": 16, "I": 64}
    assert by_name(be.contract("moe_gate_up_q4"), moe) == {"E": 16}
    assert by_name(be.contract("moe_down_grouped_q4"), moe) == {}
    assert by_name(be.contract("moe_align"), moe) == {}          # E is offsets' shape; H and I are not its dims
    assert by_name(be.contract("linear_q4"), {"N": 8, "K": 16}) == {}


def test_dequant_inputs_are_a_packed_matrix_of_t_rows():
    be = ReferenceBackend()
    dims = {"T": 130, "K": 256}
    ts = make_inputs(torch, be.contract("dequant_q4"), "bf16", dict(dims), torch.Generator().manual_seed(0), "dequant_q4")
    assert ts["w"].numel() == nbytes("q4", (130, 256)) and tuple(ts["y"].shape) == (130, 256)
    be.run("dequant_q4", **ts)
    assert torch.isfinite(ts["y"].float()).all()


def test_router_norm_and_dense_gemm_inputs_are_plain_tensors():
    """moe_router is not an expert op: its inputs come from the contract like any op's (so do the norms' and the
    bf16 GEMMs': linear_swiglu's name has a linear_ prefix but no packed format)."""
    be = ReferenceBackend()
    for op, dims in [("moe_router", {"T": 3, "E": 16, "H": 64}), ("add_rms_norm_zc", {"T": 3, "H": 64}),
                     ("rms_norm_zc", {"T": 3, "H": 64}), ("linear", {"T": 3, "N": 16, "K": 64}),
                     ("linear_swiglu", {"T": 3, "I": 16, "K": 64})]:
        ts = make_inputs(torch, be.contract(op), "bf16", dict(dims), torch.Generator().manual_seed(0), op)
        assert set(ts) == set(be.contract(op)["inputs"]) | set(be.contract(op)["outputs"])
        be.run(op, **ts)


def test_packed_swiglu_inputs_hold_the_gate_and_up_rows():
    """linear_swiglu_q4's packed weight is the [2I, K] matrix (its WB constraint checks the byte count)."""
    be = ReferenceBackend()
    dims = {"T": 3, "I": 128, "K": 512}
    ts = make_inputs(torch, be.contract("linear_swiglu_q4"), "bf16", dict(dims), torch.Generator().manual_seed(0),
                     "linear_swiglu_q4")
    be.run("linear_swiglu_q4", **ts)
    assert ts["y"].shape == (3, 128) and ts["y"].isfinite().all()


def test_gdn_decode_inputs_run_and_count_the_states_twice():
    """A decode step of T sequences in distinct slots; the states are read and written back, so bytes count them twice."""
    be = ReferenceBackend()
    dims = {"T": 3, "H": 64, "HK": 2, "R": 2, "DK": 32, "DV": 32}
    ts = make_inputs(torch, be.contract("gdn_decode"), "bf16", dict(dims), torch.Generator().manual_seed(0), "gdn_decode")
    assert sorted(ts["slots"].tolist()) == [0, 1, 2]
    state0 = ts["state"].clone()
    be.run("gdn_decode", **ts, scale=32 ** -0.5)
    assert torch.isfinite(ts["y"].float()).all() and not torch.equal(ts["state"], state0)
    once = sum(t.numel() * t.element_size() for t in ts.values())
    states = sum(ts[k].numel() * ts[k].element_size() for k in ("state", "conv_state"))
    assert op_bytes("gdn_decode", ts, dims) == once + states


PRESET = Manifest.load().tolerances["gdn_state_fp32"]


def test_gdn_verify_inputs_are_runs_that_commit_and_run():
    """A verify step's T tokens as runs of VERIFY_RUN, one slot each, every run committed (the states written: bytes
    count them twice); the reference's y equals gdn_decode's over the same tokens one step at a time."""
    be = ReferenceBackend()
    dims = {"T": 6, "H": 64, "HK": 2, "R": 2, "DK": 32, "DV": 32}
    ts = make_inputs(torch, be.contract("gdn_verify"), "bf16", dict(dims), torch.Generator().manual_seed(0), "gdn_verify")
    assert ts["query_start"].tolist() == [0, 4, 6] and ts["commit"].tolist() == [4, 2]
    assert sorted(ts["slots"].tolist()) == [0, 1] and ts["x"].shape == (6, 64)
    before = {k: ts[k].clone() for k in ("state", "conv_state")}
    be.run("gdn_verify", **ts, scale=32 ** -0.5)
    assert torch.isfinite(ts["y"].float()).all() and not torch.equal(ts["state"], before["state"])
    once = sum(t.numel() * t.element_size() for t in ts.values())
    states = sum(ts[k].numel() * ts[k].element_size() for k in ("state", "conv_state"))
    assert op_bytes("gdn_verify", ts, dims) == once + states
    steps = {**ts, **{k: v.clone() for k, v in before.items()}}
    for i in range(4):   # decode step i: token i of each run that has one
        rows = [r for r, (a, b) in enumerate([(0, 4), (4, 6)]) if a + i < b]
        tok = torch.tensor([(0, 4)[r] + i for r in rows])
        y = torch.empty(len(rows), 2, 2, 32, dtype=torch.bfloat16)
        be.run("gdn_decode", x=ts["x"][tok], qkvz=ts["qkvz"][tok], w_ba=ts["w_ba"], conv_w=ts["conv_w"],
               A_log=ts["A_log"], dt_bias=ts["dt_bias"], norm_w=ts["norm_w"], slots=ts["slots"][rows],
               conv_state=steps["conv_state"], state=steps["state"], y=y, scale=32 ** -0.5)
        assert compare(y, ts["y"][tok], PRESET, f"y of step {i}")
    assert torch.equal(steps["conv_state"], ts["conv_state"])
    assert compare(steps["state"], ts["state"], PRESET, "state")   # (b/a from a [1, H] or [4, H] product: not bitwise)


def test_verify_attention_inputs_are_lanes_of_verify_run_tokens():
    """paged_attention_verify's inputs: T / VERIFY_RUN lanes, each querying its last VERIFY_RUN positions of an
    ATTN_CONTEXT-token sequence (its own pages); the partials, merged, are paged_attention's on the same inputs."""
    from ninfer.cli.bench_inputs import ATTN_CONTEXT, VERIFY_RUN
    be = ReferenceBackend()
    dims = {"T": 2 * VERIFY_RUN, "NH": 4, "NKV": 2, "D": 32, "BS": 16, "KS": 8}
    ts = make_inputs(torch, be.contract("paged_attention_verify"), "bf16", dict(dims), torch.Generator().manual_seed(0),
                     "paged_attention_verify")
    assert ts["token_seq"].tolist() == [0] * VERIFY_RUN + [1] * VERIFY_RUN
    assert ts["positions"].tolist() == 2 * list(range(ATTN_CONTEXT - VERIFY_RUN, ATTN_CONTEXT))
    assert ts["block_table"].shape == (2, ATTN_CONTEXT // 16) and len(set(ts["block_table"].flatten().tolist())) == 1024
    ts = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in ts.items()}
    be.run("paged_attention_verify", **ts, scale=0.2, L=VERIFY_RUN)
    gate, o, attn = torch.zeros(dims["T"], 4, 32), torch.empty(dims["T"], 4, 32), torch.empty(dims["T"], 4, 32)
    be.run("merge_attn_states", part_o=ts["part_o"], m=ts["m"], l=ts["l"], gate=gate, o=o)
    be.run("paged_attention", **{k: ts[k] for k in ("q", "k_cache", "v_cache", "block_table", "token_seq", "positions")},
           scale=0.2, o=attn)
    assert torch.allclose(o, attn * 0.5, atol=1e-5)


def test_gdn_prefill_inputs_are_one_sequence_and_run():
    """gdn_conv and gdn_delta_rule as ninfer-tune times them: one sequence of T tokens, its state in one slot."""
    be = ReferenceBackend()
    rng = torch.Generator().manual_seed(0)
    conv = make_inputs(torch, be.contract("gdn_conv"), "bf16", {"T": 37, "C": 96, "KW": 4}, rng, "gdn_conv")
    state0 = conv["conv_state"].clone()
    be.run("gdn_conv", **conv)
    assert torch.isfinite(conv["y"].float()).all()
    assert torch.equal(conv["conv_state"][0], state0[0]) and torch.equal(conv["conv_state"][1], conv["x"][-3:].T)
    gdn = make_inputs(torch, be.contract("gdn_delta_rule"), "bf16", {"T": 37, "HV": 32, "DK": 16, "DV": 16}, rng,
                      "gdn_delta_rule")
    be.run("gdn_delta_rule", **gdn, num_k_heads=16, scale=16 ** -0.5)
    assert torch.isfinite(gdn["o"].float()).all()


def test_omitted_ops_are_not_launched():
    """omit_launches (ninfer-bench model --omit-op) drops the launches of those ops only."""
    be = ReferenceBackend()
    omit_launches(be, frozenset({"add"}))
    a, b = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    y = torch.full((4, 8), 7.0).bfloat16()
    be.run("add", a=a, b=b, y=y)
    assert (y == 7.0).all()
    x, y2 = torch.randn(4, 16).bfloat16(), torch.empty(4, 8).bfloat16()
    be.run("silu_and_mul", x=x, y=y)
    ReferenceBackend().run("silu_and_mul", x=x, y=y2)
    assert torch.equal(y, y2) and not (y == 7.0).all()


def test_sample_inputs_carry_the_named_settings():
    """The sampler's bench rows: every row with the problem's settings (greedy rows give the argmax), no penalties,
    so the counts are not among the bytes the op must move."""
    be = ReferenceBackend()
    for mode, (temp, top_k, top_p, _) in SAMPLING.items():
        dims = {"T": 3, "V": 256, "sampling": mode}
        ts = make_inputs(torch, be.contract("sample"), "bf16", dict(dims), torch.Generator().manual_seed(0), "sample")
        assert set(ts) == set(be.contract("sample")["inputs"]) | set(be.contract("sample")["outputs"])
        assert torch.equal(ts["temperature"], torch.full((3,), temp)) and ts["top_k"].tolist() == [top_k] * 3
        assert torch.equal(ts["top_p"], torch.full((3,), top_p))
        be.run("sample", **ts, domain=250)
        if mode == "greedy":
            assert ts["ids"].tolist() == ts["logits"][:, :250].float().argmax(1).tolist()
        assert ((ts["ids"] >= 0) & (ts["ids"] < 250)).all()
        assert op_bytes("sample", ts, dims) == sum(t.numel() * t.element_size() for k, t in ts.items() if k != "counts")


def test_decode_figures_are_the_median_step_with_its_spread():
    """`ninfer-bench model` reports each concurrency's median decode step (one stalled step does not move it) and
    the 10th / 90th percentile steps, so a slow run shows whether a few steps or all of them were slower."""
    import pytest

    from ninfer.cli.bench import step_stats
    steps = [0.010] * 9 + [0.050]                      # one stalled step of ten
    got = step_stats(steps)
    assert got["median"] == 0.010 and got["p10"] == 0.010 and got["p90"] == 0.010
    assert step_stats([4.0, 1.0, 3.0, 2.0]) == {"median": 2.5, "p10": 1.0, "p90": 4.0}
    got = step_stats([i / 1000 for i in range(101)])  # 0..100 ms
    assert (got["median"], got["p10"], got["p90"]) == (0.050, 0.010, 0.090)
    with pytest.raises(ValueError, match="no decode steps"):
        step_stats([])


def test_w8a8_inputs_are_finite_codes_and_run():
    """linear_fp8_w8a8's inputs: E4M3 codes that are no NaN (0x7F / 0xFF), positive token scales, a packed fp8 weight;
    quant_fp8_per_token's: a bf16 row per token. Both run on them."""
    be = ReferenceBackend()
    rng = torch.Generator().manual_seed(0)
    for op, dims in (("linear_fp8_w8a8", {"T": 130, "N": 256, "K": 208}), ("quant_fp8_per_token", {"T": 5, "K": 264})):
        contract = be.contract(op)
        ts = make_inputs(torch, contract, "bf16", dict(dims), rng, op)
        assert set(ts) == set(contract["inputs"]) | set(contract["outputs"])
        be.run(op, **ts)
        out = ts["y"] if op == "linear_fp8_w8a8" else ts["s"]
        assert torch.isfinite(out.float()).all() and out.abs().max() > 0
    codes = make_inputs(torch, be.contract("linear_fp8_w8a8"), "bf16", {"T": 64, "N": 128, "K": 4096}, rng,
                        "linear_fp8_w8a8")["xq"]
    assert not ((codes & 0x7F) == 0x7F).any() and (codes >= 0x80).any() and (codes == 0x7E).any()


def bound(be, op, ts, **params):
    """The dims an op's launch binds from these tensors (what the model bench's profile events carry)."""
    from ninfer.runtime.contracts import bind
    return bind(op, be.contract(op), "bf16", ts, params)[0]


def test_contract_bytes_count_each_tensor_once_and_the_step_slots_of_a_state_pool():
    be, g = ReferenceBackend(), torch.Generator().manual_seed(1)
    dims = {"T": 3, "H": 64}
    ts = make_inputs(torch, be.contract("add_rms_norm_zc"), "bf16", dict(dims), g, "add_rms_norm_zc")
    assert contract_bytes(be.contract("add_rms_norm_zc"), bound(be, "add_rms_norm_zc", ts)) == 2 * (4 * 3 * 64 + 64)
    # gdn_decode over a pool of exactly its T slots: the bench's own count (states read and written)
    dims = {"T": 3, "H": 64, "HK": 2, "R": 2, "DK": 32, "DV": 32}
    ts = make_inputs(torch, be.contract("gdn_decode"), "bf16", dict(dims), g, "gdn_decode")
    c = be.contract("gdn_decode")
    assert contract_bytes(c, bound(be, "gdn_decode", ts, scale=1.0)) == op_bytes("gdn_decode", ts, dims)
    # the same step in a pool of 8 slots moves the same bytes
    pool = {k: torch.cat([ts[k]] * 3)[:8] for k in ("state", "conv_state")}
    assert contract_bytes(c, bound(be, "gdn_decode", {**ts, **pool}, scale=1.0)) == op_bytes("gdn_decode", ts, dims)
    # a paged KV cache is read only where the sequences' pages are: not counted
    assert contract_bytes(be.contract("paged_attention"), {}) is None


def test_the_step_profile_ranks_the_ops_furthest_from_the_copy_ceiling(capsys):
    """_profile_table (ninfer-bench model --profile) prints each op's GB/s against the copy rate, the linear ops'
    weights and the others' contract bytes, and names the ops that lose the most time against it."""
    from ninfer.cli.bench import _profile_table
    be, g = ReferenceBackend(), torch.Generator().manual_seed(2)
    norm = bound(be, "add_rms_norm_zc", make_inputs(torch, be.contract("add_rms_norm_zc"), "bf16", {"T": 1, "H": 5120},
                                                     g, "add_rms_norm_zc"))
    lin = {"T": 1, "N": 5120, "K": 6144, "WB": nbytes("q4", (5120, 6144))}
    launches = [("add_rms_norm_zc", "row_reg.t640v1", norm, "norm_kernel"),       # 51 KB in 2 us
                ("linear_q4", "gemv_splitk.t1u2k2px", lin, "gemv_kernel")]     # 16.7 MB in 8 us
    _profile_table(launches, {"norm_kernel": 2.0, "gemv_kernel": 8.0, "a_torch_kernel": 5.0}, "profile", 4000.0,
                   800.0, be.contract)
    out = capsys.readouterr().out
    norm_row = next(line for line in out.splitlines() if line.strip().startswith("add_rms_norm_zc"))
    assert "26 GB/s =   0.6 % of copy" in norm_row
    assert "% of copy" in next(line for line in out.splitlines() if line.strip().startswith("linear_q4"))
    worst = out.splitlines()[-1]
    assert worst.index("linear_q4") < worst.index("add_rms_norm_zc")   # 8 - 4.2 us lost against 2 - 0.01
    with pytest.raises(RuntimeError, match="no kernel gemv_kernel"):   # a launch CUPTI did not see is not guessed
        _profile_table(launches, {"norm_kernel": 2.0}, "profile", 4000.0, 800.0, be.contract)
