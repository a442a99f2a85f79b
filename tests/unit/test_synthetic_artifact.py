"""Random-weight artifacts at a model's shapes (the serving benchmark's input): the config round-trips,
transformers accepts it, and the written file loads and generates like any artifact."""
import dataclasses
import json

import pytest
import transformers as tf

from ninfer.runtime.artifact import open_artifact
from ninfer.runtime.engine import Engine
from ninfer.runtime.models.config import parse_config
from ninfer.runtime.synthetic import QUANT_SUFFIXES, SHAPES, hf_config, weight_shapes, write_artifact


def tiny_dense():
    """A 4-layer dense model at toy widths (3 GDN layers, 1 attention layer)."""
    return dataclasses.replace(SHAPES["qwen3.6-27b"], hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64,
                               rotary_dim=16, k_heads=2, v_heads=4, k_dim=32, v_dim=32, intermediate=384,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], moe_layers=[False] * 4)


def resources(demo_artifact) -> dict:
    src = open_artifact(demo_artifact)
    try:
        return {k: src.resource(k) for k in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")}
    finally:
        src.close()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_hf_config_round_trips_and_transformers_reads_it(shape):
    cfg = SHAPES[shape]
    d = hf_config(cfg)
    assert parse_config(json.dumps(d)) == cfg
    conf = tf.AutoConfig.for_model(**d)
    assert (conf.hidden_size, conf.num_hidden_layers, conf.layer_types) == (cfg.hidden, cfg.layers, cfg.layer_types)


def test_written_artifact_loads_and_generates(demo_artifact, tmp_path):
    tiny, res = tiny_dense(), resources(demo_artifact)
    path = tmp_path / "tiny.ninfer"
    size = write_artifact(tiny, "q4", path, res, "cpu")
    art = open_artifact(path)
    try:
        assert path.stat().st_size == size
        assert parse_config(art.resource("config.json")) == tiny
        assert art.resource("tokenizer.json") == res["tokenizer.json"]
        assert set(art.tensors) == set(weight_shapes(tiny))
        for name, e in art.tensors.items():
            assert e.format == ("q4" if name.endswith(QUANT_SUFFIXES) else
                                "fp32" if name.endswith(("A_log", "dt_bias")) else "bf16"), name
    finally:
        art.close()
    eng = Engine(path, backend="reference", max_context=64, max_seqs=2)
    try:
        (seq,) = eng.generate([[11, 12, 13]], max_new=6)
        assert len(seq.generated) == 6 and all(0 <= t < tiny.vocab for t in seq.generated)
    finally:
        eng.close()


def test_no_leftover_on_failure(tmp_path, monkeypatch):
    """A write that fails part-way (here the first packed matrix, after the embedding table was written)
    leaves neither the artifact nor a temp file behind."""
    import ninfer.runtime.weights as weights
    tiny = dataclasses.replace(SHAPES["qwen3.6-27b"], hidden=128, layers=1, layer_types=["full_attention"],
                               heads=2, kv_heads=1, head_dim=64, rotary_dim=16, intermediate=128, moe_layers=[False])

    def fail(*a, **k):
        raise RuntimeError("device lost")
    monkeypatch.setattr(weights, "random_packed", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        write_artifact(tiny, "q4", tmp_path / "x.ninfer", {"tokenizer.json": b"{}"}, "cpu")
    assert list(tmp_path.iterdir()) == []


def test_recipe_weights_are_the_recipes_default_mix():
    """--weights recipe: each quantized matrix in its role's default format (as a converted checkpoint), the
    embedding table bf16; a single format covers the QUANT_SUFFIXES matrices."""
    from ninfer.runtime.synthetic import packed_formats, weight_bytes
    dense = packed_formats(SHAPES["qwen3.6-27b"], "recipe")
    assert dense["lm_head"] == "q6" and "embed" not in dense
    assert (dense["layers.0.gdn.in_qkv"], dense["layers.0.gdn.in_z"], dense["layers.0.gdn.out"]) == ("q4", "q5", "q5")
    assert (dense["layers.0.mlp.gate_up"], dense["layers.0.mlp.down"], dense["layers.3.attn.qkv"]) == ("q4", "q5", "q5")
    moe = packed_formats(SHAPES["qwen3.6-35b-a3b"], "recipe")
    assert (moe["layers.0.mlp.experts.gate_up"], moe["layers.0.mlp.experts.down"]) == ("q4", "q5")
    assert (moe["layers.0.mlp.shared.gate_up"], moe["layers.0.gdn.in_qkv"], moe["lm_head"]) == ("w8", "w8", "q6")
    assert "layers.0.mlp.router" not in moe and "layers.0.mlp.shared.gate" not in moe
    q4 = packed_formats(SHAPES["qwen3.6-27b"], "q4")
    assert set(q4) == {n for n in weight_shapes(SHAPES["qwen3.6-27b"]) if n.endswith(QUANT_SUFFIXES)}
    assert packed_formats(SHAPES["qwen3.6-27b"], "bf16") == {}
    mix, all_q4 = weight_bytes(SHAPES["qwen3.6-27b"], "recipe"), weight_bytes(SHAPES["qwen3.6-27b"], "q4")
    assert mix["layers.0.mlp.down"] > all_q4["layers.0.mlp.down"] and mix["embed"] == all_q4["embed"]


def test_recipe_artifact_stores_each_format(demo_artifact, tmp_path):
    from ninfer.runtime.synthetic import packed_formats
    tiny, res = tiny_dense(), resources(demo_artifact)
    path = tmp_path / "mix.ninfer"
    write_artifact(tiny, "recipe", path, res, "cpu")
    art = open_artifact(path)
    try:
        packed = packed_formats(tiny, "recipe")
        assert {"q4", "q5", "q6"} <= set(packed.values())
        for name, e in art.tensors.items():
            assert e.format == packed.get(name, "fp32" if name.endswith(("A_log", "dt_bias")) else "bf16"), name
    finally:
        art.close()
    eng = Engine(path, backend="reference", max_context=64, max_seqs=1)
    try:
        (seq,) = eng.generate([[11, 12, 13]], max_new=4)
        assert len(seq.generated) == 4
    finally:
        eng.close()
