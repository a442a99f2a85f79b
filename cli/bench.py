"""`ninfer-bench ops`: time every route of every op at real Qwen3.6-27B shapes (the MoE expert ops at the
35B-A3B shape) on the GPU.

Each figure is the median of CUDA-event timings of CUDA-graph replays (20 launches per graph, so no host
overhead sits between kernels) after warm-up, printed next to the ceilings measured
in the same run (device copy bandwidth, torch bf16 GEMM rate) and the fraction reached. Weight-sized
inputs rotate among copies that together exceed the L2, so memory-bound figures are not cache hits.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from types import SimpleNamespace

import click

from ninfer.cli.bench_inputs import (GDN_K_HEADS, SAMPLING, VERIFY_RUN, by_name, contract_bytes, make_inputs, op_bytes,
                                     op_flops, timing_sets)
from ninfer.cli.bench_serve import serve_cmd
from ninfer.cli.bench_spec import spec_cmd
from ninfer.runtime.kv_dtype import KV_CACHE_DTYPES, kv_element_bytes

MOE_35B = {"H": 2048, "E": 256, "I": 512, "K": 8}
# (op, problem dims, T values) at the Qwen3.6-27B shapes (hidden 5120, MLP 17408, 24x256 q+gate heads).
CASES = [
    ("linear", {"N": 17408, "K": 5120}, [1, 2, 4, 8, 16, 64, 128, 512, 2048, 4096]),
    ("linear", {"N": 5120, "K": 17408}, [1, 8, 4096]),
    ("linear", {"N": 12288, "K": 5120}, [1, 4096]),
    ("rms_norm_zc", {"H": 5120}, [1, 8, 4096]),
    ("add_rms_norm_zc", {"H": 5120}, [1, 8, 4096]),
    # a 35B-A3B MoE layer's end: the shared expert's gate add, the add-norm, and the two in one launch
    *((op, {"H": 2048}, [1, 8]) for op in ("sigmoid_gate_add", "add_rms_norm_zc", "sigmoid_gate_add_rms_norm_zc")),
    ("rms_norm", {"H": 128}, [48, 48 * 4096]),
    ("add", {"H": 5120}, [1, 4096]),
    ("silu_and_mul", {"I": 17408}, [1, 4096]),
    # the 27B MLP's up projection with the activation in the GEMM epilogue (against linear N 34816 + silu_and_mul)
    ("linear", {"N": 34816, "K": 5120}, [4096]),
    ("linear_swiglu", {"I": 17408, "K": 5120}, [4096]),
    ("sigmoid_mul", {"N": 6144}, [1, 4096]),
    ("embedding", {"V": 248320, "H": 5120}, [1, 4096]),
    ("linear_q4", {"N": 17408, "K": 5120}, [1, 2, 4, 8, 9, 16, 64, 512, 4096]),
    ("linear_q4", {"N": 5120, "K": 17408}, [1, 8, 16, 32, 4096]),
    ("linear_q4", {"N": 5120, "K": 6144}, [32]),
    ("linear_q4", {"N": 34816, "K": 5120}, [8, 16, 32, 64]),
    # a verify step of 8 lanes of K = 3 (T = 32): the GDN in_qkvz projection and the MLP's fused SwiGLU
    ("linear_q4", {"N": 16384, "K": 5120}, [16, 32]),
    ("linear_swiglu_q4", {"I": 17408, "K": 5120}, [16, 32]),
    # prefill with the codes decoded inside the wgmma GEMM (against dequant_q4 + linear / linear_swiglu above)
    ("linear_q4", {"N": 6144, "K": 5120}, [4096]),
    ("linear_q4", {"N": 34816, "K": 5120}, [4096]),
    ("linear_swiglu_q4", {"I": 17408, "K": 5120}, [4096]),
    ("linear_q4", {"N": 248320, "K": 5120}, [1, 32]),
    *((f"linear_{f}", {"N": 17408, "K": 5120}, [1, 4096]) for f in ("q5", "q6", "w8", "fp8")),
    # FP8 weights on FP8 tensor cores (W8A8): the activations' per-token codes, then the E4M3 GEMM at the 27B MLP
    # shapes (against dequant_fp8 + linear, the bf16 path, and linear_fp8's mma.sync route above)
    ("quant_fp8_per_token", {"K": 5120}, [4096]),
    ("quant_fp8_per_token", {"K": 17408}, [4096]),
    ("linear_fp8_w8a8", {"N": 17408, "K": 5120}, [512, 2048, 4096]),
    ("linear_fp8_w8a8", {"N": 34816, "K": 5120}, [4096]),
    ("linear_fp8_w8a8", {"N": 5120, "K": 17408}, [4096]),
    # prefill decodes each packed matrix into a bf16 scratch (T = its rows): 27B gate_up and down
    *((f"dequant_{f}", {"K": 5120}, [34816]) for f in ("q4", "q5", "q6", "w8", "fp8")),
    ("dequant_q4", {"K": 17408}, [5120]),
    # one sequence of T tokens: 27B, then 35B-A3B (4096: a prefill chunk)
    ("gdn_delta_rule", {"HV": 48, "DK": 128, "DV": 128}, [1, 8, 31, 32, 1024, 4096]),
    ("gdn_delta_rule", {"HV": 32, "DK": 128, "DV": 128}, [4096]),
    # the fused GDN decode step of T sequences: 27B, then 35B-A3B
    ("gdn_decode", {"H": 5120, "HK": 16, "R": 3, "DK": 128, "DV": 128}, [1, 2, 4, 8]),
    ("gdn_decode", {"H": 2048, "HK": 16, "R": 2, "DK": 128, "DV": 128}, [1, 2, 4, 8]),
    # a speculative verify step's GDN mixer: T tokens in runs of 4 (1, 2, 8 lanes at K = 3), each run committed;
    # T = 1..3 one lane of that many tokens (the cost of a token in the run, against gdn_decode at T = 1)
    ("gdn_verify", {"H": 5120, "HK": 16, "R": 3, "DK": 128, "DV": 128}, [1, 2, 3, 4, 8, 32]),
    ("gdn_verify", {"H": 2048, "HK": 16, "R": 2, "DK": 128, "DV": 128}, [4, 32]),
    # T <= 64: T sequences at ATTN_CONTEXT (decode); 4096: the second chunk of an 8K prompt (prefill)
    ("paged_attention", {"NH": 24, "NKV": 4, "D": 256, "BS": 16}, [1, 2, 4, 8, 4096]),
    ("paged_attention", {"NH": 16, "NKV": 2, "D": 256, "BS": 16}, [1, 2, 4096]),
    # flash decoding: the split partials at a few split counts, then their merge (times the output gate)
    *(("paged_attention_split", {"NH": nh, "NKV": nkv, "D": 256, "BS": 16, "KS": ks}, [1, 2, 4, 8])
      for nh, nkv in ((24, 4), (16, 2)) for ks in (8, 16, 32, 64)),
    *(("merge_attn_states", {"NH": 24, "D": 256, "KS": ks}, [1, 8]) for ks in (8, 16, 32, 64)),
    # a verify step's attention: 1, 2 and 8 lanes of 4 tokens (K = 3), each lane's keys read once for 2 of its tokens
    *(("paged_attention_verify", {"NH": nh, "NKV": nkv, "D": 256, "BS": 16, "KS": ks}, [4, 8, 32])
      for nh, nkv in ((24, 4), (16, 2)) for ks in (8, 16, 32)),
    # the same over the FP8 cache (E4M3 codes, half the bytes)
    ("paged_attention_fp8", {"NH": 24, "NKV": 4, "D": 256, "BS": 16}, [1, 8, 4096]),
    *(("paged_attention_split_fp8", {"NH": 24, "NKV": 4, "D": 256, "BS": 16, "KS": ks}, [1, 2, 4, 8]) for ks in (8, 32)),
    *(("paged_attention_split_fp8", {"NH": 16, "NKV": 2, "D": 256, "BS": 16, "KS": ks}, [1, 8]) for ks in (8, 32)),
    # the routed experts of a 35B-A3B MoE layer: the single op, and its split decode form (gate_up, then down)
    *((op, MOE_35B, [1, 2, 4, 8, 16, 32, 64]) for op in ("moe_gate_up_q4", "moe_down_q4")),
    ("moe_experts_q4", MOE_35B, [1, 2, 4, 8, 16, 32, 64, 256, 1024]),
    *((op, MOE_35B, [1, 8]) for op in ("moe_experts_q4_q5", "moe_down_q5")),
    # routing: the GEMV routes at decode, wgmma from a few tokens on
    ("moe_router", {"E": 256, "H": 2048}, [1, 2, 4, 8, 64, 1024, 2048, 4096]),
    ("moe_topk", {"E": 256, "K": 8}, [1, 8]),
    # token selection over the Qwen vocabulary rows: argmax, and the sampler greedy / Qwen-style / every id kept
    ("argmax", {"V": 248320}, [1, 8]),
    *(("sample", {"V": 248320, "sampling": mode}, [1, 8]) for mode in ("greedy", "qwen", "pure")),
    # the prefill form: pairs sorted by expert, grouped GEMMs, slot sum
    *((op, MOE_35B, [64, 256, 1024, 4096]) for op in ("moe_align", "moe_gate_up_grouped_q4", "moe_down_grouped_q4",
                                                       "moe_sum")),
]


def measure_fp8_gemm(torch) -> float | None:
    """E4M3 GEMM TFLOP/s via torch._scaled_mm (8192^3, per-tensor scales, fp32 accumulation), median of 10; None
    where torch has no FP8 GEMM for this GPU."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    try:
        secs = _time(torch, lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), 10)
    except (RuntimeError, AttributeError):
        return None
    return 2 * 8192**3 / secs / 1e12


