"""The README's fresh-machine commands stay true: CI runs exactly the README's test command."""

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
    for name in ("screenshot-1366x768.png", "screenshot-1920x1080.png"):
        assert f"docs/{name}" in readme
        assert (ROOT / "docs" / name).read_bytes()[:4] == b"\x89PNG"
