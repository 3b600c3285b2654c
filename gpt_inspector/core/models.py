"""Load a decoder-only model and its tokenizer, wired to our attention function."""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import adapters, capture, hf, kv_layout, outfile
from .errors import InspectorError
from .fidelity import check_supported, stepped_note, verify_fidelity


def _demo_model() -> str:
    """The embedded demo model (a tiny GPT-2 trained here); GPT_INSPECTOR_DEMO_MODEL overrides it.

    An installed package (wheel, ``pip install .``) carries it as ``gpt_inspector/demo_model``;
    a source checkout and an editable install read the repository's ``resources/demo-gpt2``.
    """
    pkg = Path(__file__).resolve().parents[1]
    for folder in (pkg / "demo_model", pkg.parent / "resources" / "demo-gpt2"):
        if (folder / "config.json").is_file():
            return str(folder)
    return str(pkg / "demo_model")  # missing: load_model says so in one line


DEMO_MODEL = os.environ.get("GPT_INSPECTOR_DEMO_MODEL") or _demo_model()

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


@dataclass
class LoadedModel:
    """A model ready for a Session: its shapes are read off a probe forward, not guessed from config."""

    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer (its decode, encode, convert_* and vocabulary)
    name: str
    device: torch.device
    dtype: torch.dtype
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # why the fidelity self-test could not vouch for this model (loaded with allow_unverified), or None
    unverified: str | None = None
    warnings: tuple[str, ...] = ()  # load-time doubts a front end should show (the CLI prints them)
    # what the cache holds per layer next to the K/V attention receives (read off the probe)
    kv_layout: kv_layout.KVLayout | None = None
    # loaded with accelerate's device_map: module name -> where it lives (GPU index, "cpu", "disk"); else None
    device_map: dict | None = None
    # one line on which of the model's computations the numbers are, where it has two that differ
    # (fidelity.STEPPED_DECODE: its stepped decode, as generate runs it, not its full-sequence forward); else None
    note: str | None = None

    @property
    def mirror_kv(self) -> bool:
        """Whether K/V must be recorded as attention received them (the cache holds something else)."""
        return self.kv_layout is not None and self.kv_layout.mirrored

    def new_cache(self):
        """An empty cache for a run: the model's own kind, full length on every attention layer."""
        own = self.kv_layout is not None and self.kv_layout.own_cache
        return kv_layout.new_cache(self.model.config, own)

    def cache_layer(self, layer: int) -> int:
        """The cache layer holding the K/V that ``layer``'s attention reads (itself, or a shared one)."""
        lk = None if self.kv_layout is None else self.kv_layout.layers[layer]
        return layer if lk is None or lk.reads is None else lk.reads

    @property
    def kv_group(self) -> int:
        """Query heads per KV head (1 for multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    def kv_head_of(self, head: int) -> int:
        return head // self.kv_group

    @property
    def cuda_devices(self) -> tuple[torch.device, ...]:
        """Every CUDA device a forward runs on: the one device, or each GPU of a device map."""
        gpus = {torch.device("cuda", d) for d in (self.device_map or {}).values() if isinstance(d, int)}
        if self.device.type == "cuda":
            gpus.add(
                self.device if self.device.index is not None else torch.device("cuda", torch.cuda.current_device())
            )
        return tuple(sorted(gpus, key=lambda d: d.index))

    def describe(self) -> str:
        gqa = f", {self.n_kv_heads} KV heads" if self.n_kv_heads != self.n_heads else ""
        where = str(self.device)
        if self.device_map:
            counts = Counter(f"cuda:{d}" if isinstance(d, int) else str(d) for d in self.device_map.values())
            where = "a device map (" + ", ".join(f"{n} {d}" for d, n in counts.items()) + " modules)"
        text = (
            f"{self.name}: {self.n_layers} layers, {self.n_heads} heads{gqa}, d_head {self.head_dim}, "
            f"context {self.context_length}, {str(self.dtype).removeprefix('torch.')} on {where}"
        )
        extra = [x for x in ("" if self.kv_layout is None else self.kv_layout.describe(), self.note or "") if x]
        return "; ".join([text, *extra])


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    d = str(device).strip().lower()
    mps = getattr(torch.backends, "mps", None)
    has_mps = mps is not None and mps.is_available()
    if d == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu")
    if d == "mps" and not has_mps:
        raise InspectorError("device 'mps' is not available on this machine; use --device cpu")
    if d in ("cpu", "mps"):
        return torch.device(d)
    if d == "cuda" or d.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise InspectorError(f"device {device!r} is not available (no CUDA GPU); use --device cpu or auto")
        idx = d.partition(":")[2]
        if idx and (not idx.isdigit() or int(idx) >= torch.cuda.device_count()):
            raise InspectorError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
        return torch.device(d)
    raise InspectorError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InspectorError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise InspectorError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16")
    return _DTYPES[key]


def _check_local_folder(path: Path, allow_pickle: bool) -> None:
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


def _check_tokenizer_sizes(path: Path, config) -> None:
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


def _check_weight_dtypes(path: Path, config) -> None:
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


def _load_config(source: str, local: bool, trust_remote_code: bool):
    try:
        return hf.AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise InspectorError(
                f"model {source!r} needs its own Python code; pass --trust-remote-code only if you trust it"
            ) from None
        raise InspectorError(f"cannot read the config of {source!r}: {_first_line(e)}") from None
    except OSError as e:
        if local:
            raise InspectorError(f"cannot read the config in {source}: {_first_line(e)}") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        where = "offline mode is on (HF_HUB_OFFLINE)" if offline else "the hub could not be reached"
        raise InspectorError(
            f"model {source!r} is not in the local cache and {where}; run once online or pass a folder"
        ) from None
    except Exception as e:  # a config class's own validation (huggingface_hub's strict dataclasses, __post_init__)
        raise InspectorError(f"cannot read the config of {source!r}: {_described(e)}") from None


def _check_causal(config, source: str) -> None:
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


def load_model(
    name_or_path: str | os.PathLike | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    allow_unverified: bool = False,
    device_map: str | dict | None = None,
    max_memory: str | dict | None = None,
    offload_folder: str | os.PathLike | None = None,
) -> LoadedModel:
    """Load a causal LM (hub id or local folder) with attention routed through our capture.

    Weights load from safetensors only unless ``allow_pickle``; remote code never runs unless
    ``trust_remote_code``. Honours ``HF_HUB_OFFLINE`` and the local HF cache. A model whose
    logits through our attention differ from its own eager attention is refused unless
    ``allow_unverified`` (then ``LoadedModel.unverified`` holds the reason).

    ``device_map`` ("auto", "balanced", "sequential" or a dict) spreads the layers over GPUs, the
    CPU and, past ``max_memory`` ({0: "20GiB", "cpu": "60GiB"} or "0=20GiB,cpu=60GiB"), disk
    under ``offload_folder``, through accelerate; capture records each layer where it runs.

    Every failure is an ``InspectorError`` of one line, never a traceback.
    """
    with _one_line(str(name_or_path) if name_or_path is not None else DEMO_MODEL):
        return _load_model(name_or_path, device, dtype, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                           allow_unverified=allow_unverified, device_map=device_map, max_memory=max_memory,
                           offload_folder=offload_folder)  # fmt: skip


def _load_model(name_or_path, device, dtype, *, allow_pickle, trust_remote_code, allow_unverified, device_map,
                max_memory, offload_folder) -> LoadedModel:  # fmt: skip
    AutoModelForCausalLM, AutoTokenizer = hf.auto_classes()
    hf.no_progress_bars()
    source = str(name_or_path) if name_or_path is not None else DEMO_MODEL
    if not source.strip():
        raise InspectorError("empty model name; give a hub id such as gpt2 or a folder")
    dt = resolve_dtype(dtype)
    placement = _placement(device, device_map, max_memory, offload_folder)
    dev = resolve_device(device) if placement is None else None
    path = outfile.expand(source)  # ~nosuchuser is one line, not pathlib's RuntimeError
    local = path.is_dir()
    if local:
        _check_local_folder(path, allow_pickle)
        source = str(path)
    elif path.exists() or source.startswith((".", "/", "~")) or os.sep in source and source.count("/") > 1:
        raise InspectorError(f"model folder {source!r} does not exist")
    config = _load_config(source, local, trust_remote_code)
    if local:  # hub downloads come through the hub's own checks; a folder is whatever is on disk
        _check_tokenizer_sizes(path, config)
        _check_weight_dtypes(path, config)
    _check_causal(config, source)
    _check_shapes(config, source)
    _check_fits_in_memory(config, source, dt, trust_remote_code, dev, placement)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise InspectorError(f"no usable tokenizer for {source}: {_first_line(e)}") from None
    except Exception as e:  # a tokenizer class's own failure (tokenizers' Exception, a KeyError in its files)
        raise InspectorError(f"no usable tokenizer for {source}: {_described(e)}") from None
    # transformers 5 builds an empty tokenizer when the folder has no tokenizer files
    if tokenizer is None or isinstance(tokenizer, bool) or len(tokenizer) < 2:
        raise InspectorError(f"no tokenizer found for {source}: add tokenizer.json (or vocab files) to the folder")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dt,
            use_safetensors=None if allow_pickle else True,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **(placement or {}),
        )
    except OSError as e:
        msg = _first_line(e)
        if not allow_pickle and ("safetensors" in msg.lower() or "pytorch_model.bin" in msg):
            raise InspectorError(
                f"{source} has no safetensors weights; pass --allow-pickle only if you trust the source"
            ) from None
        raise InspectorError(f"cannot load weights of {source}: {msg}") from None
    except Exception as e:
        import pickle

        if isinstance(e, pickle.UnpicklingError):
            raise InspectorError(
                f"cannot load weights of {source}: the pickle file holds something other than plain tensors"
            ) from None
        # a damaged weights file surfaces as whatever its reader raises (SafetensorError,
        # UnpicklingError, ValueError from a layer's own checks, ...): all mean "these weights are unusable"
        raise InspectorError(f"cannot load weights of {source}: {type(e).__name__}: {_first_line(e)}") from None
    _check_loading_info(info, source)
    warnings = _check_vocab(model, tokenizer, source)
    _wire(model, source)
    if placement is None:
        try:
            model.to(dev)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            raise InspectorError(f"cannot move the model to {dev}: {_first_line(e)}; try --device cpu") from None
    else:
        dev = _input_device(model)
    model.eval()
    lm = _probe_and_verify(model, tokenizer, source, dev, dt, allow_unverified)
    lm.warnings = warnings
    lm.device_map = dict(getattr(model, "hf_device_map", None) or {}) or None if placement else None
    return lm


def _placement(device, device_map, max_memory, offload_folder) -> dict | None:
    """from_pretrained's placement arguments for a device map, validated; None for one device."""
    from . import validate

    dmap, mem = validate.device_map(device_map), validate.max_memory(max_memory)
    if dmap is None:
        if mem is not None or offload_folder is not None:
            what = "--max-memory" if mem is not None else "--offload-folder"
            raise InspectorError(f"{what} applies to a device map: add --device-map auto")
        return None
    if str(device).strip().lower() not in ("auto", "") and not isinstance(device, torch.device):
        raise InspectorError(f"--device {device} and --device-map both say where the model goes: give one of them")
    try:
        import accelerate  # noqa: F401  (transformers needs it for a device map)
    except ImportError:
        raise InspectorError("--device-map needs the accelerate package: pip install accelerate") from None
    if mem is not None and any(isinstance(k, int) for k in mem) and not torch.cuda.is_available():
        raise InspectorError("--max-memory names a GPU but this machine has no CUDA GPU")
    out: dict = {"device_map": dmap}
    if mem is not None:
        out["max_memory"] = mem
    if offload_folder is not None:
        folder = outfile.expand(offload_folder)
        if folder.exists() and not folder.is_dir():
            raise InspectorError(f"offload folder {str(folder)!r} is a file, not a folder")
        if not folder.exists() and not folder.parent.is_dir():
            raise InspectorError(f"offload folder {str(folder)!r}: its parent folder does not exist")
        out["offload_folder"] = str(folder)
    return out


