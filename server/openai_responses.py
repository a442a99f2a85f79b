"""`/v1/responses` (OpenAI Responses): create (JSON or semantic SSE events), retrieve, delete, input items.

`store` (default true) keeps the response and its whole conversation in memory, so a later request can
continue it with `previous_response_id` (its `instructions` are not carried over, as in OpenAI's API)
or point at single items with `item_reference`. Reasoning comes back as a `reasoning` item whose
content is `reasoning_text`; reasoning items sent back as input are rendered where the template keeps
reasoning (inside a tool loop) and dropped otherwise.
"""
from __future__ import annotations

import json
import time

from aiohttp import web

from . import validate as v
from .common import Streamer, check_model, read_json, run
from .errors import ApiError, bad_request
from .generation import Content, Finished, GenRequest, Reasoning, ToolArgs, ToolEnd, ToolStart, fold_system, new_id
from .openai_chat import EFFORTS, content_text
from .response_store import Stored
from .state import state_of

INPUT_PART_TYPES = ("input_text", "output_text", "text", "refusal")


# -- request -------------------------------------------------------------------------------------
def _text_parts(c, where: str) -> str:
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad_request(f"'{where}' must be a string or an array of content parts", where)
    for j, p in enumerate(c):
        p = v.element(p, f"{where}[{j}]")
        if p.get("type") in ("input_image", "input_file", "input_audio"):
            raise ApiError(400, f"'{where}[{j}]': {p.get('type')} is not supported by this server (text only)",
                           code="modality_not_supported", param=f"{where}[{j}]")
        if p.get("type") not in INPUT_PART_TYPES:
            raise bad_request(f"'{where}[{j}].type' must be input_text or output_text, got {p.get('type')!r}",
                              f"{where}[{j}].type")
    return content_text(c, where)


def normalize_items(raw, store, where: str = "input") -> list[dict]:
    """Input items in canonical form, each with an id (item_reference resolved from the store)."""
    if isinstance(raw, str):
        return [{"id": new_id("msg_"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list):
        raise bad_request(f"'{where}' must be a string or an array of input items", where)
    out = []
    for i, it in enumerate(raw):
        w = f"{where}[{i}]"
        it = v.element(it, w)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "item_reference":
            ref = v.string(it, "id", required=True, where=w + ".")
            found = store.item(ref)
            if found is None:
                raise ApiError(404, f"'{w}.id': no stored item '{ref}'", code="item_not_found", param=f"{w}.id")
            out.append(found)
        elif kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"'{w}.role' must be user, system, developer or assistant, got {role!r}", f"{w}.role")
            text = _text_parts(it.get("content"), f"{w}.content")
            part = "output_text" if role == "assistant" else "input_text"
            item = {"id": it["id"] if isinstance(it.get("id"), str) else new_id("msg_"), "type": "message",
                    "role": role, "content": [{"type": part, "text": text}]}
            if role == "assistant":
                item["status"] = "completed"
            out.append(item)
        elif kind == "function_call":
            call_id = v.string(it, "call_id", required=True, where=w + ".")
            name = v.tool_name(it.get("name"), f"{w}.name")
            args = v.string(it, "arguments", required=True, where=w + ".")
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"'{w}.arguments' is not valid JSON", f"{w}.arguments") from None
            if not isinstance(parsed, dict):
                raise bad_request(f"'{w}.arguments' must be a JSON object", f"{w}.arguments")
            out.append({"id": it["id"] if isinstance(it.get("id"), str) else new_id("fc_"), "type": "function_call",
                        "call_id": call_id, "name": name, "arguments": args, "status": "completed"})
        elif kind == "function_call_output":
            call_id = v.string(it, "call_id", required=True, where=w + ".")
            output = it.get("output")
            text = output if isinstance(output, str) else _text_parts(output, f"{w}.output")
            out.append({"id": it["id"] if isinstance(it.get("id"), str) else new_id("fco_"),
                        "type": "function_call_output", "call_id": call_id, "output": text, "status": "completed"})
        elif kind == "reasoning":
            parts = []
            for key in ("content", "summary"):
                arr = it.get(key) or []
                if not isinstance(arr, list):
                    raise bad_request(f"'{w}.{key}' must be an array", f"{w}.{key}")
                for j, p in enumerate(arr):
                    p = v.element(p, f"{w}.{key}[{j}]")
                    if not isinstance(p.get("text"), str):
                        raise bad_request(f"'{w}.{key}[{j}].text' must be a string", f"{w}.{key}[{j}].text")
                if arr and not parts:
                    parts = [p["text"] for p in arr]
            out.append({"id": it["id"] if isinstance(it.get("id"), str) else new_id("rs_"), "type": "reasoning",
                        "summary": [], "content": [{"type": "reasoning_text", "text": "\n\n".join(parts)}]})
        else:
            raise bad_request(f"'{w}.type' {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning, item_reference)", f"{w}.type")
    return out


