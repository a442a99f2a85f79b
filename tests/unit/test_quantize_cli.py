"""ninfer-quantize end to end on tiny random checkpoints written by transformers 5.24: every
artifact tensor is checked against an expectation built here, independently of the recipes, from
the HF tensors (fusions, MoE layouts, Qwen3-Next un-grouping via HF's own code); bad inputs fail
with a message naming what is wrong and leave no file behind."""
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file


from ninfer.cli.quantize import main
from ninfer.runtime import formats as F
from ninfer.runtime.artifact import open_artifact
from ninfer.runtime.recipes import Recipe, RecipeError, load_recipe
from tests.fixtures.tiny_checkpoints import CHAT_TEMPLATE, build_all

torch.set_num_threads(1)
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    return build_all(tmp_path_factory.mktemp("tiny_ckpts"))


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def ok(result):
    assert result.exit_code == 0, result.output
    return result


def failed(result, *patterns, out=None):
    """Non-zero exit, every pattern in the message, and no output (or temp) file left."""
    assert result.exit_code != 0, result.output
    for p in patterns:
        assert re.search(p, result.output), f"{p!r} not in:\n{result.output}"
    if out is not None:
        out = Path(out)
        assert not out.exists()
        if out.parent.exists():
            assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return result


# ---------------------------------------------------------------- independent expectation
def load_sd(d: Path) -> dict:
    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update({k: v.float() for k, v in load_file(str(f)).items()})
    return sd


