"""The one boundary with transformers: every name the engine takes from it, and the version shims.

transformers renames things between minor releases (5.24 renamed the forwards' ``past_key_values``
to ``cache``, and deprecated the old name for removal in 5.40). Everything version-dependent is
decided here, from what the installed release really has (a signature, a name), never from a
version number alone, so the next rename is a change to this file only. A test
(``tests/architecture``) checks that no other module imports transformers.

``SUPPORTED`` is the range the package declares (pyproject.toml) and the suite has passed on;
``scripts/check-transformers.sh`` tries the newest release before the cap is raised.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import transformers

__all__ = [
    "VERSION", "SUPPORTED", "AttentionInterface", "AttentionMaskInterface", "AutoConfig", "DynamicCache",
    "DynamicLayer", "DynamicSlidingWindowLayer", "EncoderDecoderCache", "LinearAttentionCacheLayerMixin", "sdpa_mask", "cache_kwarg", "call",
    "cache_arg", "family_module", "layer_types", "layer_config", "layer_config_value", "cache_keeps",
    "causal_lm_types", "quiet", "no_progress_bars", "auto_classes",
    "logits_processors", "bytes_to_unicode", "cache_utils", "SHIPPED_FIELDS", "generation_defaults",
    "logits_processor_list", "candidate_generator", "chat_template_of", "apply_chat_template",
]  # fmt: skip

VERSION: str = transformers.__version__
# what pyproject.toml declares: the lowest release the suite passed on (5.20 lacks BLOOM's slope
# helper the adapter uses; 5.13 and older lack get_layer_types_and_kwargs), and the cap above the
# newest (scripts/check-transformers.sh)
SUPPORTED = (">=5.21.0", "<5.25")


def _too_old(version: str) -> bool:
    from packaging.version import Version

    return Version(version) < Version(SUPPORTED[0].lstrip(">="))


if _too_old(VERSION):
    # the names below would fail one by one, deep in a load; say what to install instead
    raise ImportError(f"gpt-inspector needs transformers{','.join(SUPPORTED)}, this environment has {VERSION}: "
                      f"pip install 'transformers{','.join(SUPPORTED)}'")  # fmt: skip

# after the version check: on an older release these fail with a name, not with what to install
from transformers import AttentionInterface, AutoConfig, DynamicCache  # noqa: E402
from transformers.cache_utils import (  # noqa: E402
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    LinearAttentionCacheLayerMixin,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

# the keyword a forward takes its KV cache by: "cache" from 5.24, "past_key_values" before
_CACHE_NAMES = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def _forward_cache_name(cls: Any) -> str:  # cls: a model class (hashable, the lru_cache key)
    # deprecate_kwarg wraps with functools.wraps, so the signature is the forward's own
    try:
        params: Mapping[str, inspect.Parameter] = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        params = {}
    for name in _CACHE_NAMES:
        if name in params:
            return name
    return _RELEASE_CACHE_NAME


def _release_cache_name() -> str:
    # a forward that takes only **kwargs gets the name the release's own generate passes
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


_RELEASE_CACHE_NAME = _release_cache_name()


def cache_kwarg(model) -> str:
    """The keyword ``model``'s forward takes its cache by, on the installed release."""
    return _forward_cache_name(type(model))  # type: ignore[arg-type]  # a class is hashable


def call(model, cache, **kwargs):
    """``model(**kwargs)`` with ``cache`` passed under the name this release's forward takes."""
    kwargs[cache_kwarg(model)] = cache
    return model(**kwargs)


def cache_arg(cache=None, past_key_values=None):
    """For an adapter's replacement attention forward, which accepts both names: the cache given."""
    return cache if cache is not None else past_key_values


def family_module(family: str, name: str = "modeling"):
    """A family's own module, ``transformers.models.<family>.<name>_<family>``."""
    return importlib.import_module(f"transformers.models.{family}.{name}_{family}")


def cache_utils():
    return importlib.import_module("transformers.cache_utils")


def layer_types(config) -> list[str]:
    """The cache layer type of every decoder layer, as transformers' own cache would build them."""
    types, _ = cache_utils().get_layer_types_and_kwargs(config.get_text_config(decoder=True))  # 5.14 on
    return list(types)


def layer_config(config, layer: int):
    """Decoder layer ``layer``'s own config: ``config`` with that layer's overrides applied.

    Heterogeneous configs (``per_layer_config``, Gemma 4's full-attention layers with their own
    head size and KV heads) raise on reading a per-layer attribute off the global config; a
    release without them, or a homogeneous config, has one config for every layer.
    """
    if not getattr(config, "is_heterogeneous", False):
        return config
    return config.per_layer_config[layer]


