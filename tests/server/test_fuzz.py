"""Malformed requests (bad JSON, wrong types, missing fields, huge bodies, bad tool schemas, unknown
models, bad keys, wrong routes): each gets its protocol's typed 4xx envelope, the server stays up, and
the lanes and KV pages are back at their baseline afterwards."""
import asyncio
import json
import random

import aiohttp

CHAT, RESP, MSG, COUNT = "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"
M = "ninfer-demo"
GOOD = {
    CHAT: {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    RESP: {"model": M, "input": "hi", "max_output_tokens": 2},
    MSG: {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    COUNT: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}


def with_(path, **kw):
    d = json.loads(json.dumps(GOOD[path]))
    for k, v in kw.items():
        if v is ...:
            d.pop(k, None)
        else:
            d[k] = v
    return path, json.dumps(d).encode()


def raw_bodies():
    deep = b"[" * 5000 + b"]" * 5000
    return [b"", b"{", b"nul", b"[1, 2]", b'"text"', b"123", b'{"model": NaN}', b"\xff\xfe{}", deep,
            b'{"a": 1', b"{'model': 'x'}", b'{"model": "x",}', b"\x00\x01", b"{" + b'"k": 1, ' * 3 + b"}"]


def cases():
    out = []
    for path in (CHAT, RESP, MSG, COUNT):
        out += [(path, b) for b in raw_bodies()]
        out.append(with_(path, model=...))
        out.append(with_(path, model=123))
        out.append(with_(path, model=["x"]))
    tools_bad = [
        "x", [1], [{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
        [{"type": "function", "function": {"name": "a b"}}], [{"type": "function", "function": {"name": "x" * 300}}],
        [{"type": "function", "function": {"name": "f", "parameters": "schema"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": [1]}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}],
        [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
        [{"type": "web_search"}], [{"type": "function", "function": {"name": "<f>"}}],
    ]
    for t in tools_bad:
        out.append(with_(CHAT, tools=t))
    for choice in ("sometimes", 5, {"type": "function", "function": {"name": "nope"}}, "required", []):
        out.append(with_(CHAT, tool_choice=choice))
    for k, v in [("messages", ...), ("messages", "hi"), ("messages", []), ("messages", [1]), ("messages", [{}]),
                 ("messages", [{"role": 5, "content": "x"}]), ("messages", [{"role": "robot", "content": "x"}]),
                 ("messages", [{"role": "user"}]), ("messages", [{"role": "user", "content": 5}]),
                 ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                 ("messages", [{"role": "user", "content": [{"type": "text"}]}]),
                 ("messages", [{"role": "user", "content": [5]}]),
                 ("messages", [{"role": "function", "content": "x", "name": "f"}]),
                 ("messages", [{"role": "assistant", "content": "",
                                "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]),
                 ("messages", [{"role": "assistant", "content": "", "tool_calls": "x"}]),
                 ("messages", [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                               "arguments": "[1]"}}]}]),
                 ("messages", [{"role": "tool", "content": "x", "tool_call_id": 5}]),
                 ("messages", [{"role": "user", "content": "x " * 3000}]),
                 ("max_tokens", "x"), ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True),
                 ("max_completion_tokens", "2"), ("temperature", "hot"), ("temperature", 5), ("temperature", -1),
                 ("top_p", 2), ("top_p", "x"), ("top_k", -5), ("min_p", 3), ("presence_penalty", 9),
                 ("frequency_penalty", "x"), ("seed", "x"), ("seed", 1.5), ("stream", "yes"), ("stream", 1),
                 ("stop", 5), ("stop", [1]), ("stop", ["a"] * 40), ("n", 2), ("n", "1"), ("logprobs", True),
                 ("response_format", {"type": "json_object"}), ("response_format", "json"),
                 ("functions", [{"name": "f"}]), ("function_call", "auto"), ("stream_options", "x"),
                 ("enable_thinking", "yes"), ("chat_template_kwargs", 5), ("reasoning_effort", "ultra"),
                 ("reasoning_effort", 3), ("parallel_tool_calls", "no"), ("model", "gpt-4o")]:
        out.append(with_(CHAT, **{k: v}))
    for k, v in [("input", ...), ("input", 5), ("input", [5]), ("input", [{"type": "weird"}]),
                 ("input", [{"role": "robot", "content": "x"}]), ("input", [{"role": "user", "content": 5}]),
                 ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                 ("input", [{"type": "function_call", "name": "f", "arguments": "{}"}]),
                 ("input", [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]),
                 ("input", [{"type": "function_call_output", "output": "x"}]),
                 ("input", [{"type": "item_reference", "id": "msg_missing"}]),
                 ("input", [{"type": "reasoning", "summary": "x"}]), ("previous_response_id", "resp_missing"),
                 ("previous_response_id", 5), ("max_output_tokens", 0), ("max_output_tokens", "x"),
                 ("temperature", 9), ("tools", [{"type": "file_search"}]), ("tools", [{"type": "function"}]),
                 ("tools", [{"type": "function", "name": "f", "parameters": 3}]), ("tool_choice", "x"),
                 ("tool_choice", {"type": "function", "name": "nope"}), ("reasoning", {"effort": "huge"}),
                 ("reasoning", "high"), ("text", {"format": {"type": "json_schema"}}), ("background", True),
                 ("conversation", "conv_1"), ("instructions", 5), ("store", "yes"), ("model", "gpt-5")]:
        out.append(with_(RESP, **{k: v}))
    for path in (MSG, COUNT):
        for k, v in [("messages", ...), ("messages", []), ("messages", [{"role": "system", "content": "x"}]),
                     ("messages", [{"role": "user", "content": 5}]),
                     ("messages", [{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                     ("messages", [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                 "input": {}}]}]),
                     ("messages", [{"role": "user", "content": [{"type": "tool_result"}]}]),
                     ("messages", [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                      "input": "x"}]}]),
                     ("messages", [{"role": "assistant", "content": [{"type": "weird"}]}]),
                     ("system", 5), ("system", [{"type": "image"}]), ("thinking", {"type": "maybe"}),
                     ("thinking", {"type": "enabled"}), ("thinking", "on"), ("tools", [{"name": "f"}]),
                     ("tools", [{"name": "f", "input_schema": 5}]), ("tools", [{"name": "", "input_schema": {}}]),
                     ("tools", [{"type": "web_search_20250305", "name": "web_search"}]), ("tool_choice", {"type": "x"}),
                     ("tool_choice", {"type": "tool", "name": "nope"}), ("tool_choice", {"type": "any"}),
                     ("output_config", {"format": {"type": "json_schema"}}), ("output_config", {"effort": "huge"})]:
            out.append(with_(path, **{k: v}))
    for k, v in [("max_tokens", ...), ("max_tokens", 0), ("max_tokens", "5"), ("stop_sequences", "x"),
                 ("stop_sequences", [5]), ("temperature", "x"), ("top_k", -1), ("stream", "x")]:
        out.append(with_(MSG, **{k: v}))
    return out


def check_envelope(path: str, status: int, body: bytes, want: int | None = None):
    assert 400 <= status < 500, (path, status, body[:200])
    if want is not None:
        assert status == want, (path, status, body[:200])
    doc = json.loads(body)
    if path.startswith("/v1/messages"):
        assert doc["type"] == "error" and isinstance(doc["error"]["type"], str), doc
        assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    else:
        assert isinstance(doc["error"]["message"], str) and doc["error"]["message"], doc
        assert isinstance(doc["error"]["type"], str)
    return doc


async def _send_all(base, requests, headers=None, concurrency=8):
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as http:
        async def one(method, path, body, hdrs):
            data = body
            if hdrs.pop("chunked", None):            # no Content-Length: the limit bites while reading
                async def gen(b=body):
                    for i in range(0, len(b), 65536):
                        yield b[i:i + 65536]
                data = gen()
            async with sem:
                async with http.request(method, base + path, data=data, headers=hdrs) as r:
                    return method, path, r.status, await r.read()
        return await asyncio.gather(*[one(m, p, b, {**(headers or {}), **h}) for m, p, b, h in requests])


def test_malformed_requests_get_typed_4xx_and_nothing_leaks(server):
    server.state.config.max_request_mib = 0.25          # huge bodies: over this limit
    try:
        reqs = [("POST", p, b, {"Content-Type": "application/json"}) for p, b in cases()]
        big = b'{"model": "' + b"x" * 400_000 + b'"}'
        reqs += [("POST", p, big, {}) for p in (CHAT, RESP, MSG, COUNT)]
        reqs += [("POST", p, big, {"chunked": True}) for p in (CHAT, MSG)]
        reqs += [("GET", "/v1/nope", None, {}), ("POST", "/v1/completions", b"{}", {}), ("GET", CHAT, None, {}),
                 ("PUT", MSG, b"{}", {}), ("DELETE", "/v1/models", None, {}), ("GET", "/v1/models/gpt-4", None, {}),
                 ("GET", "/v1/responses/resp_nope", None, {}), ("DELETE", "/v1/responses/resp_nope", None, {}),
                 ("GET", "/v1/responses/resp_nope/input_items", None, {})]
        random.Random(0).shuffle(reqs)
        assert len(reqs) >= 200
        results = asyncio.run(_send_all(server.base, reqs))
        statuses = {}
        for method, path, status, body in results:
            check_envelope(path, status, body)
            statuses[status] = statuses.get(status, 0) + 1
        assert {400, 404, 405, 413} <= set(statuses), statuses
        by_body = {(p, b): s for (m, p, b, h), (_, _, s, _) in zip(reqs, results) if b is big}
        assert set(by_body.values()) == {413}
    finally:
        server.state.config.max_request_mib = 64.0
    # still up, still serving, nothing held
    status, _, body = server.get("/health")
    assert status == 200
    r = server.openai().chat.completions.create(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                                temperature=0)
    assert r.usage.completion_tokens >= 1
    server.wait_idle()


def test_bad_keys_get_401_in_each_protocol(think_server):
    good = {"x-api-key": "sekret-key"}
    reqs = []
    for hdrs in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}, {"Authorization": "sekret-key"},
                 {"Authorization": "Basic c2VrcmV0LWtleQ=="}, {"x-api-key": ""}, {"Authorization": "Bearer "}):
        for path in (CHAT, RESP, MSG, COUNT):
            reqs.append(("POST", path, json.dumps(GOOD[path]).encode(), hdrs))
        reqs += [("GET", "/v1/models", None, hdrs), ("GET", "/metrics", None, hdrs), ("GET", "/slots", None, hdrs)]
    results = asyncio.run(_send_all(think_server.base, reqs))
    for method, path, status, body in results:
        doc = check_envelope(path, status, body, want=401)
        err = doc["error"]
        assert err["type"] == "authentication_error"
    ok = asyncio.run(_send_all(think_server.base, [("POST", COUNT, json.dumps(GOOD[COUNT]).encode(), good),
                                                   ("GET", "/health", None, {})]))
    assert [r[2] for r in ok] == [200, 200]
    think_server.wait_idle()
