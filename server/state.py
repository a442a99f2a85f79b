"""The server's shared state: configuration, the model's text side, the scheduler, metrics, logs, store."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from .generation import ModelText
from .metrics import Metrics
from .request_log import NullLog
from .response_store import ResponseStore


@dataclass
class ServerConfig:
    model_id: str
    api_key: str | None = None
    max_request_mib: float = 64.0
    default_max_tokens: int = 8192
    tolerant_tool_calls: bool = False
    store_responses: int = 512
    slot_save_path: Path | None = None   # folder of saved slots (POST /slots/{id}?action=save|restore); None: off


@dataclass
class AppState:
    config: ServerConfig
    text: ModelText
    scheduler: object
    metrics: Metrics
    request_log: object = field(default_factory=NullLog)
    store: ResponseStore = field(default_factory=ResponseStore)
    created: int = field(default_factory=lambda: int(time.time()))
    text_hook: object = None     # tests only: GenRequest -> scripted answer text (the engine still runs)

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def max_context(self) -> int:
        return self.scheduler.max_context

    @property
    def default_max_tokens(self) -> int:
        return self.config.default_max_tokens

    @property
    def tolerant_tool_calls(self) -> bool:
        return self.config.tolerant_tool_calls


STATE = web.AppKey("state", AppState)


def state_of(request: web.Request) -> AppState:
    return request.app[STATE]


