"""ninfer-quantize: convert Hugging Face Qwen hybrid checkpoints to .ninfer artifacts, inspect and
verify them, and benchmark the converter at real model shapes.

  ninfer-quantize convert HF_DIR -o OUT.ninfer [--recipe NAME] [--format F] [--override ROLE=F ...]
                                              [--skip mtp|visual] [--dry-run]
                                              [--draft-vocab-size N [--draft-vocab-corpus TEXT ...]]
  ninfer-quantize inspect FILE
  ninfer-quantize verify FILE [--recipe NAME]
  ninfer-quantize bench-convert --shape qwen3.6-27b --layers 2 --format q4
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import click

from ninfer.runtime.artifact import ArtifactError, open_artifact
from ninfer.runtime.convert import RECIPE_RESOURCE, ConvertError, convert, plan_conversion
from ninfer.runtime.draft_head import DRAFT_HEAD, add_draft_head, check_draft_head
from ninfer.runtime.format_base import FormatError
from ninfer.runtime.formats import WEIGHT_FORMATS, get_format
from ninfer.runtime.hf_checkpoint import CheckpointError
from ninfer.runtime.recipe_expr import ExprError
from ninfer.runtime.recipes import PlanError, Recipe, RecipeError, load_recipe

# Every failure the user can cause ends as "Error: <message>" and exit status 1.
USER_ERRORS = (ConvertError, CheckpointError, RecipeError, PlanError, FormatError, ArtifactError,
               ExprError, OSError)
MiB = 1 << 20


def _fail(e: Exception):
    raise click.ClickException(str(e)) from None


def _keep_freed_memory() -> None:
    """glibc hands big freed blocks straight back to the OS, so every chunk's numpy temporaries would
    be fresh pages and page faults would cost more than the encoding (measured: sys time 1.9 s vs
    0.3 s on a 1.3 GiB conversion). Keep freed blocks in the heap instead; the resident set stays at
    about one chunk's working set. No-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)     # M_MMAP_THRESHOLD: serve blocks < 1 GiB from the heap
        libc.mallopt(-1, 1 << 30)     # M_TRIM_THRESHOLD: do not return freed heap to the OS eagerly
    except (OSError, AttributeError):
        pass


def _parse_overrides(values) -> list[tuple[str, str]]:
    out = []
    for v in values:
        role, sep, fmt = v.partition("=")
        if not sep or not role or not fmt:
            raise click.BadParameter(f"{v!r}: expected ROLE=FORMAT (ROLE may be a glob such as 'mtp_*')",
                                     param_hint="--override")
        out.append((role.strip(), fmt.strip()))
    return out


@click.group()
def main():
    """Convert, inspect and verify .ninfer artifacts."""


@main.command("convert")
@click.argument("hf_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output .ninfer file.")
@click.option("--recipe", help="Recipe name (recipes/NAME.yaml) or path; default: from config.json model_type.")
@click.option("--format", "fmt", type=click.Choice(WEIGHT_FORMATS),
              help="Format for every quantizable role (default: the recipe's per-role choice).")
@click.option("--override", "overrides", multiple=True, metavar="ROLE=FORMAT",
              help="Per-role format, applied after --format; ROLE may be a glob. Repeatable.")
@click.option("--skip", multiple=True, type=click.Choice(["mtp", "visual"]),
              help="Leave out an optional section even if the checkpoint has it.")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