def layer_config_value(config, name: str, layer: int, default: Any = None) -> Any:
    """Attribute ``name`` as decoder layer ``layer`` reads it (``default`` where the config has none)."""
    return getattr(layer_config(config, layer), name, default)


# more positions than any window: zero-width tensors of this length take no memory
_PROBE_POSITIONS = 1 << 40


def cache_keeps(config) -> list[int | None]:
    """Per decoder layer, the most positions the model's own cache keeps for it (the one ``generate``
    builds, ``DynamicCache(config=...)``), None where it keeps every one; [] if it cannot be built.

    Asked of transformers' layer classes rather than read off the config, so a release that changes
    what a window keeps changes the answer: each layer is fed zero-width keys and values for more
    positions than any window, then one more, and the length it holds is read back. 5.24's sliding
    and chunked layers keep window - 1 (attention concatenates the current step's keys to them).
    Layers that hold no keys (a state-space state, a KV-sharing layer's placeholder) answer None.
    """
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a config transformers' own cache cannot be built from: no window known, as before
        return []
    out: list[int | None] = []
    for cl in layers:
        if not hasattr(cl, "update"):  # a state-space layer: no K/V to hold
            out.append(None)
            continue
        try:
            held = []
            for n in (_PROBE_POSITIONS, 1):
                x = torch.empty((1, 1, n, 0))
                cl.update(x, x)
                # what the layer holds, not what update returns (a sliding layer returns window + new)
                held.append(cl.keys.shape[-2])  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError, NotImplementedError, RuntimeError):
            out.append(None)
            continue
        out.append(held[0] if held[0] == held[1] < _PROBE_POSITIONS else None)
    return out


