"""HF checkpoint -> .ninfer conversion: plan (recipe + config + checkpoint) and stream (read a chunk
of rows, encode, append), so memory stays at about one chunk whatever the model size."""
from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .artifact_writer import ArtifactWriter, TensorSpec
from .format_base import NonFiniteError, as_matrix_shape
from .formats import get_format
from .hf_checkpoint import Checkpoint, CheckpointError
from .recipes import BoundTensor, Recipe, RecipeError, detect_recipe, load_recipe

# Resources copied byte for byte from the checkpoint directory (config.json is required).
RESOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                  "generation_config.json", "config.json")
RECIPE_RESOURCE = "recipe.yaml"
DEFAULT_CHUNK_ELEMS = 4 << 20   # ~16 MiB of float32 per chunk; keeps numpy temporaries small


class ConvertError(Exception):
    pass


@dataclass
class ConversionPlan:
    hf_dir: Path
    recipe: Recipe
    config: dict
    checkpoint: Checkpoint
    tensors: list[BoundTensor]
    resources: list[tuple[str, bytes]]
    notes: list[str] = field(default_factory=list)

    @property
    def source_bytes(self) -> int:
        return sum(self.checkpoint.tensors[s].nbytes * c // self.checkpoint.tensors[s].numel
                   for t in self.tensors for s, _, c in t.segments)

    def output_bytes(self) -> int:
        return sum(get_format(t.format).nbytes(t.shape) for t in self.tensors)


def read_config(hf_dir: Path) -> dict:
    p = hf_dir / "config.json"
    if not p.exists():
        raise ConvertError(f"{p}: missing (every HF checkpoint directory has one; it selects the recipe)")
    try:
        cfg = json.loads(p.read_text("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{p}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{p}: expected a JSON object")
    return cfg


def plan_conversion(hf_dir, recipe: str | None = None, fmt: str | None = None, overrides=(),
                    skip=()) -> ConversionPlan:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir}: not a directory")
    config = read_config(hf_dir)
    rec = load_recipe(recipe) if recipe else detect_recipe(config, str(hf_dir / "config.json"))
    unknown_skip = set(skip) - set(rec.optional_sections())
    if unknown_skip:
        raise RecipeError(f"--skip {sorted(unknown_skip)}: recipe {rec.name} has optional sections "
                          f"{sorted(rec.optional_sections())}")
    ckpt = Checkpoint(hf_dir)
    try:
        shapes = {n: t.shape for n, t in ckpt.tensors.items()}
        present = rec.present_sections(shapes, skip)
        tensors = rec.bind(rec.expand(config, present), shapes, skip)
        rec.apply_formats(tensors, fmt, overrides)
    except BaseException:
        ckpt.close()
        raise
    resources, notes = [], []
    for name in RESOURCE_FILES:
        p = hf_dir / name
        if p.exists():
            resources.append((name, p.read_bytes()))
        else:
            notes.append(f"optional resource {name} not found in {hf_dir}; not embedded")
    resources.append((RECIPE_RESOURCE, rec.text.encode("utf-8")))
    for flag, on in present.items():
        if on:
            notes.append(f"section '{flag}' present: its tensors are carried with flag {flag}")
    return ConversionPlan(hf_dir, rec, config, ckpt, tensors, resources, notes)


class _Gather:
    """Reads flat element ranges of one artifact tensor from its source segments."""

    def __init__(self, ckpt: Checkpoint, t: BoundTensor):
        self.ckpt, self.t = ckpt, t
        self.starts = list(np.cumsum([0] + [c for _, _, c in t.segments]))

    def read(self, start: int, count: int) -> np.ndarray:
        out = np.empty(count, np.float32)
        i = bisect.bisect_right(self.starts, start) - 1
        pos = 0
        while pos < count:
            src, s0, n = self.t.segments[i]
            off = start + pos - self.starts[i]
            take = min(n - off, count - pos)
            piece = self.ckpt.read(src, s0 + off, take)
            if not np.isfinite(piece).all():
                j = int(np.argmax(~np.isfinite(piece)))
                shape = self.ckpt.tensors[src].shape
                idx = [int(v) for v in np.unravel_index(s0 + off + j, shape)] if shape else []
                raise NonFiniteError(f"source tensor {src!r} element {idx} is {piece[j]} (feeds artifact "
                                     f"tensor {self.t.name!r}); weights must be finite")
            out[pos:pos + take] = piece
            pos += take
            i += 1
        return out


def tensor_chunks(ckpt: Checkpoint, t: BoundTensor, chunk_elems: int = DEFAULT_CHUNK_ELEMS, progress=None):
    """Yield the encoded bytes of tensor `t`, a block of rows at a time."""
    fmt = get_format(t.format)
    n, k = as_matrix_shape(t.shape)
    step = max(fmt.row_block, (chunk_elems // k) // fmt.row_block * fmt.row_block)
    g = _Gather(ckpt, t)
    amax = None
    if fmt.needs_amax:   # e.g. nvfp4's tensor scale: one extra read pass, still chunked
        amax = 0.0
        for r0 in range(0, n, step):
            amax = max(amax, float(np.abs(g.read(r0 * k, (min(n, r0 + step) - r0) * k)).max()))
        yield fmt.header(t.shape, amax)
    for r0 in range(0, n, step):
        rows = min(n, r0 + step) - r0
        data = g.read(r0 * k, rows * k).reshape(rows, k)
        yield fmt.encode_rows(data, t.name, r0, amax)
        if progress:
            progress(rows * k)


def convert(plan: ConversionPlan, out_path, chunk_elems: int = DEFAULT_CHUNK_ELEMS, progress=None) -> dict:
    """Write the artifact atomically. `progress(tensor_index, tensor_name, elements_done)` is called
    as chunks are written. Returns a small stats dict."""
    specs = [TensorSpec(t.name, t.shape, t.format, t.role, t.flags) for t in plan.tensors]
    t0 = time.perf_counter()
    with ArtifactWriter(out_path, plan.recipe.model_family, specs,
                        [(n, len(b)) for n, b in plan.resources]) as w:
        for i, t in enumerate(plan.tensors):
            cb = (lambda e, i=i, name=t.name: progress(i, name, e)) if progress else None
            w.add_tensor(t.name, tensor_chunks(plan.checkpoint, t, chunk_elems, cb))
        for name, data in plan.resources:
            w.add_resource(name, data)
        total = w.total_bytes
    return {"seconds": time.perf_counter() - t0, "source_bytes": plan.source_bytes, "output_bytes": total,
            "tensors": len(plan.tensors), "elements": sum(math.prod(t.shape) for t in plan.tensors)}


__all__ = ["ConvertError", "ConversionPlan", "plan_conversion", "convert", "tensor_chunks",
           "CheckpointError", "RecipeError", "RESOURCE_FILES", "RECIPE_RESOURCE"]
