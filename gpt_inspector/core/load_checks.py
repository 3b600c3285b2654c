"""The refusals of a load: each reads a folder, a config or a loaded model and says in one line why
gpt-inspector will not step it (pickle weights, oversized tokenizer files, integer weights, not a
decoder-only LM, impossible head shapes, more weights than memory, weights that do not match the
config, a tokenizer larger than the vocabulary). ``models.load_model`` runs them in order, before
any weight is read where it can.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import hf
from .errors import InspectorError
from .fidelity import check_supported


def check_local_folder(path: Path, allow_pickle: bool) -> None:
    if not (path / "config.json").is_file():
        raise InspectorError(f"{path} is not a model folder (no config.json)")
    names = {p.name for p in path.iterdir()}
    has_st = any(n.endswith(".safetensors") for n in names)
    has_pickle = any(n.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl")) for n in names)
    if not has_st:
        if has_pickle and not allow_pickle:
            raise InspectorError(
                f"{path} has only pickle weights, which can run code when loaded; "
                "convert them to safetensors or pass --allow-pickle if you trust the source"
            )
        if not has_pickle:
            raise InspectorError(f"{path} has no weights (no *.safetensors file)")


# The tokenizer files a parser reads whole into memory (many times their size: a 50 MB tokenizer.json
# took 4.7 GB before its refusal). Real ones hold about 130 bytes per vocabulary entry (Gemma 3's
# 262,144 entries: 33 MB); 1 KB per entry, 16 MB at least, leaves room and stops a hostile file first.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")  # fmt: skip
TOKENIZER_BYTES_PER_ENTRY = 1024
TOKENIZER_MIN_LIMIT = 16 * 1024 * 1024
# floating-point weights: what the engine computes in (F8 for checkpoints stored in 8-bit floats)
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def check_tokenizer_sizes(path: Path, config) -> None:
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        text = getattr(config, "get_text_config", lambda: None)()
        vocab = getattr(text, "vocab_size", None) if text is not None else None
    limit = max(TOKENIZER_MIN_LIMIT, TOKENIZER_BYTES_PER_ENTRY * vocab if isinstance(vocab, int) and vocab > 0 else 0)
    for name in TOKENIZER_FILES:
        try:
            size = (path / name).stat().st_size
        except OSError:
            continue
        if size > limit:
            raise InspectorError(f"{path / name} is {size:,} bytes, more than a tokenizer for a vocabulary of "
                                 f"{vocab or 'unknown size'} needs (at most {limit:,}); it is not read")  # fmt: skip


def check_weight_dtypes(path: Path, config) -> None:
    """Every stored weight is a floating-point tensor, read from the safetensors headers alone.

    transformers casts integer weights to the load dtype without a word: an int32 checkpoint would
    run as a model of rounded numbers. Quantized checkpoints (a quantization_config) store integers by design.
    """
    if getattr(config, "quantization_config", None):
        return
    for f in sorted(path.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 2 <= n <= 100 * 1024 * 1024:
                    continue  # not a readable header: the weight loader refuses the file in its own words
                header = json.loads(fh.read(n))
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(header, dict):
            continue
        for name, info in header.items():
            dtype = info.get("dtype") if isinstance(info, dict) else None
            if name != "__metadata__" and isinstance(dtype, str) and name.endswith(("weight", "bias")) \
                    and dtype not in FLOAT_DTYPES:  # fmt: skip
                raise InspectorError(f"{f.name}: weight {name} is stored as {dtype}; gpt-inspector loads "
                                     "floating-point weights (F32, F16, BF16) only")  # fmt: skip


def check_causal(config, source: str) -> None:
    """Refuse, in one line, what is not a decoder-only LM we can reproduce: a known family by its own reason first."""
    check_supported(config, source)
    mt = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise InspectorError(f"{source} is an encoder-decoder ({mt}) model; gpt-inspector steps decoder-only models")
    # a custom architecture the user opted into (--trust-remote-code) names its own causal-LM class;
    # whether its attention is the model's own is then the fidelity self-test's to decide
    custom = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if mt not in hf.causal_lm_types() and not custom:
        raise InspectorError(f"{source} ({mt}) is not a causal language model that transformers knows")


# the deepest released decoders have a few hundred layers; a config far past that is damaged or
# hostile, and each layer is read and then built one by one (10^9 of them hung the load)
MAX_LAYERS = 4096


def check_shapes(config, source: str) -> None:
    """Shape rules a layer would otherwise enforce with a traceback deep in its constructor.

    Read per decoder layer: a heterogeneous config (Gemma 4) gives some layers their own head
    size and KV heads, and refuses to answer for them globally.
    """
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab <= 0:  # else a zero-row embedding loads
        raise InspectorError(f"{source}: its config gives a vocabulary of {vocab} tokens; it must be positive")
    n = getattr(config, "num_hidden_layers", None)
    if isinstance(n, int) and n > MAX_LAYERS:  # read per layer below, and built per layer by transformers
        raise InspectorError(f"{source}: its config asks for {n} layers; more than {MAX_LAYERS} is refused")
    layers = range(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else [0]
    seen = set()
    for layer in layers:
        try:
            shape = tuple(hf.layer_config_value(config, a, layer) for a in ("hidden_size", "num_attention_heads", "head_dim",
                                                                            "num_key_value_heads"))  # fmt: skip
        except Exception:  # an attribute_map pointing nowhere
            return
        if shape not in seen:
            seen.add(shape)
            hidden, heads, head_dim, kv = shape
            _check_layer_shape(hidden, heads, head_dim, kv, source)


def _check_layer_shape(hidden, heads, head_dim, kv, source: str) -> None:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (hidden, heads)):
        return
    if hidden <= 0 or heads <= 0:
        raise InspectorError(f"{source}: config has hidden size {hidden} and {heads} heads; both must be positive")
    if head_dim is None and hidden % heads:
        raise InspectorError(
            f"{source}: config says {heads} attention heads but a hidden size of {hidden}, "
            f"which {heads} does not divide; the config is damaged"
        )
    if isinstance(kv, int) and not isinstance(kv, bool) and (kv <= 0 or heads % kv):
        raise InspectorError(f"{source}: config says {heads} attention heads over {kv} KV heads, which does not divide")


def parameter_bytes(config, dtype: torch.dtype, trust_remote_code: bool = False) -> int | None:
    """The model's weights and buffers in bytes, counted on the meta device (nothing is allocated); None if unknown.

    Buffers count because a config can ask for a huge one without any weight growing (a
    positional table or a causal mask sized by a hostile ``n_positions``).
    """
    AutoModelForCausalLM, _ = hf.auto_classes()

    try:
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # the real load reports a config it cannot build, in its own words
        return None
    floats = sum(p.numel() for p in m.parameters() if p.is_floating_point())
    others = sum(p.numel() * p.element_size() for p in m.parameters() if not p.is_floating_point())
    # floating buffers follow the load's dtype only sometimes (rotary tables stay float32): the larger
    buffers = sum(
        b.numel() * max(b.element_size(), dtype.itemsize if b.is_floating_point() else 0) for b in m.buffers()
    )
    return floats * dtype.itemsize + others + buffers


def check_fits_in_memory(config, source: str, dtype: torch.dtype, trust_remote_code: bool,
                          dev: torch.device | None = None, placement: dict | None = None) -> None:  # fmt: skip
    """Refuse, before any weight is read, a model whose config describes more weights than fit."""
    from .validate import memory_bytes

    need = parameter_bytes(config, dtype, trust_remote_code)
    ram = memory_bytes()
    if need is None:
        return
    gib = lambda n: f"{n / 2**30:.2f} GiB"
    dt = str(dtype).removeprefix("torch.")
    if placement is not None:
        mem = placement.get("max_memory")
        if mem is None:  # accelerate's own defaults: every GPU and the machine's memory
            mem = {i: torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())}
            mem["cpu"] = ram or 0
        room = sum(v for k, v in mem.items() if k != "disk")
        if need <= room:
            return
        folder = placement.get("offload_folder")
        if folder is None:
            raise InspectorError(f"{source}: about {gib(need)} of weights in {dt}, more than the {gib(room)} the device "
                                 "map may use; raise --max-memory or give --offload-folder DIR to keep the rest on disk")  # fmt: skip
        import shutil

        probe = Path(folder)
        while not probe.exists():
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if need - room > free:
            raise InspectorError(f"{source}: {gib(need - room)} of its weights would go to disk under {folder}, "
                                 f"which has {gib(free)} free")  # fmt: skip
        return
    if dev is not None and dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        if need > total:
            raise InspectorError(f"{source}: about {gib(need)} of weights in {dt}, more than {dev}'s {gib(total)}; "
                                 "--device-map auto spreads it over the GPUs, the CPU and disk")  # fmt: skip
        return
    if not ram or need <= ram:
        return
    hint = "--dtype bfloat16 would halve it" if dtype == torch.float32 and need // 2 <= ram else "use a smaller model"
    raise InspectorError(
        f"{source}: its config describes about {need / 2**30:.1f} GiB of weights and buffers in "
        f"{dt}, more than this machine's {ram / 2**30:.1f} GiB of memory; {hint}"
    )


def check_loading_info(info: dict, source: str) -> None:
    """Missing or unexpected weights mean the checkpoint is not this model: refuse, never fill in randomly."""
    problems = []
    for key, what in (
        ("missing_keys", "missing"),
        ("unexpected_keys", "unexpected"),
        ("mismatched_keys", "wrong shape"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in (info.get(key) or ()))
        if names:
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            problems.append(f"{what}: {shown}")
    errors = info.get("error_msgs") or []
    if errors:
        problems.append(f"errors: {(str(errors[0]).strip().splitlines() or ['(no message)'])[0][:200]}")
    if problems:
        raise InspectorError(f"{source}: the weights do not match the model's config ({'; '.join(problems)})")


def check_vocab(model, tokenizer, source: str) -> tuple[str, ...]:
    """A tokenizer with ids past the model's embedding would index out of range: refuse. Fewer: warn."""
    emb = model.get_output_embeddings() or model.get_input_embeddings()
    if emb is None:
        return ()
    rows, n_tok = int(emb.weight.shape[0]), len(tokenizer)
    if n_tok > rows:
        raise InspectorError(
            f"{source}: the tokenizer has {n_tok} tokens but the model's vocabulary has {rows}; "
            "they do not belong together"
        )
    if n_tok < rows:
        # common and harmless (embeddings padded to a round size), but sampled ids past the tokenizer decode to nothing
        return (f"{source}: the model's vocabulary has {rows} entries, the tokenizer only {n_tok}",)
    return ()
