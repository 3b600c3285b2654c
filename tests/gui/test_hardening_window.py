"""The window never loses the session: autosave on every change, restore at start, faults survived."""

from __future__ import annotations

from PySide6.QtWidgets import QMessageBox

from gpt_inspector.gui import autosave
from gpt_inspector.gui.controller import ForceToken, Load, NewSession, OpenTrace, SaveTrace, SetDecoding, SetMaskEdits


def _capture_dialogs(monkeypatch):
    shown = []
    for name in ("warning", "critical", "information"):
        monkeypatch.setattr(QMessageBox, name, lambda parent, title, text, *a, **k: shown.append((title, text)))
    return shown


def test_every_change_is_autosaved_and_restores_the_same_tokens(make_window, wait_idle, qtbot, tiny_dir):
    from gpt_inspector.gui.main_window import MainWindow

    win = make_window("llama", temperature=1.0, seed=3)
    assert autosave.read() is None  # nothing stepped yet: nothing worth restoring
    win.step()
    win.step()
    wait_idle(win)
    first = autosave.read()
    assert [op["op"] for op in first["ops"]] == ["step", "step"]
    win.run(3)
    win.post(SetDecoding(0.4, None, None, redecide=True))
    snap = wait_idle(win)
    saved = autosave.read()
    assert [op["op"] for op in saved["ops"]] == ["step"] * 5 + ["decoding"]
    assert saved["model"] == str(tiny_dir["llama"]) and saved["load"]["device"] == "cpu"
    # a new window (as after a crash) replays it to the same place
    other = MainWindow(restore_layout=False)
    qtbot.addWidget(other)
    other.restore(saved)
    restored = wait_idle(other, timeout=60000)
    try:
        assert restored.labels == snap.labels and restored.n_steps == snap.n_steps == 5
        assert other.session_panel.prompt.toPlainText() == saved["prompt"]
        assert abs(other.session_panel.temperature.value() - 0.4) < 1e-9
    finally:
        other.worker.stop()


def test_start_offers_restore_and_no_discards_it(make_window, wait_idle, monkeypatch):
    from gpt_inspector.gui.app import _offer_restore

    crashed = make_window()
    crashed.step()
    wait_idle(crashed)
    assert autosave.read() is not None
    crashed.worker.stop()  # a crash: the file stays, its owner is gone
    win = make_window()
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.No)
    assert _offer_restore(win) is None
    assert not autosave.path(crashed.worker.autosave_owner).exists()
    assert autosave.path(win.worker.autosave_owner).exists()  # the live window keeps its own file


def test_a_corrupt_autosave_is_ignored(make_window, monkeypatch):
    make_window()
    autosave.path().write_text("{not json")
    assert autosave.read_with_owner() is None
    autosave.path().write_text('{"format": "gpt-inspector-recipe/1", "ops": [{"op": "explode"}], "model": "x"}')
    rejected: list = []
    assert autosave.read_with_owner(rejected) is None  # refused before any question, not halfway through a replay
    assert len(rejected) == 1 and "cannot be restored" in rejected[0]
    assert not autosave.path().exists()  # moved aside: the next start is clean
    assert len(list(autosave.path().parent.glob("autosave.json.rejected-*"))) == 2  # both kept for the user


