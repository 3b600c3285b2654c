"""Load a decoder-only model and its tokenizer, wired to our attention function."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import adapters, capture, hf, kv_layout, load_checks, outfile
from .errors import InspectorError
from .fidelity import stepped_note, verify_fidelity


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
        load_checks.check_local_folder(path, allow_pickle)
        source = str(path)
    elif path.exists() or source.startswith((".", "/", "~")) or os.sep in source and source.count("/") > 1:
        raise InspectorError(f"model folder {source!r} does not exist")
    config = _load_config(source, local, trust_remote_code)
    if local:  # hub downloads come through the hub's own checks; a folder is whatever is on disk
        load_checks.check_tokenizer_sizes(path, config)
        load_checks.check_weight_dtypes(path, config)
    load_checks.check_causal(config, source)
    load_checks.check_shapes(config, source)
    load_checks.check_fits_in_memory(config, source, dt, trust_remote_code, dev, placement)
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
    load_checks.check_loading_info(info, source)
    warnings = load_checks.check_vocab(model, tokenizer, source)
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
    assert rec.k is not None  # the recorder mirrors K/V (mirror_kv=True above)
    q_rows, k_rows = rec.q[first].t, rec.k[first].t
    assert q_rows is not None and k_rows is not None  # every attention layer was called (checked above)
    _, n_heads, _, head_dim = q_rows.shape
    n_kv = k_rows.shape[1]
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
        load_checks.check_causal(model.config, name)
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
