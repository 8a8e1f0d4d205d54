"""Engine streams as HTTP sees them: several merged in arrival order, collected whole while
watching for a client that left, and a streaming response that aborts them however it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.engine.async_engine import (EngineUnavailableError, RequestFailedError,
                                           RequestStream)
from tokenmill.request import RequestOutput
from tokenmill.server.protocol import APIError

# What a stream may end with instead of its last output: said to the client, not logged.
STREAM_ERRORS = (EngineUnavailableError, RequestFailedError, APIError)


def engine_error(e: EngineUnavailableError | RequestFailedError) -> APIError:
    """The API error of an engine that stopped or of a request the engine failed."""
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), "server_error", None, "request_failed")
    return APIError(503, str(e), "server_error", None, "unavailable", {"Retry-After": "5"})


def as_api_error(e: BaseException) -> APIError:
    """One of ``STREAM_ERRORS`` as the API error it is said as."""
    return e if isinstance(e, APIError) else engine_error(e)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """Final outputs of all streams; a client that disconnects aborts them at once (the
    engine logs one line per aborted request; nothing else is said)."""
    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        while True:
            await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in tasks if t.done() and t.exception()), None)
            if failed is not None:
                raise failed.exception()
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
            if await raw.is_disconnected():
                raise APIError(499, "the client disconnected", code="client_disconnected")
    except (EngineUnavailableError, RequestFailedError) as e:
        raise engine_error(e) from None
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()
        # Retrieve what the cancelled tasks ended with, so asyncio has nothing to report.
        await asyncio.gather(*tasks, return_exceptions=True)


class AbortingStreamingResponse(StreamingResponse):
    """Server-sent events that abort their requests however the response ends, even if the
    body was never iterated."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()
