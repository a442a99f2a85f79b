"""Chat messages -> prompt text through a jinja2 chat template (sandboxed), and the model's output
back into reasoning and answer.

`render(messages, tools=None, enable_thinking=True, add_generation_prompt=True, template=None)` is
the one entry point. The template is chosen by `load_template`: an explicit file, else the
artifact's chat_template.jinja (or tokenizer_config.json's `chat_template`), else ours
(chat_template.jinja beside this file). Messages are normalized first (OpenAI content parts joined,
tool-call arguments parsed from JSON, inline <think> blocks moved to `reasoning_content`), so the
template, ours or a checkpoint's, sees plain strings and mappings.

Errors: `MessagesError` for input the template cannot be given, `ChatTemplateError` for a template
that does not compile or fails to render; both are `ChatError` (a ValueError) and say why.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

OUR_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    pass


class MessagesError(ChatError):
    """The messages (or tools) are not something a chat template can render."""


class ChatTemplateError(ChatError):
    """The chat template does not compile, or raised / failed while rendering."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str          # the jinja text
    origin: str          # where it came from, for error messages


def load_template(art=None, path=None) -> ChatTemplate:
    """The template to use: `path` if given, else the artifact's, else ours."""
    if path is not None:
        p = Path(path)
        try:
            return ChatTemplate(p.read_text("utf-8"), str(p))
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"chat template {p}: cannot read it: {e}") from None
    if art is not None:
        if "chat_template.jinja" in art.resources:
            return ChatTemplate(art.resource("chat_template.jinja").decode("utf-8"),
                                f"{art.path}:chat_template.jinja")
        if "tokenizer_config.json" in art.resources:
            try:
                cfg = json.loads(art.resource("tokenizer_config.json"))
            except ValueError:
                cfg = {}
            if isinstance(cfg, dict) and isinstance(cfg.get("chat_template"), str):
                return ChatTemplate(cfg["chat_template"], f"{art.path}:tokenizer_config.json chat_template")
    return ChatTemplate(OUR_TEMPLATE.read_text("utf-8"), str(OUR_TEMPLATE))


# -- jinja ---------------------------------------------------------------------------------------
class _Refused(Exception):
    """raise_exception() called by the template."""


def _raise(message):
    raise _Refused(str(message))


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str, origin: str):
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    # trim/lstrip blocks as checkpoint templates expect (they are written for transformers' settings)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                                        keep_trailing_newline=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template {origin}: syntax error at line {e.lineno}: {e.message}") from None


