"""Tensor statistics and health: :func:`stats`, :func:`health`.

Each tensor is read once (``Checkpoint.read``: its bytes only, no pickle run), one at a time,
and measured in its value (sparse tensors dense, quantized ones dequantized, nested ones padded
with 0, complex ones by modulus, bool as 0/1) in slices of at most :data:`SLICE` elements, the sums accumulated in
float64, so a tensor's float64 copy never exists
whole (``std`` from the squares around the mean, in a second pass with the histogram).
``min``, ``max``, ``mean``, ``std`` (the population standard deviation:
``torch.std(..., correction=0)``), ``abs_max`` and the histogram are over the finite elements; ``nan``, ``inf`` and ``zeros`` count elements. The histogram has
:data:`BINS` equal bins from ``min`` to ``max`` (``torch.histc``'s rule: the last bin holds
``max``); a constant tensor's finite elements all fall in the first bin.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["BINS", "SLICE", "TensorStats", "health", "stats"]

BINS = 64
SLICE = 1 << 22  # elements converted to float64 at a time (32 MiB)


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
    """The tensor's value (:func:`~ckptlab.compare._diff.dense_value`) as a flat tensor of
    reals."""
    import torch

    from ckptlab.compare._diff import dense_value

    t, _ = dense_value(t)
    if t.is_complex():
        t = t.abs()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.detach().reshape(-1)


def measure(t: Any) -> TensorStats:
    """:class:`TensorStats` of one tensor: one pass for the counts, the range and the float64
    sum; one for the squares around the mean and the histogram (on the values' own float
    type where it is one)."""
    import torch

    dtype = str(t.dtype).removeprefix("torch.")
    x = _flat(t)
    if not x.is_floating_point():
        x = x.to(torch.float64)  # integers: exact in float64 up to 2**53
    n = x.numel()
    nan = inf = zeros = finite = 0
    lo, hi = math.inf, -math.inf
    total = squares = 0.0
    for start in range(0, n, SLICE):
        s = x[start:start + SLICE]
        zeros += int((s == 0).sum())
        if not bool(torch.isfinite(s).all()):  # (one pass in the usual case of none)
            isnan, isinf = torch.isnan(s), torch.isinf(s)
            nan += int(isnan.sum())
            inf += int(isinf.sum())
            s = s[~(isnan | isinf)]
        if s.numel():
            finite += s.numel()
            low, high = torch.aminmax(s)
            lo, hi = min(lo, float(low)), max(hi, float(high))
            total += float(s.sum(dtype=torch.float64))  # accumulated in float64
    if not finite:
        return TensorStats(dtype, n, nan=nan, inf=inf, zeros=zeros)
    mean = total / finite
    counts = torch.zeros(BINS, dtype=torch.float64)
    kind = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    for start in range(0, n, SLICE):  # the spread around the mean (exact), the histogram
        s = x[start:start + SLICE]
        s = s[torch.isfinite(s)] if nan or inf else s
        squares += float(torch.linalg.vector_norm(s.to(torch.float64) - mean)) ** 2
        if hi > lo:
            counts += torch.histc(s.to(kind), bins=BINS, min=lo, max=hi).to(torch.float64)
    if hi == lo:
        counts[0] = finite
    var = squares / finite
    edges = tuple(float(e) for e in torch.linspace(lo, hi, BINS + 1, dtype=torch.float64))
    return TensorStats(dtype, n, lo, hi, mean, math.sqrt(var), max(abs(lo), abs(hi)), nan,
                       inf, zeros, edges, tuple(int(c) for c in counts))


def stats(source: Any, names: Any = None) -> dict[str, TensorStats]:
    """Statistics of every tensor of a checkpoint (path, URL or
    :class:`~ckptlab.checkpoint.Checkpoint`), or of ``names`` (a list of names, or a test of a
    name), in the checkpoint's order; a tensor that cannot be read gets ``error``."""
    from ckptlab.checkpoint import Checkpoint, open_checkpoint

    ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    if names is None:
        wanted = list(ck.tensors)
    elif callable(names):
        wanted = [n for n in ck.tensors if names(n)]
    else:
        wanted = list(names)
    out = {}
    for name in wanted:
        entry = ck.tensors[name]
        try:
            t = ck.read(name)
        except Exception as exc:  # said per tensor; the others are measured
            out[name] = TensorStats(entry.dtype, 0, error=f"cannot be read: {exc}"[:300])
            continue
        out[name] = measure(t)
        del t
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

