"""The decoder stack shared by the Qwen hybrid families: pre-norm residual layers, each a mixer
(gated attention on every `full_attention` layer, Gated DeltaNet otherwise) and a feed-forward block
chosen by the family file (`make_mlp`)."""
from __future__ import annotations

import torch

from .blocks import GatedAttention, GatedDeltaNet, Step, add_, add_rms_norm_zc, linear, new, rms_norm_zc
from .config import HybridConfig


class HybridForCausalLM:
    family = "?"

    def __init__(self, cfg: HybridConfig, weights: dict, cache):
        self.cfg = cfg
        self.embed, self.norm = weights["embed"], weights["norm"]
        # tied: the lm_head reads the table in its stored format (packed, when it is)
        self.lm_head = weights.get("embed.packed", weights["embed"]) if cfg.tied_embeddings else weights["lm_head"]
        self.layers = []
        for i in range(cfg.layers):
            if cfg.is_attention(i):
                mixer = GatedAttention(cfg, weights, i, cache.kv[i])
            else:
                mixer = GatedDeltaNet(cfg, weights, i, *cache.gdn[i])
            self.layers.append((weights[f"layers.{i}.input_norm"], mixer, weights[f"layers.{i}.post_norm"],
                                self.make_mlp(cfg, weights, i)))

    @staticmethod
    def fuse_weights(cfg: HybridConfig, weights: dict) -> None:
        """Join matrices that one launch can read together (in place; the engine calls it before planning memory)."""
        for i in range(cfg.layers):
            if not cfg.is_attention(i):
                GatedDeltaNet.fuse_weights(weights, i)

    def make_mlp(self, cfg: HybridConfig, weights: dict, layer: int):
        raise NotImplementedError

    def forward(self, be, ids: torch.Tensor, step: Step, logits_rows: torch.Tensor,
                hidden_out: list | None = None) -> torch.Tensor:
        """Run all layers over the step's tokens; return logits [len(logits_rows), V] for the chosen rows.
        With hidden_out, a copy of the residual stream after each layer is appended (tests)."""
        eps = self.cfg.eps
        h = new(self.embed, ids.shape[0], self.cfg.hidden)
        be.run("embedding", ids=ids, table=self.embed, y=h)
        x = rms_norm_zc(be, h, self.layers[0][0], eps)
        for i, (_, mixer, post_norm, mlp) in enumerate(self.layers):
            # pre-norm residual: h += mixer(norm(h)); h += mlp(norm(h)); each add fused with the norm after it
            x = add_rms_norm_zc(be, h, mixer(be, x, step), post_norm, eps)
            out = mlp(be, x)
            if i + 1 < len(self.layers):
                x = add_rms_norm_zc(be, h, out, self.layers[i + 1][0], eps)
            else:
                add_(be, h, out)
            if hidden_out is not None:
                hidden_out.append(h.clone())
        last = h.index_select(0, logits_rows)
        return linear(be, rms_norm_zc(be, last, self.norm, eps), self.lm_head)
