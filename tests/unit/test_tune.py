"""ninfer-tune's table building and writing, and the tuned tables through codegen and the manifest: a
valid table is picked on its GPU only, a broken one is refused by name and leaves the previous file as it
was. (The timing itself needs a GPU: it ran on the H200, see specs/tuned/.)"""
import pytest
import torch

from click.testing import CliRunner

from ninfer.cli.tune import (_keep_above, _merge, artifact_problems, build_spans, candidates, gpu_slug, main, missing,
                             model_problems, render, run_note, splice_spans, tune_within, write_validated)
from ninfer.codegen.render import build_manifest_and_sources
from ninfer.codegen.specs import load_specs
from ninfer.codegen.yamlio import SpecError, load_yaml
from ninfer.runtime.manifest import Manifest

GPU = "Test GPU 9000"
PROBLEM = {"N": 17408, "K": 5120}


def test_spans_cover_every_t_once_and_merge_neighbours():
    spans = build_spans([1, 2, 4, 8, 64], ["a", "a", "b", "b", "c"])
    assert spans == [{"from": 1, "to": 3, "use": "a"}, {"from": 4, "to": 63, "use": "b"},
                     {"from": 64, "to": None, "use": "c"}]
    for bad in ([2, 4], [1, 4, 4], [1, 3, 2]):
        with pytest.raises(ValueError):
            build_spans(bad, ["a"] * len(bad))


def test_keep_above_splices_the_decode_spans_onto_the_previous_table(tmp_path):
    """--keep-above with a grid ending at 8: the new winners own T = 1..8 (the last one stops at 8), the previous
    table owns 9..; equal neighbours merge, every T is covered once; a problem with no previous table takes the
    default's spans (the generated table's, in ninfer-tune), or without a default is refused."""
    old = [{"from": 1, "to": 4, "use": "gemv.t4"}, {"from": 5, "to": 16, "use": "gemv_batch.t16"},
           {"from": 17, "to": None, "use": "mma.m64"}]
    new = build_spans([1, 2, 3, 4, 5, 8], ["x1", "x1", "x4", "x4", "x8", "gemv_batch.t16"])
    assert splice_spans(new, old, 8) == [{"from": 1, "to": 2, "use": "x1"}, {"from": 3, "to": 4, "use": "x4"},
                                         {"from": 5, "to": 7, "use": "x8"}, {"from": 8, "to": 16, "use": "gemv_batch.t16"},
                                         {"from": 17, "to": None, "use": "mma.m64"}]
    assert splice_spans([{"from": 1, "to": None, "use": "a"}], old, 20) == [{"from": 1, "to": 20, "use": "a"},
                                                                           {"from": 21, "to": None, "use": "mma.m64"}]
    f = tmp_path / "gpu.yaml"
    f.write_text(render(GPU, "sm_90a", "2026-11-30, qwen3.6-27b q4, grid 1,2", [{"op": "linear_q4", "problem": PROBLEM, "spans": old}]),
                 encoding="utf-8")
    assert _keep_above(f, "linear_q4", PROBLEM, new, 1, 8)[-1] == {"from": 17, "to": None, "use": "mma.m64"}
    import click
    with pytest.raises(click.UsageError, match="no table of linear_q4 5120x5120"):
        _keep_above(f, "linear_q4", {"N": 5120, "K": 5120}, new, 1, 8)
    default = [{"from": 1, "to": 1, "use": "gemv.t1"}, {"from": 2, "to": None, "use": "wgmma.m64"}]
    asked = []
    got = _keep_above(f, "linear_q4", {"N": 5120, "K": 5120}, new, 1, 8, lambda op, p: asked.append((op, p)) or default)
    assert asked == [("linear_q4", {"N": 5120, "K": 5120})]
    assert got[-2:] == [{"from": 8, "to": 8, "use": "gemv_batch.t16"}, {"from": 9, "to": None, "use": "wgmma.m64"}]
    assert _keep_above(f, "linear_q4", PROBLEM, new, 1, 8, lambda op, p: default)[-1]["use"] == "mma.m64"   # file first


