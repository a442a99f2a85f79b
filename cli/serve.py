"""`ninfer-serve ARTIFACT`: the OpenAI/Anthropic-compatible HTTP server (`--demo`: the demo model).

One process: the engine runs on the scheduler's worker thread, the aiohttp loop serves HTTP. Stop it
with Ctrl-C (SIGINT) or SIGTERM; running requests end with an error, lanes are released.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

import click

from ninfer.runtime.kv_dtype import KV_CACHE_DTYPES
from ninfer.runtime.paths import ROOT

DEMO_DIR = ROOT / "build" / "demo"
DEMO_MODEL_ID = "ninfer-demo"


def demo_artifact() -> Path:
    """The demo artifact, built once and cached under build/demo/ (rebuilt when the demo builder changes)."""
    import hashlib

    from ninfer.cli import demo
    key = hashlib.sha256(Path(demo.__file__).read_bytes()).hexdigest()[:12]
    out = DEMO_DIR / f"ninfer-demo-{key}.ninfer"
    if out.exists():
        return out
    DEMO_DIR.mkdir(parents=True, exist_ok=True)
    click.echo(f"ninfer-serve --demo: building the demo artifact once (cached as {out})", err=True)
    demo.build_demo(out, log=lambda m: click.echo(f"  demo: {m}", err=True))
    for old in DEMO_DIR.glob("ninfer-demo-*.ninfer"):  # builds of an older demo builder
        if old != out:
            old.unlink(missing_ok=True)
    return out


def shout(text: str) -> None:
    bar = "!" * 100
    click.echo(f"{bar}\n{text}\n{bar}", err=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--demo", is_flag=True, help="Build (once, cached under build/) and serve the demo model: random "
              "weights, the real Qwen3.5 tokenizer; its output is noise.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes it).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0 picks a free port.")
@click.option("--api-key", envvar="NINFER_API_KEY", default=None,
              help="Require this key (Authorization: Bearer / x-api-key) on every route but /health. "
                   "[env NINFER_API_KEY]")
@click.option("--model-id", default=None, help="The model name clients use (default: the artifact's file name).")
@click.option("--max-concurrency", type=click.IntRange(1, 8), default=4, show_default=True,
              help="Sequence lanes decoding together (continuous batching).")
@click.option("--max-context", type=click.IntRange(16), default=8192, show_default=True,
              help="Tokens per sequence (prompt + output).")
@click.option("--max-pending-requests", type=click.IntRange(0), default=64, show_default=True,
              help="Requests that may wait for a lane; beyond that a 429 is returned.")
@click.option("--pending-timeout-ms", type=click.IntRange(0), default=300_000, show_default=True,
              help="How long a request may wait for a lane before a 503 (0: no limit).")
@click.option("--max-request-mib", type=click.FloatRange(0.001), default=64.0, show_default=True,
              help="Largest request body accepted (413 beyond).")
@click.option("--default-max-tokens", type=click.IntRange(1), default=8192, show_default=True,
              help="Output limit of a request that gives none (always capped by the context).")
@click.option("--request-log-jsonl", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Append one JSON line per request to this file.")
@click.option("--request-log-max-mib", type=click.FloatRange(0), default=64.0, show_default=True,
              help="Rotate the request log at this size (0: never).")
@click.option("--request-log-keep", type=click.IntRange(0), default=3, show_default=True,
              help="Rotated request logs to keep (FILE.1 ... FILE.N).")
@click.option("--tolerant-tool-calls", is_flag=True, help="Recover complete tool calls from malformed wrappers.")
@click.option("--chat-template", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="A jinja chat template file that replaces the artifact's.")
@click.option("--backend", type=click.Choice(["auto", "cuda", "reference"]), default="auto", show_default=True,
              help="Generated CUDA kernels, or the torch reference (CPU without a GPU); auto picks cuda on a GPU.")
@click.option("--prefill-chunk", type=click.IntRange(1), default=4096, show_default=True,
              help="Most prompt tokens per prefill step, while no other request decodes (every step reads all "
                   "the weights; GPU memory is planned for this many).")
@click.option("--prefill-chunk-decoding", type=click.IntRange(1), default=512, show_default=True,
              help="Prompt tokens per prefill step while other requests decode (long prompts interleave with "
                   "their decode steps); at most --prefill-chunk.")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="KV cache storage: auto = the model's dtype (bf16); fp8 = E4M3, half the bytes (twice the context "
                   "in the same memory, faster long-context decode; sm_89+).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="Keep each finished request's lane (its prompt's KV pages and a checkpoint of its GDN state at the "
                   "prompt's end) so that a prompt extending it, as a chat's next turn does, prefills only the rest. "
                   "The checkpoints take one more GDN state per lane of GPU memory.")
@click.option("--prefix-snapshots", type=click.IntRange(0, 64), default=2, show_default=True,
              help="With prefix caching: keep the system turn (system prompt and tools, from 256 tokens) of this many "
                   "recent prompts, so a new conversation that repeats it prefills only the rest (one more GDN state "
                   "each; their KV pages are given back when wanted). 0: none.")
@click.option("--cache-ram", "cache_ram_mib", type=click.IntRange(0), default=0, show_default=True,
              help="With prefix caching: host memory (MiB) for the lanes it gives back (their KV pages and GDN "
                   "states, copied out), so more conversations than lanes keep their prefixes; a prompt that one "
                   "serves best is copied back into a lane (llama.cpp's --cache-ram). 0: off.")
@click.option("--slot-save-path", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for llama.cpp-style POST /slots/{id}?action=save|restore|erase: a slot retained by prefix "
                   "caching (a finished prompt's KV pages and GDN states) to or from a file there, e.g. to keep a "
                   "long session across restarts. Off when not given.")
@click.option("--speculative-config", default=None, metavar="JSON",
              help='Speculative decoding, as vLLM takes it: drafts from the checkpoint\'s MTP layer, \'{"method": '
                   '"mtp", "num_speculative_tokens": 3}\', or from what followed the sequence\'s last tokens earlier '
                   'in it (prompt lookup: what code edits repeat), \'{"method": "ngram", "num_speculative_tokens": 3, '
                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; 1..8 drafts a round. Each request commits up '
                   'to that many + 1 tokens a step, exactly the tokens plain decoding gives (the same draws for '
                   'seeded sampling). Off when not given.')
def main(artifact, demo, host, port, api_key, model_id, max_concurrency, max_context, max_pending_requests,
         pending_timeout_ms, max_request_mib, default_max_tokens, request_log_jsonl, request_log_max_mib,
         request_log_keep, tolerant_tool_calls, chat_template, backend, prefill_chunk, prefill_chunk_decoding,
         kv_cache_dtype, enable_prefix_caching, prefix_snapshots, cache_ram_mib, slot_save_path, speculative_config):
    """Serve ARTIFACT (a .ninfer file) over OpenAI Chat Completions, OpenAI Responses and Anthropic Messages."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if demo == (artifact is not None):
        raise click.UsageError("give an ARTIFACT or --demo (not both)")
    if demo:
        shout("ninfer-serve --demo: THE DEMO MODEL HAS RANDOM WEIGHTS. EVERYTHING IT SAYS IS NOISE.\n"
              "It exercises the tokenizer, chat template, engine, scheduler and APIs end to end; "
              "serve a real artifact for real answers.")
        artifact = demo_artifact()
        model_id = model_id or DEMO_MODEL_ID
    elif not artifact.is_file():
        raise click.ClickException(f"{artifact}: no such file")
    model_id = model_id or artifact.stem
    try:
        asyncio.run(serve(artifact, host=host, port=port, api_key=api_key, model_id=model_id,
                          max_concurrency=max_concurrency, max_context=max_context,
                          max_pending=max_pending_requests, pending_timeout_ms=pending_timeout_ms,
                          max_request_mib=max_request_mib, default_max_tokens=default_max_tokens,
                          log_path=request_log_jsonl, log_max_mib=request_log_max_mib, log_keep=request_log_keep,
                          tolerant=tolerant_tool_calls, template=chat_template, backend=backend,
                          prefill_chunk=prefill_chunk, prefill_chunk_decoding=prefill_chunk_decoding,
                          kv_cache_dtype=kv_cache_dtype, prefix_caching=enable_prefix_caching,
                          prefix_snapshots=prefix_snapshots, cache_ram_mib=cache_ram_mib,
                          slot_save_path=slot_save_path, speculative_config=speculative_config, demo=demo))
    except KeyboardInterrupt:
        pass


