"""The comma-separated number lists of the CLI: one parser for integers and numbers, one line on bad input."""

from __future__ import annotations

import pytest

from gpt_inspector.cli import main
from gpt_inspector.commands.common import number_list
from gpt_inspector.core.errors import InspectorError


def test_blanks_are_skipped_and_each_part_converted():
    assert number_list(" 3, ,4,", "--layers", int) == [3, 4]
    got = number_list("0.5, 2", "--temperatures", float)
    assert got == [0.5, 2.0] and all(type(t) is float for t in got)


@pytest.mark.parametrize(
    ("text", "convert", "hint", "message"),
    [
        ("1,1.5", int, "", "--x takes comma-separated integers, got '1,1.5'"),
        ("1,x", float, "", "--x takes comma-separated numbers, got '1,x'"),
        (" , ", int, "; give e.g. 0", "--x is empty; give e.g. 0"),
        ("", float, "", "--x is empty"),
    ],
)
def test_bad_lists_say_what_they_take(text, convert, hint, message):
    with pytest.raises(InspectorError) as e:
        number_list(text, "--x", convert, hint)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["compare", "--max-new-tokens", "2", "--samples", "2", "--temperatures", "1,x"],
            "--temperatures takes comma-separated numbers, got '1,x'",
        ),
        (["compare", "--max-new-tokens", "2", "--samples", "2", "--temperatures", ","], "--temperatures is empty"),
        (
            ["compare", "--max-new-tokens", "2", "--samples", "2", "--temperatures", "0.5,0"],
            "every temperature must be a finite number > 0",
        ),
        (["probe-cache", "--layers", "a,b"], "--layers takes comma-separated integers, got 'a,b'"),
        (["probe-cache", "--layers", ","], "--layers is empty; give e.g. 0 or 0,1"),
    ],
)
def test_each_list_option_exits_2_with_its_one_line(tiny_dir, capsys, argv, message):
    rc = main([*argv, "--model", str(tiny_dir["gpt2"]), "--device", "cpu", "--prompt", "One two"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_the_sweep_budgets_exit_2_with_their_one_line(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("One two\n", encoding="utf-8")
    rc = main(["kv-lab", "--model", str(tiny_dir["gpt2"]), "--device", "cpu", "--sweep", "--prompts", str(prompts),
               "--policies", "h2o", "--budgets", "4,x"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--budgets takes comma-separated integers, got '4,x'" in err, err