def items_to_messages(items: list[dict], instructions: str | None) -> list[dict]:
    msgs: list[dict] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    reasoning = None
    for it in items:
        kind = it["type"]
        if kind == "reasoning":
            text = "".join(p.get("text", "") for p in it.get("content") or []) or \
                "".join(p.get("text", "") for p in it.get("summary") or [])
            reasoning = text or None
        elif kind == "message":
            text = "".join(p.get("text", "") for p in it["content"])
            role = "system" if it["role"] == "developer" else it["role"]
            m = {"role": role, "content": text}
            if role == "assistant" and reasoning:
                m["reasoning_content"], reasoning = reasoning, None
            msgs.append(m)
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": json.loads(it["arguments"] or "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and reasoning is None:
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                m = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    m["reasoning_content"], reasoning = reasoning, None
                msgs.append(m)
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return fold_system(msgs)


def parse_tools(raw) -> list[dict] | None:
    def fields(t, w):
        if t.get("type") != "function":
            raise bad_request(f"'{w}.type' {t.get('type')!r}: only function tools are supported", f"{w}.type")
        return t, w + ".", "parameters"
    return v.function_tools(raw, "tools", fields)


def parse_tool_choice(raw, tools):
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request(f"'tool_choice' must be auto, none, required or a function, got {raw!r}", "tool_choice")
        if raw == "required" and not tools:
            raise bad_request("'tool_choice' is 'required' but no tools were given", "tool_choice")
        return raw
    tc = v.element(raw, "tool_choice")
    if tc.get("type") != "function":
        raise bad_request(f"'tool_choice.type' must be 'function', got {tc.get('type')!r}", "tool_choice.type")
    names = [t["function"]["name"] for t in tools or []]
    if tc.get("name") not in names:
        raise bad_request(f"'tool_choice.name' {tc.get('name')!r} is not among the tools "
                          f"({', '.join(names) or 'none'})", "tool_choice.name")
    return {"name": tc["name"]}


def parse(body: dict, state) -> tuple[GenRequest, dict]:
    model = v.string(body, "model", required=True)
    check_model(state, model)
    if body.get("background"):
        raise bad_request("'background' responses are not supported by this server", "background")
    if body.get("conversation") is not None:
        raise bad_request("'conversation' objects are not supported; use previous_response_id", "conversation")
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    instructions = v.string(body, "instructions")
    prev_id = v.string(body, "previous_response_id")
    history: list[dict] = []
    if prev_id is not None:
        prev = state.store.get(prev_id)
        if prev is None:
            raise ApiError(404, f"previous response '{prev_id}' not found (not stored, deleted, or the server "
                                "restarted)", code="previous_response_not_found", param="previous_response_id")
        history = list(prev.conversation)
    items = normalize_items(body.get("input"), state.store)
    thinking = True
    reasoning = v.obj(body, "reasoning") or {}
    effort = v.string(reasoning, "effort", where="reasoning.")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}, got {effort!r}",
                              "reasoning.effort")
        thinking = effort not in ("none", "minimal")
    thinking = v.boolean(body, "enable_thinking", default=thinking)
    text = v.obj(body, "text") or {}
    fmt = v.obj(text, "format", where="text.") or {}
    if fmt.get("type", "text") != "text":
        raise bad_request(f"'text.format.type' {fmt.get('type')!r} is not supported; only 'text' is",
                          "text.format.type")
    tools = parse_tools(body.get("tools"))
    temperature = v.number(body, "temperature", lo=0, hi=2)
    top_p = v.number(body, "top_p", lo=0, hi=1)
    if top_p == 0:
        top_p, temperature = 1.0, 0.0
    top_k = v.integer(body, "top_k", lo=-1)
    sampling = state.text.sampling(temperature=temperature, top_p=top_p, top_k=0 if top_k == -1 else top_k,
                                   seed=v.integer(body, "seed"))
    max_out = v.integer(body, "max_output_tokens", lo=1, hi=1 << 30)
    gr = GenRequest(protocol="responses", messages=items_to_messages(history + items, instructions), tools=tools,
                    tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
                    parallel_tool_calls=v.boolean(body, "parallel_tool_calls", default=True),
                    thinking=thinking, max_tokens=max_out, sampling=sampling, request_id=new_id("resp_", 48))
    metadata = v.obj(body, "metadata") or {}
    opts = dict(stream=v.boolean(body, "stream", default=False), store=v.boolean(body, "store", default=True),
                history=history, items=items, instructions=instructions, previous_response_id=prev_id,
                effort=effort, summary=reasoning.get("summary"), tools_raw=body.get("tools") or [],
                tool_choice_raw=body.get("tool_choice", "auto"), temperature=temperature, top_p=top_p,
                max_output_tokens=max_out, metadata=metadata, created=int(time.time()),
                parallel=gr.parallel_tool_calls)
    return gr, opts