def build_state(artifact, *, model_id, max_concurrency, max_context, max_pending, pending_timeout_ms,
                max_request_mib=64.0, default_max_tokens=8192, log_path=None, log_max_mib=64.0, log_keep=3,
                tolerant=False, template=None, backend="auto", prefill_chunk=4096, prefill_chunk_decoding=512,
                kv_cache_dtype="auto", prefix_caching=True, prefix_snapshots=2, cache_ram_mib=0, slot_save_path=None,
                speculative_config=None, api_key=None, engine=None):
    """Engine, scheduler and server state (also what tests start in-process)."""
    from ninfer.runtime.artifact import ArtifactError
    from ninfer.runtime.chat import ChatError
    from ninfer.runtime.engine import Engine, EngineError
    from ninfer.runtime.scheduler import Scheduler
    from ninfer.runtime.speculative import SpeculativeConfig
    from ninfer.runtime.tokenizer import TokenizerError
    from ninfer.server.generation import ModelText
    from ninfer.server.metrics import Metrics
    from ninfer.server.request_log import NullLog, RequestLog
    from ninfer.server.response_store import ResponseStore
    from ninfer.server.state import AppState, ServerConfig
    try:
        if engine is None:
            spec = SpeculativeConfig.parse(speculative_config) if speculative_config is not None else None
            engine = Engine(artifact, backend=backend, max_context=max_context, max_seqs=max_concurrency,
                            prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype, prefix_caching=prefix_caching,
                            prefix_snapshots=prefix_snapshots if prefix_caching else 0,
                            cache_ram_bytes=cache_ram_mib << 20, speculative=spec)
        text = ModelText(engine.art, template)
    except (ArtifactError, EngineError, TokenizerError, ChatError, OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    sched = Scheduler(engine, max_pending=max_pending, pending_timeout_ms=pending_timeout_ms,
                      prefill_chunk_decoding=prefill_chunk_decoding)
    if slot_save_path is not None:
        slot_save_path = Path(slot_save_path)
        try:
            slot_save_path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise click.ClickException(f"--slot-save-path {slot_save_path}: {e}") from None
    cfg = ServerConfig(model_id=model_id, api_key=api_key, max_request_mib=max_request_mib,
                       default_max_tokens=default_max_tokens, tolerant_tool_calls=tolerant,
                       slot_save_path=slot_save_path)
    log = RequestLog(log_path, log_max_mib, log_keep) if log_path else NullLog()
    return AppState(config=cfg, text=text, scheduler=sched, metrics=Metrics(sched), request_log=log,
                    store=ResponseStore()), engine


async def serve(artifact, *, host, port, demo=False, api_key=None, **options) -> None:
    from ninfer.server.app import start
    t0 = time.perf_counter()
    state, engine = build_state(artifact, api_key=api_key, **options)
    runner, bound = await start(state, host, port)
    state.request_log.write("server_start", artifact=str(artifact), model_id=state.model_id, host=host, port=bound,
                            backend=engine.be.name, max_concurrency=engine.cache.max_seqs,
                            max_context=state.max_context, kv_pages=engine.cache.num_pages,
                            kv_cache_dtype=engine.kv_cache_dtype, prefix_caching=engine.cache.prefix_caching,
                            speculative=engine.spec.config.__dict__ if engine.spec is not None else None,
                            prefill_chunk=engine.prefill_chunk,
                            prefill_chunk_decoding=state.scheduler.prefill_chunk_decoding, auth=bool(api_key), demo=demo,
                            argv=_redacted(sys.argv))
    click.echo(f"ninfer-serve: {state.model_id} on http://{host}:{bound}  (backend {engine.be.name}, "
               f"{engine.cache.max_seqs} lanes, context {state.max_context}, {engine.cache.num_pages} KV pages "
               f"(kv cache {engine.kv_cache_dtype}, prefix caching {'on' if engine.cache.prefix_caching else 'off'}"
               + (f", speculative decoding: {engine.spec.config.method}, {engine.spec.k} drafts" if engine.spec else "")
               + "), "
               f"ready in {time.perf_counter() - t0:.1f} s)", err=True)
    click.echo(f"  OpenAI:    http://{host}:{bound}/v1  (chat/completions, responses, models)\n"
               f"  Anthropic: http://{host}:{bound}  (v1/messages, v1/messages/count_tokens)\n"
               f"  health, metrics, slots: /health /metrics /slots" + ("" if api_key else "\n  no --api-key: "
               "every client on this address is let in"), err=True)
    if demo:
        shout("REMINDER: this is the demo model. Its output is noise (random weights).")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        click.echo("ninfer-serve: stopping", err=True)
        state.scheduler.close()
        await runner.cleanup()
        state.request_log.close()
        engine.close()


def _redacted(argv: list[str]) -> list[str]:
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(a)
    return out


if __name__ == "__main__":
    main()