def test_keep_above_with_a_grid_from_above_one_keeps_the_spans_below_it_too(tmp_path):
    """--keep-above --grid 17,32,64: the new winners own T = 17..64 only (the one at 17 from 17, the last stopping at
    64); the previous table's spans hold below 17 (one cut at 16) and above 64; equal neighbours merge; without
    --keep-above such a grid is refused (nothing would cover T = 1..16); the note says which spans the run set."""
    old = [{"from": 1, "to": 8, "use": "gemv.t8"}, {"from": 9, "to": 20, "use": "gemv_batch.t16"},
           {"from": 21, "to": None, "use": "mma.m64"}]
    new = build_spans([17, 32, 64], ["c16", "c16", "mma.m64"], window=True)
    assert new[0]["from"] == 17
    assert splice_spans(new, old, 64, 17) == [{"from": 1, "to": 8, "use": "gemv.t8"},
                                              {"from": 9, "to": 16, "use": "gemv_batch.t16"},
                                              {"from": 17, "to": 63, "use": "c16"},
                                              {"from": 64, "to": None, "use": "mma.m64"}]
    assert splice_spans([{"from": 9, "to": None, "use": "gemv.t8"}], old, 12, 9) == [
        {"from": 1, "to": 12, "use": "gemv.t8"}, {"from": 13, "to": 20, "use": "gemv_batch.t16"},
        {"from": 21, "to": None, "use": "mma.m64"}]
    with pytest.raises(ValueError):
        build_spans([17, 32, 64], ["a"] * 3)
    assert run_note("2026-12-05", "qwen3.6-27b q4 (linear_q4)", [17, 32, 64], True) == (
        "2026-12-05, qwen3.6-27b q4 (linear_q4), grid 17,32,64 (spans T = 17..64, the earlier runs' below and above)")


def test_a_new_run_keeps_the_other_problems_and_notes(tmp_path):
    """Tuning one model after another keeps the first model's tables and its note; re-tuning a problem
    replaces its table in place, and a source's earlier note is replaced by its new one."""
    a = {"op": "linear_q4", "problem": {"N": 5120, "K": 6144}, "spans": [{"from": 1, "to": None, "use": "gemv.t1"}]}
    b = {"op": "linear_q4", "problem": {"N": 2048, "K": 4096}, "spans": [{"from": 1, "to": None, "use": "gemv.t1"}]}
    f = tmp_path / "gpu.yaml"
    f.write_text(render(GPU, "sm_90a", "2026-11-30, qwen3.6-27b q4, grid 1,2", [a]), encoding="utf-8")
    def shown(ts):  # the file also gives each table its dtypes
        return [{k: t[k] for k in ("op", "problem", "spans")} for t in ts]
    tables, note = _merge(f, [b], "2026-12-01, qwen3.6-35b-a3b q4, grid 1,2", "qwen3.6-35b-a3b q4")
    assert shown(tables) == [a, b]
    assert note == "2026-11-30, qwen3.6-27b q4, grid 1,2; 2026-12-01, qwen3.6-35b-a3b q4, grid 1,2"
    f.write_text(render(GPU, "sm_90a", note, tables), encoding="utf-8")
    a2 = {**a, "spans": [{"from": 1, "to": None, "use": "gemv.t8p"}]}
    tables, note = _merge(f, [a2], "2026-12-02, qwen3.6-27b q4, grid 1,2,3", "qwen3.6-27b q4")
    assert shown(tables) == [a2, b]
    assert note == "2026-12-01, qwen3.6-35b-a3b q4, grid 1,2; 2026-12-02, qwen3.6-27b q4, grid 1,2,3"
    f.write_text(render(GPU, "sm_90a", note, tables), encoding="utf-8")
    some = "qwen3.6-35b-a3b q4 (linear_q4)"   # a run of some ops (--op) keeps the whole-model run's note
    tables, note = _merge(f, [b], f"2026-12-03, {some}, grid 1", some)
    assert note == ("2026-12-01, qwen3.6-35b-a3b q4, grid 1,2; 2026-12-02, qwen3.6-27b q4, grid 1,2,3; "
                    "2026-12-03, qwen3.6-35b-a3b q4 (linear_q4), grid 1")


