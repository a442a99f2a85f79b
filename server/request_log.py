"""`--request-log-jsonl FILE`: one JSON object per line, flushed per event, rotated by size.

Events: `server_start` (configuration), `request_done` (protocol, finish reason, prompt / cached /
completion tokens, queue / prefill / decode / total seconds, TTFT), `request_error` (status, type,
message). No prompt or response text is logged.

Rotation: when a write would take FILE past `max_mib`, FILE becomes FILE.1 (FILE.1 becomes FILE.2, ...)
and FILE.{keep} is deleted; keep 0 means FILE is simply started afresh.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

SCHEMA = "ninfer_serve_request_log"
VERSION = 1


class RequestLog:
    def __init__(self, path, max_mib: float = 64.0, keep: int = 3):
        self.path = Path(path)
        self.max_bytes = int(max_mib * (1 << 20)) if max_mib and max_mib > 0 else 0
        self.keep = max(0, int(keep))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        now = time.time()
        rec = {"schema": SCHEMA, "version": VERSION, "event": event,
               "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"}
        rec.update(fields)
        line = json.dumps(rec, ensure_ascii=False, separators=(",", ":"), default=str) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            if self._f is None:
                return
            if self.max_bytes and self._f.tell() > 0 and self._f.tell() + len(data) > self.max_bytes:
                self._rotate()
            self._f.write(line)
            self._f.flush()

    def _rotate(self) -> None:
        self._f.close()
        if self.keep == 0:
            self.path.unlink(missing_ok=True)
        else:
            Path(f"{self.path}.{self.keep}").unlink(missing_ok=True)
            for i in range(self.keep - 1, 0, -1):
                src = Path(f"{self.path}.{i}")
                if src.exists():
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._f = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


class NullLog:
    def write(self, event: str, **fields) -> None:
        pass

    def close(self) -> None:
        pass
