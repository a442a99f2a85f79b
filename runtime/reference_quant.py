"""Torch references of the ops over packed weights (rowtile128-v1, specs/formats.md §3).

`unpack` rebuilds the exact float32 matrix a packed tensor encodes, on the tensor's own device, so the
reference backend (and the GPU tests' oracle) can run any packed op as "decode, then the bf16 op's math".
It shares the tile arithmetic with the codecs in runtime/format_*.py (same plane sizes and offsets).
"""
from __future__ import annotations

import torch

from .format_base import K_ALIGN, align_up
from .formats import get_format
from .reference import REFERENCES, ids_of, linear, linear_swiglu, moe_down, moe_experts, moe_gate_up

PACKED = ("q4", "q5", "q6", "w8", "fp8")


def _int_codes(planes: list[torch.Tensor], bits: int, n: int) -> torch.Tensor:
    """Planes of one stack of tiles [nt, bytes] -> signed codes [nt, n] (n = r * kp lanes)."""
    if bits == 8:
        return planes[0].view(torch.int8).to(torch.int32)
    low = planes[0].to(torch.int32)
    u = torch.stack([low & 15, low >> 4], dim=-1).reshape(low.shape[0], n)
    if bits > 4:
        hb = bits - 4
        per = 8 // hb
        shifts = torch.arange(per, device=u.device, dtype=torch.int32) * hb
        high = (planes[1].to(torch.int32)[..., None] >> shifts) & ((1 << hb) - 1)
        u = u | (high.reshape(u.shape) << 4)
    return u - (u >= (1 << (bits - 1))).to(torch.int32) * (1 << bits)


