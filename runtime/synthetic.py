"""Random weights at a model's real shapes, built straight on the device: speed is measured at the real
Qwen3.6 shapes although no real weights can be downloaded. The names are the artifact's (recipes/)."""
from __future__ import annotations

import math

import torch

from .draft_head import DRAFT_HEAD, DRAFT_IDS
from .models.config import HybridConfig

# DESIGN.md §8 / notes/ninfer-anchor.md §1.2
SHAPES = {
    "qwen3.6-27b": HybridConfig(
        family="qwen3_5", hidden=5120, layers=64, layer_types=["full_attention" if (i + 1) % 4 == 0 else
                                                                  "linear_attention" for i in range(64)],
        vocab=248320, eps=1e-6, heads=24, kv_heads=4, head_dim=256, rotary_dim=64, rope_theta=1e7,
        k_heads=16, v_heads=48, k_dim=128, v_dim=128, conv_width=4, intermediate=17408,
        moe_layers=[False] * 64, max_position=262144),
    "qwen3.6-35b-a3b": HybridConfig(
        family="qwen3_5_moe", hidden=2048, layers=40, layer_types=["full_attention" if (i + 1) % 4 == 0 else
                                                                      "linear_attention" for i in range(40)],
        vocab=248320, eps=1e-6, heads=16, kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=1e7,
        k_heads=16, v_heads=32, k_dim=128, v_dim=128, conv_width=4, experts=256, experts_per_token=8,
        expert_intermediate=512, shared_intermediate=512, moe_layers=[True] * 40, max_position=262144),
}
TOKEN_DOMAIN = 248077


def weight_shapes(cfg: HybridConfig, mtp: bool = False) -> dict[str, tuple]:
    """name -> shape of every weight (with `mtp`, the MTP layer's too: its fc, norms and one gated-attention decoder
    layer with the family's feed-forward)."""
    H = cfg.hidden
    shapes = {"embed": (cfg.vocab, H), "norm": (H,)}
    if not cfg.tied_embeddings:
        shapes["lm_head"] = (cfg.vocab, H)
    for i in range(cfg.layers):
        shapes |= _layer_shapes(cfg, f"layers.{i}.", cfg.is_attention(i), cfg.moe_layers[i])
    if mtp:
        shapes |= {"mtp.fc": (H, 2 * H), "mtp.norm_embedding": (H,), "mtp.norm_hidden": (H,), "mtp.norm": (H,)}
        shapes |= _layer_shapes(cfg, "mtp.layers.0.", True, cfg.family != "qwen3_5")
    return shapes


def _layer_shapes(cfg: HybridConfig, p: str, attention: bool, moe: bool) -> dict[str, tuple]:
    H = cfg.hidden
    shapes = {p + "input_norm": (H,), p + "post_norm": (H,)}
    if attention:
        D = cfg.head_dim
        shapes |= {p + "attn.qkv": (2 * cfg.heads * D + 2 * cfg.kv_heads * D, H), p + "attn.q_norm": (D,),
                   p + "attn.k_norm": (D,), p + "attn.o": (H, cfg.heads * D)}
    else:
        C, V = cfg.conv_channels, cfg.v_heads * cfg.v_dim
        shapes |= {p + "gdn.in_qkv": (C, H), p + "gdn.in_z": (V, H), p + "gdn.in_b": (cfg.v_heads, H),
                   p + "gdn.in_a": (cfg.v_heads, H), p + "gdn.conv": (C, cfg.conv_width),
                   p + "gdn.A_log": (cfg.v_heads,), p + "gdn.dt_bias": (cfg.v_heads,), p + "gdn.norm": (cfg.v_dim,),
                   p + "gdn.out": (H, V)}
    if moe:
        E, I, S = cfg.experts, cfg.expert_intermediate, cfg.shared_intermediate
        shapes |= {p + "mlp.router": (E, H), p + "mlp.experts.gate_up": (E, 2 * I, H),
                   p + "mlp.experts.down": (E, H, I), p + "mlp.shared.gate_up": (2 * S, H),
                   p + "mlp.shared.down": (H, S), p + "mlp.shared.gate": (1, H)}
    else:
        shapes |= {p + "mlp.gate_up": (2 * cfg.intermediate, H), p + "mlp.down": (H, cfg.intermediate)}
    return shapes