def measure_ceilings(torch) -> tuple[float, float]:
    """Device copy GB/s (read + write) and bf16 GEMM TFLOP/s via torch, median of 10."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy = _time(torch, lambda: b.copy_(a), 10)
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    n = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = _time(torch, lambda: m @ n, 10)
    return 2 * a.numel() / copy / 1e9, 2 * 8192**3 / gemm / 1e12


def _time(torch, fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def _time_graph(torch, plans, reps: int, launches: int = 20) -> float:
    """Seconds per launch: `launches` launches (cycling through input sets) captured in one CUDA graph and
    replayed, so no host overhead sits between kernels, as in graph-replayed decode."""
    from ninfer.runtime.decode_graph import capture

    def launch_all():
        for i in range(launches):
            plans[i % len(plans)]()

    def warm_each():
        for p in plans:
            p()
    return _time(torch, capture(launch_all, warm_each).replay, reps) / launches


OP_PARAMS = {"gdn_delta_rule": {"num_k_heads": GDN_K_HEADS, "scale": 128 ** -0.5}, "paged_attention": {"scale": 256 ** -0.5},
             "paged_attention_split": {"scale": 256 ** -0.5}, "paged_attention_verify": {"scale": 256 ** -0.5, "L": VERIFY_RUN},
             "gdn_decode": {"scale": 128 ** -0.5}, "gdn_verify": {"scale": 128 ** -0.5},
             "paged_attention_fp8": {"scale": 256 ** -0.5}, "paged_attention_split_fp8": {"scale": 256 ** -0.5},
             "attn_qk_prep": {"theta": 1.0e7, "rotary_dim": 64}, "argmax": {"domain": 248077},
             "sample": {"domain": 248077}}


def bench_ops(ops: tuple[str, ...], reps: int, json_out: str | None, routes: tuple[str, ...] = (),
              tokens: tuple[int, ...] = ()) -> None:
    import fnmatch

    import torch

    from ninfer.runtime.dispatch import CudaBackend
    from ninfer.runtime.manifest import RouteError

    be = CudaBackend()
    copy_gbs, gemm_tflops = measure_ceilings(torch)
    dev = be.device
    click.echo(f"# {dev.name} ({dev.arch}, {dev.sm_count} SMs); measured ceilings: copy {copy_gbs:,.0f} GB/s "
               f"(read+write), bf16 GEMM {gemm_tflops:,.0f} TFLOP/s (torch)")
    fp8_tflops = None
    if any(op.endswith("_w8a8") for op, _, _ in CASES if not ops or op in ops):
        fp8_tflops = measure_fp8_gemm(torch)
        click.echo(f"# FP8 GEMM {fp8_tflops:,.0f} TFLOP/s (torch._scaled_mm): the peak of the _w8a8 ops" if fp8_tflops
                   else "# no FP8 GEMM in torch here: the _w8a8 ops' %peak is against the bf16 GEMM")
    click.echo(f"{'op':<18}{'problem':<18}{'T':>7}  {'route':<18}{'us':>9}{'GB/s':>8}{'%bw':>6}{'TFLOP/s':>9}{'%peak':>7}")
    rows = []
    rng = torch.Generator(device="cuda")
    rng.manual_seed(0)
    for op, problem, Ts in CASES:
        if ops and op not in ops:
            continue
        contract = be.contract(op)
        for T in Ts:
            if tokens and T not in tokens:
                continue
            dims = {"T": T, **problem}
            instances = sorted({k.instance for k in be.manifest.kernels.values() if k.op == op and k.arch == dev.arch
                                and (not routes or any(fnmatch.fnmatch(k.instance, r) for r in routes))})
            chosen = be.select(op, "bf16", dims).instance
            sets = None
            for inst in instances:
                if sets is None:
                    base = make_inputs(torch, contract, "bf16", dims, rng, op)
                    nbytes = op_bytes(op, base, dims)
                    sets = timing_sets(torch, op, base, dims, rng)
                try:
                    plans = [be.plan(op, route=inst, **s, **OP_PARAMS.get(op, {}), **by_name(contract, problem))
                             for s in sets]
                except RouteError:
                    continue  # this route's constraints exclude the problem (e.g. T above its tmax)
                secs = _time_graph(torch, plans, reps)
                flops = op_flops(op, T, problem)
                gbs = nbytes / secs / 1e9
                peak = fp8_tflops if op.endswith("_w8a8") and fp8_tflops else gemm_tflops
                row = {"op": op, "problem": problem, "T": T, "route": inst, "selected": inst == chosen,
                       "us": secs * 1e6, "GB/s": gbs, "bw_frac": gbs / copy_gbs,
                       "TFLOP/s": flops / secs / 1e12, "peak_frac": flops / secs / 1e12 / peak}
                rows.append(row)
                mark = "*" if inst == chosen else " "
                click.echo(f"{op:<18}{json.dumps(problem, separators=(',', ':')):<18}{T:>7}  {mark}{inst:<17}"
                           f"{row['us']:>9.1f}{gbs:>8.0f}{100 * row['bw_frac']:>5.0f}%"
                           f"{row['TFLOP/s']:>9.1f}{100 * row['peak_frac']:>6.0f}%")
            del sets
            torch.cuda.empty_cache()
    click.echo("(* = the route the table selects for this T; GB/s counts each input read once and each output written once)")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"device": dev.name, "arch": dev.arch, "copy_GBps": copy_gbs, "gemm_TFLOPs": gemm_tflops,
                       "fp8_gemm_TFLOPs": fp8_tflops, "rows": rows}, f, indent=1)


@click.group()
def main() -> None:
    """Benchmarks (GPU): figures with the fraction of the measured roofline."""


@main.command("ops")
@click.option("--op", "ops", multiple=True, help="only these ops (repeatable)")
@click.option("--route", "routes", multiple=True, help="only route instances matching this pattern, e.g. 'prefill*' "
              "(repeatable)")
@click.option("--tokens", "tokens", multiple=True, type=int, help="only these token counts T (repeatable)")
@click.option("--reps", default=30, show_default=True)
@click.option("--json", "json_out", type=click.Path(), help="also write the rows to this JSON file")
def ops_cmd(ops, routes, tokens, reps, json_out) -> None:
    """Time each route of each op at the 27B shapes (events, warm-up, median)."""
    from ninfer.runtime.cuda import gpu_available
    if not gpu_available():
        click.echo("ninfer-bench ops: needs a CUDA GPU (none found)", err=True)
        sys.exit(2)
    bench_ops(ops, reps, json_out, routes, tokens)


def model_figures(cfg, n_prompt_tokens: int, fmt: str = "bf16", kv_bytes: int = 2) -> dict:
    """FLOPs per prompt token (weights + causal attention at this length) and decode bytes per step (kv_bytes: per
    cached K or V element, 1 with the FP8 cache)."""
    from ninfer.runtime.synthetic import weight_bytes, weight_shapes
    shapes, nbytes = weight_shapes(cfg), weight_bytes(cfg, fmt)
    matmul_params = sum(math.prod(s) for n, s in shapes.items() if len(s) >= 2 and n != "embed"
                        and ".experts." not in n)
    expert_params = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n)
    active_experts = expert_params * cfg.experts_per_token // cfg.experts if cfg.experts else 0
    attn_layers = sum(cfg.is_attention(i) for i in range(cfg.layers))
    attn_flops = attn_layers * 2 * cfg.heads * cfg.head_dim * n_prompt_tokens  # QK^T + PV, causal half, per token
    return {"flops_per_token": 2 * (matmul_params + active_experts) + attn_flops,
            "dense_bytes": sum(b for n, b in nbytes.items() if len(shapes[n]) >= 2 and n != "embed"
                               and ".experts." not in n),
            # one expert's weights in one layer: a decode step reads min(E, C*K) of them per MoE layer
            "expert_bytes_per_choice": sum(b for n, b in nbytes.items() if ".experts." in n)
                                       // max(cfg.experts * sum(cfg.moe_layers), 1),
            "kv_bytes_per_token": 2 * attn_layers * cfg.kv_heads * cfg.head_dim * kv_bytes,
            "gdn_state_bytes": (cfg.layers - attn_layers) * cfg.v_heads * cfg.k_dim * cfg.v_dim * 4}


def decode_step_bytes(cfg, fig: dict, c: int, context: int) -> int:
    """Fewest bytes one decode step of c sequences at this context must read: the dense weights, the experts
    the c tokens choose (at most all of them) in every MoE layer, each sequence's KV cache and GDN state."""
    chosen = min(cfg.experts, c * cfg.experts_per_token) if cfg.experts else 0
    return (fig["dense_bytes"] + chosen * fig["expert_bytes_per_choice"] * sum(cfg.moe_layers)
            + c * (context * fig["kv_bytes_per_token"] + 2 * fig["gdn_state_bytes"]))


