"""Spec validation: every bad input is refused with a message naming file, key and what is allowed."""
import re
import subprocess
import sys

import pytest
import yaml

from ninfer.codegen.render import RenderError, generate
from ninfer.codegen.specs import load_specs
from ninfer.codegen.yamlio import SpecError


def edit(path, fn):
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def fails(spec_tree, message):
    specs, templates = spec_tree
    with pytest.raises(SpecError) as e:
        load_specs(specs, templates)
    assert message in str(e.value), str(e.value)
    return str(e.value)


def test_real_specs_load(spec_tree):
    s = load_specs(*spec_tree)
    assert {"linear", "rms_norm", "rms_norm_zc", "add", "silu_and_mul", "sigmoid_mul", "embedding"} <= set(s.ops)
    assert set(s.archs) == {"sm_80", "sm_86", "sm_89", "sm_90a", "sm_120a"}
    assert "wgmma" in s.archs["sm_90a"].features and "wgmma" not in s.archs["sm_80"].features


def test_malformed_yaml_names_file_and_line(spec_tree):
    specs, _ = spec_tree
    (specs / "ops" / "add.yaml").write_text("op: add\nsummary: [unclosed\n")
    msg = fails(spec_tree, "ops/add.yaml: malformed YAML: line 3")
    assert "column" in msg


def test_duplicate_key(spec_tree):
    specs, _ = spec_tree
    p = specs / "ops" / "add.yaml"
    p.write_text(p.read_text() + "tolerance: exact\n")
    fails(spec_tree, "ops/add.yaml: malformed YAML: line")
    fails(spec_tree, "duplicate key 'tolerance'")


def test_unknown_key_lists_allowed(spec_tree):
    specs, _ = spec_tree
    edit(specs / "ops" / "add.yaml", lambda d: d.update(colour="red"))
    fails(spec_tree, "ops/add.yaml: unknown key(s) colour (allowed: aliases, constraints, dims, dtypes, formula, "
                     "inputs, notes, op, outputs, params, problem, reference, states, summary, tolerance)")


def test_unknown_dtype(spec_tree):
    specs, _ = spec_tree
    edit(specs / "ops" / "add.yaml", lambda d: d["inputs"]["a"].update(dtype="bf17"))
    fails(spec_tree, "ops/add.yaml: inputs.a.dtype: unknown dtype 'bf17' (allowed: $dtype, bf16, f16, f32, i32, u8)")


def test_unknown_arch(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0].update(archs=["sm_70"]))
    fails(spec_tree, "routes/add.yaml: routes[0].archs[0]: unknown arch 'sm_70' (allowed: sm_120a, sm_80, sm_86, sm_89, sm_90a)")


def test_unknown_op_in_route_file(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d.update(op="addd"))
    fails(spec_tree, "routes/add.yaml: op: unknown op 'addd' (known ops:")


def test_a_shared_routes_file_serves_each_listed_op(spec_tree):
    """routes/moe_experts_packed.yaml lists the packed-expert ops of every format; each gets its own routes,
    and an op routed by two files, or an unknown op in the list, is refused by name."""
    specs, templates = spec_tree
    s = load_specs(specs, templates)
    assert {r.file for r in s.routes["moe_experts_q5"].values()} == {"routes/moe_experts_packed.yaml"}
    assert set(s.routes["moe_experts_q5"]) == set(s.routes["moe_experts_fp8"])
    shared = specs / "routes" / "moe_experts_packed.yaml"
    second = specs / "routes" / "zz_more_experts.yaml"
    second.write_text(shared.read_text())
    edit(second, lambda d: d.update(ops=["moe_experts_q5"]))
    fails(spec_tree, "routes/zz_more_experts.yaml: op 'moe_experts_q5' already has routes in routes/moe_experts_packed.yaml")
    second.unlink()
    edit(shared, lambda d: d.update(ops=[*d["ops"], "moe_experts_nope"]))
    fails(spec_tree, "routes/moe_experts_packed.yaml: ops: unknown op 'moe_experts_nope'")


def test_unknown_template(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0].update(template="nope.cu.j2"))
    fails(spec_tree, "routes/add.yaml: routes[0].template: unknown template 'nope.cu.j2'")


def test_unknown_tolerance(spec_tree):
    specs, _ = spec_tree
    edit(specs / "ops" / "add.yaml", lambda d: d.update(tolerance="loose"))
    fails(spec_tree, "ops/add.yaml: tolerance: unknown tolerance preset 'loose' (allowed: attention_bf16, bf16_elementwise")


