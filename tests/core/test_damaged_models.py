"""Damaged model folders: one InspectorError line each, never a traceback and never random weights."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpt_inspector as gi


def _clone(tiny_dir, tmp_path, name, family="gpt2"):
    d = tmp_path / name
    shutil.copytree(tiny_dir[family], d)
    return d


def _edit_config(d, **kw):
    c = json.loads((d / "config.json").read_text())
    c.update(kw)
    (d / "config.json").write_text(json.dumps(c))


def _weights(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def _save(d, t):
    from safetensors.torch import save_file

    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def truncated(d):
    b = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(b[: len(b) // 2])


def empty(d):
    (d / "model.safetensors").write_bytes(b"")


def mislabelled(d):  # a pickle wearing a .safetensors name
    (d / "model.safetensors").write_bytes(pickle.dumps({"not": "weights"}))


def pickle_not_weights(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps([1, 2, 3]))


def heads_do_not_divide(d):
    _edit_config(d, n_head=5)


def missing_layer(d):
    _save(d, {k: v for k, v in _weights(d).items() if ".h.1." not in k})


def unexpected_weight(d):
    t = _weights(d)
    t["transformer.h.7.attn.c_attn.weight"] = t["transformer.h.0.attn.c_attn.weight"].clone()
    _save(d, t)


def wrong_shape(d):
    t = _weights(d)
    t["transformer.h.0.ln_1.weight"] = t["transformer.h.0.ln_1.weight"][:16].clone()
    _save(d, t)


def config_field_of_wrong_type(d):  # transformers' strict config classes raise their own exception type
    _edit_config(d, n_head="four")


def far_too_large(d):
    # 4.6 TiB of float32 weights in 24 wide layers: counted on the meta device at once (2,000 narrow ones
    # described as much but took seconds to build there)
    _edit_config(d, n_layer=24, n_embd=65536, n_head=64)


def tokenizer_larger_than_vocab(d):
    _edit_config(d, vocab_size=100)
    _save(d, {k: (v[:100].clone() if v.shape[0] == 320 else v) for k, v in _weights(d).items()})


def config_null(d):
    (d / "config.json").write_text("null")


def config_nested_deeply(d):  # json's recursion limit, not a crash
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)


def model_type_a_list(d):
    _edit_config(d, model_type=["gpt2"])


def layer_count_a_float(d):
    _edit_config(d, n_layer=2.5)


def eos_a_mapping(d):
    _edit_config(d, eos_token_id={"x": [1]})


def layers_200_000(d):  # read, then built, one by one: it hung the load
    _edit_config(d, n_layer=200_000)


def layers_10_to_the_9(d):
    _edit_config(d, n_layer=10**9)


def vocabulary_of_zero(d):  # a zero-row embedding is built (torch warns) and then the weights mismatch
    _edit_config(d, vocab_size=0)


def tokenizer_json_not_a_tokenizer(d):
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')


def tokenizer_json_truncated(d):
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {')


DAMAGE = [
    (truncated, "cannot load weights"),
    (empty, "cannot load weights"),
    (mislabelled, "cannot load weights"),
    (pickle_not_weights, "something other than plain tensors"),
    (heads_do_not_divide, "5 does not divide"),
    (config_field_of_wrong_type, "cannot read the config .*'n_head' expected int, got str"),
    (missing_layer, r"missing: transformer\.h\.1\..*12 in all"),
    (unexpected_weight, r"unexpected: transformer\.h\.7"),
    (wrong_shape, "cannot load weights|do not match"),
    (far_too_large, "GiB of weights.*memory"),
    (tokenizer_larger_than_vocab, "tokenizer has 320 tokens but the model's vocabulary has 100"),
    (config_null, "cannot read the config"),
    (config_nested_deeply, "cannot read the config .*RecursionError"),
    (model_type_a_list, "cannot read the config"),
    (layer_count_a_float, "cannot read the config .*n_layer"),
    (eos_a_mapping, "cannot read the config .*eos_token_id"),
    (layers_200_000, "200000 layers; more than 4096 is refused"),
    (layers_10_to_the_9, "1000000000 layers; more than 4096 is refused"),
    (vocabulary_of_zero, "a vocabulary of 0 tokens; it must be positive"),
    (tokenizer_json_not_a_tokenizer, "no usable tokenizer"),
    (tokenizer_json_truncated, "no usable tokenizer"),
]


@pytest.mark.parametrize("damage,match", DAMAGE, ids=[d[0].__name__ for d in DAMAGE])
def test_damaged_folder_is_one_inspector_error(tiny_dir, tmp_path, damage, match):
    d = _clone(tiny_dir, tmp_path, damage.__name__)
    damage(d)
    with pytest.raises(gi.InspectorError, match=match) as e:
        gi.load_model(d, device="cpu", allow_pickle=damage is pickle_not_weights)
    assert "\n" not in str(e.value)


def test_tied_lm_head_is_not_missing(tiny_dir):
    lm = gi.load_model(tiny_dir["gpt2"], device="cpu")  # gpt2 ties lm_head to the embedding
    assert lm.warnings == ()


def test_smaller_tokenizer_than_vocab_loads_with_a_warning(tiny_dir, tmp_path):
    import torch

    d = _clone(tiny_dir, tmp_path, "padded")
    _edit_config(d, vocab_size=384)
    t = _weights(d)
    t = {k: (torch.cat([v, torch.zeros(64, *v.shape[1:])]) if v.shape[0] == 320 else v) for k, v in t.items()}
    _save(d, t)
    lm = gi.load_model(d, device="cpu")
    assert lm.vocab_size == 384 and any("tokenizer only 320" in w for w in lm.warnings)


@pytest.mark.parametrize(
    "damage",
    [missing_layer, truncated, far_too_large, layers_10_to_the_9, config_nested_deeply],
    ids=lambda f: f.__name__,
)
def test_cli_damaged_folder_one_line_in_a_real_process(tiny_dir, tmp_path, damage):
    d = _clone(tiny_dir, tmp_path, damage.__name__)
    damage(d)
    env = dict(os.environ, PYTHONPATH=str(Path(gi.__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "gpt_inspector", "trace", "--model", str(d), "--device", "cpu",
                        "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "o.safetensors")],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(("where", "error", "match"), [
    ("transformers.AutoConfig.from_pretrained", ValueError(), "cannot read the config of .*: ValueError"),
    ("transformers.AutoConfig.from_pretrained", OSError(""), "cannot read the config in .*: OSError"),
    ("transformers.AutoTokenizer.from_pretrained", TypeError(" "), "no usable tokenizer for .*: TypeError"),
])  # fmt: skip
def test_an_error_without_a_message_is_still_one_line(tiny_dir, tmp_path, monkeypatch, where, error, match):
    """A library error with an empty message gave IndexError (the first line of nothing), not the refusal."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_dir["gpt2"], folder)

    def fail(*_a, **_kw):
        raise error

    monkeypatch.setattr(where, fail)
    with pytest.raises(gi.InspectorError, match=match):
        gi.load_model(str(folder))


