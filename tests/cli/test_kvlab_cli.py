"""`gpt-inspector kv-lab`: one run and the sweep agree with the API; figures and tables are written;
bad input is one line with exit 2; Ctrl+C exits 130 and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpt_inspector.cli import main

PROMPT = "She eats an apple. He reads a book."


def test_one_run_json_matches_the_api(tiny_dir, capsys):
    import gpt_inspector as gi
    from gpt_inspector.core.kvlab import KVLab, make

    argv = ["kv-lab", "--model", str(tiny_dir["llama"]), "--device", "cpu", "--prompt", PROMPT, "--policy", "h2o",
            "--budget", "6", "--steps", "5", "--probe"]  # fmt: skip
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    lab = KVLab(gi.load_model(tiny_dir["llama"], device="cpu"), PROMPT, make("h2o", 6))
    steps = lab.run_steps(5)
    assert [s["kl"] for s in d["steps_detail"]] == pytest.approx([s.kl for s in steps], rel=1e-12, abs=0)
    assert [s["agree"] for s in d["steps_detail"]] == [s.agree for s in steps]
    assert [s["step"] for s in d["steps_detail"]] == [1, 2, 3, 4, 5]  # counted from 1, as the window counts
    first = lab.first_divergence
    assert d["first_divergence"] == (None if first is None else first + 1) and d["bytes_policy"] == sum(
        steps[-1].bytes_policy
    )
    assert d["privacy"]["prompt_tokens"] == lab.run.prompt_length and d["privacy"] == lab.probe().to_json()
    assert d["evicted_rows"] == [
        [list(map(int, r.nonzero()[0])) for r in lab.evicted(i)] for i in range(lab.lm.n_layers)
    ]
    held = lab.run.cache_length - np.array([len(r) for r in d["evicted_rows"][1]])
    assert (held <= 6).all()
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.count("step ") >= 5 and "mean KL" in text and "cache probe (layer 0)" in text


@pytest.mark.parametrize("suffix,magic", [(".svg", b"<?xml"), (".png", b"\x89PNG")])
def test_one_run_draws_its_kl_per_step(tiny_dir, tmp_path, capsys, suffix, magic):
    out = tmp_path / f"lab{suffix}"
    argv = ["kv-lab", "--model", str(tiny_dir["gpt2"]), "--prompt", PROMPT, "--policy", "h2o", "--budget", "6",
            "--steps", "5", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert out.read_bytes().startswith(magic) and f"figure saved to {out}" in capsys.readouterr().err
    if suffix == ".svg":  # text kept as text: the axis, the policy and the run's length are readable
        text = out.read_text(encoding="utf-8")
        assert "KL, nats" in text and "h2o budget 6" in text and "5 steps, teacher-forced" in text


def test_a_quoted_tilde_is_the_home_folder_in_every_file_argument(tiny_dir, tmp_path, monkeypatch, capsys):
    # a shell leaves "~/x" alone when it is quoted; export expanded it, kv-lab, lens and trace did not
    monkeypatch.setenv("HOME", str(tmp_path))
    model = ["--model", str(tiny_dir["gpt2"]), "--prompt", PROMPT]
    assert main(["kv-lab", *model, "--policy", "h2o", "--budget", "6", "--steps", "2", "--out", "~/lab.png",
                 "--json", "~/lab.json"]) == 0  # fmt: skip
    assert main(["lens", *model, "--steps", "1", "--out", "~/lens.svg"]) == 0
    assert main(["trace", *model, "--steps", "1", "--out", "~/t.safetensors"]) == 0
    assert (
        main(
            ["export", "--trace", str(tmp_path / "t.safetensors"), "--layer", "0", "--head", "0", "--out", "~/head.png"]
        )
        == 0
    )
    assert {p.name for p in tmp_path.iterdir()} >= {"lab.png", "lab.json", "lens.svg", "t.safetensors", "head.png"}


def test_per_layer_and_per_head_budgets_from_the_cli(tiny_dir, capsys):
    argv = ["kv-lab", "--model", str(tiny_dir["llama"]), "--prompt", PROMPT, "--policy", "tova", "--budget", "8",
            "--layer-budget", "0=3,6", "--steps", "3", "--json"]  # fmt: skip
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    t = d["steps_detail"][-1]["position"] + 1
    assert [t - len(r) for r in d["evicted_rows"][0]] == [3, 6] and [t - len(r) for r in d["evicted_rows"][1]] == [8, 8]


def test_quantization_json_has_each_rows_error(tiny_dir, tmp_path, capsys):
    out = tmp_path / "q.json"
    argv = ["kv-lab", "--model", str(tiny_dir["gpt2"]), "--prompt", PROMPT, "--policy", "int2", "--group", "4",
            "--residual", "2", "--steps", "3", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    d = json.loads(out.read_text(encoding="utf-8"))
    k = np.array(d["row_error"][0]["keys"])  # (Hkv, T)
    assert k.shape[1] == d["steps_detail"][-1]["position"] + 1
    assert (k[:, -2:] == 0).all() and (k[:, :4] > 0).all()


def test_free_running_says_where_the_texts_part(tiny_dir, capsys):
    argv = ["kv-lab", "--model", str(tiny_dir["gpt2"]), "--prompt", PROMPT, "--policy", "streaming", "--budget", "4",
            "--sinks", "1", "--steps", "8", "--free-running"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "texts part at step" in out and "reference:" in out and "policy:" in out


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_sweep_draws_the_frontier_and_writes_the_table(tiny_dir, tmp_path, capsys, suffix, magic):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n\nOne two three four five six\n", encoding="utf-8")
    out, table = tmp_path / f"front{suffix}", tmp_path / "table.json"
    argv = ["kv-lab", "--model", str(tiny_dir["gpt2"]), "--sweep", "--prompts", str(prompts), "--policies",
            "streaming,h2o,int4", "--budgets", "4,10", "--residual", "3", "--steps", "3", "--out", str(out),
            "--json", str(table)] + ([] if suffix == ".png" else ["--no-probe"])  # fmt: skip
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "5/10" in cap.err and "10/10" in cap.err  # progress on stderr
    assert out.read_bytes().startswith(magic)
    d = json.loads(table.read_text(encoding="utf-8"))
    assert d["format"] == "gpt-inspector-kvlab-sweep/1" and len(d["rows"]) == 2 * 5 and len(d["points"]) == 5
    assert {(p["policy"], p["budget"]) for p in d["points"]} == {("streaming", 4), ("streaming", 10), ("h2o", 4),
                                                                 ("h2o", 10), ("int4", None)}  # fmt: skip
    small = next(p for p in d["points"] if p["policy"] == "h2o" and p["budget"] == 4)
    big = next(p for p in d["points"] if p["policy"] == "h2o" and p["budget"] == 10)
    assert small["bytes_ratio"] < big["bytes_ratio"] < 1
    if suffix == ".png":
        assert all(p["recovered_fraction"] is not None for p in d["points"])
    if suffix == ".svg":
        text = out.read_text(encoding="utf-8")
        assert "policy cache / full cache (bytes)" in text and "mean KL" in text
    # a row equals the API's lab on the same prompt
    import gpt_inspector as gi
    from gpt_inspector.core.kvlab import KVLab, make

    lm = gi.load_model(tiny_dir["gpt2"])  # where the CLI put it (its default device), for the same rounding
    # the sweep shares one reference per prompt (its runs step alone, not as a batch of two): so does this lab
    lab = KVLab(lm, PROMPT, make("h2o", 4), reference=gi.Session(lm, PROMPT))
    lab.run_steps(3)
    row = next(r for r in d["rows"] if r["policy"] == "h2o" and r["budget"] == 4 and r["prompt"] == 0)
    assert row["mean_kl"] == pytest.approx(lab.summary()["mean_kl"], rel=1e-12)


def test_sweep_ctrl_c_exits_130_and_writes_nothing(tiny_dir, tmp_path, capsys, monkeypatch):
    from gpt_inspector.core.kvlab import lab as lab_module

    calls = []
    real = lab_module.KVLab.run_steps

    def interrupted(self, n):
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, n)

    monkeypatch.setattr(lab_module.KVLab, "run_steps", interrupted)
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n", encoding="utf-8")
    out, table = tmp_path / "f.png", tmp_path / "t.json"
    argv = ["kv-lab", "--model", str(tiny_dir["gpt2"]), "--sweep", "--prompts", str(prompts), "--policies", "h2o",
            "--budgets", "4,8,12", "--steps", "2", "--out", str(out), "--json", str(table), "--no-probe"]  # fmt: skip
    assert main(argv) == 130
    assert not out.exists() and not table.exists() and list(tmp_path.iterdir()) == [prompts]
    assert "interrupted" in capsys.readouterr().err


def test_sweep_with_jobs_writes_the_same_table_as_one_process(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n", encoding="utf-8")
    tables = {}
    for jobs in ("1", "2"):
        tables[jobs] = tmp_path / f"t{jobs}.json"
        argv = ["kv-lab", "--model", str(tiny_dir["gpt2"]), "--sweep", "--prompts", str(prompts), "--policies",
                "h2o,int4", "--budgets", "4,8", "--residual", "2", "--steps", "3", "--json", str(tables[jobs]),
                "--jobs", jobs]  # fmt: skip
        assert main(argv) == 0
        assert "3/3" in capsys.readouterr().err  # the progress bar, as with one process
    one, two = (json.loads(tables[j].read_text(encoding="utf-8")) for j in ("1", "2"))
    for r in one["rows"] + two["rows"]:
        r.pop("seconds")
    assert two == one


def test_sweep_with_jobs_ctrl_c_terminates_the_workers_and_writes_nothing(tiny_dir, tmp_path, capsys, monkeypatch):
    import multiprocessing.pool

    real = multiprocessing.pool.IMapIterator.next
    got = []

    def interrupted(self, timeout=None):
        got.append(real(self, timeout))
        if len(got) == 1:
            raise KeyboardInterrupt  # Ctrl+C in the parent while the workers are busy
        return got[-1]

    monkeypatch.setattr(multiprocessing.pool.IMapIterator, "next", interrupted)
    terminated = []
    real_terminate = multiprocessing.pool.Pool.terminate
    monkeypatch.setattr(
        multiprocessing.pool.Pool, "terminate", lambda self: terminated.append(1) or real_terminate(self)
    )
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n", encoding="utf-8")
    out, table = tmp_path / "f.png", tmp_path / "t.json"
    argv = ["kv-lab", "--model", str(tiny_dir["gpt2"]), "--sweep", "--prompts", str(prompts), "--policies", "h2o",
            "--budgets", "4,8,12", "--steps", "2", "--out", str(out), "--json", str(table), "--no-probe",
            "--jobs", "2"]  # fmt: skip
    assert main(argv) == 130
    assert got and not out.exists() and not table.exists() and list(tmp_path.iterdir()) == [prompts]
    assert "interrupted" in capsys.readouterr().err
    assert terminated and not multiprocessing.active_children()  # killed, not left to finish their labs


BAD = [
    ["--prompt", "x", "--policy", "h2o", "--steps", "0"],
    ["--prompt", "x", "--policy", "lru"],
    ["--prompt", "x", "--policy", "h2o", "--budget", "0"],
    ["--prompt", "x", "--policy", "h2o", "--budget", "-2"],
    ["--prompt", "x", "--policy", "h2o", "--budget", "100000"],
    ["--prompt", "x", "--policy", "int4", "--budget", "8"],
    ["--prompt", "x", "--policy", "int4", "--group", "3"],
    ["--prompt", "x", "--policy", "h2o", "--budget", "two"],
    ["--prompt", "x", "--policy", "int8", "--scheme", "transformers"],
    ["--prompt", "x", "--policy", "h2o", "--budget", "8", "--layer-budget", "1:4"],
    ["--prompt", "x", "--policy", "h2o", "--budget", "8", "--layer-budget", "9=4"],
    ["--prompt", "x", "--policy", "h2o", "--budget", "8", "--layer-budget", "1=4,4,4,4,4"],
    ["--prompt", "x", "--policy", "int4", "--scheme", "gptq"],
    ["--prompt", "x", "--policy", "streaming", "--budget", "3", "--sinks", "3"],
    ["--policy", "h2o"],
    ["--prompt", "x", "--policy", "h2o", "--out", "fig.txt"],
    ["--prompt", "x", "--policy", "h2o", "--json", "/no/such/folder/t.json"],
    ["--sweep", "--policies", "h2o", "--budgets", "4"],
    ["--sweep", "--prompts", "/no/such/file.txt", "--policies", "h2o", "--budgets", "4"],
    ["--sweep", "--prompts", "PROMPTS", "--policies", "h2o", "--budgets", "4,x"],
    ["--sweep", "--prompts", "PROMPTS", "--policies", "h2o,nope", "--budgets", "4"],
    ["--sweep", "--prompts", "PROMPTS", "--policies", "h2o"],
    ["--sweep", "--prompts", "EMPTY", "--policies", "h2o", "--budgets", "4"],
    ["--sweep", "--prompts", "PROMPTS", "--policies", "h2o", "--budgets", "0"],
    ["--sweep", "--prompts", "PROMPTS", "--policies", "h2o", "--budgets", "4", "--jobs", "0"],
    ["--sweep", "--prompts", "PROMPTS", "--policies", "h2o", "--budgets", "4", "--jobs", "-2"],
    [
        "--sweep",
        "--prompts",
        "PROMPTS",
        "--policies",
        "h2o",
        "--budgets",
        "4",
        "--jobs",
        str((os.cpu_count() or 1) + 1),
    ],
]


@pytest.mark.parametrize("extra", BAD)
def test_bad_input_is_one_line_exit_2(tiny_dir, tmp_path, capsys, extra):
    (tmp_path / "p.txt").write_text("hello there\n", encoding="utf-8")
    (tmp_path / "e.txt").write_text("\n \n", encoding="utf-8")
    extra = [str(tmp_path / "p.txt") if a == "PROMPTS" else str(tmp_path / "e.txt") if a == "EMPTY" else a
             for a in extra]  # fmt: skip
    try:
        code = main(["kv-lab", "--model", str(tiny_dir["gpt2"]), *extra])
    except SystemExit as e:  # argparse's own refusals (a non-integer) exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_help_imports_no_engine_and_names_every_policy():
    code = ("import sys\nfrom gpt_inspector.cli import main\ntry:\n    main(['kv-lab', '--help'])\n"
            "except SystemExit as e:\n    print(e.code, [m for m in ('torch', 'transformers') if m in sys.modules])")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.stdout.strip().splitlines()[-1] == "0 []", r.stderr
    from gpt_inspector.commands.kv_lab import POLICIES
    from gpt_inspector.core.kvlab import NAMES

    assert POLICIES == NAMES
