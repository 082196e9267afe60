"""The request guard: what every HTTP request must pass before a route sees it.

A pure ASGI middleware (a BaseHTTPMiddleware would interfere with streaming and with
client-disconnect detection), checked in this order:

1. Host: with `allowed_hosts`, the Host header must name one of them (DNS rebinding: a
   hostile page whose name resolves to 127.0.0.1 still sends its own name as Host).
2. Authentication: with API keys, every route but /health and /ping needs
   `Authorization: Bearer KEY`.
3. Content type: a POST must carry `application/json`, which a browser cannot send
   cross-site without a CORS preflight this server never grants (so a hostile page cannot
   post `text/plain` "JSON" to /admin/spec).
4. The body: more than `max_request_bytes` is refused with 413 by its Content-Length before a
   byte is read, or as soon as a chunked body passes the limit; a body not complete within
   `request_read_timeout` seconds gets 408. The body is read here, whole, and replayed to the
   route, so a slow or vanished client never holds a route (or the engine) and a client that
   leaves mid-body is simply dropped: there is no one to answer and nothing to log.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from specscope.config import ServerConfig
from specscope.server.schemas import APIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

OPEN_PATHS = ("/health", "/ping")  # answered without an API key (load balancers, probes)


class _ClientGone(Exception):
    """The client disconnected before its body was complete."""


def host_name(host: str) -> str:
    """'example.com' from a Host header value ('Example.com:8000', '[::1]:8000', '::1')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def bearer_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"").decode("latin-1").strip()
    scheme, _, key = auth.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


class RequestGuard:
    """Host, API-key, content-type and body checks in front of the app (module docstring)."""

    def __init__(self, app: Callable, config: ServerConfig) -> None:
        self.app, self.config = app, config
        self._keys = [k.encode() for k in config.api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        try:
            self._check_headers(scope, headers)
            if scope["method"] not in ("POST", "PUT", "PATCH"):
                await self.app(scope, receive, send)
                return
            body = await self._read_body(receive, headers)
        except APIError as e:
            await _send_error(send, e)
            return
        except _ClientGone:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for http.disconnect, as usual

        await self.app(scope, replay, send)

    def _check_headers(self, scope: Scope, headers: dict[bytes, bytes]) -> None:
        cfg = self.config
        if cfg.allowed_hosts and "*" not in cfg.allowed_hosts:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in cfg.allowed_hosts:
                raise APIError(400, f"the Host header {host!r} is not one this server answers "
                               f"to (--allowed-hosts)", code="invalid_host")
        if self._keys and scope["path"] not in OPEN_PATHS:
            key = bearer_key(headers)
            if key is None:
                raise APIError(401, "this server needs an API key: send the header "
                               "'Authorization: Bearer KEY'", type="authentication_error",
                               code="invalid_api_key")
            given = key.encode()
            if not any(hmac.compare_digest(given, k) for k in self._keys):
                raise APIError(401, "the API key is not valid", type="authentication_error",
                               code="invalid_api_key")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            media = ctype.split(";", 1)[0].strip().lower()
            if media != "application/json":
                shown = repr(ctype) if ctype else "none"
                raise APIError(415, f"the body must be JSON sent with 'Content-Type: "
                               f"application/json' (got {shown})",
                               code="unsupported_media_type")

    async def _read_body(self, receive: Receive, headers: dict[bytes, bytes]) -> bytes:
        limit = self.config.max_request_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                raise APIError(400, "the Content-Length header is not a number") from None
            if n > limit:
                raise too_large(n, limit)
        deadline = time.monotonic() + self.config.request_read_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within "
                               f"{self.config.request_read_timeout:g} s "
                               f"(--request-read-timeout)", code="request_timeout",
                               headers={"Connection": "close"}) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body ({size} bytes or more) is over this server's limit "
                    f"of {limit} bytes (--max-request-bytes)", code="request_too_large",
                    headers={"Connection": "close"})


async def _send_error(send: Send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
