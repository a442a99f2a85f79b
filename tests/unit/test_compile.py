"""NVRTC needs no GPU: every generated unit must compile for sm_90a, every template for each of the five archs."""
import os
import subprocess
import sys

import pytest
import yaml

from ninfer.codegen.render import generate
from ninfer.runtime import nvrtc
from ninfer.runtime.cubins import CubinError, check_arch, compile_kernel, cubin_sm
from ninfer.runtime.manifest import Manifest

ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_120a"]
CC = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90a": 90, "sm_120a": 120}
SM89_ONLY = {"kv_cache_write_fp8.cu.j2", "quant_fp8_per_token.cu.j2"}   # E4M3 conversions (cvt ... e4m3x2): sm_89+


@pytest.fixture(scope="module")
def manifest():
    return Manifest.load()


def test_every_sm90a_unit_compiles(manifest):
    units = [k for k in manifest.kernels.values() if k.arch == "sm_90a"]
    assert units
    for k in units:
        path, _, _ = compile_kernel(k.data)
        cubin = path.read_bytes()
        assert cubin_sm(cubin) == 90
        check_arch(cubin, k.data, 90)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_template_compiles_for_each_arch(manifest, arch):
    by_template = {}
    for k in manifest.kernels.values():
        if k.arch == arch:
            by_template.setdefault(k.template, k)
    all_templates = {k.template for k in manifest.kernels.values()}
    sm90_only = {k.template for k in manifest.kernels.values()} - {k.template for k in manifest.kernels.values() if k.arch != "sm_90a"}
    absent = set() if arch == "sm_90a" else sm90_only | (SM89_ONLY if CC[arch] < 89 else set())
    assert set(by_template) == all_templates - absent
    for k in by_template.values():
        path, _, _ = compile_kernel(k.data)
        assert cubin_sm(path.read_bytes()) == CC[arch]


def test_wrong_arch_cubin_is_refused(manifest):
    k80 = next(k for k in manifest.kernels.values() if k.arch == "sm_80")
    path, _, _ = compile_kernel(k80.data)
    with pytest.raises(CubinError, match=r"was built for sm_80, but sm_80 \(sm_90\) was expected"):
        check_arch(path.read_bytes(), k80.data, 90)
    with pytest.raises(CubinError, match="not a 64-bit ELF cubin"):
        cubin_sm(b"// PTX .version 9.0")


def test_compile_error_points_to_route_template_and_line(spec_tree, tmp_path, monkeypatch):
    specs, templates = spec_tree
    t = templates / "elementwise.cu.j2"
    lines = t.read_text().split("\n")
    bad = next(i for i, ln in enumerate(lines) if "fa[i] += fb[i];" in ln)
    lines[bad] = lines[bad].replace("fa[i] += fb[i];", "fa[i] += fb[i] +* ;")
    t.write_text("\n".join(lines))
    out = tmp_path / "gen"
    m = generate(specs, templates, out)
    monkeypatch.setenv("NINFER_GENERATED", str(out))
    monkeypatch.setenv("NINFER_CACHE", str(tmp_path / "cache"))
    k = m["kernels"]["sm_90a/add/vec8.t256/bf16"]
    with pytest.raises(nvrtc.CompileError) as e:
        compile_kernel(k)
    msg = str(e.value)
    assert "routes/add.yaml: route add/vec8 tile t256 (sm_90a, bf16), template codegen/templates/elementwise.cu.j2" in msg
    assert f"[from codegen/templates/elementwise.cu.j2:{bad + 1}]" in msg, msg
    assert "error" in msg
    assert not list((tmp_path / "cache").rglob("*.cubin"))  # nothing half-written


def test_build_cli_reports_failure_and_exits_nonzero(spec_tree, tmp_path):
    specs, templates = spec_tree
    t = templates / "embedding.cu.j2"
    t.write_text(t.read_text().replace("const int id = ids[t];", "const int id = ids[t] +* ;"))
    out = tmp_path / "gen"
    generate(specs, templates, out)
    env = {**os.environ, "NINFER_GENERATED": str(out), "NINFER_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "ninfer.runtime.build", "--archs", "sm_86", "--jobs", "2"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED routes/embedding.yaml: route embedding/gather tile t128 (sm_86, bf16)" in r.stderr
    assert "embedding.cu.j2:" in r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert "1 failed" in summary and "compiled" in summary and "cached" in summary
    r = subprocess.run([sys.executable, "-m", "ninfer.runtime.build", "--archs", "sm_70"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "unknown arch(s) sm_70" in r.stderr


def test_stale_or_edited_source_is_refused(spec_tree, tmp_path, monkeypatch):
    out = tmp_path / "gen"
    m = generate(*spec_tree, out)
    monkeypatch.setenv("NINFER_GENERATED", str(out))
    monkeypatch.setenv("NINFER_CACHE", str(tmp_path / "cache"))
    k = m["kernels"]["sm_90a/add/vec8.t256/bf16"]
    (out / k["source"]).write_text("// edited\n")
    with pytest.raises(CubinError, match="does not match the manifest"):
        compile_kernel(k)


def test_compiling_leaves_python_bytes_alone():
    """NVRTC writes its log into the buffer we pass: an empty log must not clobber Python's shared b" "."""
    nvrtc.compile_cubin('extern "C" __global__ void k(int* x) { x[0] = 1; }', "k.cu", "sm_90a")
    assert bytes([32]) == b" " and b" ".decode() == " "
