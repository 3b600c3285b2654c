"""Never silently wrong: families we refuse up front, and a self-test of every model at load.

The refusal list names the families whose attention our function cannot reproduce (or that do
not run attention through transformers' interface at every layer), each with the reason a user
sees. Everything else is checked at load by ``verify_fidelity``: a short probe sequence runs once
through the model's own eager attention and once through ours, the way a session runs it
(prefill, then one token at a time against the cache); logits that differ beyond the dtype's
tolerance refuse the model unless the user accepts an unverified load.
"""

from __future__ import annotations

import torch

from . import adapters, capture, hf
from .errors import InspectorError

# why a family that transformers also puts behind a causal-LM head is not a decoder-only LM
_ENCODER = ("encoder-only: a bidirectional encoder; its causal-LM head is for fine-tuning it as the decoder of an "
            "encoder-decoder model")  # fmt: skip
_SEQ2SEQ = ("the decoder of an encoder-decoder model: its layers cross-attend to the encoder's states, which a prompt "
            "alone lacks")  # fmt: skip

# model_type -> why its numbers would not be the model's own (or why it is no decoder-only LM); shown at load
REFUSED: dict[str, str] = {
    "deepseek_v4": "sparse multi-head latent attention with compressed keys",
    "kimi_linear": "hybrid (latent attention beside delta-attention layers): not yet verified on a tiny test model",
    "gemma3n": "the multimodal (audio, vision) model is not verified; its text model gemma3n_text is",
    "minimax": "hybrid: its lightning-attention layers need a cache class of its own (MiniMaxCache)",
    "zamba": "hybrid: its shared attention block does not say which layer it runs in (no layer_idx), so its "
    "records cannot be placed",
    "bailing_hybrid": "hybrid with linear-attention layers; not yet verified on a tiny test model",
    "gemma4": "the multimodal (vision, audio) model is not verified; its text model gemma4_text is",
    "gemma4_unified": "the multimodal (vision, audio) model is not verified; its text model gemma4_unified_text is",
    "gemma4_assistant": "a drafter for Gemma 4's assisted decoding: its forward takes the target model's hidden "
    "states and K/V (shared_kv_states), not token ids, and keeps no cache of its own",
    "gemma4_unified_assistant": "a drafter for Gemma 4's assisted decoding: its forward takes the target model's "
    "hidden states and K/V (shared_kv_states), not token ids, and keeps no cache of its own",
    "qwen3_5": "the multimodal model is not verified; its text model qwen3_5_text is",
    "qwen3_5_moe": "the multimodal model is not verified; its text model qwen3_5_moe_text is",
    "recurrent_gemma": "recurrent (RG-LRU) layers with local attention; no transformers attention interface",
    "mamba": "a state-space model: no attention",
    "mamba2": "a state-space model: no attention",
    "falcon_mamba": "a state-space model: no attention",
    "rwkv": "a recurrent model: no attention",
    "xlstm": "a recurrent (xLSTM) model: no attention",
    "reformer": "LSH / local attention with its own chunked cache",
    "xlnet": "two-stream permutation attention with relative positions",
    "lfm3": "hybrid with linear-attention layers; not yet verified",
    "qwen4_exp_text": "hybrid with linear-attention layers; not yet verified",
    "inkling_text": "hybrid: convolution states in the cache, relative position biases in attention",
    "inkling2_text": "hybrid: convolution states in the cache, relative position biases and sinks in attention",
    "hrm_text": "recurrent depth: each layer runs several cycles, each with its own cache slot",
    "minimax_m3_vl_text": "block-sparse attention: an indexer picks key blocks, a mask transformers builds only "
    "for its own eager and sdpa attention",
    "cpmant": "computes attention itself, not through transformers' attention interface",
    "openai-gpt": "keeps no KV cache in transformers (every forward recomputes the whole sequence), "
    "which stepping one token at a time relies on",
    "blt": "byte latent transformer: patch-level cross attention between encoder and decoder",
    "xlm": "computes attention itself (its own MultiHeadAttention), not through transformers' attention interface",
    "dory": "recurrent depth: its middle layers run n_recurrent_loops times per token, each pass with a cache slot of "
    "its own (or reading the last pass's)",
    "inkling2_loop_text": "recurrent depth over inkling2_text's layers (refused): its loop layers run loop_num_passes "
    "times per token, each pass with its own cache copy",
    # bidirectional encoders
    **dict.fromkeys(
        [
            "bert",
            "big_bird",
            "camembert",
            "data2vec-text",
            "electra",
            "ernie",
            "megatron-bert",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roc_bert",
            "roformer",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xmod",
        ],
        _ENCODER,
    ),
    "bert-generation": "encoder-only BERT weights reused as the decoder of an encoder-decoder model",
    "modernbert": "encoder-only: a bidirectional encoder (its decoder-only sibling modernbert-decoder is verified)",
    # decoders of encoder-decoder models
    **dict.fromkeys(
        ["bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus", "plbart"],
        _SEQ2SEQ,
    ),
    "prophetnet": "the decoder of an encoder-decoder model: n-stream self-attention that predicts several future "
    "tokens, and cross-attention to the encoder's states",
    "trocr": "the text decoder of an image-to-text encoder-decoder model: its layers cross-attend to the image "
    "encoder's states",
    "whisper": "the text decoder of a speech-to-text encoder-decoder model: its layers cross-attend to the audio "
    "encoder's states",
    "musicgen": "the audio decoder of a text-to-music model: several EnCodec codebooks per step (one LM head each), "
    "cross-attending to the text encoder's states",
    "musicgen_melody": "the audio decoder of a text-to-music model: several EnCodec codebooks per step (one LM head "
    "each), conditioned on text and melody states prepended to its sequence",
    # multimodal models: the text (language) model they wrap is checked under its own type
    "gemma3": "the multimodal (vision) model is not verified; its text model gemma3_text is",
    "llama4": "the multimodal (vision) model is not verified; its text model llama4_text is",
    "dots3_note": "the multimodal (vision, audio) model is not verified; its text model dots3_note_text is",
    "qwen4_exp": "the multimodal model is not verified; its text model qwen4_exp_text is refused too",
    "got_ocr2": "the OCR model (vision encoder and language model) is not verified; its language model (qwen2 by "
    "default) is",
    "fuyu": "the multimodal model (image patches projected into the token sequence) is not verified; its language "
    "model (persimmon by default) is",
    "phi4_multimodal": "the multimodal (vision, audio) model is not verified; its language model is phi3's "
    "architecture, which is",
    "moss_transcribe_diarize": "the speech-to-text model (an audio encoder feeding a language model) is not verified; "
    "its language model (qwen3 by default) is",
    "emu3": "the multimodal model (VQ-VAE image tokens) is not verified; its text model has no causal-LM type of its "
    "own",
    "mllama": "the vision-language model is not verified; its text model interleaves cross-attention layers that read "
    "image features",
    "git": "an image-to-text model: an image encoder's tokens lead the sequence and attend to each other "
    "bidirectionally; not verified",
}

