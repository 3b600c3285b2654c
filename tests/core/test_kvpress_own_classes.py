"""``from_press`` with kvpress's own press classes (their code, unmodified), beside the lab's copies.

kvpress's package ``__init__`` wraps every registered attention function and imports ``datasets`` and
``requests``; its press modules need neither. So its modules are loaded here under empty package
objects, without running that ``__init__``: kvpress patches nothing, and its classes run in this
environment's transformers (kvpress's metadata pins < 5.3; the press modules only read torch and two
llama helpers). GPT_INSPECTOR_KVPRESS_SRC names the ``kvpress`` folder (``scripts/kvpress-env.sh`` sets
it from its throw-away venv); without it the test is skipped.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from gpt_inspector.core.kvlab import KVLab, from_press, presses

SRC = os.environ.get("GPT_INSPECTOR_KVPRESS_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="kvpress's own classes: run scripts/kvpress-env.sh")
PROMPT = "She eats an apple. He reads a book. They walk to the park. The cat sat on the mat and"
CONTEXT = 14


@pytest.fixture(scope="module")
def kp():
    """kvpress's press modules, loaded without its package ``__init__``."""
    root = Path(str(SRC))
    assert (root / "presses" / "scorer_press.py").is_file(), f"GPT_INSPECTOR_KVPRESS_SRC={root} is no kvpress folder"
    saved = {k: v for k, v in sys.modules.items() if k == "kvpress" or k.startswith("kvpress.")}
    for name, path in (("kvpress", root), ("kvpress.presses", root / "presses")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    mods = {m: importlib.import_module(f"kvpress.presses.{m}") for m in (
        "streaming_llm_press", "snapkv_press", "knorm_press", "tova_press", "observed_attention_press",
        "expected_attention_press", "keydiff_press", "random_press", "adakv_press", "per_layer_compression_press")}  # fmt: skip
    yield types.SimpleNamespace(**{k: v for m in mods.values() for k, v in vars(m).items() if k.endswith("Press")})
    for k in [k for k in sys.modules if k == "kvpress" or k.startswith("kvpress.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def pairs(kp):
    """(kvpress's press, the lab's copy, hand over attention weights)."""
    P = presses
    return [
        (kp.StreamingLLMPress(0.5), P.StreamingLLMPress(0.5), False),
        (kp.SnapKVPress(0.5, window_size=4), P.SnapKVPress(0.5, window_size=4), False),
        (kp.SnapKVPress(0.4, window_size=4), P.SnapKVPress(0.4, window_size=4), True),
        (kp.KnormPress(0.5), P.KnormPress(0.5), False),
        (kp.TOVAPress(0.6), P.TOVAPress(0.6), False),
        (kp.ObservedAttentionPress(0.5), P.ObservedAttentionPress(0.5), True),
        (kp.ExpectedAttentionPress(0.5), P.ExpectedAttentionPress(0.5), False),
        (kp.KeyDiffPress(0.3), P.KeyDiffPress(0.3), False),
        (kp.RandomPress(0.5, seed=1), P.RandomPress(0.5, seed=1), False),
        (kp.AdaKVPress(kp.KnormPress(0.5)), P.AdaKVPress(P.KnormPress(0.5)), False),
        (kp.PerLayerCompressionPress(kp.KnormPress(), [0.2, 0.7]), P.PerLayerCompressionPress(P.KnormPress(), [0.2, 0.7]),
         False),
    ]  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kvpress_classes_run_as_lab_policies_and_equal_the_labs_copies(family, kp, tiny_lm):
    lm = tiny_lm(family)
    for theirs, mine, attn in pairs(kp):
        runs = []
        for press in (theirs, mine):
            lab = KVLab(lm, PROMPT, from_press(press, context=CONTEXT, attentions=attn), free_running=True)
            lab.run_steps(3)
            runs.append(lab)
        a, b = runs
        t = a.run.cache_length
        name = type(theirs).__name__
        for layer in range(lm.n_layers):
            assert torch.equal(a.policy.evicted(layer, t), b.policy.evicted(layer, t)), f"{name}: layer {layer}"
        assert bool(a.policy.evicted(0, t).any()), f"{name} evicted nothing"
        for x, y in zip(a.run.steps_done, b.run.steps_done):
            assert torch.equal(x.logits, y.logits), name
