"""ninfer-perplexity: how well a model predicts a text, and how far a quantized model drifts from its base.

  ninfer-perplexity ARTIFACT --text FILE [--window N] [--stride N] [--backend ...] [--json]
  ninfer-perplexity kl QUANT.ninfer BASE.ninfer --text FILE [--window N] [--stride N] [--json]

The text is tokenized once (with ARTIFACT's tokenizer; `--ids FILE` gives token ids directly) and
cut into fixed windows: window w starts at w*stride and holds up to N tokens; each window is scored
independently (Engine.score, fresh state). A token is counted once, in the first window whose new
part covers it (with stride < window the earlier tokens of a window are context only); the first
token of a window is never a target (nothing precedes it there), so with the default stride =
window each window predicts window - 1 tokens. Results are token-weighted: every counted token has the same weight,
whatever window it sits in.

  perplexity = exp(mean NLL)          NLL = -log p(token | preceding tokens of its window)
  KL         = mean KL(base || quant) of the next-token distributions at the counted positions,
               plus how often both pick the same top-1 token.
Distributions are over the tokenizer's ids only (Engine.domain), as in generation.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import click

from ninfer.cli.main import fail
from ninfer.runtime.kv_dtype import KV_CACHE_DTYPES


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first counted position) per window; positions count the token predicted there."""
    out, counted, start = [], 0, 0   # tokens [0, counted) are done
    while counted < n:
        end = min(start + window, n)
        first = max(counted, start + 1)  # a window's first token has no context in it: never a target
        if end > first:
            out.append((start, end, first))
        counted = end
        if end == n:
            break
        start += stride
    return out


def read_ids(text_file: Path | None, ids_file: Path | None, artifact: Path) -> list[int]:
    if (text_file is None) == (ids_file is None):
        raise click.UsageError("give exactly one of --text FILE or --ids FILE")
    if ids_file is not None:
        try:
            raw = ids_file.read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"ids file {ids_file}: cannot read it: {e}")
        try:
            ids = json.loads(raw) if raw.lstrip().startswith("[") else [int(t) for t in raw.split()]
        except ValueError as e:
            fail(f"ids file {ids_file}: expected a JSON array or whitespace-separated integers: {e}")
        if not all(isinstance(i, int) for i in ids):
            fail(f"ids file {ids_file}: every id must be an integer")
        return ids
    try:
        text = text_file.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"text file {text_file}: cannot read it: {e}")
    from ninfer.runtime.artifact import ArtifactError, open_artifact
    from ninfer.runtime.tokenizer import Tokenizer, TokenizerError
    if not artifact.exists():
        fail(f"{artifact}: no such file")
    try:
        with open_artifact(artifact) as art:
            return Tokenizer.from_artifact(art).encode(text)
    except (ArtifactError, TokenizerError, OSError) as e:
        fail(str(e))


def open_engine(path: Path, backend: str, window: int, kv_cache_dtype: str = "auto"):
    from ninfer.runtime.artifact import ArtifactError
    from ninfer.runtime.engine import Engine, EngineError
    from ninfer.runtime.models.config import ConfigError
    if not path.exists():
        fail(f"{path}: no such file")
    try:
        return Engine(path, backend=backend, max_context=window, max_seqs=1, prefill_chunk=min(window, 1024),
                      kv_cache_dtype=kv_cache_dtype)
    except (ArtifactError, ConfigError, EngineError, OSError, KeyError) as e:
        fail(f"{path}: {e}")
    except RuntimeError as e:
        fail(f"cannot start the {backend} backend: {e}")


ROW_CHUNK = 64   # rows of [V] log-probabilities (float64) held at once


def _score(engine, ids: list[int]):
    from ninfer.runtime.cache import CapacityError
    from ninfer.runtime.engine import EngineError
    try:
        return engine.score(ids)
    except (EngineError, CapacityError) as e:
        fail(str(e))


def _row_chunks(logits, engine, start: int, end: int, first: int):
    """(log-probabilities over the token domain, target ids) for the counted rows, a chunk at a time.
    Row r of a window's logits predicts token start + r + 1."""
    import torch
    for a in range(first, end, ROW_CHUNK):
        b = min(a + ROW_CHUNK, end)
        rows = logits[a - start - 1:b - start - 1, :engine.domain]
        yield torch.log_softmax(rows.double(), dim=-1), (a, b)


def perplexity(engine, ids: list[int], window: int, stride: int) -> dict:
    import torch
    nll, count = 0.0, 0
    spans = windows(len(ids), window, stride)
    for start, end, first in spans:
        logits = _score(engine, ids[start:end])
        for lp, (a, b) in _row_chunks(logits, engine, start, end, first):
            targets = torch.tensor(ids[a:b], device=lp.device)
            nll -= lp.gather(1, targets[:, None]).sum().item()
        count += end - first
    mean = nll / count
    return {"tokens": count, "windows": len(spans), "window": window, "stride": stride,
            "mean_nll": mean, "perplexity": math.exp(mean)}


