"""The building blocks of the Qwen hybrid decoders, each a short sequence of dispatched ops.

A block holds its weights (device tensors) and runs on a backend (`cuda` kernels or the torch
`reference`) through `be.run(op, ...)`; nothing here does math itself. Activations are token-major
[T, width]; a step's per-token and per-sequence metadata lives in `Step`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..draft_head import DRAFT_HEAD
from ..reference_quant import moe_op
from ..weights import PackedWeight, cat_rows, split_rows
from .config import HybridConfig


@dataclass
class Step:
    """One forward step over T tokens from S sequences (each sequence's tokens contiguous and in order)."""
    positions: torch.Tensor      # [T] i32 position of each token in its sequence
    token_seq: torch.Tensor      # [T] i32 index (0..S-1) of each token's sequence
    query_start: torch.Tensor    # [S+1] i32 token offsets of the sequences
    slot_mapping: torch.Tensor   # [T] i32 KV-cache slot (page * page_size + offset) of each token
    block_table: torch.Tensor    # [S, MB] i32 KV pages of each sequence
    state_slots: torch.Tensor    # [S] i32 GDN state slot of each sequence
    decode: bool = False         # every sequence has exactly one token (T == S): fused decode ops apply
    # a speculative verify step: GDN layers run gdn_verify with `commit` ([S] zeros: the states read, none written)
    # and append (themselves, their input, its [q|k|v|z] projection) to `keep` for the round's commit (commit_round)
    keep: list | None = None
    commit: torch.Tensor | None = None
    run: int = 0                 # tokens per sequence where all have as many (a static verify step's K + 1), else 0


def new(like: torch.Tensor, *shape, dtype=None) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype or like.dtype, device=like.device)


# Prefill over a packed weight: from this many tokens on, decoding the matrix once into a scratch (one
# memory-bound pass) and running the dense GEMM (wgmma on Hopper, ~600 TFLOP/s) beats the fused-dequant
# mma.sync route (~200 TFLOP/s); matrices above the byte cap (the lm_head when every row's logits are wanted)
# stay on the fused route rather than take a multi-GB scratch. The rates are measured (PERF_NOTES.md,
# 2026-12-01); the crossover at 256 tokens is estimated from them, not swept.
DEQUANT_MIN_T = 256
DEQUANT_MAX_BYTES = 512 << 20


def _env_tokens(name: str, default: int | None) -> int | None:
    """A token count from the environment (A/B runs): `default` when unset, None for "off"."""
    v = os.environ.get(name)
    if v is None:
        return default
    if v == "off":
        return None
    if not v.isdigit():
        raise ValueError(f"{name}={v!r}: expected a token count (0, 1, 2, ...) or 'off'")
    return int(v)


# Packed MoE experts (SparseMoE.packed_experts): up to MOE_SPLIT_MAX_T tokens they run split in two launches
# (moe_gate_up_<fmt>, moe_down_<fmt>) whose blocks cover every SM; from MOE_GROUPED_MIN_T tokens on, grouped by
# expert (moe_align, moe_gate_up_grouped_<fmt>, moe_down_grouped_<fmt>, moe_sum); in between, and while a form
# is off (0 / None), the token-centric single op moe_experts_<fmt>. The crossovers, H200, 35B-A3B q4
# (PERF_NOTES.md, session 9): split beats moe_experts at every T up to 64 (T = 1: 12.9 vs 43.8 us; T = 64: 351 vs
# 362 us), grouped beats split somewhere between 64 and 128 tokens and moe_experts 4.5x at 1024.
# NINFER_MOE_SPLIT_MAX_T / NINFER_MOE_GROUPED_MIN_T override them (a token count or "off"; A/B runs).
MOE_SPLIT_MAX_T = _env_tokens("NINFER_MOE_SPLIT_MAX_T", 64) or 0
MOE_GROUPED_MIN_T = _env_tokens("NINFER_MOE_GROUPED_MIN_T", 65)
# A MoE block returns its routed sum and gated shared expert unsummed (GatedSum) and the residual add-norm after it
# sums them (sigmoid_gate_add_rms_norm_zc: one launch a layer fewer than sigmoid_gate_add + add_rms_norm_zc, the
# same bf16 results). H200, 35B-A3B q4 (PERF_NOTES.md, session 36): C = 1 step 2.41 -> 2.38 ms, C = 8 4.25 -> 4.21.
# NINFER_MOE_GATE_ADD_NORM=0 turns it off (A/B runs).
MOE_GATE_ADD_NORM = os.environ.get("NINFER_MOE_GATE_ADD_NORM", "1") == "1"