def _input_device(model) -> torch.device:
    """Where a device-mapped model takes its input ids: its first accelerator, else the CPU (disk runs there)."""
    for d in (getattr(model, "hf_device_map", None) or {}).values():
        if isinstance(d, int):
            return torch.device("cuda", d)
        if str(d) not in ("cpu", "disk", "meta"):
            return torch.device(str(d))
    return torch.device("cpu")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _described(e: BaseException) -> str:
    """``e`` in one line: its type and its message's first line (the type alone where it has no message)."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0].strip()[:200]}" if lines else type(e).__name__
    if lines and lines[0].rstrip().endswith(":") and e.__cause__ is not None:
        text += f" {_described(e.__cause__)}"  # a wrapper's first line only introduces its cause
    return text


@contextlib.contextmanager
def _one_line(name: str):
    """A failure the checks did not foresee, anywhere in a load, becomes a one-line refusal naming it."""
    try:
        yield
    except InspectorError:
        raise
    except Exception as e:
        raise InspectorError(f"{name} cannot be loaded: {_described(e)}") from None


# the deepest released decoders have a few hundred layers; a config far past that is damaged or
# hostile, and each layer is read and then built one by one (10^9 of them hung the load)
MAX_LAYERS = 4096


def _check_shapes(config, source: str) -> None:
    """Shape rules a layer would otherwise enforce with a traceback deep in its constructor.

    Read per decoder layer: a heterogeneous config (Gemma 4) gives some layers their own head
    size and KV heads, and refuses to answer for them globally.
    """
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
            _check_layer_shape(*shape, source)


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


def _check_fits_in_memory(config, source: str, dtype: torch.dtype, trust_remote_code: bool,
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


def _check_loading_info(info: dict, source: str) -> None:
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


def _check_vocab(model, tokenizer, source: str) -> tuple[str, ...]:
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


def _probe(model, tokenizer, name: str, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    """Run two positions through the model to learn its real attention shapes.

    A model whose layers never reach our attention function is refused here rather than showing
    empty views later.
    """
    cfg = model.config
    n_layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    if n_layers <= 0:
        raise InspectorError(f"{name}: cannot tell the number of layers from its config")
    rec = capture.Recorder(n_layers, mirror_kv=True)
    own_cache = kv_layout.needs_own_cache(cfg)
    cache = kv_layout.new_cache(cfg, own_cache)  # the kind a session steps with
    with torch.inference_mode(), rec.active():
        # two distinct ordinary tokens (not 0, often the pad id, whose embedding may be zero: every
        # layer's K would then look alike and the cache layout could not be told apart)
        vocab = int(model.get_input_embeddings().weight.shape[0])
        ids = torch.tensor([[1, 2]], dtype=torch.long, device=dev) * 7919 % max(vocab - 1, 1) + 1  # (1, 2)
        hf.call(model, cache, input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    # a hybrid's state-space (and feed-forward-only) layers never attend; every other layer must
    silent = kv_layout.silent_layers(cache) if own_cache else set()
    missing = [i for i, c in enumerate(rec.calls) if c == 0 and i not in silent]
    if missing or not any(rec.calls):
        missing = missing or list(range(n_layers))
        raise InspectorError(
            f"{name}: layers {missing[:5]} did not call transformers' attention interface; this model is not supported"
        )
    layout = kv_layout.read_layout(rec, cache, n_layers, 2, own_cache, hf.cache_keeps(cfg))
    first = layout.attention_layers[0]
    _, n_heads, _, head_dim = rec.q[first].t.shape
    n_kv = rec.k[first].t.shape[1]
    named = (getattr(cfg, attr, None) for attr in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"))
    ctx = next((v for v in named if isinstance(v, int) and v > 0), None)
    tok_max = getattr(tokenizer, "model_max_length", None)
    if ctx is None and isinstance(tok_max, int) and 0 < tok_max < 10**7:
        ctx = tok_max
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        bos = cfg.bos_token_id if isinstance(cfg.bos_token_id, int) else None
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        device=dev,
        dtype=dt,
        n_layers=n_layers,
        n_heads=int(n_heads),
        n_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        context_length=int(ctx or 2048),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        eos_token_ids=eos_ids,
        bos_token_id=bos,
        kv_layout=layout,
        note=stepped_note(cfg),
    )


def from_model(model, tokenizer, name: str = "model", *, allow_unverified: bool = False) -> LoadedModel:
    """A causal LM already in memory (built or loaded by the caller), wired, probed and verified.

    The same checks as ``load_model`` after the weights are in: supported family, attention
    routed through our function, the fidelity self-test.
    """
    with _one_line(name):
        _check_causal(model.config, name)
        _wire(model, name)
        model.eval()
        p = next(model.parameters(), None)
        if p is None:
            raise InspectorError(f"{name} has no parameters: not a language model")
        return _probe_and_verify(model, tokenizer, name, p.device, p.dtype, allow_unverified)


def _wire(model, name: str) -> None:
    """Route the model's attention through our capture function."""
    try:
        model.set_attn_implementation(capture.ATTN_NAME)
    except (ValueError, AttributeError) as e:
        raise InspectorError(
            f"{name} does not dispatch attention through transformers' attention interface: {e}"
        ) from None
    adapters.adapt(model, name)  # families that compute attention in their own code


def _probe_and_verify(model, tokenizer, name: str, dev, dt, allow_unverified: bool) -> LoadedModel:
    """The probe and the fidelity self-test; a model that crashes in them is refused in one line.

    Families we have not met can break inside their own forward once our attention runs in it
    (a cache type of their own, shapes our function does not expect); that is a refusal, not a
    traceback.
    """
    try:
        return verify_fidelity(_probe(model, tokenizer, name, dev, dt), allow_unverified)
    except InspectorError:
        raise
    except Exception as e:  # whatever the family's own code raises (its own exception types included)
        mt = getattr(model.config, "model_type", "?")
        raise InspectorError(
            f"{name} ({mt}) is not supported: its forward fails with gpt-inspector's attention ({_described(e)})"
        ) from None
