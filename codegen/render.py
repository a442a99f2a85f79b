"""Render every (op, route, arch, dtype, tile) into a translation unit, plus generated/manifest.json.

Deterministic (sorted iteration, no timestamps) and atomic: the new tree is written beside the old
one and swapped in only when everything rendered.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path

import jinja2

from .specs import DTYPES, SpecError, SpecSet

MANIFEST_VERSION = 1
_MARK = re.compile(r" //@@([^@]+)@(\d+)@@$")


class RenderError(Exception):
    pass


def symbol_for(op: str, route: str, tile: str, dtype: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", f"ninfer_{op}__{route}__{tile}__{dtype}")


def _environment(templates: Path) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def _annotated_environment(templates: Path) -> jinja2.Environment:
    """Like _environment, but each plain template line ends with a `//@@<template>@<n>@@` marker: rendering
    through it tells which template line produced each output line (the map used to report compile errors)."""

    class Marking(jinja2.FileSystemLoader):
        def get_source(self, environment, name):
            src, filename, uptodate = super().get_source(environment, name)
            return _mark_lines(src, name), filename, uptodate

    return jinja2.Environment(loader=Marking(str(templates)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def _mark_lines(src: str, name: str) -> str:
    out, depth = [], 0
    for i, line in enumerate(src.split("\n"), 1):
        opens = line.count("{%") + line.count("{#")
        closes = line.count("%}") + line.count("#}")
        plain = depth == 0 and opens == 0 and closes == 0 and not line.rstrip().endswith("\\") and line.strip()
        out.append(f"{line} //@@{name}@{i}@@" if plain else line)
        depth += opens - closes
    return "\n".join(out)


def _line_map(annotated: str, plain: str) -> list[list] | None:
    """Runs [first_output_line, template, template_line, count]; None when the annotation changed the output."""
    lines = annotated.split("\n")
    if "\n".join(_MARK.sub("", ln) for ln in lines) != plain:
        return None
    runs: list[list[int]] = []
    for n, ln in enumerate(lines, 1):
        m = _MARK.search(ln)
        if not m:
            continue
        name, t = m.group(1), int(m.group(2))
        last = runs[-1] if runs else None
        if last and last[1] == name and last[0] + last[3] == n and last[2] + last[3] == t:
            last[3] += 1
        else:
            runs.append([n, name, t, 1])
    return runs


def _render_one(env, annotated_env, template: str, ctx: dict, where: str) -> tuple[str, list | None]:
    try:
        text = env.get_template(template).render(**ctx)
    except jinja2.TemplateError as e:
        name, line = getattr(e, "name", None) or template, getattr(e, "lineno", None)
        if line is None:  # runtime errors (e.g. undefined): jinja maps the template frame to its source line
            tb = e.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code.co_filename.endswith(".j2"):
                    name, line = Path(tb.tb_frame.f_code.co_filename).name, tb.tb_lineno
                tb = tb.tb_next
        raise RenderError(f"{where}: template codegen/templates/{name}{f':{line}' if line else ''}: "
                          f"{e.message or e}") from None
    return text, _line_map(annotated_env.get_template(template).render(**ctx), text)


def build_manifest_and_sources(specs: SpecSet, templates: Path) -> tuple[dict, dict[str, str]]:
    env, annotated = _environment(templates), _annotated_environment(templates)
    sources: dict[str, str] = {}
    kernels: dict[str, dict] = {}
    for op_name in sorted(specs.routes):  # reference-only ops (no routes file) have no kernels
        op = specs.ops[op_name]
        for rname in sorted(specs.routes[op_name]):
            route = specs.routes[op_name][rname]
            for arch_name in sorted(route.archs):
                arch = specs.archs[arch_name]
                for dtype in sorted(route.dtypes):
                    for tid in sorted(route.tiles):
                        tile = route.tiles[tid]
                        symbol = symbol_for(op_name, rname, tid, dtype)
                        rel = f"{arch_name}/{op_name}/{rname}.{tid}.{dtype}.cu"
                        ctx = {"symbol": symbol, "pre_symbol": symbol + "_pre", "tile": tile,
                               "dtype": {"name": dtype, "ctype": DTYPES[dtype]},
                               "arch": {"name": arch_name, "cc": arch.cc, "features": arch.features},
                               "op": {"name": op_name, "params": op.params}, "route": rname}
                        where = f"{route.file}: route {op_name}/{rname} tile {tid} ({arch_name}, {dtype})"
                        text, line_map = _render_one(env, annotated, route.template, ctx, where)
                        header = (f"// Generated by ninfer codegen from {route.file} (route {rname}, tile {tid}) and "
                                  f"codegen/templates/{route.template}. Do not edit.\n")
                        text = header + text
                        if line_map is not None:
                            line_map = [[a + 1, f, b, c] for a, f, b, c in line_map]
                        sources[rel] = text
                        low = route.lowered[tid]
                        if "pre" in low and f"{symbol}_pre(" not in text:
                            raise RenderError(f"{where}: the route launches a pre kernel, but the template defines "
                                              f"no {symbol}_pre (use {{{{ pre_symbol }}}})")
                        record = kernels[f"{arch_name}/{op_name}/{rname}.{tid}/{dtype}"] = {
                            "op": op_name, "route": rname, "tile": tid, "tile_params": tile, "arch": arch_name,
                            "dtype": dtype, "symbol": symbol, "source": rel, "template": route.template,
                            "spec": route.file, "source_sha256": hashlib.sha256(text.encode()).hexdigest(),
                            "args": low["args"], "grid": low["grid"], "block": low["block"], "smem": low["smem"],
                            "constraints": low["constraints"], "line_map": line_map,
                            # launched with programmatic stream serialization on sm_90+ (_pdl.cuh.j2)
                            "pdl": "nf_pdl_enter();" in text}
                        if "pre" in low:
                            record["pre"] = {"symbol": symbol + "_pre", **low["pre"]}
                        if "workspace" in low:
                            record["workspace"] = low["workspace"]
    tables = _tables(specs.tables)
    tuned = {gpu: {"arch": arch, "tables": _tables(ts)[arch]} for gpu, (arch, ts) in sorted(specs.tuned.items()) if ts}
    ops = {name: {"summary": op.doc["summary"], "formula": op.doc["formula"], "dims": list(op.dims),
                  "problem": op.problem, "dtypes": op.dtypes,
                  # lists, not mappings: argument order is part of the contract and JSON keys get sorted
                  "inputs": [{"name": k, "dtype": v.dtype, "shape": v.shape} for k, v in op.inputs.items()],
                  "outputs": [{"name": k, "dtype": v.dtype, "shape": v.shape} for k, v in op.outputs.items()],
                  "states": [{"name": k, "dtype": v.dtype, "shape": v.shape} for k, v in op.states.items()],
                  "params": [{"name": k, **v} for k, v in op.params.items()], "constraints": op.constraints, "aliases": op.aliases, "reference": op.reference, "tolerance": op.tolerance}
           for name, op in sorted(specs.ops.items())}
    archs = {a.name: {"cc": a.cc, "smem_per_block": a.smem_per_block, "sm_count_hint": a.sm_count_hint,
                      "features": a.features} for a in specs.archs.values()}
    manifest = {"version": MANIFEST_VERSION, "archs": archs, "tolerances": specs.tolerances, "ops": ops,
                "kernels": dict(sorted(kernels.items())), "tables": tables, "tuned": tuned}
    return manifest, sources


def _tables(table_list) -> dict:
    """arch -> op -> dtype -> [{problem, spans, spec}], specific problems before the default."""
    tables: dict = {}
    for t in table_list:
        for a in t.archs:
            for d in t.dtypes:
                entry = {"problem": dict(sorted(t.problem.items())), "spans": [list(s) for s in t.spans], "spec": t.file}
                tables.setdefault(a, {}).setdefault(t.op, {}).setdefault(d, []).append(entry)
    for a in tables.values():
        for o in a.values():
            for lst in o.values():
                lst.sort(key=lambda e: (len(e["problem"]) == 0, json.dumps(e["problem"])))
    return tables


def write_tree(out: Path, manifest: dict, sources: dict[str, str]) -> None:
    """Write into a sibling temp dir, then swap it in; a failure leaves the previous tree as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    try:
        for rel, text in sources.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old.exists():
            old.rename(out)
        raise
    if old.exists():
        shutil.rmtree(old)


def generate(specs_dir: Path, templates: Path, out: Path) -> dict:
    from .specs import load_specs
    specs = load_specs(specs_dir, templates)
    manifest, sources = build_manifest_and_sources(specs, templates)
    write_tree(out, manifest, sources)
    return manifest


__all__ = ["generate", "RenderError", "SpecError", "symbol_for"]
