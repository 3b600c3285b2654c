"""A real ``gpt-inspector serve`` process on 127.0.0.1, a free port, and a tiny checkpoint the tests saved.

The server runs on one thread like the tests (conftest sets torch to one), so a local session on the
same checkpoint computes the very same bits. Every process started here is killed in a finalizer.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from on_device import DEVICE

START_TIMEOUT = 180  # a loaded 2-core machine: importing torch and the self-test take their time
ROOT = Path(__file__).resolve().parents[2]


class Served:
    """One server process: its URL (the line it printed), its stderr so far, and a way to stop it."""

    def __init__(self, model: Path, workdir: Path, *extra: str):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.recipe = workdir / "recipe.json"
        cmd = [sys.executable, "-m", "gpt_inspector", "serve", "--model", str(model), "--device", DEVICE,
               "--bind", "127.0.0.1:0", "--recipe-out", str(self.recipe), *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir,
                                     env=env)  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err.append), daemon=True).start()
        try:
            self.url = self.lines.get(timeout=START_TIMEOUT).strip()
        except queue.Empty:
            self.kill()
            raise AssertionError(
                f"serve printed no URL within {START_TIMEOUT} s; stderr: {''.join(self.err)}"
            ) from None
        self.port = int(self.url.split(":")[2].split("/")[0])

    @staticmethod
    def _pump(stream, put):
        for line in stream:
            put(line)

    def interrupt(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A saved tiny Llama (grouped-query attention: 4 query heads read 2 KV heads) whose tokenizer has a
    chat template (the turns of a chat prompt are rendered by the engine)."""
    import tiny_chat
    import tiny_models

    folder = tmp_path_factory.mktemp("remote-model")
    return tiny_chat.with_template(tiny_models.build(folder / "base", "llama"), folder / "llama")


@pytest.fixture
def serve(tmp_path_factory, tiny_llama):
    """``serve(*extra_flags)`` starts a server on the tiny Llama; each is killed when the test ends."""
    started = []

    def start(*extra: str) -> Served:
        s = Served(tiny_llama, tmp_path_factory.mktemp("serve"), *extra)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_llama):
    """One server for every remote test that needs no server of its own (each test opens its own
    session and closes its client: the server takes one at a time)."""
    s = Served(tiny_llama, tmp_path_factory.mktemp("serve"))
    yield s
    s.kill()


# a client that closed frees the slot within a second; one left open holds it for as long as it lives
SLOT_FREE_S = 15


@pytest.fixture(autouse=True)
def slot_given_back(request):
    """After every test on the shared ``server``: a new client gets in. A test that leaves a client open
    fails here, by its own name, instead of the next test on the server failing with "another client"."""
    srv = request.getfixturevalue("server") if "server" in request.fixturenames else None
    yield
    if srv is None:
        return
    from gpt_inspector.remote.client import RemoteRefused, RemoteSession

    deadline = time.monotonic() + SLOT_FREE_S
    while True:
        try:
            RemoteSession(srv.url, timeout=20).close()
            return
        except RemoteRefused as e:
            if "another client" not in str(e) or time.monotonic() > deadline:
                raise AssertionError(f"the engine's one client slot is still held {SLOT_FREE_S} s after the "
                                     f"test: {e}") from None  # fmt: skip


@pytest.fixture(scope="session")
def local_lm(tiny_llama):
    from gpt_inspector import load_model

    return load_model(tiny_llama, device=DEVICE)


class Proxy:
    """A TCP relay on loopback between a client and the server, whose link the test can stall or cut.

    ``stalled``: bytes are swallowed and the sockets stay open (a pulled cable); ``cut()``: every link
    relayed so far ends at both sides; ``block()``:
    cut, and nothing listens on the port until ``unblock()``. ``trip``: called once, in place of relaying it,
    with the first bytes from the engine that carry a long job's progress note (the job is then running)."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.stalled = threading.Event()
        self.trip = None
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.port = 0
        self._listen()

    def url(self, url: str) -> str:
        return url.replace(f":{self.upstream}/", f":{self.port}/")

    def _listen(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))  # the same port again after a block
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        while True:
            try:
                a, _ = listener.accept()
            except OSError:  # closed: blocked, or the test is over
                return
            try:
                b = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # no engine behind (stopped, not yet restarted): the window's attempt fails as it would
                a.close()
                continue
            self.pairs.append((a, b))
            threading.Thread(target=self._pipe, args=(a, b, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(b, a, True), daemon=True).start()

    def _pipe(self, src, dst, from_engine: bool) -> None:
        try:
            while data := src.recv(65536):
                trip = self.trip if from_engine and b'"progress"' in data else None
                if trip is not None:
                    self.trip = None
                    trip()
                if not self.stalled.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        for pair in self.pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass
        self.pairs.clear()

    def _stop_listening(self) -> None:
        try:  # wakes the thread blocked in accept(), which a close alone leaves listening
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()

    def block(self) -> None:
        self._stop_listening()
        self.cut()

    def unblock(self) -> None:
        self._listen()

    def close(self) -> None:
        self._stop_listening()
        self.cut()


@pytest.fixture
def proxy():
    made = []

    def make(port: int) -> Proxy:
        p = Proxy(port)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