def test_a_huge_tokenizer_file_is_refused_by_its_size_before_parsing(tiny_dir, tmp_path):
    import resource

    d = _clone(tiny_dir, tmp_path, "bigtok")
    with open(d / "tokenizer.json", "r+b") as f:  # sparse: the size of the file the issue found, no disk used
        f.truncate(50 * 1024 * 1024)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(gi.InspectorError) as e:
        gi.load_model(d, device="cpu")
    assert "tokenizer.json" in str(e.value) and "bytes" in str(e.value) and "\n" not in str(e.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KB: never parsed


def test_weights_stored_as_integers_are_refused_in_one_line(tiny_dir, tmp_path):
    import torch

    d = _clone(tiny_dir, tmp_path, "intweights")
    t = _weights(d)
    name = next(k for k in t if k.endswith("weight"))
    t[name] = (t[name] * 100).to(torch.int32)
    _save(d, t)
    with pytest.raises(gi.InspectorError) as e:
        gi.load_model(d, device="cpu")
    assert name in str(e.value) and "I32" in str(e.value) and "\n" not in str(e.value)


def _backtracking_tokenizer(d):
    t = json.loads((d / "tokenizer.json").read_text())
    t["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False}
    (d / "tokenizer.json").write_text(json.dumps(t))


def test_a_tokenizer_regex_that_backtracks_is_one_line_and_the_model_stays_usable(tiny_dir, tmp_path):
    d = _clone(tiny_dir, tmp_path, "regex")
    _backtracking_tokenizer(d)
    lm = gi.load_model(d, device="cpu")
    with pytest.raises(gi.InspectorError, match="tokenizer failed on this prompt: PanicException") as e:
        gi.Session(lm, "a" * 5000 + "b")  # Oniguruma gives up at its retry limit: bounded, then a Rust panic
    assert "\n" not in str(e.value)
    gi.Session(lm, "aab").step()  # a prompt it can split still runs


def test_cli_tokenizer_panic_prints_one_line_not_rusts_report(tiny_dir, tmp_path):
    d = _clone(tiny_dir, tmp_path, "regex")
    _backtracking_tokenizer(d)
    env = dict(os.environ, PYTHONPATH=str(Path(gi.__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "gpt_inspector", "trace", "--model", str(d), "--device", "cpu",
                        "--prompt", "a" * 5000 + "b", "--steps", "1", "--out", str(tmp_path / "o.safetensors")],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "panicked" not in r.stderr and "tokenizer failed" in r.stderr, r.stderr


def test_a_config_asking_for_a_huge_buffer_is_refused_before_anything_is_built(tmp_path):
    # CTRL's sinusoidal table is a buffer sized by n_positions: no weight grows, the OOM killer came
    from tiny_families import build_model
    from tiny_models import build_tokenizer

    d = tmp_path / "ctrl"
    build_model("ctrl", 0).save_pretrained(d)
    build_tokenizer(d)
    _edit_config(d, n_positions=10**9)
    with pytest.raises(gi.InspectorError, match="GiB of weights and buffers") as e:
        gi.load_model(d, device="cpu")
    assert "\n" not in str(e.value)
