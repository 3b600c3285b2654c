"""`trace` on models whose cache is not per-head K/V: the real cache bytes, said in the CLI and kept in the trace."""

from __future__ import annotations

import json

import pytest
import tiny_families
import tiny_models
import torch

import gpt_inspector as gi
from gpt_inspector.cli import main


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for family in ("deepseek_v3", "gemma3n_text", "doge"):
        folder = tmp_path_factory.mktemp(family)
        tok = tiny_models.build_tokenizer(folder)
        tiny_families.build_model(family, tok.convert_tokens_to_ids("<|endoftext|>")).save_pretrained(folder)
        out[family] = folder
    return out


def _cache_tensor_bytes(s) -> int:
    return sum(t.numel() * t.element_size() for cl in s.cache.layers for t in (cl.keys, cl.values))


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma3n_text"])
def test_trace_reports_the_real_cache_and_the_trace_keeps_it(family, folders, tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    argv = ["trace", "--model", str(folders[family]), "--device", "cpu", "--prompt", "She eats an apple",
            "--steps", "3", "--out", str(out)]  # fmt: skip
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    s = gi.Session(gi.load_model(folders[family], device="cpu"), "She eats an apple")
    s.run(3)
    # the session keeps every position; the model's own cache (gemma3n's layer 0: a 4-key sliding window) less
    assert data["kv_kept_bytes"] == s.kv_kept_bytes() == _cache_tensor_bytes(s)
    t = s.cache_length
    window = [s.kv_cache_positions(i) for i in range(s.n_layers)]
    assert (
        data["kv_cache_bytes"]
        == s.kv_cache_bytes()
        == sum(s.kv_kept_bytes(i) // t * window[i] for i in range(s.n_layers))
    )
    per_head = sum((k.nbytes + v.nbytes) // t * window[i] for i in range(s.n_layers) for k, v in [s.qkv(i)[1:]])
    assert data["kv_per_head_bytes"] == s.kv_per_head_bytes() == per_head
    if family == "deepseek_v3":
        assert data["kv_cache_bytes"] * 4 < data["kv_per_head_bytes"] and "compressed latent" in data["kv_cache"]
        assert window == [t, t] and data["kv_cache_bytes"] == data["kv_kept_bytes"]
    else:
        assert "layer 2 reads layer 0's cache" in data["kv_cache"]
        assert window == [3, t, 3, t] and data["kv_cache_bytes"] < data["kv_kept_bytes"]
    tr = gi.load_trace(out)  # V's head size differs from K's for MLA: the trace says so and loads
    assert tr.kv_cache_bytes() == data["kv_cache_bytes"] and tr.kv_per_head_bytes() == per_head
    assert tr.kv_kept_bytes() == data["kv_kept_bytes"]
    for layer in range(s.n_layers):
        for ours, saved in zip(s.qkv(layer), tr.qkv(layer)):
            assert ours.shape == saved.shape
        torch.testing.assert_close(torch.from_numpy(tr.attention(layer, 1)), torch.from_numpy(s.attention(layer, 1)))
    assert main(argv + ["--force"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "KV cache: " in out and (family != "deepseek_v3" or "per-head K and V would take" in out)
    assert ("kept for inspection" in out) == (family == "gemma3n_text")


def test_lens_on_a_model_with_several_residual_streams_says_so_in_one_line(folders, capsys):
    rc = main(["lens", "--model", str(folders["gemma3n_text"]), "--device", "cpu", "--prompt", "She eats an apple"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "AltUp" in err and "Traceback" not in err


def test_probe_cache_on_a_latent_cache_says_so_in_one_line(folders, capsys):
    rc = main(
        ["probe-cache", "--model", str(folders["deepseek_v3"]), "--device", "cpu", "--prompt", "She eats an apple"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "latent" in err and "Traceback" not in err


def test_a_model_computed_two_ways_says_at_load_which_the_numbers_are(folders, tmp_path, capsys):
    # doge (like deepseek_v32): its full-sequence forward and its stepped decode can differ; the numbers are the
    # stepped decode's. One line of information on stdout, never on stderr, and not in the middle of JSON
    from gpt_inspector.core.fidelity import STEPPED_NOTE

    argv = ["math-check", "--model", str(folders["doge"]), "--device", "cpu", "--prompt", "She eats", "--steps", "2"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[0] == f"gpt-inspector: note: {STEPPED_NOTE}" and out.err == ""
    assert main(argv + ["--json"]) == 0
    json.loads(capsys.readouterr().out)
    t = tmp_path / "t.safetensors"
    assert main(["trace", "--model", str(folders["doge"]), "--device", "cpu", "--prompt", "She eats", "--steps", "2",
                 "--out", str(t), "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["note"] == STEPPED_NOTE
    # a model computed one way says nothing
    assert main(["math-check", "--model", str(folders["deepseek_v3"]), "--device", "cpu", "--prompt", "She eats"]) == 0
    assert "note" not in capsys.readouterr().out
