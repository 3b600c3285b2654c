"""The package says MIT in pyproject.toml; the repository carries the licence text that says so."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_mit_licence_is_in_the_repository():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert re.search(r"^Copyright \(c\) \d{4} gpt-inspector developers$", text, re.M)
    assert "Permission is hereby granted, free of charge" in text and 'THE SOFTWARE IS PROVIDED "AS IS"' in text
    # tomllib is 3.11+ and the package supports 3.10: read the one line
    assert re.search(r'^license = \{text = "MIT"\}$', (ROOT / "pyproject.toml").read_text(), re.M)
