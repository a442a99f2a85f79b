"""Field checks for request bodies: each failure is a 400 naming the field, what it got and what is allowed."""
from __future__ import annotations

import json
import math

from .errors import bad_request

_MISSING = object()


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def parse_json(body: bytes):
    """The request body as a JSON object (NaN/Infinity and non-UTF-8 refused)."""
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None

    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        doc = json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise bad_request("the request body nests too deeply") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise bad_request(f"the request body must be a JSON object, got {_kind(doc)}")
    return doc


def string(obj: dict, key: str, *, required: bool = False, where: str = "", allow_empty: bool = True,
           default=None) -> str | None:
    name = where + key
    v = obj.get(key, _MISSING)
    if v is _MISSING or v is None:
        if required:
            raise bad_request(f"'{name}' is required", name)
        return default
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {_kind(v)}", name)
    if not allow_empty and not v:
        raise bad_request(f"'{name}' must not be empty", name)
    return v


def boolean(obj: dict, key: str, *, default: bool | None = None, where: str = "") -> bool | None:
    name = where + key
    v = obj.get(key, None)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {_kind(v)}", name)
    return v


def integer(obj: dict, key: str, *, lo: int | None = None, hi: int | None = None, required: bool = False,
            default: int | None = None, where: str = "") -> int | None:
    name = where + key
    v = obj.get(key, None)
    if v is None:
        if required:
            raise bad_request(f"'{name}' is required", name)
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer, got {_kind(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"within {lo}..{hi}")
        raise bad_request(f"'{name}' must be {rng}, got {v}", name)
    return v


def number(obj: dict, key: str, *, lo: float | None = None, hi: float | None = None, default: float | None = None,
           where: str = "") -> float | None:
    name = where + key
    v = obj.get(key, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a number, got {_kind(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"'{name}' must lie within [{lo}, {hi}], got {v}", name)
    return float(v)


def array(obj: dict, key: str, *, required: bool = False, where: str = "", nonempty: bool = False) -> list | None:
    name = where + key
    v = obj.get(key, None)
    if v is None:
        if required:
            raise bad_request(f"'{name}' is required", name)
        return None
    if not isinstance(v, list):
        raise bad_request(f"'{name}' must be an array, got {_kind(v)}", name)
    if nonempty and not v:
        raise bad_request(f"'{name}' must not be empty", name)
    return v


def obj(o: dict, key: str, *, required: bool = False, where: str = "") -> dict | None:
    name = where + key
    v = o.get(key, None)
    if v is None:
        if required:
            raise bad_request(f"'{name}' is required", name)
        return None
    if not isinstance(v, dict):
        raise bad_request(f"'{name}' must be an object, got {_kind(v)}", name)
    return v


def element(v, name: str) -> dict:
    if not isinstance(v, dict):
        raise bad_request(f"'{name}' must be an object, got {_kind(v)}", name)
    return v


def stop_list(v, name: str, limit: int = 16) -> list[str]:
    """`stop`: a string or an array of strings."""
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request(f"'{name}' must be a string or an array of strings", name)
    if len(v) > limit:
        raise bad_request(f"'{name}' has {len(v)} entries; at most {limit} are allowed", name)
    return [s for s in v if s]


def json_schema(v, name: str) -> dict:
    """A tool's parameter schema: a JSON object (an absent one means no parameters)."""
    if v is None:
        return {"type": "object", "properties": {}}
    if not isinstance(v, dict):
        raise bad_request(f"'{name}' must be a JSON Schema object, got {_kind(v)}", name)
    if "type" in v and v["type"] not in ("object", ["object"]):
        raise bad_request(f"'{name}' must describe an object (type 'object'), got type {v['type']!r}", name)
    props = v.get("properties")
    if props is not None and not isinstance(props, dict):
        raise bad_request(f"'{name}.properties' must be an object, got {_kind(props)}", name)
    for k, p in (props or {}).items():
        if not isinstance(p, (dict, bool)):
            raise bad_request(f"'{name}.properties.{k}' must be a schema object, got {_kind(p)}", name)
    req = v.get("required")
    if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
        raise bad_request(f"'{name}.required' must be an array of strings", name)
    return v


def tool_name(v, name: str) -> str:
    if not isinstance(v, str) or not v:
        raise bad_request(f"'{name}' must be a non-empty string", name)
    if len(v) > 128 or any(c in v for c in "<>\n\r\t "):
        raise bad_request(f"'{name}' must be at most 128 characters without spaces or '<', '>' ({v[:40]!r})", name)
    return v


def function_tools(raw, where: str, element_fields) -> list[dict] | None:
    """A tools array, validated into the chat template's {"type": "function", "function": {...}} shape.
    `element_fields(t, w)` checks one element the protocol's way and returns (d, prefix, schema_key): the
    dict holding name/description/schema, its key path for messages, and the schema's key."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request(f"'{where}' must be an array", where)
    out, seen = [], set()
    for i, t in enumerate(raw):
        w = f"{where}[{i}]"
        d, p, schema_key = element_fields(element(t, w), w)
        name = tool_name(d.get("name"), f"{p}name")
        if name in seen:
            raise bad_request(f"'{p}name': the tool name '{name}' is given twice", f"{p}name")
        seen.add(name)
        fn = {"name": name, "parameters": json_schema(d.get(schema_key), f"{p}{schema_key}")}
        desc = string(d, "description", where=p)
        if desc:
            fn["description"] = desc
        out.append({"type": "function", "function": fn})
    return out or None