def _eager_profile(torch, be, step) -> tuple[list, dict]:
    """Run one eager step (step()) under CUPTI (torch.profiler): the backend's record of every launch (op, route
    instance, dims, kernel symbol), and the GPU time of each generated kernel symbol in microseconds (a route's
    `_pre` kernel counted with it). CUPTI times each kernel on the GPU itself, so the host's launch time between
    kernels is not counted (CUDA events around each launch counted it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    be.profile = []
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        launches = be.profile
    finally:
        be.profile = None
    us: dict = {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU:
            name = e.name.removesuffix("_pre")
            us[name] = us.get(name, 0.0) + e.time_range.elapsed_us()
    return launches, us


def _profile_table(launches: list, kernel_us: dict, title: str, copy_gbs: float, gemm_tflops: float,
                   contract) -> None:
    """Per (op, route) GPU time of one eager step (_eager_profile) and the fraction of its ceiling: for the linear ops
    FLOPs / GEMM peak and weight bytes / copy bandwidth, for the others the bytes their contract moves
    (contract_bytes) / copy bandwidth; then the ops that lose the most time against their ceiling (which op is
    furthest from it)."""
    agg: dict = {}
    symbols: dict = {}
    for op, inst, dims, symbol in launches:
        a = agg.setdefault((op, inst), [0, 0.0, 0, 0])       # calls, ms, flops, bytes (None: not known)
        a[0] += 1
        symbols[symbol] = (op, inst)
        if op.startswith("linear"):
            a[2] += op_flops(op, dims["T"], dims)
            a[3] += dims.get("WB", op_flops(op, 1, dims))   # bf16 weights: 2 bytes per multiply-add of one token
        else:
            nbytes = contract_bytes(contract(op), dims)
            a[3] = None if nbytes is None or a[3] is None else a[3] + nbytes
    for symbol, key in symbols.items():   # a route instance is one kernel symbol, so its calls' times add up there
        if symbol not in kernel_us:
            raise RuntimeError(f"profile: CUPTI saw no kernel {symbol} although {key[0]} launched it")
        agg[key][1] += kernel_us[symbol] / 1e3
    total = sum(a[1] for a in agg.values())
    click.echo(f"{title}: {total:.2f} ms of kernels in {sum(a[0] for a in agg.values())} launches")
    lost = {}
    for (op, inst), (n, ms, flops, nbytes) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        extra = ""
        if flops:
            tf = flops / (ms * 1e-3) / 1e12
            extra = f"{tf:6.1f} TFLOP/s = {100 * tf / gemm_tflops:5.1f} % of peak; weights "
        if nbytes:
            gbs = nbytes / (ms * 1e-3) / 1e9
            extra += f"{gbs:7.0f} GB/s = {100 * gbs / copy_gbs:5.1f} % of copy"
            lost[(op, inst)] = ms - max(nbytes / (copy_gbs * 1e9), flops / (gemm_tflops * 1e12)) * 1e3
        click.echo(f"  {op:<18} {inst:<24} {n:5d} calls {ms:9.3f} ms {100 * ms / total:5.1f} %  {extra}")
    worst = sorted(lost.items(), key=lambda kv: -kv[1])[:5]
    click.echo("  furthest from their ceiling (ms above bytes / copy rate or FLOPs / GEMM peak, the larger): "
               + ", ".join(f"{op} {inst} {ms:.3f}" for (op, inst), ms in worst))


def _graph_profile(torch, eng, live, step_secs: float, steps: int = 8) -> None:
    """Kernel time per op inside the decode graph replays (CUPTI via torch.profiler), against the step's wall
    time: what is left is launch gaps between the graph's kernels."""
    from torch.profiler import ProfilerActivity, profile
    names = {k.symbol: (k.op, k.instance) for k in eng.be.manifest.kernels.values() if k.arch == eng.be.device.arch}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.decode(live)
        torch.cuda.synchronize()
    agg: dict = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        key = names.get(e.key, (e.key[:40], ""))
        a = agg.setdefault(key, [0, 0.0])
        a[0] += e.count / steps
        a[1] += us / steps
    kernels = sum(a[1] for a in agg.values())
    launches = sum(a[0] for a in agg.values())
    click.echo(f"graph profile, C={len(live)}: {kernels / 1e3:.2f} ms of kernels per {step_secs * 1e3:.2f} ms step, "
               f"{launches:.0f} launches ({(step_secs * 1e6 - kernels) / max(launches, 1):.2f} us of gap per launch)")
    if eng.be.pdl:   # a kernel launched early waits in griddepcontrol.wait, and that wait counts as its time
        click.echo("  (programmatic dependent launch is on: kernels overlap, so the times rank the ops but do not add "
                   "up; NINFER_PDL=0 gives each kernel's own duration)")
    for (op, inst), (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:24]:
        click.echo(f"  {op:<22} {inst:<26} {n:6.0f} / step {us:9.1f} us {100 * us / kernels:5.1f} %  {us / max(n, 1):7.2f} us each")


