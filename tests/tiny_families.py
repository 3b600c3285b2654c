"""Tiny random decoder-only models for every family transformers maps to a causal-LM head.

Built in memory from each config class with small sizes: the common size attributes are set
where the config has them, so a new family needs no code here unless its config is unusual.
"""

from __future__ import annotations

import inspect

import torch

VOCAB = 320
# the newest transformers release the suite has passed on (pyproject's cap is just above it)
NEWEST_CHECKED = "5.24.0"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def older_than_checked() -> bool:
    from packaging.version import Version

    return Version(transformers_version()) < Version(NEWEST_CHECKED)


# set only where the config class has the attribute (or an alias for it)
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.3,
    # windows narrower than the test sequence, so the sliding mask is exercised
    sliding_window=4, attention_window_size=4, window_size=4,
    n_layer=2, n_head=4, n_embd=64, n_positions=128, n_ctx=128, num_layers=2, num_heads=4, d_model=64,
    ffn_dim=64, n_inner=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, decoder_sparse_step=1, kv_channels=16, multi_query_group_num=2,
    rotary_dim=8, partial_rotary_factor=0.5, use_cache=True, tie_word_embeddings=False,
    attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    dropout=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip


# families whose configs nest or derive their sizes where the common names above do not reach
_MLA = dict(
    kv_lora_rank=24,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    num_key_value_heads=4,
    n_group=1,
    topk_group=1,
    head_dim=8,
    partial_rotary_factor=1.0,
)  # a value head size unlike the key's, on purpose
EXTRA = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    # its rope is per layer type: rotary sliding-window layers beside NoPE (rope None) full-attention layers
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
        sliding_attention=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2]), full_attention=None)),
    # DbrxAttention reads rope_theta from attn_config, where released config.json files keep it, and cannot run
    # without clip_qkv (clamp(None, None) raises); 4.0 clips about a tenth of the tiny model's q, k, v
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=4.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "xglm": dict(init_std=0.3),
    # doge's dynamic top-k keeps 3 keys per head inside its 4-key sliding window, so both cut
    "doge": dict(keep_window_size=3),
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "minicpm3": _MLA,
    "youtu": _MLA,
    "glm4_moe_lite": _MLA,
    "axk1": _MLA,
    "longcat_flash": _MLA,
    "sarvam_mla": _MLA,
    "glm_moe_dsa": dict(_MLA, index_topk=3, index_head_dim=8, index_n_heads=2, layer_types=["indexed_attention"] * 2,
                        mlp_layer_types=["dense", "sparse"]),
    "axk2": dict(_MLA, index_topk=3, index_head_dim=8, index_n_heads=2, layer_types=["indexed_attention"] * 2,
                 mlp_layer_types=["dense", "sparse"]),
    "hy_v4": dict(_MLA, index_topk=3, index_head_dim=8, index_n_heads=2, layer_types=["indexed_attention"] * 2,
                  mlp_layer_types=["dense", "sparse"]),
    "deepseek_v32": dict(_MLA, index_topk=3, index_head_dim=8, index_n_heads=2, layer_types=["indexed_attention"] * 2,
                         mlp_layer_types=["dense", "sparse"]),
    # an indexed (sparse) MLA layer, then a sliding-window MLA layer with sizes of its own (the swa_* keys)
    "dots3_note_text": dict(_MLA, head_dim=24, index_topk=3, index_head_dim=8, index_n_heads=2,
                            layer_types=["indexed_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"],
                            shared_experts_intermediate_size=32, swa_num_attention_heads=4, swa_num_key_value_heads=4,
                            swa_q_lora_rank=16, swa_kv_lora_rank=20, swa_head_dim=20, swa_qk_nope_head_dim=12,
                            swa_v_head_dim=8),
    # hybrids: a state-space (or convolution) layer, then an attention layer
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_dt_rank=8),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8),
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8),
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "lara_mini": dict(layer_types=["linear_attention", "sliding_attention"], linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    # convolution and recurrent states beside attention in every layer
    "zaya": dict(num_experts_per_tok=1, layer_types=["hybrid_sliding", "hybrid"], router_hidden_size=16),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2),
    "zamba": dict(layers_block_type=["mamba", "hybrid"], attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=8,
                  mamba_d_state=8, attention_head_dim=32, n_mamba_heads=2),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=8, n_mamba_heads=4, mamba_ngroups=1,
                   num_mem_blocks=1, adapter_rank=8),
    # four layers: the last two read the K/V of the last earlier layer of their kind (KV sharing)
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, intermediate_size=[64] * 4,
                         layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
                         vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=8),
    # a sliding layer, then a full-attention layer with its own head size (per_layer_config), and per-layer inputs
    "gemma4_text": dict(layer_types=["sliding_attention", "full_attention"], global_head_dim=32,
                        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
    # Gemma 4's text decoder without per-layer inputs
    "gemma4_unified_text": dict(layer_types=["sliding_attention", "full_attention"], global_head_dim=32),
}  # fmt: skip

