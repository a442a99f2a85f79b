"""Codegen output: deterministic bytes, one unit per (op, route, arch, dtype, tile), a closed manifest."""
import hashlib
import json

from ninfer.codegen.render import generate
from ninfer.codegen.specs import load_specs


def tree_digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_runs_identical_bytes(spec_tree, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    generate(*spec_tree, a)
    generate(*spec_tree, b)
    assert tree_digest(a) == tree_digest(b)
    generate(*spec_tree, a)  # regenerating over an existing tree swaps it in whole
    assert tree_digest(a) == tree_digest(b)


def test_one_unit_per_instance_and_manifest_consistent(spec_tree, tmp_path):
    specs = load_specs(*spec_tree)
    out = tmp_path / "gen"
    m = generate(*spec_tree, out)
    expected = sum(len(r.archs) * len(r.dtypes) * len(r.tiles) for rs in specs.routes.values() for r in rs.values())
    assert len(m["kernels"]) == expected
    symbols = set()
    for key, k in m["kernels"].items():
        src = (out / k["source"]).read_text()
        assert hashlib.sha256(src.encode()).hexdigest() == k["source_sha256"]
        assert f'extern "C" __global__' in src and k["symbol"] in src
        assert key == f"{k['arch']}/{k['op']}/{k['route']}.{k['tile']}/{k['dtype']}"
        symbols.add((k["arch"], k["symbol"]))
    assert len(symbols) == len(m["kernels"])
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*.cu")}
    assert on_disk == {k["source"] for k in m["kernels"].values()}
    json.loads((out / "manifest.json").read_text())


def test_tables_close_over_all_t(spec_tree, tmp_path):
    m = generate(*spec_tree, tmp_path / "gen")
    for arch, ops in m["tables"].items():
        for op, by_dtype in ops.items():
            for dtype, entries in by_dtype.items():
                assert any(e["problem"] == {} for e in entries), (arch, op, dtype)
                for e in entries:
                    nxt = 1
                    for lo, hi, use in e["spans"]:
                        assert lo == nxt and f"{arch}/{op}/{use}/{dtype}" in m["kernels"]
                        nxt = None if hi is None else hi + 1
                    assert nxt is None


def test_line_map_points_into_templates(spec_tree, tmp_path):
    out = tmp_path / "gen"
    m = generate(*spec_tree, out)
    k = next(k for k in m["kernels"].values() if k["op"] == "rms_norm_zc" and k["arch"] == "sm_90a")
    lines = (out / k["source"]).read_text().split("\n")
    templates = spec_tree[1]
    checked = 0
    for start, tpl, tline, count in k["line_map"]:
        tl = (templates / tpl).read_text().split("\n")
        for i in range(count):
            src, t = lines[start - 1 + i].strip(), tl[tline - 1 + i].strip()
            if "{{" not in t:
                assert src == t, (start + i, src, t)
                checked += 1
    assert checked > 20


def test_every_kernel_enters_through_pdl(spec_tree, tmp_path):
    """The runtime launches a kernel with programmatic dependent launch only when its manifest entry says
    pdl; every template's kernel must wait for its predecessor (nf_pdl_enter) before it reads or writes."""
    out = tmp_path / "gen"
    m = generate(*spec_tree, out)
    for key, k in m["kernels"].items():
        src = (out / k["source"]).read_text()
        assert k["pdl"] is True, key
        # one wait per kernel
        assert src.count("nf_pdl_enter();") == src.count('extern "C" __global__'), key


def test_pre_kernel_and_workspace_reach_the_manifest(spec_tree, tmp_path):
    """A route with launch.pre and a workspace: the manifest names the pre kernel (defined in the same unit) with
    its geometry, and the runtime's workspace bound evaluates the route's formula (the largest over the op's
    routes on that arch; 0 for an op without one)."""
    from ninfer.runtime.manifest import Manifest
    out = tmp_path / "gen"
    m = Manifest(generate(*spec_tree, out))
    k = m.kernel("sm_90a", "gdn_delta_rule", "chunked_scan.v32", "bf16")
    assert k.pre["symbol"] == k.symbol + "_pre" and f'{k.pre["symbol"]}(' in (out / k.source).read_text()
    assert k.pre["grid"] == ["cdiv(T, 64) + S", "HV", "1"] and "workspace" in k.args
    dims = {"T": 4096, "S": 1, "HV": 48, "DK": 128, "DV": 128}
    assert m.workspace_bytes("sm_90a", "gdn_delta_rule", dims) == (64 + 1) * 48 * 21504
    assert m.workspace_bytes("sm_90a", "linear", {"T": 4096, "N": 8, "K": 8}) == 0
    # what the engine's memory plan asks the cuda backend for (its method on this manifest and arch), 27B shape
    from types import SimpleNamespace

    from ninfer.runtime.dispatch import CudaBackend
    from ninfer.runtime.models.blocks import prefill_workspace_bytes
    from ninfer.runtime.synthetic import SHAPES
    cuda = SimpleNamespace(manifest=m, device=SimpleNamespace(arch="sm_90a"))
    cuda.workspace_bytes = lambda op, **d: CudaBackend.workspace_bytes(cuda, op, **d)
    assert prefill_workspace_bytes(cuda, SHAPES["qwen3.6-27b"], 4096, 8) == (64 + 8) * 48 * 21504
