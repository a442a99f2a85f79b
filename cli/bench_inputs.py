"""What `ninfer-bench ops` and `ninfer-tune` time an op on: random inputs at given dims (packed weights in a
valid layout, real-looking routing and gates), sets of them that rotate so that timed launches read from HBM,
and the bytes and FLOPs the op must move and do (the roofline of each figure)."""
from __future__ import annotations

import itertools
import math

ATTN_CONTEXT = 8192
ATTN_DECODE_MAX_T = 64   # paged_attention inputs: up to this T a decode step of T sequences, above it a prefill chunk
GDN_K_HEADS = 16
VERIFY_RUN = 4   # gdn_verify inputs: runs of a verify step's K + 1 tokens a lane (NInfer's MTP3: K = 3)
L2_BYTES = 60 << 20


def verify_run(T: int) -> int:
    """A verify step's tokens a lane at T tokens: VERIFY_RUN where T holds whole lanes of it, else the largest run
    below it that does (T = 3: one lane of K = 2; T = 7: seven lanes of one token), so every T has a valid step."""
    return next(r for r in range(min(T, VERIFY_RUN), 0, -1) if T % r == 0)


def is_expert_op(op: str) -> bool:
    """The routed-expert ops (moe_experts*, their split and grouped forms, moe_align, moe_sum): inputs from
    make_inputs' MoE branch, sets from moe_sets; not moe_router / moe_topk (plain tensors)."""
    return op.startswith(("moe_experts", "moe_gate_up_", "moe_down_", "moe_align", "moe_sum"))


