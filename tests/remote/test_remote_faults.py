"""Faults: a client that crashes, a link that stalls or is cut, a second client, Ctrl+C on the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.remote.client import LinkLost, RemoteRefused

PROMPT = "The cat sat on the mat"


def test_a_second_client_and_a_wrong_or_missing_token_are_refused_in_one_line(server):
    with gi.connect(server.url, prompt=PROMPT) as first:
        first.step()
        with pytest.raises(RemoteRefused, match="another client is connected") as e:
            gi.connect(server.url, timeout=20)
        assert "\n" not in str(e.value) and "token=" not in str(e.value)
        first.step()  # the first client was not disturbed
        assert first.n_steps == 2
    wrong = server.url[:-4] + ("aaaa" if not server.url.endswith("aaaa") else "bbbb")
    for url in (wrong, server.url.split("?")[0], server.url + "&token=x"):
        with pytest.raises(RemoteRefused, match="valid token is required") as e:
            gi.connect(url, timeout=20)
        assert server.url.split("token=")[1] not in str(e.value)  # the secret is never echoed
    with gi.connect(server.url) as again:  # the slot is free once the first client closed
        assert again.n_steps == 2


def test_a_client_that_crashes_leaves_the_session_for_the_next_one(server, tmp_path):
    script = (
        "import os, sys, gpt_inspector as gi\n"
        "r = gi.connect(sys.argv[1], prompt=sys.argv[2])\n"
        "r.run(4)\n"
        "print(' '.join(map(str, r.tokens)), flush=True)\n"
        "os._exit(3)  # no close, no goodbye: a crash\n"
    )
    out = subprocess.run([sys.executable, "-c", script, server.url, PROMPT], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 3, out.stderr
    tokens = [int(t) for t in out.stdout.split()]
    deadline = time.monotonic() + 30
    while True:  # the server may take a moment to see the dead link go
        try:
            r = gi.connect(server.url, timeout=20)
            break
        except RemoteRefused:
            assert time.monotonic() < deadline, "the crashed client's slot was never freed"
            time.sleep(0.2)
    with r:
        assert r.tokens == tokens and r.n_steps == 4
        r.step()
        assert r.n_steps == 5


def test_a_stalled_link_raises_within_seconds_and_reconnect_gets_the_same_session(server, proxy, local_lm):
    relay = proxy(server.port)
    r = gi.connect(relay.url(server.url), prompt=PROMPT)
    r.run(3)
    relay.stalled.set()  # the cable is pulled: nothing arrives, nothing says goodbye
    t0 = time.monotonic()
    with pytest.raises(LinkLost, match="lost the link .*reconnect") as e:
        r.step()
    assert time.monotonic() - t0 < 10
    assert "\n" not in str(e.value) and "token=" not in str(e.value)
    with pytest.raises(LinkLost):  # still down until a reconnect
        r.tokens and r.step()
    relay.stalled.clear()
    relay.cut()  # the old link ends at the server too, as its pings would end it
    r.reconnect(timeout=30)
    # the step sent into the stall may or may not have reached the server; either way the client
    # now shows what the server holds, and it is what a local session computes for those steps
    s = gi.Session(local_lm, PROMPT)
    s.run(r.n_steps)
    assert r.tokens == s.tokens
    r.step(), s.step()
    assert torch.equal(r.attention_rows(1, 0, s.cache_length), s.attention_rows(1, 0, s.cache_length))
    r.close()


def test_a_cut_link_raises_at_once_and_reconnects(server, proxy):
    relay = proxy(server.port)
    with gi.connect(relay.url(server.url), prompt=PROMPT) as r:
        r.step()
        relay.cut()
        t0 = time.monotonic()
        with pytest.raises(LinkLost):
            r.step()
        assert time.monotonic() - t0 < 5
        r.reconnect(timeout=30)
        assert r.n_steps in (1, 2)
        r.step()


def test_ctrl_c_stops_the_server_cleanly_and_saves_the_recipe(serve, local_lm):
    srv = serve("--prompt", PROMPT, "--temperature", "0.9", "--seed", "5")
    with gi.connect(srv.url) as r:  # the session --prompt opened
        r.run(4)
        r.set_mask_edits([gi.MaskEdit(query=5, key=1, layer=1)])
        r.step_back()
        tokens = list(r.tokens)
    assert srv.interrupt(timeout=60) == 0
    err = "".join(srv.err)
    assert "Traceback" not in err and f"recipe saved to {srv.recipe}" in err
    recipe = json.loads(srv.recipe.read_text())
    again = gi.Session.replay(local_lm, recipe)
    assert again.tokens == tokens
    assert srv.recipe.stat().st_mode & 0o077 == 0  # the prompt is the user's: not readable by others
    with pytest.raises(LinkLost):
        gi.connect(srv.url, timeout=5)
    # a new server started from the recipe serves the very session the stopped one had
    back = serve("--restore", str(srv.recipe))
    with gi.connect(back.url) as r:
        assert r.tokens == tokens and r.mask_edits == [gi.MaskEdit(query=5, key=1, layer=1)]
        assert r.decoding == again.decoding


def test_a_second_stop_signal_during_the_shutdown_is_not_a_traceback(serve):
    # `timeout` or a supervisor forwards SIGTERM after a Ctrl+C; a user presses Ctrl+C twice
    import signal
    import time

    srv = serve("--prompt", PROMPT)
    srv.proc.send_signal(signal.SIGINT)
    for _ in range(20):
        time.sleep(0.05)
        if srv.proc.poll() is not None:
            break
        srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=60) == 0
    time.sleep(0.2)  # the stderr pump drains
    err = "".join(srv.err)
    assert "Traceback" not in err and "Exception ignored" not in err and "recipe saved to" in err, err