def test_duplicate_route_name(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"].append(dict(d["routes"][0])))
    fails(spec_tree, "routes/add.yaml: routes[1].name: duplicate route name 'vec8' for op add")


def test_unknown_route_instance_in_table(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["tables"][0]["spans"][0].update(use="vec8.t999"))
    fails(spec_tree, "routes/add.yaml: tables[0].spans[0].use: unknown route instance 'vec8.t999' (allowed: vec8.t256)")


def _rs_route(d):
    return next(r for r in d["routes"] if r["name"] == "wgmma_rs")


def test_packed_tmap_arg_names_its_format_and_matrix(spec_tree):
    """A TMA argument over a packed weight's code planes names a known format and the matrix's [rows, cols]."""
    specs, _ = spec_tree
    p = specs / "routes" / "linear_q4.yaml"
    edit(p, lambda d: _rs_route(d)["args"][1].update(format="q9"))
    fails(spec_tree, "routes/linear_q4.yaml: routes[")
    fails(spec_tree, "args[1].format: unknown format 'q9' (allowed: q4, q5, q6, fp8)")
    edit(p, lambda d: _rs_route(d)["args"][1].update(format="q4", plane=1))
    fails(spec_tree, "args[1].plane: q4 has no plane 1 (allowed: 0)")
    edit(p, lambda d: _rs_route(d)["args"][1].update(plane=0, swizzle="64B"))
    fails(spec_tree, "args[1].swizzle: unknown swizzle '64B' (allowed: NONE, 128B)")
    edit(p, lambda d: _rs_route(d)["args"][1].pop("swizzle"))
    edit(p, lambda d: _rs_route(d)["args"][1].pop("plane"))
    edit(p, lambda d: _rs_route(d)["args"][1].update(format="q4", matrix=["N"]))
    fails(spec_tree, "args[1].matrix: expected [rows, cols]")
    edit(p, lambda d: _rs_route(d)["args"][1].pop("matrix"))
    fails(spec_tree, "args[1]: `format` and `matrix` go together")


def _spans(spans):
    def f(d):
        d["tables"][0]["spans"] = [{"from": a, "to": b, "use": "vec8.t256"} for a, b in spans]
    return f


@pytest.mark.parametrize("spans,message", [
    ([(1, 8), (10, None)], "tables[0].spans[1]: gap: T=9..9 is covered by no span (spans must cover T=1..∞)"),
    ([(2, None)], "tables[0].spans[0]: gap: T=1..1 is covered by no span"),
    ([(1, 8), (8, None)], "tables[0].spans[1]: span T=8.. overlaps the previous span, which ends at T=8"),
    ([(1, 8), (9, 16)], "tables[0].spans: gap: T=17..∞ is covered by no span (the last span needs to: null)"),
    ([(1, None), (5, None)], "tables[0].spans[1]: span starts at T=5 after an open span"),
    ([(1, 8), (9, 4)], "tables[0].spans[1].to: span ends (T=4) before it starts (T=9)"),
])
def test_closed_catalogue(spec_tree, spans, message):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", _spans(spans))
    fails(spec_tree, f"routes/add.yaml: {message}")


def test_missing_default_table(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d.pop("tables"))
    fails(spec_tree, "routes/add.yaml: tables: no default table (problem: any) for add on sm_120a/bf16: every T must be admitted")


def test_two_tables_for_one_problem(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["tables"].append(d["tables"][0]))
    fails(spec_tree, "routes/add.yaml: tables: two tables for add on sm_80/bf16 problem any")


def test_t_constraint_of_route_is_respected_by_spans(spec_tree):
    specs, _ = spec_tree
    def f(d):
        d["routes"][0]["constraints"] = ["T <= tile.threads"]
    edit(specs / "routes" / "add.yaml", f)
    fails(spec_tree, "routes/add.yaml: tables[0].spans[0].use: route vec8.t256 admits only T <= 256; the span reaches T=∞")


def test_smem_over_arch_limit(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(smem="tile.threads * 1024"))
    fails(spec_tree, "routes/add.yaml: routes[0].tiles.t256: tile needs 262144 bytes of shared memory; sm_80 allows at most 166912 per block")


def test_smem_formula_may_use_the_formula_functions(spec_tree):
    """smem (and block) formulas may call cdiv / min / max like any formula: the limit check evaluates them."""
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(smem="max(cdiv(tile.threads, 2), 1) * 2048"))
    fails(spec_tree, "routes/add.yaml: routes[0].tiles.t256: tile needs 262144 bytes of shared memory; sm_80 allows at most 166912 per block")


