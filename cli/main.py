"""`ninfer ARTIFACT (--prompt TEXT | --messages FILE)`: one-shot generation.

The answer goes to stdout as it is generated; reasoning (<think>...</think>), timings and memory go
to stderr. `--json` prints one JSON object on stdout instead. Every input is checked before the
weights are loaded, so bad input fails fast with "Error: ..." and exit status 1 (2 for usage
errors), and nothing stays allocated.

Sampling defaults come from the artifact's generation_config.json (do_sample, temperature, top_k,
top_p, min_p), else greedy; flags override. Stop token ids default to generation_config's
eos_token_id plus <|im_end|> when the tokenizer has it.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import click

from ninfer.runtime.artifact import ArtifactError, open_artifact
from ninfer.runtime.chat import (ChatError, load_template, normalize_messages, prompt_opens_reasoning,
                                 render, ReasoningSplitter)
from ninfer.runtime.kv_dtype import KV_CACHE_DTYPES
from ninfer.runtime.tokenizer import StopStrings, Tokenizer, TokenizerError

MiB = 1 << 20


def fail(message: str):
    raise click.ClickException(message)


# -- inputs --------------------------------------------------------------------------------------
def read_messages(path: Path) -> tuple[list, list | None]:
    """A JSON array of messages, or an object {messages, tools}."""
    try:
        doc = json.loads(path.read_text("utf-8"))
    except OSError as e:
        fail(f"messages file {path}: cannot read it: {e.strerror or e}")
    except UnicodeDecodeError as e:
        fail(f"messages file {path}: not UTF-8 text: {e}")
    except ValueError as e:
        fail(f"messages file {path}: not valid JSON: {e}")
    if isinstance(doc, dict):
        unknown = set(doc) - {"messages", "tools"}
        if "messages" not in doc or unknown:
            fail(f"messages file {path}: expected a JSON array of messages or an object with 'messages' "
                 f"(and optionally 'tools')" + (f"; unexpected keys: {sorted(unknown)}" if unknown else ""))
        msgs, tools = doc["messages"], doc.get("tools")
    elif isinstance(doc, list):
        msgs, tools = doc, None
    else:
        fail(f"messages file {path}: expected a JSON array of messages or an object with 'messages', "
             f"got {type(doc).__name__}")
    try:
        normalize_messages(msgs)
    except ChatError as e:
        fail(f"messages file {path}: {e}")
    return msgs, tools


def resource_json(art, name: str) -> dict:
    if name not in art.resources:
        return {}
    try:
        doc = json.loads(art.resource(name))
    except ValueError as e:
        fail(f"{art.path}: resource {name} is not valid JSON: {e}")
    return doc if isinstance(doc, dict) else {}


def sampling_defaults(gen: dict) -> dict:
    """temperature/top_k/top_p/min_p from generation_config.json (greedy when absent or do_sample false)."""
    if not gen or gen.get("do_sample") is False or "temperature" not in gen:
        return {"temperature": 0.0}
    out = {"temperature": float(gen["temperature"])}
    for key, cast in (("top_k", int), ("top_p", float), ("min_p", float)):
        if gen.get(key) is not None:
            out[key] = cast(gen[key])
    return out


def default_stop_ids(gen: dict, tok: Tokenizer | None) -> list[int]:
    eos = gen.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
    im_end = tok.token_id("<|im_end|>") if tok is not None else None
    if im_end is not None and im_end not in ids:
        ids.append(im_end)
    return ids


# -- output --------------------------------------------------------------------------------------
class Output:
    """Streams the generated text: stop strings cut it, reasoning goes to stderr, the answer to stdout
    (or nothing is printed in JSON mode: everything is collected)."""

    def __init__(self, tok: Tokenizer, stop_ids, stops, split: bool, in_reasoning: bool, quiet: bool):
        self.decoder = tok.stream(skip_ids=stop_ids)
        self.stops = StopStrings(stops)
        self.splitter = ReasoningSplitter(in_reasoning) if split else None
        self.quiet = quiet
        self.text, self.reasoning, self.content = "", "", ""
        self._in_reasoning_out = False

    def token(self, token: int) -> bool:
        """Take one generated id; True when a stop string ended the generation."""
        piece, hit = self.stops.feed(self.decoder.push(token))
        self._emit(piece)
        return hit

    def finish(self) -> None:
        if self.stops.hit is None:
            piece, _ = self.stops.feed(self.decoder.finish())
            self._emit(piece + self.stops.finish())
        if self.splitter is not None:
            self._route(self.splitter.finish())
        if self._in_reasoning_out:
            click.echo("", err=True)
        if not self.quiet and self.content and not self.content.endswith("\n"):
            click.echo("")

    def _emit(self, piece: str) -> None:
        if not piece:
            return
        self.text += piece
        if self.splitter is None:
            self._route([("content", piece)])
        else:
            self._route(self.splitter.feed(piece))

    def _route(self, parts) -> None:
        for channel, text in parts:
            if channel == "reasoning":
                self.reasoning += text
                if not self.quiet:
                    if not self._in_reasoning_out:
                        click.echo("[reasoning] ", err=True, nl=False)
                        self._in_reasoning_out = True
                    click.echo(text, err=True, nl=False)
            else:
                self.content += text
                if not self.quiet:
                    if self._in_reasoning_out:
                        click.echo("\n[/reasoning]", err=True)
                        self._in_reasoning_out = False
                    click.echo(text, nl=False)
                    sys.stdout.flush()


def _engine_class():
    """Engine with a per-token hook (stop strings, streaming). Engine has no public callback yet, so
    the hook wraps its per-token bookkeeping method."""
    from ninfer.runtime.engine import Engine

    class StreamingEngine(Engine):
        on_token = None

        def _accept(self, seq, token):
            super()._accept(seq, token)
            if self.on_token is not None and self.on_token(seq, token):
                seq.finish_reason = "stop"
    return StreamingEngine


def memory_report(engine) -> dict:
    from ninfer.runtime.weights import weights_nbytes
    weights = weights_nbytes(engine.weights)
    out = {"weights_bytes": weights, "cache_bytes": engine.cache.bytes(),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if engine.device.type == "cuda":
        import torch
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(engine.device)
    return out


# -- the command ---------------------------------------------------------------------------------
@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--prompt", help="The user message (or, with --raw-output, the whole prompt text).")
@click.option("--messages", "messages_file", type=click.Path(dir_okay=False, path_type=Path),
              help="JSON file: an array of chat messages, or {\"messages\": [...], \"tools\": [...]}.")
@click.option("--max-new", type=click.IntRange(0), default=128, show_default=True, help="Most tokens to generate.")
@click.option("--max-context", type=click.IntRange(1), default=2048, show_default=True,
              help="Context size planned for the sequence (prompt + generated tokens).")
@click.option("--prefill-chunk", type=click.IntRange(1), default=4096, show_default=True,
              help="Most prompt tokens per prefill step (at most --max-context).")
@click.option("--greedy", is_flag=True, help="Exact argmax decoding (forces temperature 0).")
@click.option("--temperature", type=float, help="Default: generation_config.json's, else 0 (greedy).")
@click.option("--top-k", type=int)
@click.option("--top-p", type=float)
@click.option("--min-p", type=float)
@click.option("--presence-penalty", type=float)
@click.option("--frequency-penalty", type=float)
@click.option("--seed", type=int, help="Sampling seed (default: random).")
@click.option("--stop", "stops", multiple=True, metavar="TEXT",
              help="Stop when the generated text contains TEXT; the text is cut before it. Repeatable.")
@click.option("--stop-token-id", "stop_token_ids", multiple=True, type=int,
              help="Stop on this token id (repeatable; replaces the default eos ids + <|im_end|>).")
@click.option("--no-thinking", is_flag=True, help="Render the prompt with thinking off (enable_thinking=false).")
@click.option("--raw-output", is_flag=True, help="No chat template: the --prompt text is tokenized as is, "
              "and the output is printed as generated (no reasoning split).")
@click.option("--chat-template", "template_file", type=click.Path(dir_okay=False, path_type=Path),
              help="A jinja chat template to use instead of the artifact's.")
@click.option("--backend", type=click.Choice(["auto", "cuda", "reference"]), default="auto", show_default=True,
              help="auto: cuda when a GPU is present, else the reference (torch, CPU) backend.")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="KV cache storage: auto = the model's dtype; fp8 = E4M3 codes (half the bytes; sm_89+ on a GPU).")
@click.option("--speculative-config", default=None, metavar="JSON",
              help='Speculative decoding (vLLM\'s form): \'{"method": "mtp", "num_speculative_tokens": 3}\' (the '
                   'checkpoint\'s MTP layer drafts) or \'{"method": "ngram", "num_speculative_tokens": 3}\' (prompt '
                   'lookup): the same tokens as without it (the same draws with --seed), up to that many + 1 a step.')
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ids, text, finish reason, timings).")
def main(artifact, prompt, messages_file, max_new, max_context, prefill_chunk, greedy, temperature, top_k, top_p,
         min_p, presence_penalty, frequency_penalty, seed, stops, stop_token_ids, no_thinking, raw_output,
         template_file, backend, kv_cache_dtype, speculative_config, as_json):
    """Generate a reply from the model in ARTIFACT (.ninfer)."""
    if (prompt is None) == (messages_file is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --messages FILE")
    if raw_output and messages_file is not None:
        raise click.UsageError("--raw-output takes --prompt (raw text), not --messages")
    if raw_output and template_file is not None:
        raise click.UsageError("--raw-output uses no chat template; drop --chat-template")
    if prompt is not None and not prompt.strip():
        fail("empty prompt: --prompt needs some text")
    messages, tools = (read_messages(messages_file) if messages_file is not None
                       else ([{"role": "user", "content": prompt}], None))
    if not artifact.exists():
        fail(f"{artifact}: no such file")

    # Everything that can be checked without the weights: container, family, tokenizer, template, length.
    from ninfer.runtime.models.config import ConfigError, parse_config   # (imports torch: after the cheap checks)
    try:
        art = open_artifact(artifact)
    except (ArtifactError, OSError) as e:
        fail(str(e))
    try:
        try:
            raw_cfg = json.loads(art.resource("config.json"))
            parse_config(raw_cfg)
        except KeyError:
            fail(f"{artifact}: the artifact carries no config.json")
        except (ConfigError, ValueError) as e:
            fail(f"{artifact}: cannot serve this model: {e}")
        gen = resource_json(art, "generation_config.json")
        tok = Tokenizer.from_artifact(art)
        if raw_output:
            text = prompt
        else:
            template = load_template(art, template_file)
            text = render(messages, tools=tools, enable_thinking=not no_thinking, add_generation_prompt=True,
                          template=template)
    except (TokenizerError, ChatError) as e:
        fail(str(e))
    finally:
        art.close()

    from ninfer.cli.demo import DEMO_MARKER, NOISE_WARNING
    if isinstance(raw_cfg, dict) and DEMO_MARKER in raw_cfg:
        click.echo(f"WARNING: {NOISE_WARNING}", err=True)

    ids = tok.encode(text)
    if not ids:
        fail("empty prompt: it tokenizes to no tokens")
    need = len(ids) + (1 if max_new > 0 else 0)
    if need > max_context:
        fail(f"the prompt is {len(ids)} tokens; with --max-context {max_context} at most {max_context - 1} "
             f"prompt tokens fit (one more is needed to generate). Raise --max-context or shorten the prompt.")

    from ninfer.runtime.engine import SamplingParams
    params = sampling_defaults(gen)
    for key, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                       ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None:
            params[key] = value
    if greedy:
        params["temperature"] = 0.0
    try:
        sampling = SamplingParams(seed=seed, **params).check()
    except ValueError as e:
        fail(str(e))
    stop_ids = list(stop_token_ids) if stop_token_ids else default_stop_ids(gen, tok)
    spec = None
    if speculative_config is not None:
        from ninfer.runtime.speculative import SpeculativeConfig, SpeculativeConfigError
        try:
            spec = SpeculativeConfig.parse(speculative_config)
        except SpeculativeConfigError as e:
            fail(str(e))

    # The weights: only now.
    from ninfer.runtime.cache import CapacityError
    from ninfer.runtime.engine import EngineError
    from ninfer.runtime.speculative import SpeculativeConfigError
    engine = None
    try:
        t_load = time.perf_counter()
        try:
            engine = _engine_class()(artifact, backend=backend, max_context=max_context, max_seqs=1,
                                     prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype, speculative=spec)
        except (ArtifactError, ConfigError, EngineError, SpeculativeConfigError, OSError) as e:
            fail(str(e))
        except (RuntimeError, ValueError) as e:   # e.g. --backend cuda without a usable GPU
            fail(f"cannot start the {backend} backend: {e}")
        load_s = time.perf_counter() - t_load
        out = Output(tok, stop_ids, stops, split=not raw_output,
                     in_reasoning=not raw_output and prompt_opens_reasoning(text), quiet=as_json)
        engine.on_token = lambda seq, token: False if token in seq.stop_ids else out.token(token)
        try:
            seq = engine.generate([ids], max_new=max_new, stop_ids=stop_ids, sampling=sampling)[0]
        except (EngineError, CapacityError) as e:
            fail(str(e))
        out.finish()
        report(seq, out, engine, load_s, as_json)
    finally:
        if engine is not None:
            engine.close()


def report(seq, out: Output, engine, load_s: float, as_json: bool) -> None:
    n_prompt, n_gen = len(seq.prompt), len(seq.generated)
    decode_steps = max(n_gen - 1, 0)         # the first token comes out of the prefill
    timings = {"load_s": load_s, "prefill_s": seq.prefill_s, "decode_s": seq.decode_s, "ttft_s": seq.ttft_s,
               "prompt_tokens": n_prompt, "generated_tokens": n_gen,
               "prefill_tok_s": n_prompt / seq.prefill_s if seq.prefill_s > 0 else None,
               "decode_tok_s": decode_steps / seq.decode_s if seq.decode_s > 0 else None}
    mem = memory_report(engine)
    spec = dict(engine.spec.stats, accepted_per_pos=engine.spec.accepted_per_pos) if engine.spec is not None else None
    if as_json:
        click.echo(json.dumps({"prompt_token_ids": seq.prompt, "token_ids": seq.generated, "text": out.text,
                               "reasoning": out.reasoning, "content": out.content,
                               "finish_reason": seq.finish_reason, "stop": out.stops.hit,
                               "timings": timings, "memory": mem, "backend": engine.be.name, "speculative": spec},
                              ensure_ascii=False))
        return
    rate = lambda v: f"{v:.1f} tok/s" if v is not None else "n/a"  # noqa: E731
    click.echo(f"[{seq.finish_reason}{' on ' + repr(out.stops.hit) if out.stops.hit else ''}] "
               f"prompt {n_prompt} tokens, prefill {seq.prefill_s:.3f} s ({rate(timings['prefill_tok_s'])}), "
               f"TTFT {seq.ttft_s:.3f} s; generated {n_gen} tokens, decode {seq.decode_s:.3f} s "
               f"({rate(timings['decode_tok_s'])}); load {load_s:.2f} s; backend {engine.be.name}", err=True)
    line = (f"memory: weights {mem['weights_bytes'] / MiB:.1f} MiB, KV + GDN state {mem['cache_bytes'] / MiB:.1f} MiB, "
            f"peak RSS {mem['peak_rss_bytes'] / MiB:.0f} MiB")
    if "gpu_peak_bytes" in mem:
        line += f", GPU peak {mem['gpu_peak_bytes'] / MiB:.0f} MiB"
    click.echo(line, err=True)
    if spec is not None:
        accepted = spec["num_accepted_tokens"] / spec["num_draft_tokens"] if spec["num_draft_tokens"] else 0.0
        click.echo(f"speculative ({engine.spec.config.method}): {spec['num_drafts']} rounds with drafts, "
                   f"{spec['num_accepted_tokens']} of {spec['num_draft_tokens']} drafts accepted "
                   f"({100 * accepted:.0f} %), by position {spec['accepted_per_pos']}", err=True)


if __name__ == "__main__":
    main()
