"""Attack the command line with bad values and hostile model folders, and count what is handled.

    .venv/bin/python scripts/attack.py [--jobs 2] [--only cli|models] [--list]

Every value-taking option of every headless sub-command gets a pool of bad values chosen by the
option's kind (number, path, choice, text); every field of the demo model's config and its tokenizer and
weights files get hostile replacements. Each case runs `gpt_inspector.cli.main(argv)` in a forked
child of this process, which imported torch and transformers once, so a case starts in milliseconds and
a crash, an OOM kill or a hang ends only that child (it is killed after --timeout seconds; its OOM score
is raised so that the kernel picks it first).

Outcomes: "refused" (exit 2, one line on stderr, no traceback: what the README promises), "ran" (exit 0:
the value was one the command accepts, e.g. 0 for a count that may be 0; listed with --list) and
"escaped" (anything else: a traceback, several lines, another exit code, a signal or a timeout; always
listed). Prints the counts per front door; exit 1 when anything escaped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "resources" / "demo-gpt2"

NUMBERS = ["-1", "0", "nan", "inf", "-inf", "1e309", "1e-45", "1e-38", str(10**30), "abc", "", "²", "0x10", "1.5"]
TEXTS = ["", "a\ud800b", "x" * 200_000, "\x00", "-"]
PATHS = ["~nosuchuser-attack/x", "{long}", "{dir}", "{fifo}", "{ro}/x.png", "", "a\ud800b", "{missing}/x.png"]
CHOICES = ["nosuch", "", "a\ud800b"]

BASE = {
    "trace": ["trace", "--prompt", "She eats", "--steps", "1", "--out", "{tmp}/t.safetensors", "--force"],
    "compare": ["compare", "--prompt", "She eats", "--max-new-tokens", "2"],
    "export": ["export", "--prompt", "x", "--steps", "1", "--layer", "0", "--head", "0", "--out", "{tmp}/e.png"],
    "probe-cache": ["probe-cache", "--prompt", "She eats"],
    "math-check": ["math-check", "--prompt", "x", "--steps", "1"],
    "lens": ["lens", "--prompt", "x"],
    "kv-lab": ["kv-lab", "--prompt", "x", "--policy", "int8", "--steps", "1"],
}
# options whose bad values need another run of the model to mean anything, or that open the window
SKIP = {"help", "json", "force", "derived", "sample", "full_resolution", "free_running", "probe", "allow_pickle",
        "trust_remote_code", "unverified", "sweep", "no_probe"}  # fmt: skip
PATHLIKE = ("out", "trace", "model", "prompts", "folder", "screenshot", "json", "messages")


def pool(action) -> list[str]:
    if action.choices:
        return CHOICES
    name = action.dest
    if any(p in name for p in PATHLIKE):
        return PATHS
    kind = getattr(action.type, "__name__", "")
    if action.type in (int, float) or kind in ("int", "float") or "int" in kind or "float" in kind:
        return NUMBERS
    return NUMBERS + TEXTS  # free text parsed by the command itself (ids, budgets, layers, L.H)


# the model and decoding options every command shares (one code path, commands/common.py) are attacked
# through these commands only; the others get their own options
SHARED_ON = ("trace", "compare", "kv-lab")


def shared_dests() -> tuple[set[str], set[str]]:
    """(model options, decoding options)."""
    from gpt_inspector.commands import common

    model = argparse.ArgumentParser(add_help=False)
    common.add_model_args(model)
    decoding = argparse.ArgumentParser(add_help=False)
    common.add_decoding_args(decoding)
    return {a.dest for a in model._actions}, {a.dest for a in decoding._actions}


def cli_cases() -> list[tuple[str, list[str]]]:
    from gpt_inspector.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    model_dests, decoding_dests = shared_dests()
    cases = []
    for command, base in BASE.items():
        sp = subs.choices[command]
        for action in sp._actions:
            if action.dest in SKIP or action.nargs == 0 or not action.option_strings:
                continue
            if action.dest in model_dests and command != "trace":
                continue
            if action.dest in decoding_dests and command not in SHARED_ON:
                continue
            flag = max(action.option_strings, key=len)
            for value in pool(action):
                argv = list(base)
                if flag in argv:  # replace the base's own value
                    i = argv.index(flag)
                    argv[i + 1] = value
                else:
                    argv += [flag, value]
                cases.append((f"{command} {flag} {value[:40]!r}", argv))
    return cases


CONFIG_FIELDS = ["model_type", "n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "eos_token_id",
                 "bos_token_id", "n_inner", "layer_norm_epsilon", "activation_function", "architectures",
                 "dtype", "tie_word_embeddings", "scale_attn_weights"]  # fmt: skip
CONFIG_VALUES = [None, -1, 0, 1.5, "12", [1], {}, 10**9, 200_000, True, "nan", "x" * 10_000]
WHOLE_FILES = ["null", "[]", "1", '"x"', "{", "", "[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000]


def model_cases(tmp: Path) -> list[tuple[str, list[str]]]:
    """Folders beside each other in tmp, each the demo model with one file made hostile."""
    cases = []
    config = json.loads((DEMO / "config.json").read_text())
    tokenizer = (DEMO / "tokenizer.json").read_text()

    def folder(name: str, files: dict[str, bytes | str]) -> Path:
        d = tmp / "models" / name
        shutil.copytree(DEMO, d)
        for fname, content in files.items():
            data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
            (d / fname).write_bytes(data)
        return d

    def add(name: str, files: dict[str, bytes | str]) -> None:
        d = folder(name, files)
        argv = ["trace", "--model", str(d), "--prompt", "She eats", "--steps", "1", "--out", "{tmp}/m.safetensors",
                "--force"]  # fmt: skip
        cases.append((f"model {name}", argv))

    for i, whole in enumerate(WHOLE_FILES):
        add(f"config-whole-{i}", {"config.json": whole})
        add(f"tokenizer-whole-{i}", {"tokenizer.json": whole})
    for field in CONFIG_FIELDS:
        for j, value in enumerate(CONFIG_VALUES):
            add(f"config-{field}-{j}", {"config.json": json.dumps({**config, field: value})})
    half = len(tokenizer) // 2
    tok = json.loads(tokenizer)
    backtrack = json.loads(tokenizer)
    backtrack["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a|a?)+$"}, "behavior": "Isolated",
                                  "invert": False}  # fmt: skip
    add("tokenizer-backtracking-regex", {"tokenizer.json": json.dumps(backtrack)})
    add("tokenizer-truncated", {"tokenizer.json": tokenizer[:half]})
    add("tokenizer-vocab-list", {"tokenizer.json": json.dumps({**tok, "model": {**tok["model"], "vocab": [1, 2]}})})
    add("tokenizer-no-model", {"tokenizer.json": json.dumps({k: v for k, v in tok.items() if k != "model"})})
    add("tokenizer-config-null", {"tokenizer_config.json": "null"})
    add("generation-config-null", {"generation_config.json": "null"})
    add("generation-config-bad-eos", {"generation_config.json": json.dumps({"eos_token_id": "x"})})
    weights = (DEMO / "model.safetensors").read_bytes()
    add("weights-truncated", {"model.safetensors": weights[: len(weights) // 2]})
    add("weights-empty", {"model.safetensors": b""})
    add("weights-header-garbage", {"model.safetensors": (100).to_bytes(8, "little") + b"\xff" * 100})
    add("weights-header-huge", {"model.safetensors": (2**62).to_bytes(8, "little") + b"{}"})
    return cases


def fill(argv: list[str], tmp: Path) -> list[str]:
    subs = {"{tmp}": str(tmp / "out"), "{long}": str(tmp / ("n" * 300 + ".png")), "{dir}": str(tmp / "d.png"),
            "{fifo}": str(tmp / "fifo.png"), "{ro}": str(tmp / "ro"), "{missing}": str(tmp / "missing")}  # fmt: skip
    out = []
    for a in argv:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def run_case(argv: list[str], tmp: Path, timeout: float) -> tuple[str, str]:
    """Fork, run main(argv) in the child with stdout/stderr to files, classify the result."""
    err = tmp / f"err-{os.getpid()}-{time.monotonic_ns()}"
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            Path("/proc/self/oom_score_adj").write_text("1000")
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            from gpt_inspector.cli import main

            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 71
        finally:
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "escaped", f"timeout after {timeout:.0f} s"
        time.sleep(0.02)
    text = err.read_text(errors="replace") if err.exists() else ""
    err.unlink(missing_ok=True)
    lines = [line for line in text.splitlines() if line.strip()]
    if os.WIFSIGNALED(status):
        return "escaped", f"killed by signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "ran", ""
    if code == 2 and len(lines) == 1 and "Traceback" not in text:
        return "refused", lines[0]
    return "escaped", f"exit {code}, {len(lines)} lines: " + " | ".join(lines[-3:])[:300]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["cli", "models"])
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--list", action="store_true", help="also list the cases that ran (exit 0)")
    ap.add_argument("--log", type=Path, help="write every case's outcome to this file, one JSON object a line")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from gpt_inspector.cli import quiet_transformers

    quiet_transformers()  # torch and transformers imported once; every child inherits them
    tmp = Path(tempfile.mkdtemp(prefix="gpt-inspector-attack-"))
    try:
        (tmp / "out").mkdir()
        (tmp / "d.png").mkdir()
        os.mkfifo(tmp / "fifo.png")
        (tmp / "ro").mkdir()
        (tmp / "ro").chmod(stat.S_IRUSR | stat.S_IXUSR)
        groups = []
        if args.only in (None, "cli"):
            groups.append(("CLI values and paths", cli_cases()))
        if args.only in (None, "models"):
            groups.append(("model folders", model_cases(tmp)))
        escaped_total = 0
        log = args.log.open("w") if args.log else None
        for title, cases in groups:
            counts = {"refused": 0, "ran": 0, "escaped": 0}
            t0 = time.monotonic()
            for name, argv in cases:
                outcome, detail = run_case(fill(argv, tmp), tmp, args.timeout)
                counts[outcome] += 1
                if log:
                    print(json.dumps({"case": name, "outcome": outcome, "detail": detail}), file=log, flush=True)
                if outcome == "escaped" or (outcome == "ran" and args.list):
                    print(f"  {outcome:8s} {name}: {detail}", flush=True)
            escaped_total += counts["escaped"]
            print(f"{title}: {len(cases)} cases, {counts['refused']} refused in one line, {counts['ran']} ran "
                  f"(a value the command accepts), {counts['escaped']} escaped "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
        if log:
            log.close()
        return 1 if escaped_total else 0
    finally:
        (tmp / "ro").chmod(stat.S_IRWXU)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
