"""`ninfer-quantize bench-convert`: write a synthetic BF16 safetensors checkpoint at the real Qwen3.6
shapes (tensor names and shapes come from the recipe itself, fused experts as real checkpoints
store them), evict it from the page cache, then convert it in a child process and report the child's
peak RSS and throughput. The child reads its own VmHWM: getrusage(RUSAGE_CHILDREN) would also count
the pages a fork inherits from this (larger) parent. A benchmark, not a test: nothing is asserted."""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from ninfer.runtime.recipes import load_recipe

MiB, GiB = 1 << 20, 1 << 30

_27B = dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
            num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            vocab_size=248320, num_hidden_layers=64, tie_word_embeddings=False)
_35B = dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320, num_hidden_layers=40,
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, tie_word_embeddings=False)
SHAPES = {"qwen3.6-27b": ("qwen3_5", "qwen3_5", _27B), "qwen3.6-35b-a3b": ("qwen3_5_moe", "qwen3_5_moe", _35B)}


def synthetic_config(shape: str, layers: int, vocab: int | None) -> tuple[str, dict]:
    recipe, model_type, text = SHAPES[shape]
    text = dict(text, num_hidden_layers=layers)
    if vocab:
        text["vocab_size"] = vocab
    # the real hybrid pattern on the first `layers` layers: full attention at 3, 7, 11, ...
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return recipe, {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": model_type,
                    "text_config": text, "tie_word_embeddings": False}


def source_tensors(recipe_name: str, config: dict) -> list[tuple[str, tuple]]:
    """(name, shape) of every checkpoint tensor the recipe reads, VLM naming, first (fused) variant."""
    rec = load_recipe(recipe_name)
    out = []
    for pt in rec.expand(config, {}):
        for s in pt.variants[0]:
            out.append((s.name.replace("{P}", "model.language_model."), s.shape))
    return list(dict.fromkeys(out))


def write_safetensors(path: Path, tensors: list[tuple[str, tuple]], seed: int = 0) -> int:
    """Stream a BF16 safetensors file: header, then each tensor's bytes cut from a 64 MiB pool of
    N(0, 0.02) values (rotating start, so tensors differ). Memory: the pool."""
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    pool = ((rng.standard_normal(32 * MiB, np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    pool = np.concatenate([pool, pool]).view(np.uint8)     # doubled: any window of 64 MiB is contiguous
    half = pool.size // 2
    start = 0
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, shape in tensors:
            left = math.prod(shape) * 2
            while left:
                n = min(left, half)
                f.write(memoryview(pool[start:start + n]))
                left -= n
                start = (start + 2 * 7919) % half          # stay 2-byte aligned
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)   # convert from disk, not cache
    return 8 + len(raw) + pos


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_main() -> None:
    """Run `ninfer-quantize ARGS` and print the peak RSS on stderr (the benchmark's child)."""
    from ninfer.cli.quantize import main
    try:
        main(args=sys.argv[1:], prog_name="ninfer-quantize")
    finally:
        print(f"peak_rss_bytes={peak_rss_bytes()}", file=sys.stderr)


def run_bench(shape, layers, vocab, fmt, workdir, keep) -> dict:
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="ninfer-bench-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt, out = work / "ckpt", work / f"{shape}-{layers}L-{fmt}.ninfer"
    try:
        ckpt.mkdir(exist_ok=True)
        recipe, config = synthetic_config(shape, layers, vocab)
        (ckpt / "config.json").write_text(json.dumps(config, indent=1))
        tensors = source_tensors(recipe, config)
        t0 = time.perf_counter()
        src_bytes = write_safetensors(ckpt / "model.safetensors", tensors)
        t_synth = time.perf_counter() - t0
        click.echo(f"synthetic {shape}: {layers} layers, {len(tensors)} tensors, {src_bytes / GiB:.2f} GiB BF16 "
                   f"written in {t_synth:.1f} s -> {ckpt}", err=True)
        cmd = [sys.executable, "-c", "from ninfer.cli.quantize_bench import child_main; child_main()",
               "convert", str(ckpt), "-o", str(out), "--format", fmt, "--no-progress"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise click.ClickException(f"conversion failed ({proc.returncode}):\n{proc.stderr}")
        peak = int(proc.stderr.rsplit("peak_rss_bytes=", 1)[1].split()[0])
        out_bytes = out.stat().st_size
        result = {"shape": shape, "layers": layers, "format": fmt, "source_GiB": src_bytes / GiB,
                  "artifact_GiB": out_bytes / GiB, "wall_s": wall, "source_MBps": src_bytes / 1e6 / wall,
                  "peak_rss_MiB": peak / MiB}
        click.echo(proc.stdout.strip(), err=True)
        click.echo(f"bench-convert {shape} layers={layers} format={fmt}: source {src_bytes / GiB:.2f} GiB -> "
                   f"artifact {out_bytes / GiB:.2f} GiB in {wall:.1f} s wall (incl. process start) = "
                   f"{result['source_MBps']:.0f} MB/s of BF16 source; peak RSS of the converter "
                   f"{result['peak_rss_MiB']:.0f} MiB")
        return result
    finally:
        if not keep:
            shutil.rmtree(work if own else ckpt, ignore_errors=True)
            if not own and out.exists():
                out.unlink()
