"""Typed API errors and each protocol's error envelope.

One `ApiError` is raised anywhere in the server; the middleware (or a stream writer, in-band) renders it
in the envelope of the protocol the route speaks: OpenAI `{"error": {message, type, param, code}}` for
`/v1/chat/completions`, `/v1/responses`, `/v1/models` and the rest; Anthropic
`{"type": "error", "error": {type, message}}` for `/v1/messages*`.
"""
from __future__ import annotations

from ..runtime import scheduler as sched

# status -> (OpenAI type, Anthropic type)
TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    409: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    501: ("not_supported_error", "api_error"),
    503: ("server_error", "overloaded_error"),
    529: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def openai(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, TYPES[500])[0],
                          "param": self.param, "code": self.code}}

    def anthropic(self) -> dict:
        return {"type": "error", "error": {"type": TYPES.get(self.status, TYPES[500])[1], "message": self.message}}

    def body(self, protocol: str) -> dict:
        return self.anthropic() if protocol == "anthropic" else self.openai()

    def status_for(self, protocol: str) -> int:
        # Anthropic signals an overloaded server with 529 (its SDKs retry it); OpenAI clients know 503.
        if protocol == "anthropic" and self.status == 503:
            return 529
        return self.status


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_scheduler(err: sched.SchedulerError) -> ApiError:
    """A scheduler refusal or failure as the API error clients expect."""
    if isinstance(err, sched.ContextTooLong):
        return ApiError(400, str(err), code="context_length_exceeded", param="messages")
    if isinstance(err, sched.InvalidPrompt):
        return ApiError(400, str(err), code="invalid_prompt")
    if isinstance(err, sched.QueueFull):
        return ApiError(429, str(err), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(err, sched.QueueTimeout):
        return ApiError(503, str(err), code="queue_timeout", headers={"Retry-After": "1"})
    if isinstance(err, sched.ShuttingDown):
        return ApiError(503, str(err), code="shutting_down")
    return ApiError(500, str(err), code="internal_error")


def protocol_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"