_INDEXER = (
    "its sparse indexer selects each query's keys by torch.topk over the keys of the forward at hand; a "
    "full-sequence forward can select other keys than the stepped decode"
)
# model_type -> why transformers' full-sequence forward is not what generate computes. generate runs
# the prompt, then one token at a time against the model's own cache; the session steps the same
# way, so its numbers (logits and attention weights) are that run's. The fidelity self-test and the
# family tests compare these with the model's stepped run.
STEPPED_DECODE: dict[str, str] = {
    "deepseek_v32": _INDEXER,
    "glm_moe_dsa": _INDEXER,
    "axk2": _INDEXER,
    "hy_v4": _INDEXER,
    "dots3_note_text": "its full-sequence forward gives a position other logits depending on how many tokens follow "
    "it (8.3 apart between 13- and 16-token forwards of the tiny test model)",
    "nemotron_h": "its Mamba2 layers' chunked scan (a full-sequence forward) rounds apart from their recurrence",
    "zamba2": "its Mamba2 layers' chunked scan (a full-sequence forward) rounds apart from their recurrence",
    "doge": "its dynamic mask keeps each row's top keys with torch.topk over the keys of the forward at hand; "
    "where key biases tie, which tied key it keeps depends on that forward's length",
}
STEPPED_NOTE = (
    "numbers follow the model's stepped (cached) decode, as generate runs it; its full-sequence forward can differ"
)


