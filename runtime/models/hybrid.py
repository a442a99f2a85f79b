"""The decoder stack shared by the Qwen hybrid families: pre-norm residual layers, each a mixer
(gated attention on every `full_attention` layer, Gated DeltaNet otherwise) and a feed-forward block
chosen by the family file (`make_mlp`); and the multi-token prediction (MTP) layer that drafts tokens for
speculative decoding, where the artifact carries it."""
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
                mixer = GatedAttention(cfg, weights, f"layers.{i}.attn.", cache.kv[i])
            else:
                mixer = GatedDeltaNet(cfg, weights, i, *cache.gdn[i])
            self.layers.append((weights[f"layers.{i}.input_norm"], mixer, weights[f"layers.{i}.post_norm"],
                                self.make_mlp(cfg, weights, f"layers.{i}.mlp.", i)))
        # the MTP layer where the cache has its KV (the engine asks for both when it decodes speculatively)
        self.mtp = MtpHead(self, weights, cache.kv["mtp"]) if "mtp" in cache.kv else None

    @staticmethod
    def fuse_weights(cfg: HybridConfig, weights: dict) -> None:
        """Join matrices that one launch can read together (in place; the engine calls it before planning memory)."""
        for i in range(cfg.layers):
            if not cfg.is_attention(i):
                GatedDeltaNet.fuse_weights(weights, i)

    def make_mlp(self, cfg: HybridConfig, weights: dict, prefix: str, layer: int | None):
        """The feed-forward block whose weights are named `prefix`*: of decoder layer `layer`, or (None) the MTP layer's."""
        raise NotImplementedError

    def forward(self, be, ids: torch.Tensor, step: Step, logits_rows: torch.Tensor,
                hidden_out: list | None = None, normed: bool = False):
        """Run all layers over the step's tokens; return logits [len(logits_rows), V] for the chosen rows, and with
        `normed` also the final-normed hidden state of every token [T, H] (what the MTP layer reads).
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
        if normed:
            out = rms_norm_zc(be, h, self.norm, eps)
            return linear(be, out.index_select(0, logits_rows), self.lm_head), out
        last = h.index_select(0, logits_rows)
        return linear(be, rms_norm_zc(be, last, self.norm, eps), self.lm_head)

    def logits(self, be, hidden: torch.Tensor) -> torch.Tensor:
        """The shared lm_head over final-normed hidden states [n, H] (the MTP layer's drafts)."""
        return linear(be, hidden, self.lm_head)


class MtpHead:
    """Qwen3.5's multi-token prediction layer (checkpoint `mtp.*`; notes/model-reference.md §2.5): for the pair of
    the target's final-normed hidden h_t and token x_{t+1}, u = fc([norm_e(embed(x_{t+1})); norm_h(h_t)]), one gated
    full-attention decoder layer over u at position t (its own KV, in the same pages), and a final zero-centred norm:
    the normed hidden whose logits (the shared lm_head) draft x_{t+2}, and which a further draft step pairs with that
    draft in place of h_{t+1}. All norms zero-centred; the feed-forward is the family's (dense or MoE)."""

    def __init__(self, model: HybridForCausalLM, weights: dict, kv_cache: tuple):
        cfg, p = model.cfg, "mtp.layers.0."
        self.cfg, self.embed = cfg, model.embed
        self.fc, self.norm_e, self.norm_h, self.norm = (weights[n] for n in ("mtp.fc", "mtp.norm_embedding",
                                                                              "mtp.norm_hidden", "mtp.norm"))
        self.input_norm, self.post_norm = weights[p + "input_norm"], weights[p + "post_norm"]
        self.attn = GatedAttention(cfg, weights, p + "attn.", kv_cache)
        self.mlp = model.make_mlp(cfg, weights, p + "mlp.", None)

    def __call__(self, be, ids: torch.Tensor, hidden: torch.Tensor, step: Step) -> torch.Tensor:
        """ids [T] (token t+1 of each pair), hidden [T, H] (h_t), step at positions t: the normed outputs [T, H]."""
        eps, T = self.cfg.eps, ids.shape[0]
        e = new(hidden, T, self.cfg.hidden)
        be.run("embedding", ids=ids, table=self.embed, y=e)
        u = linear(be, torch.cat([rms_norm_zc(be, e, self.norm_e, eps), rms_norm_zc(be, hidden, self.norm_h, eps)], 1),
                   self.fc)
        x = add_rms_norm_zc(be, u, self.attn(be, rms_norm_zc(be, u, self.input_norm, eps), step), self.post_norm, eps)
        add_(be, u, self.mlp(be, x))
        return rms_norm_zc(be, u, self.norm, eps)
