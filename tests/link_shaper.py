"""A loopback TCP relay that behaves like a slow link: a round-trip delay and a bandwidth limit, both ways.

``LinkShaper(upstream_port, rtt_s=0.050, rate=10e6)`` listens on 127.0.0.1 (a free port) and relays
every connection to 127.0.0.1:upstream_port. Each direction is modelled as a link of its own: a
byte leaves the sender's end no sooner than the link has finished sending the bytes before it (at
``rate`` bytes a second) and arrives ``rtt_s / 2`` after it left. So a request and its reply cost
one round trip plus their bytes at the rate, as on a real link, and a long reply streams (its first
bytes arrive while the rest is still being sent).

``spawn(...)`` runs one in a process of its own (``python tests/link_shaper.py UPSTREAM ...``), so
that relaying never competes for the measuring process's interpreter lock, as a real link does not.

It counts the bytes it relays each way (``bytes_up``: client to server, ``bytes_down``), which is
what crosses the wire whatever the client or server count themselves.

Bounded: each direction holds at most ``max_buffered`` bytes in flight (the reader waits for the
writer beyond that); it listens on loopback only; and it stops itself ``lifetime_s`` seconds after
it started (or on ``close()``/leaving its ``with`` block), closing every relayed connection. It
runs its asyncio loop on a daemon thread, so synchronous code (the benchmark, a test) can use it.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading

CHUNK = 16 * 1024  # the pacing grain: a 16 KiB piece takes 1.6 ms at 10 MB/s


class LinkShaper:
    def __init__(self, upstream_port: int, rtt_s: float = 0.050, rate: float = 10e6, lifetime_s: float = 600.0,
                 max_buffered: int = 8 << 20):  # fmt: skip
        if rtt_s < 0 or rate <= 0 or lifetime_s <= 0:
            raise ValueError("rtt_s >= 0, rate > 0 and lifetime_s > 0")
        self.upstream, self.rtt_s, self.rate = upstream_port, rtt_s, rate
        self.lifetime_s, self.max_buffered = lifetime_s, max_buffered
        self.bytes_up = self.bytes_down = 0
        self.connections = 0
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._main, name="link-shaper", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the link shaper did not start within 30 s")
        if self._error is not None:
            raise RuntimeError(f"the link shaper could not start: {self._error}")

    # ------------------------------------------------------------------ use from any thread
    def url(self, url: str) -> str:
        """``url`` (a ws://127.0.0.1:PORT/... line) with the upstream port replaced by the shaper's."""
        return url.replace(f":{self.upstream}/", f":{self.port}/")

    @property
    def total_bytes(self) -> int:
        return self.bytes_up + self.bytes_down

    @property
    def running(self) -> bool:
        return not self._stopped.is_set()

    def close(self, timeout: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not self._stopped.is_set():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has just closed on its own
                pass
        self._thread.join(timeout)

    def __enter__(self) -> LinkShaper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop's thread
    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._stopped.set()
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        writers: list[asyncio.StreamWriter] = []

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
            except OSError:
                writer.close()
                return
            self.connections += 1
            writers.extend((writer, up_w))
            me = asyncio.current_task()
            assert me is not None
            tasks.add(me)
            try:
                await asyncio.gather(self._direction(reader, up_w, "up"), self._direction(up_r, writer, "down"))
            except asyncio.CancelledError:
                pass  # stopped: the writers are closed already; nothing to report
            finally:
                tasks.discard(me)

        try:
            server = await asyncio.start_server(accept, "127.0.0.1", 0)
        except OSError as e:
            self._error = e
            return
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await asyncio.wait_for(self._stop.wait(), self.lifetime_s)
        except asyncio.TimeoutError:  # (not the builtin before 3.11)
            pass  # the lifetime is up: stop as if closed
        server.close()
        for w in writers:
            w.close()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()

    async def _direction(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, way: str) -> None:
        """Relay src to dst as one direction of the link: paced at ``rate``, delivered ``rtt_s / 2`` later."""
        queue: asyncio.Queue = asyncio.Queue()
        room = asyncio.Semaphore(max(1, self.max_buffered // CHUNK))
        one_way = self.rtt_s / 2
        loop = asyncio.get_running_loop()

        async def read() -> None:
            sent_until = 0.0  # when the link finishes sending the bytes queued so far (loop clock)
            try:
                while data := await src.read(CHUNK):
                    for i in range(0, len(data), CHUNK):
                        piece = data[i : i + CHUNK]
                        await room.acquire()
                        sent_until = max(sent_until, loop.time()) + len(piece) / self.rate
                        await queue.put((sent_until + one_way, piece))
            except (OSError, asyncio.IncompleteReadError):
                pass
            await queue.put(None)

        async def write() -> None:
            try:
                while (item := await queue.get()) is not None:
                    due, piece = item
                    if (wait := due - loop.time()) > 0:
                        await asyncio.sleep(wait)
                    # counted before it is written, so a reader that has the bytes sees them counted
                    if way == "up":
                        self.bytes_up += len(piece)
                    else:
                        self.bytes_down += len(piece)
                    dst.write(piece)
                    await dst.drain()
                    room.release()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(read(), write())


class Spawned:
    """A LinkShaper in a child process: ``port``, ``url()``, ``total_bytes`` and ``close()`` as the class's.

    The child ends when told, when its lifetime is up, or when this side goes away (its stdin closes).
    """

    def __init__(self, upstream_port: int, rtt_s: float = 0.050, rate: float = 10e6, lifetime_s: float = 600.0):
        self.upstream = upstream_port
        cmd = [sys.executable, __file__, str(upstream_port), "--rtt-s", repr(rtt_s), "--rate", repr(rate),
               "--lifetime-s", repr(lifetime_s)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the link shaper process did not start: {line!r}")
        self.port = int(line)

    def url(self, url: str) -> str:
        return url.replace(f":{self.upstream}/", f":{self.port}/")

    @property
    def total_bytes(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("bytes\n")
        self.proc.stdin.flush()
        up, down = self.proc.stdout.readline().split()
        return int(up) + int(down)

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the child's loop ends on EOF
            self.proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=15)

    def __enter__(self) -> Spawned:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def spawn(upstream_port: int, rtt_s: float = 0.050, rate: float = 10e6, lifetime_s: float = 600.0) -> Spawned:
    return Spawned(upstream_port, rtt_s, rate, lifetime_s)


def _main() -> None:
    ap = argparse.ArgumentParser(description="relay 127.0.0.1:PORT through a shaped link; prints the port it "
                                 "listens on, then answers 'bytes' lines on stdin with 'UP DOWN'; EOF stops it")  # fmt: skip
    ap.add_argument("upstream", type=int)
    ap.add_argument("--rtt-s", type=float, default=0.050)
    ap.add_argument("--rate", type=float, default=10e6, help="bytes a second, each way")
    ap.add_argument("--lifetime-s", type=float, default=600.0)
    a = ap.parse_args()
    with LinkShaper(a.upstream, a.rtt_s, a.rate, a.lifetime_s) as sh:
        print(sh.port, flush=True)
        for line in sys.stdin:
            if line.strip() != "bytes":
                break
            print(sh.bytes_up, sh.bytes_down, flush=True)


if __name__ == "__main__":
    _main()
