"""`ninfer-bench spec`: speculative decoding (MTP or n-gram drafts) at a real shape with synthetic weights, against
plain decoding in the same run.

Random weights make a random MTP layer: its drafts are rejected, so a round then commits one token (the worst case,
the verify step's and the MTP layer's cost on top of a decode step); n-gram drafts of random prompts are mostly
none or wrong, likewise. To measure rounds whose drafts are accepted,
the same prompts run again with the drafts taken from the tokens the first pass produced (the known continuation):
a round then commits up to K + 1 tokens (the best case). Real weights land in between (NInfer reports 72-89 %
acceptance with three drafts). Each figure: the median of per-call times (a call ends on its tokens' copy to the
host), tokens committed per call, and the fraction of the bandwidth roofline of one plain decode step's bytes per
round; then the rate at the acceptance NInfer reports with real weights, projected from the known-drafts round's
time (1 + K·a tokens a round: a projection, not a measurement).
"""
from __future__ import annotations

import statistics
import sys
import time

import click

PROFILE_CALLS = 4   # decode calls --profile records after a mode's timed ones
# fractions of drafts accepted that NInfer reports for MTP3 with real weights (its docs/performance.md: 72-89 %)
PROJECT_AT = (0.72, 0.80, 0.89)


def _spec_rows(eng, prompts, rounds: int, known: dict | None, sync, profile=None) -> dict:
    """Open, prefill and run `rounds` timed decode calls for these prompts (greedy); drafts from `known` (prompt ->
    its continuation) where given; then profile(seqs, median call seconds) where given. Returns per-call medians and
    every sequence's tokens."""
    from ninfer.runtime.speculative import drafts_from
    before = dict(eng.spec.stats) if eng.spec is not None else None
    seqs = [eng.open(p, max_new=1 << 30) for p in prompts]
    try:
        with drafts_from(known or {}):
            for s in seqs:
                while not eng.prefill(s):
                    pass
            eng.decode(seqs)   # warm-up (plans, graphs)
            sync()
            times, tokens = [], []
            start = time.perf_counter()
            for _ in range(rounds):
                n0 = sum(s.n_generated for s in seqs)
                t0 = time.perf_counter()
                eng.decode(seqs)
                times.append(time.perf_counter() - t0)
                tokens.append(sum(s.n_generated for s in seqs) - n0)
            sync()   # inside the clock: a call may return before its GPU work ends
            total = time.perf_counter() - start
            if profile is not None:
                profile(seqs, statistics.median(times))
        out = {"call_s": statistics.median(times), "tokens_per_call": sum(tokens) / len(tokens),
               "tok_s": sum(tokens) / total, "tokens": {tuple(s.prompt): list(s.tokens) for s in seqs},
               "context": len(seqs[0].tokens)}
        if before is not None:
            st = {k: eng.spec.stats[k] - before[k] for k in before}
            out["acceptance"] = st["num_accepted_tokens"] / max(st["num_draft_tokens"], 1)
        return out
    finally:
        for s in seqs:
            eng.release(s)


def bench_spec(cfg, eng, concurrency: list[int], decode_prompt: int, rounds: int, k: int, fmt: str,
               copy_gbs: float | None, sync=lambda: None, echo=click.echo, profile=None) -> list[dict]:
    """For each concurrency: plain decode (the engine's own path: CUDA graphs on the GPU), rounds with the method's own
    drafts, rounds with the known continuation's drafts; profile(seqs, call seconds) after each mode's timed calls
    where given (ninfer-bench spec --profile: the kernels of the rounds)."""
    import torch

    from ninfer.cli.bench import decode_step_bytes, model_figures
    from ninfer.runtime.decode_graph import DecodeGraphs
    rng = torch.Generator().manual_seed(0)
    fig = model_figures(cfg, decode_prompt, fmt)
    if eng.cuda_graphs and eng.graphs is None:   # the plain baseline as served: decode steps captured
        eng.graphs = DecodeGraphs(eng)
    rows = []
    for c in concurrency:
        prompts = [torch.randint(0, eng.domain, (decode_prompt,), generator=rng).tolist() for _ in range(c)]
        spec, eng.spec = eng.spec, None
        try:
            plain = _spec_rows(eng, prompts, rounds, None, sync, profile)
        finally:
            eng.spec = spec
        # (own: also the continuation for the next pass, so as many more tokens as the profile's calls may commit)
        own = _spec_rows(eng, prompts, (rounds + PROFILE_CALLS) * (k + 1) + 2, None, sync, profile)
        injected = _spec_rows(eng, prompts, rounds, own["tokens"], sync, profile)
        nbytes = decode_step_bytes(cfg, fig, c, decode_prompt)
        for name, r in (("plain", plain), (f"{eng.spec.config.method} drafts", own), ("known drafts", injected)):
            frac = nbytes / r["call_s"] / (copy_gbs * 1e9) if copy_gbs else None
            row = {"concurrency": c, "mode": name, "num_speculative_tokens": 0 if name == "plain" else k,
                   "tok_s": r["tok_s"], "call_ms": r["call_s"] * 1e3, "tokens_per_call": r["tokens_per_call"],
                   "acceptance": r.get("acceptance"), "bw_frac_per_call": frac, "context": r["context"]}
            rows.append(row)
            acc = "" if row["acceptance"] is None else f", {100 * row['acceptance']:5.1f} % of drafts accepted"
            roof = "" if frac is None else f", {100 * frac:5.1f} % of the bandwidth roofline of a decode step per call"
            echo(f"C={c} {name:>12}: {row['tok_s']:>8,.1f} tok/s ({row['call_ms']:6.2f} ms a call median, "
                 f"{row['tokens_per_call']:.2f} tokens a call{acc}{roof})")
        echo(f"C={c}: {eng.spec.config.method} with K={k} against plain: {own['tok_s'] / plain['tok_s']:.2f}x with its "
             f"own drafts (random weights), {injected['tok_s'] / plain['tok_s']:.2f}x with drafts that hold")
        # a round verifies K drafts a lane and commits 1 + K * a tokens on average at acceptance a; its time is about
        # the known-drafts round's (the same launches; fewer kept rows only shorten the commit)
        proj = {a: c * (1 + k * a) / injected["call_s"] for a in PROJECT_AT}
        rows[-1]["projected_tok_s"] = {f"{a:.2f}": v for a, v in proj.items()}
        echo(f"C={c}: projected at {' / '.join(f'{100 * a:.0f}' for a in proj)} % of drafts accepted (NInfer's MTP3 "
             f"range, real weights): {' / '.join(f'{v:,.0f}' for v in proj.values())} tok/s (1 + K·a tokens a round "
             f"at the known-drafts round's {injected['call_s'] * 1e3:.2f} ms; plain {plain['tok_s']:,.1f})")
    return rows