# the matrices a recipe quantizes (recipes/*.yaml, kind quant); the embedding table stays bf16 (only the
# prompt's rows are ever read)
QUANT_SUFFIXES = ("attn.qkv", "attn.o", "gdn.in_qkv", "gdn.in_z", "gdn.out", "mlp.gate_up", "mlp.down",
                  "experts.gate_up", "experts.down", "shared.gate_up", "shared.down", "lm_head")


def packed_formats(cfg: HybridConfig, fmt: str, mtp: bool = False) -> dict[str, str]:
    """name -> packed format of the quantized weights: every QUANT_SUFFIXES matrix in `fmt` (q4, ...; none for
    bf16), or with fmt "recipe" each weight the family's recipe quantizes in its role's default format (the mix
    a converted checkpoint gets: e.g. 27B q4 / q5 / q6, 35B-A3B q4 / q5 experts and w8 elsewhere), but for the
    embedding table, which stays bf16 here (only the prompt's rows are read)."""
    if fmt == "bf16":
        return {}
    shapes = weight_shapes(cfg, mtp)
    if fmt != "recipe":
        return {name: fmt for name in shapes if name.endswith(QUANT_SUFFIXES)}
    from .recipes import load_recipe
    from .reference_quant import PACKED
    conf = hf_config(cfg)
    rec = load_recipe(cfg.family)
    present = {**rec.present_sections(rec.namespace(conf)), "mtp": mtp}   # (mtp: a checkpoint's mtp.* sections)
    return {p.name: p.default_format for p in rec.expand(conf, present)
            if p.kind == "quant" and p.default_format in PACKED and p.name in shapes and p.name != "embed"}


def random_weights(cfg: HybridConfig, device, dtype=torch.bfloat16, seed: int = 0, fmt: str = "bf16",
                   mtp: bool = False, draft_rows: int = 0) -> dict:
    """Random weights at the model's shapes (with `mtp`, the MTP layer's too); with a packed `fmt` (q4, ..., or
    "recipe": packed_formats) the quantized matrices are random packed bytes of their format
    (runtime.weights.PackedWeight). draft_rows: a q4 draft head of that many rows (ninfer-quantize
    --draft-vocab-size), its ids its row numbers."""
    from .weights import random_packed
    g = torch.Generator(device=device).manual_seed(seed)
    packed = packed_formats(cfg, fmt, mtp)
    out = {}
    for name, shape in weight_shapes(cfg, mtp).items():
        if name in packed:
            out[name] = random_packed(packed[name], shape, device, g, 1.0 / shape[-1] ** 0.5)
            continue
        if name.endswith(("A_log", "dt_bias")):
            out[name] = torch.rand(shape, generator=g, device=device, dtype=torch.float32) - 0.5
            continue
        t = torch.empty(shape, device=device, dtype=dtype)
        scale = 0.1 if "norm" in name else 1.0 / max(shape[-1], 1) ** 0.5
        out[name] = t.normal_(0.0, scale, generator=g)
    if draft_rows:
        out[DRAFT_HEAD] = random_packed("q4", (draft_rows, cfg.hidden), device, g, 1.0 / cfg.hidden ** 0.5)
        out[DRAFT_IDS] = torch.arange(draft_rows, dtype=torch.int32, device=device)
    return out


def weight_bytes(cfg: HybridConfig, fmt: str = "bf16") -> dict[str, int]:
    """Bytes of every weight as random_weights(fmt) stores it."""
    from .formats import get_format
    packed = packed_formats(cfg, fmt)
    return {name: get_format(packed[name]).nbytes(shape) if name in packed else 2 * math.prod(shape)
            for name, shape in weight_shapes(cfg).items()}