def test_a_keep_above_run_keeps_the_notes_of_the_spans_it_kept(tmp_path):
    """A --keep-above run replaces the decode spans only: the earlier note of the same source still describes the
    spans above, so it stays, and the new note holds no "; " (the separator of the runs' notes)."""
    a = {"op": "linear_q4", "problem": {"N": 5120, "K": 6144}, "spans": [{"from": 1, "to": None, "use": "gemv.t1"}]}
    f = tmp_path / "gpu.yaml"
    f.write_text(render(GPU, "sm_90a", "2026-11-30, qwen3.6-27b q4 (linear_q4), grid 1,2,64", [a]), encoding="utf-8")
    source = "qwen3.6-27b q4 (linear_q4)"
    _, note = _merge(f, [a], run_note("2026-12-01", source, [1, 2], True), source, replaces=False)
    assert note.split("; ") == ["2026-11-30, qwen3.6-27b q4 (linear_q4), grid 1,2,64",
                                "2026-12-01, qwen3.6-27b q4 (linear_q4), grid 1,2 (spans up to T = 2, the earlier "
                                "runs' above)"]


def test_max_seconds_stops_between_problems_and_the_cut_run_keeps_the_earlier_notes(tmp_path):
    """--max-seconds: no problem starts after the limit (the one running finishes), the problems reached are returned
    in order, the stop is reported; the cut run's note says so and, like a --keep-above run, keeps the earlier note of
    its source (the tables of the problems it did not reach are still those runs')."""
    problems = [("linear_q4", {"N": n, "K": 5120}) for n in (6144, 10240, 34816)]
    now, done, said = [0.0], [], []

    def tune_one(op, problem):
        done.append(problem["N"])
        now[0] += 40.0    # each problem takes 40 s
        return {"op": op, "problem": problem, "spans": [{"from": 1, "to": None, "use": "gemv.t1"}]}

    tables = tune_within(problems, tune_one, 50, said.append, clock=lambda: now[0])
    assert done == [6144, 10240] and [t["problem"]["N"] for t in tables] == done
    assert said == ["# --max-seconds 50: stopped before linear_q4 34816x5120, 2 of 3 problems tuned"]
    now[0], done[:] = 0.0, []
    assert len(tune_within(problems, tune_one, None, said.append, clock=lambda: now[0])) == 3 and len(said) == 1
    f = tmp_path / "gpu.yaml"
    f.write_text(render(GPU, "sm_90a", "2026-11-30, qwen3.6-27b q4 (linear_q4), grid 1,2,64", tables), encoding="utf-8")
    source = "qwen3.6-27b q4 (linear_q4)"
    _, note = _merge(f, tables[:1], run_note("2026-12-05", source, [1, 2, 64], False, cut=True), source, replaces=False)
    assert note.split("; ") == ["2026-11-30, qwen3.6-27b q4 (linear_q4), grid 1,2,64",
                                "2026-12-05, qwen3.6-27b q4 (linear_q4), grid 1,2,64 (cut by --max-seconds: the problems "
                                "it reached)"]
    f.write_text(render(GPU, "sm_90a", note, tables), encoding="utf-8")   # the cut note's ": " stays a string
    assert load_yaml(f, tmp_path)["measured"] == note


