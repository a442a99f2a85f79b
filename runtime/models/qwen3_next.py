"""Qwen3-Next (e.g. Qwen3-Next-80B-A3B): MoE on the layers `decoder_sparse_step` selects, dense SwiGLU on
`mlp_only_layers`; top-k renormalised only when `norm_topk_prob`. Its fused GDN projections are
un-grouped by the recipe, so the mixers are the Qwen3.5 ones."""
from .blocks import DenseMLP, SparseMoE
from .hybrid import HybridForCausalLM


class Qwen3NextForCausalLM(HybridForCausalLM):
    family = "qwen3_next"

    def make_mlp(self, cfg, weights, prefix, layer):
        # the MTP layer (layer None) is a MoE layer, as in Qwen3-Next's checkpoints
        return SparseMoE(cfg, weights, prefix) if layer is None or cfg.moe_layers[layer] else DenseMLP(weights, prefix)
