"""RequestStreams: the outputs of one API request's engine requests, read as one stream,
which a shutdown can end at once."""
import asyncio
import contextlib
from collections.abc import AsyncIterator

from jaxllm.outputs import RequestOutput

# A request enters the engine in its reader's first step (~0.3 ms: the engine's checks, the
# message to the core): a request of 1000 prompts enters this many per loop iteration, not
# all in one, which held the event loop (and /health) for 0.3 s.
_ADDS_PER_STEP = 32


class ServerShuttingDown(Exception):
    """What a request's outputs end with when the server stops it to shut down."""


class RequestFailed(Exception):
    """The engine failed a request (its output carries the error)."""


class RequestStreams:
    """The engine requests of one API request (one per prompt), their outputs interleaved as
    they come: each request is read by a task of its own into one small queue. A consumer
    that falls behind leaves outputs in AsyncLLM, which merges a request's DELTA outputs: a
    slow client gets fewer, larger chunks, and the server does less work per token, not
    more. Closing aborts every unfinished request; `stop` does too, and the consumer then
    gets ServerShuttingDown."""

    def __init__(self, streams: list[AsyncIterator[RequestOutput]]):
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._num_streams = self._live = len(streams)
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
        self._stopping = False
        self._tasks = [asyncio.ensure_future(self._read(i, s)) for i, s in enumerate(streams)]

    async def _read(self, i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            for _ in range(i // _ADDS_PER_STEP):
                await asyncio.sleep(0)
            async with contextlib.aclosing(stream):  # closing the engine's generator aborts the request
                async for out in stream:
                    await self._queue.put((i, out))
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            asyncio.current_task().uncancel()  # stop() cancelled this reader, to tell the consumer
            await self._queue.put((i, ServerShuttingDown()))
        except Exception as e:
            await self._queue.put((i, e))
        else:
            await self._queue.put((i, None))

    async def _next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any request; None once all have ended. Raises what a request raised."""
        while self._live:
            i, item = await self._queue.get()
            if item is None:
                self._live -= 1
            elif isinstance(item, Exception):
                self.close()
                raise item
            else:
                return i, item
        return None

    async def first_outputs(self) -> list[RequestOutput]:
        """Each request's first output; if one fails (or this is cancelled), all are aborted."""
        firsts: dict[int, RequestOutput] = {}
        try:
            while len(firsts) < self._num_streams:
                item = await self._next()
                if item is None:
                    raise RuntimeError("a request ended without an output")
                self._buffer.append(item)
                firsts.setdefault(item[0], item[1])
        except BaseException:
            self.close()
            raise
        return [firsts[i] for i in range(self._num_streams)]

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, from the first outputs on."""
        try:
            while self._buffer:
                yield self._buffer.pop(0)
            while (item := await self._next()) is not None:
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort what has not finished: each reader, cancelled, closes its request's stream.
        Nothing here awaits, so it completes even inside a cancelled task."""
        for task in self._tasks:
            task.cancel()

    def stop(self) -> None:
        """End every request now, for a shutdown: the consumer gets ServerShuttingDown."""
        self._stopping = True
        self.close()