def footprint(tensors: dict) -> int:
    """Bytes of all the tensors."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def rotating_sets(base: dict, factor: int = 3, most: int = 8) -> list[dict]:
    """`base` and up to most-1 clones whose bytes together exceed factor x the L2, so launches that cycle
    through them are timed from HBM, not from cache."""
    copies = max(1, min(most, -(-factor * L2_BYTES // footprint(base))))
    return [base] + [{k: v.clone() for k, v in base.items()} for _ in range(copies - 1)]


def timing_sets(torch, op: str, base: dict, dims: dict, rng, factor: int = 3, most: int = 8) -> list[dict]:
    """The input sets timed launches cycle through: for the expert ops `most` routings over shared weights
    (moe_sets), else copies of `base` exceeding factor x the L2 (rotating_sets)."""
    return moe_sets(torch, base, dims, rng, n=most) if is_expert_op(op) else rotating_sets(base, factor, most)


# contract tensors an op reads only part of: a paged KV cache, the routed experts' weights, an embedding table
PARTLY_READ = ("k_cache", "v_cache", "gate_up", "down", "table")


def contract_bytes(contract: dict, dims: dict) -> int | None:
    """Bytes an op must move by its contract at these bound dims: each input read once, each output written once,
    each state read and written for the sequences of the step only (a state pool's leading NS dim counts S, else T,
    slots); None where a tensor is only partly read (PARTLY_READ). $dtype tensors count as bf16 (the benches' dtype)."""
    from ninfer.runtime.contracts import TORCH_DTYPES, shape_of
    groups = [(contract["inputs"], 1), (contract["outputs"], 1), (contract.get("states", {}), 2)]
    if any(name in PARTLY_READ for g, _ in groups for name in g):
        return None
    total = 0
    for g, times in groups:
        for spec in g.values():
            shape = shape_of(spec, dims)
            if spec["shape"][0] == "NS":
                shape[0] = dims.get("S", dims["T"])
            total += times * math.prod(shape) * TORCH_DTYPES["bf16" if spec["dtype"] == "$dtype" else spec["dtype"]].itemsize
    return total


def op_bytes(op, tensors, dims) -> int:
    """Fewest bytes the op must move: each input read once, each output written once (MoE experts: only the
    experts the tokens choose)."""
    if is_expert_op(op):
        from ninfer.runtime.formats import nbytes
        gfmt, dfmt = _moe_formats(op)
        per_expert = ((nbytes(gfmt, (2 * dims["I"], dims["H"])) if gfmt else 0)
                      + (nbytes(dfmt, (dims["H"], dims["I"])) if dfmt else 0))
        acts = sum(t.numel() * t.element_size() for k, t in tensors.items() if k not in ("gate_up", "down"))
        if "ids" in tensors:
            chosen = tensors["ids"].unique().numel()
        else:   # the grouped ops: the experts moe_align gave pairs to
            chosen = int((tensors["offsets"].diff(prepend=tensors["offsets"].new_zeros(1)) > 0).sum()) if per_expert else 0
        return chosen * per_expert + acts
    if op in ("gdn_decode", "gdn_verify"):  # the recurrent and conv states are read and written back
        return sum(t.numel() * t.element_size() for t in tensors.values()) + sum(
            tensors[k].numel() * tensors[k].element_size() for k in ("state", "conv_state"))
    if op == "sample":  # without penalties the counts are not read
        return sum(t.numel() * t.element_size() for k, t in tensors.items() if k != "counts")
    if op == "embedding":  # only the gathered rows of the table are read
        return tensors["ids"].numel() * 4 + 2 * tensors["y"].numel() * tensors["y"].element_size()
    return sum(t.numel() * t.element_size() for t in tensors.values())


def op_flops(op: str, T: int, problem: dict) -> int:
    """Multiply-add FLOPs of a linear, expert or attention op (0 for the others)."""
    if op in ("linear_swiglu", "linear_swiglu_q4"):   # the [gate | up] projection: 2I rows
        return 2 * T * 2 * problem["I"] * problem["K"]
    if op.startswith("linear"):
        return 2 * T * problem["N"] * problem["K"]
    if op.startswith("paged_attention"):   # Q.K and P.V over the keys each query sees
        keys = T * ATTN_CONTEXT if T <= ATTN_DECODE_MAX_T else sum(range(ATTN_CONTEXT - T + 1, ATTN_CONTEXT + 1))
        return 4 * keys * problem["NH"] * problem["D"]
    if is_expert_op(op) and op not in ("moe_align", "moe_sum"):
        gfmt, dfmt = _moe_formats(op)
        per_pair = (2 * problem["I"] * problem["H"] if gfmt else 0) + (problem["H"] * problem["I"] if dfmt else 0)
        return 2 * T * problem["K"] * per_pair
    return 0


def make_inputs(torch, contract, dtype, dims, rng, op=""):
    """Random inputs and outputs of an op at these dims, on the generator's device."""
    from ninfer.runtime.contracts import TORCH_DTYPES, shape_of
    from ninfer.runtime.formats import FORMATS, nbytes
    from ninfer.runtime.weights import random_packed

    if op == "gdn_delta_rule":
        return _make_gdn(torch, dims, rng)
    if op == "gdn_conv":
        return _make_gdn_conv(torch, dims, rng)
    if op.startswith("paged_attention"):
        return _make_attention(torch, dims, rng, op)
    if op == "gdn_decode":
        return _make_gdn_decode(torch, dims, rng)
    if op == "gdn_verify":
        return _make_gdn_verify(torch, dims, rng)
    if op == "sample":
        return _make_sample(torch, dims, rng)
    if is_expert_op(op):
        return _make_moe(torch, contract, op, dims, rng)
    if op == "linear_fp8_w8a8":
        return _make_w8a8(torch, dims, rng)
    if op == "quant_fp8_per_token":
        T, K, dev = dims["T"], dims["K"], rng.device
        return {"x": torch.randn(T, K, device=dev, generator=rng).bfloat16(),
                "q": torch.empty(T, K, device=dev, dtype=torch.uint8), "s": torch.empty(T, device=dev)}
    suffix = op.rsplit("_", 1)[1] if op.startswith(("linear_", "dequant_")) else None
    packed = suffix if suffix in FORMATS else None   # linear_q4 / dequant_q4 / linear_swiglu_q4, not linear_swiglu
    if op.startswith("dequant_"):   # T rows of a packed [T, K] matrix
        dims["N"] = dims["T"]
    if op.startswith("linear_swiglu_"):   # the packed [gate | up] matrix: 2I rows
        dims["N"] = 2 * dims["I"]
    if packed:
        dims["WB"] = nbytes(packed, (dims["N"], dims["K"]))
    if op == "attn_qk_prep":   # the fused projection row: [q | gate] per head, then k, then v
        dims["W"] = 2 * dims["NH"] * dims["D"] + 2 * dims["NKV"] * dims["D"]

    ts = {}
    for name, spec in {**contract["inputs"], **contract["outputs"]}.items():
        dt = TORCH_DTYPES[dtype if spec["dtype"] == "$dtype" else spec["dtype"]]
        if dt == torch.uint8:
            ts[name] = random_packed(packed, (dims["N"], dims["K"]), rng.device, rng, dims["K"] ** -0.5).data
        elif dt == torch.int32:
            ts[name] = torch.randint(0, dims.get("V", 1), shape_of(spec, dims), device=rng.device, dtype=dt, generator=rng)
        else:
            ts[name] = torch.randn(shape_of(spec, dims), device=rng.device, dtype=torch.float32, generator=rng).to(dt)
    return ts


def _make_w8a8(torch, dims, rng):
    """Per-token E4M3 activation codes (finite: magnitudes below 448, random signs) and scales, a packed fp8 weight."""
    from ninfer.runtime.formats import nbytes
    from ninfer.runtime.weights import random_packed
    T, N, K, dev = dims["T"], dims["N"], dims["K"], rng.device
    dims["WB"] = nbytes("fp8", (N, K))
    mag = torch.randint(0, 0x7F, (T, K), device=dev, generator=rng, dtype=torch.uint8)
    sign = torch.randint(0, 2, (T, K), device=dev, generator=rng, dtype=torch.uint8) << 7
    return {"xq": mag | sign, "xs": torch.rand(T, device=dev, generator=rng) / 448,
            "w": random_packed("fp8", (N, K), dev, rng, K ** -0.5).data,
            "y": torch.empty(T, N, device=dev, dtype=torch.bfloat16)}


def _make_gdn(torch, dims, rng):
    """One sequence of T tokens through the delta rule (prefill when T is large), real-looking gates."""
    T, hv, dk, dv = dims["T"], dims["HV"], dims["DK"], dims["DV"]
    dev = rng.device
    return {"qkv": torch.randn(T, 2 * GDN_K_HEADS * dk + hv * dv, device=dev, generator=rng).bfloat16(),
            "g": -torch.rand(T, hv, device=dev, generator=rng) * 2, "beta": torch.rand(T, hv, device=dev, generator=rng),
            "query_start": torch.tensor([0, T], dtype=torch.int32, device=dev),
            "slots": torch.zeros(1, dtype=torch.int32, device=dev),
            "state": torch.randn(2, hv, dk, dv, device=dev, generator=rng) * 0.1,
            "o": torch.empty(T, hv, dv, device=dev, dtype=torch.bfloat16)}


def _make_gdn_conv(torch, dims, rng):
    """One sequence of T tokens through the causal conv of the q|k|v channels, its state in slot 1 of 2."""
    T, C, kw, dev = dims["T"], dims["C"], dims["KW"], rng.device
    return {"x": torch.randn(T, C, device=dev, generator=rng).bfloat16(),
            "w": (torch.randn(C, kw, device=dev, generator=rng) * 0.5).bfloat16(),
            "query_start": torch.tensor([0, T], dtype=torch.int32, device=dev),
            "slots": torch.ones(1, dtype=torch.int32, device=dev),
            "conv_state": torch.randn(2, C, kw - 1, device=dev, generator=rng).bfloat16(),
            "y": torch.empty(T, C, device=dev, dtype=torch.bfloat16)}


# sample settings (temperature, top_k, top_p, min_p) by the problem's "sampling" name; no penalties (counts unread)
SAMPLING = {"greedy": (0.0, 0, 1.0, 0.0), "qwen": (0.7, 20, 0.95, 0.0), "pure": (1.0, 0, 1.0, 0.0)}


def _make_sample(torch, dims, rng):
    """T rows of logits at the vocabulary V, every row with the problem's sampling settings."""
    T, V, dev = dims["T"], dims["V"], rng.device
    temp, top_k, top_p, min_p = SAMPLING[dims["sampling"]]
    full = lambda v, dt: torch.full((T,), v, device=dev, dtype=dt)  # noqa: E731
    return {"logits": (torch.randn(T, V, device=dev, generator=rng) * 3).bfloat16(),
            "counts": torch.zeros(T, V, device=dev, dtype=torch.int32),
            "temperature": full(temp, torch.float32), "top_k": full(top_k, torch.int32), "top_p": full(top_p, torch.float32),
            "min_p": full(min_p, torch.float32), "presence": full(0.0, torch.float32), "frequency": full(0.0, torch.float32),
            "seed": torch.arange(T, device=dev, dtype=torch.int32), "counter": full(7, torch.int32),
            "ids": full(0, torch.int32)}


def _make_gdn_decode(torch, dims, rng):
    """A decode step of T sequences (one token each) through the fused GDN mixer, states in distinct slots."""
    T, H, hk, r, dk, dv = (dims[d] for d in ("T", "H", "HK", "R", "DK", "DV"))
    C, hv, dev = 2 * hk * dk + hk * r * dv, hk * r, rng.device
    randn = lambda *shape, scale=1.0: torch.randn(*shape, device=dev, generator=rng) * scale  # noqa: E731
    return {"x": randn(T, H).bfloat16(), "qkvz": randn(T, C + hv * dv).bfloat16(),
            "w_ba": randn(2, hk, r, H, scale=H ** -0.5).bfloat16(), "conv_w": randn(C, 4, scale=0.5).bfloat16(),
            "A_log": randn(hk, r), "dt_bias": randn(hk, r), "norm_w": (randn(dv, scale=0.5) + 1).bfloat16(),
            "slots": torch.randperm(T, device=dev, generator=rng).int(), "conv_state": randn(T, C, 3).bfloat16(),
            "state": randn(T, hk, r, dk, dv, scale=0.5), "y": torch.empty(T, hk, r, dv, device=dev, dtype=torch.bfloat16)}


def _make_gdn_verify(torch, dims, rng):
    """The T tokens of a verify step in runs of VERIFY_RUN (the last one shorter), one sequence a run, each committing
    its whole run: the round's commit, which writes the states (the verify itself reads them only)."""
    T = dims["T"]
    runs = [min(VERIFY_RUN, T - a) for a in range(0, T, VERIFY_RUN)]
    ts = _make_gdn_decode(torch, {**dims, "T": len(runs)}, rng)
    dev, hk, r, dv = rng.device, dims["HK"], dims["R"], dims["DV"]
    H, CZ = ts["x"].shape[1], ts["qkvz"].shape[1]
    ts |= {"x": torch.randn(T, H, device=dev, generator=rng).bfloat16(),
           "qkvz": torch.randn(T, CZ, device=dev, generator=rng).bfloat16(),
           "query_start": torch.tensor([0, *itertools.accumulate(runs)], dtype=torch.int32, device=dev),
           "commit": torch.tensor(runs, dtype=torch.int32, device=dev),
           "y": torch.empty(T, hk, r, dv, device=dev, dtype=torch.bfloat16)}
    return ts


def _make_attention(torch, dims, rng, op):
    """T <= ATTN_DECODE_MAX_T: a decode step, T sequences of ATTN_CONTEXT tokens each, one query token per sequence.
    Larger T: a prefill chunk, the last T tokens of one ATTN_CONTEXT-token prompt. paged_attention_verify: T / L
    lanes (L: dims["L"], else VERIFY_RUN), each querying its last L positions. Every page of the cache belongs to
    a sequence (so the cache's bytes are the bytes the launch must read). paged_attention_split writes KS partials
    per (token, head) instead of o. The _fp8 ops read E4M3 codes: random magnitudes below 4 (codes < 0x48), random signs."""
    T, nh, nkv, d, bs = dims["T"], dims["NH"], dims["NKV"], dims["D"], dims["BS"]
    decode = T <= ATTN_DECODE_MAX_T
    run = dims.get("L", VERIFY_RUN) if op == "paged_attention_verify" else 1   # a verify step: lanes of L tokens
    seqs, mb = (T // run if decode else 1), ATTN_CONTEXT // bs
    dev = rng.device
    if op.endswith("_fp8"):
        shape = (seqs * mb, bs, nkv, d)
        byte = lambda hi: torch.randint(0, hi, shape, device=dev, generator=rng, dtype=torch.uint8)  # noqa: E731
        cache = lambda: byte(0x48) | (byte(2) << 7)  # noqa: E731
    else:
        cache = lambda: torch.randn(seqs * mb, bs, nkv, d, device=dev, generator=rng).bfloat16()  # noqa: E731
    ts = {"q": torch.randn(T, nh, d, device=dev, generator=rng).bfloat16(), "k_cache": cache(), "v_cache": cache(),
          "block_table": torch.randperm(seqs * mb, device=dev, generator=rng).int().view(seqs, mb),
          "token_seq": (torch.arange(seqs, dtype=torch.int32, device=dev).repeat_interleave(run) if decode
                        else torch.zeros(T, dtype=torch.int32, device=dev)),
          "positions": (torch.arange(ATTN_CONTEXT - run, ATTN_CONTEXT, dtype=torch.int32, device=dev).repeat(seqs)
                        if decode else torch.arange(ATTN_CONTEXT - T, ATTN_CONTEXT, dtype=torch.int32, device=dev))}
    if not op.startswith(("paged_attention_split", "paged_attention_verify")):
        ts["o"] = torch.empty(T, nh, d, device=dev, dtype=torch.bfloat16)
    else:
        ks = dims["KS"]
        ts.update(part_o=torch.empty(T, nh, ks, d, device=dev), m=torch.empty(T, nh, ks, device=dev),
                  l=torch.empty(T, nh, ks, device=dev))
    return ts


def _moe_formats(op: str) -> tuple[str | None, str | None]:
    """(gate_up format, down format) an expert op reads: moe_experts (bf16), moe_experts_q4, moe_experts_q4_q5,
    moe_gate_up[_grouped]_q4 (no down), moe_down[_grouped]_q5 (no gate_up); moe_align and moe_sum read no weights."""
    if op == "moe_experts":   # bf16 experts, [E, 2I, H] and [E, H, I]
        return "bf16", "bf16"
    if op.startswith("moe_experts_"):
        fmts = op.split("_")[2:]
        return fmts[0], fmts[-1]
    fmt = op.rsplit("_", 1)[1]
    return (fmt, None) if op.startswith("moe_gate_up_") else (None, fmt) if op.startswith("moe_down_") else (None, None)


def _moe_routing(torch, dims, rng, names) -> dict:
    """Fresh activations and routing for the tensors named: K distinct experts per token, softmax weights, and
    moe_align's order and offsets of those ids."""
    from ninfer.runtime.reference import moe_align
    T, H, E, I, K = (dims[d] for d in ("T", "H", "E", "I", "K"))
    dev = rng.device
    ids = torch.rand(T, E, device=dev, generator=rng).argsort(-1)[:, :K].int().contiguous()
    make = {"x": lambda: torch.randn(T, H, device=dev, generator=rng).bfloat16(),
            "ids": lambda: ids,
            "weights": lambda: torch.softmax(torch.randn(T, K, device=dev, generator=rng), -1).contiguous(),
            "h": lambda: torch.randn(T, K, I, device=dev, generator=rng),
            "ys": lambda: torch.randn(T, K, H, device=dev, generator=rng),
            "y": lambda: torch.empty(T, H, device=dev, dtype=torch.bfloat16)}
    out = {k: make[k]() for k in names if k in make}
    if "order" in names or "offsets" in names:
        out.update(moe_align(ids, {"E": E}))
    return out


def _make_moe(torch, contract, op, dims, rng):
    """Random packed experts of every E and one token batch's routing (the tensors the contract names)."""
    from ninfer.runtime.weights import random_packed
    H, E, I = dims["H"], dims["E"], dims["I"]
    gfmt, dfmt = _moe_formats(op)
    ts = _moe_routing(torch, dims, rng, [*contract["inputs"], *contract["outputs"]])

    def weights(fmt, rows, cols):
        if fmt == "bf16":
            return (torch.randn(E, rows, cols, device=rng.device, generator=rng) * cols ** -0.5).bfloat16()
        return random_packed(fmt, (E * rows, cols), rng.device, rng, cols ** -0.5).data
    if gfmt:
        ts["gate_up"] = weights(gfmt, 2 * I, H)
    if dfmt:
        ts["down"] = weights(dfmt, H, I)
    return ts


def moe_sets(torch, base, dims, rng, n: int = 8) -> list[dict]:
    """`base` and n-1 sets with the same expert weights (hundreds of MB) but their own routing, so launches
    that cycle through them read other experts each time instead of the last launch's from the L2."""
    return [base] + [{**base, **_moe_routing(torch, dims, rng, [k for k in base if k not in ("gate_up", "down")])}
                     for _ in range(n - 1)]


def by_name(contract: dict, problem: dict) -> dict:
    """The problem dims a contract takes by name: those it declares that no tensor's shape carries (the MoE ops'
    E, I). A shared problem (MOE_35B) may name dims an op does not have (moe_align has no H or I)."""
    tensors = {**contract["inputs"], **contract["outputs"], **contract["states"]}
    in_shapes = {str(d).rpartition("*")[2] for spec in tensors.values() for d in spec["shape"]}
    return {d: v for d, v in problem.items() if d in contract["dims"] and d not in in_shapes}
