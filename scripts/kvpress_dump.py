"""Run NVIDIA kvpress itself on tiny checkpoints and write down what it kept and the logits it gave.

Runs in kvpress's own environment (``scripts/kvpress-env.sh`` makes it: kvpress 0.5.5, the newest
transformers it accepts, torch 2.13.0), never in the project's: kvpress pins transformers < 5.3 and
wraps every registered attention function on import. Usage::

    python scripts/kvpress_dump.py OUT_DIR

writes OUT_DIR/models/<family>/ (the checkpoints, built by tests/tiny_models.py with their seeds) and
OUT_DIR/<family>--<case>.safetensors per comparison case: ``kept`` (L, Hkv, C) uint8, which context
entries each layer and KV head held after kvpress compressed the context; ``logits`` (steps, V)
float32, the question's last position and then each greedy answer step; ``tokens`` the answer;
``prompt`` the context then the question. ``cases.json`` lists the cases with their press settings.
tests/core/test_kvpress_parity.py runs the lab's copies (``core.kvlab.presses``) on the same
checkpoints and compares. Kept sets are read off the cache kvpress left (each kept key row found among
the layer's uncompressed keys) or, for AdaKV, off the indices it masks: kvpress's result, not a
recomputation of its rule.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import tiny_models  # noqa: E402  (tests/ is not a package: it goes on the path first)

FAMILIES = ("llama", "qwen2")
PROMPT = "She eats an apple. He reads a book. They walk to the park. The cat sat on the mat"
QUESTION = " and the dog ran in the"
ANSWER_STEPS = 4
RATIO = 0.5


def cases():
    """name -> (press settings for cases.json, a builder of kvpress's press, attention implementation)."""
    import kvpress as kp

    class LocalQFilter(kp.QFilterPress):
        # kvpress downloads the filters per model from the Hub; the tiny models have none there, so the
        # filters are seeded here and the comparison hands the lab the same tensor
        def post_init_from_model(self, model):
            pass

    def qfilter(model):
        c = model.config
        g = torch.Generator().manual_seed(7)
        f = torch.randn(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, generator=g)
        p = LocalQFilter(compression_ratio=RATIO)
        p.q_filters = f
        return p, {"q_filters": f}

    def plain(cls, **kw):
        return lambda model: (cls(compression_ratio=RATIO, **kw), {})

    return {
        "streaming_llm": ({"press": "StreamingLLMPress", "n_sink": 4}, plain(kp.StreamingLLMPress, n_sink=4), "sdpa"),
        "snapkv": ({"press": "SnapKVPress", "window_size": 8, "kernel_size": 5},
                   plain(kp.SnapKVPress, window_size=8, kernel_size=5), "sdpa"),
        "snapkv_eager": ({"press": "SnapKVPress", "window_size": 8, "kernel_size": 5, "attentions": True},
                         plain(kp.SnapKVPress, window_size=8, kernel_size=5), "eager"),
        "knorm": ({"press": "KnormPress"}, plain(kp.KnormPress), "sdpa"),
        "tova": ({"press": "TOVAPress"}, plain(kp.TOVAPress), "sdpa"),
        "observed_attention": ({"press": "ObservedAttentionPress", "attentions": True},
                               plain(kp.ObservedAttentionPress), "eager"),
        "expected_attention": ({"press": "ExpectedAttentionPress"}, plain(kp.ExpectedAttentionPress), "sdpa"),
        "keydiff": ({"press": "KeyDiffPress"}, plain(kp.KeyDiffPress), "sdpa"),
        "random": ({"press": "RandomPress", "seed": 3}, plain(kp.RandomPress, seed=3), "sdpa"),
        "qfilter": ({"press": "QFilterPress"}, qfilter, "sdpa"),
        "adakv_snapkv": ({"press": "AdaKVPress", "inner": "SnapKVPress", "window_size": 8, "kernel_size": 5,
                          "alpha_safeguard": 0.2},
                         lambda m: (kp.AdaKVPress(kp.SnapKVPress(compression_ratio=RATIO, window_size=8,
                                                                 kernel_size=5), alpha_safeguard=0.2), {}), "sdpa"),
        "adakv_knorm": ({"press": "AdaKVPress", "inner": "KnormPress", "alpha_safeguard": 0.2},
                        lambda m: (kp.AdaKVPress(kp.KnormPress(compression_ratio=RATIO), alpha_safeguard=0.2), {}),
                        "sdpa"),
        "per_layer_knorm": ({"press": "PerLayerCompressionPress", "inner": "KnormPress", "ratios": [0.25, 0.75]},
                            lambda m: (kp.PerLayerCompressionPress(kp.KnormPress(), compression_ratios=[0.25, 0.75]),
                                       {}), "sdpa"),
    }  # fmt: skip


def run_case(model, context_ids, question_ids, press):
    """kvpress's pipeline, step by step (``KVPressTextGenerationPipeline._forward`` and ``generate_answer``),
    keeping the logits: the context prefilled under the press, the question and the answer uncompressed."""
    from transformers import DynamicCache

    cache = DynamicCache()
    full: dict[int, torch.Tensor] = {}

    def before_press(module, args, kwargs, output):  # registered first: runs before the press's hook
        full[module.layer_idx] = kwargs["past_key_values"].layers[module.layer_idx].keys.clone()

    layers = model.model.layers
    hooks = [layer.self_attn.register_forward_hook(before_press, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad(), press(model):
            model.model(input_ids=context_ids, past_key_values=cache)
    finally:
        for h in hooks:
            h.remove()
    c = context_ids.shape[1]
    kept = torch.zeros(len(layers), model.config.num_key_value_heads, c, dtype=torch.uint8)
    for i, layer in enumerate(layers):
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:  # AdaKV: nothing pruned, these (batch, head, position) masked
            kept[i] = 1
            kept[i, masked[1], masked[2]] = 0
            continue
        got = cache.layers[i].keys[0]  # (Hkv, n, d)
        for h in range(got.shape[0]):
            eq = (got[h][:, None, :] == full[i][0, h][None, :, :]).all(-1)  # (n, C)
            assert bool((eq.sum(1) == 1).all()), "a kept key matches no single uncompressed row"
            kept[i, h, eq.float().argmax(1)] = 1
    logits, tokens = [], []
    if len({cache.layers[i].keys.shape[2] for i in range(len(layers))}) > 1:
        # layers of different lengths (PerLayerCompressionPress): kvpress runs them only under flash
        # attention (its docstring says so); sdpa and eager build one mask for all layers and fail
        return kept, torch.zeros(0, model.config.vocab_size), torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        pos = torch.arange(c, c + question_ids.shape[1]).unsqueeze(0)
        out = model(input_ids=question_ids, past_key_values=cache, position_ids=pos, logits_to_keep=1)
        pos = pos[:, -1:] + 1
        for i in range(ANSWER_STEPS):
            logits.append(out.logits[0, -1].float())
            tokens.append(int(out.logits[0, -1].argmax()))
            if i + 1 < ANSWER_STEPS:
                out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=pos + i)
    return kept, torch.stack(logits), torch.tensor(tokens)


def main(out: Path) -> None:
    import kvpress
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    index = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
             "transformers": transformers.__version__, "torch": torch.__version__, "ratio": RATIO, "cases": []}  # fmt: skip
    for family in FAMILIES:
        folder = tiny_models.build(out / "models" / family, family)
        tok = AutoTokenizer.from_pretrained(folder)
        ctx = tok(PROMPT, return_tensors="pt").input_ids
        qst = tok(QUESTION, return_tensors="pt").input_ids
        for name, (settings, build, impl) in cases().items():
            model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=impl).eval()
            press, tensors = build(model)
            c, q = ctx, qst
            if name.startswith("adakv"):
                # kvpress masks AdaKV's evictions with a fake key orthogonal-ish to every query of a
                # forward (attention_patch.search_hyperplane); on 8-number heads no such key exists for
                # the question's 8 tokens x the group's heads, so the question is its last token alone
                c, q = torch.cat([ctx, qst[:, :-1]], 1), qst[:, -1:]
            kept, logits, tokens = run_case(model, c, q, press)
            save_file({"kept": kept.contiguous(), "logits": logits.contiguous(), "tokens": tokens,
                       "prompt": torch.cat([c[0], q[0]]), "context": torch.tensor([c.shape[1]]),
                       **{k: v.contiguous() for k, v in tensors.items()}},
                      str(out / f"{family}--{name}.safetensors"))  # fmt: skip
            index["cases"].append({"family": family, "case": name, "attn_implementation": impl, **settings})
            print(f"kvpress {name} on {family}: kept {int(kept.sum())} of {kept.numel()}")
    (out / "cases.json").write_text(json.dumps(index, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/kvpress_dump.py OUT_DIR")
    main(Path(sys.argv[1]))