def test_missing_only_tunes_the_problems_without_a_table_and_keeps_the_earlier_notes(tmp_path):
    """--missing-only (the same command again after a cut): the problems the file has no table for, in order; its note
    says so and, like a cut run, keeps the earlier note of its source; not with --keep-above (the opposite choice)."""
    problems = [("linear_q4", {"N": n, "K": 2048}) for n in (1024, 4096, 8192)] + [("rms_norm_zc", {"H": 2048})]
    f = tmp_path / "gpu.yaml"
    assert missing(f, problems) == problems                       # no file yet: every problem
    first = "2026-12-05, qwen3.6-35b-a3b q4, grid 1,2,64 (cut by --max-seconds: the problems it reached)"
    had = [{"op": op, "problem": p, "spans": [{"from": 1, "to": None, "use": "gemv.t1"}]} for op, p in problems[:2]]
    f.write_text(render(GPU, "sm_90a", first, had), encoding="utf-8")
    assert missing(f, problems) == problems[2:]
    source = "qwen3.6-35b-a3b q4"
    new = [{"op": op, "problem": p, "spans": [{"from": 1, "to": None, "use": "gemv.t8"}]} for op, p in problems[2:]]
    note = run_note("2026-12-06", source, [1, 2, 64], False, missing_only=True)
    tables, merged = _merge(f, new, note, source, replaces=False)
    assert [t["spans"][0]["use"] for t in tables] == ["gemv.t1", "gemv.t1", "gemv.t8", "gemv.t8"]
    assert merged.split("; ") == [first, "2026-12-06, qwen3.6-35b-a3b q4, grid 1,2,64 (the problems without a table)"]
    f.write_text(render(GPU, "sm_90a", merged, tables), encoding="utf-8")
    assert missing(f, problems) == []
    got = CliRunner().invoke(main, ["--keep-above", "--missing-only", "--grid", "1,2"])
    assert got.exit_code == 2 and "pick one" in got.output


def test_route_patterns_keep_the_tables_choice_as_the_baseline():
    """--route: only the matching instances are timed, and the table's own choice at that T always, first (the skip
    rule's yardstick); without patterns every instance, the table's choice first."""
    inst = ["gemv.t1", "gemv_batch_s8.t32c16m2s4u1", "wgmma_rs.n128t32s8c2", "wgmma_rs_splitk.n128t32s8c2k3",
            "mma.m64n128k64s4"]
    assert candidates(inst, "gemv_batch_s8.t32c16m2s4u1", ("wgmma_rs*",)) == [
        "gemv_batch_s8.t32c16m2s4u1", "wgmma_rs.n128t32s8c2", "wgmma_rs_splitk.n128t32s8c2k3"]
    assert candidates(inst, "mma.m64n128k64s4", ("*splitk*", "gemv.t1")) == [
        "mma.m64n128k64s4", "gemv.t1", "wgmma_rs_splitk.n128t32s8c2k3"]
    assert candidates(inst, "gemv.t1", ()) == ["gemv.t1", *sorted(i for i in inst if i != "gemv.t1")]
    assert candidates(inst, "gemv.t1", ("nothing*",)) == ["gemv.t1"]


def test_model_problems_are_the_linear_shapes_and_the_norms():
    got = model_problems("qwen3.6-27b", "q4")
    assert ("linear_q4", {"N": 34816, "K": 5120}) in got and ("linear_q4", {"N": 248320, "K": 5120}) in got
    assert ("linear", {"N": 96, "K": 5120}) in got            # the GDN b|a projection runs bf16
    assert ("linear", {"N": 5120, "K": 10240}) in got         # the MTP layer's fc (bf16 here; speculative rounds)
    # GDN qkv (10240 rows) and z (6144) run as one projection at decode (GatedDeltaNet.fuse_weights) and as its
    # two row views at prefill (split_rows): all three are problems, the views' bf16 GEMM (dequant path) too
    assert ("linear_q4", {"N": 16384, "K": 5120}) in got
    assert {("linear_q4", 10240), ("linear_q4", 6144), ("linear", 10240), ("linear", 6144)} <= \
        {(op, p["N"]) for op, p in got if op.startswith("linear") and "N" in p and p["K"] == 5120}
    assert {op for op, _ in got} == {"linear", "linear_q4", "linear_swiglu_q4", "add_rms_norm_zc", "rms_norm_zc", "gdn_conv", "gdn_delta_rule",
                                     "gdn_gated_norm", "gdn_decode", "gdn_verify", "attn_qk_prep", "paged_attention",
                                     "paged_attention_split", "merge_attn_states", "paged_attention_fp8",
                                     "paged_attention_split_fp8", "paged_attention_verify"}
    assert ("gdn_gated_norm", {"HV": 48, "DV": 128}) in got and ("attn_qk_prep", {"NH": 24, "NKV": 4, "D": 256}) in got
    assert ("linear_swiglu_q4", {"I": 17408, "K": 5120}) in got   # the MLP's [gate | up] with SwiGLU in the GEMM
    assert ("add_rms_norm_zc", {"H": 5120}) in got and not any(op.startswith("moe_") for op, _ in got)
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"


