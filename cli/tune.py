"""`ninfer-tune`: measure every applicable route of every linear, MoE-expert, norm, router, GDN (conv, delta
rule, decode step) and attention problem of a model on this GPU and write the GPU's own route tables,
specs/tuned/<gpu>.yaml, which `make generate` validates (closed catalogue, like any table) and the runtime
prefers when it runs on that GPU.

For each (op, problem) and each T of a grid, every route instance that admits the whole span [T, next grid
T - 1] is timed (CUDA-graph replays over input copies that exceed the L2, as `ninfer-bench ops`); the fastest
owns the span. A route whose first launch takes SKIP_FACTOR x the fastest full timing so far at that T is
dropped there without its full timing (a decode attention route over a 4096-token prefill chunk). Decode-only
ops are timed on their own grid (OP_GRIDS: the decode batch sizes they serve). Nothing is written until every
measurement is done and the new file passed validation, so an interrupted run leaves the previous table as it was;
--max-seconds stops a run between problems instead and writes the problems it finished (the others keep their tables).
--missing-only tunes only the problems the GPU's file has no table for: the same command again finishes a cut run.
--keep-above re-tunes only the spans up to the grid's largest T (the decode batch sizes, say) and keeps the previous
table's spans above it; with a grid from above 1 (--grid 17,32,64) also those below its first T. For a problem this
GPU's file has no table for, the previous table is the generated default's (what runs on this GPU until then).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

GRID = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Ops the model runs only for decode steps (T sequences of one token; gdn_verify: a speculative verify step's T
# tokens, K + 1 a lane): timed at those T, whatever --grid says; the last point's winner owns the rest of T
# (models/blocks.py: flash decoding up to ATTN_SPLIT_MAX_T = 8). paged_attention_verify: a verify step's T tokens in
# lanes of bench_inputs.verify_run(T) (K = 3 where T holds whole lanes of 4).
OP_GRIDS = {"gdn_decode": (1, 2, 3, 4, 5, 8, 9, 16, 32, 64), "gdn_verify": (1, 2, 4, 8, 12, 16, 32, 36, 64),
            "paged_attention_split": (1, 2, 3, 4, 5, 8), "paged_attention_split_fp8": (1, 2, 3, 4, 5, 8),
            "merge_attn_states": (1, 2, 3, 4, 5, 8), "paged_attention_verify": (1, 2, 3, 4, 8, 12, 16, 32)}
SKIP_FACTOR = 4


def build_spans(grid: list[int], winners: list[str], window: bool = False) -> list[dict]:
    """The fastest instance at grid[i] owns T = grid[i] .. grid[i+1] - 1 (the last one to ∞); equal
    neighbours merge. grid starts at 1, so the spans cover every T once (window: it may start above 1, the spans
    then cover grid[0] on, for splice_spans to put between the previous table's)."""
    if (not grid or grid[0] < 1 or (grid[0] != 1 and not window) or sorted(set(grid)) != list(grid)
            or len(winners) != len(grid)):
        raise ValueError("the T grid must be strictly increasing from 1, with one winner per T")
    spans: list[dict] = []
    for i, (t, use) in enumerate(zip(grid, winners)):
        end = grid[i + 1] - 1 if i + 1 < len(grid) else None
        if spans and spans[-1]["use"] == use:
            spans[-1]["to"] = end
        else:
            spans.append({"from": t, "to": end, "use": use})
    return spans


def splice_spans(new: list[dict], old: list[dict], last: int, first: int = 1) -> list[dict]:
    """`old` below T = first, `new` from first to last (the grid's smallest and largest T; its last winner stops
    there), then `old` from last + 1 on; equal neighbours merge. `old` covers every T once and `new` every T from
    first on, so the result covers every T once."""
    spans: list[dict] = [dict(s, to=min(s["to"] or first - 1, first - 1)) for s in old if s["from"] < first]
    clipped = [dict(s, to=min(s["to"] or last, last)) for s in new if s["from"] <= last]
    clipped += [dict(s, **{"from": max(s["from"], last + 1)}) for s in old if s["to"] is None or s["to"] > last]
    for s in clipped:
        if spans and spans[-1]["use"] == s["use"]:
            spans[-1]["to"] = s["to"]
        else:
            spans.append(s)
    return spans


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def model_problems(shape: str, fmt: str) -> list[tuple[str, dict]]:
    """(op, problem) of every projection the model file runs through a linear op ({N, K}), of its routed
    experts ({H, E, I, K}) and of its norms and router, at a model shape with the quantizable matrices in `fmt`;
    the MTP layer's too (the real checkpoints carry one: speculative decoding runs it)."""
    from ninfer.runtime.synthetic import SHAPES, packed_formats, weight_shapes
    cfg = SHAPES[shape]
    packed = packed_formats(cfg, fmt, mtp=True)
    stored = {name: (s, packed.get(name, "bf16")) for name, s in weight_shapes(cfg, mtp=True).items()}
    return linear_problems(cfg, stored) + expert_problems(cfg, stored) + layer_problems(cfg) + mixer_problems(cfg)


def artifact_problems(path) -> list[tuple[str, dict]]:
    """(op, problem) of an artifact's linear projections and routed experts, each in the format it is stored in,
    and of its norms and router; the MTP layer's and its draft head's too (speculative decoding), not the vision
    tower's."""
    from ninfer.runtime.artifact import open_artifact
    from ninfer.runtime.models.config import parse_config
    art = open_artifact(path)
    try:
        cfg = parse_config(art.resource("config.json"))
        stored = {name: (tuple(e.shape), e.format) for name, e in art.tensors.items()
                  if "visual" not in e.flags}
    finally:
        art.close()
    return linear_problems(cfg, stored) + expert_problems(cfg, stored) + layer_problems(cfg) + mixer_problems(cfg)


def linear_problems(cfg, stored: dict) -> list[tuple[str, dict]]:
    """stored: tensor name -> (shape, format). A packed matrix runs linear_<format> (decode) and, from
    DEQUANT_MIN_T tokens on, the bf16 `linear` over its decoded copy (prefill); a float one runs `linear`.
    A tied lm_head is the embedding table; GDN b|a is one bf16 projection, and GDN qkv|z one where their
    storage joins (models/blocks.py: decode runs the joined matrix, prefill its two row views, so both count).
    With FP8 prefill on the FP8 tensor cores (NINFER_FP8_W8A8_MIN_T), an fp8 matrix whose shape the E4M3 GEMM
    admits runs linear_fp8_w8a8 too, after quant_fp8_per_token of its input ({K})."""
    from ninfer.runtime.models import blocks
    from ninfer.runtime.models.blocks import DEQUANT_MAX_BYTES
    from ninfer.runtime.paths import ROOT
    from ninfer.runtime.reference_quant import PACKED
    from ninfer.runtime.weights import can_cat_rows
    out, quant, stored = set(), set(), dict(stored)
    if "lm_head" not in stored and cfg.tied_embeddings:
        stored["lm_head"] = stored["embed"]
    for qkv in [n for n in stored if n.endswith("gdn.in_qkv")]:   # GatedDeltaNet.fuse_weights
        z = qkv[:-len("qkv")] + "z"
        (sa, fa), (sb, fb) = stored[qkv], stored.get(z, ((), None))
        if fb is not None and can_cat_rows(fa, sa, fb, sb):
            stored[qkv + "z"] = ((sa[0] + sb[0], sa[1]), fa)
    for name, (s, fmt) in stored.items():
        if len(s) != 2 or name == "embed" or name.endswith(("router", "conv", "in_b", "in_a")):
            continue     # not run through a linear op (embedding, moe_router, gdn_conv) or fused (b|a)
        if fmt in PACKED:
            out.add((f"linear_{fmt}", s[0], s[1]))
        if fmt not in PACKED or 2 * s[0] * s[1] <= DEQUANT_MAX_BYTES:
            out.add(("linear", s[0], s[1]))
        if fmt == "fp8" and blocks.FP8_W8A8_MIN_T is not None and s[0] % 128 == 0 and s[1] % 16 == 0:
            out.add(("linear_fp8_w8a8", s[0], s[1]))
            quant.add(s[1])
    if not all(cfg.is_attention(i) for i in range(cfg.layers)):
        out.add(("linear", 2 * cfg.v_heads, cfg.hidden))
    # a packed [gate | up] matrix of a dense MLP (or a MoE's shared expert) also runs linear_swiglu_<fmt>, where
    # that op exists (specs/ops): SwiGLU in the GEMM's epilogue (DenseMLP)
    swiglu = sorted({(f"linear_swiglu_{fmt}", s[0] // 2, s[1]) for name, (s, fmt) in stored.items()
                     if name.endswith("gate_up") and len(s) == 2 and fmt in PACKED
                     and (ROOT / "specs" / "ops" / f"linear_swiglu_{fmt}.yaml").is_file()})
    return ([(op, {"N": n, "K": k}) for op, n, k in sorted(out)] + [(op, {"I": i, "K": k}) for op, i, k in swiglu]
            + [("quant_fp8_per_token", {"K": k}) for k in sorted(quant)])


def expert_problems(cfg, stored: dict) -> list[tuple[str, dict]]:
    """(op, {H, E, I, K}) of the routed experts. Packed experts run the single op moe_experts_<fmt>, the decode
    form (moe_gate_up_<fmt>, moe_down_<fmt>) and the prefill form (moe_*_grouped_<fmt>); the model picks among
    them by T (models/blocks.py). Float experts run moe_experts."""
    from ninfer.runtime.reference_quant import MOE_PAIRS, PACKED, moe_op
    problem = {"H": cfg.hidden, "E": cfg.experts, "I": cfg.expert_intermediate, "K": cfg.experts_per_token}
    out = set()
    for name, (_, gfmt) in stored.items():
        if not name.endswith("experts.gate_up"):
            continue
        _, dfmt = stored[name[:-len("gate_up")] + "down"]
        if gfmt in PACKED and dfmt in PACKED:
            out |= {f"moe_gate_up_{gfmt}", f"moe_down_{dfmt}", f"moe_gate_up_grouped_{gfmt}", f"moe_down_grouped_{dfmt}"}
            if (gfmt, dfmt) in MOE_PAIRS:
                out.add(moe_op(gfmt, dfmt))
        else:
            out.add("moe_experts")
    return [(op, dict(problem)) for op in sorted(out)]


def layer_problems(cfg) -> list[tuple[str, dict]]:
    """The other per-layer ops with several routes and plain-tensor inputs: the residual norms ({H}) and, in a
    MoE model, the router ({E, H}) and the add-norm with the shared expert's gate add ({H}, MOE_GATE_ADD_NORM)."""
    from ninfer.runtime.models import blocks
    out = [("add_rms_norm_zc", {"H": cfg.hidden}), ("rms_norm_zc", {"H": cfg.hidden})]
    if cfg.experts:
        out.append(("moe_router", {"E": cfg.experts, "H": cfg.hidden}))
        if blocks.MOE_GATE_ADD_NORM:
            out.append(("sigmoid_gate_add_rms_norm_zc", {"H": cfg.hidden}))
    return out


def mixer_problems(cfg, page_size: int = 16) -> list[tuple[str, dict]]:
    """The token mixers' ops with several routes: GDN's prefill conv ({C, KW}), delta rule ({HV, DK, DV}: one
    sequence of T tokens) and gated norm ({HV, DV}), its fused decode step and speculative verify step ({H, HK, R, DK,
    DV}; the verify's T tokens in runs of a lane's K + 1); the attention's
    q/k norm and RoPE ({NH, NKV, D}) and its paged attention of prefill and decode with the flash-decoding pair
    ({NH, NKV, D, BS} at the engine's page size; merge_attn_states {NH, D}), over either KV cache (the _fp8 ops:
    --kv-cache-dtype fp8)."""
    out = []
    if not all(cfg.is_attention(i) for i in range(cfg.layers)):
        out += [("gdn_conv", {"C": cfg.conv_channels, "KW": cfg.conv_width}),
                ("gdn_delta_rule", {"HV": cfg.v_heads, "DK": cfg.k_dim, "DV": cfg.v_dim}),
                *((op, {"H": cfg.hidden, "HK": cfg.k_heads, "R": cfg.v_heads // cfg.k_heads, "DK": cfg.k_dim,
                        "DV": cfg.v_dim}) for op in ("gdn_decode", "gdn_verify")),
                ("gdn_gated_norm", {"HV": cfg.v_heads, "DV": cfg.v_dim})]
    if any(cfg.is_attention(i) for i in range(cfg.layers)):
        attn = {"NH": cfg.heads, "NKV": cfg.kv_heads, "D": cfg.head_dim, "BS": page_size}
        out += [("attn_qk_prep", {"NH": cfg.heads, "NKV": cfg.kv_heads, "D": cfg.head_dim}),
                ("paged_attention", attn), ("paged_attention_split", dict(attn)),
                ("merge_attn_states", {"NH": cfg.heads, "D": cfg.head_dim}), ("paged_attention_verify", dict(attn)),
                ("paged_attention_fp8", dict(attn)), ("paged_attention_split_fp8", dict(attn))]
    return out


def step_dims(op: str, T: int, problem: dict, problems: list) -> dict:
    """Dims an op's inputs need beyond T and its problem: the flash-decoding split count KS the model uses at T
    (blocks.attn_splits over the attention's kv heads; merge_attn_states's from the paged_attention problem of
    the same heads); paged_attention_verify's tokens a lane L (also its param) and its KS (blocks.verify_splits)."""
    from ninfer.cli.bench_inputs import verify_run
    from ninfer.runtime.models.blocks import attn_splits, verify_splits
    if op in ("paged_attention_split", "paged_attention_split_fp8"):
        return {"KS": attn_splits(T, problem["NKV"])}
    if op == "paged_attention_verify":
        L = verify_run(T)
        return {"L": L, "KS": verify_splits(T, L, problem["NH"], problem["NKV"])}
    if op == "merge_attn_states":
        nkv = next(p["NKV"] for o, p in problems if o == "paged_attention" and p["NH"] == problem["NH"])
        return {"KS": attn_splits(T, nkv)}
    return {}


def step_params(contract: dict, op: str, dims: dict) -> dict:
    """An op's params at a problem and T: the dims no tensor shape carries (bench_inputs.by_name), the bench's
    fixed ones (OP_PARAMS: scales, eps) and those step_dims chose (paged_attention_verify's L)."""
    from ninfer.cli.bench import OP_PARAMS
    from ninfer.cli.bench_inputs import by_name
    return {**by_name(contract, dims), **OP_PARAMS.get(op, {}), **{k: v for k, v in dims.items() if k in contract["params"]}}


def label(problem: dict) -> str:
    """A problem as --problem spells it: its dims joined by x (N x K; H x E x I x K for the experts)."""
    return "x".join(str(v) for v in problem.values())


def admits(kernel, dims: dict) -> bool:
    from ninfer.runtime.manifest import evaluate
    return all(evaluate(c, dims) for c in kernel.constraints)


def candidates(instances: list[str], chosen: str, routes: tuple[str, ...]) -> list[str]:
    """The instances timed at a T, the table's own choice first (the skip rule's yardstick); with --route patterns
    only those matching one, besides the table's choice (the baseline a new route has to beat)."""
    import fnmatch
    keep = [i for i in instances if i == chosen or not routes or any(fnmatch.fnmatch(i, r) for r in routes)]
    return sorted(keep, key=lambda i: (i != chosen, i))


def measure(be, op: str, problem: dict, grid, reps: int, echo, verbose: bool = False, extra=lambda t: {},
            bounded: bool = False, routes: tuple[str, ...] = ()) -> list[str]:
    """The fastest instance at each grid T among those admitting the whole span it would own (verbose: echo
    every instance's time); extra(T): the dims the inputs need beyond T and the problem (step_dims). bounded
    (--keep-above): the last grid T's span ends there, not at infinity. routes: candidates() patterns."""
    import torch

    from ninfer.cli.bench import _time, _time_graph
    from ninfer.cli.bench_inputs import footprint, make_inputs, timing_sets
    from ninfer.runtime.contracts import bind
    contract = be.contract(op)
    kernels = {k.instance: k for k in be.manifest.kernels.values()
               if k.op == op and k.arch == be.device.arch and k.dtype == "bf16"}
    rng = torch.Generator(device="cuda")
    rng.manual_seed(0)
    winners = []
    for i, t in enumerate(grid):
        last = grid[i + 1] - 1 if i + 1 < len(grid) else t if bounded else 1 << 30
        dims = {"T": t, **problem, **extra(t)}
        params = step_params(contract, op, dims)
        base = make_inputs(torch, contract, "bf16", dict(dims), rng, op)
        sets = timing_sets(torch, op, base, dims, rng, factor=2, most=4)
        dims, _ = bind(op, contract, "bf16", base, params)   # every dim a constraint may name (gdn_decode's KW, ...)
        nbytes = footprint(base)
        best = None
        chosen = be.select(op, "bf16", dims).instance   # timed first: the skip rule then has a good yardstick
        fits = [i for i in kernels if admits(kernels[i], dims) and admits(kernels[i], {**dims, "T": last})]
        # (--route leaving no instance that admits the span, e.g. the table's own stops inside it: all of them)
        for k in (kernels[i] for i in candidates(fits, chosen, routes) or candidates(fits, chosen, ())):
            plans = [be.plan(op, route=k.instance, **s, **params) for s in sets]
            if best is not None and _time(torch, plans[0], 1, warmup=1) > SKIP_FACTOR * best[0]:
                if verbose:
                    echo(f"    {k.instance} skipped (one launch > {SKIP_FACTOR} x the fastest)")
                continue
            launches = max(len(sets), min(20, int(2e-3 / max(nbytes / 3e12, 1e-7))))
            secs = _time_graph(torch, plans, reps, launches)
            if verbose:
                echo(f"    {k.instance} {secs * 1e6:.1f} us")
            if best is None or secs < best[0]:
                best = (secs, k.instance)
        if best is None:
            raise click.ClickException(f"{op} {problem}: no route admits T={t}..{last}")
        shown = " ".join(f"{k}={v}" for k, v in problem.items())
        echo(f"  {op} {shown} T={t}: {best[1]} {best[0] * 1e6:.1f} us")
        winners.append(best[1])
        del sets, base
        torch.cuda.empty_cache()
    return winners


def render(gpu: str, arch: str, note: str, tables: list[dict]) -> str:
    lines = [f"# Route tables measured by ninfer-tune on {gpu} ({arch}). Regenerate with ninfer-tune; hand",
             "# edits are validated like any table (closed catalogue) by `make generate`.",
             # the notes are free text (": " in a cut run's note): quoted, as JSON strings are valid YAML
             f"gpu: {json.dumps(gpu)}", f"arch: {arch}", f"measured: {json.dumps(note)}", "tables:"]
    for t in tables:
        problem = ", ".join(f"{k}: {v}" for k, v in t["problem"].items())
        lines += [f"  - op: {t['op']}", "    dtypes: [bf16]", f"    problem: {{{problem}}}", "    spans:"]
        for s in t["spans"]:
            to = "null" if s["to"] is None else s["to"]
            lines.append(f"      - {{from: {s['from']}, to: {to}, use: {s['use']}}}")
    return "\n".join(lines) + "\n"


def write_validated(specs_dir: Path, templates: Path, name: str, text: str) -> Path:
    """Validate the new tuned file against a copy of the spec tree, then move it into place atomically."""
    from ninfer.codegen.specs import load_specs
    specs_dir = Path(specs_dir)
    with tempfile.TemporaryDirectory() as tmp:
        trial = Path(tmp) / "specs"
        shutil.copytree(specs_dir, trial)
        (trial / "tuned").mkdir(exist_ok=True)
        (trial / "tuned" / name).write_text(text, encoding="utf-8")
        load_specs(trial, templates)            # raises SpecError naming the file and key on any mistake
    dest = specs_dir / "tuned" / name
    dest.parent.mkdir(exist_ok=True)
    fd, part = tempfile.mkstemp(prefix=f".{name}.", dir=dest.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, dest)
    return dest


@click.command()
@click.option("--artifact", type=click.Path(exists=True, dir_okay=False), default=None,
              help="tune the problems of this artifact, each in its stored format (instead of --shape/--weights)")
@click.option("--shape", type=click.Choice(["qwen3.6-27b", "qwen3.6-35b-a3b"]), default="qwen3.6-27b", show_default=True,
              help="the model whose problems are tuned")
@click.option("--weights", "fmt", type=click.Choice(["bf16", "q4", "q5", "q6", "w8", "fp8", "recipe"]), default="bf16",
              show_default=True, help="format of the quantizable matrices (recipe: each role's default, as a converted checkpoint)")
@click.option("--op", "ops", multiple=True, help="only these ops (repeatable), e.g. linear_q4")
@click.option("--problem", "only", multiple=True, metavar="NxK",
              help="only these problems (repeatable), e.g. 16384x5120 (linear N x K), 2048x256x512x8 (experts H x E x I x K), "
                   "5120 (norms H)")
@click.option("--grid", default=",".join(map(str, GRID)), show_default=True, help="T values to time")
@click.option("--reps", default=10, show_default=True)
@click.option("-v", "--verbose", is_flag=True, help="print every route instance's time, not only the fastest")
@click.option("--keep-above", is_flag=True,
              help="replace only the spans up to the grid's largest T, keeping the previous table's spans above it "
                   "(e.g. re-tune the decode spans with --grid 1,2,3,4,5,8), and below its smallest where it starts "
                   "above 1 (--grid 17,32,64: the verify steps of several lanes)")
@click.option("--route", "routes", multiple=True, metavar="PATTERN",
              help="time only route instances matching this pattern (repeatable, e.g. 'wgmma_rs*'), besides the one the "
                   "current table picks at each T: a quick re-tune over new routes")
@click.option("--max-seconds", type=click.FloatRange(min=0), default=None,
              help="start no problem after this many seconds; write the problems finished (a run under a time limit)")
@click.option("--missing-only", is_flag=True,
              help="tune only the problems this GPU's tuned file has no table for (run a cut command again to finish it)")
@click.option("--specs", "specs_dir", type=click.Path(file_okay=False), default=None,
              help="spec tree to write tuned/<gpu>.yaml into (default: the repository's specs/)")
def main(artifact, shape, fmt, ops, only, grid, reps, verbose, keep_above, routes, max_seconds, missing_only,
         specs_dir) -> None:
    """Time every route of every linear, expert, norm, router, GDN and attention problem of a model on this GPU;
    write specs/tuned/<gpu>.yaml."""
    from ninfer.runtime.cuda import gpu_available
    from ninfer.runtime.paths import ROOT
    if keep_above and missing_only:
        raise click.UsageError("--keep-above re-tunes problems that have a table, --missing-only those without: pick one")
    if not gpu_available():
        click.echo("ninfer-tune: needs a CUDA GPU (none found); nothing was written", err=True)
        sys.exit(2)
    try:
        ts = [int(x) for x in grid.split(",")]
        build_spans(ts, ["x"] * len(ts), window=keep_above)
    except ValueError:
        raise click.BadParameter("expected comma-separated T values increasing from 1 (from any T with --keep-above)",
                                 param_hint="--grid") from None
    from ninfer.runtime.dispatch import CudaBackend
    be = CudaBackend()
    if artifact:
        source = Path(artifact).name
        problems = artifact_problems(artifact)
    else:
        source, problems = f"{shape} {fmt}", model_problems(shape, fmt)
    if ops:   # a run of some ops replaces only the note of a run of the same ops
        source += f" ({', '.join(ops)})"
    if routes:
        source += f" (routes {', '.join(routes)} and each table's own)"
    everything = problems
    if absent := sorted({op for op, _ in problems if not be.has_op(op)}):   # e.g. the _fp8 ops before sm_89
        click.echo(f"# not on this GPU ({be.device.arch}), not tuned: {', '.join(absent)}", err=True)
    problems = [(op, p) for op, p in problems if be.has_op(op) and (not ops or op in ops) and (not only or label(p) in only)]
    if not problems:
        raise click.BadParameter(f"no problem of {source} matches --op {', '.join(ops) or '(any)'} "
                                 f"--problem {', '.join(only) or '(any)'}", param_hint="--op/--problem")
    gpu, arch = be.device.name, be.device.arch
    root = Path(specs_dir) if specs_dir else ROOT / "specs"
    name = f"{gpu_slug(gpu)}.yaml"
    existing = root / "tuned" / name
    if missing_only:
        problems = missing(existing, problems)
        if not problems:
            click.echo(f"ninfer-tune: {existing} has a table for every problem of {source}; nothing to tune", err=True)
            return
    click.echo(f"# ninfer-tune on {gpu} ({arch}): {len(problems)} problems x {len(ts)} T values", err=True)
    def default_spans(op, problem):   # what runs for a problem the GPU's file has no table for: the generated table
        return [{"from": lo, "to": hi, "use": use} for lo, hi, use in be.manifest.table(arch, op, "bf16", problem)]
    def tune_one(op, problem):
        grid_t = list(OP_GRIDS.get(op, ts))
        winners = measure(be, op, problem, grid_t, reps, lambda m: click.echo(m, err=True), verbose,
                          extra=lambda t: step_dims(op, t, problem, everything), bounded=keep_above, routes=routes)
        spans = build_spans(grid_t, winners, window=keep_above)
        if keep_above:
            spans = _keep_above(existing, op, problem, spans, grid_t[0], grid_t[-1], default_spans)
        return {"op": op, "problem": problem, "spans": spans}

    tables = tune_within(problems, tune_one, max_seconds, lambda m: click.echo(m, err=True))
    if not tables:
        click.echo("ninfer-tune: --max-seconds ran out before the first problem was tuned; nothing was written", err=True)
        sys.exit(1)
    cut = len(tables) < len(problems)
    note = run_note(datetime.date.today().isoformat(), source, ts, keep_above, cut=cut, missing_only=missing_only)
    if existing.is_file():    # keep the previous tables of problems this run did not measure, and their runs' notes
        tables, note = _merge(existing, tables, note, source, replaces=not (keep_above or cut or missing_only))
    dest = write_validated(root, ROOT / "codegen" / "templates", name, render(gpu, arch, note, tables))
    click.echo(f"wrote {dest}: {len(tables)} tables; run `make generate` to use them")


def tune_within(problems: list, tune_one, max_seconds: float | None, echo, clock=time.monotonic) -> list[dict]:
    """tune_one(op, problem) of each problem in order, starting none after max_seconds (None: no limit)."""
    tables, start = [], clock()
    for op, problem in problems:
        if max_seconds is not None and clock() - start > max_seconds:
            echo(f"# --max-seconds {max_seconds:g}: stopped before {op} {label(problem)}, "
                 f"{len(tables)} of {len(problems)} problems tuned")
            break
        tables.append(tune_one(op, problem))
    return tables


def missing(existing: Path, problems: list) -> list:
    """--missing-only: the problems the existing tuned file (if any) has no table for, in order."""
    have = {_key(t["op"], t.get("problem")) for t in _read(existing).get("tables", [])}
    return [(op, p) for op, p in problems if _key(op, p) not in have]


def run_note(day: str, source: str, ts: list[int], keep_above: bool, cut: bool = False, missing_only: bool = False) -> str:
    """This run's entry in the file's `measured` notes; no "; " inside it (the separator of the runs' notes). A run cut
    by --max-seconds, or one of the missing problems only, says so: the earlier notes of its source stay, as the
    tables of the problems it did not time."""
    note = f"{day}, {source}, grid {','.join(map(str, ts))}"
    if missing_only:
        note += " (the problems without a table)"
    if keep_above:
        note += (f" (spans up to T = {ts[-1]}, the earlier runs' above)" if ts[0] == 1 else
                 f" (spans T = {ts[0]}..{ts[-1]}, the earlier runs' below and above)")
    return note + (" (cut by --max-seconds: the problems it reached)" if cut else "")


def _read(existing: Path) -> dict:
    """The existing tuned file, parsed ({} where there is none yet)."""
    import yaml
    return (yaml.safe_load(existing.read_text(encoding="utf-8")) if existing.is_file() else None) or {}


def _key(op: str, problem: dict | None) -> tuple:
    """A table's identity in the tuned file: its op and problem."""
    return op, tuple(sorted((problem or {}).items()))


def _previous_spans(existing: Path, op: str, problem: dict, default=None) -> list[dict]:
    """The existing file's spans of this problem, else default(op, problem); with no default such a problem cannot
    be spliced (--keep-above): refused, nothing is written."""
    key = _key(op, problem)
    prev = next((t for t in _read(existing).get("tables", []) if _key(t["op"], t.get("problem")) == key), None)
    if prev is not None:
        return prev["spans"]
    if default is None:
        raise click.UsageError(f"--keep-above: {existing} has no table of {op} {label(problem)} to keep spans from; "
                               f"tune it over a whole grid first (nothing was written)")
    return default(op, problem)


def _keep_above(existing: Path, op: str, problem: dict, spans: list[dict], first: int, last: int,
                default=None) -> list[dict]:
    """--keep-above: the previous spans of the same problem (the existing file's, else default(op, problem)) below
    `first` (a grid from above 1) and above `last`, the new ones between."""
    return splice_spans(spans, _previous_spans(existing, op, problem, default), last, first)


def _merge(existing: Path, tables: list[dict], note: str, source: str, replaces: bool = True) -> tuple[list[dict], str]:
    """The existing file's tables, each re-tuned one replaced in its place, then this run's new problems; its
    `measured` notes (runs joined by "; ") less those of the same source when this run replaces them (a whole
    grid; a --keep-above, cut or --missing-only run keeps them: the tables it did not time stay), then this run's."""
    old = _read(existing)
    new = {_key(t["op"], t["problem"]): t for t in tables}
    merged = [new.pop(_key(t["op"], t.get("problem")), t) for t in old.get("tables", [])]
    notes = [n for n in str(old.get("measured") or "").split("; ") if n and not (replaces and f", {source}, " in n)]
    return merged + list(new.values()), "; ".join(notes + [note])


if __name__ == "__main__":
    main()