def kl_divergence(quant, base, ids: list[int], window: int, stride: int) -> dict:
    import torch
    if quant.domain != base.domain:
        fail(f"the two models' vocabularies differ ({quant.domain} vs {base.domain} ids): KL needs the same tokens")
    kl, agree, count, nll_q, nll_b = 0.0, 0, 0, 0.0, 0.0
    spans = windows(len(ids), window, stride)
    for start, end, first in spans:
        lq_all, lb_all = _score(quant, ids[start:end]), _score(base, ids[start:end])
        for (lq, (a, b)), (lb, _) in zip(_row_chunks(lq_all, quant, start, end, first),
                                         _row_chunks(lb_all, base, start, end, first)):
            lq = lq.to(lb.device)
            kl += (lb.exp() * (lb - lq)).sum().item()
            agree += int((lq.argmax(-1) == lb.argmax(-1)).sum())
            targets = torch.tensor(ids[a:b], device=lb.device)[:, None]
            nll_q -= lq.gather(1, targets).sum().item()
            nll_b -= lb.gather(1, targets).sum().item()
        count += end - first
    return {"tokens": count, "windows": len(spans), "window": window, "stride": stride,
            "mean_kl": kl / count, "top1_agreement": agree / count,
            "perplexity_quant": math.exp(nll_q / count), "perplexity_base": math.exp(nll_b / count)}


def _check_window(ids, window, stride) -> int:
    stride = stride or window
    if stride > window:
        raise click.UsageError(f"--stride {stride} is larger than --window {window}: tokens would be skipped")
    if len(ids) < 2:
        fail(f"the text is {len(ids)} token(s); at least 2 are needed to predict one")
    return stride


class _DefaultGroup(click.Group):
    """`ninfer-perplexity ARTIFACT ...` runs the hidden `ppl` command; `kl` is a subcommand."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["ppl", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Perplexity of ARTIFACT on a text (`ninfer-perplexity ARTIFACT --text FILE`), or the KL
    divergence of a quantized model from its base (`ninfer-perplexity kl QUANT BASE --text FILE`)."""


def _common(f):
    for opt in reversed([
        click.option("--text", "text_file", type=click.Path(dir_okay=False, path_type=Path),
                     help="UTF-8 text file, tokenized with the artifact's tokenizer."),
        click.option("--ids", "ids_file", type=click.Path(dir_okay=False, path_type=Path),
                     help="Token ids instead of text (JSON array or whitespace-separated)."),
        click.option("--window", type=click.IntRange(2), default=512, show_default=True,
                     help="Tokens per window (the context each prediction can see at most)."),
        click.option("--stride", type=click.IntRange(1), default=None,
                     help="Start of one window to the next (default: --window, non-overlapping)."),
        click.option("--backend", type=click.Choice(["auto", "cuda", "reference"]), default="auto",
                     show_default=True),
        click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
                     help="KV cache storage (as ninfer-serve's); in `kl`, QUANT's only: `kl M M --kv-cache-dtype fp8` "
                          "measures the FP8 cache against the model-dtype one."),
        click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object."),
    ]):
        f = opt(f)
    return f


@main.command("ppl")
@click.argument("artifact", type=click.Path(dir_okay=False, path_type=Path))
@_common
def ppl_cmd(artifact, text_file, ids_file, window, stride, backend, kv_cache_dtype, as_json):
    """(default) Token-weighted perplexity of ARTIFACT over fixed windows of the text;
    `ninfer-perplexity ARTIFACT ...` is short for `ninfer-perplexity ppl ARTIFACT ...`."""
    ids = read_ids(text_file, ids_file, artifact)
    stride = _check_window(ids, window, stride)
    engine = open_engine(artifact, backend, window, kv_cache_dtype)
    try:
        t0 = time.perf_counter()
        res = perplexity(engine, ids, window, stride)
        res["seconds"] = time.perf_counter() - t0
    finally:
        engine.close()
    res["artifact"] = str(artifact)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(f"{artifact}: {res['tokens']} tokens in {res['windows']} windows of {window} (stride {stride})")
    click.echo(f"mean NLL {res['mean_nll']:.6f} nats/token, perplexity {res['perplexity']:.4f}  "
               f"({res['seconds']:.2f} s)")


@main.command("kl")
@click.argument("quant", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("base", type=click.Path(dir_okay=False, path_type=Path))
@_common
def kl_cmd(quant, base, text_file, ids_file, window, stride, backend, kv_cache_dtype, as_json):
    """Token-weighted mean KL(BASE || QUANT) of next-token distributions, and top-1 agreement."""
    ids = read_ids(text_file, ids_file, base)
    stride = _check_window(ids, window, stride)
    eb = open_engine(base, backend, window)
    try:
        eq = open_engine(quant, backend, window, kv_cache_dtype)
        try:
            t0 = time.perf_counter()
            res = kl_divergence(eq, eb, ids, window, stride)
            res["seconds"] = time.perf_counter() - t0
        finally:
            eq.close()
    finally:
        eb.close()
    res.update(quant=str(quant), base=str(base), quant_kv_cache_dtype=kv_cache_dtype)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(f"{quant} vs {base}: {res['tokens']} tokens in {res['windows']} windows of {window} "
               f"(stride {stride})")
    click.echo(f"mean KL(base || quant) {res['mean_kl']:.6g} nats/token, top-1 agreement "
               f"{100 * res['top1_agreement']:.2f} %")
    click.echo(f"perplexity: quant {res['perplexity_quant']:.4f}, base {res['perplexity_base']:.4f}  "
               f"({res['seconds']:.2f} s)")


if __name__ == "__main__":
    main()