# -- response ------------------------------------------------------------------------------------
def response_obj(state, gr: GenRequest, opts: dict, *, status: str, output: list, fin: Finished | None = None,
                 error: dict | None = None) -> dict:
    usage = None
    incomplete = None
    if fin is not None:
        d = fin.done
        usage = {"input_tokens": d.prompt_tokens, "input_tokens_details": {"cached_tokens": d.cached_tokens},
                 "output_tokens": d.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": fin.reasoning_tokens},
                 "total_tokens": d.prompt_tokens + d.completion_tokens}
        if fin.finish_reason == "length":
            incomplete = {"reason": "max_output_tokens"}
    return {"id": gr.request_id, "object": "response", "created_at": opts["created"], "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": opts["instructions"], "max_output_tokens": opts["max_output_tokens"],
            "model": state.model_id, "output": output, "parallel_tool_calls": opts["parallel"],
            "previous_response_id": opts["previous_response_id"],
            "reasoning": {"effort": opts["effort"], "summary": opts["summary"]}, "store": opts["store"],
            "temperature": opts["temperature"], "text": {"format": {"type": "text"}},
            "tool_choice": opts["tool_choice_raw"], "tools": opts["tools_raw"], "top_p": opts["top_p"],
            "truncation": "disabled", "usage": usage, "user": None, "metadata": opts["metadata"]}


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"id": rid, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else [],
            "status": status}


def _message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(fid: str, call_id: str, name: str, args: str, status: str = "completed") -> dict:
    return {"id": fid, "type": "function_call", "call_id": call_id, "name": name, "arguments": args, "status": status}


def output_items(fin: Finished) -> list[dict]:
    out = []
    if fin.reasoning:
        out.append(_reasoning_item(new_id("rs_"), fin.reasoning))
    if fin.content or not fin.calls:
        out.append(_message_item(new_id("msg_"), fin.content))
    for c in fin.calls:
        out.append(_call_item(new_id("fc_"), new_id("call_"), c.name, c.arguments_json))
    return out


def _status(fin: Finished) -> str:
    return "incomplete" if fin.finish_reason == "length" else "completed"


def store_result(state, gr: GenRequest, opts: dict, resp: dict) -> None:
    if opts["store"] and resp["status"] in ("completed", "incomplete"):
        state.store.put(gr.request_id, Stored(resp, opts["items"], opts["history"] + opts["items"] + resp["output"]))


