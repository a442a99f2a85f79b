"""`ninfer-bench serve`: the whole serving path measured over HTTP, and a peer on the same machine.

Starts `ninfer-serve` on an artifact (by default one with random weights at the real Qwen3.6-27B or
35B-A3B shape, written once under --workdir) and drives it with streaming OpenAI chat requests:
  prefill: one request per prompt length, max_tokens 1; the time to the end of the response is the time
           to the first token (TTFT), prompt tokens / TTFT the prefill rate;
  retry:   after each prefill request, the same request again (a retried or regenerated answer): its TTFT with
           the prompt's last-token logits kept by the prefix cache;
  next turn: after each prefill request, the conversation's next turn (that prompt, a short answer, a
           --next-turn-token message): its TTFT and the prompt tokens the server took from its prefix cache;
  return:  after the decode runs (whose streams took every lane), the first conversation's next turn again: its
           TTFT from host memory with --cache-ram, else from whatever prefix is left;
  shared system turn: two new conversations that open with the same --shared-system-token system prompt: the
           second's TTFT starts from the first's prefix snapshot;
  decode:  C concurrent streams of --max-tokens tokens after a --decode-prompt prompt; the aggregate rate
           is counted over the window in which all C are decoding (from the last first token to the first
           end), from the arrival times of the streamed chunks.
Then the peer, Hugging Face transformers (bf16, SDPA attention, its default cache; on the GPU machine its
Gated DeltaNet layers run the torch fallback, as fla/causal-conv1d are not installed), builds the same
model with random weights and runs the same prompt lengths and batch sizes with model.generate. Each
figure carries its fraction of the roofline measured in the same run (FLOPs / bf16 GEMM peak for prefill,
bytes / device copy rate for decode); the ratios ninfer / peer close the table. JSON with --json.
"""
from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

from ninfer.runtime.kv_dtype import KV_CACHE_DTYPES, kv_element_bytes

# Common English words that the Qwen tokenizer keeps whole (" the", " river", ...): prompts of about n tokens.
WORDS = ("the of and to in is was for on with as by at from that this it he she they we you are were be "
         "been have has had do does did not but or if then so than when where which who what how all any "
         "each every some many more most other such only own same very can will just now time year day way "
         "man world life hand part child eye woman place work week case point number group problem fact "
         "river mountain city house door road light water fire stone tree garden window table paper story").split()
TEMPLATE_TOKENS = 8      # what the chat template adds around one user message (about)
NEXT_ANSWER = "I have read it and will answer the question below."   # the next turn's assistant message
RESOURCES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def prompt_text(n_tokens: int, seed: int) -> str:
    """About n_tokens tokens of words (the server reports the exact count), different for every seed."""
    import random
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(max(1, n_tokens - TEMPLATE_TOKENS)))


# -- the artifact --------------------------------------------------------------------------------
def synthetic_artifact(shape: str, fmt: str, workdir: Path, resources_from: Path | None) -> Path:
    """build/bench/<shape>-<fmt>.ninfer: random weights at the shape, the tokenizer and chat template of
    `resources_from` (default: the demo artifact). Written once, atomically; reused afterwards."""
    from ninfer.runtime.artifact import open_artifact
    from ninfer.runtime.cuda import gpu_available
    from ninfer.runtime.synthetic import SHAPES, write_artifact
    path = Path(workdir) / f"{shape}-{fmt}-random.ninfer"
    if path.exists():
        return path
    if resources_from is None:
        from ninfer.cli.serve import demo_artifact
        resources_from = demo_artifact()
    art = open_artifact(resources_from)
    try:
        missing = [r for r in RESOURCES if r not in art.resources]
        if missing:
            raise click.ClickException(f"{resources_from}: lacks the resources {', '.join(missing)}")
        res = {r: art.resource(r) for r in RESOURCES}
    finally:
        art.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    click.echo(f"# writing {path} (random {fmt} weights at the {shape} shape)", err=True)
    t0 = time.perf_counter()
    n = write_artifact(SHAPES[shape], fmt, path, res, "cuda" if gpu_available() else "cpu")
    click.echo(f"# wrote {n / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s", err=True)
    return path


