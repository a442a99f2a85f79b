"""The text-model configuration of a Qwen hybrid checkpoint, read from the artifact's config.json.

Always read from the checkpoint: class defaults differ from real checkpoints (rope_theta 1e4 vs 1e7,
hidden 4096 vs 5120, ...). VLM configs nest the text model under `text_config`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field


class ConfigError(ValueError):
    pass


FAMILIES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
            "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}


@dataclass
class HybridConfig:
    family: str
    hidden: int
    layers: int
    layer_types: list[str]            # "full_attention" | "linear_attention" per layer
    vocab: int
    eps: float
    # gated attention
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # gated delta net
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_width: int
    # feed-forward
    intermediate: int = 0             # dense MLP width (0 when every layer is MoE)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    renormalize_topk: bool = True
    moe_layers: list[bool] = field(default_factory=list)
    tied_embeddings: bool = False
    max_position: int = 32768

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def is_attention(self, i: int) -> bool:
        return self.layer_types[i] == "full_attention"


def _get(cfg: dict, key: str, where: str, default=None):
    if key in cfg:
        return cfg[key]
    if default is not None:
        return default
    raise ConfigError(f"config.json: {where}{key} is missing")


def parse_config(raw: bytes | str | dict) -> HybridConfig:
    root = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
    model_type = root.get("model_type")
    text, where = root, ""
    if isinstance(root.get("text_config"), dict):
        text, where = root["text_config"], "text_config."
        model_type = text.get("model_type", model_type)
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json: unknown model_type {model_type!r} (known: {', '.join(sorted(FAMILIES))})")
    family = FAMILIES[model_type]
    g = lambda k, d=None: _get(text, k, where, d)  # noqa: E731
    layers = g("num_hidden_layers")
    interval = g("full_attention_interval", 4)
    types = text.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                        for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "linear_attention"}:
        raise ConfigError(f"config.json: {where}layer_types must list {layers} of full_attention/linear_attention")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"config.json: {where}rope_parameters.rope_theta is missing")
    if rope.get("rope_type", "default") not in ("default", None):
        raise ConfigError(f"config.json: rope_type {rope.get('rope_type')!r} is not supported (only default RoPE)")
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    head_dim = g("head_dim")
    cfg = HybridConfig(
        family=family, hidden=g("hidden_size"), layers=layers, layer_types=list(types), vocab=g("vocab_size"),
        eps=float(g("rms_norm_eps", 1e-6)), heads=g("num_attention_heads"), kv_heads=g("num_key_value_heads"),
        head_dim=head_dim, rotary_dim=int(head_dim * partial), rope_theta=float(theta),
        k_heads=g("linear_num_key_heads"), v_heads=g("linear_num_value_heads"), k_dim=g("linear_key_head_dim"),
        v_dim=g("linear_value_head_dim"), conv_width=g("linear_conv_kernel_dim"),
        tied_embeddings=bool(root.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position=int(text.get("max_position_embeddings", 32768)))
    if family == "qwen3_5":
        cfg.intermediate = g("intermediate_size")
        cfg.moe_layers = [False] * layers
    else:
        cfg.experts, cfg.experts_per_token = g("num_experts"), g("num_experts_per_tok")
        cfg.expert_intermediate = g("moe_intermediate_size")
        cfg.shared_intermediate = g("shared_expert_intermediate_size")
        if family == "qwen3_next":
            cfg.renormalize_topk = bool(text.get("norm_topk_prob", True))
            step, dense = text.get("decoder_sparse_step", 1), set(text.get("mlp_only_layers") or [])
            cfg.moe_layers = [i not in dense and cfg.experts > 0 and (i + 1) % step == 0 for i in range(layers)]
            cfg.intermediate = text.get("intermediate_size", 0)
        else:
            cfg.moe_layers = [True] * layers
    if cfg.heads % cfg.kv_heads or cfg.v_heads % cfg.k_heads:
        raise ConfigError("config.json: attention heads must be a multiple of kv heads, and GDN value heads of key heads")
    return cfg