def _decode_tiles(fmt: str, planes: list[torch.Tensor], r: int, kp: int) -> torch.Tensor:
    nt = planes[0].shape[0]
    if fmt == "fp8":
        vals = planes[0].contiguous().view(torch.float8_e4m3fn).float().reshape(nt, r, kp)
        return vals * planes[1].contiguous().view(torch.float32).reshape(nt, r, 1)
    f = get_format(fmt)
    codes = _int_codes(planes, f.bits, r * kp).float().reshape(nt, r, kp // f.group, f.group)
    scales = planes[-1].contiguous().view(torch.float16).float().reshape(nt, r, kp // f.group, 1)
    return (codes * scales).reshape(nt, r, kp)


def unpack(fmt: str, w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Packed bytes (1-D uint8) of an [n, k] matrix -> float32 [n, k] on w's device."""
    f = get_format(fmt)
    if w.numel() != f.nbytes((n, k)):
        raise ValueError(f"{fmt}: {w.numel()} bytes given, [{n}, {k}] needs {f.nbytes((n, k))}")
    kp = align_up(k, K_ALIGN)
    out = [_decode_tiles(fmt, st.planes(w), st.rows, kp).reshape(st.tiles * st.rows, kp) for st in f.tile_stacks(n, kp)]
    return torch.cat(out)[:, :k]


def fp8_codes_and_scales(w: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed fp8 [n, k] matrix -> its E4M3 values float32 [n, k] and its row scales float32 [n], unmultiplied."""
    f = get_format("fp8")
    if w.numel() != f.nbytes((n, k)):
        raise ValueError(f"fp8: {w.numel()} bytes given, [{n}, {k}] needs {f.nbytes((n, k))}")
    kp = align_up(k, K_ALIGN)
    vals, scales = [], []
    for st in f.tile_stacks(n, kp):
        codes, s = st.planes(w)
        vals.append(codes.contiguous().view(torch.float8_e4m3fn).float().reshape(st.tiles * st.rows, kp))
        scales.append(s.contiguous().view(torch.float32).reshape(-1))
    return torch.cat(vals)[:, :k], torch.cat(scales)


def quant_fp8_per_token(x):
    """Per-row E4M3 codes and FP32 scales (specs/ops/quant_fp8_per_token.yaml), in float32 whatever x's dtype."""
    x = x.float()
    amax = x.abs().amax(-1)
    # amax / (a tensor of 448): torch on CUDA divides by a Python scalar as a product with its reciprocal, which is
    # not the IEEE quotient the contract names (the kernel's and the CPU's)
    s = torch.where(amax > 0, torch.clamp_min(amax / torch.full_like(amax, 448.0), 2.0 ** -100), torch.zeros_like(amax))
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = (x * inv[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return {"q": q, "s": s}


def linear_fp8_w8a8(xq, xs, w, dims):
    """(E4M3 codes of x) · (E4M3 codes of w)ᵀ, then the token's and the row's scales: in xs's precision (fp32 in the
    reference backend, fp64 in the tests' oracle)."""
    codes, ws = fp8_codes_and_scales(w, dims["N"], dims["K"])
    xv = xq.view(torch.float8_e4m3fn).to(xs.dtype)
    return {"y": (xv @ codes.to(xs.dtype).T) * xs[:, None] * ws.to(xs.dtype)[None, :]}


def _linear_ref(fmt):
    def ref(x, w, dims):
        return linear(x, unpack(fmt, w, dims["N"], dims["K"]).to(x.dtype))
    ref.__name__ = f"linear_{fmt}"
    return ref


def linear_swiglu_q4(x, w, dims):
    return linear_swiglu(x, unpack("q4", w, 2 * dims["I"], dims["K"]).to(x.dtype))


def _dequant_ref(fmt):
    def ref(w, dims):
        return {"y": unpack(fmt, w, dims["T"], dims["K"])}
    ref.__name__ = f"dequant_{fmt}"
    return ref


def moe_op(gate_up_fmt: str, down_fmt: str) -> str:
    """The packed expert op for these two formats: moe_experts_q4, or moe_experts_q4_q5 when they differ."""
    return f"moe_experts_{gate_up_fmt}" if gate_up_fmt == down_fmt else f"moe_experts_{gate_up_fmt}_{down_fmt}"


# expert format pairs with their own op besides the same-format ones: the recipes' default (gate_up q4, down q5)
MOE_PAIRS = [(f, f) for f in PACKED] + [("q4", "q5")]


def _moe_ref(gu_fmt, dn_fmt):
    def ref(x, gate_up, down, weights, ids, dims):
        e, i, h = dims["E"], dims["I"], dims["H"]
        gu = unpack(gu_fmt, gate_up, e * 2 * i, h).to(x.dtype).reshape(e, 2 * i, h)
        dn = unpack(dn_fmt, down, e * h, i).to(x.dtype).reshape(e, h, i)
        return moe_experts(x, gu, dn, weights, ids)
    ref.__name__ = moe_op(gu_fmt, dn_fmt)
    return ref


def _moe_split_refs(fmt):
    """moe_gate_up_<fmt> and moe_down_<fmt>, the two halves of moe_experts_<fmt> (the decode form), and their
    grouped forms over moe_align's order (prefill; the down form keeps each slot's output for moe_sum)."""
    def experts(w, rows, cols, dims, like):
        return unpack(fmt, w, dims["E"] * rows, cols).to(like.dtype).reshape(dims["E"], rows, cols)

    def gate_up_ref(x, gate_up, ids, dims):
        return moe_gate_up(x, experts(gate_up, 2 * dims["I"], dims["H"], dims, x), ids)

    def down_ref(h, down, weights, ids, dims):
        return moe_down(h, experts(down, dims["H"], dims["I"], dims, h), weights, ids)

    def gate_up_grouped_ref(x, gate_up, order, offsets, dims):
        return gate_up_ref(x, gate_up, ids_of(order, offsets), dims)

    def down_grouped_ref(h, down, weights, order, offsets, dims):
        """Each slot's weighted down projection on its own: moe_down of that slot alone."""
        ids, dn = ids_of(order, offsets), experts(down, dims["H"], dims["I"], dims, h)
        return {"ys": torch.stack([moe_down(h[:, k:k + 1], dn, weights[:, k:k + 1], ids[:, k:k + 1])["y"]
                                   for k in range(ids.shape[1])], 1)}
    gate_up_ref.__name__, down_ref.__name__ = f"moe_gate_up_{fmt}", f"moe_down_{fmt}"
    gate_up_grouped_ref.__name__, down_grouped_ref.__name__ = f"moe_gate_up_grouped_{fmt}", f"moe_down_grouped_{fmt}"
    return [gate_up_ref, down_ref, gate_up_grouped_ref, down_grouped_ref]


QUANT_REFERENCES = {f.__name__: f for f in [*(_linear_ref(fmt) for fmt in PACKED), *(_dequant_ref(fmt) for fmt in PACKED),
                                             linear_swiglu_q4, quant_fp8_per_token, linear_fp8_w8a8,
                                             *(_moe_ref(*p) for p in MOE_PAIRS),
                                             *(f for fmt in PACKED for f in _moe_split_refs(fmt))]}
ALL_REFERENCES = {**REFERENCES, **QUANT_REFERENCES}
