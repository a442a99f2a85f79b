"""The aiohttp application: shared state, routes, and the middleware that guards every request.

The event loop never touches the engine: generation goes through the scheduler's worker thread, and
/slots and /metrics read the snapshot and counters it publishes.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from . import anthropic_messages, openai_chat, openai_completions, openai_responses, slot_files
from .errors import ApiError, protocol_of
from .metrics import CONTENT_TYPE
from .state import STATE, AppState, state_of

log = logging.getLogger("ninfer.server")
NO_AUTH = ("/health",)


# -- middleware ----------------------------------------------------------------------------------
def _error_response(err: ApiError, protocol: str) -> web.Response:
    return web.json_response(err.body(protocol), status=err.status_for(protocol), headers=err.headers)


def _authorized(request: web.Request, key: str) -> bool:
    """Either header may carry the key: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic)."""
    given = [request.headers.get("x-api-key", "")]
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        given.append(auth[7:].strip())
    want = key.encode("utf-8")
    return any(g and hmac.compare_digest(g.encode("utf-8", "replace"), want) for g in given)


@web.middleware
async def guard(request: web.Request, handler):
    state = state_of(request)
    protocol = protocol_of(request.path)
    if request.method == "OPTIONS":  # preflight / capability probes: nothing to authorize
        return web.Response(status=204, headers={"Allow": "GET, POST, DELETE, OPTIONS"})
    try:
        if state.config.api_key and request.path not in NO_AUTH and not _authorized(request, state.config.api_key):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           code="invalid_api_key")
        limit = int(state.config.max_request_mib * (1 << 20))
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"the request body has {request.content_length} bytes; the limit is {limit} "
                                f"(--max-request-mib {state.config.max_request_mib:g})", code="request_too_large")
        return await handler(request)
    except ApiError as e:
        state.metrics.error(e.status_for(protocol))
        if e.status >= 500:
            state.request_log.write("request_error", path=request.path, status=e.status, code=e.code,
                                    message=e.message)
        return _error_response(e, protocol)
    except web.HTTPException as e:
        if e.status == 413:
            err = ApiError(413, f"the request body is over the limit of {state.config.max_request_mib:g} MiB "
                                "(--max-request-mib)", code="request_too_large")
        elif e.status == 404:
            err = ApiError(404, f"no route for {request.method} {request.path}", code="not_found")
        elif e.status == 405:
            err = ApiError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed")
        elif e.status < 400:
            raise
        else:
            err = ApiError(e.status, e.reason or "error")
        state.metrics.error(err.status_for(protocol))
        return _error_response(err, protocol)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:  # a bug: say so in the protocol's shape, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        err = ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
        state.metrics.error(500)
        state.request_log.write("request_error", path=request.path, status=500, code="internal_error",
                                message=str(e))
        return _error_response(err, protocol)


# -- small routes --------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _model_obj(state: AppState) -> dict:
    # one object both SDKs read: OpenAI's (id, object, created, owned_by) and Anthropic's
    # (type, id, display_name, created_at), plus the context window clients size prompts by
    return {"id": state.model_id, "object": "model", "type": "model", "created": state.created,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.created)),
            "owned_by": "ninfer", "display_name": state.model_id, "context_window": state.max_context,
            "max_model_len": state.max_context, "max_output_tokens": state.max_context}


async def models(request: web.Request) -> web.Response:
    state = state_of(request)
    m = _model_obj(state)
    return web.json_response({"object": "list", "data": [m], "has_more": False, "first_id": m["id"],
                              "last_id": m["id"]})


async def model(request: web.Request) -> web.Response:
    state = state_of(request)
    if request.match_info["model"] != state.model_id:
        raise ApiError(404, f"the model '{request.match_info['model']}' does not exist; this server serves "
                            f"'{state.model_id}'", code="model_not_found", param="model")
    return web.json_response(_model_obj(state))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=state_of(request).metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def slots(request: web.Request) -> web.Response:
    """llama.cpp-shaped: one entry per lane, with what it holds."""
    state = state_of(request)
    snap = state.scheduler.snapshot()
    by_slot = {lane["slot"]: lane for lane in snap["lanes"]}
    out = []
    for i in range(snap["max_seqs"]):
        lane = by_slot.get(i)
        busy = lane is not None and lane["state"] != "retained"   # a retained lane holds a finished prompt
        entry = {"id": i, "n_ctx": state.max_context, "is_processing": busy,
                 "state": lane["state"] if lane else "idle", "id_task": lane.get("id_task") if lane else None,
                 "protocol": lane.get("protocol") if lane else None,
                 "n_prompt_tokens": lane["n_prompt_tokens"] if lane else 0,
                 "n_prefilled": lane["n_prefilled"] if lane else 0, "n_decoded": lane["n_decoded"] if lane else 0,
                 "n_predict": lane["max_new"] if lane else 0, "kv_pages": lane["kv_pages"] if lane else 0,
                 "n_cached_tokens": lane["n_cached_tokens"] if lane else 0}
        out.append(entry)
    return web.json_response(out, headers={"X-Ninfer-Kv-Pages-Used": str(snap["kv_pages_used"]),
                                           "X-Ninfer-Kv-Pages-Total": str(snap["kv_pages_total"]),
                                           "X-Ninfer-Pending": str(snap["pending"])})


def build_app(state: AppState) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=int(state.config.max_request_mib * (1 << 20)))
    app[STATE] = state
    r = app.router
    r.add_get("/health", health)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model:.+}", model)
    r.add_get("/metrics", metrics)
    r.add_get("/slots", slots)
    r.add_post("/slots/{id}", slot_files.slot_action)
    r.add_post("/v1/chat/completions", openai_chat.handle)
    r.add_post("/v1/completions", openai_completions.handle)
    r.add_post("/tokenize", openai_completions.tokenize)
    r.add_post("/detokenize", openai_completions.detokenize)
    r.add_post("/v1/responses", openai_responses.create)
    r.add_get("/v1/responses/{id}", openai_responses.retrieve)
    r.add_delete("/v1/responses/{id}", openai_responses.delete)
    r.add_get("/v1/responses/{id}/input_items", openai_responses.input_items)
    r.add_post("/v1/messages", anthropic_messages.handle)
    r.add_post("/v1/messages/count_tokens", anthropic_messages.count_tokens)
    return app


async def start(state: AppState, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve on host:port (0 picks a free port); returns the runner and the bound port."""
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]
