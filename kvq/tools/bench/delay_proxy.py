"""A TCP proxy on loopback that delays every byte by half a round trip each way: WAN latency
for a benchmark without root (no `tc netem`).

Each direction of each connection is a queue of (due time, chunk): a chunk read at t is written
at t + rtt/2, in order, so bandwidth is unchanged and only latency is added. It runs an asyncio
loop on a daemon thread; `close()` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time


class DelayProxy:
    """`listen_host`:`port` -> `upstream_host`:`upstream_port`, adding `rtt_ms` per round trip
    (`listen_host`: loopback unless a bench gives the address of a device it made)."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        rtt_ms: float,
        listen_host: str = "127.0.0.1",
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self.delay_s = max(0.0, rtt_ms) / 2000.0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, self.listen_host, 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self._writers.add(up_writer)
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(chunk)
                await dst.drain()

        sender = asyncio.create_task(send())
        try:
            while chunk := await src.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, chunk))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(ConnectionError, OSError):
            await sender
        with contextlib.suppress(ConnectionError, OSError):
            dst.close()

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for w in self._writers:
                w.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in self._writers:
                with contextlib.suppress(ConnectionError, OSError):
                    await w.wait_closed()
            if self._server is not None:
                await self._server.wait_closed()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