# Attention of steps up to ATTN_SPLIT_MAX_T tokens (decode batches) as flash decoding: paged_attention_split cuts each
# token's keys into attn_splits(T, kv heads) splits, one block each, and merge_attn_states combines them (and applies
# the output gate), where paged_attention ran one cluster of 8 blocks per (token, kv head): 16 (35B-A3B) to 64 SMs
# busy. H200, q4, 8K context, attn_splits' 128 blocks / at most 32 splits (PERF_NOTES.md, session 11, one A/B run,
# off in brackets): 27B C=1 163.3 (151.2), C=8 637.7 (643.7); 35B-A3B C=1 403.6 (376.0), C=8 1,604 (1,499);
# 256/64 and 512/64 were no better. NINFER_ATTN_SPLIT_MAX_T=off turns it off.
ATTN_SPLIT_MAX_T = _env_tokens("NINFER_ATTN_SPLIT_MAX_T", 8) or 0
# Blocks per step to aim for and the most splits per token (NINFER_ATTN_SPLIT_BLOCKS / NINFER_ATTN_SPLIT_MAX_KS: A/B runs).
ATTN_SPLIT_BLOCKS = _env_tokens("NINFER_ATTN_SPLIT_BLOCKS", 128) or 128
ATTN_SPLIT_MAX_KS = _env_tokens("NINFER_ATTN_SPLIT_MAX_KS", 32) or 32


# The SwiGLU up projection of steps from SWIGLU_MIN_T tokens (prefill) as one GEMM with the activation in its
# epilogue (linear_swiglu), where the backend has it: the [T, 2I] projection is neither rounded nor written and
# read back. Below it, and without the op, the projection then silu_and_mul. NINFER_SWIGLU_MIN_T: A/B runs.
SWIGLU_MIN_T = _env_tokens("NINFER_SWIGLU_MIN_T", DEQUANT_MIN_T)
# Below it the fused op runs only where its table sends T to a route sized for decode and verify batches: the GEMVs and
# wgmma_rs_decode (wgmma_rs's 256-token tiles in a table's upper spans are prefill tiles: at a decode step they would
# pad the tokens to 256; there the projection's own decode route runs, then silu_and_mul).
DECODE_FUSED_ROUTES = ("gemv", "wgmma_rs_decode")


# Attention of a verify step (Step.run > 1) as paged_attention_verify: a block takes up to 16 // G of a lane's tokens
# (G query heads a kv head) as the rows of its tile, so a key read serves several of the lane's K + 1 tokens where
# paged_attention_split reads the lane's keys once per token. H100, 8K context (PERF_NOTES.md, session 30): 27B one
# lane of 4 tokens 52.9 -> 27.6 us, two lanes 99.5 -> 43.3; 35B-A3B 31.4 -> 21.5 and 54.0 -> 29.5 (the GPU tests of
# every route pass). NINFER_ATTN_VERIFY=0 turns it off (A/B runs).
ATTN_VERIFY = os.environ.get("NINFER_ATTN_VERIFY", "1") == "1"