GAP_STEPS = 9   # decode steps (8 gaps) after each level's timed ones, with events around every graph replay


def step_stats(secs: list[float]) -> dict:
    """The median and the 10th / 90th percentiles (nearest rank) of per-step seconds: a decode figure is the median
    step, and the spread shows whether a slow run is a few stalled steps or every step slower."""
    if not secs:
        raise ValueError("no decode steps were timed")
    s = sorted(secs)
    rank = lambda f: s[round(f * (len(s) - 1))]  # noqa: E731
    return {"median": statistics.median(s), "p10": rank(0.1), "p90": rank(0.9)}


def omit_launches(be, ops) -> None:
    """Make `be.run` drop the launches of these ops (their outputs keep whatever they held): `--omit-op` times a
    decode step without them, the most that fusing them into their neighbours could save."""
    run = be.run

    def run_unless_omitted(op: str, **args) -> None:
        if op not in ops:
            run(op, **args)

    be.run = run_unless_omitted


def bench_model(shape: str, prompts: list[int], concurrency: list[int], decode_prompt: int, steps: int,
                json_out: str | None, fmt: str = "bf16", profile: int = 0, prefill_chunk: int = 4096,
                prefill_reps: int = 3, omit: tuple[str, ...] = (), sampling: str = "greedy",
                kv_cache_dtype: str = "auto") -> None:
    import time

    import torch

    from ninfer.runtime.decode_graph import DecodeGraphs
    from ninfer.runtime.engine import Engine, SamplingParams
    from ninfer.runtime.synthetic import SHAPES, TOKEN_DOMAIN, random_weights

    cfg = SHAPES[shape]
    copy_gbs, gemm_tflops = measure_ceilings(torch)
    weights = random_weights(cfg, "cuda", fmt=fmt)
    # decode tokens a sequence gets: a warm-up step and its share of the steps at each concurrency, twice with --omit-op
    new_tokens = (steps + len(concurrency)) * (2 if omit else 1) + GAP_STEPS * len(concurrency) + 8
    ctx = max(max(prompts), decode_prompt + new_tokens) + 16
    eng = Engine.from_weights(cfg, weights, backend="cuda", domain=TOKEN_DOMAIN, max_context=ctx,
                              max_seqs=max(concurrency), prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype)
    kv_bytes = kv_element_bytes(kv_cache_dtype)
    dev = eng.be.device
    click.echo(f"# {shape} ({fmt} synthetic weights) on {dev.name}; ceilings measured: copy {copy_gbs:,.0f} GB/s, "
               f"bf16 GEMM {gemm_tflops:,.0f} TFLOP/s; KV pages {eng.cache.num_pages} x {eng.cache.page_size} "
               f"(kv cache {eng.kv_cache_dtype}); "
               f"prefill chunk {prefill_chunk}")
    from ninfer.runtime.models import blocks
    fp8_tflops = measure_fp8_gemm(torch) if fmt == "fp8" and blocks.FP8_W8A8_MIN_T is not None else None
    if fp8_tflops:   # the GEMMs from FP8_W8A8_MIN_T tokens run on the FP8 tensor cores: their peak is the roofline
        click.echo(f"# fp8 prefill on the FP8 tensor cores from {blocks.FP8_W8A8_MIN_T} tokens; FP8 GEMM "
                   f"{fp8_tflops:,.0f} TFLOP/s (torch._scaled_mm)")
    rng = torch.Generator().manual_seed(0)
    rows = []

    def ids(n):
        return torch.randint(0, TOKEN_DOMAIN, (n,), generator=rng).tolist()

    def prefill_secs(n):
        seq = eng.open(ids(n), max_new=1)
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while not eng.prefill(seq):
                pass
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        finally:
            eng.release(seq)

    for n in prompts:
        # the first prefill of a length pays its plans, module loads and allocations: warm up, then the median
        prefill_secs(n)
        secs = sorted(prefill_secs(n) for _ in range(prefill_reps))[prefill_reps // 2]
        fig = model_figures(cfg, n // 2, fmt, kv_bytes)
        tps = n / secs
        frac = tps * fig["flops_per_token"] / ((fp8_tflops or gemm_tflops) * 1e12)
        rows.append({"kind": "prefill", "tokens": n, "tok_s": tps, "ttft_s": secs, "peak_frac": frac})
        click.echo(f"prefill {n:>6} tokens: {tps:>9,.0f} tok/s  TTFT {secs:6.2f} s  {100 * frac:5.1f} % of "
                   f"{'FP8' if fp8_tflops else 'bf16'} peak")
    def eager_profiles():   # one eager prefill chunk and one eager decode step at each concurrency, op by op, each
        # op's own GPU time (CUPTI; the backend's profile mode launches without PDL, so no kernel's time holds its wait
        # for the one before)
        lanes = [eng.open(ids(profile), max_new=len(concurrency) + 2) for _ in range(max(concurrency))]
        seq = lanes[0]
        graphs, eng.graphs = eng.graphs, None
        try:
            while seq.prefilled + eng.prefill_chunk < len(seq.prompt):   # keep only the last chunk (most context)
                eng.prefill(seq)
            done = []
            launches, us = _eager_profile(torch, eng.be, lambda: done.append(eng.prefill(seq)))
            _profile_table(launches, us, f"profile: last prefill chunk of a {profile}-token prompt",
                           copy_gbs, gemm_tflops, eng.be.contract)
            while not done[-1]:   # a chunk cut short at a prefix-cache snapshot
                done.append(eng.prefill(seq))
            for s in lanes[1:]:
                while not eng.prefill(s):
                    pass
            for c in concurrency:
                launches, us = _eager_profile(torch, eng.be, lambda: eng.decode(lanes[:c]))
                _profile_table(launches, us, f"profile: one eager decode step, C={c}", copy_gbs, gemm_tflops,
                               eng.be.contract)
        finally:
            eng.graphs = graphs
            for s in lanes:
                eng.release(s)

    def decode_secs(live) -> dict:
        """step_stats of the timed steps; each step ends on its sampled ids' copy to the host (the step's one
        sync), so its wall time is its own."""
        eng.decode(live)  # warm-up step for this batch size
        torch.cuda.synchronize()
        times = []
        for _ in range(steps // len(concurrency)):
            t0 = time.perf_counter()
            eng.decode(live)
            times.append(time.perf_counter() - t0)
        return step_stats(times)

    def host_gap_us(live) -> float | None:
        """Median time (µs, GPU clock) from one decode-graph replay's end to the next one's start, over GAP_STEPS
        more steps: the host's share of a step, while the GPU has nothing to run (None without decode graphs)."""
        if eng.graphs is None:
            return None
        marks, g = [], eng.graphs.graphs[len(live)]
        real = g.graph

        def replay():   # the batch size's captured graph, with events just before and after each replay
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            real.replay()
            end.record()
            marks.append((start, end))
        g.graph = SimpleNamespace(replay=replay)
        try:
            for _ in range(GAP_STEPS):
                eng.decode(live)
        finally:
            g.graph = real
        torch.cuda.synchronize()
        return statistics.median(1e3 * a[1].elapsed_time(b[0]) for a, b in zip(marks, marks[1:]))

    temp, top_k, top_p, min_p = SAMPLING[sampling]
    seqs = [eng.open(ids(decode_prompt), max_new=new_tokens,
                     sampling=SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=i))
            for i in range(max(concurrency))]
    step_ms: dict = {}   # each level's median decode step, in ms
    try:
        for s in seqs:
            while not eng.prefill(s):
                pass
        for c in concurrency:
            live = seqs[:c]
            st = decode_secs(live)
            secs, gap = st["median"], host_gap_us(live)
            fig = model_figures(cfg, decode_prompt, fmt, kv_bytes)
            ctx_now = len(live[0].tokens)
            nbytes = decode_step_bytes(cfg, fig, c, ctx_now)
            tps = c / secs
            frac = (nbytes / secs) / (copy_gbs * 1e9)
            step_ms[c] = secs * 1e3
            rows.append({"kind": "decode", "concurrency": c, "context": ctx_now, "sampling": sampling, "tok_s": tps,
                         "step_ms": secs * 1e3, "step_ms_p10": st["p10"] * 1e3, "step_ms_p90": st["p90"] * 1e3,
                         "host_gap_us": gap, "bytes_per_step": nbytes, "bw_frac": frac})
            how = "" if sampling == "greedy" else f" ({sampling} sampling)"
            click.echo(f"decode C={c}{how}: {tps:>8,.1f} tok/s aggregate ({secs * 1e3:6.2f} ms/step median, p10-p90 "
                       f"{st['p10'] * 1e3:.2f}-{st['p90'] * 1e3:.2f}, "
                       f"{'' if gap is None else f'host gap {gap:.0f} us, '}context {ctx_now}) "
                       f"{100 * frac:5.1f} % of the bandwidth roofline ({nbytes / 1e9:.1f} GB/step)")
        # the profiles come after every timed step: decode steps timed after one read ~1.5 % slow on the H100
        # (PERF_NOTES.md session 39; CUPTI may stay attached once started, as Kineto need not tear it down)
        if profile:
            c = concurrency[0]
            _graph_profile(torch, eng, seqs[:c], step_ms[c] / 1e3)
        if omit:  # the same steps with these ops' launches dropped (outputs wrong): the most fusing them away saves
            omit_launches(eng.be, frozenset(omit))
            if eng.graphs is not None:
                eng.graphs = DecodeGraphs(eng)
            for c in concurrency:
                secs = decode_secs(seqs[:c])["median"]
                full = step_ms[c]
                rows.append({"kind": "decode", "concurrency": c, "omitted": sorted(omit), "tok_s": c / secs,
                             "step_ms": secs * 1e3})
                click.echo(f"decode C={c} without {', '.join(sorted(omit))}: {c / secs:>8,.1f} tok/s aggregate "
                           f"({secs * 1e3:6.2f} ms/step, {full - secs * 1e3:+.2f} ms against the full step; outputs wrong)")
    finally:
        for s in seqs:
            eng.release(s)
    if profile:
        eager_profiles()
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"shape": shape, "device": dev.name, "weights": fmt, "kv_cache_dtype": eng.kv_cache_dtype,
                       "prefill_chunk": prefill_chunk, "copy_GBps": copy_gbs,
                       "gemm_TFLOPs": gemm_tflops, "rows": rows}, f, indent=1)


