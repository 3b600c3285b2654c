"""One rule for every tick step (the window's axes, the figures' label thinning, colour-bar values)."""

import pytest

from gpt_inspector.figures.labels import nice_step, ticks


@pytest.mark.parametrize("mantissas", [(1.0, 2.0, 5.0), (1.0, 2.0, 2.5, 5.0)])
def test_nice_step_is_the_smallest_round_value_not_below_x(mantissas):
    # the candidates written out, not derived the way the code derives them
    candidates = sorted(m * 10.0**e for e in range(-6, 8) for m in mantissas)
    for x in (3e-5, 0.3, 0.99, 1.0, 1.01, 2.4, 2.6, 7.0, 20.0, 21.0, 999.0, 12345.0, 9.9e6):
        want = min(c for c in candidates if c >= x * (1 - 1e-12))
        assert nice_step(x, mantissas) == pytest.approx(want, rel=1e-12), x


def test_colour_bar_ticks_use_quarter_steps_with_the_decimals_they_need():
    assert ticks(0.0, 1.0) == [(0.0, "0.00"), (0.25, "0.25"), (0.5, "0.50"), (0.75, "0.75"), (1.0, "1.00")]
    assert [v for v, _ in ticks(0.0, 100.0, n=3)] == [0.0, 50.0, 100.0]
