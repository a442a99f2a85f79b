"""Torch reference implementations, one per op contract (`reference:` in specs/ops/*.yaml).

Each takes the op's inputs, states and params as keyword arguments (and `dims`, the bound dims, where a
shape cannot be read off the tensors) and returns its outputs and new states as a dict, computed
in fp32 (or wider, for the test oracles: pass fp64 tensors) and cast once to the output dtype by the
caller. They run on any device: the reference backend uses them on CPU in CI.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def _norm(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, w, eps):
    return {"y": _norm(x, eps) * w}


def rms_norm_zc(x, w, eps):
    return {"y": _norm(x, eps) * (1 + w)}


def add_rms_norm_zc(a, b, w, eps):
    s = a + b
    return {"s": s, "y": _norm(s, eps) * (1 + w)}


def sigmoid_gate_add_rms_norm_zc(a, b, c, g, w, eps, store=None):
    # m is stored in the op's dtype before the add-norm, as the contract (and sigmoid_gate_add) does: where a + m
    # cancels, that rounding is most of s
    m = sigmoid_gate_add(b, c, g)["y"]
    return add_rms_norm_zc(a, m if store is None else m.to(store).to(m.dtype), w, eps)


def add(a, b):
    return {"y": a + b}


def silu_and_mul(x):
    i = x.shape[-1] // 2
    return {"y": F.silu(x[..., :i]) * x[..., i:]}


def sigmoid_mul(x, g):
    return {"y": x * torch.sigmoid(g)}


def embedding(ids, table):
    ok = (ids >= 0) & (ids < table.shape[0])
    return {"y": table[ids.clamp(0, table.shape[0] - 1).long()] * ok[:, None].to(table.dtype)}


def linear(x, w):
    return {"y": x @ w.T}


def linear_swiglu(x, w):
    return silu_and_mul(x @ w.T)


def _rope_neox(x, positions, theta, rotary_dim):
    """Rotate (x[i], x[i + R/2]) for i < R/2 by position · theta^(-2i/R); dims >= R pass through."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=x.device) / rotary_dim))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]          # [T, R/2]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def attn_qk_prep(qkv, positions, q_norm, k_norm, theta, rotary_dim, eps, dims):
    nh, nkv, d = dims["NH"], dims["NKV"], dims["D"]
    qg = qkv[:, : 2 * nh * d].reshape(-1, nh, 2 * d)
    k = qkv[:, 2 * nh * d: 2 * nh * d + nkv * d].reshape(-1, nkv, d)
    v = qkv[:, 2 * nh * d + nkv * d:].reshape(-1, nkv, d)
    q = _rope_neox(_norm(qg[..., :d], eps) * (1 + q_norm), positions, theta, rotary_dim)
    k = _rope_neox(_norm(k, eps) * (1 + k_norm), positions, theta, rotary_dim)
    return {"q": q, "gate": qg[..., d:], "k": k, "v": v}


