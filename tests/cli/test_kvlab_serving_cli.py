"""`kv-lab --schedule/--page/--share`: the JSON records the settings and the paged bytes the API gives;
a bad value is one line with exit 2."""

from __future__ import annotations

import json

import pytest

from gpt_inspector.cli import main

PROMPT = "She eats an apple. He reads a book."


def test_serving_options_reach_the_policy_and_the_json(tiny_dir, capsys):
    import gpt_inspector as gi
    from gpt_inspector.core.kvlab import KVLab, make

    argv = ["kv-lab", "--model", str(tiny_dir["llama"]), "--device", "cpu", "--prompt", PROMPT, "--policy", "tova",
            "--budget", "8", "--steps", "6", "--schedule", "2", "--page", "2", "--share", "layer", "--json"]  # fmt: skip
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["settings"] == {"schedule": 2, "page": 2, "share": "layer"} and d["page"] == 2
    lab = KVLab(
        gi.load_model(tiny_dir["llama"], device="cpu"), PROMPT, make("tova", 8, schedule=2, page=2, share="layer")
    )
    steps = lab.run_steps(6)
    assert [s["kl"] for s in d["steps_detail"]] == pytest.approx([s.kl for s in steps], rel=1e-12, abs=0)
    assert [s["bytes_paged"] for s in d["steps_detail"]] == [sum(s.bytes_paged) for s in steps]
    assert d["bytes_paged"] == sum(steps[-1].bytes_paged) and d["bytes_full_paged"] == sum(steps[-1].bytes_full_paged)
    assert "every 2 steps, pages of 2, shared across a layer's heads" in d["policy"]
    assert main(argv[:-1]) == 0  # the text summary says the paged bytes
    assert f"in pages of 2: {sum(steps[-1].bytes_paged):,}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra",
    [["--schedule", "sometimes"], ["--schedule", "0"], ["--page", "0"], ["--share", "model"], ["--page", "8"]],
)
def test_bad_serving_options_are_one_line_exit_2(tiny_dir, capsys, extra):
    try:
        code = main(["kv-lab", "--model", str(tiny_dir["gpt2"]), "--device", "cpu", "--prompt", PROMPT,
                     "--policy", "tova", "--budget", "8", *extra])  # fmt: skip
    except SystemExit as e:  # argparse's own refusals (a choice) exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
