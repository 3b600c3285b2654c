"""Diverging colour levels of the K/V, Q/K/V and head-attribution images when cells are NaN or inf."""

from __future__ import annotations

import numpy as np
import pytest

from gpt_inspector.gui.views.common import symmetric_levels


@pytest.mark.parametrize(
    ("cells", "want"),
    [
        ([[-2.0, 1.0], [0.5, 0.0]], 2.0),
        ([[-2.0, np.inf], [0.5, 3.0]], 3.0),  # an overflowed half-precision cell: the others keep their scale
        ([[np.nan, -4.0], [0.5, 1.0]], 4.0),
        ([[-np.inf, np.nan]], 1.0),  # nothing finite
        ([[0.0, 0.0]], 1.0),  # all zero: a range that is not empty
        (np.zeros((0, 3)), 1.0),
    ],
)
def test_levels_come_from_the_finite_cells(cells, want):
    lo, hi = symmetric_levels(np.asarray(cells, dtype=np.float32))
    assert (lo, hi) == (-want, want)
