"""Request plumbing the three protocol adapters share: body reading, the model check, running one
generation as JSON or as a stream, llama.cpp-style timings, and the request log / metrics record."""
from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from .errors import ApiError
from .generation import Finished, FirstToken, Generation, GenRequest, KeepAlive
from .sse import ClientGone, SSEWriter
from .state import state_of
from .validate import parse_json

log = logging.getLogger("ninfer.server")


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object, read up to --max-request-mib (413 beyond, chunked bodies included)."""
    mib = state_of(request).config.max_request_mib
    limit = int(mib * (1 << 20))
    body = bytearray()
    while True:
        chunk = await request.content.read(1 << 16)
        if not chunk:
            break
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {mib:g} MiB (--max-request-mib)",
                           code="request_too_large")
    return parse_json(bytes(body))


def check_model(state, model: str | None) -> None:
    if model != state.model_id:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{state.model_id}'",
                       code="model_not_found", param="model")


def timings(done) -> dict:
    """llama.cpp's per-request timings block."""
    pn, dn = done.prompt_tokens - done.cached_tokens, max(done.completion_tokens - 1, 0)
    pms, dms = done.prefill_s * 1000, done.decode_s * 1000
    return {"cache_n": done.cached_tokens, "prompt_n": pn, "prompt_ms": pms,
            "prompt_per_token_ms": pms / pn if pn else 0.0, "prompt_per_second": pn * 1000 / pms if pms else 0.0,
            "predicted_n": done.completion_tokens, "predicted_ms": dms,
            "predicted_per_token_ms": dms / dn if dn else 0.0, "predicted_per_second": dn * 1000 / dms if dms else 0.0,
            "queue_ms": done.queue_s * 1000, "ttft_ms": done.ttft_s * 1000}


class Streamer:
    """What a protocol writes around the semantic events of one streamed generation."""

    def __init__(self, writer: SSEWriter):
        self.w = writer

    async def start(self) -> None: ...
    async def event(self, ev) -> None: ...
    async def finish(self, fin: Finished) -> None: ...
    async def error(self, err: ApiError) -> None: ...

    async def keepalive(self) -> None:
        await self.w.comment()


async def run(request: web.Request, state, gr: GenRequest, *, stream: bool, make_streamer=None,
              to_json=None) -> web.StreamResponse:
    """Prepare, submit and run one generation; returns the JSON response or the finished stream.
    The request's lane is released however this ends (done, error, client gone, handler cancelled)."""
    gen = Generation(state, gr)
    await gen.prepare()
    gen.submit()
    outcome, fin, writer = "error", None, None
    try:
        if not stream:
            async for ev in gen.events():
                if isinstance(ev, Finished):
                    fin = ev
            outcome = "ok"
            return web.json_response(to_json(gen, fin), dumps=_dumps)
        writer = SSEWriter(request)
        streamer = make_streamer(writer, gen)
        try:
            async for ev in gen.events(keepalive=True):
                if not writer.started:
                    await streamer.start()
                if isinstance(ev, FirstToken):
                    continue
                if isinstance(ev, KeepAlive):
                    await streamer.keepalive()
                elif isinstance(ev, Finished):
                    fin = ev
                    await streamer.finish(ev)
                else:
                    await streamer.event(ev)
            outcome = "ok"
        except ApiError as e:
            if not writer.started:
                raise
            await streamer.error(e)  # in-band: the status line has gone already
            outcome = "error"
        except (ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug after the stream started: say so in-band, keep serving
            if not writer.started:
                raise
            log.exception("stream failed")
            await streamer.error(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))
            outcome = "error"
        await writer.close()
        return writer.resp
    except ClientGone:
        outcome = "cancelled"
        return writer.resp if writer.resp is not None else web.Response(status=499)  # nobody reads it
    except asyncio.CancelledError:  # the client went away (aiohttp cancels the handler)
        outcome = "cancelled"
        raise
    finally:
        gen.cancel()
        record(state, gr, gen, fin, outcome, stream)


def record(state, gr: GenRequest, gen: Generation, fin: Finished | None, outcome: str, stream: bool) -> None:
    base = dict(id=gr.request_id, protocol=gr.protocol, stream=stream, thinking=gr.thinking,
                tools=len(gr.tools or []), max_tokens=gr.max_tokens, prompt_tokens=len(gen.prompt_ids))
    if fin is None:
        state.metrics.outcome(gr.protocol, outcome)
        state.request_log.write("request_cancelled" if outcome == "cancelled" else "request_error", **base)
        return
    d = fin.done
    state.metrics.finished(gr.protocol, d, outcome)
    state.request_log.write("request_done", **base, outcome=outcome, finish_reason=fin.finish_reason,
                            cached_tokens=d.cached_tokens, completion_tokens=d.completion_tokens,
                            reasoning_tokens=fin.reasoning_tokens, tool_calls=len(fin.calls),
                            queue_s=d.queue_s, prefill_s=d.prefill_s, decode_s=d.decode_s, ttft_s=d.ttft_s,
                            total_s=d.total_s)


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)