@click.command("spec")
@click.option("--shape", type=click.Choice(["qwen3.6-27b", "qwen3.6-35b-a3b"]), default="qwen3.6-27b", show_default=True)
@click.option("--weights", "fmt", type=click.Choice(["bf16", "q4", "q5", "q6", "w8", "fp8", "recipe"]), default="q4",
              show_default=True, help="format of the quantizable matrices, the MTP layer's too (random packed bytes)")
@click.option("--method", type=click.Choice(["mtp", "ngram"]), default="mtp", show_default=True,
              help="where drafts come from: the MTP layer (synthetic weights, included) or prompt lookup")
@click.option("--num-speculative-tokens", "k", type=click.IntRange(1, 8), default=3, show_default=True)
@click.option("--draft-vocab-size", type=click.IntRange(1), default=None,
              help="MTP drafts over the first N ids and the added tokens (speculative-config draft_vocab_size; "
                   "NInfer's --lm-head-draft uses 131072); default: the whole lm_head")
@click.option("--draft-head", is_flag=True,
              help="with --draft-vocab-size: draft over a q4 draft head of that many rows (as `ninfer-quantize convert "
                   "--draft-vocab-size` writes), not views of the lm_head")
@click.option("--concurrency", default="1,8", show_default=True)
@click.option("--decode-prompt", default=8192, show_default=True, help="context before the decode measurement")
@click.option("--rounds", type=click.IntRange(1), default=16, show_default=True, help="timed decode calls per mode")
@click.option("--profile", is_flag=True, help="also the kernel time per op inside each mode's decode calls (CUPTI via "
              "torch.profiler): where a round's time goes")
@click.option("--json", "json_out", type=click.Path())
def spec_cmd(shape, fmt, method, k, draft_vocab_size, draft_head, concurrency, decode_prompt, rounds, profile,
             json_out) -> None:
    """Speculative decoding against plain decoding (synthetic weights: drafts rejected, then injected)."""
    import json

    from ninfer.runtime.cuda import gpu_available
    if not gpu_available():
        click.echo("ninfer-bench spec: needs a CUDA GPU (none found)", err=True)
        sys.exit(2)
    import torch

    from ninfer.cli.bench import measure_ceilings
    from ninfer.runtime.engine import Engine
    from ninfer.runtime.format_base import TILE_ROWS, align_up
    from ninfer.runtime.speculative import SpeculativeConfig
    from ninfer.runtime.synthetic import SHAPES, TOKEN_DOMAIN, random_weights
    if draft_head and not draft_vocab_size:
        raise click.UsageError("--draft-head needs --draft-vocab-size (the head's rows)")
    cfg, levels = SHAPES[shape], [int(x) for x in concurrency.split(",")]
    copy_gbs, _ = measure_ceilings(torch)
    weights = random_weights(cfg, "cuda", fmt=fmt, mtp=method == "mtp",
                             draft_rows=align_up(draft_vocab_size, TILE_ROWS) if draft_head else 0)
    ctx = decode_prompt + ((rounds + PROFILE_CALLS) * (k + 1) + 4) * (k + 1) + 16   # own drafts' calls, all kept
    eng = Engine.from_weights(cfg, weights, backend="cuda", domain=TOKEN_DOMAIN, max_context=ctx,
                              max_seqs=max(levels),
                              speculative=SpeculativeConfig(method, k, draft_vocab_size=draft_vocab_size))
    click.echo(f"# {shape} ({fmt} synthetic weights{', MTP layer included' if method == 'mtp' else ''}) on "
               f"{eng.be.device.name}; copy {copy_gbs:,.0f} GB/s; context {decode_prompt}; {method} drafts, K={k}"
               f"{f', draft vocabulary {draft_vocab_size}' if draft_vocab_size else ''}"
               f"{' (a q4 draft head)' if draft_head else ''}")
    from ninfer.cli.bench import _graph_profile
    prof = (lambda seqs, secs: _graph_profile(torch, eng, seqs, secs, steps=PROFILE_CALLS)) if profile else None
    rows = bench_spec(cfg, eng, levels, decode_prompt, rounds, k, fmt, copy_gbs, torch.cuda.synchronize, profile=prof)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"shape": shape, "device": eng.be.device.name, "weights": fmt, "method": method, "k": k,
                       "draft_vocab_size": draft_vocab_size, "draft_head": draft_head,
                       "copy_GBps": copy_gbs, "rows": rows}, f, indent=1)