def _hf_ungroup(sd, key, cfg):
    """Qwen3-Next in_proj_qkvz / in_proj_ba -> (q|k|v, z, b, a) weight rows, computed by running
    HF's own fix_query_key_value_ordering on the weight (each input unit vector picks one column)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    me = SimpleNamespace(num_k_heads=cfg["linear_num_key_heads"], num_v_heads=cfg["linear_num_value_heads"],
                         head_k_dim=cfg["linear_key_head_dim"], head_v_dim=cfg["linear_value_head_dim"])
    qkvz, ba = sd[key + "in_proj_qkvz.weight"], sd[key + "in_proj_ba.weight"]
    # projected = x @ W.T with x = I (batch 1, seq = H): row t of the output is column t of W
    q, k, v, z, b, a = Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(me, qkvz.T[None], ba.T[None])
    H = qkvz.shape[1]
    rows = lambda t: t.reshape(H, -1).T  # noqa: E731
    return torch.cat([rows(q), rows(k), rows(v)]), rows(z), rows(b), rows(a)


SIMPLE = [  # (HF suffix regex, artifact suffix) inside a decoder layer / the top level
    (r"input_layernorm\.weight", "input_norm"), (r"post_attention_layernorm\.weight", "post_norm"),
    (r"linear_attn\.in_proj_qkv\.weight", "gdn.in_qkv"), (r"linear_attn\.in_proj_z\.weight", "gdn.in_z"),
    (r"linear_attn\.in_proj_b\.weight", "gdn.in_b"), (r"linear_attn\.in_proj_a\.weight", "gdn.in_a"),
    (r"linear_attn\.A_log", "gdn.A_log"), (r"linear_attn\.dt_bias", "gdn.dt_bias"),
    (r"linear_attn\.norm\.weight", "gdn.norm"), (r"linear_attn\.out_proj\.weight", "gdn.out"),
    (r"self_attn\.q_norm\.weight", "attn.q_norm"), (r"self_attn\.k_norm\.weight", "attn.k_norm"),
    (r"self_attn\.o_proj\.weight", "attn.o"), (r"mlp\.down_proj\.weight", "mlp.down"),
    (r"mlp\.gate\.weight", "mlp.router"), (r"mlp\.shared_expert\.down_proj\.weight", "mlp.shared.down"),
    (r"mlp\.shared_expert_gate\.weight", "mlp.shared.gate"), (r"mlp\.experts\.down_proj", "mlp.experts.down"),
    (r"mlp\.experts\.gate_up_proj", "mlp.experts.gate_up"),
]


def expected_tensors(d: Path) -> dict:
    """Artifact name -> float32 array, from the HF tensors and the documented mapping."""
    sd, cfg = load_sd(d), json.loads((d / "config.json").read_text())
    tcfg = cfg.get("text_config", cfg)
    P = "model.language_model." if any(k.startswith("model.language_model.") for k in sd) else "model."
    exp = {"embed": sd[P + "embed_tokens.weight"], "lm_head": sd["lm_head.weight"], "norm": sd[P + "norm.weight"]}
    layer_prefixes = {}
    for k in sd:
        m = re.match(re.escape(P) + r"layers\.(\d+)\.", k) or re.match(r"mtp\.layers\.(\d+)\.", k)
        if m:
            layer_prefixes[m.group(0)] = ("mtp." if k.startswith("mtp.") else "") + f"layers.{m.group(1)}."
    for src, dst in layer_prefixes.items():
        has = lambda s: src + s in sd  # noqa: E731
        for pat, name in SIMPLE:
            for k in sd:
                if k.startswith(src) and re.fullmatch(pat, k[len(src):]):
                    exp[dst + name] = sd[k]
        if has("self_attn.q_proj.weight"):     # [q_proj (per-head q|gate) | k | v]
            exp[dst + "attn.qkv"] = torch.cat([sd[src + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        if has("mlp.gate_proj.weight"):
            exp[dst + "mlp.gate_up"] = torch.cat([sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]])
        if has("mlp.shared_expert.gate_proj.weight"):
            exp[dst + "mlp.shared.gate_up"] = torch.cat([sd[src + "mlp.shared_expert.gate_proj.weight"],
                                                         sd[src + "mlp.shared_expert.up_proj.weight"]])
        if has("mlp.experts.0.gate_proj.weight"):
            n = len([k for k in sd if k.startswith(src + "mlp.experts.") and k.endswith(".down_proj.weight")])
            exp[dst + "mlp.experts.gate_up"] = torch.stack([torch.cat([sd[src + f"mlp.experts.{e}.gate_proj.weight"],
                                                                       sd[src + f"mlp.experts.{e}.up_proj.weight"]])
                                                            for e in range(n)])
            exp[dst + "mlp.experts.down"] = torch.stack([sd[src + f"mlp.experts.{e}.down_proj.weight"] for e in range(n)])
        if has("linear_attn.conv1d.weight"):
            exp[dst + "gdn.conv"] = sd[src + "linear_attn.conv1d.weight"][:, 0, :]
        if has("linear_attn.in_proj_qkvz.weight"):
            (exp[dst + "gdn.in_qkv"], exp[dst + "gdn.in_z"], exp[dst + "gdn.in_b"],
             exp[dst + "gdn.in_a"]) = _hf_ungroup(sd, src + "linear_attn.", tcfg)
    for a, b in [("mtp.fc", "mtp.fc.weight"), ("mtp.norm_embedding", "mtp.pre_fc_norm_embedding.weight"),
                 ("mtp.norm_hidden", "mtp.pre_fc_norm_hidden.weight"), ("mtp.norm", "mtp.norm.weight")]:
        if b in sd:
            exp[a] = sd[b]
    for k, v in sd.items():
        if k.startswith("model.visual."):
            name = k[len("model."):].replace("patch_embed.proj", "patch_embed").replace("linear_fc", "fc")
            name = re.sub(r"\.weight$", "", name)
            exp[name] = v.reshape(v.shape[0], -1) if name == "visual.patch_embed" else v
    return {k: v.numpy().astype(np.float32) for k, v in exp.items()}


def check_artifact(path: Path, ckpt: Path, expect_formats=None):
    exp = expected_tensors(ckpt)
    with open_artifact(path) as a:
        a.verify()
        assert set(a.tensors) == set(exp), (sorted(set(a.tensors) ^ set(exp)))
        for name, t in a.tensors.items():
            src = exp[name]
            assert t.shape == src.shape, name
            err = np.abs(a.decode(name).astype(np.float64) - src)
            assert (err <= F.get_format(t.format).error_bound(src)).all(), (name, t.format, err.max())
            assert t.flags == (("mtp",) if name.startswith("mtp.") else ("visual",) if name.startswith("visual.") else ())
            if expect_formats and t.role in expect_formats:
                assert t.format == expect_formats[t.role], (name, t.format)
        return dict(a.tensors)


# ---------------------------------------------------------------- conversions
@pytest.mark.parametrize("kind,recipe,formats", [
    ("dense", "qwen3_5", {"embed": "q6", "mlp_gate_up": "q4", "mlp_down": "q5", "mtp_attn_qkv": "w8", "norm": "fp32"}),
    ("dense_vlm", "qwen3_5", {"attn_qkv": "q5", "visual_qkv": "w8", "visual_pos_embed": "bf16"}),
    ("moe", "qwen3_5_moe", {"experts_gate_up": "q4", "experts_down": "q5", "moe_router": "fp32"}),
    ("moe_fused", "qwen3_5_moe", {"experts_gate_up": "q4", "shared_gate": "bf16"}),
    ("next", "qwen3_next", {"gdn_in_qkv": "w8", "gdn_in_b": "bf16", "mlp_gate_up": "q4"}),
])
def test_convert_every_family(ckpts, tmp_path, kind, recipe, formats):
    out = tmp_path / f"{kind}.ninfer"
    r = ok(cli("convert", ckpts[kind], "-o", out))
    assert f"wrote {out}" in r.output
    check_artifact(out, ckpts[kind], formats)
    with open_artifact(out) as a:
        assert a.model_family == recipe
        assert a.resource("recipe.yaml") == (RECIPES / f"{recipe}.yaml").read_bytes()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                     "config.json"):
            assert a.resource(name) == (ckpts[kind] / name).read_bytes(), name
    assert ok(cli("verify", out)).output.startswith("OK ")


def test_roles_and_layout_details(ckpts, tmp_path):
    out = tmp_path / "d.ninfer"
    ok(cli("convert", ckpts["dense"], "-o", out))
    with open_artifact(out) as a:
        roles = {n: t.role for n, t in a.tensors.items()}
        assert roles["layers.3.attn.qkv"] == "attn_qkv" and roles["layers.0.gdn.A_log"] == "gdn_A_log"
        assert roles["mtp.layers.0.attn.qkv"] == "mtp_attn_qkv" and roles["mtp.norm"] == "mtp_norm"
        assert roles["mtp.layers.0.input_norm"] == "mtp_norm" and roles["mtp.fc"] == "mtp_fc"
        assert a.tensors["layers.3.attn.qkv"].shape == (4 * 64 * 2 + 2 * 2 * 64, 256)
        assert a.tensors["layers.0.gdn.conv"].shape == (256, 4)
        assert not any(n.startswith(("layers.3.gdn", "layers.0.attn")) for n in a.tensors)   # hybrid 3:1


def test_text_and_vlm_checkpoints_share_text_names(ckpts, tmp_path):
    ok(cli("convert", ckpts["dense"], "-o", tmp_path / "t.ninfer", "--skip", "mtp"))
    ok(cli("convert", ckpts["dense_vlm"], "-o", tmp_path / "v.ninfer", "--skip", "visual"))
    with open_artifact(tmp_path / "t.ninfer") as t, open_artifact(tmp_path / "v.ninfer") as v:
        assert {n: e.shape for n, e in t.tensors.items()} == {n: e.shape for n, e in v.tensors.items()}
    ok(cli("verify", tmp_path / "v.ninfer"))


def test_fused_and_per_expert_moe_give_identical_bytes(ckpts, tmp_path):
    ok(cli("convert", ckpts["moe"], "-o", tmp_path / "a.ninfer", "--format", "q5"))
    ok(cli("convert", ckpts["moe_fused"], "-o", tmp_path / "b.ninfer", "--format", "q5"))
    with open_artifact(tmp_path / "a.ninfer") as a, open_artifact(tmp_path / "b.ninfer") as b:
        assert {n: t.sha256 for n, t in a.tensors.items()} == {n: t.sha256 for n, t in b.tensors.items()}


@pytest.mark.parametrize("fmt", F.WEIGHT_FORMATS)
def test_every_format_on_a_vlm_checkpoint(ckpts, tmp_path, fmt):
    out = tmp_path / "m.ninfer"
    ok(cli("convert", ckpts["dense_vlm"], "-o", out, "--format", fmt, "--no-progress"))
    tensors = check_artifact(out, ckpts["dense_vlm"])
    quant = [t for t in tensors.values() if t.role not in ("norm", "conv", "gdn_A_log", "gdn_dt_bias", "gdn_in_a",
                                                            "gdn_in_b", "visual_norm", "visual_bias", "visual_pos_embed")]
    assert quant and all(t.format == fmt for t in quant)
    assert all(t.format in ("fp32", "bf16") for t in tensors.values() if t.role in ("norm", "visual_bias"))


def test_overrides(ckpts, tmp_path):
    out = tmp_path / "m.ninfer"
    ok(cli("convert", ckpts["dense"], "-o", out, "--format", "q4", "--override", "mtp_*=q6",
           "--override", "lm_head=w8", "--override", "norm=bf16"))
    with open_artifact(out) as a:
        fm = {n: t.format for n, t in a.tensors.items()}
    assert fm["lm_head"] == "w8" and fm["embed"] == "q4" and fm["layers.0.mlp.down"] == "q4"
    assert fm["mtp.layers.0.mlp.down"] == "q6" and fm["mtp.fc"] == "q6"
    assert fm["mtp.norm"] == "fp32"             # the glob skips roles that may not be quantized
    assert fm["layers.0.input_norm"] == "bf16"
    check_artifact(out, ckpts["dense"])


def test_dry_run_inspect_and_progress(ckpts, tmp_path):
    out = tmp_path / "m.ninfer"
    r = ok(cli("convert", ckpts["moe"], "-o", out, "--dry-run"))
    assert not out.exists()
    assert re.search(r"layers\.0\.mlp\.experts\.gate_up\s+\[8, 256, 256\]\s+experts_gate_up\s+q4", r.output)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight (+15)" in r.output
    r = ok(cli("convert", ckpts["moe"], "-o", out))
    assert "converting 82 tensors" in r.output   # 66 of the text model, 16 of its MTP layer
    r = ok(cli("inspect", out))
    assert re.search(r"experts_gate_up\s+q4\s+4\s+2,097,152\s+[\d.]+\s+4\.250", r.output)
    assert "tokenizer.json" in r.output and "family qwen3_5_moe" in r.output


def test_missing_optional_resources_are_noted(ckpts, tmp_path):
    src = tmp_path / "ck"
    shutil.copytree(ckpts["next"], src)
    (src / "chat_template.jinja").unlink()
    (src / "tokenizer.json").unlink()
    r = ok(cli("convert", src, "-o", tmp_path / "m.ninfer"))
    assert "optional resource tokenizer.json not found" in r.output
    assert "optional resource chat_template.jinja not found" in r.output
    with open_artifact(tmp_path / "m.ninfer") as a:
        assert sorted(a.resources) == ["config.json", "generation_config.json", "recipe.yaml", "tokenizer_config.json"]


def test_chat_template_bytes_are_exotic():
    raw = CHAT_TEMPLATE.encode()
    assert b"\r\n" in raw and any(b > 127 for b in raw)   # so the byte-for-byte checks above mean something


def test_console_script_runs_in_a_subprocess(ckpts, tmp_path):
    exe = Path(sys.executable).with_name("ninfer-quantize")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ninfer.cli.quantize"]
    p = subprocess.run(cmd + ["convert", str(ckpts["next"]), "-o", str(tmp_path / "m.ninfer"), "--format", "w8"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(cmd + ["verify", str(tmp_path / "m.ninfer")], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("OK"), p.stderr


# ---------------------------------------------------------------- verify against the recipe
def _rewrite_shape(path, name, shape):
    raw = path.read_bytes()
    n = int.from_bytes(raw[8:16], "little")
    doc = json.loads(raw[16:16 + n])
    next(t for t in doc["tensors"] if t["name"] == name)["shape"] = shape
    js = json.dumps(doc, separators=(",", ":")).encode()
    js += b" " * (n - len(js))                  # same length: payload stays where it is
    path.write_bytes(raw[:16] + js + raw[16 + n:])


def test_verify_reports_inventory_mismatch(ckpts, tmp_path):
    out = tmp_path / "n.ninfer"
    ok(cli("convert", ckpts["next"], "-o", out))
    # qwen3_5_moe makes every layer MoE; this Qwen3-Next model has a dense layer 1
    failed(cli("verify", out, "--recipe", "qwen3_5_moe"), r"does not match recipe qwen3_5_moe",
           r"missing tensor 'layers.1.mlp.router'", r"unexpected tensor 'layers.1.mlp.gate_up'")


def test_verify_checks_inventory_and_digests(ckpts, tmp_path):
    out = tmp_path / "m.ninfer"
    ok(cli("convert", ckpts["dense"], "-o", out))
    failed(cli("verify", out, "--recipe", "qwen3_5_moe"), r"config.json has no text key 'num_experts'")
    _rewrite_shape(out, "layers.0.gdn.in_qkv", [256, 250])     # same byte count in q4: only the recipe notices
    failed(cli("verify", out), r"'layers.0.gdn.in_qkv' has shape \[256, 250\], recipe expects \[256, 256\]")
    _rewrite_shape(out, "layers.0.gdn.in_qkv", [256, 256])
    ok(cli("verify", out))
    with open_artifact(out) as a:
        t = a.tensors["layers.2.mlp.down"]
        pos = a.payload_offset + t.offset + 100
    raw = bytearray(out.read_bytes())
    raw[pos] ^= 1
    out.write_bytes(bytes(raw))
    failed(cli("verify", out), r"tensor 'layers.2.mlp.down' sha256 mismatch")
    out.write_bytes(b"NOTNINFR" + bytes(raw[8:]))
    failed(cli("inspect", out), r"bad magic")


# ---------------------------------------------------------------- bad input
@pytest.fixture
def bad(ckpts, tmp_path):
    """A private copy of the dense checkpoint to break, and a function to rewrite its main file."""
    src = tmp_path / "ck"
    shutil.copytree(ckpts["dense"], src)

    def edit(fn):
        sd = load_file(str(src / "model.safetensors"))
        fn(sd)
        save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    return SimpleNamespace(dir=src, edit=edit, out=tmp_path / "out" / "m.ninfer")


@pytest.fixture(autouse=True)
def _out_dir(tmp_path):
    (tmp_path / "out").mkdir()


def test_bad_missing_tensor(bad):
    bad.edit(lambda sd: sd.pop("model.layers.3.self_attn.k_proj.weight"))
    failed(cli("convert", bad.dir, "-o", bad.out),
           r"missing tensor 'model.layers.3.self_attn.k_proj.weight'.*needed for layers.3.attn.qkv", out=bad.out)


def test_bad_extra_tensor(bad):
    bad.edit(lambda sd: sd.update({"model.layers.0.mlp.bias": torch.zeros(4)}))
    failed(cli("convert", bad.dir, "-o", bad.out),
           r"unexpected tensor 'model.layers.0.mlp.bias' \(shape \[4\]\) is not mapped by recipe qwen3_5", out=bad.out)


def test_bad_shape(bad):
    bad.edit(lambda sd: sd.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(511, 256)}))
    failed(cli("convert", bad.dir, "-o", bad.out),
           r"'model.layers.1.mlp.up_proj.weight' has shape \[511, 256\], expected \[I, H\] = \[512, 256\]",
           out=bad.out)


def test_bad_dtype(bad):
    bad.edit(lambda sd: sd.update({"model.norm.weight": torch.zeros(256, dtype=torch.int32)}))
    failed(cli("convert", bad.dir, "-o", bad.out), r"tensor 'model.norm.weight' has dtype I32; weights must be one of",
           out=bad.out)


def test_bad_truncated_safetensors(bad):
    p = bad.dir / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])
    failed(cli("convert", bad.dir, "-o", bad.out), r"model.safetensors: tensor '.*' needs data bytes.*truncated",
           out=bad.out)


def test_bad_corrupt_header(bad):
    p = bad.dir / "mtp.safetensors"
    raw = bytearray(p.read_bytes())
    raw[8:12] = b"\xff\xfe{{"
    p.write_bytes(bytes(raw))
    failed(cli("convert", bad.dir, "-o", bad.out), r"mtp.safetensors: corrupt safetensors header", out=bad.out)


def test_bad_missing_shard(ckpts, tmp_path):
    src = tmp_path / "ck"
    shutil.copytree(ckpts["dense_vlm"], src)
    (src / "model-00003-of-00025.safetensors").unlink()
    out = tmp_path / "out" / "m.ninfer"
    failed(cli("convert", src, "-o", out), r"lists shard 'model-00003-of-00025.safetensors', which is missing", out=out)


def test_bad_config(bad):
    cfg = json.loads((bad.dir / "config.json").read_text())
    (bad.dir / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    failed(cli("convert", bad.dir, "-o", bad.out), r"unknown model_type 'llama'.*recipes know: .*qwen3_5_text",
           out=bad.out)
    (bad.dir / "config.json").write_text("{not json")
    failed(cli("convert", bad.dir, "-o", bad.out), r"config.json: not valid JSON", out=bad.out)
    (bad.dir / "config.json").unlink()
    failed(cli("convert", bad.dir, "-o", bad.out), r"config.json: missing", out=bad.out)
    (bad.dir / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    failed(cli("convert", bad.dir, "-o", bad.out), r"config.json has no text key 'hidden_size'", out=bad.out)


def test_bad_non_finite_weight(bad):
    def poison(sd):
        w = sd["model.layers.2.linear_attn.out_proj.weight"].clone()
        w[7, 33] = float("nan")
        sd["model.layers.2.linear_attn.out_proj.weight"] = w
    bad.edit(poison)
    failed(cli("convert", bad.dir, "-o", bad.out),
           r"source tensor 'model.layers.2.linear_attn.out_proj.weight' element \[7, 33\] is nan.*layers.2.gdn.out",
           out=bad.out)


def test_bad_scale_overflow(bad):
    bad.edit(lambda sd: sd["lm_head.weight"].__setitem__((5, 5), 1e9))
    failed(cli("convert", bad.dir, "-o", bad.out, "--format", "q4"), r"tensor 'lm_head'.*exceeds the FP16 maximum",
           out=bad.out)


def test_bad_options(bad):
    failed(cli("convert", bad.dir, "-o", bad.out, "--format", "int3"), r"Invalid value for '--format'.*'int3'",
           out=bad.out)
    failed(cli("convert", bad.dir, "-o", bad.out, "--override", "attention=q4"),
           r"no role matches 'attention'.*roles: .*attn_qkv", out=bad.out)
    failed(cli("convert", bad.dir, "-o", bad.out, "--override", "gdn_A_log=q4"),
           r"role gdn_A_log is float and may only use fp32, bf16", out=bad.out)
    failed(cli("convert", bad.dir, "-o", bad.out, "--override", "embed=q7"), r"embed=q7: unknown format", out=bad.out)
    failed(cli("convert", bad.dir, "-o", bad.out, "--override", "embed"), r"expected ROLE=FORMAT", out=bad.out)
    failed(cli("convert", bad.dir, "-o", bad.out, "--recipe", "llama"), r"no recipe 'llama'.*available: qwen3_5",
           out=bad.out)
    failed(cli("convert", bad.dir / "nope", "-o", bad.out), r"nope: not a directory", out=bad.out)
    failed(cli("convert", bad.dir), r"missing -o/--output")


def test_failed_conversion_keeps_existing_output(bad):
    ok(cli("convert", bad.dir, "-o", bad.out))
    before = bad.out.read_bytes()
    bad.edit(lambda sd: sd["model.norm.weight"].__setitem__(0, float("inf")))
    r = cli("convert", bad.dir, "-o", bad.out)
    assert r.exit_code != 0 and "'model.norm.weight' element [0] is inf" in r.output
    assert bad.out.read_bytes() == before
    assert [p.name for p in bad.out.parent.iterdir()] == ["m.ninfer"]


@contextmanager
def unwritable_dir(base: Path):
    """A directory this process cannot create files in, even as root (chattr +i), else skip."""
    d = base / "ro"
    d.mkdir()
    os.chmod(d, 0o555)
    immutable = False

    def writable(p):
        try:
            (p / ".probe").touch()
        except OSError:
            return False
        (p / ".probe").unlink()
        return True
    try:
        if writable(d) and shutil.which("chattr"):
            immutable = subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0
        if writable(d):
            pytest.skip("cannot make an unwritable directory on this machine")
        yield d
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(d)], check=True)
        os.chmod(d, 0o755)


def test_bad_read_only_output_dir(bad, tmp_path):
    with unwritable_dir(tmp_path) as d:
        out = d / "m.ninfer"
        failed(cli("convert", bad.dir, "-o", out), r"cannot create a file in .*ro", out=out)
        assert list(d.iterdir()) == []


# ---------------------------------------------------------------- recipes as data
def test_recipes_at_real_shapes():
    from ninfer.cli.quantize_bench import synthetic_config
    rec, cfg = synthetic_config("qwen3.6-27b", 64, None)
    shapes = {p.name: p.shape for p in load_recipe(rec).expand(cfg, {})}
    assert shapes["layers.3.attn.qkv"] == (14336, 5120) and shapes["layers.3.attn.o"] == (5120, 6144)
    assert shapes["layers.0.gdn.in_qkv"] == (10240, 5120) and shapes["layers.0.gdn.conv"] == (10240, 4)
    assert shapes["layers.0.gdn.in_z"] == (6144, 5120) and shapes["layers.0.gdn.in_a"] == (48, 5120)
    assert shapes["layers.63.mlp.gate_up"] == (34816, 5120) and shapes["embed"] == (248320, 5120)
    assert sum("attn.qkv" in n for n in shapes) == 16 and sum("gdn.in_qkv" in n for n in shapes) == 48
    rec, cfg = synthetic_config("qwen3.6-35b-a3b", 40, None)
    shapes = {p.name: p.shape for p in load_recipe(rec).expand(cfg, {})}
    assert shapes["layers.0.mlp.experts.gate_up"] == (256, 1024, 2048)
    assert shapes["layers.39.mlp.experts.down"] == (256, 2048, 512)
    assert shapes["layers.7.attn.qkv"] == (9216, 2048) and shapes["layers.0.mlp.router"] == (256, 2048)


@pytest.mark.parametrize("edit,pattern", [
    (lambda t: t.replace("model_types:", "model_kinds:"), r"unknown key\(s\) \['model_kinds'\]"),
    (lambda t: t.replace("{kind: float, format: fp32}", "{kind: float, format: q4}", 1),
     r"roles.norm.format 'q4' not allowed for kind float"),
    (lambda t: t.replace("role: attn_o,", "role: attn_out,"), r"role 'attn_out' is not in roles"),
    (lambda t: t.replace("rules: decoder_layer", "rules: decoder"), r"rules 'decoder' is not a rule_set"),
    (lambda t: t.replace('shape: [QKV, H], when: "mixer', 'shap: [QKV, H], when: "mixer', 1),
     r"unknown key\(s\) \['shap'\]"),
])
def test_recipe_schema_errors_name_file_and_key(edit, pattern):
    text = (RECIPES / "qwen3_5.yaml").read_text()
    with pytest.raises(RecipeError, match=pattern) as e:
        Recipe(edit(text), "broken.yaml")
    assert "broken.yaml" in str(e.value)


def test_recipe_shape_expressions_are_checked(ckpts):
    cfg = json.loads((ckpts["next"] / "config.json").read_text())
    rec = load_recipe("qwen3_next")
    with pytest.raises(RecipeError, match=r"in_qkv.*sources hold 65536 elements, shape \[288, 256\] needs 73728"):
        rec.expand(dict(cfg, linear_num_value_heads=5), {})      # 5 value heads do not split over 2 key heads