# variants of a family's config that take another code path: name -> (model_type, config overrides)
VARIANTS = {
    "falcon_new_arch": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "falcon_mha": ("falcon", dict(multi_query=False)),
    "falcon_alibi": ("falcon", dict(alibi=True)),
    "mpt_clip_qkv": ("mpt", dict(attn_config=dict(clip_qkv=0.8))),
    # doge with HF's own initialisation of A (0: every key bias exp(0) = 1, so the top-k picks among ties), inside
    # the 4-key sliding window and with none
    "doge_tied": ("doge", dict()),
    "doge_tied_no_window": ("doge", dict(sliding_window=None)),
    # Gemma 4's larger checkpoints: full-attention layers with fewer KV heads, keys doubling as values
    "gemma4_k_eq_v": ("gemma4_text", dict(attention_k_eq_v=True, num_global_key_value_heads=1)),
    # Gemma 4's small checkpoints: the last layers read the K/V of the last earlier layer of their kind
    "gemma4_kv_shared": ("gemma4_text", dict(num_hidden_layers=4, num_kv_shared_layers=2,
                                             layer_types=["sliding_attention", "full_attention"] * 2)),
    "gemma4_unified_kv_shared": ("gemma4_unified_text", dict(num_hidden_layers=4, num_kv_shared_layers=2,
                                 layer_types=["sliding_attention", "full_attention"] * 2, attention_k_eq_v=True,
                                 num_global_key_value_heads=1)),
    # chunked attention with chunks narrower than the test sequence (the default, 8192, never cuts it)
    "llama4_chunked": ("llama4_text", dict(attention_chunk_size=4)),
}  # fmt: skip


def _doge_bias(model) -> None:
    # A starts at zero, which makes doge's learned key bias exp(0) = 1 everywhere: a bias that shows nothing
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.A, 0.0, 1.0)


# weights a family (or a variant, by its name) initialises to a value that would hide what the tests check
TWEAKS = {"doge": _doge_bias, "doge_tied": None, "doge_tied_no_window": None}


def small_config(model_type: str, eos: int):
    """The family's (or a ``VARIANTS`` entry's) config with small sizes."""
    from transformers import CONFIG_MAPPING

    overrides = {}
    if model_type in VARIANTS:
        model_type, overrides = VARIANTS[model_type]
    if model_type not in CONFIG_MAPPING and older_than_checked():
        # the declared floor predates the family: the floor is checked on the families it ships
        import pytest

        pytest.skip(f"transformers {transformers_version()} does not ship {model_type}")
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    known = set(default.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    try:
        known |= set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        pass
    kw = {k: v for k, v in SMALL.items() if k in known}
    kw.update(EXTRA.get(model_type, {}))
    kw.update(overrides)
    kw.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    cfg = cls(**kw)
    per_layer = getattr(cfg, "per_layer_attributes", None) or set()  # set per layer: reading them globally raises
    for k, v in kw.items():  # some configs ignore constructor arguments they derive
        if k in per_layer:
            continue
        try:
            have = getattr(cfg, k)
        # RuntimeError: a per-layer attribute of a heterogeneous config (dots3_note_text) has no global value
        except (AttributeError, RuntimeError):
            continue
        if have != v and not isinstance(have, (list, dict)) and not isinstance(v, dict):
            try:
                setattr(cfg, k, v)
            except (AttributeError, ValueError, TypeError):
                pass
    return cfg


def build_model(model_type: str, eos: int, seed: int = 0):
    from transformers import AutoModelForCausalLM

    cfg = small_config(model_type, eos)
    with torch.device("meta"):  # count first: a config that ignored our sizes would take gigabytes
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > 3_000_000:
        raise ValueError(f"too large for a tiny test ({n} parameters)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    tweak = TWEAKS[model_type] if model_type in TWEAKS else TWEAKS.get(cfg.model_type)
    if tweak is not None:
        with torch.no_grad():
            tweak(model)
    return model
