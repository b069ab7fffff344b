"""The compiled element loops against the NumPy ones, without torch (so that the newest
CPython, where torch may not be installed yet, checks its build of ``_ckernels`` too):
counts, ranges and histograms equal, sums to rounding, on arrays with NaN, infinities and
signed zeros around the block sizes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.compare.conftest import pick

VALUES = st.one_of(st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45]),
                   st.floats(-1e6, 1e6, width=32))


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, float) or isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y)) or \
            abs(x - y) <= 1e-9 * max(abs(x), abs(y))
    return x == y


@settings(max_examples=120, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(0, 4200), elements=VALUES),
       kind=st.sampled_from(["f", "d"]))
def test_the_two_implementations_agree(x: Any, kind: str) -> None:
    py, c = pick("python"), pick("c")
    x = x if kind == "f" else x.astype(np.float64)
    m_py, m_c = py.moments(x, kind), c.moments(x, kind)
    assert all(_same(a, b) for a, b in zip(m_py, m_c, strict=True)), (m_py, m_c)
    finite, lo, hi, total = m_c[3:7]
    if finite:
        counts_py, counts_c = np.zeros(64, np.int64), np.zeros(64, np.int64)
        mean = total / finite
        assert _same(py.spread(x, kind, mean, lo, hi, counts_py),
                     c.spread(x, kind, mean, lo, hi, counts_c))
        assert (counts_py == counts_c).all() and counts_c.sum() == finite
    y = x.copy()
    y[::7] = y[::7] * 1.5
    for atol, rtol in ((0.0, 0.0), (1e-3, 1e-2)):
        a, b = py.compare(x, y, kind, atol, rtol), c.compare(x, y, kind, atol, rtol)
        assert all(_same(p, q) for p, q in zip(a, b, strict=True)), (a, b)
    bits = x.view(np.uint16)
    t_py, t_c = np.zeros(1 << 16, np.int64), np.zeros(1 << 16, np.int64)
    py.count16(bits, t_py)
    c.count16(bits, t_c)
    assert (t_py == t_c).all()
