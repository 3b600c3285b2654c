"""figures.save writes through the one writer: a full disk keeps the old image whole, a FIFO or link is refused."""

from __future__ import annotations

import os

import pytest
from known_source import KnownSource
from writing import full_disk

from gpt_inspector import figures
from gpt_inspector.core.errors import InspectorError

OLD = b"\x89PNG old " * 700  # ~6,000 bytes, as in the report


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_a_full_disk_keeps_the_old_figure_byte_for_byte(tmp_path, monkeypatch, suffix):
    p = tmp_path / f"h{suffix}"
    p.write_bytes(OLD)
    fig = figures.head_figure(KnownSource(), 0, 1, "probs")
    with full_disk(tmp_path, monkeypatch, after=8192), pytest.raises(InspectorError, match="No space left") as e:
        figures.save(fig, p)
    assert "\n" not in str(e.value)
    assert p.read_bytes() == OLD and os.listdir(tmp_path) == [p.name]
    assert figures.save(fig, p) == p and p.read_bytes() != OLD  # and a later save, with room, replaces it


def test_a_fifo_or_a_symlink_is_refused_before_the_figure_is_encoded(tmp_path, monkeypatch):
    os.mkfifo(tmp_path / "pipe.png")  # opening it to write, as before, would block with no reader
    (tmp_path / "real.png").write_bytes(OLD)
    (tmp_path / "link.png").symlink_to(tmp_path / "real.png")
    from gpt_inspector.figures import output

    monkeypatch.setattr(output, "to_bytes", lambda *a, **k: pytest.fail("encoded for a refused destination"))
    fig = figures.head_figure(KnownSource(), 0, 1, "probs")
    for name, word in (("pipe.png", "pipe"), ("link.png", "symbolic link")):
        with pytest.raises(InspectorError, match=word):
            figures.save(fig, tmp_path / name)
    assert (tmp_path / "real.png").read_bytes() == OLD
