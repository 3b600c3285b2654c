"""Painting at long T touches only what is on screen, and shows what a full paint shows."""

from __future__ import annotations

from types import SimpleNamespace

from gpt_inspector.gui.views.common import TokenAxis
from gpt_inspector.gui.views.token_strip import TokenStrip


def test_token_strip_paints_a_clip_as_the_whole_canvas_shows_it(qtbot):
    strip = TokenStrip()
    qtbot.addWidget(strip)
    strip.resize(400, 120)
    strip.show()
    n = 3000
    labels = tuple(f"tok{i % 97}" + "x" * (i % 5) for i in range(n))
    snap = SimpleNamespace(T=n - 1, query=1234, tokens=SimpleNamespace(labels=labels, token_ids=tuple(range(n)),
                           token_probs=tuple(None if i < 2000 else (i % 10) / 10 for i in range(n)),
                           prompt_len=2000, roles=()))  # fmt: skip
    strip.set_snapshot(snap)
    canvas = strip.canvas
    assert len(canvas.rects) == n and canvas.height() > 1000
    whole = canvas.grab().toImage()
    for r in (canvas.rects[1234], canvas.rects[0], canvas.rects[-1], canvas.rects[2600].united(canvas.rects[2640])):
        clip = r.adjusted(-7, -9, 9, 7).intersected(canvas.rect())  # cuts through chips and rows
        part = canvas.grab(clip).toImage()
        assert part == whole.copy(clip)


def test_token_axis_spaces_its_ticks_by_the_longest_label(qtbot):
    axis = TokenAxis("bottom", chars=6)
    axis.set_labels(["a"] * 1000)
    short = axis.tickValues(0, 1000, 500)[0][0]
    axis.set_labels(["a"] * 999 + ["abcdef"])
    long = axis.tickValues(0, 1000, 500)[0][0]
    axis.set_labels(["abcdef"] * 2 + ["a"] * 998)
    assert long > short and axis.tickValues(0, 1000, 500)[0][0] == long


def test_token_axes_given_one_snapshots_labels_each_show_them(qtbot):
    """Axes handed the same labels (one snapshot's, as a dozen views do) share the work of reading
    them, yet each shows its own: after an axis that saw other labels, after a step, after a list."""
    a, b, c = (TokenAxis("bottom", chars=6) for _ in range(3))
    first = tuple(f"t{i}" for i in range(500))
    for ax in (a, b):
        ax.set_labels(first)
    c.set_labels(["other"] * 3)
    stepped = (*first, "abcdefgh")  # a step appends a longer label
    for ax in (a, b, c):
        ax.set_labels(stepped)
        assert ax.labels == list(stepped) and ax.longest == 8
    assert a.tickStrings([500.5], 1, 1) == b.tickStrings([500.5], 1, 1) == c.tickStrings([500.5], 1, 1)
    given = ["x"] * 4
    a.set_labels(given)
    given[0] = "changed"  # a list may change after it was given: it is read again
    a.set_labels(given)
    b.set_labels(given)
    assert a.labels == b.labels == given and a.longest == b.longest == 7