@click.option("--chunk-mb", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Float32 working set per chunk.")
@click.option("--draft-vocab-size", type=click.IntRange(1), default=None, metavar="N",
              help="Also write a draft head for the MTP drafts (NInfer's --lm-head-draft): the lm_head rows of the N "
                   "most used ids (rounded up to 128), served with speculative-config draft_vocab_size.")
@click.option("--draft-vocab-corpus", "corpus", multiple=True, type=click.Path(path_type=Path), metavar="FILE",
              help="UTF-8 text whose token counts rank the ids for the draft head (repeatable; default: id order).")
@click.option("--draft-vocab-format", type=click.Choice(WEIGHT_FORMATS), default="q4", show_default=True,
              help="Format of the draft head's rows.")
def convert_cmd(hf_dir, output, recipe, fmt, overrides, skip, dry_run, progress, chunk_mb, draft_vocab_size, corpus,
                draft_vocab_format):
    """Convert the checkpoint in HF_DIR into one .ninfer file (streamed, written atomically)."""
    if output is None and not dry_run:
        raise click.UsageError("missing -o/--output (or use --dry-run)")
    if corpus and draft_vocab_size is None:
        raise click.UsageError("--draft-vocab-corpus ranks the ids of a draft head: give --draft-vocab-size too")
    try:
        plan = plan_conversion(hf_dir, recipe, fmt, _parse_overrides(overrides), skip)
    except USER_ERRORS as e:
        _fail(e)
    try:
        if draft_vocab_size is not None:
            try:
                plan.notes.append(add_draft_head(plan, draft_vocab_size, list(corpus), draft_vocab_format))
            except USER_ERRORS as e:
                _fail(e)
        for note in plan.notes:
            click.echo(f"note: {note}", err=True)
        if dry_run:
            _print_plan(plan)
            return
        _keep_freed_memory()
        _run_conversion(plan, output, progress, chunk_mb)
    finally:
        plan.checkpoint.close()


def _print_plan(plan):
    click.echo(f"recipe {plan.recipe.name} ({plan.recipe.path}); family {plan.recipe.model_family}")
    click.echo(f"{'tensor':<44} {'shape':<18} {'role':<18} {'format':<8} {'bytes':>12}  sources")
    for t in plan.tensors:
        src = t.sources
        more = f" (+{len(src) - 1})" if len(src) > 1 else ""
        click.echo(f"{t.name:<44} {str(list(t.shape)):<18} {t.role:<18} {t.format:<8} "
                   f"{get_format(t.format).nbytes(t.shape):>12}  {src[0]}{more}")
    click.echo(f"{len(plan.tensors)} tensors, {plan.output_bytes() / MiB:.1f} MiB encoded from "
               f"{plan.source_bytes / MiB:.1f} MiB of source; resources: "
               + ", ".join(n for n, _ in plan.resources))


def _run_conversion(plan, output, progress, chunk_mb):
    """Convert with a progress bar over encoded bytes; its label shows [tensor i/N] and the name."""
    n = len(plan.tensors)
    per_elem = [get_format(t.format).nbytes(t.shape) / _numel(t.shape) for t in plan.tensors]
    state = {"i": 0, "name": ""}
    bar_cm = contextlib.nullcontext()
    if progress:
        bar_cm = click.progressbar(length=plan.output_bytes(), label=f"converting {n} tensors",
                                   file=sys.stderr, show_pos=True,
                                   item_show_func=lambda _: f"[{state['i'] + 1}/{n}] {state['name']}"
                                   if state["name"] else None)
    try:
        with bar_cm as bar:
            def on_progress(i, name, elements):
                state["i"], state["name"] = i, name
                if bar is not None:
                    bar.update(int(elements * per_elem[i]), current_item=name)
            stats = convert(plan, output, chunk_mb * MiB // 4, on_progress)
    except USER_ERRORS as e:
        _fail(e)
    secs = stats["seconds"]
    click.echo(f"wrote {output}: {stats['tensors']} tensors + {len(plan.resources)} resources, "
               f"{stats['output_bytes'] / MiB:.1f} MiB from {stats['source_bytes'] / MiB:.1f} MiB of source "
               f"in {secs:.2f} s ({stats['source_bytes'] / MiB / max(secs, 1e-9):.1f} MiB/s)")


@main.command("inspect")
@click.argument("file", type=click.Path(path_type=Path))
def inspect_cmd(file):
    """Summarise FILE: tensors by role and format, sizes, bits per weight, resources."""
    try:
        a = open_artifact(file)
    except USER_ERRORS as e:
        _fail(e)
    with a:
        rows = defaultdict(lambda: [0, 0, 0])
        flags = defaultdict(int)
        for t in a.tensors.values():
            r = rows[(t.role, t.format)]
            r[0] += 1
            r[1] += _numel(t.shape)
            r[2] += t.bytes
            for f in t.flags:
                flags[f] += 1
        click.echo(f"{file}: family {a.model_family}, format_version {a.format_version}, "
                   f"{len(a.tensors)} tensors, {len(a.resources)} resources, {a.file_size / MiB:.2f} MiB")
        click.echo(f"{'role':<22} {'format':<9} {'tensors':>7} {'params':>14} {'MiB':>10} {'bits/w':>7}")
        tot = [0, 0, 0]
        for (role, fmt), (count, params, nbytes) in sorted(rows.items()):
            click.echo(f"{role:<22} {fmt:<9} {count:>7} {params:>14,} {nbytes / MiB:>10.2f} "
                       f"{8 * nbytes / params:>7.3f}")
            tot = [tot[0] + count, tot[1] + params, tot[2] + nbytes]
        click.echo(f"{'total':<22} {'':<9} {tot[0]:>7} {tot[1]:>14,} {tot[2] / MiB:>10.2f} "
                   f"{8 * tot[2] / max(tot[1], 1):>7.3f}")
        if flags:
            click.echo("flags: " + ", ".join(f"{f} ({n} tensors)" for f, n in sorted(flags.items())))
        click.echo("resources:")
        for r in a.resources.values():
            click.echo(f"  {r.name:<26} {r.bytes:>10} B")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@main.command("verify")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--recipe", help="Check shapes against this recipe instead of the embedded recipe.yaml.")
def verify_cmd(file, recipe):
    """Check FILE: closed schema, every digest, and the tensor inventory against the recipe."""
    try:
        with open_artifact(file) as a:
            t0 = time.perf_counter()
            a.verify()
            secs = time.perf_counter() - t0
            rec = load_recipe(recipe) if recipe else Recipe(a.resource(RECIPE_RESOURCE).decode("utf-8"),
                                                           f"{file}:{RECIPE_RESOURCE}")
            config = json.loads(a.resource("config.json"))
            problems = (rec.check_inventory(config, {n: t for n, t in a.tensors.items() if n != DRAFT_HEAD})
                        + check_draft_head(a))
            n_obj = len(a.tensors) + len(a.resources)
    except KeyError as e:
        _fail(ArtifactError(f"{file}: cannot check against the recipe: {e.args[0]}"))
    except USER_ERRORS + (ValueError,) as e:
        _fail(e)
    if problems:
        _fail(PlanError(f"{file}: does not match recipe {rec.name}:\n  " + "\n  ".join(problems)))
    click.echo(f"OK {file}: schema valid, {n_obj} object digests + payload digest match "
               f"({secs:.2f} s), {len(a.tensors)} tensors match recipe {rec.name}")


@main.command("bench-convert")
@click.option("--shape", type=click.Choice(["qwen3.6-27b", "qwen3.6-35b-a3b"]), default="qwen3.6-27b",
              show_default=True)
@click.option("--layers", type=click.IntRange(1), default=2, show_default=True,
              help="Decoder layers to synthesise (the real models have 64 / 40).")
@click.option("--vocab", type=click.IntRange(1), default=None, help="Override the vocabulary (default: real).")
@click.option("--format", "fmt", type=click.Choice(WEIGHT_FORMATS), default="q4", show_default=True)
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="Where to put the synthetic checkpoint and artifact (default: a temp dir, removed).")
@click.option("--keep", is_flag=True, help="Keep the files.")
def bench_convert_cmd(shape, layers, vocab, fmt, workdir, keep):
    """Write a synthetic BF16 checkpoint at real Qwen shapes and time its conversion (peak RSS, MB/s)."""
    from ninfer.cli.quantize_bench import run_bench
    try:
        run_bench(shape, layers, vocab, fmt, workdir, keep)
    except USER_ERRORS as e:
        _fail(e)


if __name__ == "__main__":
    main()
