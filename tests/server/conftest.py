"""Live servers for the SDK tests: the demo artifact (random weights, the real Qwen3.5 tokenizer, our
template) on the reference backend, served on 127.0.0.1 with an ephemeral port by the same code path
as `ninfer-serve` (build_state + app.start), in a background event-loop thread so the tests can use the
synchronous `openai` and `anthropic` clients and also look at the engine directly."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest

from ninfer.runtime.chat import OUR_TEMPLATE

# Appended to our template: a generation prompt that opens <think>, so that everything the (random)
# demo model writes is reasoning: the thinking paths then run on the real engine.
OPEN_THINK = ("{%- if add_generation_prompt and (enable_thinking is not defined or enable_thinking) -%}"
              "{{- '<think>\\n' -}}{%- endif -%}")


class LiveServer:
    def __init__(self, artifact, **options):
        from ninfer.cli.serve import build_state
        from ninfer.server.app import start
        options.setdefault("model_id", "ninfer-demo")
        options.setdefault("backend", "reference")
        self.state, self.engine = build_state(artifact, **options)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()
        started = asyncio.run_coroutine_threadsafe(start(self.state, "127.0.0.1", 0), self.loop)
        self.runner, self.port = started.result(60)
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = options.get("api_key")

    def openai(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=120, **kw)

    def anthropic(self, **kw):
        import anthropic
        return anthropic.Anthropic(base_url=self.base, api_key=self.api_key or "none", max_retries=0, timeout=120,
                                   **kw)

    def get(self, path: str, headers=None):
        req = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def post_json(self, path: str, body=None):
        """POST a JSON body (or none); (status, parsed JSON answer)."""
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.base + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def slots(self):
        hdr = {"x-api-key": self.api_key} if self.api_key else {}
        status, headers, body = self.get("/slots", hdr)
        assert status == 200
        return json.loads(body), int(headers["X-Ninfer-Kv-Pages-Used"])

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Lanes and KV pages back to their baseline (nothing busy, nothing held), seen both through
        /slots and in the engine itself."""
        deadline = time.monotonic() + timeout
        while True:
            lanes, pages = self.slots()
            # a lane retained for prefix caching holds its finished prompt's pages, given back on demand
            busy = [s for s in lanes if s["is_processing"] or (s["kv_pages"] and s["state"] != "retained")]
            if not busy and pages == 0 and self.engine.cache.in_use == (0, 0) and self.state.scheduler.pending == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout} s: busy lanes {busy}, {pages} pages, "
                                     f"engine in_use {self.engine.cache.in_use}")
            time.sleep(0.05)

    def render_tokens(self, messages, tools=None, thinking=True) -> int:
        """Prompt tokens the server must count for these canonical messages."""
        return len(self.state.text.encode(self.state.text.render(messages, tools, thinking)))

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.state.scheduler.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.state.request_log.close()
        self.engine.close()


@pytest.fixture(scope="session")
def server(demo_artifact):
    """The main server: 8 lanes, small prefill chunks (long prompts interleave with decode steps)."""
    s = LiveServer(demo_artifact, max_concurrency=8, max_context=1024, prefill_chunk=64, max_pending=64,
                   pending_timeout_ms=120_000)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def think_server(demo_artifact, tmp_path_factory):
    """A second server: a --chat-template whose generation prompt opens <think>, an API key, tolerant
    tool calls and a request log."""
    d = tmp_path_factory.mktemp("think")
    tpl = d / "open_think.jinja"
    tpl.write_text(OUR_TEMPLATE.read_text("utf-8") + OPEN_THINK, "utf-8")
    s = LiveServer(demo_artifact, max_concurrency=2, max_context=1024, prefill_chunk=256, max_pending=8,
                   pending_timeout_ms=60_000, template=tpl, api_key="sekret-key", tolerant=True,
                   log_path=d / "requests.jsonl", log_max_mib=64.0, log_keep=2)
    s.log_path = d / "requests.jsonl"
    yield s
    s.stop()


@pytest.fixture
def scripted(server):
    """Test-only hook: the engine still runs each request, but its text is replaced by a script
    (answer text with reasoning / tool-call markup), so the parsers and protocol shapes can be checked
    deterministically through the real SDKs."""
    scripts = []

    def hook(req):
        return scripts.pop(0) if scripts else None
    server.state.text_hook = hook
    yield scripts
    server.state.text_hook = None
