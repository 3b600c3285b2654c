import os
import sys
from pathlib import Path

# Qt must never need a display in tests; models never come from the network.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402

# tiny models run fastest on one thread, and a busy 2-core machine makes two threads fight
torch.set_num_threads(1)

import tiny_models  # noqa: E402
from on_device import DEVICE, reference  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """family -> folder with a saved tiny random checkpoint and tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: tiny_models.build(root / f, f) for f in tiny_models.FAMILIES + tiny_models.EXTRA_FAMILIES}


@pytest.fixture(scope="session")
def chat_dir(tiny_dir, tmp_path_factory):
    """family -> a copy of the tiny checkpoint whose tokenizer has a chat template (tests/tiny_chat.py)."""
    import tiny_chat

    root, made = tmp_path_factory.mktemp("chat"), {}

    def get(family):
        if family not in made:
            made[family] = tiny_chat.with_template(tiny_dir[family], root / family)
        return made[family]

    return get


@pytest.fixture(scope="session")
def tiny_lm(tiny_dir):
    """family -> LoadedModel on the CPU, or GPT_INSPECTOR_TEST_DEVICE (loaded once per test run)."""
    from gpt_inspector import load_model

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_model(tiny_dir[family], device=DEVICE)
        return cache[family]

    return get


@pytest.fixture
def as_trace(tmp_path):
    """``as_trace(source)``: the run saved as a trace file and opened again (read-only)."""
    from gpt_inspector import load_trace

    saved = []

    def reopen(source):
        saved.append(tmp_path / f"as-trace-{len(saved)}.safetensors")
        return load_trace(source.save_trace(saved[-1]))

    return reopen


def _hf_models(tiny_dir, attn_implementation):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = reference(
                AutoModelForCausalLM.from_pretrained(tiny_dir[family], attn_implementation=attn_implementation).eval()
            )
        return cache[family]

    return get


@pytest.fixture(scope="session")
def hf_sdpa(tiny_dir):
    """family -> the same checkpoint with transformers' default sdpa attention, as users' generate runs it."""
    return _hf_models(tiny_dir, "sdpa")


@pytest.fixture(scope="session")
def hf_eager(tiny_dir):
    """family -> the same checkpoint in plain transformers with eager attention: the reference."""
    return _hf_models(tiny_dir, "eager")