def test_an_exception_inside_a_step_shows_a_dialog_and_keeps_the_last_good_step(
    make_window, wait_idle, monkeypatch, tiny_lm
):
    shown = _capture_dialogs(monkeypatch)
    win = make_window("gpt2")
    win.run(3)
    before = wait_idle(win)
    mlp = tiny_lm("gpt2").model.transformer.h[1].mlp
    orig = mlp.forward

    def boom(*a, **k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(mlp, "forward", boom)
    win.step()
    after = wait_idle(win)
    assert len(shown) == 1 and shown[0][0] == "The model failed"
    assert "out of memory" in shown[0][1] and "--device cpu" in shown[0][1]
    assert after.labels == before.labels and after.n_steps == before.n_steps == 3
    monkeypatch.setattr(mlp, "forward", orig)
    win.step()
    assert wait_idle(win).n_steps == 4  # the session goes on from its last good step
    assert autosave.read()["ops"] == [{"op": "step"}] * 4


def test_restoring_an_unreadable_recipe_reports_and_keeps_the_window(make_window, wait_idle, monkeypatch, tiny_dir):
    shown = _capture_dialogs(monkeypatch)
    win = make_window()
    win.step()
    before = wait_idle(win)
    win.restore({"format": "gpt-inspector-recipe/1", "model": str(tiny_dir["gpt2"]), "ops": [{"op": "explode"}]})
    after = wait_idle(win)
    assert shown and "recipe" in shown[-1][1]
    assert after.labels == before.labels


def test_sliding_window_model_in_the_window(make_window, wait_idle, monkeypatch, tiny_lm):
    """Gemma 2: sliding-window layer 0 and soft-capped scores, shown without error and as the engine says."""
    import numpy as np

    import gpt_inspector as gi

    shown = _capture_dialogs(monkeypatch)
    win = make_window("gemma2")
    win.run(6)
    snap = wait_idle(win)
    assert not shown and snap.n_steps == 6
    ref = gi.Session(tiny_lm("gemma2"), win.session_panel.prompt.toPlainText())
    ref.run(6)
    assert snap.selection.layer == 0 and snap.allowed is not None
    np.testing.assert_array_equal(snap.allowed, ref.allowed(0, snap.selection.head))
    assert not snap.allowed[snap.T - 1, 0]  # the window hides the first key from the last query
    np.testing.assert_allclose(np.nan_to_num(snap.matrix), ref.attention(0, snap.selection.head, "probs"), atol=1e-6)


def test_kv_cache_exports_the_layers_keys(make_window, wait_idle, monkeypatch, tmp_path, tiny_lm):
    """KV cache → Export K: the image is the snapshot's K matrix with the token labels."""
    import numpy as np

    import gpt_inspector.gui.export_dialog as dlg

    win = make_window("llama")
    win.run(2)
    snap = wait_idle(win)
    seen = {}

    def fake_show(parent, fig, default_name, scale, what, preview=None):
        seen["fig"], seen["name"] = fig, default_name
        seen["values"] = fig.panel_values[0].copy()
        return dlg.figures.save(fig, tmp_path / "k.svg")

    monkeypatch.setattr(dlg, "_show", fake_show)
    win.kv_cache.export_requested.emit("k")
    fig = seen["fig"]
    assert seen["name"] == f"kv-L{snap.selection.layer}-k.png" and "K cache" in fig.heading
    # the image holds the layer's real cached keys: rows = processed tokens, columns = every KV head's dims
    lm = tiny_lm("llama")
    assert snap.kv_k.shape == (snap.T, lm.n_kv_heads * lm.head_dim)
    assert fig.pool == 1
    np.testing.assert_array_equal(seen["values"], snap.kv_k)
    assert fig.row_labels == list(snap.labels[: snap.T])
    assert (tmp_path / "k.svg").read_text().lstrip().startswith("<?xml")


def _bad_window_inputs(tmp_path, tiny_dir=None):
    import shutil

    from gpt_inspector.core import MaskEdit
    from gpt_inspector.gui.worker import ModelSpec, SessionSpec

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    hi = SessionSpec("hi", 0.0, None, None, 0)
    (tmp_path / "a-folder.safetensors").mkdir()
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_dir["gpt2"], damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated on the way
    return [
        (NewSession(SessionSpec("hi", 0.0, None, None, 2**64)), "seed"),
        (NewSession(SessionSpec("a\udc80b", 0.0, None, None, 0)), "lone surrogate"),
        (SetMaskEdits((MaskEdit(2.5, 1),)), "position"),
        (SaveTrace(str(tmp_path / "missing" / "t.safetensors")), "does not exist"),
        (SaveTrace(str(tmp_path / "a-folder.safetensors")), "folder"),
        (SaveTrace(str(tmp_path / "link.safetensors")), "symbolic link"),
        (Load(ModelSpec(str(damaged), "cpu"), hi), "damaged"),
        (ForceToken(10**9), "token id"),
        (SetDecoding(-1.0), "temperature"),
        (SetDecoding(float("nan")), "temperature"),
        (SetDecoding(1.0, top_k=0), "top_k"),
        (SetDecoding(1.0, top_p=1.5), "top_p"),
        (SetMaskEdits((MaskEdit(1, 4),)), "future"),
        (SetMaskEdits(tuple(MaskEdit(2, j) for j in range(3))), "every key"),
        (NewSession(SessionSpec("word " * 80, 0.0, None, None, 0)), "context"),
        (OpenTrace(str(corrupt)), "not a readable trace"),
        (OpenTrace(str(tmp_path / "missing.safetensors")), "no trace file"),
        (SaveTrace(str(tmp_path / "trace.txt")), ".safetensors"),
        (Load(ModelSpec("nobody/nothing-here", "cpu"), hi), "not in the local cache"),
        (Load(ModelSpec(str(tmp_path), "cpu"), hi), "not a model folder"),
    ]


def test_bad_inputs_in_the_window_give_one_dialog_each_and_the_session_goes_on(make_window, wait_idle, monkeypatch,
                                                                                tmp_path, tiny_dir):  # fmt: skip
    shown = _capture_dialogs(monkeypatch)
    win = make_window("gpt2")
    win.run(2)
    good = wait_idle(win)
    for command, word in _bad_window_inputs(tmp_path, tiny_dir):
        n = len(shown)
        win.post(command)
        snap = wait_idle(win)
        assert len(shown) == n + 1, command
        assert word in shown[-1][1], (command, shown[-1])
        assert snap.labels == good.labels and not snap.read_only, command
    win.step()
    assert wait_idle(win).n_steps == 3
