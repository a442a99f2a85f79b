"""Qwen3.5 / 3.6 / 3.8 dense hybrid (e.g. Qwen3.6-27B): every layer's feed-forward is a dense SwiGLU."""
from .blocks import DenseMLP
from .hybrid import HybridForCausalLM


class Qwen3_5ForCausalLM(HybridForCausalLM):
    family = "qwen3_5"

    def make_mlp(self, cfg, weights, prefix, layer):
        return DenseMLP(weights, prefix)