def test_mixer_problems_and_the_split_counts_they_are_timed_at():
    """The GDN decode step and the attention ops at the model's head shapes and the engine's page size; the
    flash-decoding pair is timed at the split count the model uses at each T (blocks.attn_splits)."""
    from ninfer.cli.tune import OP_GRIDS, mixer_problems, step_dims
    from ninfer.runtime.models.blocks import attn_splits
    from ninfer.runtime.synthetic import SHAPES
    got = model_problems("qwen3.6-35b-a3b", "q4")
    attn = {"NH": 16, "NKV": 2, "D": 256, "BS": 16}
    assert ("gdn_decode", {"H": 2048, "HK": 16, "R": 2, "DK": 128, "DV": 128}) in got
    assert ("gdn_verify", {"H": 2048, "HK": 16, "R": 2, "DK": 128, "DV": 128}) in got
    assert ("gdn_conv", {"C": 8192, "KW": 4}) in got and ("gdn_delta_rule", {"HV": 32, "DK": 128, "DV": 128}) in got
    assert ("paged_attention", attn) in got and ("paged_attention_split", attn) in got
    assert ("paged_attention_fp8", attn) in got and ("paged_attention_split_fp8", attn) in got   # the FP8 cache's
    assert ("merge_attn_states", {"NH": 16, "D": 256}) in got
    assert OP_GRIDS["paged_attention_split_fp8"] == OP_GRIDS["paged_attention_split"]
    for T in OP_GRIDS["paged_attention_split"]:
        assert step_dims("paged_attention_split", T, attn, got) == {"KS": attn_splits(T, 2)}
        assert step_dims("paged_attention_split_fp8", T, attn, got) == {"KS": attn_splits(T, 2)}
        assert step_dims("merge_attn_states", T, {"NH": 16, "D": 256}, got) == {"KS": attn_splits(T, 2)}
    assert step_dims("gdn_decode", 4, got[0][1], got) == {} and step_dims("paged_attention", 4, attn, got) == {}
    assert all(g[0] == 1 and list(g) == sorted(set(g)) for g in OP_GRIDS.values())
    cfg = SHAPES["qwen3.6-27b"]
    assert ("paged_attention", {"NH": 24, "NKV": 4, "D": 256, "BS": 32}) in mixer_problems(cfg, page_size=32)


