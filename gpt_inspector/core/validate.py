"""Argument rules shared by every front door (Session, beam search, compare, the CLI).

One copy of each rule, so a prompt or a count that one path accepts is accepted by all.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile

import numpy as np

from .errors import InspectorError


def integer(name: str, v, low: int) -> int:
    """``v`` as an int >= ``low`` (bools and floats refused), else InspectorError."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise InspectorError(f"{name} must be an integer >= {low}, got {v!r}")
    return int(v)


def json_number(x: float | None) -> float | None:
    """``x`` as a float for JSON output, or None where it is None, NaN or inf (JSON has no such numbers)."""
    return float(x) if x is not None and math.isfinite(x) else None


def count(n, name: str = "steps") -> int:
    """A number of steps (>= 1)."""
    return integer(name, n, 1)


SEED_MAX = 2**63 - 1  # torch.Generator takes a signed 64-bit seed


def seed(v, name: str = "seed") -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= SEED_MAX:
        raise InspectorError(f"{name} must be an integer in [0, 2**63-1], got {_short(v)}")
    return int(v)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def text(v, name: str = "prompt") -> str:
    """Text the tokenizer can take: a str that is valid Unicode (no lone surrogates).

    Invalid UTF-8 on a command line reaches Python as lone surrogates (surrogateescape).
    """
    if not isinstance(v, str):
        raise InspectorError(f"{name} must be text, got {type(v).__name__}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InspectorError(
            f"{name} is not valid text: character {e.start} is {v[e.start]!r}, a lone surrogate "
            "(invalid UTF-8 in the input?)"
        ) from None
    return v


def length_penalty(v, context_length: int) -> float:
    """A finite length penalty whose ``length ** penalty`` stays finite for every length the model allows."""
    try:
        lp = float(v)
    except (TypeError, ValueError, OverflowError):
        raise InspectorError(f"length_penalty must be a number, got {_short(v)}") from None
    if not math.isfinite(lp):
        raise InspectorError(f"length_penalty must be finite, got {_short(v)}")
    bound = 700 / math.log(max(context_length, 2))  # e**700 is near float64's limit
    if abs(lp) > bound:
        raise InspectorError(
            f"length_penalty {lp:g} overflows: with a context of {context_length} tokens it must be within "
            f"[-{bound:.0f}, {bound:.0f}]"
        )
    return lp


# every beam is a batch row of every forward and every candidate a node of the tree the window and
# `compare` draw; far past this a search is minutes of Python per step, not something to step through
MAX_BEAMS = 1024


