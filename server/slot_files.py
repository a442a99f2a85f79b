"""llama.cpp's slot save / restore: `POST /slots/{id}?action=save|restore|erase` (ninfer-serve --slot-save-path DIR).

A lane retained by prefix caching (a finished request's prompt, its KV pages and GDN states) is written to a file
in DIR, read back into a lane, or given back. The engine's part runs on the scheduler's worker between steps (the
device copies); the file is written and read on an executor thread, so running streams only wait for the copies.
"""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from ..runtime.cache import CapacityError
from ..runtime.lane_image import read_lane_image, write_lane_image
from .errors import ApiError
from .state import state_of

ACTIONS = ("save", "restore", "erase")


def _filename(body) -> str:
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name or len(name) > 255 or name in (".", "..") or name.startswith(".") \
            or any(c in name for c in "/\\\0"):
        raise ApiError(400, "filename must be a plain file name (no path, not hidden, at most 255 characters)",
                       code="invalid_filename", param="filename")
    return name


async def slot_action(request: web.Request) -> web.Response:
    state = state_of(request)
    folder, sched = state.config.slot_save_path, state.scheduler
    if folder is None or not sched.engine.cache.prefix_caching:
        raise ApiError(501, "slot actions are off: start ninfer-serve with --slot-save-path DIR (and prefix caching)",
                       code="not_supported")
    try:
        slot = int(request.match_info["id"])
    except ValueError:
        slot = -1
    if not 0 <= slot < sched.max_seqs:
        raise ApiError(404, f"no slot {request.match_info['id']!r}: slots are 0..{sched.max_seqs - 1}",
                       code="invalid_slot")
    action = request.query.get("action")
    if action not in ACTIONS:
        raise ApiError(400, f"action must be one of {', '.join(ACTIONS)}, got {action!r}", param="action")
    engine, loop, t0 = sched.engine, asyncio.get_running_loop(), time.perf_counter()
    if action == "erase":
        n = await sched.call(lambda: engine.cache.erase_lane(slot))
        return web.json_response({"id_slot": slot, "n_erased": n})
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the body must be JSON: {\"filename\": NAME}", param="filename") from None
    name = _filename(body)
    path = folder / name
    if action == "save":
        try:
            tensors, meta = await sched.call(lambda: engine.lane_image(slot))
        except KeyError:
            raise ApiError(400, f"slot {slot} holds no finished prompt to save", code="invalid_slot") from None
        nbytes = await loop.run_in_executor(None, write_lane_image, path, tensors, meta)
        return web.json_response({"id_slot": slot, "filename": name, "n_saved": len(meta["tokens"]),
                                  "n_written": nbytes, "timings": {"save_ms": 1e3 * (time.perf_counter() - t0)}})
    if not path.is_file():
        raise ApiError(404, f"no saved slot {name!r} in the --slot-save-path folder", code="not_found", param="filename")
    try:
        tensors, meta, nbytes = await loop.run_in_executor(None, read_lane_image, path)
        n = await sched.call(lambda: engine.restore_lane(slot, tensors, meta))
    except ValueError as e:
        raise ApiError(400, f"cannot restore {name!r}: {e}", code="invalid_image", param="filename") from None
    except CapacityError as e:
        raise ApiError(409, f"cannot restore {name!r} into slot {slot}: {e}", code="slot_busy") from None
    return web.json_response({"id_slot": slot, "filename": name, "n_restored": n, "n_read": nbytes,
                              "timings": {"restore_ms": 1e3 * (time.perf_counter() - t0)}})
