"""Qwen3.5 / 3.6 MoE hybrid (e.g. Qwen3.6-35B-A3B): every layer's feed-forward is a sparse MoE
(softmax router, top-k always renormalised, shared expert gated by a sigmoid)."""
from .blocks import SparseMoE
from .hybrid import HybridForCausalLM


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    family = "qwen3_5_moe"

    def make_mlp(self, cfg, weights, prefix, layer):
        return SparseMoE(cfg, weights, prefix)
