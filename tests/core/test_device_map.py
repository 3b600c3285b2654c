"""Big models: a device map through accelerate (here a tiny model split between the CPU and disk
offload), capture wherever a layer runs, and refusals before any weight is allocated."""

from __future__ import annotations

import os

import pytest
import torch

import gpt_inspector as gi
from gpt_inspector.cli import main
from gpt_inspector.core import validate
from gpt_inspector.core.errors import InspectorError

pytest.importorskip("accelerate")

PROMPT = "She eats an apple. He reads"


def _weights(folder) -> int:
    return sum(os.path.getsize(f) for f in folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def split_lm(tiny_dir, tmp_path_factory):
    """The tiny llama with room on the CPU for about three quarters of its weights: the rest on disk."""
    folder = tiny_dir["llama"]
    off = tmp_path_factory.mktemp("offload")
    lm = gi.load_model(folder, device_map="auto", max_memory={"cpu": int(_weights(folder) * 0.76)}, offload_folder=off)
    return lm


def test_split_between_cpu_and_disk_equals_hf(split_lm, hf_eager):
    lm = split_lm
    placed = set(lm.device_map.values())
    assert placed == {"cpu", "disk"}, lm.device_map  # really split, both ways
    assert "layers" in " ".join(k for k, v in lm.device_map.items() if v == "disk") or "lm_head" in lm.device_map
    assert "device map" in lm.describe()
    s = gi.Session(lm, PROMPT)
    s.run(5)
    hf = hf_eager("llama")
    ids = torch.tensor([s.tokens[:-1]])  # every position that was fed
    with torch.inference_mode():
        out = hf(ids, output_attentions=True)
    ref_logits = out.logits[0]  # (T, V)
    scale = float(ref_logits.abs().max())
    for st in s.steps_done:
        torch.testing.assert_close(st.logits, ref_logits[st.position], rtol=0, atol=2e-5 * scale)
    for layer in range(lm.n_layers):
        for head in range(lm.n_heads):
            torch.testing.assert_close(torch.as_tensor(s.attention(layer, head)), out.attentions[layer][0, head],
                                       rtol=0, atol=2e-5)  # fmt: skip
    # the tokens HF's own generate chooses on the unsplit model
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([s.prompt_ids]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert s.tokens == gen[0].tolist()


def test_mask_edit_and_step_back_on_a_split_model(split_lm, tiny_lm):
    """The recompute and the rollback touch caches whose layers ran in different places."""
    one = gi.Session(tiny_lm("llama"), PROMPT)
    split = gi.Session(split_lm, PROMPT)
    for s in (one, split):
        s.run(4)
        s.set_mask_edits([gi.MaskEdit(query=3, key=1, layer=1)])
        s.step_back()
        s.run(2)
    assert one.tokens == split.tokens
    torch.testing.assert_close(
        split.current.logits, one.current.logits, rtol=0, atol=1e-5 * float(one.current.logits.abs().max())
    )


def test_too_big_for_max_memory_without_an_offload_folder_is_refused_before_loading(tiny_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(InspectorError, match="offload-folder") as e:
        gi.load_model(tiny_dir["llama"], device_map="auto", max_memory="cpu=1000")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw,match", [
    ({"device_map": "everywhere"}, "--device-map must be one of"),
    ({"max_memory": "cpu=1GiB"}, "add --device-map"),
    ({"offload_folder": "x"}, "add --device-map"),
    ({"device_map": "auto", "max_memory": "cpu:1GiB"}, "DEVICE=SIZE"),
    ({"device_map": "auto", "max_memory": "gpu=1GiB"}, "GPU indices"),
    ({"device_map": "auto", "max_memory": "cpu=0"}, "above zero"),
    ({"device_map": "auto", "max_memory": "cpu=12 parsecs"}, "a size such as"),
    ({"device_map": "auto", "max_memory": "0=2²GiB"}, "a size such as"),
    ({"device_map": "auto", "max_memory": "²=2GiB"}, "GPU indices"),
    ({"device_map": "auto", "max_memory": "٣=2GiB"}, "GPU indices"),
    ({"device_map": "auto", "device": "cpu"}, "give one of them"),
])  # fmt: skip
def test_bad_placement_arguments_say_what_to_do(tiny_dir, kw, match):
    with pytest.raises(InspectorError, match=match):
        gi.load_model(tiny_dir["llama"], **kw)


def test_max_memory_parsing():
    assert validate.max_memory("0=20GiB, cuda:1=512MB,cpu=2e9,disk=100") == {
        0: 20 * 2**30,
        1: 512 * 10**6,
        "cpu": 2 * 10**9,
        "disk": 100,
    }
    assert validate.max_memory({"cpu": "1GiB"}) == {"cpu": 2**30}
    assert validate.max_memory("") is None and validate.device_map("none") is None
    with pytest.raises(InspectorError, match="twice"):
        validate.max_memory("cpu=1GB,cpu=2GB")


def test_cli_device_map_runs_and_bad_max_memory_exits_2(tiny_dir, tmp_path, capsys):
    folder = tiny_dir["llama"]
    out = tmp_path / "t.safetensors"
    common = ["--model", str(folder), "--prompt", "She eats", "--steps", "2", "--out", str(out)]
    rc = main(["trace", *common, "--device-map", "auto", "--max-memory", f"cpu={int(_weights(folder) * 0.76)}",
               "--offload-folder", str(tmp_path / "off")])  # fmt: skip
    assert rc in (0, None) and out.exists()
    capsys.readouterr()
    common[-1] = str(tmp_path / "never.safetensors")
    for bad, match in ((["--device-map", "auto", "--max-memory", "cpu=lots"], "--max-memory cpu"),
                       (["--device-map", "auto", "--max-memory", "cpu=1000"], "--offload-folder"),
                       (["--max-memory", "cpu=1GiB"], "--device-map")):  # fmt: skip
        try:
            rc = main(["trace", *common, *bad])
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and match in err and "Traceback" not in err, err
