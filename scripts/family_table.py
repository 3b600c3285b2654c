"""Print the README's "Model families" lists from the code that checks them, for the installed transformers.

The verified list is ``VERIFIED`` and ``VARIANTS`` of tests/parity/test_families.py (the families
whose per-step logits, probabilities, greedy and beams that file checks against HF), the refused
table ``gpt_inspector.core.fidelity.REFUSED`` and the adapters' refused config variants. Counts
are of the model types the installed transformers maps to a causal-LM head. Run the family tests
on the same release first; paste the output into README.md.

    .venv/bin/python scripts/family_table.py
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests"):  # run as `python scripts/...`: sys.path[0] is scripts/
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

TEST_FILE = REPO / "tests" / "parity" / "test_families.py"


def _test_lists() -> dict[str, object]:
    """VERIFIED, VARIANTS and PENDING_ELSEWHERE as the test file defines them, read without importing it (pytest)."""
    found = {}
    for node in ast.parse(TEST_FILE.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if name not in ("VERIFIED", "VARIANTS", "PENDING_ELSEWHERE"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "split":
                found[name] = ast.literal_eval(value.func.value).split()  # """...""".split()
            else:
                found[name] = ast.literal_eval(value)
    return found


def _variant(name: str) -> str:
    """``falcon`` with ``multi_query=False``: a tiny_families variant as its family and the config it changes."""
    import tiny_families

    family, overrides = tiny_families.VARIANTS[name]

    def flat(d, prefix=""):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={v!r}"]

    return f"`{family}` with `{', '.join(flat(overrides))}`"


def _refused_variants(verified: set[str]) -> list[tuple[str, str]]:
    """(variant, reason) for the tiny_families variants an adapter refuses (Falcon with ALiBi)."""
    import tiny_families

    from gpt_inspector.core import adapters

    out = []
    for name, (family, _) in tiny_families.VARIANTS.items():
        limit = adapters.LIMITS.get(family)
        why = None if name in verified or limit is None else limit(tiny_families.small_config(name, eos=0))
        if why:
            lead, _, rest = why.partition(": ")  # "Falcon with ALiBi: ...": the row names the variant already
            out.append((_variant(name), rest if rest and family in lead.lower() else why))
    return out


def _code(text: str, names: set[str]) -> str:
    """Model types and identifiers in a reason, in backticks (the README's style)."""

    def mark(m):
        w = m.group(0)
        camel = re.fullmatch(r"(?:[A-Z][a-z0-9]+){3,}", w)  # a class name (MiniMaxCache), not a model's (EnCodec)
        return f"`{w}`" if w in names or "_" in w or camel else w

    return re.sub(r"(?<![\w`-])[A-Za-z][\w-]*[A-Za-z0-9](?![\w`-])", mark, text)


def verified_line() -> str:
    """The README's "**Verified (N):**" paragraph: every verified model type, then the verified variants."""
    lists = _test_lists()
    verified, variants = sorted(lists["VERIFIED"]), list(lists["VARIANTS"])
    return (f"**Verified ({len(verified)}):** " + ", ".join(f"`{mt}`" for mt in verified)
            + "; variants: " + "; ".join(_variant(v) for v in variants) + ".")  # fmt: skip


def refused_table() -> list[str]:
    """The README's refused table, one row per reason (in the order REFUSED gives them), then refused variants."""
    from gpt_inspector.core.fidelity import REFUSED

    # the types the lists name (not every config type: "encoder-decoder" is one, and a word here), the same on
    # every transformers release
    names = set(_test_lists()["VERIFIED"]) | set(REFUSED)
    rows: dict[str, list[str]] = {}
    for mt in REFUSED:
        rows.setdefault(REFUSED[mt], []).append(mt)
    lines = ["| families | why |", "|---|---|"]
    lines += [f"| {', '.join(f'`{mt}`' for mt in sorted(mts))} | {_code(why, names)} |" for why, mts in rows.items()]
    refused_variants = _refused_variants(set(_test_lists()["VARIANTS"]))
    lines += [f"| {variant} | {_code(why, names)} |" for variant, why in refused_variants]
    return lines


def main() -> None:
    from gpt_inspector.core import hf
    from gpt_inspector.core.fidelity import REFUSED

    lists = _test_lists()
    verified, variants = sorted(lists["VERIFIED"]), list(lists["VARIANTS"])
    pending = set(lists.get("PENDING_ELSEWHERE", ()))
    causal = hf.causal_lm_types()
    refused = [mt for mt in REFUSED if mt in causal]
    others = sorted(set(causal) - set(verified) - set(refused) - pending)
    classes = {causal[mt] for mt in verified}

    print(f"Checked on **transformers {hf.VERSION}**: of the {len(causal)} model types it maps to a causal-LM head, "
          f"{len(verified)} are verified and {len(refused)} refused at load"
          + (f"; {len(pending)} ({', '.join(f'`{p}`' for p in sorted(pending))}) are being checked on another branch"
             if pending else "")
          + (f"; not yet either: {', '.join(others)}" if others else "") + ".")  # fmt: skip
    print()
    print(f"Counted as TransformerLens counts its families (the model types it supports): {len(verified)} verified "
          f"decoder-only model types and {len(variants)} config variants with code paths of their own, "
          f"{len(verified) + len(variants)} in all ({len(classes)} distinct transformers causal-LM classes: several "
          "model types share one, e.g. `exaone` runs `LlamaForCausalLM`).")  # fmt: skip
    print()
    print(verified_line())
    print()
    print("**Refused at load**, in one line naming the reason (exit status 2 from the CLI):")
    print()
    print("\n".join(refused_table()))


if __name__ == "__main__":
    main()