@main.command("model")
@click.option("--shape", type=click.Choice(["qwen3.6-27b", "qwen3.6-35b-a3b"]), default="qwen3.6-27b", show_default=True)
@click.option("--prompts", default="1024,8192,32768", show_default=True, help="prefill lengths")
@click.option("--concurrency", default="1,2,4,8", show_default=True)
@click.option("--decode-prompt", default=8192, show_default=True, help="context before the decode measurement")
@click.option("--steps", default=64, show_default=True,
              help="decode steps, split over the concurrency levels; each level reports its median step")
@click.option("--weights", "fmt", type=click.Choice(["bf16", "q4", "q5", "q6", "w8", "fp8", "recipe"]), default="bf16",
              show_default=True, help="format of the quantizable matrices (random packed bytes; recipe: each role's "
              "default format, the mix a converted checkpoint gets)")
@click.option("--profile", type=int, default=0, help="also time each op of one prefill of this many tokens and "
              "of one decode step at each --concurrency (eager, after every timed step)")
@click.option("--prefill-chunk", type=click.IntRange(1), default=4096, show_default=True,
              help="prompt tokens per prefill step (each step decodes every packed matrix once for the GEMMs; "
              "ninfer-serve's default while no other request decodes)")
@click.option("--prefill-reps", type=click.IntRange(1), default=3, show_default=True,
              help="timed prefills of each prompt length (the median is reported), after one untimed warm-up")