# -- the server ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """ninfer-serve in a child process on a free loopback port; stopped (and waited for) on exit."""

    def __init__(self, artifact: Path, *, backend: str, max_concurrency: int, max_context: int,
                 startup_timeout: float, kv_cache_dtype: str = "auto", cache_ram_mib: int = 0,
                 speculative_config: str | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "ninfer.cli.serve", str(artifact), "--port", str(self.port),
                    "--backend", backend, "--max-concurrency", str(max_concurrency), "--max-context",
                    str(max_context), "--model-id", "bench", "--kv-cache-dtype", kv_cache_dtype,
                    "--cache-ram", str(cache_ram_mib)]
        if speculative_config is not None:
            self.cmd += ["--speculative-config", speculative_config]
        # (ninfer-serve's own prefill chunks: what users get)
        self.startup_timeout = startup_timeout

    def __enter__(self) -> "Server":
        import urllib.request
        self.proc = subprocess.Popen(self.cmd)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise click.ClickException(f"ninfer-serve exited with status {self.proc.returncode} "
                                               f"before it answered: {' '.join(self.cmd)}") from None
                if time.monotonic() > deadline:
                    self._stop()
                    raise click.ClickException(f"ninfer-serve did not answer within {self.startup_timeout:.0f} s") from None
                time.sleep(0.5)

    def _stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self._stop()


