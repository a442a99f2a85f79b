"""What the three protocols share: the model's text side, one generation turned into semantic events.

A protocol adapter validates its request into a `GenRequest` (canonical OpenAI-style messages, function
tools, tool choice, thinking, limits, sampling), then drives a `Generation`: render with the chat
template, tokenize (off the event loop), submit to the scheduler, and read back `Reasoning`, `Content`,
`ToolStart`, `ToolArgs`, `ToolEnd` events and one final `Finished` carrying the whole result.

tool_choice: "none" renders no tools and parses no calls; "required" and a named function make the
model start its answer with a call: the prompt is rendered with thinking off and ends with the call's
opening (`<tool_call>\n<function=` or `<tool_call>\n<function=NAME>\n`), which the parser is fed first.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field

from ..runtime import scheduler as sched
from ..runtime.chat import (ChatError, ReasoningSplitter, load_template, prompt_opens_reasoning, render)
from ..runtime.engine import SamplingParams
from ..runtime.tokenizer import Tokenizer, TurnEncoder
from .errors import ApiError, from_scheduler
from .tool_calls import CallArgs, CallEnd, CallStart, TextPart, ToolCall, ToolCallParser

KEEPALIVE_S = 10.0
SNAPSHOT_MIN_TOKENS = 256   # shorter first turns are not worth a prefix snapshot
SCRIPT_CHARS = 9   # test hook: characters of scripted text per generated token


def new_id(prefix: str, n: int = 24) -> str:
    return prefix + secrets.token_hex(n // 2)


class ModelText:
    """Tokenizer, chat template, stop tokens and default sampling of the served artifact."""

    def __init__(self, art, template_path=None):
        self.tok = Tokenizer.from_artifact(art)
        self.turns = TurnEncoder(self.tok)   # a conversation's next turn encodes only its new turns
        self.mark = self.tok.token_id("<|im_start|>")
        self.system_opener = [self.mark, *self.tok.encode("system")]   # a prompt's first ids when it has a system turn
        self.template = load_template(art, template_path)
        gen = {}
        if "generation_config.json" in art.resources:
            try:
                gen = json.loads(art.resource("generation_config.json"))
            except ValueError:
                gen = {}
        stops = set()
        eos = gen.get("eos_token_id")
        for e in (eos if isinstance(eos, list) else [eos]):
            if isinstance(e, int):
                stops.add(e)
        for name in ("<|im_end|>", "<|endoftext|>"):
            i = self.tok.token_id(name)
            if i is not None:
                stops.add(i)
        if self.tok.eos_id is not None:
            stops.add(self.tok.eos_id)
        self.stop_ids = frozenset(stops)
        self.defaults = dict(temperature=_num(gen.get("temperature"), 0.6), top_p=_num(gen.get("top_p"), 0.95),
                             top_k=int(_num(gen.get("top_k"), 20)), min_p=_num(gen.get("min_p"), 0.0))
        if not gen.get("do_sample", True):
            self.defaults["temperature"] = 0.0
        # fail at start-up, not on the first request, when a template cannot render a plain chat
        render([{"role": "user", "content": "hi"}], template=self.template)

    def render(self, messages, tools=None, thinking: bool = True) -> str:
        return render(messages, tools=tools, enable_thinking=thinking, add_generation_prompt=True,
                      template=self.template)

    def encode(self, text: str) -> list[int]:
        return self.turns.encode(text)

    def first_turn_end(self, ids: list[int]) -> int:
        """Where a prompt's system turn (the system prompt and tool list a new conversation repeats) ends, as a
        prefix snapshot point; 0 when the prompt opens with another turn (a user's first message is not repeated
        by other conversations, and the next turn extends the lane anyway), or the system turn is shorter than
        SNAPSHOT_MIN_TOKENS."""
        if self.mark is None or ids[:2] != self.system_opener:
            return 0
        second = next((i for i in range(1, len(ids)) if ids[i] == self.mark), 0)   # the second turn's opener
        return second if second >= SNAPSHOT_MIN_TOKENS else 0

    def sampling(self, *, temperature=None, top_p=None, top_k=None, min_p=None, presence_penalty=None,
                 frequency_penalty=None, seed=None) -> SamplingParams:
        d = self.defaults
        return SamplingParams(temperature=d["temperature"] if temperature is None else temperature,
                              top_p=d["top_p"] if top_p is None else top_p,
                              top_k=d["top_k"] if top_k is None else top_k,
                              min_p=d["min_p"] if min_p is None else min_p,
                              presence_penalty=presence_penalty or 0.0, frequency_penalty=frequency_penalty or 0.0,
                              seed=seed)


def _num(v, default):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default


@dataclass
class GenRequest:
    protocol: str                      # "chat" | "responses" | "anthropic" | "completions"
    messages: list[dict]
    tools: list[dict] | None = None    # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: object = "auto"       # "auto" | "none" | "required" | {"name": NAME}
    parallel_tool_calls: bool = True
    thinking: bool = True
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    raw_prompt: str | list[int] | None = None   # completions: the prompt as given (text or token ids), no template
    stop_ids: frozenset | None = None            # the ids that end the answer (None: the model's end-of-turn ids)


# -- semantic events -----------------------------------------------------------------------------
@dataclass
class Reasoning:
    text: str


@dataclass
class Content:
    text: str


@dataclass
class ToolStart:
    index: int
    name: str


@dataclass
class ToolArgs:
    index: int
    delta: str


@dataclass
class ToolEnd:
    call: ToolCall


@dataclass
class Finished:
    reasoning: str
    content: str
    calls: list[ToolCall]
    finish_reason: str          # "stop" | "length" | "tool_calls"
    stop_string: str | None
    done: sched.Done
    reasoning_tokens: int


@dataclass
class KeepAlive:
    pass


@dataclass
class FirstToken:
    """The request is admitted and its first token chosen (streams start here, even before any text)."""


class Generation:
    def __init__(self, app_state, req: GenRequest):
        self.state = app_state
        self.req = req
        self.handle: sched.Handle | None = None
        self.prompt = ""
        self.prompt_ids: list[int] = []
        self.started = time.monotonic()
        self.forced = ""
        self.thinking = req.thinking
        self.script: str | None = None

    # -- prompt ------------------------------------------------------------------------------------
    def _tools_for_template(self):
        return None if self.req.tool_choice == "none" else self.req.tools

    def _forced_prefix(self) -> str:
        tc = self.req.tool_choice
        if not self.req.tools or tc in ("auto", "none"):
            return ""
        if tc == "required" and len(self.req.tools) == 1:  # one function: required names it
            tc = {"name": self.req.tools[0]["function"]["name"]}
        if tc == "required":
            return "<tool_call>\n<function="
        return f"<tool_call>\n<function={tc['name']}>\n"

    def build_prompt(self) -> None:
        """Render and tokenize (blocking: run it in an executor)."""
        raw = self.req.raw_prompt
        if raw is not None:   # completions: the text (its special tokens included) or the ids, as given
            self.thinking = False
            self.prompt_ids = list(raw) if isinstance(raw, list) else self.state.text.encode(raw)
            self.prompt = raw if isinstance(raw, str) else ""
            return
        forced = self._forced_prefix()
        thinking = self.req.thinking and not forced
        try:
            text = self.state.text.render(self.req.messages, self._tools_for_template(), thinking)
        except ChatError as e:
            raise ApiError(400, str(e), param="messages") from None
        self.prompt = text + forced
        self.forced = forced
        self.thinking = thinking
        self.prompt_ids = self.state.text.encode(self.prompt)

    async def prepare(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.build_prompt)

    def count_tokens(self) -> int:
        self.build_prompt()
        return len(self.prompt_ids)

    # -- running -----------------------------------------------------------------------------------
    def submit(self) -> None:
        max_new = self.req.max_tokens if self.req.max_tokens is not None else self.state.default_max_tokens
        r = sched.Request(prompt=self.prompt_ids, max_new=max_new, sampling=self.req.sampling,
                          stop_ids=self.state.text.stop_ids if self.req.stop_ids is None else self.req.stop_ids,
                          stop_strings=tuple(self.req.stop),
                          detokenizer=self.state.text.tok.stream(skip_ids=self.state.text.stop_ids),
                          snapshot_at=self.state.text.first_turn_end(self.prompt_ids),
                          info=dict(id_task=self.req.request_id, protocol=self.req.protocol))
        hook = getattr(self.state, "text_hook", None)
        self.script = hook(self.req) if hook else None
        try:
            self.handle = self.state.scheduler.submit(r)
        except sched.SchedulerError as e:
            self.state.metrics.rejected(type(e).__name__)
            raise from_scheduler(e) from None

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    async def events(self, keepalive: bool = False):
        """Semantic events, then one Finished. Raises ApiError if the request fails."""
        tools = {}
        for t in (self.req.tools or []):
            f = t["function"]
            tools[f["name"]] = f.get("parameters") or {}
        parse_calls = bool(self.req.tools) and self.req.tool_choice != "none"
        parser = ToolCallParser(tools, tolerant=self.state.tolerant_tool_calls) if parse_calls else None
        splitter = (Verbatim() if self.req.raw_prompt is not None   # completions: the text exactly as generated
                    else ReasoningSplitter(in_reasoning=self.thinking and prompt_opens_reasoning(self.prompt)))
        reasoning, content = [], []
        calls: list[ToolCall] = []
        reasoning_tokens = 0
        max_calls = None if self.req.parallel_tool_calls else 1

        def answer(text: str, final: bool = False):
            if parser is None:
                if text:
                    content.append(text)
                    yield Content(text)
                return
            evs = parser.feed(text) if text else []
            if final:
                evs += parser.finish()
            for ev in evs:
                if isinstance(ev, TextPart):
                    content.append(ev.text)
                    yield Content(ev.text)
                elif max_calls is not None and (ev.call.index if isinstance(ev, CallEnd) else ev.index) >= max_calls:
                    continue  # parallel_tool_calls false: the first call only
                elif isinstance(ev, CallStart):
                    yield ToolStart(ev.index, ev.name)
                elif isinstance(ev, CallArgs):
                    yield ToolArgs(ev.index, ev.delta)
                elif isinstance(ev, CallEnd):
                    calls.append(ev.call)
                    yield ToolEnd(ev.call)

        def route(parts):
            for channel, text in parts:
                if channel == "reasoning":
                    reasoning.append(text)
                    yield Reasoning(text)
                else:
                    yield from answer(text)

        opening = []  # the call's opening is in the prompt: the parser starts inside it
        if self.forced:
            for ev in answer(self.forced):
                if isinstance(ev, Content):
                    content.pop()
                else:
                    opening.append(ev)
        queue = self.handle.events
        first_seen = False
        while True:
            if keepalive:
                try:
                    ev = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield KeepAlive()
                    continue
            else:
                ev = await queue.get()
            if isinstance(ev, sched.Text):
                if not first_seen:
                    first_seen = True
                    yield FirstToken()
                    for out in opening:
                        yield out
                if self.script is not None:  # test hook: scripted text, some characters per real token
                    ev = sched.Text(self.script[:SCRIPT_CHARS], ev.tokens)
                    self.script = self.script[SCRIPT_CHARS:]
                if splitter.state == "reasoning":
                    reasoning_tokens += ev.tokens
                if ev.text:
                    for out in route(splitter.feed(ev.text)):
                        yield out
            elif isinstance(ev, sched.Done):
                self.handle.finished = True
                if self.script:
                    for out in route(splitter.feed(self.script)):
                        yield out
                    self.script = ""
                for out in route(splitter.finish()):
                    yield out
                for out in answer("", final=True):
                    yield out
                finish = ev.finish_reason if self.script is None else "stop"  # a script is a whole turn
                if calls and finish == "stop":
                    finish = "tool_calls"
                yield Finished("".join(reasoning), "".join(content), calls, finish, ev.stop_string, ev,
                               reasoning_tokens)
                return
            elif isinstance(ev, sched.Failed):
                self.handle.finished = True
                raise from_scheduler(ev.error)


class Verbatim:
    """ReasoningSplitter's interface for raw completions: every piece is content, its whitespace and any <think> kept
    (code completion needs the text exactly)."""
    state = "content"

    def feed(self, text: str) -> list[tuple[str, str]]:
        return [("content", text)] if text else []

    def finish(self) -> list[tuple[str, str]]:
        return []


def fold_system(msgs: list[dict]) -> list[dict]:
    """Leading system messages merge into one (the template takes a single first system turn); a system
    message later in the conversation (agents inject them) is passed on as a user turn, not refused."""
    out: list[dict] = []
    for m in msgs:
        if m["role"] == "system":
            if all(x["role"] == "system" for x in out):
                if out:
                    out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + m["content"]}
                else:
                    out.append(dict(m))
                continue
            m = {"role": "user", "content": m["content"]}
        out.append(m)
    return out