def kv_cache_write(k, v, slot_mapping, k_cache, v_cache):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    bs = k_cache.shape[1]
    ok = slot_mapping >= 0
    s = slot_mapping[ok].long()
    k_cache[s // bs, s % bs] = k[ok].to(k_cache.dtype)
    v_cache[s // bs, s % bs] = v[ok].to(v_cache.dtype)
    return {"k_cache": k_cache, "v_cache": v_cache}


E4M3_MAX = 448.0


def fp8_kv_positions(d: int, v: bool, device=None) -> torch.Tensor:
    """Where head-dim element i sits in an FP8 cache row (kv_cache_write_fp8's kperm / vperm): blocks of 16, the
    order inside a block chosen so that 8x8 ldmatrix loads of the byte tile give the kernels' mma fragments."""
    i = torch.arange(d, device=device)
    j = i % 16
    return i - j + (2 * (j % 8) + j // 8 if v else 4 * ((j % 8) // 2) + 2 * (j // 8) + j % 2)


def fp8_kv_codes(x, scale: float, v: bool) -> torch.Tensor:
    """[..., D] values -> E4M3 codes (uint8; x / scale rounded to nearest even, saturated at ±448) in the cache order."""
    codes = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty_like(codes)
    out[..., fp8_kv_positions(x.shape[-1], v, x.device)] = codes
    return out


def fp8_kv_values(codes, scale: float, v: bool) -> torch.Tensor:
    """The inverse of fp8_kv_codes: fp32 values in head-dim order."""
    return codes[..., fp8_kv_positions(codes.shape[-1], v, codes.device)].view(torch.float8_e4m3fn).float() * scale


def kv_cache_write_fp8(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    bs = k_cache.shape[1]
    ok = slot_mapping >= 0
    s = slot_mapping[ok].long()
    k_cache[s // bs, s % bs] = fp8_kv_codes(k[ok], k_scale, v=False)
    v_cache[s // bs, s % bs] = fp8_kv_codes(v[ok], v_scale, v=True)
    return {"k_cache": k_cache, "v_cache": v_cache}


def _keys_values(q, k_cache, v_cache, block_table, s: int, n: int):
    """Keys and values 0..n-1 of sequence s from the paged cache, each kv head repeated over its query heads
    (GQA): two [n, NH, D] tensors in q's dtype."""
    nh, (bs, nkv, d) = q.shape[1], k_cache.shape[1:]
    pages = block_table[s, : (n + bs - 1) // bs].long()
    return [c[pages].reshape(-1, nkv, d)[:n].to(q.dtype).repeat_interleave(nh // nkv, dim=1) for c in (k_cache, v_cache)]


def paged_attention(q, k_cache, v_cache, block_table, token_seq, positions, scale):
    out = torch.empty_like(q)
    for s in torch.unique(token_seq).tolist():
        rows = (token_seq == s).nonzero().flatten()
        n = int(positions[rows].max()) + 1
        K, V = _keys_values(q, k_cache, v_cache, block_table, s, n)
        scores = torch.einsum("thd,nhd->thn", q[rows], K) * scale
        mask = torch.arange(n, device=q.device)[None, :] > positions[rows][:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
        out[rows] = torch.einsum("thn,nhd->thd", scores.softmax(-1), V)
    return {"o": out}


def _split_partials(qt, K, V, scale, ks: int, nt: int):
    """One token's (m, l, O / l) per split [nh, ks(, d)]: the n = len(K) keys in cdiv(n, 16) chunks cut into ks
    splits, keys from nt on left out (a verify lane's earlier token)."""
    n, dev = K.shape[0], qt.device
    x = torch.einsum("hd,nhd->hn", qt, K) * (scale * 1.4426950408889634)                         # [nh, n]
    chunks = (n + 15) // 16
    ends = torch.tensor([16 * (chunks * (i + 1) // ks) for i in range(ks)], device=dev)
    split = torch.searchsorted(ends, torch.arange(n, device=dev), right=True)                     # each key's split
    mine = (split[None, :] == torch.arange(ks, device=dev)[:, None]) & (torch.arange(n, device=dev) < nt)   # [ks, n]
    xs = x[None].masked_fill(~mine[:, None, :], float("-inf"))                                   # [ks, nh, n]
    mx = xs.max(-1).values                                                                       # [ks, nh]
    w = torch.exp2(xs - mx.clamp(min=-3e38)[..., None])   # 0 for keys of other splits (and empty splits)
    sw = w.sum(-1)
    po = torch.einsum("shn,nhd->shd", w, V) / sw.clamp(min=1e-30)[..., None]
    return mx.T, sw.T, po.transpose(0, 1)


def _partials(q, ks: int):
    T, nh, d = q.shape
    return (q.new_zeros(T, nh, ks, d, dtype=torch.float32), q.new_full((T, nh, ks), float("-inf"), dtype=torch.float32),
            q.new_zeros(T, nh, ks, dtype=torch.float32))


def paged_attention_split(q, k_cache, v_cache, block_table, token_seq, positions, scale, dims):
    part_o, m, l = _partials(q, dims["KS"])
    for t in range(q.shape[0]):
        n = min(int(positions[t]) + 1, block_table.shape[1] * k_cache.shape[1])
        K, V = _keys_values(q, k_cache, v_cache, block_table, int(token_seq[t]), n)
        m[t], l[t], part_o[t] = _split_partials(q[t], K, V, scale, dims["KS"], n)
    return {"part_o": part_o, "m": m, "l": l}


def paged_attention_verify(q, k_cache, v_cache, block_table, token_seq, positions, scale, L, dims):
    T = q.shape[0]
    seq = token_seq.view(T // L, L)
    if not bool((seq == seq[:, :1]).all()):
        raise ValueError(f"paged_attention_verify: token_seq must be constant over each lane's {L} rows")
    cap = block_table.shape[1] * k_cache.shape[1]
    part_o, m, l = _partials(q, dims["KS"])
    for lane in range(T // L):
        rows = range(lane * L, lane * L + L)
        n = min(max(int(positions[t]) for t in rows) + 1, cap)   # the lane's longest token cuts the splits
        K, V = _keys_values(q, k_cache, v_cache, block_table, int(token_seq[lane * L]), n)
        for t in rows:
            m[t], l[t], part_o[t] = _split_partials(q[t], K, V, scale, dims["KS"], min(int(positions[t]) + 1, cap))
    return {"part_o": part_o, "m": m, "l": l}


def paged_attention_fp8(q, k_cache, v_cache, block_table, token_seq, positions, scale, k_scale, v_scale):
    return paged_attention(q, fp8_kv_values(k_cache, k_scale, v=False), fp8_kv_values(v_cache, v_scale, v=True),
                           block_table, token_seq, positions, scale)


def paged_attention_split_fp8(q, k_cache, v_cache, block_table, token_seq, positions, scale, k_scale, v_scale, dims):
    return paged_attention_split(q, fp8_kv_values(k_cache, k_scale, v=False), fp8_kv_values(v_cache, v_scale, v=True),
                                 block_table, token_seq, positions, scale, dims)


def merge_attn_states(part_o, m, l, gate):
    M = m.max(-1, keepdim=True).values
    w = torch.where(m == float("-inf"), torch.zeros_like(l), l * torch.exp2(m - M))
    merged = (w[..., None] * part_o).sum(2) / w.sum(-1)[..., None]
    return {"o": (merged * torch.sigmoid(gate.float())).to(gate.dtype)}


def _sequences(query_start, slots):
    qs = query_start.tolist()
    return [(qs[i], qs[i + 1], int(slots[i])) for i in range(len(qs) - 1)]


def gdn_conv(x, w, query_start, slots, conv_state):
    conv_state = conv_state.clone()
    y = torch.empty_like(x)
    kw = w.shape[1]
    for a, b, slot in _sequences(query_start, slots):
        window = torch.cat([conv_state[slot].T, x[a:b]], dim=0)             # [KW-1 + n, C]
        for i in range(b - a):
            y[a + i] = F.silu((window[i: i + kw] * w.T).sum(0))
        conv_state[slot] = window[-(kw - 1):].T
    return {"y": y, "conv_state": conv_state}


def gdn_gates(ba, A_log, dt_bias):
    b, a = ba.chunk(2, dim=-1)
    return {"g": -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float()), "beta": torch.sigmoid(b.float())}


def _l2norm(x, eps):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_delta_rule(qkv, g, beta, query_start, slots, state, num_k_heads, scale, eps):
    state = state.clone()
    hv, dk, dv = state.shape[1:]
    hk = num_k_heads
    q = _l2norm(qkv[:, : hk * dk].reshape(-1, hk, dk), eps).repeat_interleave(hv // hk, dim=1) * scale
    k = _l2norm(qkv[:, hk * dk: 2 * hk * dk].reshape(-1, hk, dk), eps).repeat_interleave(hv // hk, dim=1)
    v = qkv[:, 2 * hk * dk:].reshape(-1, hv, dv)
    o = torch.empty(qkv.shape[0], hv, dv, dtype=qkv.dtype, device=qkv.device)
    wide = torch.float64 if qkv.dtype == torch.float64 else torch.float32
    for a, b, slot in _sequences(query_start, slots):
        S = state[slot].to(wide)                                             # [HV, DK, DV]
        for t in range(a, b):
            S = S * torch.exp(g[t].to(wide))[:, None, None]
            kv = torch.einsum("hkv,hk->hv", S, k[t].to(wide))
            S = S + k[t].to(wide)[:, :, None] * ((v[t].to(wide) - kv) * beta[t].to(wide)[:, None])[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, q[t].to(wide)).to(o.dtype)
        state[slot] = S.to(state.dtype)
    return {"o": o, "state": state}


def gdn_gated_norm(o, z, w, eps):
    return {"y": w * _norm(o, eps) * F.silu(z)}


def gdn_decode(x, qkvz, w_ba, conv_w, A_log, dt_bias, norm_w, slots, conv_state, state, scale, eps, norm_eps):
    """The decode-step GDN mixer as the unfused ops, each sequence a one-token run."""
    T, (hk, r) = x.shape[0], A_log.shape
    hv, dk, dv = hk * r, state.shape[3], state.shape[4]
    qkv, z = qkvz[:, :conv_w.shape[0]], qkvz[:, conv_w.shape[0]:]
    runs = torch.arange(T + 1, dtype=torch.int32)
    gates = gdn_gates(linear(x, w_ba.reshape(2 * hv, -1))["y"], A_log.reshape(hv), dt_bias.reshape(hv))
    conv = gdn_conv(qkv, conv_w, runs, slots, conv_state)
    rule = gdn_delta_rule(conv["y"], gates["g"], gates["beta"], runs, slots, state.reshape(-1, hv, dk, dv), hk,
                          scale, eps)
    y = gdn_gated_norm(rule["o"], z.reshape(T, hv, dv), norm_w, norm_eps)["y"]
    return {"y": y.reshape(T, hk, r, dv), "conv_state": conv["conv_state"], "state": rule["state"].reshape(state.shape)}


def gdn_verify(x, qkvz, w_ba, conv_w, A_log, dt_bias, norm_w, query_start, slots, commit, conv_state, state, scale,
               eps, norm_eps):
    """gdn_decode's composition over each sequence's run of tokens; the states as after each run's first commit[s]
    tokens (the same ops again over those tokens alone)."""
    T, (hk, r) = x.shape[0], A_log.shape
    hv, dk, dv = hk * r, state.shape[3], state.shape[4]
    qkv, z = qkvz[:, :conv_w.shape[0]], qkvz[:, conv_w.shape[0]:]
    gates = gdn_gates(linear(x, w_ba.reshape(2 * hv, -1))["y"], A_log.reshape(hv), dt_bias.reshape(hv))
    flat = state.reshape(-1, hv, dk, dv)
    conv = gdn_conv(qkv, conv_w, query_start, slots, conv_state)
    rule = gdn_delta_rule(conv["y"], gates["g"], gates["beta"], query_start, slots, flat, hk, scale, eps)
    y = gdn_gated_norm(rule["o"], z.reshape(T, hv, dv), norm_w, norm_eps)["y"]
    n = [min(max(c, 0), b - a) for c, (a, b, _) in zip(commit.tolist(), _sequences(query_start, slots))]
    rows = torch.tensor([a + i for c, (a, _, _) in zip(n, _sequences(query_start, slots)) for i in range(c)],
                        dtype=torch.long, device=x.device)
    runs = torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
    kept = gdn_conv(qkv[rows], conv_w, runs, slots, conv_state)
    after = gdn_delta_rule(kept["y"], gates["g"][rows], gates["beta"][rows], runs, slots, flat, hk, scale, eps)
    return {"y": y.reshape(T, hk, r, dv), "conv_state": kept["conv_state"], "state": after["state"].reshape(state.shape)}


def moe_router(x, w):
    # fp32 (fp64 stays fp64) and never rounded to the run dtype: the top-k reading these logits flips on
    # differences below one bf16 ulp
    x, w = (t if t.dtype == torch.float64 else t.float() for t in (x, w))
    return {"logits": x @ w.T}


def moe_topk(logits, renormalize, dims):
    p = torch.softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
    k = dims["K"]
    # stable sort on -p: equal probabilities keep ascending ids, so the lower id wins ties
    order = torch.sort(-p, dim=-1, stable=True).indices[:, :k]
    w = torch.gather(p, 1, order)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return {"weights": w, "ids": order.to(torch.int32)}


def moe_experts(x, gate_up, down, weights, ids):
    inter = down.shape[2]
    y = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ gate_up[e].T
        h = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ down[e].T
        y.index_add_(0, tok, h * weights[tok, slot][:, None].to(h.dtype))
    return {"y": y}


def moe_gate_up(x, gate_up, ids):
    """h[t, k] = silu(gate) * up of expert ids[t, k] (0 for an id outside [0, E)): moe_experts split in two."""
    inter = gate_up.shape[1] // 2
    h = x.new_zeros(*ids.shape, inter)
    for e in torch.unique(ids).tolist():
        if 0 <= e < gate_up.shape[0]:
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gu = x[tok] @ gate_up[e].T
            h[tok, slot] = F.silu(gu[:, :inter]) * gu[:, inter:]
    return {"h": h}


def moe_down(h, down, weights, ids):
    """y[t] = sum over slots of weights[t, k] * down[ids[t, k]] . h[t, k] (slots with an id outside [0, E) skipped)."""
    y = h.new_zeros(h.shape[0], down.shape[1])
    for e in torch.unique(ids).tolist():
        if 0 <= e < down.shape[0]:
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, tok, (h[tok, slot] @ down[e].T) * weights[tok, slot][:, None].to(h.dtype))
    return {"y": y}


def moe_align(ids, dims):
    """The (token, slot) pairs sorted by expert (stable; ids outside [0, E) last) and each expert's end offset."""
    E = dims["E"]
    flat = ids.flatten().long()
    valid = (flat >= 0) & (flat < E)
    order = torch.sort(torch.where(valid, flat, E), stable=True).indices
    offsets = torch.bincount(flat[valid], minlength=E).cumsum(0)
    return {"order": order.to(torch.int32).view(ids.shape), "offsets": offsets.to(torch.int32)}


def ids_of(order, offsets):
    """The ids moe_align sorted: each listed pair's expert (E for the pairs after offsets[E-1])."""
    pos = torch.arange(order.numel(), device=order.device)
    experts = torch.searchsorted(offsets.long(), pos, right=True)
    ids = torch.empty(order.numel(), dtype=torch.long, device=order.device)
    ids[order.flatten().long()] = experts
    return ids.view(order.shape)


def moe_sum(ys):
    return {"y": ys.sum(1)}


def sigmoid_gate_add(a, b, g):
    return {"y": a + torch.sigmoid(g) * b}


def argmax(logits, domain):
    return {"ids": logits[:, :domain].argmax(-1).to(torch.int32)}  # torch.argmax returns the first maximum


_M64 = (1 << 64) - 1


def rng_uniform(seed: int, counter: int) -> float:
    """The sample op's counter-based uniform in [0, 1) (splitmix64 finaliser, 24 bits)."""
    z = ((seed & 0xFFFFFFFF) + (counter + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return (z >> 40) / float(1 << 24)


def sample(logits, counts, temperature, top_k, top_p, min_p, presence, frequency, seed, counter, domain):
    ids = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
    for t in range(logits.shape[0]):
        c = counts[t, :domain].to(torch.float64)
        l = logits[t, :domain].to(torch.float64) - presence[t].item() * (c > 0) - frequency[t].item() * c
        temp = temperature[t].item()
        if temp <= 0:
            ids[t] = int(l.argmax())
            continue
        p = torch.softmax(l / temp, dim=0)
        order = torch.sort(-p, stable=True).indices      # p desc, id asc
        ps = p[order]
        keep = len(ps)
        if top_k[t].item() > 0:
            keep = min(keep, int(top_k[t]))
        if top_p[t].item() < 1:
            reach = int((torch.cumsum(ps[:keep], 0) < top_p[t].item()).sum()) + 1
            keep = min(keep, max(reach, 1))
        if min_p[t].item() > 0:
            keep = max(1, min(keep, int((ps[:keep] >= min_p[t].item() * ps[0]).sum())))
        run = torch.cumsum(ps[:keep], 0)
        u = rng_uniform(int(seed[t]), int(counter[t])) * run[-1].item()
        ids[t] = int(order[min(int((run <= u).sum()), keep - 1)])
    return {"ids": ids}


REFERENCES = {f.__name__: f for f in (rms_norm, rms_norm_zc, add_rms_norm_zc, sigmoid_gate_add_rms_norm_zc, add, silu_and_mul, sigmoid_mul, embedding, linear,
                                      linear_swiglu, attn_qk_prep, kv_cache_write, paged_attention, paged_attention_split, paged_attention_verify,
                                      kv_cache_write_fp8, paged_attention_fp8, paged_attention_split_fp8, merge_attn_states, gdn_conv, gdn_gates,
                                      gdn_delta_rule, gdn_gated_norm, gdn_decode, gdn_verify, moe_router, moe_topk, moe_experts, moe_align, moe_sum,
                                      sigmoid_gate_add, argmax, sample)}
