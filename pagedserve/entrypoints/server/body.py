"""BodyLimits: a request body bounded in size (413) and in the time it takes to arrive (408),
decided before anything parses it.

Size: a declared Content-Length over the limit is refused without reading a byte; a chunked
body (no length declared) is refused at the first chunk past it.

Time: a client that sends its headers and then trickles its body (slow-loris on the body)
would hold its connection, and a coroutine waiting for the rest, for as long as it likes;
uvicorn has no timer for it (its keep-alive timer runs between requests only, and
`_HeaderTimeoutProtocol` covers the headers). So the whole body is read here within
`timeout` seconds of its headers, however it is split: a body still incomplete then gets a
408 and the connection is closed. The handler runs only once the body is in, and gets it as
it came (the app reads every body whole anyway, to parse its JSON, and the size bound keeps
that small).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.entrypoints.server.errors import APIError


class BodyLimits:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(_too_large(self.max_bytes), scope, receive, send)
            return
        if chunked or (declared is not None and declared.isdigit() and int(declared) > 0):
            try:
                async with asyncio.timeout(self.timeout):
                    messages = await self._read(receive)
            except TimeoutError:
                await self._refuse(_too_slow(self.timeout), scope, receive, send)
                return
            if messages is None:
                await self._refuse(_too_large(self.max_bytes), scope, receive, send)
                return
            receive = _replay(messages, receive)
        await self.app(scope, receive, send)

    async def _read(self, receive: Receive) -> list[Message] | None:
        """The body's messages, or None once they pass the size limit."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # the client went away; the app will see it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    @staticmethod
    async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        response = error.response()
        response.headers["Connection"] = "close"  # the unread rest of the body stays unread
        await response(scope, receive, send)


def _too_large(max_bytes: int) -> APIError:
    return APIError(f"The request body is larger than the server's limit of {max_bytes} "
                    "bytes (--max-body-size).", 413, code="request_too_large")


def _too_slow(timeout: float) -> APIError:
    return APIError(f"The request body did not arrive within {timeout:g} s of its headers "
                    "(--body-timeout); the connection is closed.", 408, "timeout_error",
                    code="body_timeout")


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives `messages` first, then whatever the connection sends next (a
    disconnect, which streaming responses listen for)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
