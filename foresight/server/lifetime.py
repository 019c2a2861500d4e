"""Work follows the client: a request's engine work ends when its client leaves or its time is up.

`guarded` re-yields a request's events while watching a deadline and, for non-streaming requests, the
connection (a streaming response notices a disconnect by itself: Starlette cancels it). Each step of
the inner iterator runs in its own task, so giving up is a plain cancel of that task: the cancellation
unwinds the engine's generator, whose `finally` aborts the request in the target worker.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from .errors import ClientGone, OutputStalled, RequestTimedOut

POLL_S = 0.25  # how often a waiting non-streaming request checks its connection


async def _next(it: AsyncIterator):
    return await anext(it)


@dataclass
class _Watch:
    """What `guarded` watches: a deadline (in `loop.time()` seconds) and, at most every `poll_s`, the
    connection — also while outputs arrive faster than that, which would otherwise never leave time to
    look (a fast request would run to its end for a client long gone)."""

    deadline: float | None
    disconnected: Callable[[], Awaitable[bool]] | None
    poll_s: float
    idle_s: float | None = None  # the longest wait for one step (the next output)
    checked_at: float = float("-inf")

    async def wait(self, step: asyncio.Future) -> None:
        """Until `step` is done; raise RequestTimedOut past the deadline, OutputStalled past the idle
        limit, ClientGone once disconnected."""
        loop = asyncio.get_running_loop()
        idle_until = loop.time() + self.idle_s if self.idle_s else None
        while True:
            timeout = self.poll_s if self.disconnected is not None else None
            for limit, error in ((self.deadline, RequestTimedOut), (idle_until, lambda: OutputStalled(self.idle_s))):
                if limit is None:
                    continue
                left = limit - loop.time()
                if left <= 0:
                    raise error()
                timeout = left if timeout is None else min(timeout, left)
            done, _ = await asyncio.wait({step}, timeout=timeout)
            await self._check_connection(loop.time())
            if done:
                return

    async def _check_connection(self, now: float) -> None:
        if self.disconnected is None or now - self.checked_at < self.poll_s:
            return
        self.checked_at = now
        if await self.disconnected():
            raise ClientGone()


async def guarded(events: AsyncIterator, deadline: float | None = None,
                  disconnected: Callable[[], Awaitable[bool]] | None = None,
                  poll_s: float = POLL_S, idle_s: float | None = None) -> AsyncIterator:
    """Re-yield `events`; `deadline` is in `loop.time()` seconds (None: none); `idle_s` bounds the wait
    for each next event (None: none)."""
    if deadline is None and disconnected is None and not idle_s:
        try:
            async for item in events:  # nothing to watch: no task per step
                yield item
        finally:
            await events.aclose()
        return
    it = aiter(events)
    watch = _Watch(deadline, disconnected, poll_s, idle_s)
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(_next(it))
            try:
                await watch.wait(step)
            except (RequestTimedOut, ClientGone):
                step.cancel()
                await asyncio.wait({step})  # the engine has sent its abort before we answer
                raise
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if step is not None and not step.done():
            step.cancel()  # we were cancelled from outside: the step's task unwinds the inner iterator
        else:
            await it.aclose()


_END = object()


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(i, item) from several iterators as their items come (the n choices of one request). One that raises
    ends them all: the others are closed (which aborts their engine requests) and the error goes on to the
    caller; closing this iterator closes them all. One iterator is re-yielded as it is, without tasks."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, None, _END))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, end = await queue.get()
            if end is _END:
                left -= 1
            elif end is not None:
                raise end
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
