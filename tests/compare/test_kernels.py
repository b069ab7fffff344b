"""One suite for both implementations of the element loops of ``ckptlab.compare`` (NumPy and
compiled), each held to torch computing the same figure on float64: counts and ranges exactly,
the histogram exactly as ``torch.histc`` bins float64, sums to rounding."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, 3.4e38, -1.0, 1.0]


@pytest.fixture
def k(kernels: Any) -> Any:
    """Each implementation in turn (the ``kernels`` fixture of conftest.py)."""
    return kernels


def arrays(dtype: Any) -> Any:
    """Arrays of every length around the 8-lane and 2048-element blocks, with NaN, infinities,
    signed zeros and subnormals among ordinary values."""
    elements = st.one_of(st.sampled_from(SPECIAL),
                         st.floats(-1e6, 1e6, width=32 if dtype == np.float32 else 64))
    return hnp.arrays(dtype, st.one_of(st.integers(0, 40), st.integers(2040, 4200)),
                      elements=elements)


def _close(a: float, b: float, scale: float) -> bool:
    """Equal to rounding: within 1e-12 of ``scale`` (the sum of the magnitudes added; where
    that is not finite, an infinity beside finite values, of the larger of the two)."""
    if not math.isfinite(scale):
        scale = max(abs(a), abs(b))
    return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-12 * scale + 1e-300


@settings(max_examples=150, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64]))
def test_moments_and_spread_against_torch(k: Any, data: Any, dtype: Any) -> None:
    x = data.draw(arrays(dtype))
    kind = "f" if dtype == np.float32 else "d"
    nan, inf, zeros, finite, lo, hi, total, squares = k.moments(x, kind)
    t = torch.from_numpy(x.astype(np.float64))
    ok = torch.isfinite(t)
    f = t[ok]
    assert (nan, inf, zeros, finite) == (int(torch.isnan(t).sum()), int(torch.isinf(t).sum()),
                                         int((t == 0).sum()), f.numel())
    scale = float(f.abs().sum()) if f.numel() else 0.0
    if not f.numel():
        assert (lo, hi, total, squares) == (math.inf, -math.inf, 0.0, 0.0)
        return
    assert (lo, hi) == (f.min().item(), f.max().item())
    assert _close(total, float(f.sum()), scale)
    assert _close(squares, float((f * f).sum()), float((f * f).sum()))
    mean = total / finite
    for bins in (64, 7):
        counts = np.zeros(bins, dtype=np.int64)
        squares = k.spread(x, kind, mean, lo, hi, counts)
        assert _close(squares, float(((f - mean) ** 2).sum()), float(((f - mean) ** 2).sum()))
        if hi > lo:
            want = torch.histc(f, bins=bins, min=lo, max=hi)
            assert counts.tolist() == [int(c) for c in want]
        else:
            assert counts.tolist() == [finite] + [0] * (bins - 1)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_spread_leaves_out_what_is_outside_the_range(k: Any, data: Any) -> None:
    """Elements outside [lo, hi], NaN and infinities are not counted; lo and hi themselves
    are (hi in the last bin), as torch.histc counts float64."""
    x = data.draw(arrays(np.float64))
    lo = data.draw(st.floats(-1e6, 1e6))
    hi = data.draw(st.floats(lo, 2e6).filter(lambda h: h > lo))
    x = np.concatenate([x, [lo, hi, np.nextafter(lo, -np.inf), np.nextafter(hi, np.inf)]])
    counts = np.zeros(64, dtype=np.int64)
    k.spread(x, "d", 0.0, lo, hi, counts)
    t = torch.from_numpy(x)
    want = torch.histc(t[torch.isfinite(t)], bins=64, min=lo, max=hi)
    assert counts.tolist() == [int(c) for c in want]


def test_spread_bins_exactly_on_the_edges(k: Any) -> None:
    """Values where multiplying by 1/width and dividing by width round differently: the bin
    is the division's (torch.histc's)."""
    rng = np.random.default_rng(3)
    lo, hi = -0.3, 0.7000000000000001
    edges = lo + (hi - lo) * np.arange(65) / 64
    x = np.concatenate([edges, np.nextafter(edges, np.inf), np.nextafter(edges, -np.inf),
                        rng.uniform(lo, hi, 5000)])
    x = x[(x >= lo) & (x <= hi)]
    counts = np.zeros(64, dtype=np.int64)
    k.spread(x, "d", 0.0, lo, hi, counts)
    assert counts.tolist() == [int(c) for c in torch.histc(torch.from_numpy(x), 64, lo, hi)]


def test_count16(k: Any) -> None:
    x = np.random.default_rng(0).integers(0, 1 << 16, 100_003).astype(np.uint16)
    counts = np.zeros(1 << 16, dtype=np.int64)
    k.count16(x, counts)
    k.count16(x[:10], counts)  # added to what is there
    want = np.bincount(x, minlength=1 << 16)
    want += np.bincount(x[:10], minlength=1 << 16)
    assert (counts == want).all()


@settings(max_examples=150, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64]),
       atol=st.sampled_from([0.0, 1e-3]), rtol=st.sampled_from([0.0, 1e-2]))
def test_compare_against_torch(k: Any, data: Any, dtype: Any, atol: float,
                               rtol: float) -> None:
    a = data.draw(arrays(dtype))
    b = a.copy()
    if a.size:  # some elements moved, some NaN / infinities planted on one side
        idx = data.draw(st.lists(st.integers(0, a.size - 1), max_size=8))
        for i in idx:
            b[i] = data.draw(st.sampled_from(SPECIAL + [float(a[i]) * 1.001, 5.0]))
    kind = "f" if dtype == np.float32 else "d"
    n_diff, nan_a, nan_b, max_abs, sa, sb, sd, dot, within = k.compare(a, b, kind, atol, rtol)
    x, y = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(b.astype(np.float64))
    na, nb = torch.isnan(x), torch.isnan(y)
    equal = (x == y) | (na & nb)
    assert n_diff == int((~equal).sum())
    assert (nan_a, nan_b) == (int(na.sum()), int(nb.sum()))
    ok = ~(na | nb)
    xs, ys = x[ok], y[ok]
    delta = torch.where(xs == ys, torch.zeros_like(xs), xs - ys)
    assert max_abs == (float(delta.abs().max()) if delta.numel() else 0.0) or \
        (math.isnan(max_abs) and bool(torch.isnan(delta).any()))
    for got, want in ((sa, (xs * xs).sum()), (sb, (ys * ys).sum()), (sd, (delta ** 2).sum()),
                      (dot, (xs * ys).sum())):
        scale = float((xs.abs() * ys.abs()).sum() + (xs * xs).sum() + (ys * ys).sum())
        assert _close(got, float(want), scale)
    assert within == bool(torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True).all())


def test_bad_arguments_are_refused(k: Any) -> None:
    with pytest.raises(ValueError):
        k.moments(b"\0" * 6, "f")
    with pytest.raises(ValueError):
        k.moments(b"\0" * 8, "x")
    with pytest.raises(ValueError):
        k.compare(b"\0" * 8, b"\0" * 16, "f", 0.0, 0.0)
    with pytest.raises(ValueError):
        k.count16(b"\0" * 4, np.zeros(10, dtype=np.int64))
    with pytest.raises(ValueError):
        k.spread(b"\0" * 8, "d", 0.0, 0.0, 1.0, np.zeros(0, dtype=np.int64))
