"""Server-sent events over an aiohttp StreamResponse.

`send` writes one event (`event:` line optional, one `data:` line of compact JSON). A write to a client
that has gone raises `ClientGone`, which the protocol handlers turn into a cancel of the request.
"""
from __future__ import annotations

import json

from aiohttp import web


class ClientGone(Exception):
    """The client closed the connection."""


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class SSEWriter:
    def __init__(self, request: web.Request):
        self.request = request
        self.resp: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.resp is not None

    async def start(self) -> None:
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "Connection": "keep-alive", "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(self.request)
        except (ConnectionError, RuntimeError) as e:
            raise ClientGone(str(e)) from None
        self.resp = resp

    async def _write(self, text: str) -> None:
        if self.resp is None:
            await self.start()
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone("the client closed the connection")
        try:
            await self.resp.write(text.encode("utf-8"))
        except (ConnectionError, RuntimeError) as e:  # aiohttp raises ClientConnectionResetError(ConnectionError)
            raise ClientGone(str(e)) from None

    async def send(self, data, event: str | None = None) -> None:
        payload = data if isinstance(data, str) else dumps(data)
        head = f"event: {event}\n" if event else ""
        await self._write(f"{head}data: {payload}\n\n")

    async def comment(self, text: str = "keep-alive") -> None:
        await self._write(f": {text}\n\n")

    async def close(self) -> None:
        if self.resp is not None:
            try:
                await self.resp.write_eof()
            except (ConnectionError, RuntimeError):
                pass
