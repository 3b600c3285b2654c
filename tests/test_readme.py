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
