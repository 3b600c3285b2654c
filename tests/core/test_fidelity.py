"""The load-time fidelity self-test: a model whose numbers through us are not its own is refused."""

from __future__ import annotations

import time

import pytest
import tiny_models
import torch
from transformers import AttentionInterface

import gpt_inspector as gi
from gpt_inspector.cli import main
from gpt_inspector.core import capture, fidelity


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory):
    return tiny_models.build_sinks_model(tmp_path_factory.mktemp("oss"))


attention_that_drops_sinks = tiny_models.attention_that_drops_sinks


def test_a_faithful_model_loads_verified(oss_dir):
    lm = gi.load_model(oss_dir, device="cpu")
    assert lm.unverified is None
    gap, _, tol = fidelity.fidelity_gap(lm)
    assert gap <= tol / 10


def test_a_silently_wrong_model_is_refused_in_one_line(oss_dir):
    with attention_that_drops_sinks(), pytest.raises(gi.InspectorError) as e:
        gi.load_model(oss_dir, device="cpu")
    msg = str(e.value)
    assert "max |diff|" in msg and "at probe position" in msg and "--unverified" in msg and "\n" not in msg


def test_allow_unverified_loads_and_marks_every_reader(oss_dir, as_trace):
    with attention_that_drops_sinks():
        lm = gi.load_model(oss_dir, device="cpu", allow_unverified=True)
        assert lm.unverified and "max |diff|" in lm.unverified
        s = gi.Session(lm, "She eats")
        s.run(2)
        assert s.unverified == lm.unverified
        t = as_trace(s)
    assert t.unverified == lm.unverified
    lm_ok = gi.load_model(oss_dir, device="cpu")
    s_ok = gi.Session(lm_ok, "She eats")
    s_ok.run(2)
    assert s_ok.unverified is None
    assert as_trace(s_ok).unverified is None


def test_cli_refuses_with_exit_2_and_loads_with_unverified(oss_dir, tmp_path, capsys):
    argv = ["trace", "--model", str(oss_dir), "--device", "cpu", "--prompt", "She eats", "--steps", "2",
            "--out", str(tmp_path / "c.safetensors")]  # fmt: skip
    with attention_that_drops_sinks():
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "max |diff|" in err
        assert main([*argv, "--unverified"]) == 0
        assert "UNVERIFIED" in capsys.readouterr().err


def test_a_model_that_crashes_in_our_attention_is_refused_not_a_traceback(oss_dir):
    def crashing(*args, **kwargs):
        raise RuntimeError("shapes this family never sends\nsecond line")

    AttentionInterface.register(capture.ATTN_NAME, crashing)
    try:
        with pytest.raises(gi.InspectorError, match=r"not supported: its forward fails .*RuntimeError") as e:
            gi.load_model(oss_dir, device="cpu")
    finally:
        AttentionInterface.register(capture.ATTN_NAME, capture.inspector_attention)
    assert "\n" not in str(e.value)


class _Unforeseen(Exception):
    """An exception type no loader knows about, raised without a message."""


def test_an_unforeseen_exception_in_the_self_test_is_one_line(tmp_path):
    import tiny_families

    from gpt_inspector.core.models import from_model

    tok = tiny_models.build_tokenizer(tmp_path)
    model = tiny_families.build_model("llama", tok.convert_tokens_to_ids("<|endoftext|>"))
    mlp, calls = model.model.layers[1].mlp, []
    real = mlp.forward

    def fails_after_the_probe(x):
        calls.append(x.shape[1])
        if len(calls) > 1:
            raise _Unforeseen()
        return real(x)

    mlp.forward = fails_after_the_probe
    with pytest.raises(gi.InspectorError) as e:
        from_model(model, tok, "flaky")
    assert calls == [2, fidelity.PROBE_LENGTH - fidelity.STEPPED]  # the probe passed; the self-test's prefill raised
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("flaky (llama) is not supported") and msg.endswith("(_Unforeseen)")


def test_refused_family_from_config_alone(tmp_path):
    from transformers import AutoConfig

    folder = tmp_path / "mla"
    tiny_models.build_tokenizer(folder)
    AutoConfig.for_model("deepseek_v4").save_pretrained(folder)
    from safetensors.torch import save_file

    save_file({"unused": torch.zeros(1)}, folder / "model.safetensors")  # never read: the refusal comes first
    t0 = time.perf_counter()
    with pytest.raises(
        gi.InspectorError, match=r"\(deepseek_v4\) is not supported: sparse multi-head latent attention"
    ):
        gi.load_model(folder, device="cpu")
    assert time.perf_counter() - t0 < 5


def test_every_figure_of_an_unverified_run_carries_the_band(oss_dir, tmp_path, as_trace):
    from gpt_inspector import figures
    from gpt_inspector.core.lens import lens

    with attention_that_drops_sinks():
        lm = gi.load_model(oss_dir, device="cpu", allow_unverified=True)
        s = gi.Session(lm, "She eats")
        s.run(2)
        t = as_trace(s)
        made = [figures.head_figure(s, 0, 1), figures.grid_figure(t, None), figures.grid_figure(s, 0),
                figures.lens_figure(lens(s), lm.name, unverified=s.unverified)]  # fmt: skip
    for fig in made:
        svg = figures.to_bytes(fig, "svg").decode()
        assert "UNVERIFIED" in svg and fig.unverified == lm.unverified
        figures.close(fig)
    ok = gi.Session(gi.load_model(oss_dir, device="cpu"), "She eats")
    ok.step()
    fig = figures.head_figure(ok, 0, 1)
    assert "UNVERIFIED" not in figures.to_bytes(fig, "svg").decode()
    figures.close(fig)