def test_the_verify_attention_is_timed_at_whole_lanes_and_the_models_split_count():
    """paged_attention_verify at any T (a grid point or a tuned span's boundary): lanes of verify_run(T) tokens
    (VERIFY_RUN where T holds whole lanes of it), at the split count the model uses (blocks.verify_splits), the
    lane length passed as the op's param; the inputs built there run through the reference and merge to
    paged_attention's output."""
    from ninfer.cli.bench_inputs import VERIFY_RUN, make_inputs, verify_run
    from ninfer.cli.tune import OP_GRIDS, mixer_problems, step_dims, step_params
    from ninfer.runtime.dispatch import ReferenceBackend
    from ninfer.runtime.models.blocks import attn_splits, verify_splits
    from ninfer.runtime.synthetic import SHAPES
    attn = {"NH": 24, "NKV": 4, "D": 256, "BS": 16}
    got = mixer_problems(SHAPES["qwen3.6-27b"])
    assert ("paged_attention_verify", attn) in got
    assert [verify_run(t) for t in range(1, 13)] == [1, 2, 3, 4, 1, 3, 1, 4, 3, 2, 1, 4]
    for T in range(1, 70):
        d = step_dims("paged_attention_verify", T, attn, got)
        assert T % d["L"] == 0 and d["L"] <= VERIFY_RUN and (T % VERIFY_RUN or d["L"] == VERIFY_RUN)
        assert d["KS"] == verify_splits(T, d["L"], 24, 4)
    # the split count of the blocks' row sets: one lane of 4 tokens is 2 blocks of R = 2 (27B, G = 6), 16 splits;
    # 35B-A3B (G = 8, R = 2) the same over 2 kv heads, 32; one token a lane (L = 1) as paged_attention_split
    assert verify_splits(4, 4, 24, 4) == attn_splits(2, 4) == 16 and verify_splits(4, 4, 16, 2) == 32
    assert verify_splits(8, 4, 16, 2) == attn_splits(4, 2) == 16 and verify_splits(3, 1, 24, 4) == attn_splits(3, 4)
    assert all(T % VERIFY_RUN == 0 for T in OP_GRIDS["paged_attention_verify"] if T >= VERIFY_RUN)
    be = ReferenceBackend()
    contract = be.contract("paged_attention_verify")
    small = {"NH": 4, "NKV": 2, "D": 32, "BS": 16}
    for T in (3, 6, 8):
        dims = {"T": T, **small, **step_dims("paged_attention_verify", T, small, got)}
        ts = make_inputs(torch, contract, "bf16", dict(dims), torch.Generator().manual_seed(T), "paged_attention_verify")
        params = step_params(contract, "paged_attention_verify", dims)
        assert params["L"] == verify_run(T) and ts["token_seq"].tolist() == [i // params["L"] for i in range(T)]
        ts = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in ts.items()}
        be.run("paged_attention_verify", **ts, **params)
        o, attn_o = torch.empty(T, 4, 32), torch.empty(T, 4, 32)
        be.run("merge_attn_states", part_o=ts["part_o"], m=ts["m"], l=ts["l"], gate=torch.zeros(T, 4, 32), o=o)
        be.run("paged_attention", **{k: ts[k] for k in ("q", "k_cache", "v_cache", "block_table", "token_seq",
                                                       "positions")}, scale=params["scale"], o=attn_o)
        assert torch.allclose(o, attn_o * 0.5, atol=1e-5)


def test_problems_include_the_prefill_gemm_of_each_packed_matrix():
    """A packed matrix is decoded and multiplied by the bf16 `linear` from DEQUANT_MIN_T tokens on (below the
    scratch cap: the 2.5 GB lm_head stays on its fused route), so that GEMM is a problem too."""
    got = model_problems("qwen3.6-27b", "q4")
    assert ("linear", {"N": 34816, "K": 5120}) in got and ("linear_q4", {"N": 34816, "K": 5120}) in got
    assert ("linear_q4", {"N": 248320, "K": 5120}) in got and ("linear", {"N": 248320, "K": 5120}) not in got
    shapes = lambda ps: {(p["N"], p["K"]) for _, p in ps}  # noqa: E731
    bf16 = [(op, p) for op, p in model_problems("qwen3.6-27b", "bf16") if op.startswith("linear")]
    gemms = [(o, p) for o, p in got if o.startswith("linear") and "N" in p]   # not linear_swiglu_q4's {I, K}
    assert {op for op, _ in bf16} == {"linear"} and shapes(bf16) == shapes(gemms)


def test_fp8_problems_include_the_fp8_tensor_core_gemm_where_it_runs(monkeypatch):
    """With NINFER_FP8_W8A8_MIN_T (256 by default), an fp8 model's prefill quantizes each linear's input and runs
    the E4M3 GEMM (models/blocks.py w8a8): those problems are tuned too; with it off, they are not."""
    from ninfer.runtime.models import blocks
    monkeypatch.setattr(blocks, "FP8_W8A8_MIN_T", None)
    assert not [p for p in model_problems("qwen3.6-27b", "fp8") if p[0] in ("linear_fp8_w8a8", "quant_fp8_per_token")]
    monkeypatch.setattr(blocks, "FP8_W8A8_MIN_T", 256)
    got = model_problems("qwen3.6-27b", "fp8")
    assert ("linear_fp8_w8a8", {"N": 34816, "K": 5120}) in got and ("linear_fp8_w8a8", {"N": 5120, "K": 17408}) in got
    assert ("linear_fp8", {"N": 34816, "K": 5120}) in got   # decode still runs the packed GEMV
    assert [p for o, p in got if o == "quant_fp8_per_token"] == [{"K": 5120}, {"K": 6144}, {"K": 17408}]


