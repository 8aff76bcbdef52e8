"""What every request meets before a route sees it: the API key and the request-size limit.

Both are plain ASGI middleware, so they cover every path (including FastAPI's own /openapi.json) and
answer before the body is read: a Content-Length over the limit is refused at once, and a chunked body
is counted as it arrives and refused as soon as it passes the limit. The rest of a refused body is never
kept: its connection is closed after the 413, or (a body of a known size up to 4x the limit) uvicorn
reads and drops it, so that a client that sends everything before it reads gets its 413.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashtree.errors import FlashtreeError

OPEN_PATHS = frozenset({"/health"})  # the only route that needs no key
DRAIN_FACTOR = 4


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    @property
    def kind(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 429:
            return "rate_limit_error"
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


def check_api_key(api_key: str | None) -> None:
    """An empty key would let clients that send no header in: refuse it when the server starts."""
    if api_key is None:
        return
    if not api_key.strip():
        raise FlashtreeError("--api-key is empty: give a non-empty key, or leave --api-key out")
    if api_key != api_key.strip() or any(not c.isprintable() for c in api_key):
        raise FlashtreeError("--api-key must not have surrounding spaces or control characters")


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (scheme case-insensitive, RFC 6750)."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _too_large(limit: int, size: int | None) -> APIError:
    what = "The request body" if size is None else f"The request body ({size} bytes)"
    # A body up to DRAIN_FACTOR x the limit is let through and dropped after the answer, so that a client
    # that sends it all before reading sees its 413; a larger one, or a chunked one (of no known end),
    # has its connection closed after the answer.
    close = size is None or size > DRAIN_FACTOR * limit
    return APIError(
        413,
        f"{what} is over this server's limit of {limit} bytes (flashtree serve --max-request-bytes).",
        code="request_too_large",
        headers={"Connection": "close"} if close else None,
    )


class Guard:
    """ASGI middleware: the API key on every path but /health, then the body-size limit.
    `on_reject(path, status)` is told of every request refused here."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_request_bytes: int,
        on_reject: Callable[[str, int], None],
    ):
        self.app, self.api_key, self.limit, self.on_reject = app, api_key, max_request_bytes, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = self._refusal(scope["path"], headers)
        if error is not None:
            self.on_reject(scope["path"], error.status)
            await error.response()(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _refusal(self, path: str, headers: dict[str, str]) -> APIError | None:
        if self.api_key is not None and path not in OPEN_PATHS:
            given = bearer_token(headers.get("authorization", ""))
            if given is None or not secrets.compare_digest(given.encode(), self.api_key.encode()):
                return APIError(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer KEY'.",
                    code="invalid_api_key",
                )
        length = headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > self.limit:  # h11 has refused malformed lengths already
            return _too_large(self.limit, int(length))
        return None

    def _counted(self, receive: Receive) -> Receive:
        """`receive` that raises a 413 once the body read so far is over the limit (chunked bodies)."""
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _too_large(self.limit, None)
            return message

        return counted
