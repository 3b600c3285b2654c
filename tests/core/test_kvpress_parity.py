"""The lab's copies of kvpress's presses against NVIDIA kvpress 0.5.5 itself.

kvpress cannot enter this environment (it pins transformers < 5.3 and wraps the attention functions
on import): ``scripts/kvpress-env.sh`` runs it in a throw-away venv of its own, which writes its kept
entries and logits on tiny checkpoints to a folder, and then runs this test with
GPT_INSPECTOR_KVPRESS_DUMP naming that folder (CI's second step). Without the variable it is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DUMP = os.environ.get("GPT_INSPECTOR_KVPRESS_DUMP")
pytestmark = pytest.mark.skipif(not DUMP, reason="kvpress comparison: run scripts/kvpress-env.sh")


def _table():
    spec = importlib.util.spec_from_file_location("kvpress_table", ROOT / "scripts" / "kvpress_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvpress_table"] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_press_keeps_what_kvpress_keeps_and_gives_its_logits():
    dump = Path(str(DUMP))
    assert (dump / "cases.json").is_file(), f"GPT_INSPECTOR_KVPRESS_DUMP={dump} holds no cases.json"
    table = _table()
    rows = table.compare(dump)
    assert len(rows) == len(json.loads((dump / "cases.json").read_text())["cases"]) >= 20
    bad = [r.markdown() for r in rows if not r.exact and r.case not in table.EXPLAINED]
    assert not bad, "not kvpress's result:\n" + "\n".join(bad)


def test_the_comparison_sees_a_rule_that_differs():
    """SnapKV pooled over 3 neighbours instead of kvpress's 5: the comparison must notice."""
    table = _table()

    def wrong(settings, tensors):
        press = table.build_press(settings, tensors)
        press.kernel_size = 3
        return press

    rows = _table().compare(Path(str(DUMP)), build=wrong, only="snapkv")
    assert rows and any(not r.exact for r in rows)


def test_readme_table_is_the_comparison():
    """The README's rows are this comparison's output (regenerate: scripts/kvpress-env.sh)."""
    readme = (ROOT / "README.md").read_text()
    for row in _table().compare(Path(str(DUMP))):
        cells = f"| {row.case} | {row.family} | {row.sets_same}/{row.sets} |"
        assert cells in readme, f"README: kvpress table row for {row.case} on {row.family} is stale or missing"
