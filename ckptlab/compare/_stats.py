"""Tensor statistics and health: :func:`stats`, :func:`health`, :func:`difference`.

Each tensor is read once (``Checkpoint.read``: its bytes only, no pickle run), one at a time,
and measured in its value (sparse tensors dense, quantized ones dequantized, nested ones padded
with 0, complex ones by modulus, bool as 0/1), every sum in float64:

- a tensor of 8 or 16 bits (bfloat16, float16, float8, int8...) from the count of each of its
  bit patterns: one pass, then every figure from at most 65,536 distinct values;
- any other in two passes over slices of at most :data:`SLICE` elements (so that no float64
  copy of a large tensor ever exists): the counts, the range and the sum, then the squares
  around the mean (``std`` exact, not from the sum of squares) and the histogram.

``min``, ``max``, ``mean``, ``std`` (the population standard deviation:
``torch.std(..., correction=0)``), ``abs_max`` and the histogram are over the finite elements;
``nan``, ``inf`` and ``zeros`` count elements. The histogram has :data:`BINS` equal bins from
``min`` to ``max``: an element's bin is ``floor((x - min) * BINS / (max - min))`` computed in
float64 in that order, ``max`` in the last bin (``torch.histc``'s arithmetic on float64:
the same counts); a constant tensor's finite elements all fall in the first bin. The loops are
:mod:`ckptlab.compare._kernels` (NumPy, or compiled where built).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptlab.compare import _kernels
from ckptlab.compare._kernels import (
    SLICE,
    bins_of,
    elements,
    kernels,
    kind_of,
    moments_of,
    on_threads,
    slices,
)
from ckptlab.format._dtypes import DTYPE_ITEMSIZE

__all__ = ["BINS", "SLICE", "TensorStats", "difference", "health", "side_by_side", "stats"]

BINS = 64


@dataclass(frozen=True, slots=True)
class TensorStats:
    """Statistics of one tensor (see the module docstring); ``error`` where it could not be
    read (the other fields are then empty)."""

    dtype: str
    numel: int
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    abs_max: float | None = None
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    edges: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "numel": self.numel, "min": self.min, "max": self.max,
                "mean": self.mean, "std": self.std, "abs_max": self.abs_max, "nan": self.nan,
                "inf": self.inf, "zeros": self.zeros,
                "hist": {"edges": list(self.edges), "counts": list(self.counts)},
                "error": self.error}


def _flat(t: Any) -> Any:
    """The tensor's value (:func:`~ckptlab.compare._diff.dense_value`) as a flat contiguous
    tensor of reals."""
    import torch

    from ckptlab.compare._diff import dense_value

    t, _ = dense_value(t)
    if t.is_complex():
        t = t.abs()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.detach().contiguous().reshape(-1)


def measure(t: Any, impl: str | None = None) -> TensorStats:
    """:class:`TensorStats` of one tensor (see :func:`measure_pieces`)."""
    return measure_pieces(lambda: iter([t]), str(t.dtype).removeprefix("torch."), impl)


def measure_pieces(pieces: Callable[[], Iterator[Any]], dtype: str,
                   impl: str | None = None) -> TensorStats:
    """:class:`TensorStats` of a tensor given as ``pieces()`` (its pieces, in order: the
    tensor whole, or flat pieces of it). Tensors of 8 or 16 bits are measured from the count
    of each bit pattern: one pass over the pieces, every figure then from at most 65,536
    values. The others in two: the counts, the range and the sum, then the squares around
    the mean and the histogram; ``pieces()`` is called again for the second pass where there
    is more than one piece (a tensor read in pieces is read twice). Each piece is cut into
    slices the threads of :func:`~ckptlab.compare._kernels.on_threads` share. ``impl`` picks
    the loops (:func:`~ckptlab.compare._kernels.kernels`)."""
    import numpy as np

    k = kernels(impl)
    n = nan = inf = zeros = finite = 0
    lo, hi, total = math.inf, -math.inf, 0.0
    table = kept = None
    for count, piece in enumerate(pieces()):
        x = _flat(piece)
        n += x.numel()
        if x.element_size() <= 2:
            table = _count(x, k, table)
            continue
        kept = x if count == 0 else None  # one piece: kept for the second pass
        a, b, c, d, low, high, s, _ = moments_of(x, k)
        nan, inf, zeros, finite, total = nan + a, inf + b, zeros + c, finite + d, total + s
        lo, hi = min(lo, low), max(hi, high)
    if table is not None:
        return _from_table(dtype, n, *table)
    if not finite:
        return TensorStats(dtype, n, nan=nan, inf=inf, zeros=zeros)
    mean = total / finite
    squares = 0.0
    counts = np.zeros(BINS, dtype=np.int64)
    for piece in [kept] if kept is not None else pieces():
        x = _flat(piece)
        kind = kind_of(x)

        def second(span: tuple[int, int], x: Any = x, kind: str = kind) -> tuple[float, Any]:
            counts = np.zeros(BINS, dtype=np.int64)
            part = elements(x[span[0]:span[1]], kind)
            return k.spread(part, kind, mean, lo, hi, counts), counts

        for sq, c in on_threads(second, slices(x.numel())):
            squares += sq
            counts += c
    return _result(dtype, n, lo, hi, mean, squares / finite, nan, inf, zeros, counts)


def _count(x: Any, k: Any, table: tuple[Any, Any] | None) -> tuple[Any, Any]:
    """``table`` (the value of each bit pattern of an 8- or 16-bit dtype, float64, and its
    count so far; None for none yet) with the patterns of flat ``x`` counted in."""
    import numpy as np
    import torch

    wide = x.element_size() == 2
    if table is None:
        patterns = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)) \
            if wide else torch.from_numpy(np.arange(1 << 8, dtype=np.uint8))
        table = (patterns.view(x.dtype).to(torch.float64).numpy(),
                 np.zeros(1 << (16 if wide else 8), dtype=np.int64))
    counts = table[1]
    if wide:
        bits = x.view(torch.int16).numpy()
        for start, end in slices(bits.size):
            k.count16(bits[start:end], counts)
    else:
        counts += np.bincount(x.view(torch.uint8).numpy(), minlength=1 << 8)
    return table


def _from_table(dtype: str, n: int, values: Any, counts: Any) -> TensorStats:
    """:class:`TensorStats` from each distinct value's count (the histogram's bins computed
    as :mod:`~ckptlab.compare._kernels` computes them, once per value)."""
    import numpy as np

    present = counts > 0
    values, counts = values[present], counts[present]
    isnan, isinf = np.isnan(values), np.isinf(values)
    nan, inf = int(counts[isnan].sum()), int(counts[isinf].sum())
    zeros = int(counts[values == 0].sum())
    ok = ~(isnan | isinf)
    values, counts = values[ok], counts[ok]
    finite = int(counts.sum())
    if not finite:
        return TensorStats(dtype, n, nan=nan, inf=inf, zeros=zeros)
    lo, hi = float(values.min()), float(values.max())
    mean = float((values * counts).sum()) / finite
    squares = float((counts * (values - mean) ** 2).sum())
    hist = np.bincount(bins_of(values, lo, hi, BINS), weights=counts, minlength=BINS)
    return _result(dtype, n, lo, hi, mean, squares / finite, nan, inf, zeros, hist)


def _result(dtype: str, n: int, lo: float, hi: float, mean: float, var: float, nan: int,
            inf: int, zeros: int, counts: Any) -> TensorStats:
    import torch

    edges = tuple(float(e) for e in torch.linspace(lo, hi, BINS + 1, dtype=torch.float64))
    return TensorStats(dtype, n, lo, hi, mean, math.sqrt(var), max(abs(lo), abs(hi)), nan,
                       inf, zeros, edges, tuple(int(c) for c in counts))


def difference(a: Any, b: Any) -> TensorStats:
    """Statistics of ``b - a`` (two tensors of one shape, in float64: the changes of one
    tensor, for a histogram of them), measured as :func:`measure` measures; ``dtype`` is
    ``"float64"``. It holds a float64 copy of the tensor: for one tensor at a time."""
    if a.numel() != b.numel():
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return measure(_change(a, b))


def _change(a: Any, b: Any) -> Any:
    """``b - a`` of two tensors (or pieces) of one size, flat, in float64 (complex ones by
    modulus)."""
    import torch

    return _flat(b).to(torch.float64) - _flat(a).to(torch.float64)


def side_by_side(d: Any, a: Any, b: Any, name: str) -> dict[str, TensorStats]:
    """Tensor ``name`` (A's name) of diff ``d`` measured on both sides, and its changes:
    ``{"A": ..., "B": ..., "B - A": ...}`` (the changes where it is not identical and both
    shapes agree); ``a``, ``b``: the two checkpoints, opened. A tensor over
    :data:`~ckptlab.compare._kernels.CHUNK_NBYTES` is read in pieces (each side once per
    pass; the changes in float64 one piece at a time), so that a view of a large embedding
    holds pieces, not copies."""
    from ckptlab.checkpoint import Scratch
    from ckptlab.compare._diff import _pieces

    other = d.b_names.get(name, name)
    ea, eb = a.tensors[name], b.tensors[other]
    most = _kernels.piece_elements(8)  # (float64 pieces of the changes)
    scratches = Scratch(), Scratch()

    def side(ck: Any, key: str, i: int) -> TensorStats:
        return measure_pieces(lambda: ck.read_pieces(key, most=most, scratch=scratches[i]),
                              ck.tensors[key].dtype)

    out = {"A": side(a, name, 0), "B": side(b, other, 1)}
    t = d.tensors.get(name)
    if t is not None and not t.identical and ea.shape == eb.shape and \
            out["A"].numel == out["B"].numel:
        def changes() -> Iterator[Any]:
            for (pa, _), (pb, _) in zip(_pieces(a, name, most, scratches[0]),
                                        _pieces(b, other, most, scratches[1]), strict=True):
                yield _change(pa, pb)

        out["B - A"] = measure_pieces(changes, "float64")
    return out


def wanted(ck: Any, names: Any = None) -> list[str]:
    """The tensors of ``ck`` that ``names`` picks (None: all; a test of a name; a list of
    names), in the checkpoint's order for the first two."""
    if names is None:
        return list(ck.tensors)
    if callable(names):
        return [n for n in ck.tensors if names(n)]
    return list(names)


def stats(source: Any, names: Any = None, *,
          measured: Callable[[str], None] | None = None) -> dict[str, TensorStats]:
    """Statistics of every tensor of a checkpoint (path, URL or
    :class:`~ckptlab.checkpoint.Checkpoint`), or of ``names`` (a list of names, or a test of a
    name), in the checkpoint's order; a tensor that cannot be read gets ``error``.
    ``measured`` is called with each tensor's name once it is measured (a progress bar)."""
    from ckptlab.checkpoint import Scratch, as_checkpoint

    ck = as_checkpoint(source)
    scratch = Scratch()  # one tensor at a time, read into the same memory
    out = {}
    for name in wanted(ck, names):
        entry = ck.tensors[name]
        most = _kernels.piece_elements(DTYPE_ITEMSIZE.get(entry.dtype, 8))
        try:
            out[name] = measure_pieces(
                lambda name=name, most=most: ck.read_pieces(name, most=most, scratch=scratch),
                entry.dtype)
        except Exception as exc:  # said per tensor; the others are measured
            out[name] = TensorStats(entry.dtype, 0, error=f"cannot be read: {exc}"[:300])
        if measured is not None:
            measured(name)
    return out


def _peer_group(name: str) -> str:
    """A tensor's layer-peer group: its name with every number replaced (layers.3.w ->
    layers.#.w)."""
    return re.sub(r"\d+", "#", name)


def health(found: dict[str, TensorStats], *, far: float = 100.0) -> list[str]:
    """What looks wrong, in words: tensors with NaN or Inf, all-zero and constant tensors,
    and tensors whose ``abs_max`` is more than ``far`` times from the median of their layer
    peers (the same name but for its numbers, at least 3 of them)."""
    out = []
    bad = [n for n, s in found.items() if s.nan or s.inf]
    if bad:
        out.append(f"NaN or Inf in {len(bad)} tensor{'s' * (len(bad) != 1)}: {_some(bad)}")
    zero = [n for n, s in found.items() if s.numel > 1 and s.zeros == s.numel]
    if zero:
        out.append(f"all zero: {_some(zero)}")
    const = [n for n, s in found.items() if s.numel > 1 and s.min is not None
             and s.min == s.max and s.zeros != s.numel]
    if const:
        out.append(f"constant: {_some(const)}")
    groups: dict[str, list[str]] = {}
    for n, s in found.items():
        if s.abs_max:
            groups.setdefault(_peer_group(n), []).append(n)
    odd = []
    for members in groups.values():
        if len(members) < 3:
            continue
        values = sorted(found[n].abs_max for n in members)  # type: ignore[misc]
        median = values[len(values) // 2]
        odd += [n for n in members if median and not (
            median / far <= found[n].abs_max <= median * far)]  # type: ignore[operator]
    if odd:
        out.append(f"range far from its layer peers' (x{far:g}): {_some(odd)}")
    return out


def _some(names: list[str], most: int = 8) -> str:
    """The first ``most`` names, comma separated, "..." after them if there are more."""
    return ", ".join(names[:most]) + (" ..." if len(names) > most else "")

