"""Help and argument errors are instant: the engine (torch, transformers) loads only when a command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpt_inspector.cli import main

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


@pytest.mark.parametrize("before", [True, False], ids=["before the command", "after it"])
def test_model_options_count_on_either_side_of_the_command(tmp_path, capsys, before):
    # before this, `gpt-inspector --model M trace ...` ran the demo model and said nothing
    model = ["--model", str(tmp_path / "no-such-model")]
    run = ["--prompt", "x", "--steps", "1", "--out", str(tmp_path / "o.safetensors")]
    argv = [*model, "trace", *run] if before else ["trace", *model, *run]
    assert main(argv) == 2
    assert "no-such-model" in capsys.readouterr().err and not (tmp_path / "o.safetensors").exists()


def test_a_model_option_after_the_command_wins(tmp_path, capsys):
    argv = ["--model", "gpt2-somewhere-else", "trace", "--model", str(tmp_path / "the-one"), "--prompt", "x",
            "--steps", "1", "--out", str(tmp_path / "o.safetensors")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the-one" in err and "somewhere-else" not in err


def test_without_model_options_the_commands_still_see_their_defaults():
    from gpt_inspector.cli import build_parser

    args = build_parser().parse_args(["trace", "--prompt", "x", "--steps", "1", "--out", "o.safetensors"])
    assert (args.model, args.device, args.dtype, args.allow_pickle, args.unverified) == (
        None,
        "auto",
        None,
        False,
        False,
    )
