"""The README's fresh-machine commands stay true: CI runs exactly the README's test command."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    return re.findall(r"```\n(python3 -m venv .+?)\n```", (ROOT / "README.md").read_text())


def test_readme_opens_with_run_and_test_commands():
    run, test = _commands()[:2]
    assert run.endswith("gpt-inspector") and "pytest" in test


def test_ci_runs_the_readme_test_command():
    test = _commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci


def test_readme_screenshots_exist():
    readme = (ROOT / "README.md").read_text()
    for name in ("screenshot-1366x768.png", "screenshot-1920x1080.png", "tour-softmax-1366x768.png",
                 "tour-cache-1366x768.png", "help-page-1366x768.png"):  # fmt: skip
        assert f"docs/{name}" in readme
        assert (ROOT / "docs" / name).read_bytes()[:4] == b"\x89PNG"


def test_readme_model_families_are_the_lists_the_tests_and_the_loader_use():
    """The verified list and the refused table are scripts/family_table.py's output, never kept by hand."""
    spec = importlib.util.spec_from_file_location("family_table", ROOT / "scripts" / "family_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    readme = (ROOT / "README.md").read_text()
    assert table.verified_line() in readme, "README: paste the output of python scripts/family_table.py"
    missing = [row for row in table.refused_table() if row not in readme]
    assert not missing, f"README: paste the output of python scripts/family_table.py; rows missing: {missing}"


# core/kvlab/policies.py is being split into policy.py + scorers.py on a branch of its own; the
# README already names the new modules, and until they land the old one stands in for them
SPLITTING = {
    "gpt_inspector/core/kvlab/policies.py": (
        "gpt_inspector/core/kvlab/policy.py",
        "gpt_inspector/core/kvlab/scorers.py",
    )
}


def _layout_modules() -> set[str]:
    """Paths of the .py lines in the Layout section's tree (two spaces of indent per folder level)."""
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    block = section.split("```\n", 2)[1]
    folders: list[str] = []
    out = set()
    for line in block.splitlines():
        if not line.strip() or line.startswith(" " * 26):
            continue  # a blank or a description's continuation
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip(" "))) // 2
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        elif name.endswith(".py"):
            out.add("/".join([*folders, name]))
    return out


def test_readme_layout_names_every_module_and_no_other():
    listed = _layout_modules()
    assert "gpt_inspector/core/attention.py" in listed and "gpt_inspector/gui/views/probe.py" in listed
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "gpt_inspector").rglob("*.py")}
    for old, new in SPLITTING.items():
        if old in on_disk and not any((ROOT / n).exists() for n in new):
            on_disk = (on_disk - {old}) | set(new)
    assert not on_disk - listed, f"README Layout: add {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"README Layout: remove {sorted(listed - on_disk)}"


def test_readme_layout_answers_where_things_are():
    """Each newcomer question is answered in one hop: its line names a module the Layout lists."""
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    listed = {m.removeprefix("gpt_inspector/") for m in _layout_modules()}
    questions = (
        "softmax row computed",
        "eviction decided",
        "family adapter registered",
        "CLI sub-command defined",
        "mask edit recomputed",
    )
    for question in questions:
        line = next((ln for ln in section.splitlines() if question in ln), None)
        assert line is not None, question
        path = line.split("`")[1].replace("<name>", "trace")  # the answer's first file
        assert path in listed, line


def test_readme_states_each_kv_policys_rule_as_the_window_does():
    """One source: the KV lab's rules (``kvlab.registry.RULES``, the window's policy picker) in the README."""
    from gpt_inspector.core.kvlab import registry

    text = " ".join((ROOT / "README.md").read_text().split())
    for name, rule in [*registry.RULES.items(), ("int4", registry.QUANT_RULE)]:
        assert " ".join(rule.split()) in text, f"README: the {name} rule is not registry.RULES[{name!r}]"