def test_artifact_problems_follow_each_tensors_stored_format(demo_artifact):
    """The demo artifact mixes formats as the recipes do (q4, q5, bf16 b/a, a q6 embedding table tied to the
    lm_head): every packed matrix is tuned in its own format."""
    from ninfer.runtime.artifact import open_artifact
    got = artifact_problems(demo_artifact)
    art = open_artifact(demo_artifact)
    try:
        mats = {n: e for n, e in art.tensors.items() if len(e.shape) == 2 and e.format in ("q4", "q5", "q6")
                and n != "embed"}
        vocab, hidden = art.tensors["embed"].shape
        assert "lm_head" not in art.tensors and art.tensors["embed"].format == "q6"
    finally:
        art.close()
    assert {e.format for e in mats.values()} == {"q4", "q5"}
    for n, e in mats.items():
        assert (f"linear_{e.format}", {"N": e.shape[0], "K": e.shape[1]}) in got, n
    assert ("linear_q6", {"N": vocab, "K": hidden}) in got             # the tied lm_head reads the packed table
    # the MTP layer's matrices too (w8: the recipe's mtp_ roles), its fc [H, 2H] among them
    assert {op for op, _ in got if op.startswith("linear")} == {"linear", "linear_q4", "linear_q5", "linear_q6",
                                                                "linear_swiglu_q4", "linear_w8"}
    assert ("linear_w8", {"N": hidden, "K": 2 * hidden}) in got


def tuned_text(spans, op="linear"):
    return render(GPU, "sm_90a", "test", [{"op": op, "problem": PROBLEM, "spans": spans}])


GOOD = [{"from": 1, "to": 1, "use": "gemv.t1r8"}, {"from": 2, "to": 100, "use": "mma.m64n128k64s4"},
        {"from": 101, "to": None, "use": "wgmma.m128n128k64s6c2"}]


def test_a_tuned_table_is_used_on_its_gpu_only(spec_tree):
    specs, templates = spec_tree
    dest = write_validated(specs, templates, "test-gpu.yaml", tuned_text(GOOD))
    assert dest.read_text().startswith("# Route tables measured by ninfer-tune")
    manifest, _ = build_manifest_and_sources(load_specs(specs, templates), templates)
    m = Manifest(manifest)
    for T, want in [(1, "gemv.t1r8"), (50, "mma.m64n128k64s4"), (101, "wgmma.m128n128k64s6c2")]:
        assert m.resolve("sm_90a", "linear", "bf16", PROBLEM, T, gpu=GPU).instance == want
    assert m.resolve("sm_90a", "linear", "bf16", PROBLEM, 1).instance == "gemv.t1"              # any other GPU
    assert m.resolve("sm_90a", "linear", "bf16", {"N": 77, "K": 200}, 1, gpu=GPU).instance == "gemv.t1"
    assert m.tuned_for(GPU, "sm_80") == {}                     # measured on another arch: ignored


@pytest.mark.parametrize("spans,message", [
    ([{"from": 1, "to": 9, "use": "gemv.t1"}, {"from": 10, "to": None, "use": "mma.m64n64k64s4"}],
     "admits only T <= 1; the span reaches T=9"),
    ([{"from": 1, "to": 4, "use": "gemv.t4"}, {"from": 6, "to": None, "use": "mma.m64n64k64s4"}],
     "gap: T=5..5 is covered by no span"),
    ([{"from": 1, "to": None, "use": "gemv.nope"}], "unknown route instance 'gemv.nope'"),
    ([{"from": 1, "to": 4, "use": "gemv.t4"}], "gap: T=5..∞"),
])
def test_a_broken_tuned_table_is_refused_and_the_previous_one_kept(spec_tree, spans, message):
    specs, templates = spec_tree
    previous = write_validated(specs, templates, "test-gpu.yaml", tuned_text(GOOD)).read_text()
    files = sorted(p.name for p in (specs / "tuned").iterdir())
    with pytest.raises(SpecError, match="tuned/test-gpu.yaml") as e:
        write_validated(specs, templates, "test-gpu.yaml", tuned_text(spans))
    assert message in str(e.value)
    assert (specs / "tuned" / "test-gpu.yaml").read_text() == previous
    assert sorted(p.name for p in (specs / "tuned").iterdir()) == files   # no temp file left behind