def stepped_note(config) -> str | None:
    """The one line a front end shows at load for a ``STEPPED_DECODE`` family, else None."""
    return STEPPED_NOTE if getattr(config, "model_type", None) in STEPPED_DECODE else None


# relative to the largest reference logit: eager and fused attention round differently per dtype
_RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
PROBE_LENGTH = 8
STEPPED = 2  # probe positions fed one at a time against the cache, after a prefill of the rest


def check_supported(config, source: str) -> None:
    """Refuse, in one line, a family whose attention our capture cannot reproduce."""
    mt = getattr(config, "model_type", None)
    if mt in REFUSED:
        raise InspectorError(f"{source} ({mt}) is not supported: {REFUSED[mt]}")


def _stepped(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits (P, V) float32 of a prefill of all but ``STEPPED`` positions, then one token at a time."""
    from .forward import position_kwargs

    half = PROBE_LENGTH - STEPPED
    parts = []
    for a, b in [(0, half)] + [(p, p + 1) for p in range(half, PROBE_LENGTH)]:
        x = ids[:, a:b]  # (1, n): with positions as a session (and generate) passes them
        parts.append(
            hf.call(model, cache, input_ids=x, use_cache=True, **position_kwargs(model, a, x)).logits[0]
        )  # (n, V)
    return torch.cat(parts).float()  # (P, V)


def _gap(ours: torch.Tensor, ref: torch.Tensor, dtype) -> tuple[float, int, float]:
    diff = (ours - ref).abs().amax(-1)  # (P,)
    pos = int(diff.argmax())
    tol = _RTOL.get(dtype, 1e-4) * max(float(ref.abs().max()), 1.0)
    return (float(diff[pos]) if torch.isfinite(diff).all() else float("inf")), pos, tol


def fidelity_gap(lm) -> tuple[float, int, float]:
    """(max |diff|, position, tolerance): our attention, stepped as a session steps, vs eager.

    Ours runs the probe as a prefill and then ``STEPPED`` single tokens against the cache, as a
    session does; the reference is one eager forward without a cache. Where that differs, the
    model's own eager run stepped the same way against its own cache (as ``generate`` runs it)
    is the second reference: for the ``STEPPED_DECODE`` families (a sparse indexer's selection,
    Mamba2's chunked scan, doge's top-k over tied biases) only the stepped run is what
    generation computes.
    """
    model = lm.model
    # spread over the vocabulary (1..vocab-1) so no special token dominates the probe
    ids = ((torch.arange(1, PROBE_LENGTH + 1) * 7919) % max(lm.vocab_size - 1, 1) + 1).to(lm.device)[None]  # (1, P)
    with torch.inference_mode():
        ours = _stepped(model, ids, lm.new_cache())  # (P, V); hybrids: the model's own state-space layers
        try:
            model.set_attn_implementation("eager")
            with adapters.native():  # a family we adapted: its own attention code, not ours
                ref = model(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float()  # (P, V)
                gap = _gap(ours, ref, lm.dtype)
                if gap[0] > gap[2]:
                    gap = min(gap, _gap(ours, _stepped(model, ids, hf.DynamicCache(config=model.config)), lm.dtype))
        finally:
            model.set_attn_implementation(capture.ATTN_NAME)
    return gap


def verify_fidelity(lm, allow_unverified: bool = False):
    """Refuse ``lm`` when its logits through our attention are not the model's own."""
    gap, pos, tol = fidelity_gap(lm)
    if gap <= tol:
        return lm
    reason = (
        f"logits through gpt-inspector's attention differ from the model's own eager attention by "
        f"max |diff| {gap:.3g} at probe position {pos} (tolerance {tol:.2g})"
    )
    if not allow_unverified:
        raise InspectorError(
            f"{lm.name}: {reason}; to inspect it anyway pass --unverified to a command (allow_unverified=True in Python)"
        )
    lm.unverified = reason
    return lm