def attn_splits(T: int, kv_heads: int) -> int:
    """Splits per token: the power of two at or below ATTN_SPLIT_BLOCKS / (T * kv_heads), clamped to 8..ATTN_SPLIT_MAX_KS."""
    ks = max(1, ATTN_SPLIT_BLOCKS // (T * kv_heads))
    return min(ATTN_SPLIT_MAX_KS, max(8, 1 << (ks.bit_length() - 1)))


def verify_splits(T: int, L: int, heads: int, kv_heads: int) -> int:
    """paged_attention_verify's splits per token: attn_splits over its blocks' rows of tokens (a block takes
    R = min(L, 16 // G) of a lane's L tokens, G = heads // kv_heads) in place of the tokens."""
    r = min(L, max(1, 16 // (heads // kv_heads)))
    return attn_splits(T // L * -(-L // r), kv_heads)


# The shared expert on a second CUDA stream beside the routed experts: a fork and a join, which a decode graph
# captures as two parallel branches. H200, 35B-A3B q4, 8K context (PERF_NOTES.md, session 10): decode C=1
# 355.5 -> 359.3 tok/s, C=8 1,384.7 -> 1,425.7 (one A/B run each: gains about the size of the run-to-run spread).
# The fork comes after the router and top-k, which otherwise share the SMs with the shared expert on the serial
# chain (session 18, two runs each: C=1 411.4 / 411.8 -> 421.3 / 420.1 tok/s, C=8 1,691.0 / 1,698.4 -> 1,726.3 /
# 1,715.0). NINFER_MOE_SHARED_STREAM=0 turns it off.
MOE_SHARED_STREAM = os.environ.get("NINFER_MOE_SHARED_STREAM", "1") == "1"
_SIDE_STREAMS: dict = {}


def side_stream(x: torch.Tensor, use: str = "moe"):
    """The device's stream for one kind of work beside the current stream's (`use`: "moe", the shared expert;
    "commit", a speculative round's GDN commit: each its own, so neither waits for the other in stream order), or
    None (CPU tensors, or the MoE fork turned off)."""
    if x.device.type != "cuda" or use == "moe" and not MOE_SHARED_STREAM:
        return None
    key = (x.device, use)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(x.device)
    return _SIDE_STREAMS[key]


def dequant_scratch_bytes(weights: dict) -> int:
    """The largest bf16 scratch a prefill decodes a packed matrix into (linear below): memory planning keeps it free.
    The MTP draft head runs at decode sizes only (a lane's last rows), never decoded."""
    sizes = [2 * w.matrix[0] * w.matrix[1] for name, w in weights.items()
             if isinstance(w, PackedWeight) and name != DRAFT_HEAD]
    return max([s for s in sizes if s <= DEQUANT_MAX_BYTES], default=0)


def prefill_workspace_bytes(be, cfg: HybridConfig, T: int, S: int) -> int:
    """The backend's workspace for the model's ops at a step of T tokens over S sequences (the GDN delta rule's
    chunked_scan route keeps its per-chunk matrices there): one buffer serves them all, so the largest."""
    return be.workspace_bytes("gdn_delta_rule", T=T, S=S, HV=cfg.v_heads, DK=cfg.k_dim, DV=cfg.v_dim)


# Prefill GEMMs straight over packed weights where the backend's route decodes them inside the GEMM (takes_packed:
# linear_q4 / linear_swiglu_q4 on wgmma_rs), instead of dequant_<fmt> into a scratch and the dense GEMM. H200, 27B q4
# prefill 8K (PERF_NOTES.md, session 15): 10,368-10,462 tok/s off, 11,108 on. NINFER_PACKED_PREFILL: 0 (off),
# 1 (every such op, the default) or comma-separated op names (A/B runs).
_PACKED_ENV = os.environ.get("NINFER_PACKED_PREFILL", "1")
PACKED_PREFILL = {"0": False, "1": True}.get(_PACKED_ENV, set(_PACKED_ENV.split(",")))


def takes_packed(be, op: str, **dims) -> bool:
    on = PACKED_PREFILL if isinstance(PACKED_PREFILL, bool) else op in PACKED_PREFILL
    return on and be.takes_packed(op, **dims)


# FP8 weights on FP8 tensor cores (W8A8, as vLLM runs FP8 checkpoints on Hopper): prefill steps from FP8_W8A8_MIN_T
# tokens quantize the activations per token (quant_fp8_per_token) and run the E4M3 GEMM (linear_fp8_w8a8) where the
# backend admits it, instead of dequant_fp8 + the bf16 GEMM; the activations' E4M3 rounding (~2^-4 relative) is the
# price. H200, 27B fp8 prefill 8K (PERF_NOTES.md, session 26): 14,747 tok/s on against 10,078 off; the tiny dense
# model's KL to its bf16 artifact 0.0034 against 0.0021 nats/token. NINFER_FP8_W8A8_MIN_T=off turns it off.
FP8_W8A8_MIN_T = _env_tokens("NINFER_FP8_W8A8_MIN_T", 256)


def w8a8(be, x, w) -> bool:
    """Whether y = x·wᵀ runs on FP8 tensor cores (FP8_W8A8_MIN_T above)."""
    if FP8_W8A8_MIN_T is None or not isinstance(w, PackedWeight) or w.fmt != "fp8" or x.shape[0] < FP8_W8A8_MIN_T:
        return False
    n, k = w.matrix
    return be.admits("quant_fp8_per_token", T=x.shape[0], K=k) and be.admits("linear_fp8_w8a8", T=x.shape[0], N=n, K=k)


def dense_weight(be, x, w):
    """The bf16 matrix a GEMM over x reads: w itself, or a packed weight decoded into scratch from DEQUANT_MIN_T
    tokens (None: below that, too large a scratch, or a format op whose route decodes inside its GEMM; the
    format's op then dequantizes on the fly)."""
    if not isinstance(w, PackedWeight):
        return w
    n, k = w.matrix
    T = x.shape[0]
    if T < DEQUANT_MIN_T or 2 * n * k > DEQUANT_MAX_BYTES or takes_packed(be, f"linear_{w.fmt}", N=n, K=k, T=T):
        return None
    if w8a8(be, x, w):
        return None
    dense = new(x, n, k)   # the caching allocator hands the same block back call after call
    be.run(f"dequant_{w.fmt}", w=w.data, y=dense)
    return dense


def linear(be, x, w):
    """y = x·wᵀ; a packed weight goes to its format's op (linear_q4, ...) or, for prefill, to `linear` over its
    decoded matrix (fp8: to the FP8 tensor cores where w8a8 says so)."""
    if w8a8(be, x, w):
        T, (n, k) = x.shape[0], w.matrix
        xq, xs, y = new(x, T, k, dtype=torch.uint8), new(x, T, dtype=torch.float32), new(x, T, n)
        be.run("quant_fp8_per_token", x=x, q=xq, s=xs)
        be.run("linear_fp8_w8a8", xq=xq, xs=xs, w=w.data, y=y)
        return y
    dense = dense_weight(be, x, w)
    if dense is None:
        y = new(x, x.shape[0], w.matrix[0])
        be.run(f"linear_{w.fmt}", x=x, w=w.data, y=y)
        return y
    y = new(x, x.shape[0], dense.shape[0])
    be.run("linear", x=x, w=dense, y=y)
    return y


def rms_norm_zc(be, x, w, eps):
    y = torch.empty_like(x)
    be.run("rms_norm_zc", x=x, w=w, y=y, eps=eps)
    return y


@dataclass
class GatedSum:
    """A MoE block's output left unsummed: y + sigmoid(g) · shared, added by the add-norm that follows it."""
    y: torch.Tensor
    shared: torch.Tensor
    g: torch.Tensor

    def sum(self, be) -> torch.Tensor:
        be.run("sigmoid_gate_add", a=self.y, b=self.shared, g=self.g, y=self.y)
        return self.y


def add_rms_norm_zc(be, h, b, w, eps):
    """h += b in place (b a tensor or a GatedSum); returns rms_norm_zc(h) (one fused op)."""
    y = torch.empty_like(h)
    if isinstance(b, GatedSum):
        be.run("sigmoid_gate_add_rms_norm_zc", a=h, b=b.y, c=b.shared, g=b.g, w=w, s=h, y=y, eps=eps)
    else:
        be.run("add_rms_norm_zc", a=h, b=b, w=w, s=h, y=y, eps=eps)
    return y


def add_(be, h, b):
    be.run("add", a=h, b=b.sum(be) if isinstance(b, GatedSum) else b, y=h)


class GatedAttention:
    """Qwen3.5 gated full attention: fused q|gate,k,v projection, q/k zero-centred norm, partial RoPE,
    causal GQA over the paged KV cache, output × sigmoid(gate), o_proj."""

    def __init__(self, cfg: HybridConfig, w: dict, p: str, kv_cache: tuple):
        self.cfg, self.qkv, self.q_norm, self.k_norm, self.o = cfg, w[p + "qkv"], w[p + "q_norm"], w[p + "k_norm"], w[p + "o"]
        self.k_cache, self.v_cache = kv_cache
        self.fp8 = self.k_cache.dtype == torch.uint8   # E4M3 codes (--kv-cache-dtype fp8): the _fp8 ops

    def __call__(self, be, x, step: Step):
        c = self.cfg
        T = x.shape[0]
        qkv = linear(be, x, self.qkv)
        q, gate = new(x, T, c.heads, c.head_dim), new(x, T, c.heads, c.head_dim)
        k, v = new(x, T, c.kv_heads, c.head_dim), new(x, T, c.kv_heads, c.head_dim)
        be.run("attn_qk_prep", qkv=qkv, positions=step.positions, q_norm=self.q_norm, k_norm=self.k_norm,
               q=q, gate=gate, k=k, v=v, theta=c.rope_theta, rotary_dim=c.rotary_dim, eps=c.eps)
        kv = "_fp8" if self.fp8 else ""
        be.run("kv_cache_write" + kv, k=k, v=v, slot_mapping=step.slot_mapping, k_cache=self.k_cache, v_cache=self.v_cache)
        o = torch.empty_like(q)
        cache = dict(q=q, k_cache=self.k_cache, v_cache=self.v_cache, block_table=step.block_table,
                     token_seq=step.token_seq, positions=step.positions, scale=c.head_dim ** -0.5)
        L = step.run
        if ATTN_VERIFY and L > 1 and not self.fp8 and be.has_op("paged_attention_verify"):
            part_o, m, l = self._partials(x, T, verify_splits(T, L, c.heads, c.kv_heads))
            be.run("paged_attention_verify", **cache, part_o=part_o, m=m, l=l, L=L)
            be.run("merge_attn_states", part_o=part_o, m=m, l=l, gate=gate, o=o)
        elif T <= ATTN_SPLIT_MAX_T:   # flash decoding: many blocks per token, then the merge (with the output gate)
            part_o, m, l = self._partials(x, T, attn_splits(T, c.kv_heads))
            be.run("paged_attention_split" + kv, **cache, part_o=part_o, m=m, l=l)
            be.run("merge_attn_states", part_o=part_o, m=m, l=l, gate=gate, o=o)
        else:
            be.run("paged_attention" + kv, **cache, o=o)
            be.run("sigmoid_mul", x=o.view(T, -1), g=gate.view(T, -1), y=o.view(T, -1))
        return linear(be, o.view(T, -1), self.o)

    def _partials(self, x, T: int, ks: int):
        """Flash decoding's per-split (O / l, m, l) buffers for T tokens in ks splits."""
        c = self.cfg
        return (new(x, T, c.heads, ks, c.head_dim, dtype=torch.float32), new(x, T, c.heads, ks, dtype=torch.float32),
                new(x, T, c.heads, ks, dtype=torch.float32))


class GatedDeltaNet:
    """Gated DeltaNet: qkv/z/b/a projections, causal conv + SiLU (conv state), gates, the delta rule
    (fp32 recurrent state), gated RMSNorm, out_proj."""

    def __init__(self, cfg: HybridConfig, w: dict, layer: int, conv_state, state):
        p = f"layers.{layer}.gdn."
        self.cfg = cfg
        # [qkv | z]: one matrix where fuse_weights could join them, else the two
        self.in_qkvz = [w[p + "in_qkvz"]] if p + "in_qkvz" in w else [w[p + "in_qkv"], w[p + "in_z"]]
        # b and a as one small projection (float roles: recipes never pack them) instead of two launches
        self.in_ba = torch.cat([w[p + "in_b"], w[p + "in_a"]], 0)
        self.conv, self.A_log, self.dt_bias = w[p + "conv"], w[p + "A_log"], w[p + "dt_bias"]
        # prefill projects [q | k | v] and z apart (each output contiguous for its consumer): the fused matrix's two
        # row ranges as views where they are whole 128-row tiles, so no [T, channels] copy is made per layer
        self.in_qkv_z = (split_rows(self.in_qkvz[0], self.conv.shape[0]) if len(self.in_qkvz) == 1 else None) \
            or self.in_qkvz
        self.norm, self.out = w[p + "norm"], w[p + "out"]
        self.conv_state, self.state = conv_state, state

    @staticmethod
    def fuse_weights(w: dict, layer: int) -> None:
        """Replace in_qkv and in_z by their row concatenation in_qkvz (one GEMV instead of two), where the
        storage allows it (weights.cat_rows); run before memory planning, which sizes scratch by matrix."""
        p = f"layers.{layer}.gdn."
        if p + "in_qkv" in w and p + "in_z" in w:
            fused = cat_rows(w[p + "in_qkv"], w[p + "in_z"])
            if fused is not None:
                w[p + "in_qkvz"] = fused
                del w[p + "in_qkv"], w[p + "in_z"]

    def _qkvz(self, be, x):
        """[q | k | v | z] projected: [T, conv channels + HV·DV]."""
        ys = [linear(be, x, m) for m in self.in_qkvz]
        return ys[0] if len(ys) == 1 else torch.cat(ys, 1)

    def _qkv_z(self, be, x):
        """The conv channels [q | k | v] and z projected, each contiguous (prefill)."""
        if len(self.in_qkv_z) == 2:
            return linear(be, x, self.in_qkv_z[0]), linear(be, x, self.in_qkv_z[1])
        qkvz = linear(be, x, self.in_qkv_z[0])
        channels = self.conv.shape[0]
        return qkvz[:, :channels].contiguous(), qkvz[:, channels:].contiguous()

    def __call__(self, be, x, step: Step):
        if step.decode:
            return self.decode(be, x, step)
        if step.keep is not None:
            return self.verify(be, x, step)
        c = self.cfg
        T = x.shape[0]
        mixed, z = self._qkv_z(be, x)
        ba = linear(be, x, self.in_ba)
        qkv = torch.empty_like(mixed)
        be.run("gdn_conv", x=mixed, w=self.conv, query_start=step.query_start, slots=step.state_slots,
               conv_state=self.conv_state, y=qkv)
        g, beta = new(x, T, c.v_heads, dtype=torch.float32), new(x, T, c.v_heads, dtype=torch.float32)
        be.run("gdn_gates", ba=ba, A_log=self.A_log, dt_bias=self.dt_bias, g=g, beta=beta)
        o = self._delta_rule(be, qkv, g, beta, step.query_start, step.state_slots)
        y = torch.empty_like(o)
        be.run("gdn_gated_norm", o=o, z=z.view(T, c.v_heads, c.v_dim), w=self.norm, y=y, eps=c.eps)
        return linear(be, y.view(T, -1), self.out)

    def _delta_rule(self, be, qkv, g, beta, query_start, slots):
        c = self.cfg
        o = new(qkv, qkv.shape[0], c.v_heads, c.v_dim)
        be.run("gdn_delta_rule", qkv=qkv, g=g, beta=beta, query_start=query_start, slots=slots, state=self.state, o=o,
               num_k_heads=c.k_heads, scale=c.k_dim ** -0.5)
        return o

    def _fused(self, x, qkvz, slots, T) -> tuple[dict, torch.Tensor]:
        """The arguments gdn_decode and gdn_verify share, and their output y [T, HV·DV]."""
        c = self.cfg
        hk, r = c.k_heads, c.v_heads // c.k_heads
        y = new(x, T, c.v_heads * c.v_dim)
        return dict(x=x, qkvz=qkvz, w_ba=self.in_ba.view(2, hk, r, -1), conv_w=self.conv, A_log=self.A_log.view(hk, r),
                    dt_bias=self.dt_bias.view(hk, r), norm_w=self.norm, slots=slots, conv_state=self.conv_state,
                    state=self.state.view(-1, hk, r, c.k_dim, c.v_dim), y=y.view(T, hk, r, c.v_dim),
                    scale=c.k_dim ** -0.5, norm_eps=c.eps), y

    def decode(self, be, x, step: Step):
        """One token per sequence: b/a, conv, gates, delta rule and gated norm are one gdn_decode launch."""
        args, y = self._fused(x, self._qkvz(be, x), step.state_slots, x.shape[0])
        be.run("gdn_decode", **args)
        return linear(be, y, self.out)

    def verify(self, be, x, step: Step):
        """A speculative verify step (a run of tokens a lane): the mixer as one gdn_verify launch that reads the
        states and writes none (step.commit: zeros); the round's commit runs it again over the tokens kept."""
        qkvz = self._qkvz(be, x)
        step.keep.append((self, x, qkvz))
        args, y = self._fused(x, qkvz, step.state_slots, x.shape[0])
        be.run("gdn_verify", **args, query_start=step.query_start, commit=step.commit)
        return linear(be, y, self.out)

    def commit(self, be, x, qkvz, query_start, slots, kept) -> None:
        """Advance the states of lanes `slots` over the first kept[s] tokens of their verify step's runs (x and qkvz
        as the step recorded them); y is dropped."""
        args, _ = self._fused(x, qkvz, slots, x.shape[0])
        be.run("gdn_verify", **args, query_start=query_start, commit=kept)


def commit_round(be, keep: list, query_start, slots, kept) -> None:
    """A speculative round's commit in every GDN layer its verify step recorded (Step.keep): each lane's state
    advanced over the kept[s] tokens it keeps of its run."""
    for mixer, x, qkvz in keep:
        mixer.commit(be, x, qkvz, query_start, slots, kept)


class DenseMLP:
    """SwiGLU over a fused [gate | up] projection: one GEMM with the activation in its epilogue where the backend
    has it (linear_swiglu_<fmt> over a packed weight: for prefill on a route that decodes inside the GEMM, for decode
    where its table sends T to a GEMV route; linear_swiglu over a dense or decoded one for prefill), else the
    projection, then silu_and_mul."""

    def __init__(self, w: dict, prefix: str):
        self.gate_up, self.down = w[prefix + "gate_up"], w[prefix + "down"]

    def __call__(self, be, x):
        T = x.shape[0]
        fused = SWIGLU_MIN_T is not None and T >= SWIGLU_MIN_T
        gu = self.gate_up
        if isinstance(gu, PackedWeight):
            op, dims = f"linear_swiglu_{gu.fmt}", dict(I=gu.matrix[0] // 2, K=gu.matrix[1], T=T)
            # prefill: a route that decodes inside the GEMM; decode: where the table sends T to a decode-sized route
            one_op = (takes_packed(be, op, **dims) if fused else
                      (be.resolved_route(op, **dims) or "").startswith(DECODE_FUSED_ROUTES))
            if one_op:
                act = new(x, T, gu.matrix[0] // 2)        # decoded inside the GEMM, the activation in its epilogue
                be.run(op, x=x, w=gu.data, y=act)
                return linear(be, act, self.down)
        dense = dense_weight(be, x, gu) if fused and be.has_op("linear_swiglu") else None
        if dense is not None:
            act = new(x, T, dense.shape[0] // 2)
            be.run("linear_swiglu", x=x, w=dense, y=act)
        else:
            gu = linear(be, x, self.gate_up)
            act = new(x, T, gu.shape[1] // 2)
            be.run("silu_and_mul", x=gu, y=act)
        return linear(be, act, self.down)


class SparseMoE:
    """Softmax router over all experts, top-k (renormalised), routed SwiGLU experts, plus the shared
    expert scaled by sigmoid(shared_gate · x)."""

    def __init__(self, cfg: HybridConfig, w: dict, p: str):
        self.cfg = cfg
        self.router, self.gate_up, self.down = w[p + "router"], w[p + "experts.gate_up"], w[p + "experts.down"]
        self.shared = DenseMLP(w, p + "shared.")
        self.shared_gate = w[p + "shared.gate"]
        if isinstance(self.gate_up, PackedWeight) != isinstance(self.down, PackedWeight):
            raise ValueError(f"{p}experts: gate_up and down must both be packed or both float formats")

    def __call__(self, be, x):
        c = self.cfg
        T = x.shape[0]
        logits = new(x, T, self.router.shape[0], dtype=torch.float32)  # fp32: bf16 logits flip near-tie top-k
        weights = new(x, T, c.experts_per_token, dtype=torch.float32)
        ids = new(x, T, c.experts_per_token, dtype=torch.int32)
        be.run("moe_router", x=x, w=self.router, logits=logits)
        be.run("moe_topk", logits=logits, weights=weights, ids=ids, renormalize=int(c.renormalize_topk))
        side = side_stream(x)
        if side is not None:   # fork: the shared expert runs beside the routed experts (joined before the sum)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side), be.beside():   # beside(): its own workspace
                shared, g = self.shared(be, x), linear(be, x, self.shared_gate)
        y = torch.empty_like(x)
        if isinstance(self.gate_up, PackedWeight):
            self.packed_experts(be, x, weights, ids, y)
        else:
            be.run("moe_experts", x=x, gate_up=self.gate_up, down=self.down, weights=weights, ids=ids, y=y)
        if side is None:
            shared, g = self.shared(be, x), linear(be, x, self.shared_gate)
        else:   # join (the side stream's tensors are next reused after the next fork, which waits for this stream)
            torch.cuda.current_stream(x.device).wait_stream(side)
        out = GatedSum(y, shared, g)
        return out if MOE_GATE_ADD_NORM else out.sum(be)

    def packed_experts(self, be, x, weights, ids, y):
        """The routed experts over packed weights: split in two launches over every SM for decode, grouped by
        expert for prefill (each expert's rows decoded once per group of its tokens), else the single op."""
        c, T, gu, dn = self.cfg, x.shape[0], self.gate_up, self.down
        K, I, E = c.experts_per_token, c.expert_intermediate, c.experts
        if T <= MOE_SPLIT_MAX_T:
            h = new(x, T, K, I, dtype=torch.float32)
            be.run(f"moe_gate_up_{gu.fmt}", x=x, gate_up=gu.data, ids=ids, h=h, E=E)
            be.run(f"moe_down_{dn.fmt}", h=h, down=dn.data, weights=weights, ids=ids, y=y, E=E)
        elif MOE_GROUPED_MIN_T is not None and T >= MOE_GROUPED_MIN_T:
            order, offsets = new(ids, T, K), new(ids, E)
            be.run("moe_align", ids=ids, order=order, offsets=offsets)
            h = new(x, T, K, I, dtype=torch.float32)
            be.run(f"moe_gate_up_grouped_{gu.fmt}", x=x, gate_up=gu.data, order=order, offsets=offsets, h=h)
            ys = new(x, T, K, c.hidden, dtype=torch.float32)
            be.run(f"moe_down_grouped_{dn.fmt}", h=h, down=dn.data, weights=weights, order=order, offsets=offsets, ys=ys)
            be.run("moe_sum", ys=ys, y=y)
        else:
            be.run(moe_op(gu.fmt, dn.fmt), x=x, gate_up=gu.data, down=dn.data, weights=weights, ids=ids, y=y, E=E, I=I)