def test_a_hand_broken_tuned_file_fails_generation(spec_tree):
    specs, templates = spec_tree
    (specs / "tuned").mkdir(exist_ok=True)
    (specs / "tuned" / "x.yaml").write_text(tuned_text(GOOD, op="no_such_op"))
    with pytest.raises(SpecError, match="unknown op or op without routes"):
        load_specs(specs, templates)


def test_expert_problems_are_every_form_of_the_routed_experts():
    from ninfer.cli.tune import expert_problems, label
    from ninfer.runtime.synthetic import SHAPES
    got = model_problems("qwen3.6-35b-a3b", "q4")
    moe = {op: p for op, p in got if op.startswith("moe_") and op != "moe_router"}
    assert set(moe) == {"moe_experts_q4", "moe_gate_up_q4", "moe_down_q4", "moe_gate_up_grouped_q4", "moe_down_grouped_q4"}
    assert all(p == {"H": 2048, "E": 256, "I": 512, "K": 8} for p in moe.values())
    assert {op for op, _ in model_problems("qwen3.6-35b-a3b", "bf16") if op.startswith("moe_")} == {"moe_experts", "moe_router"}
    assert ("moe_router", {"E": 256, "H": 2048}) in got
    assert label(moe["moe_down_q4"]) == "2048x256x512x8" and label({"N": 16384, "K": 5120}) == "16384x5120"
    cfg = SHAPES["qwen3.6-35b-a3b"]
    mixed = {"layers.0.mlp.experts.gate_up": ((256, 1024, 2048), "q4"), "layers.0.mlp.experts.down": ((256, 2048, 512), "q5")}
    assert {op for op, _ in expert_problems(cfg, mixed)} == {
        "moe_experts_q4_q5", "moe_gate_up_q4", "moe_down_q5", "moe_gate_up_grouped_q4", "moe_down_grouped_q5"}
    odd = {k: (s, "q6" if k.endswith("down") else "q5") for k, (s, _) in mixed.items()}   # no single op for q5 / q6
    assert {op for op, _ in expert_problems(cfg, odd)} == {
        "moe_gate_up_q5", "moe_down_q6", "moe_gate_up_grouped_q5", "moe_down_grouped_q6"}


def test_a_tuned_expert_table_is_used_on_its_gpu(spec_tree):
    specs, templates = spec_tree
    problem = {"H": 2048, "E": 256, "I": 512, "K": 8}
    spans = [{"from": 1, "to": 8, "use": "gemv.t1k4"}, {"from": 9, "to": None, "use": "gemv.t2k4"}]
    write_validated(specs, templates, "test-gpu.yaml",
                    render(GPU, "sm_90a", "test", [{"op": "moe_gate_up_q4", "problem": problem, "spans": spans}]))
    m = Manifest(build_manifest_and_sources(load_specs(specs, templates), templates)[0])
    assert m.resolve("sm_90a", "moe_gate_up_q4", "bf16", problem, 8, gpu=GPU).instance == "gemv.t1k4"
    assert m.resolve("sm_90a", "moe_gate_up_q4", "bf16", problem, 9, gpu=GPU).instance == "gemv.t2k4"
    assert m.resolve("sm_90a", "moe_gate_up_q4", "bf16", problem, 9).instance == "gemv.t4k2"   # another GPU: the default


def test_recipe_problems_follow_each_roles_format():
    got = model_problems("qwen3.6-27b", "recipe")
    assert ("linear_q5", {"N": 5120, "K": 17408}) in got and ("linear_q6", {"N": 248320, "K": 5120}) in got
    # GDN qkv (q4) and z (q5) cannot be joined: two problems
    assert ("linear_q4", {"N": 10240, "K": 5120}) in got and ("linear_q5", {"N": 6144, "K": 5120}) in got
    assert not any(p.get("N") == 16384 for _, p in got)