def test_feature_missing_on_arch(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0].update(requires=["wgmma"]))
    fails(spec_tree, "routes/add.yaml: routes[0].archs: route add/vec8 requires wgmma, which sm_80 lacks (its features: mma_sync_bf16, mma_sync_f16, mma_sync_int8, cp_async)")


def test_bad_formula(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(grid=["__import__('os')", 1, 1]))
    fails(spec_tree, "routes/add.yaml: routes[0].launch.grid[0]: in \"__import__('os')\": only the functions cdiv, min, max are allowed")


def test_sms_names_the_sm_count_in_grid_formulas_only(spec_tree):
    """A persistent kernel's grid may use SMS (the running GPU's SM count); block and smem may not."""
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(grid=["min(cdiv(H, 8), SMS * 4)", "T", 1]))
    load_specs(*spec_tree)
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(smem="SMS * 16"))
    fails(spec_tree, "routes[0].launch.smem: in 'SMS * 16': unknown name 'SMS'")


def test_unknown_tile_param_in_formula(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(block=["tile.warps", 1, 1]))
    fails(spec_tree, "routes[0].launch.block[0]: in 'tile.warps': unknown tile param 'warps' (tile has: threads)")


def test_block_over_1024_threads(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["tiles"].update(t256={"threads": 2048}))
    fails(spec_tree, "routes/add.yaml: routes[0].tiles.t256: block of 2048 threads breaks the limit of 1024")


def test_workspace_argument_needs_a_declared_workspace(spec_tree):
    specs, _ = spec_tree
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["args"].append("workspace"))
    fails(spec_tree, "routes/add.yaml: routes[0].args[5]: unknown argument 'workspace' (allowed: tensors, dims and params "
                     "of op add, and `workspace` when the route declares one)")
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0].update(workspace="T * H * 4"))
    load_specs(*spec_tree)
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0].update(workspace="T * Q"))
    fails(spec_tree, "routes[0].workspace: in 'T * Q': unknown name 'Q'")


def test_pre_launch_is_checked_like_the_main_one(spec_tree):
    specs, _ = spec_tree
    pre = {"grid": ["T", 1, 1], "block": ["tile.threads", 1, 1], "smem": "0"}
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(pre=dict(pre)))
    load_specs(*spec_tree)
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(pre={**pre, "block": [2048, 1, 1]}))
    fails(spec_tree, "routes/add.yaml: routes[0].tiles.t256: block of 2048 threads breaks the limit of 1024")
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(pre={**pre, "smem": "tile.threads * 1024"}))
    fails(spec_tree, "routes/add.yaml: routes[0].tiles.t256: tile needs 262144 bytes of shared memory; sm_80 allows at most 166912 per block")
    edit(specs / "routes" / "add.yaml", lambda d: d["routes"][0]["launch"].update(pre={"grid": ["T", 1]}))
    fails(spec_tree, "routes[0].launch.pre")


def test_render_error_names_template_and_line_and_leaves_tree(spec_tree, tmp_path):
    specs, templates = spec_tree
    out = tmp_path / "generated"
    generate(specs, templates, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    t = templates / "elementwise.cu.j2"
    t.write_text(t.read_text().replace("constexpr int THREADS", "{{ tile.no_such_param }}\nconstexpr int THREADS", 1))
    with pytest.raises(RenderError) as e:
        generate(specs, templates, out)
    assert re.search(r"routes/add\.yaml: route add/vec8 tile t256 \(sm_\w+, bf16\): template codegen/templates/"
                     r"elementwise\.cu\.j2:\d+: 'dict object' has no attribute 'no_such_param'", str(e.value)), str(e.value)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".generated")]


def test_codegen_cli_exits_nonzero_with_message(spec_tree, tmp_path):
    specs, templates = spec_tree
    edit(specs / "routes" / "add.yaml", _spans([(1, 4), (6, None)]))
    r = subprocess.run([sys.executable, "-m", "ninfer.codegen", "--specs", str(specs), "--templates", str(templates),
                        "--out", str(tmp_path / "gen")], capture_output=True, text=True)
    assert r.returncode == 1
    assert "routes/add.yaml: tables[0].spans[1]: gap: T=5..5 is covered by no span" in r.stderr
    assert not (tmp_path / "gen").exists()


def test_the_speculative_commit_route_needs_no_workspace(spec_tree):
    """A speculative round's commit (gdn_verify) may run beside a MoE shared expert, both plans beside() the main
    stream, which share one workspace (runtime/dispatch.py): so no gdn_verify route may declare one."""
    routes = load_specs(*spec_tree).routes["gdn_verify"]
    assert routes and all(r.workspace is None and r.pre is None for r in routes.values())
