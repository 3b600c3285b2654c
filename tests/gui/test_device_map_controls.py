"""The window's load controls take a device map, a memory limit and an offload folder."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("accelerate")


def test_load_controls_split_a_model_over_cpu_and_disk(make_window, wait_idle, tiny_dir, tmp_path, dialogs):
    folder = tiny_dir["llama"]
    weights = sum(os.path.getsize(f) for f in folder.glob("*.safetensors"))
    win = make_window()
    panel = win.session_panel
    panel.model.setCurrentText(str(folder))
    panel.device_map.setCurrentText("auto")
    panel.max_memory.setText(f"cpu={int(weights * 0.76)}")
    panel.offload_folder.setText(str(tmp_path / "offload"))
    spec = panel.model_spec()
    assert (spec.device_map, spec.max_memory, spec.offload_folder) == (
        "auto",
        f"cpu={int(weights * 0.76)}",
        str(tmp_path / "offload"),
    )
    win.acts.load.trigger()
    wait_idle(win, timeout=60000)
    assert dialogs == []
    assert "device map" in win.statusBar().currentMessage()
    placed = {}
    win.run_in_worker(lambda s: placed.update(s.lm.device_map))
    wait_idle(win)
    assert set(placed.values()) == {"cpu", "disk"}
    win.step()
    assert wait_idle(win).n_steps == 1

    # a limit that cannot be read is one dialog, and the old session stays
    panel.max_memory.setText("cpu=plenty")
    win.acts.load.trigger()
    wait_idle(win)
    assert len(dialogs) == 1 and "--max-memory cpu" in dialogs[0][1]
    assert win.controller.n_steps == 1
