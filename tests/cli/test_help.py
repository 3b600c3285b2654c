"""Help and argument errors are instant: the engine (torch, transformers) loads only when a command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys
from gpt_inspector.cli import main
try:
    main({argv!r})
except SystemExit as e:
    code = e.code
heavy = [m for m in ("torch", "transformers", "PySide6") if m in sys.modules]
print(code, heavy)
"""


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["trace", "--help"], 0), (["export", "--help"], 0),
                                        (["trace", "--steps", "two"], 2), (["nonsense"], 2)])  # fmt: skip
def test_help_and_argument_errors_import_no_engine(argv, code):
    r = subprocess.run([sys.executable, "-c", CODE.format(argv=argv)], capture_output=True, text=True)
    assert r.stdout.strip().splitlines()[-1] == f"{code} []", (r.stdout, r.stderr)


def test_top_level_help_says_no_command_opens_the_window(capsys):
    from gpt_inspector.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "opens the window" in " ".join(capsys.readouterr().out.split())