# -- normalization -------------------------------------------------------------------------------
def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessagesError(f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
        return "".join(out)
    raise MessagesError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")


def _arguments(args, where: str) -> dict:
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            raise MessagesError(f"{where}.arguments: not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise MessagesError(f"{where}.arguments: expected a JSON object, got {type(args).__name__}")
    return args


def normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, list):
        raise MessagesError(f"messages: expected a list, got {type(messages).__name__}")
    if not messages:
        raise MessagesError("messages: the list is empty (give at least one message)")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise MessagesError(f"{where}: expected an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise MessagesError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)} (or developer)")
        n = {k: v for k, v in m.items() if k not in ("role", "content")}
        n["role"], n["content"] = role, _text(m.get("content"), where)
        if role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise MessagesError(f"{where}.reasoning_content: expected a string")
            if THINK_CLOSE in n["content"]:      # reasoning sent inline: move it where templates look
                inline, _, rest = n["content"].partition(THINK_CLOSE)
                inline = inline.split(THINK_OPEN, 1)[-1]
                reasoning = reasoning or inline
                n["content"] = rest.lstrip("\n")
            if reasoning is not None:
                n["reasoning_content"] = reasoning.strip("\n")
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise MessagesError(f"{where}.tool_calls: expected a list")
            n["tool_calls"] = []
            for j, c in enumerate(calls):
                w = f"{where}.tool_calls[{j}]"
                f = c.get("function", c) if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
                    raise MessagesError(f"{w}: expected {{'function': {{'name': ..., 'arguments': ...}}}}")
                fn = {"name": f["name"], "arguments": _arguments(f.get("arguments"), w + ".function")}
                n["tool_calls"].append({**{k: v for k, v in c.items() if k != "function"},
                                        "type": "function", "function": fn})
        out.append(n)
    return out


def normalize_tools(tools) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise MessagesError(f"tools: expected a list, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise MessagesError(f"tools[{i}]: expected an object")
        if t.get("type", "function") != "function":
            raise MessagesError(f"tools[{i}].type: only function tools are supported, got {t.get('type')!r}")
        f = t.get("function", t if "name" in t else None)
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise MessagesError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        out.append({"type": "function", "function": {k: v for k, v in f.items() if k != "type"}})
    return out


def render(messages, tools=None, enable_thinking: bool = True, add_generation_prompt: bool = True,
           template: ChatTemplate | str | None = None) -> str:
    """The prompt text for `messages` (OpenAI-style dicts) and optional function `tools`."""
    if template is None:
        template = load_template()
    elif isinstance(template, str):
        template = ChatTemplate(template, "<string>")
    msgs, tls = normalize_messages(messages), normalize_tools(tools)
    compiled = _compile(template.source, template.origin)
    try:
        return compiled.render(messages=msgs, tools=tls, enable_thinking=bool(enable_thinking),
                               add_generation_prompt=bool(add_generation_prompt),
                               bos_token="", eos_token="<|im_end|>")
    except _Refused as e:
        raise ChatTemplateError(f"chat template {template.origin} refused the messages: {e}") from None
    except Exception as e:  # noqa: BLE001 - jinja raises many kinds (UndefinedError, SecurityError, TypeError...)
        raise ChatTemplateError(f"chat template {template.origin} failed to render: "
                                f"{type(e).__name__}: {e}") from None


# -- the model's output --------------------------------------------------------------------------
def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the prompt leaves a <think> block open (some templates open it for the model)."""
    start = prompt.rfind("<|im_start|>")
    opened = prompt.rfind(THINK_OPEN)
    return opened > start and opened > prompt.rfind(THINK_CLOSE)


class ReasoningSplitter:
    """Split streamed model output into reasoning (inside <think>...</think>) and answer.

    `feed(text)` returns [(channel, text), ...] with channel "reasoning" or "content"; pieces that
    could still turn out to be part of a tag, or whitespace at the edges of a section, are held back
    until more text (or `finish()`) decides them. The newlines around the reasoning and before the
    answer are dropped, as the template puts them there."""

    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self.reasoning_started = False   # leading newline after <think> dropped once
        self.content_started = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.buf, self.state = s[len(THINK_OPEN):], "reasoning"
                    continue
                if s and not THINK_OPEN.startswith(s):
                    self.state = "content"
                    continue
                return out
            if self.state == "reasoning":
                if not self.reasoning_started:
                    if not self.buf:
                        return out
                    self.buf = self.buf[1:] if self.buf.startswith("\n") else self.buf
                    self.reasoning_started = True
                end = self.buf.find(THINK_CLOSE)
                if end >= 0:
                    piece = self.buf[:end].rstrip("\n")
                    if piece:
                        out.append(("reasoning", piece))
                    self.buf, self.state = self.buf[end + len(THINK_CLOSE):], "content"
                    continue
                keep = _held_back(self.buf, THINK_CLOSE)
                piece = self.buf[:len(self.buf) - keep]
                trail = len(piece) - len(piece.rstrip("\n"))
                piece, keep = piece[:len(piece) - trail], keep + trail
                if piece:
                    out.append(("reasoning", piece))
                self.buf = self.buf[len(self.buf) - keep:] if keep else ""
                return out
            # content: everything, minus the whitespace that separates it from the reasoning
            if not self.content_started:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.content_started = True
            if self.buf:
                out.append(("content", self.buf))
            self.buf = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        """Release what is held: an unfinished tag prefix is text after all."""
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        if self.state == "reasoning":
            return [("reasoning", rest)] if rest.strip("\n") else []
        rest = rest.lstrip() if not self.content_started else rest
        return [("content", rest)] if rest else []


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """Non-streaming form of ReasoningSplitter: (reasoning, content)."""
    s = ReasoningSplitter(in_reasoning)
    parts = s.feed(text) + s.finish()
    return ("".join(t for c, t in parts if c == "reasoning"), "".join(t for c, t in parts if c == "content"))


__all__ = ["ChatError", "MessagesError", "ChatTemplateError", "ChatTemplate", "load_template", "render",
           "normalize_messages", "normalize_tools", "prompt_opens_reasoning", "ReasoningSplitter",
           "split_reasoning", "OUR_TEMPLATE"]