def causal_lm_types() -> dict[str, str]:
    """model_type -> the causal-LM class name transformers maps it to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def auto_classes():
    """(AutoModelForCausalLM, AutoTokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM, AutoTokenizer


def load_tensor_parallel(folder: str, dtype=None):
    """(model, tokenizer) from a local safetensors folder, sharded by transformers' own tensor-parallel
    plan (``tp_plan="auto"``): this process holds its rank's share of the heads. Run under torchrun;
    transformers starts torch.distributed from its environment (gloo on a CPU, NCCL on GPUs)."""
    from transformers import DistributedConfig  # 5.x; its tp_plan keyword on from_pretrained is deprecated

    AutoModelForCausalLM, AutoTokenizer = auto_classes()
    plan = DistributedConfig(tp_plan="auto")
    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=plan, use_safetensors=True, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(folder)


def logits_processors():
    """transformers' ``generation.logits_process`` module."""
    from transformers.generation import logits_process

    return logits_process


# the generation-config fields that give ``generate`` a logits processor or warper (guidance and
# watermarking need the model itself and are left out); a checkpoint may ship any of them
SHIPPED_FIELDS = (
    "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
    "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "sequence_bias", "renormalize_logits", "top_h",
)  # fmt: skip


def generation_defaults(model) -> dict:
    """The processor settings ``model``'s own generation config sets (the checkpoint's defaults), by
    ``generate``'s names. transformers' global fallbacks (top-k 50 when sampling) are not the model's."""
    gc = getattr(model, "generation_config", None)
    out = {}
    for name in SHIPPED_FIELDS:
        v = getattr(gc, name, None)
        if v is not None:
            out[name] = v
    return out


@functools.lru_cache(maxsize=1)
def _builder():
    # generate's own list builder, on a stand-in for a decoder-only model: it reads only
    # config.is_encoder_decoder and the merge helper (guidance and watermarking, which need the
    # model, are never asked for), so a trace without its model builds the very same list
    from transformers.generation.utils import GenerationMixin

    class _DecoderOnly(GenerationMixin):
        config = type("_Config", (), {"is_encoder_decoder": False})()
        device = torch.device("cpu")

    return object.__new__(_DecoderOnly)


def logits_processor_list(settings: dict, eos_token_ids, prompt_length: int, max_length: int) -> list:
    """``generate``'s ``LogitsProcessorList`` for ``settings`` (its keyword arguments: do_sample,
    temperature, top_k, ...): built by its own ``_get_logits_processor`` after its own special-token
    preparation, so the processors, their order and their arguments are generate's. ``prompt_length``
    is generate's ``input_ids_seq_length`` (min-new-tokens counts from it), ``max_length`` its
    ``max_length`` (forced EOS fires on the last position before it). ValueError for a setting a
    processor refuses."""
    from transformers import GenerationConfig

    b = _builder()
    gc = GenerationConfig(**settings, eos_token_id=list(eos_token_ids) or None, max_length=int(max_length))
    b._prepare_special_tokens(gc, True, device=torch.device("cpu"))
    return list(b._get_logits_processor(gc, input_ids_seq_length=int(prompt_length), device=torch.device("cpu"),
                                        model_kwargs={}))  # fmt: skip


def candidate_generator(settings: dict, eos_token_ids, max_length: int, prompt_ids: list[int], vocab_size: int,
                        device: torch.device, *, assistant_model=None, prompt_lookup_num_tokens: int | None = None,
                        max_matching_ngram_size: int | None = None, num_assistant_tokens: int | None = None,
                        assistant_confidence_threshold: float | None = None):  # fmt: skip
    """The candidate generator ``generate``'s assisted decoding (``_get_candidate_generator``) builds for a
    decoder-only target with the same tokenizer: ``PromptLookupCandidateGenerator`` for
    ``prompt_lookup_num_tokens``, else ``AssistedCandidateGenerator`` over ``assistant_model`` (its own
    generation config: ``num_assistant_tokens``, the schedule, ``assistant_confidence_threshold``; given
    here, they replace what the draft's config says, as setting them there would). ``settings`` are
    generate's keyword arguments (do_sample, the processors'), ``max_length`` its max_length."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import (
        AssistedCandidateGenerator,
        PromptLookupCandidateGenerator,
    )
    from transformers.generation.logits_process import LogitsProcessorList

    gc = GenerationConfig(**settings, eos_token_id=list(eos_token_ids) or None, max_length=int(max_length))
    gc.update(**gc._get_default_generation_params(), defaults_only=True)  # what generate fills in (min_length 0, ...)
    _builder()._prepare_special_tokens(gc, True, device=device)
    processors = LogitsProcessorList(logits_processor_list(settings, eos_token_ids, len(prompt_ids), max_length))
    if prompt_lookup_num_tokens is not None:
        return PromptLookupCandidateGenerator(
            eos_token_id=gc._eos_token_tensor, num_output_tokens=int(prompt_lookup_num_tokens),
            max_matching_ngram_size=max_matching_ngram_size or 2, max_length=gc.max_length,
            logits_processor=processors, vocab_size=int(vocab_size),
        )  # fmt: skip
    ids: Any = torch.tensor([list(prompt_ids)], dtype=torch.long, device=assistant_model.device)  # (1, P): a LongTensor
    # generate's model_kwargs for an unpadded prompt: the mask it builds, the cache it threads
    gen = AssistedCandidateGenerator(ids, assistant_model, gc, {"attention_mask": torch.ones_like(ids), "use_cache": True},
                                     logits_processor=processors)  # fmt: skip
    if num_assistant_tokens is not None:  # what generate reads off the assistant's generation config
        gen.num_assistant_tokens = int(num_assistant_tokens)
    if assistant_confidence_threshold is not None:  # the draft's generate stops below it (0: never)
        t = float(assistant_confidence_threshold)
        gen.assistant_confidence_threshold = gen.assistant_generation_config.assistant_confidence_threshold = t
        gen.generation_config.assistant_confidence_threshold = t
    return gen


def bytes_to_unicode() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode as b2u

    return b2u()


def no_progress_bars() -> None:
    """transformers' own progress bars off: our front ends report loading progress themselves."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def quiet() -> None:
    """Keep transformers' own warnings and progress bars from burying our one-line messages."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    no_progress_bars()
    # huggingface_hub logs each retry of an unreachable hub ("Retrying in 8s [Retry 4/5]") on its own
    # logger; our loader says it once, in one line, after the retries
    from huggingface_hub.utils import logging as hub_logging

    hub_logging.set_verbosity_error()


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's chat template (Jinja text), or None where it ships none."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # named templates: generate's default is the one called "default"
        t = t.get("default")
    return t if isinstance(t, str) and t.strip() else None


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[int]]:
    """(the rendered text, its token ids), both exactly as ``tokenizer.apply_chat_template`` gives them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                        add_generation_prompt=add_generation_prompt)  # fmt: skip
    return str(text), [int(i) for i in ids]
