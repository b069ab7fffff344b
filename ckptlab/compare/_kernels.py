"""The element loops of :mod:`ckptlab.compare`: four functions, in NumPy here and compiled in
:mod:`ckptlab.compare._ckernels` (built where a C compiler is at hand). :func:`kernels` picks
one; ``tests/compare/test_kernels.py`` runs one suite against both, as CPython pairs
``pickle.py`` with ``_pickle.c``.

Elements are contiguous float32 (``kind`` ``"f"``) or float64 (``"d"``) in any object with
the buffer protocol; all arithmetic is in float64.

- ``moments(x, kind)`` -> ``(nan, inf, zeros, finite, lo, hi, total, squares)``: counts, the
  finite range (``inf, -inf`` when nothing is finite) and the sums of the finite elements and
  of their squares.
- ``spread(x, kind, mean, lo, hi, counts)`` -> the sum of ``(x - mean) ** 2`` over the finite
  elements; their histogram is added into ``counts`` (a writable int64 array of the bins, at
  most 2**20):
  the bin of ``x`` is ``floor((x - lo) * bins / (hi - lo))`` computed in float64 in that order,
  ``x == hi`` in the last bin, elements outside ``[lo, hi]`` not counted (``torch.histc``'s
  rule, as ``torch.histc`` computes it on float64).
- ``count16(x, counts)``: adds the count of each 16-bit pattern of ``x`` into ``counts``
  (int64[65536]).
- ``compare(a, b, kind, atol, rtol)`` -> ``(n_diff, nan_a, nan_b, max_abs, sa, sb, sd, dot,
  within)``: elements that differ (NaN equal to NaN), NaN counts, and over the positions where
  neither side is NaN: the largest ``|a - b|`` (equal infinities differ by 0), the sums of
  ``a**2``, ``b**2``, ``(a - b)**2`` and ``a * b``; ``within``: every element equal or
  within ``atol + rtol * |b|`` (``torch.isclose``'s rule: NaN equal to NaN, an infinity
  close only to itself).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np

__all__ = ["CHUNK_NBYTES", "SLICE", "WORKERS", "bins_of", "elements", "kernels", "kind_of",
           "moments_of", "on_threads", "piece_elements", "slices"]

SLICE = 1 << 21  # elements per call at most (16 MiB of float64 where a slice is converted)
WORKERS = max(1, min(4, os.cpu_count() or 1))  # threads the loops of one tensor share
CHUNK_NBYTES = 64 << 20  # a tensor larger than this is read in pieces of it (diff, stats)

# dtypes whose every value float32 holds exactly (passed as "f", in float64 arithmetic)
_FLOAT32_EXACT = frozenset({"float32", "bfloat16", "float16", "int8", "uint8", "int16", "bool",
                            "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                            "float8_e5m2fnuz"})

_DTYPES = {"f": np.float32, "d": np.float64}


def _quiet(f: Any) -> Any:
    """``f`` with NumPy's floating-point warnings off (NaN and infinities are data here)."""
    def run(*args: Any) -> Any:
        with np.errstate(all="ignore"):
            return f(*args)

    run.__name__, run.__doc__ = f.__name__, f.__doc__
    return run


def _as(x: Any, kind: str) -> np.ndarray:
    if kind not in _DTYPES:
        raise ValueError("kind must be 'f' (float32) or 'd' (float64)")
    return np.frombuffer(x, dtype=_DTYPES[kind]).astype(np.float64)


@_quiet
def moments(x: Any, kind: str) -> tuple[int, int, int, int, float, float, float, float]:
    v = _as(x, kind)
    ok = np.isfinite(v)
    nan = int(np.isnan(v).sum())
    f = v[ok]
    lo, hi = (float(f.min()), float(f.max())) if f.size else (np.inf, -np.inf)
    return (nan, int(v.size - f.size - nan), int((v == 0).sum()), int(f.size), lo, hi,
            float(f.sum()), float((f * f).sum()))


@_quiet
def spread(x: Any, kind: str, mean: float, lo: float, hi: float, counts: Any) -> float:
    v = _as(x, kind)
    f = v[np.isfinite(v)]
    out = np.frombuffer(counts, dtype=np.int64)
    if not 0 < out.size <= 1 << 20:
        raise ValueError("counts must be an int64 buffer of 1 to 2**20 bins")
    out += np.bincount(bins_of(f[(f >= lo) & (f <= hi)], lo, hi, out.size), minlength=out.size)
    return float(((f - mean) ** 2).sum())


def bins_of(values: np.ndarray, lo: float, hi: float, bins: int) -> np.ndarray:
    """The bin of each of ``values`` (all in ``[lo, hi]``): ``floor((x - lo) * bins / (hi -
    lo))`` in float64 in that order, ``hi`` in the last bin, every one in bin 0 when ``hi ==
    lo`` (the rule of ``spread``, and of ``torch.histc`` on float64)."""
    width = hi - lo
    if not width > 0:
        return np.zeros(values.size, dtype=np.int64)
    return np.minimum(((values - lo) * float(bins) / width).astype(np.int64), bins - 1)


