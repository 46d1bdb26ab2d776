"""The OpenAI-shaped error a bad request becomes (``{"error": {...}}``, wire.ErrorReply's
shape): what every request model's validation (request_types.api_error) and the router raise.
"""

from __future__ import annotations

from typing import Any, Literal

from cleave.runtime.serving.wire import ErrorDetail, ErrorReply

JSONObject = dict[str, Any]
ErrorType = Literal["invalid_request_error", "not_found_error", "authentication_error",
                    "rate_limit_exceeded", "server_error", "service_unavailable"]


class APIError(Exception):
    """A failure to report to the client as OpenAI does: status code plus an ``error`` body."""

    def __init__(self, status: int, message: str, type: ErrorType = "invalid_request_error",
                 *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type: ErrorType = type
        self.param = param
        self.code = code

    def reply(self) -> ErrorReply:
        return ErrorReply(error=ErrorDetail(message=self.message, type=self.type,
                                            param=self.param, code=self.code))

    def body(self) -> JSONObject:
        return self.reply().model_dump()


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)
