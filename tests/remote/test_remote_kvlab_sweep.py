"""``kv-lab --sweep --connect``: the engine runs the sweep's labs one after the other, each a lab of
its own (its reference stepped beside its policy run as a batch of two, as one ``kv-lab --connect``
runs it). Its table is, row for row, those labs run here; the local sweep shares one reference per
prompt (stepped alone), so its KL differs from these by float rounding only, and everything else
(bytes, agreement, divergence, probe) is equal. What runs only where the model is (the needle
check, worker processes) is refused in one line."""

from __future__ import annotations

import json

import pytest
from on_device import DEVICE

PROMPTS = "She eats an apple. He reads\nThe cat sat on the mat and"


def _rows(text: str) -> list[dict]:
    d = json.loads(text)
    for row in d["rows"]:
        row.pop("seconds")  # the only number not computed
    return d["rows"]


def test_a_sweep_over_the_link_is_its_labs_run_here(server, tiny_llama, local_lm, tmp_path, capsys):
    from gpt_inspector.cli import main
    from gpt_inspector.core.kvlab import KVLab
    from gpt_inspector.core.kvlab.sweep import build_policy

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS, encoding="utf-8")
    argv = ["kv-lab", "--sweep", "--prompts", str(prompts), "--policies", "h2o,int8", "--budgets", "3,6",
            "--steps", "3", "--json"]  # fmt: skip
    outs = []
    for where in (["--connect", server.url], ["--model", str(tiny_llama), "--device", DEVICE]):
        assert main([*argv, *where]) == 0
        outs.append(_rows(capsys.readouterr().out))
    remote, local = outs
    # 2 prompts x (h2o at 2 budgets + int8): every row with its probe, as the local sweep ran them
    assert len(remote) == 6 and {r["probe_recovered"] is not None for r in remote} == {True}
    assert {(r["policy"], r["budget"]) for r in remote} == {("h2o", 3), ("h2o", 6), ("int8", None)}
    for r, loc in zip(remote, local):
        lab = KVLab(local_lm, PROMPTS.splitlines()[r["prompt"]], build_policy(r["policy"], r["budget"]))
        lab.run_steps(3)
        sm, pr = lab.summary(), lab.probe()
        want = {k: sm[k] for k in ("steps", "mean_kl", "max_kl", "agreement", "first_divergence", "bytes_policy",
                                    "bytes_full", "bytes_paged", "bytes_full_paged")}  # fmt: skip
        want.update(prompt_tokens=lab.run.prompt_length, probe_held=pr.held, probe_recovered=pr.recovered)
        assert {k: r[k] for k in want} == want  # bit for bit
        floats = ("mean_kl", "max_kl")
        assert {k: v for k, v in r.items() if k not in floats} == {k: v for k, v in loc.items() if k not in floats}
        for k in floats:  # the local sweep's shared reference steps alone: float rounding apart
            assert r[k] == pytest.approx(loc[k], rel=1e-5, abs=1e-9)


@pytest.mark.parametrize(
    "extra, words",
    [(["--needle"], "--needle runs where the model is"), (["--jobs", "2"], "--jobs: the engine runs one lab")],
)
def test_what_runs_only_where_the_model_is_is_refused(server, tmp_path, capsys, extra, words):
    from gpt_inspector.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS, encoding="utf-8")
    argv = ["kv-lab", "--connect", server.url, "--sweep", "--prompts", str(prompts), "--policies", "int8", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err