@click.option("--omit-op", "omit", multiple=True, help="then time the decode steps again with this op's launches "
              "dropped (repeatable; the outputs are wrong): the most that fusing it into its neighbours could save")
@click.option("--sampling", type=click.Choice(list(SAMPLING)), default="greedy", show_default=True,
              help="decode's token choice: greedy, qwen (temperature 0.7, top-k 20, top-p 0.95) or pure "
              "(temperature 1, every id kept)")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="KV cache storage (as ninfer-serve's): fp8 = E4M3 codes; the roofline counts its bytes")
@click.option("--json", "json_out", type=click.Path())
def model_cmd(shape, prompts, concurrency, decode_prompt, steps, fmt, profile, prefill_chunk, prefill_reps,
              omit, sampling, kv_cache_dtype, json_out) -> None:
    """Prefill and decode tok/s of the whole model at real shapes with synthetic weights."""
    from ninfer.runtime.cuda import gpu_available
    from ninfer.runtime.manifest import Manifest
    known = Manifest.load().ops if omit else {}   # the engine loads the manifest again: only when there is a name to check
    if unknown := [op for op in omit if op not in known]:
        raise click.BadParameter(f"unknown op {', '.join(unknown)} (known: {', '.join(sorted(known))})",
                                 param_hint="--omit-op")
    # a stale integer output (token ids, expert indices, positions) would be read as an index: out of bounds
    if indexing := [op for op in omit if any(o["dtype"] == "i32" for o in known[op]["outputs"].values())]:
        raise click.BadParameter(f"{', '.join(indexing)}: writes integer outputs that later kernels index with; "
                                 "only ops with floating-point outputs can be omitted", param_hint="--omit-op")
    if profile and omit:   # the profiles would see the dropped launches, and CUPTI would slow the re-timed steps
        raise click.BadParameter("--profile times the whole step: run it and --omit-op separately",
                                 param_hint="--profile")
    levels = [int(x) for x in concurrency.split(",")]
    if steps < len(levels):   # each level's figure is the median of its share of the steps
        raise click.BadParameter(f"{steps} steps for {len(levels)} concurrency levels: each level needs at least one "
                                 "timed step", param_hint="--steps")
    if not gpu_available():
        click.echo("ninfer-bench model: needs a CUDA GPU (none found)", err=True)
        sys.exit(2)
    bench_model(shape, [int(x) for x in prompts.split(",")], levels, decode_prompt, steps, json_out, fmt, profile,
                prefill_chunk, prefill_reps, omit, sampling, kv_cache_dtype)


main.add_command(serve_cmd)   # `ninfer-bench serve` (cli/bench_serve.py)
main.add_command(spec_cmd)    # `ninfer-bench spec` (cli/bench_spec.py)

if __name__ == "__main__":
    main()