def hf_config(cfg: HybridConfig) -> dict:
    """The config.json (transformers' qwen3_5_text / qwen3_5_moe_text) of a checkpoint with these shapes:
    models.config.parse_config reads it back to `cfg`, and transformers builds the same model from it (the
    serving benchmark's peer)."""
    if cfg.family not in ("qwen3_5", "qwen3_5_moe"):
        raise ValueError(f"hf_config: family {cfg.family!r} (supported: qwen3_5, qwen3_5_moe)")
    pairs = cfg.rotary_dim // 2          # MRoPE sections split the rotary frequencies 3 ways (text: all equal)
    d = {"model_type": f"{cfg.family}_text", "architectures": ["Qwen3_5ForCausalLM" if cfg.family == "qwen3_5"
                                                               else "Qwen3_5MoeForCausalLM"],
         "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
         "layer_types": list(cfg.layer_types), "num_attention_heads": cfg.heads,
         "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
         "linear_num_key_heads": cfg.k_heads, "linear_num_value_heads": cfg.v_heads,
         "linear_key_head_dim": cfg.k_dim, "linear_value_head_dim": cfg.v_dim,
         "linear_conv_kernel_dim": cfg.conv_width, "rms_norm_eps": cfg.eps,
         "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tied_embeddings,
         "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                             "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim,
                             "mrope_section": [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3],
                             "mrope_interleaved": True},
         "bos_token_id": None, "eos_token_id": 248046, "pad_token_id": 248044}
    if cfg.family == "qwen3_5":
        d["intermediate_size"] = cfg.intermediate
    else:
        d |= {"num_experts": cfg.experts, "num_experts_per_tok": cfg.experts_per_token,
              "moe_intermediate_size": cfg.expert_intermediate,
              "shared_expert_intermediate_size": cfg.shared_intermediate}
    return d


def _role(name: str) -> str:
    if name in ("embed", "lm_head", "norm"):
        return name
    tail = name.split(".", 2)[-1]                       # layers.N.<tail>
    return {"gdn.A_log": "gdn_A_log", "gdn.dt_bias": "gdn_dt_bias"}.get(tail, tail.replace(".", "_"))


def write_artifact(cfg: HybridConfig, fmt: str, path, resources: dict[str, bytes], device, seed: int = 0) -> int:
    """A .ninfer with random weights at cfg's shapes (random_weights: packed bytes in `fmt`, or the recipe's mix,
    for the quantized matrices) and the given resources, plus config.json from hf_config. Written atomically,
    tensor by tensor (each made on `device`, then copied out). Returns the file's size."""
    import json

    from .artifact_writer import ArtifactWriter, TensorSpec
    from .weights import random_packed
    shapes = weight_shapes(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    resources = {**resources, "config.json": json.dumps(hf_config(cfg), indent=1).encode()}

    packed = packed_formats(cfg, fmt)

    def fmt_of(name):
        if name in packed:
            return packed[name]
        return "fp32" if name.endswith(("A_log", "dt_bias")) else "bf16"

    specs = [TensorSpec(n, tuple(s), fmt_of(n), _role(n)) for n, s in shapes.items()]
    with ArtifactWriter(path, cfg.family, specs, [(k, len(v)) for k, v in resources.items()]) as w:
        for spec in specs:
            shape = shapes[spec.name]
            if spec.format not in ("bf16", "fp32"):
                t = random_packed(spec.format, shape, device, g, 1.0 / shape[-1] ** 0.5).data
            elif spec.format == "fp32":
                t = torch.rand(shape, generator=g, device=device, dtype=torch.float32) - 0.5
            else:
                scale = 0.1 if "norm" in spec.name else 1.0 / max(shape[-1], 1) ** 0.5
                t = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0.0, scale, generator=g)
            w.add_tensor(spec.name, [t.contiguous().view(torch.uint8).cpu().numpy().reshape(-1)])
        for k, v in resources.items():
            w.add_resource(k, v)
        return w.total_bytes
