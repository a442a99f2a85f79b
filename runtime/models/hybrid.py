"""The decoder stack shared by the Qwen hybrid families: pre-norm residual layers, each a mixer
(gated attention on every `full_attention` layer, Gated DeltaNet otherwise) and a feed-forward block
chosen by the family file (`make_mlp`)."""
from __future__ import annotations

import torch

from .blocks import GatedAttention, GatedDeltaNet, Step, add_, linear, new, rms_norm_zc
from .config import HybridConfig


class HybridForCausalLM:
    family = "?"

    def __init__(self, cfg: HybridConfig, weights: dict, cache):
        self.cfg = cfg
        self.embed, self.norm = weights["embed"], weights["norm"]
        self.lm_head = weights["embed"] if cfg.tied_embeddings else weights["lm_head"]
        self.layers = []
        for i in range(cfg.layers):
            if cfg.is_attention(i):
                mixer = GatedAttention(cfg, weights, i, cache.kv[i])
            else:
                mixer = GatedDeltaNet(cfg, weights, i, *cache.gdn[i])
            self.layers.append((weights[f"layers.{i}.input_norm"], mixer, weights[f"layers.{i}.post_norm"],
                                self.make_mlp(cfg, weights, i)))

    def make_mlp(self, cfg: HybridConfig, weights: dict, layer: int):
        raise NotImplementedError

    def forward(self, be, ids: torch.Tensor, step: Step, logits_rows: torch.Tensor,
                hidden_out: list | None = None) -> torch.Tensor:
        """Run all layers over the step's tokens; return logits [len(logits_rows), V] for the chosen rows.
        With hidden_out, a copy of the residual stream after each layer is appended (tests)."""
        eps = self.cfg.eps
        h = new(self.embed, ids.shape[0], self.cfg.hidden)
        be.run("embedding", ids=ids, table=self.embed, y=h)
        for input_norm, mixer, post_norm, mlp in self.layers:
            add_(be, h, mixer(be, rms_norm_zc(be, h, input_norm, eps), step))
            add_(be, h, mlp(be, rms_norm_zc(be, h, post_norm, eps)))
            if hidden_out is not None:
                hidden_out.append(h.clone())
        last = h.index_select(0, logits_rows)
        return linear(be, rms_norm_zc(be, last, self.norm, eps), self.lm_head)
