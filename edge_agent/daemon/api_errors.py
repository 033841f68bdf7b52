"""Errors of ``edge-agent serve``'s API, in OpenAI's shape: ``{"error": {message, type, ...}}``.

Pure: the request parsers (:mod:`edge_agent.daemon.api_request`) raise :class:`ApiError`; the
server's
middleware (:mod:`edge_agent.daemon.server`) turns it, and aiohttp's own HTTP errors, into
responses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from shared.errors import WanspecError


class ApiError(WanspecError):
    """An error answered in OpenAI's JSON shape.

    ``retry_after``: whole seconds after which the request may succeed (a 503 whose wait for
    a verifier ran out): the ``Retry-After`` header, and ``error.retry_after`` in the body
    (where a stream, its headers long sent, can still say it). ``partial``: members beside
    ``error`` in the body, in the endpoint's own shape (``choices`` with the text generated
    before the failure, ``usage``, ``wanspec``): what a failed generation had produced."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        partial: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.retry_after = retry_after
        self.partial = dict(partial or {})

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        if self.retry_after is not None:
            error["retry_after"] = self.retry_after
        return {**self.partial, "error": error}

    def response(self, **headers: str) -> web.Response:
        if self.retry_after is not None:
            headers.setdefault("Retry-After", str(self.retry_after))
        return web.json_response(self.body(), status=self.status, headers=headers or None)


def bad_request(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    """HTTP 400 about the request field ``param``."""
    return ApiError(400, message, param=param, code=code)


_HTTP_ERROR_TYPES: dict[int, tuple[str, str | None]] = {
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def from_http(e: web.HTTPException) -> ApiError:
    """aiohttp's HTTP error (unknown route, body too large, ...) in OpenAI's shape."""
    type_, code = _HTTP_ERROR_TYPES.get(e.status, ("invalid_request_error", None))
    text = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
    return ApiError(e.status, text.strip(), type_=type_, code=code)
