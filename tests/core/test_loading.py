"""Loading: devices, dtypes, and a clear error for every way a model can be wrong."""

from __future__ import annotations

import shutil

import pytest
import tiny_models
import torch

import gpt_inspector as gi
from gpt_inspector.core.models import resolve_device, resolve_dtype


def test_loads_local_folder_and_reads_shapes(tiny_dir):
    lm = gi.load_model(tiny_dir["llama"], device="cpu", dtype="bfloat16")
    assert lm.dtype == torch.bfloat16 and next(lm.model.parameters()).dtype == torch.bfloat16
    assert (lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim, lm.context_length) == (2, 4, 2, 8, 64)
    assert lm.model.config._attn_implementation == "gpt_inspector"
    s = gi.Session(lm, "One two")
    s.run(2)  # half precision steps too
    assert s.attention(1, 0, "probs").dtype.name == "float32"


def test_a_config_with_per_layer_values_loads_from_its_folder(tmp_path):
    # Gemma 4's full-attention layers have their own head size (per_layer_config); transformers raises on a read
    # of such an attribute off the global config, which the load's shape checks did (a traceback, not a refusal)
    import json

    import tiny_families

    tok = tiny_models.build_tokenizer(tmp_path)
    model = tiny_families.build_model("gemma4_text", tok.convert_tokens_to_ids("<|endoftext|>"))
    assert model.config.is_heterogeneous
    model.save_pretrained(tmp_path)
    lm = gi.load_model(tmp_path, device="cpu")
    s = gi.Session(lm, "One two")
    s.run(2)
    assert [s.qkv(layer)[0].shape[2] for layer in range(2)] == [16, 32]
    # and a per-layer value that cannot work is refused in one line, as a global one is
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["per_layer_config"]["1"]["num_key_value_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(gi.InspectorError, match="4 attention heads over 3 KV heads"):
        gi.load_model(tmp_path, device="cpu")


def test_device_and_dtype_parsing():
    assert resolve_device("auto").type in ("cpu", "cuda", "mps")
    assert resolve_device("CPU") == torch.device("cpu")
    assert resolve_dtype("fp16") == torch.float16 and resolve_dtype(None) == torch.float32
    with pytest.raises(gi.InspectorError, match="unknown device"):
        resolve_device("tpu")
    with pytest.raises(gi.InspectorError, match="unknown dtype"):
        resolve_dtype("int8")
    if not torch.cuda.is_available():
        with pytest.raises(gi.InspectorError, match="not available"):
            resolve_device("cuda:0")


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(gi.InspectorError, match="not in the local cache.*run once online or pass a folder"):
        gi.load_model("no-such-org/no-such-model-xyz", device="cpu")


def test_missing_folder():
    with pytest.raises(gi.InspectorError, match="does not exist"):
        gi.load_model("./nowhere/at/all", device="cpu")


def test_pickle_only_folder_refused_unless_opted_in(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_dir["gpt2"], folder)
    m = AutoModelForCausalLM.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(m.state_dict(), folder / "pytorch_model.bin")  # the legacy pickle format
    assert (folder / "pytorch_model.bin").exists()
    with pytest.raises(gi.InspectorError, match="pickle.*--allow-pickle"):
        gi.load_model(folder, device="cpu")
    lm = gi.load_model(folder, device="cpu", allow_pickle=True)
    assert lm.n_layers == 2


def test_encoder_only_and_seq2seq_refused(tmp_path, tiny_dir):
    from transformers import BertConfig, T5Config

    # is_decoder=True (BERT fine-tuned as a decoder) makes its mask causal, not its weights a left-to-right LM
    for name, is_decoder in (("bert", False), ("bert-as-decoder", True)):
        BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                   is_decoder=is_decoder).save_pretrained(tmp_path / name)  # fmt: skip
        (tmp_path / name / "model.safetensors").write_bytes(b"")
        with pytest.raises(gi.InspectorError, match=r"\(bert\) is not supported: encoder-only"):
            gi.load_model(tmp_path / name, device="cpu")
    T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=32).save_pretrained(tmp_path / "t5")
    (tmp_path / "t5" / "model.safetensors").write_bytes(b"")
    with pytest.raises(gi.InspectorError, match="encoder-decoder"):
        gi.load_model(tmp_path / "t5", device="cpu")


def test_missing_tokenizer(tiny_dir, tmp_path):
    folder = tmp_path / "notok"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dir["gpt2"] / name, folder / name)
    with pytest.raises(gi.InspectorError, match="tokenizer"):
        gi.load_model(folder, device="cpu")


def test_remote_code_never_implicit(tmp_path, tiny_dir):
    import json

    folder = tmp_path / "remote"
    shutil.copytree(tiny_dir["gpt2"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    cfg["model_type"] = "evil-remote"
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(gi.InspectorError, match="trust-remote-code|trust_remote_code|own Python code"):
        gi.load_model(folder, device="cpu")


def test_a_custom_architecture_loads_when_the_user_opts_in(tmp_path, tiny_dir, hf_eager):
    """--trust-remote-code is honoured all the way: the custom class loads, passes the fidelity
    self-test and steps with the model's own numbers (not refused after its code already ran)."""
    import json

    import numpy as np
    import torch

    folder = tmp_path / "custom"
    shutil.copytree(tiny_dir["gpt2"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(auto_map={"AutoConfig": "custom_model.MyConfig", "AutoModelForCausalLM": "custom_model.MyLM"},
               model_type="my_gpt2", architectures=["MyLM"])  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "custom_model.py").write_text(
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "class MyConfig(GPT2Config):\n    model_type = 'my_gpt2'\n"
        "class MyLM(GPT2LMHeadModel):\n    config_class = MyConfig\n"
    )
    with pytest.raises(gi.InspectorError, match="own Python code"):
        gi.load_model(folder, device="cpu")
    lm = gi.load_model(folder, device="cpu", trust_remote_code=True)
    assert type(lm.model).__name__ == "MyLM" and lm.unverified is None
    s = gi.Session(lm, "She eats an apple.")
    s.run(3)
    with torch.no_grad():
        ref = hf_eager("gpt2")(torch.tensor([s.tokens[:-1]])).logits[0]  # the same weights as plain GPT-2
    for st in s.steps_done:
        np.testing.assert_allclose(st.logits.numpy(), ref[st.position].numpy(), atol=1e-5 * float(ref.abs().max()))
