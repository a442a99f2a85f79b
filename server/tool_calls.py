"""Incremental parser for the Qwen XML tool-call form, fed the answer text as it streams.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Events: `TextPart` (ordinary answer text), `CallStart` (the function name is known), `CallArgs` (the next
fragment of the arguments as JSON text: all fragments of a call concatenate to one JSON object), and
`CallEnd` (the finished call with its arguments as a dict). String-typed parameters (by the tool's JSON
Schema; a parameter the schema does not describe counts as a string) stream character by character;
other parameters are converted from their text (JSON, else the raw string) when they close.

One leading and one trailing newline of a value are the form's own and are dropped. A `</parameter>`
closes a value only when what follows it is `<parameter=`, `</function>` or `</tool_call>` (or the end),
so values that contain the marker text (source files, XML) survive.

Strict mode takes only the form above; a `<tool_call>` block whose head is not `<function=NAME>` stays
text. Tolerant mode (`--tolerant-tool-calls`) also recovers complete calls from malformed wrappers: a
missing `<tool_call>` opener (a bare `<function=...>`), a missing `</parameter>` or `</function>`, stray
text between parameters, and the JSON body form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
WS = " \t\r\n"


@dataclass
class TextPart:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class CallArgs:
    index: int
    delta: str


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: dict
    arguments_json: str


@dataclass
class CallEnd:
    call: ToolCall


def _dumps(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def _holdback(buf: str, markers) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of the markers."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


def _types(schema) -> set[str] | None:
    """The JSON types a parameter schema allows (None when it says nothing usable)."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        s = {x for x in t if isinstance(x, str)}
        return s or None
    for k in ("anyOf", "oneOf"):
        if isinstance(schema.get(k), list):
            s = set()
            for sub in schema[k]:
                s |= _types(sub) or set()
            return s or None
    if "enum" in schema and all(isinstance(e, str) for e in schema["enum"] or [None]):
        return {"string"}
    if "properties" in schema:
        return {"object"}
    return None


def convert_value(raw: str, types: set[str] | None):
    """A parameter's text as the value its schema asks for (the raw string when it does not parse)."""
    if types is None or types <= {"string", "null"}:
        return raw
    text = raw.strip()
    if types & {"boolean"} and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        return raw


