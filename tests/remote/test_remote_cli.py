"""Bad input at the front doors of the remote engine: one line, exit 2 (serve) or one InspectorError (connect)."""

from __future__ import annotations

import socket

import pytest

import gpt_inspector as gi
from gpt_inspector.cli import main
from gpt_inspector.remote.client import LinkLost


@pytest.mark.parametrize("bind", ["nonsense", "127.0.0.1:", "127.0.0.1:99999", ":8000", "127.0.0.1:http"])
def test_serve_refuses_a_bad_bind_before_loading_anything(bind, capsys):
    assert main(["serve", "--bind", bind, "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bind takes HOST:PORT" in err


def test_serve_on_a_port_already_taken_says_so_in_one_line(tiny_llama, capsys, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(tiny_llama), "--device", "cpu", "--bind", f"127.0.0.1:{port}",
                     "--recipe-out", str(tmp_path / "r.json")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


def test_connect_refuses_what_is_not_a_serve_url_and_an_engine_that_is_not_there():
    with pytest.raises(gi.InspectorError, match="ws://HOST:PORT") as e:
        gi.connect("http://127.0.0.1:1/?token=secret")
    assert "secret" not in str(e.value)
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # free once closed: nothing listens there
    with pytest.raises(LinkLost, match="cannot reach the engine") as e:
        gi.connect(f"ws://127.0.0.1:{port}/?token=secret", timeout=5)
    assert "\n" not in str(e.value) and "secret" not in str(e.value)


def test_serve_refuses_a_recipe_it_cannot_read_before_loading_anything(tmp_path, capsys):
    bad = tmp_path / "r.json"
    bad.write_text('{"format": "something else"}')
    for path, words in (
        (tmp_path / "missing.json", "cannot read the recipe"),
        (bad, "not a gpt-inspector session recipe"),
    ):
        assert main(["serve", "--restore", str(path), "--model", "/no/such/model"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err