async def _stream(session, url: str, prompt: str | list, max_tokens: int, seed: int) -> dict:
    """One streaming chat request (a user message, or the messages); the arrival time of every chunk that carries
    text."""
    # sampled as the artifact's generation_config says (Qwen's: temperature 0.6, top-k 20, top-p 0.95; what a
    # client that sets nothing gets), with a fixed seed per stream: greedy decoding of random weights can repeat
    # a token that has no text
    body = {"model": "bench", "stream": True, "max_tokens": max_tokens, "seed": seed,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt}
    t0 = time.perf_counter()
    arrivals, usage = [], None
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise click.ClickException(f"ninfer-serve answered {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            if any(ch.get("delta", {}).get(k) for ch in chunk.get("choices", []) for k in ("content", "reasoning_content")):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    if usage is None:
        raise click.ClickException("ninfer-serve sent no usage chunk (stream_options.include_usage)")
    return {"start": t0, "end": end, "arrivals": arrivals, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "completion_tokens": usage["completion_tokens"]}


def decode_rate(streams: list[dict]) -> tuple[float, float]:
    """(aggregate tok/s, window s) over the window in which every stream is decoding: from the last first
    chunk to the first last chunk. A stream's chunks in the window count as its tokens per chunk each."""
    lo = max(s["arrivals"][0] for s in streams)
    hi = min(s["arrivals"][-1] for s in streams)
    if hi <= lo:
        raise click.ClickException("the streams never decoded all at once: raise --max-tokens")
    tokens = 0.0
    for s in streams:
        per_chunk = (s["completion_tokens"] - 1) / max(len(s["arrivals"]) - 1, 1)
        tokens += per_chunk * sum(1 for t in s["arrivals"][1:] if lo < t <= hi)
    return tokens / (hi - lo), hi - lo


async def drive(url: str, prompts: list[int], concurrency: list[int], decode_prompt: int, max_tokens: int,
                next_turn: int = 0, shared_system: int = 0, retry: bool = False) -> dict:
    import aiohttp
    out = {"prefill": [], "retry": [], "next_turn": [], "shared_system": [], "decode": [], "return": []}
    turns = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        # warm-up at the first prompt length: first-call costs (kernel modules, the prefill routes' scratch
        # buffers) would otherwise land in its TTFT; decode graphs are ready either way
        await _stream(s, url, prompt_text(prompts[0] if prompts else 32, 0), 2, 0)
        for i, n in enumerate(prompts):
            first = prompt_text(n, 100 + i)
            r = await _stream(s, url, first, 1, 1)
            ttft = r["end"] - r["start"]
            out["prefill"].append({"prompt_tokens": r["prompt_tokens"], "ttft_s": ttft,
                                   "tok_s": r["prompt_tokens"] / ttft})
            click.echo(f"# ninfer prefill {r['prompt_tokens']} tokens: TTFT {ttft:.3f} s", err=True)
            if retry:
                t = await _stream(s, url, first, 1, 1)
                out["retry"].append({"prompt_tokens": t["prompt_tokens"], "cached_tokens": t["cached_tokens"],
                                     "ttft_s": t["end"] - t["start"]})
                click.echo(f"# ninfer retry {t['prompt_tokens']} tokens ({t['cached_tokens']} cached): TTFT "
                           f"{t['end'] - t['start']:.3f} s", err=True)
            if next_turn:
                turn = [{"role": "user", "content": first}, {"role": "assistant", "content": NEXT_ANSWER},
                        {"role": "user", "content": prompt_text(next_turn, 500 + i)}]
                t = await _stream(s, url, turn, 1, 1)
                turns.append(turn)
                out["next_turn"].append({"after_tokens": r["prompt_tokens"], "prompt_tokens": t["prompt_tokens"],
                                         "cached_tokens": t["cached_tokens"], "ttft_s": t["end"] - t["start"]})
                click.echo(f"# ninfer next turn {t['prompt_tokens']} tokens ({t['cached_tokens']} cached): TTFT "
                           f"{t['end'] - t['start']:.3f} s", err=True)
        system = {"role": "system", "content": prompt_text(shared_system, 900)}
        for j in range(2 if shared_system else 0):
            t = await _stream(s, url, [system, {"role": "user", "content": prompt_text(64, 901 + j)}], 1, 1)
            out["shared_system"].append({"conversation": j + 1, "prompt_tokens": t["prompt_tokens"],
                                         "cached_tokens": t["cached_tokens"], "ttft_s": t["end"] - t["start"]})
            click.echo(f"# ninfer new conversation {j + 1}, shared system turn: {t['prompt_tokens']} tokens "
                       f"({t['cached_tokens']} cached): TTFT {t['end'] - t['start']:.3f} s", err=True)
        for c in concurrency:
            rs = await asyncio.gather(*[_stream(s, url, prompt_text(decode_prompt, 1000 * c + i), max_tokens, i)
                                        for i in range(c)])
            rate, window = decode_rate(rs)
            out["decode"].append({"concurrency": c, "tok_s": rate, "window_s": window,
                                  "context": statistics.median(r["prompt_tokens"] for r in rs) + max_tokens // 2,
                                  "ttft_median_s": statistics.median(r["arrivals"][0] - r["start"] for r in rs),
                                  "completion_tokens": [r["completion_tokens"] for r in rs]})
            click.echo(f"# ninfer decode C={c}: {rate:,.1f} tok/s over {window:.2f} s", err=True)
        if turns and concurrency:
            t = await _stream(s, url, turns[0], 1, 1)
            out["return"].append({"prompt_tokens": t["prompt_tokens"], "cached_tokens": t["cached_tokens"],
                                  "ttft_s": t["end"] - t["start"]})
            click.echo(f"# ninfer return to conversation 1, {t['prompt_tokens']} tokens ({t['cached_tokens']} "
                       f"cached): TTFT {t['end'] - t['start']:.3f} s", err=True)
    return out


# -- the peer ------------------------------------------------------------------------------------
def run_peer(hf_conf: dict, prompts: list[int], concurrency: list[int], decode_prompt: int, max_tokens: int) -> dict:
    """transformers on the same shapes with random weights, given the exact prompt lengths ninfer served:
    prefill = generate 1 token, decode = the extra time of generating max_tokens; a figure that fails (out of
    memory, unsupported) records its error."""
    import torch
    import transformers as tf
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    name = f"transformers {tf.__version__} ({str(dtype).removeprefix('torch.')}, sdpa)"
    try:
        conf = tf.AutoConfig.for_model(**{k: v for k, v in hf_conf.items() if k != "transformers_version"})
        with torch.device(dev):
            model = tf.AutoModelForCausalLM.from_config(conf, dtype=dtype, attn_implementation="sdpa").eval()
    except (ValueError, KeyError, ImportError, RuntimeError) as e:   # e.g. a transformers without this model
        err = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        return {"name": name, "prefill": [err] * len(prompts), "decode": [err] * len(concurrency)}
    g = torch.Generator().manual_seed(0)
    vocab = min(conf.vocab_size, 248000)

    def gen(batch: int, n: int, new: int) -> float:
        ids = torch.randint(0, vocab, (batch, n), generator=g).to(dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def attempt(fn):
        try:
            return fn()
        except (RuntimeError, ValueError, NotImplementedError) as e:   # torch.OutOfMemoryError is a RuntimeError
            if dev == "cuda":
                torch.cuda.empty_cache()
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}

    out = {"name": name, "prefill": [], "decode": []}
    gen(1, prompts[0], 2)   # warm-up at the first prompt length (first-call library and allocator costs)
    for n in prompts:
        def pre(n=n):
            secs = gen(1, n, 1)
            return {"prompt_tokens": n, "ttft_s": secs, "tok_s": n / secs}
        out["prefill"].append(attempt(pre))
        click.echo(f"# peer prefill {n} tokens: {out['prefill'][-1]}", err=True)
    for c in concurrency:
        def dec(c=c):
            first = gen(c, decode_prompt, 1)
            total = gen(c, decode_prompt, max_tokens)
            return {"concurrency": c, "tok_s": c * (max_tokens - 1) / max(total - first, 1e-9),
                    "context": decode_prompt + max_tokens // 2}
        out["decode"].append(attempt(dec))
        click.echo(f"# peer decode C={c}: {out['decode'][-1]}", err=True)
    return out   # the model's memory goes with this frame


# -- figures -------------------------------------------------------------------------------------
def add_rooflines(side: dict, cfg, fmt: str, ceilings: tuple | None, kv_bytes: int = 2) -> None:
    """peak_frac on prefill rows (FLOPs / bf16 GEMM peak), bw_frac on decode rows (bytes / copy rate; kv_bytes per
    cached K or V element)."""
    from ninfer.cli.bench import decode_step_bytes, model_figures
    if ceilings is None:
        return
    copy_gbs, gemm_tflops = ceilings
    for r in side["prefill"]:
        if "tok_s" in r:
            fig = model_figures(cfg, r["prompt_tokens"] // 2, fmt)
            r["peak_frac"] = r["tok_s"] * fig["flops_per_token"] / (gemm_tflops * 1e12)
    for r in side["decode"]:
        if "tok_s" in r:
            step_s = r["concurrency"] / r["tok_s"]
            nbytes = decode_step_bytes(cfg, model_figures(cfg, 0, fmt, kv_bytes), r["concurrency"], int(r["context"]))
            r["bw_frac"] = nbytes / step_s / (copy_gbs * 1e9)


def ratios(ours: dict, peer: dict) -> dict:
    def pair(a, b, key):
        return a[key] / b[key] if key in a and key in b and b[key] else None
    return {"prefill": [pair(a, b, "tok_s") for a, b in zip(ours["prefill"], peer["prefill"])],
            "decode": [pair(a, b, "tok_s") for a, b in zip(ours["decode"], peer["decode"])]}


def table(result: dict) -> str:
    ours, peer, rat = result["ninfer"], result.get("peer"), result.get("ratios")
    head = f"{'':<22}{'ninfer':>22}" + (f"{peer['name']:>37}{'ratio':>9}" if peer else "")
    lines = [head]

    def cell(r, key, frac):
        if "error" in r:
            return "error"
        f = f" ({100 * r[frac]:.1f} %)" if frac in r else ""
        return f"{r[key]:,.1f}{f}" if key == "tok_s" else f"{r[key]:.2f} s"

    for i, r in enumerate(ours["prefill"]):
        p = peer["prefill"][i] if peer else None
        x = rat["prefill"][i] if rat else None
        for label, key in ((f"prefill {r['prompt_tokens']} tok/s", "tok_s"), (f"TTFT {r['prompt_tokens']}", "ttft_s")):
            line = f"{label:<22}{cell(r, key, 'peak_frac'):>22}"
            if p is not None:
                line += f"{cell(p, key, 'peak_frac'):>37}" + (f"{x:>8.1f}x" if key == "tok_s" and x else "")
            lines.append(line)
    for r in ours.get("retry", []):   # the same request again
        label = f"retry {r['prompt_tokens']}"
        lines.append(f"{label + ' TTFT':<22}{cell(r, 'ttft_s', '') + ' (%d cached)' % r['cached_tokens']:>22}")
    for r in ours.get("return", []):   # the first conversation again, after the decode runs took every lane
        label = f"return {r['prompt_tokens']}"
        lines.append(f"{label + ' TTFT':<22}{cell(r, 'ttft_s', '') + ' (%d cached)' % r['cached_tokens']:>22}")
    for r in ours.get("next_turn", []):   # the peer keeps no cache between calls: its TTFT is a full prefill's
        label = f"next turn {r['prompt_tokens']}"
        lines.append(f"{label + ' TTFT':<22}{cell(r, 'ttft_s', '') + ' (%d cached)' % r['cached_tokens']:>22}")
    for r in ours.get("shared_system", []):   # two new conversations with one system prompt
        label = f"new conv {r['conversation']} {r['prompt_tokens']}"
        lines.append(f"{label + ' TTFT':<22}{cell(r, 'ttft_s', '') + ' (%d cached)' % r['cached_tokens']:>22}")
    for i, r in enumerate(ours["decode"]):
        p = peer["decode"][i] if peer else None
        x = rat["decode"][i] if rat else None
        line = f"{'decode C=%d tok/s' % r['concurrency']:<22}{cell(r, 'tok_s', 'bw_frac'):>22}"
        if p is not None:
            line += f"{cell(p, 'tok_s', 'bw_frac'):>37}" + (f"{x:>8.1f}x" if x else "")
        lines.append(line)
    return "\n".join(lines)


def _ints(text: str, what: str, lo: int = 1, hi: int | None = None) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < lo or (hi is not None and v > hi) for v in vals):
        raise click.BadParameter(f"expected comma-separated integers in {lo}..{hi or '∞'}, got {text!r}", param_hint=what)
    return vals


@click.command("serve")
@click.option("--artifact", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="serve this artifact (default: random weights at --shape, written once under --workdir)")
@click.option("--shape", type=click.Choice(["qwen3.6-27b", "qwen3.6-35b-a3b"]), default="qwen3.6-27b", show_default=True)
@click.option("--weights", "fmt", type=click.Choice(["bf16", "q4", "q5", "q6", "w8", "fp8", "recipe"]), default="q4",
              show_default=True)
@click.option("--prompts", default="1024,8192,32768", show_default=True, help="prompt lengths for prefill / TTFT")
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="concurrent streams for decode (1..8)")
@click.option("--decode-prompt", type=click.IntRange(1), default=8192, show_default=True,
              help="prompt tokens of each decode stream")
# 512: at C = 8 the later streams' 8K prefills overlap the first ones' decoding, and 128 tokens left a window of
# ~15 steps in which all eight decode (H200, session 22)
@click.option("--max-tokens", type=click.IntRange(4), default=512, show_default=True, help="tokens per decode stream")
@click.option("--backend", type=click.Choice(["auto", "cuda", "reference"]), default="auto", show_default=True)
@click.option("--peer", type=click.Choice(["transformers", "none"]), default="transformers", show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("build/bench"), show_default=True)
@click.option("--resources-from", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="artifact whose tokenizer and chat template the synthetic one copies (default: the demo model)")
@click.option("--startup-timeout", type=click.IntRange(1), default=1800, show_default=True, help="seconds")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="ninfer-serve's KV cache storage (fp8: E4M3 codes; the roofline counts their bytes)")
@click.option("--next-turn", type=click.IntRange(0), default=256, show_default=True,
              help="after each prefill request, its conversation's next turn with a message of about this many tokens "
                   "(TTFT with ninfer-serve's prefix cache; 0: none)")