class ToolCallParser:
    def __init__(self, tools: dict[str, dict] | None = None, tolerant: bool = False):
        """tools: function name -> its parameters JSON Schema (for value types)."""
        self.tools = tools or {}
        self.tolerant = tolerant
        self.buf = ""
        self.state = "text"
        self.raw = ""           # text of the current block since <tool_call> (strict fallback before CallStart)
        self.calls: list[ToolCall] = []
        self.final = False
        # the call being parsed
        self._name = ""
        self._params: dict = {}
        self._parts: list[str] = []  # keys of the closed parameters
        self._json = ""             # the arguments JSON sent so far
        self._trim = False          # drop whitespace after a call
        # the parameter being parsed
        self._key = ""
        self._stream = False
        self._start = -1        # index in buf where the value starts (after its leading newline)
        self._sent = 0          # buf index up to which a streamed value was sent
        self._scan = 0          # rejected close candidates lie before this index

    # -- public --------------------------------------------------------------------------------
    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        while self._step(out):
            pass
        return _merge(out)

    def finish(self) -> list:
        self.final = True
        out: list = []
        while self._step(out):
            pass
        if self.state in ("body", "value", "header", "opened"):  # the stream ended inside a block
            if self.state in ("header", "opened"):
                self._fallback(out)
            else:
                if self.state == "value":
                    self._close_value(len(self.buf), out, partial=True)
                self._end_call(out)
        elif self.buf:
            out.append(TextPart(self.buf))
        self.buf = ""
        self.state = "text"
        return _merge(out)

    # -- states --------------------------------------------------------------------------------
    def _step(self, out) -> bool:
        return getattr(self, "_s_" + self.state)(out)

    def _s_text(self, out) -> bool:
        # Whitespace around calls belongs to the form (the template writes it): it is not answer text.
        if self._trim:
            stripped = self.buf.lstrip(WS)
            if not stripped:
                if self.final:
                    self.buf = ""
                return False
            self.buf, self._trim = stripped, False
        markers = (OPEN, FUNC) if self.tolerant else (OPEN,)
        hits = [(self.buf.find(m), m) for m in markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if hits:
            i, m = min(hits)
            before = self.buf[:i].rstrip(WS)
            if before:
                out.append(TextPart(before))
            self.raw = self.buf[len(before):i] + m  # the whitespace comes back if this is no call
            self.buf = self.buf[i + len(m):]
            self.state = "opened" if m == OPEN else "header"
            return True
        if self.final:
            keep = 0
        else:  # a tail that may start a call, and trailing whitespace that would go if one does
            keep = _holdback(self.buf, markers)
            keep = len(self.buf) - len(self.buf[:len(self.buf) - keep].rstrip(WS))
        if len(self.buf) > keep:
            out.append(TextPart(self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _s_opened(self, out) -> bool:
        stripped = self.buf.lstrip(WS)
        self.raw += self.buf[:len(self.buf) - len(stripped)]
        self.buf = stripped
        if not self.buf:
            return False
        if self.buf.startswith(FUNC):
            self.raw += FUNC
            self.buf = self.buf[len(FUNC):]
            self.state = "header"
            return True
        if FUNC.startswith(self.buf):
            return False
        if self.tolerant and self.buf[0] == "{":
            self.state = "json"
            return True
        self._fallback(out)
        return True

    def _s_header(self, out) -> bool:
        j = self.buf.find(">")
        if j < 0:
            if "\n" in self.buf or len(self.buf) > 256:
                self._fallback(out)
                return True
            return False
        name = self.buf[:j].strip().strip("\"'")
        if not name or "\n" in name or "<" in name:
            self._fallback(out)
            return True
        self.buf = self.buf[j + 1:]
        self.raw = ""
        self._name, self._params, self._parts, self._json = name, {}, [], ""
        out.append(CallStart(len(self.calls), name))
        self.state = "body"
        return True

    def _s_body(self, out) -> bool:
        self.buf = self.buf.lstrip(WS)
        if not self.buf:
            return False
        if self.buf.startswith(PARAM):
            j = self.buf.find(">")
            if j < 0:
                if "\n" in self.buf or len(self.buf) > 256 + len(PARAM):
                    return self._body_garbage(out)
                return False
            key = self.buf[len(PARAM):j].strip().strip("\"'")
            if not key:
                return self._body_garbage(out)
            self.buf = self.buf[j + 1:]
            self._open_value(key, out)
            return True
        if self.buf.startswith(FUNC_END):
            self.buf = self.buf[len(FUNC_END):]
            self._end_call(out)
            self.state = "after"
            return True
        if self.tolerant and self.buf.startswith(CLOSE):  # </function> missing
            self.buf = self.buf[len(CLOSE):]
            self._end_call(out)
            self.state = "text"
            return True
        if any(m.startswith(self.buf) for m in (PARAM, FUNC_END, CLOSE)):
            return False
        return self._body_garbage(out)

    def _body_garbage(self, out) -> bool:
        if self.tolerant:  # skip stray text up to the next tag
            j = self.buf.find("<", 1)
            if j < 0:
                self.buf = "" if self.final or len(self.buf) > 4096 else self.buf
                return bool(self.final)
            self.buf = self.buf[j:]
            return True
        self._end_call(out)  # strict: the call ends here; the rest is text
        self.state = "text"
        return True

    def _open_value(self, key: str, out) -> None:
        self._key = key
        types = _types(self._schema_props().get(key))
        self._stream = types is None or types <= {"string", "null"} and "string" in types
        self._start, self._sent, self._scan = -1, 0, 0
        self.state = "value"
        if self._stream:
            self._args(out, self._sep() + _dumps(key) + ": \"")

    def _s_value(self, out) -> bool:
        if self._start < 0:
            if not self.buf:
                return False
            self._start = self._sent = 1 if self.buf[0] == "\n" else 0
            self._scan = self._start
        closers = (PARAM_END, FUNC_END, CLOSE) if self.tolerant else (PARAM_END,)
        pending = None
        i = self._scan
        while True:
            hits = [(self.buf.find(c, i), c) for c in closers]
            hits = [(p, c) for p, c in hits if p >= 0]
            if not hits:
                break
            p, c = min(hits)
            verdict = self._close_verdict(p, c)
            if verdict == "close":
                self._close_value(p, out)
                self.buf = self.buf[p + len(c):]
                if c == PARAM_END:
                    self.state = "body"
                elif c == FUNC_END:
                    self._end_call(out)
                    self.state = "after"
                else:
                    self._end_call(out)
                    self.state = "text"
                return True
            if verdict == "wait":
                pending = p
                break
            i = p + 1          # not a close: part of the value
            self._scan = i
        if self._stream:  # send what is surely value text
            upto = pending if pending is not None else len(self.buf) - _holdback(self.buf, closers)
            if upto > self._start and self.buf[upto - 1] == "\n":
                upto -= 1      # may be the form's trailing newline
            if upto > self._sent:
                self._args(out, _dumps(self.buf[self._sent:upto])[1:-1])
                self._sent = upto
        return False

    def _close_verdict(self, p: int, closer: str) -> str:
        rest = self.buf[p + len(closer):].lstrip(WS)
        if closer == CLOSE:
            return "close"
        follow = (PARAM, FUNC_END, CLOSE) if closer == PARAM_END else (CLOSE, OPEN, FUNC)
        if not rest:
            return "close" if self.final else "wait"
        if any(rest.startswith(f) for f in follow):
            return "close"
        if any(f.startswith(rest) for f in follow):
            return "close" if self.final else "wait"
        return "reject"

    def _close_value(self, p: int, out, partial: bool = False) -> None:
        start = max(self._start, 0)
        end = p - 1 if (not partial and p - 1 >= start and self.buf[p - 1] == "\n") else p
        raw = self.buf[start:end] if end > start else ""
        if self._stream:
            if end > self._sent:
                self._args(out, _dumps(self.buf[self._sent:end])[1:-1])
            self._args(out, "\"")
            self._params[self._key] = raw
        else:
            value = convert_value(raw, _types(self._schema_props().get(self._key)))
            self._args(out, self._sep() + _dumps(self._key) + ": " + _dumps(value))
            self._params[self._key] = value
        self._parts.append(self._key)
        if partial:
            self.buf = ""

    def _sep(self) -> str:
        return "{" if not self._parts else ", "

    def _args(self, out, delta: str) -> None:
        self._json += delta
        out.append(CallArgs(len(self.calls), delta))

    def _end_call(self, out) -> None:
        self._args(out, "}" if self._parts else "{}")
        call = ToolCall(len(self.calls), self._name, dict(self._params), self._json)
        self.calls.append(call)
        out.append(CallEnd(call))
        self._parts, self._json, self._trim = [], "", True

    def _s_after(self, out) -> bool:
        self.buf = self.buf.lstrip(WS)
        if not self.buf:
            return False
        if self.buf.startswith(CLOSE):
            self.buf = self.buf[len(CLOSE):]
            self.state = "text"
            return True
        if self.buf.startswith(FUNC):  # several functions in one block
            self.buf = self.buf[len(FUNC):]
            self.state = "header"
            return True
        if any(m.startswith(self.buf) for m in (CLOSE, FUNC)):
            return False
        self.state = "text"  # </tool_call> missing: the rest is text
        return True

    def _s_json(self, out) -> bool:
        i = self.buf.find(CLOSE)
        if i < 0 and not self.final:
            return False
        body = self.buf if i < 0 else self.buf[:i]
        rest = "" if i < 0 else self.buf[i + len(CLOSE):]
        try:
            doc = json.loads(body)
            name = doc["name"]
            args = doc.get("arguments", doc.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                raise ValueError("not a call")
        except (ValueError, KeyError, TypeError):
            out.append(TextPart(self.raw + body + ("" if i < 0 else CLOSE)))
            self.buf, self.raw, self.state = rest, "", "text"
            return True
        idx = len(self.calls)
        out.append(CallStart(idx, name))
        out.append(CallArgs(idx, _dumps(args)))
        call = ToolCall(idx, name, args, _dumps(args))
        self.calls.append(call)
        self._trim = True
        out.append(CallEnd(call))
        self.buf, self.raw, self.state = rest, "", "text"
        return True

    # -- helpers -------------------------------------------------------------------------------
    def _fallback(self, out) -> None:
        """Not a call after all: what was taken for its head is text."""
        out.append(TextPart(self.raw))
        self.raw = ""
        self.state = "text"
        if self.final and self.buf:
            out.append(TextPart(self.buf))
            self.buf = ""

    def _schema_props(self) -> dict:
        schema = self.tools.get(self._name) or {}
        props = schema.get("properties") if isinstance(schema, dict) else None
        return props if isinstance(props, dict) else {}


def _merge(events: list) -> list:
    """Join neighbouring text parts and argument fragments of one call; fill in arguments_json."""
    out: list = []
    for ev in events:
        if out and isinstance(ev, TextPart) and isinstance(out[-1], TextPart):
            out[-1] = TextPart(out[-1].text + ev.text)
        elif out and isinstance(ev, CallArgs) and isinstance(out[-1], CallArgs) and out[-1].index == ev.index:
            out[-1] = CallArgs(ev.index, out[-1].delta + ev.delta)
        elif not (isinstance(ev, TextPart) and not ev.text):
            out.append(ev)
    return out


def parse_all(text: str, tools: dict | None = None, tolerant: bool = False) -> tuple[str, list[ToolCall]]:
    """Parse a whole answer at once: (text outside calls, calls)."""
    p = ToolCallParser(tools, tolerant)
    events = p.feed(text) + p.finish()
    return "".join(e.text for e in events if isinstance(e, TextPart)), p.calls