def count16(x: Any, counts: Any) -> None:
    out = np.frombuffer(counts, dtype=np.int64)
    if len(memoryview(x).cast("B")) % 2 or out.size != 65536:
        raise ValueError("count16 takes whole 16-bit elements and an int64[65536] buffer")
    out += np.bincount(np.frombuffer(x, dtype=np.uint16), minlength=65536)


@_quiet
def compare(a: Any, b: Any, kind: str, atol: float,
            rtol: float) -> tuple[int, int, int, float, float, float, float, float, bool]:
    x, y = _as(a, kind), _as(b, kind)
    if x.size != y.size:
        raise ValueError("a and b hold different numbers of elements")
    na, nb = np.isnan(x), np.isnan(y)
    equal = (x == y) | (na & nb)
    ok = ~(na | nb)
    x, y, eq = x[ok], y[ok], equal[ok]
    delta = np.where(eq, 0.0, x - y)
    close = eq | (np.isfinite(x) & np.isfinite(y) & (np.abs(x - y) <= atol + rtol * np.abs(y)))
    within = bool(close.all()) and bool(equal[~ok].all())
    return (int((~equal).sum()), int(na.sum()), int(nb.sum()),
            float(np.abs(delta).max()) if delta.size else 0.0, float((x * x).sum()),
            float((y * y).sum()), float((delta * delta).sum()), float((x * y).sum()), within)


PYTHON = SimpleNamespace(moments=moments, spread=spread, count16=count16, compare=compare)


def kernels(which: str | None = None) -> Any:
    """The four loops: ``"python"`` (this module), ``"c"`` (:mod:`ckptlab.compare._ckernels`;
    ImportError where it is not built) or ``None``: the compiled ones where built."""
    if which == "python":
        return PYTHON
    try:
        from ckptlab.compare import _ckernels
    except ImportError:
        if which == "c":
            raise
        return PYTHON
    return _ckernels


def slices(n: int, most: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` bounds cutting ``n`` elements into slices of at most ``most``
    (default :data:`SLICE`) elements, and into at least :data:`WORKERS` slices where there
    are a million elements or more (so that the threads of :func:`on_threads` share them)."""
    most = SLICE if most is None else most
    size = min(most, max(1 << 20, -(-n // WORKERS)))
    return [(start, min(n, start + size)) for start in range(0, n, size)] or [(0, 0)]


T = TypeVar("T")
_POOL: ThreadPoolExecutor | None = None


def on_threads(f: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    """``[f(item) for item in items]``, the items shared among :data:`WORKERS` threads (the
    loops release the GIL while they run; NumPy's mostly do), in order."""
    global _POOL
    if len(items) < 2 or WORKERS == 1:
        return [f(item) for item in items]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(WORKERS, thread_name_prefix="ckptlab-compare")
    return list(_POOL.map(f, items))


def piece_elements(itemsize: int) -> int:
    """Elements of a piece of :data:`CHUNK_NBYTES` for elements of ``itemsize`` bytes."""
    return max(1, CHUNK_NBYTES // max(itemsize, 1))


def kind_of(x: Any) -> str:
    """The ``kind`` a torch tensor's elements are passed as: ``"f"`` (float32) where float32
    holds each of its values exactly, else ``"d"`` (float64: integers exact up to 2**53)."""
    return "f" if str(x.dtype).removeprefix("torch.") in _FLOAT32_EXACT else "d"


def elements(x: Any, kind: str) -> Any:
    """A flat torch tensor as a NumPy array of ``kind``'s float type (converted where it is
    another)."""
    import torch

    want = torch.float32 if kind == "f" else torch.float64
    return (x if x.dtype == want else x.to(want)).contiguous().numpy()


def moments_of(x: Any, k: Any) -> tuple[int, int, int, int, float, float, float, float]:
    """``moments`` of a flat torch tensor of reals (``k``: the loops of :func:`kernels`), its
    slices shared by the threads of :func:`on_threads`, the figures joined."""
    kind = kind_of(x)

    def part(span: tuple[int, int]) -> tuple[Any, ...]:
        return k.moments(elements(x[span[0]:span[1]], kind), kind)

    nan = inf = zeros = finite = 0
    lo, hi, total, squares = math.inf, -math.inf, 0.0, 0.0
    for a, b, c, d, low, high, s, q in on_threads(part, slices(x.numel())):
        nan, inf, zeros, finite = nan + a, inf + b, zeros + c, finite + d
        lo, hi, total, squares = min(lo, low), max(hi, high), total + s, squares + q
    return nan, inf, zeros, finite, lo, hi, total, squares