@click.option("--shared-system", type=click.IntRange(0), default=8192, show_default=True,
              help="two new conversations opening with one system prompt of about this many tokens (the second's "
                   "TTFT with ninfer-serve's prefix snapshot; 0: none)")
@click.option("--retry/--no-retry", default=True, show_default=True,
              help="after each prefill request, the same request again (TTFT with its logits kept by the prefix cache)")
@click.option("--cache-ram", "cache_ram_mib", type=click.IntRange(0), default=0, show_default=True,
              help="ninfer-serve's --cache-ram (MiB of host memory for lanes given back)")
@click.option("--speculative-config", default=None, metavar="JSON",
              help="ninfer-serve's --speculative-config (e.g. '{\"method\": \"ngram\"}'; an MTP one needs an artifact "
                   "with an MTP layer). Decode then commits several tokens a step where drafts hold: its roofline "
                   "fractions count one token's bytes per token")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def serve_cmd(artifact, shape, fmt, prompts, concurrency, decode_prompt, max_tokens, backend, peer, workdir,
              resources_from, startup_timeout, kv_cache_dtype, next_turn, shared_system, retry, cache_ram_mib,
              speculative_config, json_out) -> None:
    """Prefill / TTFT and aggregate decode through ninfer-serve over HTTP, beside a transformers peer."""
    import torch

    from ninfer.cli.bench import measure_ceilings
    from ninfer.runtime.artifact import open_artifact
    from ninfer.runtime.cuda import gpu_available
    from ninfer.runtime.models.config import parse_config
    prompt_lens = _ints(prompts, "--prompts")
    levels = _ints(concurrency, "--concurrency", 1, 8)
    gpu = gpu_available() and backend != "reference"
    if artifact is None:
        artifact = synthetic_artifact(shape, fmt, workdir, resources_from)
    art = open_artifact(artifact)
    try:
        hf_conf = json.loads(art.resource("config.json"))
        formats = {e.format for e in art.tensors.values()}
    finally:
        art.close()
    cfg = parse_config(hf_conf)
    packed = sorted(formats & {"q4", "q5", "q6", "w8", "fp8"})
    # the roofline's weight bytes: one packed format, or several (taken as the recipe's mix: synthetic_artifact's
    # "recipe", or a converted checkpoint with the recipe's defaults)
    fmt = packed[0] if len(packed) == 1 else "recipe" if packed else "bf16"
    ceilings = measure_ceilings(torch) if gpu else None
    if gpu:
        torch.cuda.empty_cache()
    max_context = max(max(prompt_lens) + next_turn + 64, shared_system + 128, decode_prompt) + max_tokens + 64
    with Server(artifact, backend=backend, max_concurrency=max(levels), max_context=max_context,
                startup_timeout=startup_timeout, kv_cache_dtype=kv_cache_dtype, cache_ram_mib=cache_ram_mib,
                speculative_config=speculative_config) as srv:
        ours = asyncio.run(drive(srv.url, prompt_lens, levels, decode_prompt, max_tokens, next_turn, shared_system,
                                 retry))
    add_rooflines(ours, cfg, fmt, ceilings, kv_element_bytes(kv_cache_dtype))
    result = {"artifact": str(artifact), "weights": fmt, "kv_cache_dtype": kv_cache_dtype, "cache_ram_mib": cache_ram_mib,
              "speculative_config": speculative_config,
              "backend": "cuda" if gpu else "reference",
              "device": torch.cuda.get_device_name() if gpu else "cpu",
              "ceilings": {"copy_GBps": ceilings[0], "gemm_TFLOPs": ceilings[1]} if ceilings else None,
              "ninfer": ours}
    if peer == "transformers":
        theirs = run_peer(hf_conf, [r["prompt_tokens"] for r in ours["prefill"]], levels,
                          int(statistics.median(r["context"] for r in ours["decode"])) - max_tokens // 2, max_tokens)
        add_rooflines(theirs, cfg, "bf16", ceilings)
        result |= {"peer": theirs, "ratios": ratios(ours, theirs)}
    where = f"{result['device']}" + (f"; ceilings: copy {ceilings[0]:,.0f} GB/s, bf16 GEMM {ceilings[1]:,.0f} TFLOP/s"
                                     if ceilings else "; no GPU: no roofline fractions")
    spec = f", --speculative-config {speculative_config}" if speculative_config else ""
    click.echo(f"# ninfer-bench serve: {artifact.name} ({fmt}{spec}) on {where}")
    click.echo(table(result))
    if json_out:
        json_out.write_text(json.dumps(result, indent=1))