class ResponsesStreamer(Streamer):
    def __init__(self, writer, gen, opts, state):
        super().__init__(writer)
        self.gen, self.opts, self.state = gen, opts, state
        self.seq = 0
        self.output: list[dict] = []     # finished items, in order
        self.open: dict | None = None    # the item being streamed
        self.text: list[str] = []

    async def ev(self, kind: str, **data) -> None:
        await self.w.send({"type": kind, "sequence_number": self.seq, **data}, event=kind)
        self.seq += 1

    def resp(self, status: str, fin=None, error=None) -> dict:
        return response_obj(self.state, self.gen.req, self.opts, status=status, output=list(self.output), fin=fin,
                            error=error)

    async def start(self) -> None:
        await self.ev("response.created", response=self.resp("in_progress"))
        await self.ev("response.in_progress", response=self.resp("in_progress"))

    async def _open(self, item: dict) -> None:
        await self._close()
        self.open, self.text = item, []
        await self.ev("response.output_item.added", output_index=len(self.output), item=dict(item))
        if item["type"] == "message":
            await self.ev("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                          content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        elif item["type"] == "reasoning":
            await self.ev("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                          content_index=0, part={"type": "reasoning_text", "text": ""})

    async def _close(self) -> None:
        item = self.open
        if item is None:
            return
        idx, text = len(self.output), "".join(self.text)
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            await self.ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                          text=text, logprobs=[])
            await self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                          part=part)
            item = _message_item(item["id"], text)
        elif item["type"] == "reasoning":
            await self.ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                          text=text)
            await self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                          part={"type": "reasoning_text", "text": text})
            item = _reasoning_item(item["id"], text)
        else:
            await self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                          name=item["name"], arguments=text)
            item = _call_item(item["id"], item["call_id"], item["name"], text)
        await self.ev("response.output_item.done", output_index=idx, item=item)
        self.output.append(item)
        self.open = None

    async def event(self, e) -> None:
        kind = self.open["type"] if self.open else None
        idx = len(self.output)
        if isinstance(e, Reasoning):
            if kind != "reasoning":
                await self._open(_reasoning_item(new_id("rs_"), "", "in_progress"))
                idx = len(self.output)
            self.text.append(e.text)
            await self.ev("response.reasoning_text.delta", item_id=self.open["id"], output_index=idx,
                          content_index=0, delta=e.text)
        elif isinstance(e, Content):
            if kind != "message":
                await self._open({"id": new_id("msg_"), "type": "message", "role": "assistant",
                                  "status": "in_progress", "content": []})
                idx = len(self.output)
            self.text.append(e.text)
            await self.ev("response.output_text.delta", item_id=self.open["id"], output_index=idx, content_index=0,
                          delta=e.text, logprobs=[])
        elif isinstance(e, ToolStart):
            await self._open(_call_item(new_id("fc_"), new_id("call_"), e.name, "", "in_progress"))
        elif isinstance(e, ToolArgs):
            self.text.append(e.delta)
            await self.ev("response.function_call_arguments.delta", item_id=self.open["id"], output_index=idx,
                          delta=e.delta)
        elif isinstance(e, ToolEnd):
            await self._close()

    async def finish(self, fin: Finished) -> None:
        await self._close()
        if not self.output:  # an empty answer is still one (empty) message
            await self._open({"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                              "content": []})
            await self._close()
        resp = self.resp(_status(fin), fin)
        store_result(self.state, self.gen.req, self.opts, resp)
        await self.ev("response.completed" if resp["status"] == "completed" else "response.incomplete", response=resp)

    async def error(self, err: ApiError) -> None:
        await self.ev("error", code=err.code or "server_error", message=err.message, param=err.param)
        await self.ev("response.failed", response=self.resp("failed", error={"code": err.code or "server_error",
                                                                              "message": err.message}))


def to_json(state, gen, fin: Finished, opts: dict) -> dict:
    resp = response_obj(state, gen.req, opts, status=_status(fin), output=output_items(fin), fin=fin)
    store_result(state, gen.req, opts, resp)
    return resp


async def create(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request)
    gr, opts = parse(body, state)
    return await run(request, state, gr, stream=opts["stream"],
                     make_streamer=lambda w, g: ResponsesStreamer(w, g, opts, state),
                     to_json=lambda g, f: to_json(state, g, f, opts))


def _stored(request: web.Request) -> Stored:
    rid = request.match_info["id"]
    st = state_of(request).store.get(rid)
    if st is None:
        raise ApiError(404, f"no stored response '{rid}'", code="response_not_found", param="response_id")
    return st


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(_stored(request).response)


async def delete(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    if not state_of(request).store.delete(rid):
        raise ApiError(404, f"no stored response '{rid}'", code="response_not_found", param="response_id")
    return web.json_response({"id": rid, "object": "response", "deleted": True})


async def input_items(request: web.Request) -> web.Response:
    items = _stored(request).input_items
    order = request.query.get("order", "desc")
    data = list(reversed(items)) if order == "desc" else list(items)
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": False})