def beams(lm, num_beams, total_length: int, prompt_length: int = 0) -> int:
    """A beam count whose KV cache, records and search state fit in memory (an estimate, refused before allocating)."""
    n = integer("num_beams", num_beams, 1)
    if n > MAX_BEAMS:
        raise InspectorError(f"num_beams {n} is more than the {MAX_BEAMS} beams this tool steps through")
    need, per_beam = beam_bytes(lm, n, total_length, prompt_length)
    ram = memory_bytes()
    if ram and need > ram:
        most = max(1, int(ram // max(1, per_beam)))
        raise InspectorError(
            f"num_beams {n} would need about {need / 2**30:.1f} GiB for the cache, records and search state; "
            f"this machine has {ram / 2**30:.1f} GiB; use at most about {most} beams or a shorter length"
        )
    return n


def beam_bytes(lm, n: int, total_length: int, prompt_length: int = 0) -> tuple[int, int]:
    """(bytes for ``n`` beams, bytes per beam) of a search to ``total_length`` tokens."""
    itemsize = getattr(lm.dtype, "itemsize", 4)  # a dtype without one: assume float32
    # per beam and position: K and V per KV head, our q and head-output records per query head
    per_token = lm.n_layers * lm.head_dim * (2 * lm.n_kv_heads + 2 * lm.n_heads) * itemsize
    V = lm.vocab_size
    # the search state of one step, per beam: the model's logits, generate's float32 copy, the
    # log-softmax, the accumulated scores and topk's work on them (num_beams x vocab each) ...
    step = V * (itemsize + 4 * 4)
    # ... and each step's float32 logits, kept for the window and `compare`
    kept = V * 4 * max(1, total_length - prompt_length)
    per_beam = total_length * per_token + step + kept
    return n * per_beam, per_beam


def early_stopping(v) -> bool | str:
    """generate's ``early_stopping``: True, False or "never" (strings accepted from the CLI)."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "never"):
        return {"true": True, "false": False}.get(v.strip().lower(), "never")
    raise InspectorError(f"early_stopping must be True, False or 'never', got {v!r}")


@contextlib.contextmanager
def _stderr_held():
    """File descriptor 2 held in a temporary file, replayed unless the block raised.

    A Rust panic prints its own multi-line report straight to fd 2 before Python sees the
    exception; a refusal is one line, and anything else written there meanwhile is kept.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (a GUI launched without one): nothing to hold
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                held.seek(0)
                data = held.read()
                if data:
                    os.write(2, data)


def _tokenize(lm, prompt: str) -> list[int]:
    try:
        with _stderr_held():
            return list(lm.tokenizer(prompt)["input_ids"])
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:
        # tokenizers' Rust panics (a pre-tokenizer regex past Oniguruma's backtracking limit) derive
        # from BaseException, not Exception: the tokenizer files are as untrusted as the config
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise InspectorError(f"the tokenizer failed on this prompt: {type(e).__name__}: {first}") from None


def prompt_ids(lm, prompt, ids) -> list[int]:
    """The token ids a run starts from: ``ids`` if given, else ``prompt`` tokenized; BOS for an empty prompt."""
    if ids is None:
        text(prompt)
        out = _tokenize(lm, prompt) if prompt else []
    else:
        if isinstance(ids, (str, bytes)):
            raise InspectorError("prompt token ids must be a list of integers, not text")
        try:
            out = list(ids)
        except TypeError:
            raise InspectorError("prompt token ids must be a list of integers") from None
        if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in out):
            raise InspectorError("prompt token ids must be integers")
        out = [int(i) for i in out]
        if any(i < 0 or i >= lm.vocab_size for i in out):
            raise InspectorError(f"prompt token ids must be in [0, {lm.vocab_size})")
    if not out:
        if lm.bos_token_id is None:
            raise InspectorError("empty prompt and this tokenizer has no BOS token to start from; type a prompt")
        out = [lm.bos_token_id]
    return out


CGROUP_ROOT = "/sys/fs/cgroup"


def memory_bytes() -> int | None:
    """The memory this process may use, in bytes: the machine's physical memory, or its container's
    (cgroup) limit where that is lower; None where the system says neither."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        ram = None
    limit = _cgroup_limit()
    if limit is not None and (ram is None or limit < ram):
        return limit
    return ram


def _cgroup_limit() -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors (v2 memory.max, or v1's
    memory.limit_in_bytes); None where there is none (v1 writes a huge number for no limit)."""
    from pathlib import Path

    root = Path(CGROUP_ROOT)
    where = {"0": "/", "memory": "/"}  # the v2 hierarchy, the v1 memory controller
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, own = line.split(":", 2)
            for key in ("0" if not controllers else "", *controllers.split(",")):
                if key in where:
                    where[key] = own.strip() or "/"
    files = []
    for base, key, name in ((root, "0", "memory.max"), (root / "memory", "memory", "memory.limit_in_bytes")):
        parts = [p for p in where[key].split("/") if p and p != ".."]
        files += [base.joinpath(*parts[:i], name) for i in range(len(parts), -1, -1)]  # own group, then ancestors
    found = []
    for f in files:
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text().strip()
            if text != "max":
                found.append(int(text))
    found = [x for x in found if 0 < x < 1 << 60]  # v1's "no limit" is 2**63 rounded down to a page
    return min(found) if found else None


# accelerate's placement strategies; a dict (module name -> device) is passed through as given
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def device_map(v) -> str | dict | None:
    """None (one device), one of ``DEVICE_MAPS``, or a dict module name -> device as accelerate takes it."""
    if v is None or isinstance(v, dict):
        return v
    s = str(v).strip().lower()
    if not s or s == "none":
        return None
    if s not in DEVICE_MAPS:
        raise InspectorError(f"--device-map must be one of {', '.join(DEVICE_MAPS)}, got {_short(v)}")
    return s


def size_bytes(v, name: str = "size") -> int:
    """``20GiB``, ``500MB``, ``1.5GB`` or a plain number of bytes, as an int > 0."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        n = float(v)
    else:
        s = str(v).strip().lower().replace(" ", "")
        num = s.rstrip("kmgtib")
        unit = s[len(num) :]
        try:
            n = float(num) * _UNITS[unit]
        except (ValueError, KeyError):
            raise InspectorError(
                f"{name} must be a size such as 20GiB, 512MB or a number of bytes, got {_short(v)}"
            ) from None
    if not math.isfinite(n) or n <= 0:
        raise InspectorError(f"{name} must be a size above zero, got {_short(v)}")
    return int(n)


def max_memory(v) -> dict | None:
    """``0=20GiB,cpu=60GiB`` (or that dict) -> {0: bytes, "cpu": bytes}: per GPU index, cpu, mps or disk."""
    if v is None:
        return None
    if isinstance(v, dict):
        items = list(v.items())
    else:
        s = str(v).strip()
        if not s:
            return None
        items = []
        for part in s.split(","):
            key, eq, size = part.partition("=")
            if not eq:
                raise InspectorError(f"--max-memory takes DEVICE=SIZE pairs such as 0=20GiB,cpu=60GiB, got {_short(v)}")
            items.append((key, size))
    out: dict = {}
    for key, size in items:
        name = str(key).strip().lower().removeprefix("cuda:")
        k: str | int = name
        if name.isascii() and name.isdigit():  # str.isdigit is true for "²", which int() refuses
            k = int(name)
        elif name not in ("cpu", "mps", "disk"):
            raise InspectorError(
                f"--max-memory devices are GPU indices (0, 1, ...), cpu, mps or disk, got {_short(key)}"
            )
        if k in out:
            raise InspectorError(f"--max-memory names {k!r} twice")
        out[k] = size_bytes(size, f"--max-memory {k}")
    return out
