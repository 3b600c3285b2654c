"""The README's kvpress comparison table: the lab's copies of kvpress's presses against kvpress itself.

    python scripts/kvpress_table.py DUMP_DIR

DUMP_DIR is what ``scripts/kvpress_dump.py`` wrote in kvpress's environment (``scripts/kvpress-env.sh``
runs both): the tiny checkpoints, and per case kvpress's kept entries and logits. Here, in the
project's environment, each case runs in the lab (``kvlab.from_press`` with the copy from
``kvlab.presses``, context compressed at prefill, question and answer uncompressed, free-running
greedy as kvpress's pipeline) and is compared: kept sets per (layer, KV head) and the largest logit
difference over the question's last position and the answer steps. Prints one markdown row per case;
tests/core/test_kvpress_parity.py asserts the rows.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# why a row is not exact, where it cannot be; every other row must be exact
EXPLAINED = {
    "per_layer_knorm": "kept sets only: kvpress runs layers of different lengths under flash attention alone "
    "(its sdpa and eager masks fail), so it gives no logits on the CPU",
}


@dataclass
class Row:
    family: str
    case: str
    sets_same: int
    sets: int
    max_logit_diff: float
    tokens_same: bool

    @property
    def exact(self) -> bool:
        return self.sets_same == self.sets and self.tokens_same and self.max_logit_diff <= 1e-4

    def markdown(self) -> str:
        note = "exact (logits to float32 rounding)" if self.exact else EXPLAINED.get(self.case, "DIFFERS")
        diff = "—" if self.max_logit_diff != self.max_logit_diff else f"{self.max_logit_diff:.1e}"
        return f"| {self.case} | {self.family} | {self.sets_same}/{self.sets} | {diff} | {note} |"


def build_press(settings: dict, tensors: dict):
    """The lab's copy of the press a case names, with the case's settings."""
    from gpt_inspector.core.kvlab import presses as P

    ratio = 0.5
    name = settings["press"]
    if name == "AdaKVPress":
        inner = build_press({**settings, "press": settings["inner"]}, tensors)
        return P.AdaKVPress(inner, alpha_safeguard=settings["alpha_safeguard"])
    if name == "PerLayerCompressionPress":
        inner = build_press({"press": settings["inner"]}, tensors)
        inner.compression_ratio = 0.0
        return P.PerLayerCompressionPress(inner, compression_ratios=list(settings["ratios"]))
    skip = {"press", "inner", "attentions", "alpha_safeguard", "ratios", "family", "case", "attn_implementation"}
    kw = {k: v for k, v in settings.items() if k not in skip}
    if name == "QFilterPress":
        kw["q_filters"] = tensors["q_filters"]
    return getattr(P, name)(compression_ratio=ratio, **kw)


def compare(dump: Path, lms: dict | None = None, build=build_press, only: str | None = None) -> list[Row]:
    """One row per case of ``dump`` (``only``: the cases of that name); ``lms``: family -> a loaded model of
    dump/models/<family> (else loaded); ``build(settings, tensors)``: the press a case runs."""
    import torch
    from safetensors.torch import load_file

    from gpt_inspector import load_model
    from gpt_inspector.core.kvlab import KVLab, from_press

    index = json.loads((dump / "cases.json").read_text())
    lms = dict(lms or {})
    rows = []
    for case in index["cases"]:
        if only is not None and case["case"] != only:
            continue
        family = case["family"]
        if family not in lms:
            lms[family] = load_model(str(dump / "models" / family), device="cpu")
        lm = lms[family]
        got = load_file(str(dump / f"{family}--{case['case']}.safetensors"))
        c = int(got["context"][0])
        prompt = [int(t) for t in got["prompt"]]
        policy = from_press(build(case, got), context=c, attentions=bool(case.get("attentions")))
        lab = KVLab(lm, prompt_ids=prompt, policy=policy, free_running=True)
        steps = got["logits"].shape[0]
        for _ in range(max(steps, 1)):
            lab.step()
        t = lab.run.cache_length
        same = total = 0
        for layer in range(lm.n_layers):
            mine = ~policy.evicted(layer, t)[:, :c]  # (Hkv, C)
            theirs = got["kept"][layer].bool()
            same += int((mine == theirs).all(1).sum())
            total += mine.shape[0]
        diff = float("nan")  # kvpress gave no logits (see EXPLAINED)
        if steps:
            logits = torch.stack([s.logits.float() for s in lab.run.steps_done[:steps]])  # (steps, V)
            diff = float((logits - got["logits"]).abs().max())
        tokens = [s.token_id for s in lab.run.steps_done[:steps]] == got["tokens"].tolist()
        rows.append(Row(family, case["case"], same, total, diff, tokens))
    return rows


def main(dump: Path) -> None:
    index = json.loads((dump / "cases.json").read_text())
    print(f"kvpress {index['kvpress']} on transformers {index['transformers']}, compression ratio {index['ratio']}:")
    print("| press | model | kept sets identical (layer × KV head) | max logit difference | |")
    print("|---|---|---|---|---|")
    for row in compare(dump):
        print(row.markdown())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/kvpress_table.py DUMP_DIR")
    main(Path(sys.argv[1]))
