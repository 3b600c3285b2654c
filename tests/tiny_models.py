"""Tiny random checkpoints the tests build and save themselves (no network, a few seconds).

Weights are initialised with a large std so attention is peaked and logits are sensitive: a test
that compares numbers must be able to fail.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

CORPUS = [
    "She eats an apple. He reads a book. They walk to the park.",
    "One two three four five six seven eight nine ten.",
    "The cat sat on the mat and the dog ran in the yard.",
    "We cook rice and beans; I drink tea with milk.",
    "Grüße aus Köln! Ça va? 東京 ✓ emoji 🙂",
]
FAMILIES = ("gpt2", "llama", "qwen2", "gpt_neox")
# Gemma 2: attention-logit soft-capping and sliding-window layers, the two ways a mask or score can
# deviate from plain causal
EXTRA_FAMILIES = ("gemma2",)


def build_tokenizer(folder: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return fast


def config_for(family: str, vocab: int, eos: int):
    from transformers import Gemma2Config, GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, initializer_range=0.3)
    if family == "gpt2":
        return GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, **common)
    if family == "llama":  # grouped-query attention: 4 query heads share 2 KV heads
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **common)  # fmt: skip
    if family == "qwen2":
        return Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, max_position_embeddings=64, **common)  # fmt: skip
    if family == "gpt_neox":
        return GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=64, rotary_pct=0.5, **common)  # fmt: skip
    if family == "gemma2":
        return Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
                            attn_logit_softcapping=5.0, final_logit_softcapping=None, pad_token_id=eos, **common)  # fmt: skip
    if family == "gpt_oss":  # attention sinks (s_aux), mixture of experts, alternating sliding windows
        from transformers import GptOssConfig

        return GptOssConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=4, max_position_embeddings=64, pad_token_id=eos, **common)  # fmt: skip
    raise ValueError(family)


def build(folder: Path, family: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_for(family, len(tok), eos))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_sinks_model(folder: Path) -> Path:
    """A tiny gpt_oss with large attention sinks: dropping them moves the logits far beyond rounding."""
    from safetensors.torch import load_file, save_file

    folder = build(folder, "gpt_oss")
    weights = load_file(folder / "model.safetensors")
    for k in [k for k in weights if k.endswith("self_attn.sinks")]:
        weights[k] = torch.randn(weights[k].shape, generator=torch.Generator().manual_seed(1)) * 3
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@contextlib.contextmanager
def attention_that_drops_sinks():
    """Our attention with the bug the fidelity self-test exists for: the s_aux keyword silently dropped."""
    from transformers import AttentionInterface

    from gpt_inspector.core import capture

    def dropping(*args, **kwargs):
        kwargs.pop("s_aux", None)
        return capture.inspector_attention(*args, **kwargs)

    AttentionInterface.register(capture.ATTN_NAME, dropping)
    try:
        yield
    finally:
        AttentionInterface.register(capture.ATTN_NAME, capture.inspector_attention)
