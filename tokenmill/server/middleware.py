"""The app's pure ASGI middleware: the API key on every non-public route, and the body-size
limit (413) applied as a body arrives, before anything parses it."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

from tokenmill.server.protocol import APIError


def error_response(err: APIError) -> JSONResponse:
    """An API error as its HTTP response (OpenAI's ``{"error": {...}}`` body)."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class BearerAuth:
    """Pure ASGI middleware: every route but the ``public`` ones needs ``Authorization: Bearer
    <key>`` (compared in constant time); Anthropic's routes (``/v1/messages``) also take the
    key as ``x-api-key``, as its SDK sends it."""

    def __init__(self, app: Any, api_key: str, public: frozenset[str]):
        self.app = app
        self.expected = api_key.encode()
        self.public = public

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public:
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if scope["path"].startswith("/v1/messages") and b"x-api-key" in headers:
                given = b"Bearer " + headers[b"x-api-key"]
            if not key_matches(given, self.expected):
                await error_response(auth_error())(scope, receive, send)
                return
        await self.app(scope, receive, send)


def key_matches(authorization: bytes, api_key: bytes | str) -> bool:
    """Whether an Authorization header is ``Bearer <api_key>`` (the key compared in constant
    time; the scheme's case does not matter, RFC 9110)."""
    expected = api_key.encode() if isinstance(api_key, str) else api_key
    scheme, _, key = authorization.partition(b" ")
    return hmac.compare_digest(key.strip(), expected) and scheme.lower() == b"bearer"


def auth_error() -> APIError:
    return APIError(401, "Incorrect or missing API key: send Authorization: Bearer <key>",
                    "authentication_error", None, "invalid_api_key")


class BodyLimit:
    """Pure ASGI middleware: a body over ``max_bytes`` is answered 413 as soon as its declared
    length says so, without reading it; a body without a length (chunked) is read up to the
    limit first."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:  # the HTTP server delivers no more than it declares
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks, size, message = [], 0, {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        err = APIError(413, f"the request body is larger than this server takes "
                       f"({self.max_bytes} bytes, --max-request-bytes)", param=None,
                       code="request_too_large")
        await error_response(err)(scope, receive, send)

