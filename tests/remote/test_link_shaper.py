"""The link shaper the remote benchmark measures through: it delays, paces, counts and stops itself.

Only lower bounds on time are asserted (a shaper that forgot to delay or to pace fails them; a
busy machine can only make things slower), plus what it relays being exactly what was sent.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from link_shaper import LinkShaper, spawn

RTT, RATE = 0.050, 10e6


@pytest.fixture
def echo():
    """A loopback echo server (one thread per connection); its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def serve_one(c: socket.socket) -> None:
        try:
            while data := c.recv(65536):
                c.sendall(data)
        except OSError:
            pass
        c.close()

    def accept() -> None:
        while True:
            try:
                c, _ = listener.accept()
            except OSError:
                return
            conns.append(c)
            threading.Thread(target=serve_one, args=(c,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for c in conns:
        try:
            c.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _exchange(port: int, payload: bytes) -> tuple[float, bytes]:
    """Seconds from sending ``payload`` to having all of it echoed back, and what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        threading.Thread(target=s.sendall, args=(payload,), daemon=True).start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = s.recv(65536)
            assert chunk, "the shaper closed the link early"
            got += chunk
        return time.perf_counter() - t0, bytes(got)


def test_a_small_exchange_costs_a_round_trip(echo):
    with LinkShaper(echo, rtt_s=RTT, rate=RATE) as sh:
        for _ in range(3):
            took, got = _exchange(sh.port, b"ping")
            assert got == b"ping"
            assert took >= RTT * 0.98, took  # half the delay each way
        assert (sh.bytes_up, sh.bytes_down) == (12, 12)


def test_a_large_transfer_is_paced_at_the_rate_and_arrives_intact(echo):
    payload = bytes(range(256)) * 2000  # 512,000 bytes: 51 ms each way at 10 MB/s
    with LinkShaper(echo, rtt_s=RTT, rate=RATE) as sh:
        took, got = _exchange(sh.port, payload)
        assert got == payload
        # up and down stream through each other, so: the round trip plus the bytes once at the rate
        # (the last piece leaves no sooner than len/rate after the first, then travels both ways)
        assert took >= (RTT + len(payload) / RATE) * 0.98, took
        assert sh.bytes_up == sh.bytes_down == len(payload)


def test_without_shaping_it_is_a_plain_relay(echo):
    with LinkShaper(echo, rtt_s=0.0, rate=1e12) as sh:
        took, got = _exchange(sh.port, b"x" * 100_000)
        assert got == b"x" * 100_000
        assert sh.total_bytes == 200_000


def test_it_stops_itself_when_its_lifetime_is_up(echo):
    sh = LinkShaper(echo, rtt_s=RTT, rate=RATE, lifetime_s=0.3)
    port = sh.port
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    deadline = time.monotonic() + 20
    while sh.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not sh.running
    assert s.recv(1) == b""  # the relayed connection was closed too
    s.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    sh.close()  # closing a stopped shaper is harmless


def test_in_a_process_of_its_own_it_shapes_counts_and_ends_with_its_parent(echo):
    with spawn(echo, rtt_s=RTT, rate=RATE) as sh:
        took, got = _exchange(sh.port, b"y" * 200_000)
        assert got == b"y" * 200_000
        assert took >= (RTT + 200_000 / RATE) * 0.98, took
        assert sh.total_bytes == 400_000
    assert sh.proc.returncode == 0  # stdin closed: it ended on its own, not killed


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        LinkShaper(1, rtt_s=-1)
    with pytest.raises(ValueError):
        LinkShaper(1, rate=0)
