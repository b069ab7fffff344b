"""What changed between two checkpoints, of any two formats: :func:`diff`.

Names are matched exactly, or through a prefix one side has on every name and the other does
not (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``, ``model.``...): the rule that
matches the most names wins (``rename=`` overrides it). Tensors left on one side with the
same dtype, shape and bytes as one on the other are ``renamed``.

Each common tensor is read once per side (``Checkpoint.read``: its bytes only, no pickle
run; one tensor of each side in memory at a time). Equal dtypes, shapes and bytes are
``identical`` without any float work. Otherwise both sides are compared in their value
(sparse tensors dense, quantized ones dequantized): cast to float64 (complex: complex128;
bool and integer tensors exactly, as float64 holds every integer up to 2**53), NaN equal to
NaN. ``n_diff`` counts the elements that differ; ``max_abs`` is the largest ``|a - b|``
where neither side is NaN (equal infinities differ by 0); ``rel_l2`` is ``||a - b|| /
||a||`` (0 when both are zero, inf when only ``a`` is); ``cosine`` is ``a . b / (||a||
||b||)`` (1 when both are zero, 0 when one is); NaN positions are left out of the three
norms. ``nan_a`` / ``nan_b`` count NaNs. A tensor is *changed* when its dtype or shape
differ, or some element is farther than ``atol + rtol * |b|`` (``torch.isclose``'s rule,
NaN equal to NaN).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointDiff", "TensorDiff", "diff"]

# prefixes wrappers put on every name (DDP, torch.compile, Lightning, PEFT, HF heads)
COMMON_PREFIXES = ("module.", "_orig_mod.", "model.", "base_model.model.", "transformer.")


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """How one tensor differs between the two sides (see the module docstring)."""

    identical: bool
    dtype: tuple[str, str]
    shape: tuple[tuple[int, ...] | None, tuple[int, ...] | None]
    max_abs: float | None = None
    rel_l2: float | None = None
    cosine: float | None = None
    n_diff: int | None = None
    nan_a: int = 0
    nan_b: int = 0
    within: bool = False  # every element within the tolerances (and the same dtype, shape)
    compared: str = "bytes"  # "bytes", "values", "dense values", "dequantized values"
    error: str | None = None  # a side that could not be read, in words

    @property
    def changed(self) -> bool:
        return not self.identical and not self.within

    def to_dict(self) -> dict[str, Any]:
        return {"identical": self.identical, "dtype": list(self.dtype),
                "shape": [None if s is None else list(s) for s in self.shape],
                "max_abs": _number(self.max_abs), "rel_l2": _number(self.rel_l2),
                "cosine": _number(self.cosine), "n_diff": self.n_diff, "nan_a": self.nan_a,
                "nan_b": self.nan_b, "changed": self.changed, "compared": self.compared,
                "error": self.error}


def _number(x: float | None) -> float | str | None:
    """A float for JSON: non-finite ones as text ("inf", "-inf", "nan")."""
    if x is None or math.isfinite(x):
        return x
    return str(x)


@dataclass(frozen=True)
class CheckpointDiff:
    """The difference between checkpoints ``a`` and ``b`` (paths as opened)."""

    a: str
    b: str
    mapping: str
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    renamed: dict[str, str]
    tensors: dict[str, TensorDiff] = field(default_factory=dict)
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def differs(self) -> bool:
        """Whether anything differs beyond the tolerances: a changed tensor, or a tensor on
        one side only (renamed ones included)."""
        return bool(self.only_a or self.only_b or any(t.changed for t in self.tensors.values()))

    def counts(self) -> dict[str, int]:
        return {"identical": sum(t.identical for t in self.tensors.values()),
                "changed": sum(t.changed for t in self.tensors.values()),
                "within_tolerance": sum(t.within and not t.identical
                                        for t in self.tensors.values()),
                "only_a": len(self.only_a), "only_b": len(self.only_b),
                "renamed": len(self.renamed)}

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``ckptlab diff --json``."""
        return {"a": self.a, "b": self.b, "mapping": self.mapping, "only_a": list(self.only_a),
                "only_b": list(self.only_b), "renamed": dict(self.renamed),
                "atol": self.atol, "rtol": self.rtol,
                "tensors": {k: t.to_dict() for k, t in self.tensors.items()},
                "summary": self.counts()}

    def largest(self, n: int = 10) -> list[tuple[str, TensorDiff]]:
        """The ``n`` most changed tensors: different dtype or shape first, then by relative
        change (rel_l2, else max_abs)."""
        def key(item: tuple[str, TensorDiff]) -> tuple[int, float, float]:
            t = item[1]
            rel = t.rel_l2 if t.rel_l2 is not None and not math.isnan(t.rel_l2) else math.inf
            return (t.dtype[0] == t.dtype[1] and t.shape[0] == t.shape[1],
                    -rel, -(t.max_abs or 0.0))

        return sorted(((k, t) for k, t in self.tensors.items() if t.changed), key=key)[:n]

    def summary(self) -> str:
        """A few lines: the counts, the name rule, the largest changes first."""
        c = self.counts()
        lines = [f"{self.a} vs {self.b}",
                 f"  {c['identical']} identical, {c['changed']} changed"
                 + (f", {c['within_tolerance']} within tolerance" if c["within_tolerance"]
                    else "")
                 + f", {c['only_a']} only in A, {c['only_b']} only in B"
                 + (f" ({c['renamed']} renamed)" if c["renamed"] else ""),
                 f"  names matched: {self.mapping}"]
        for name, t in self.largest():
            if t.error:
                what = t.error
            elif t.dtype[0] != t.dtype[1] or t.shape[0] != t.shape[1]:
                what = (f"dtype {t.dtype[0]} -> {t.dtype[1]}" if t.dtype[0] != t.dtype[1]
                        else "") + (f" shape {_shape(t.shape[0])} -> {_shape(t.shape[1])}"
                                    if t.shape[0] != t.shape[1] else "")
            else:
                what = (f"max_abs {t.max_abs:.4g}, rel_l2 {t.rel_l2:.4g}, cosine "
                        f"{t.cosine:.6g}, {t.n_diff:,} elements differ"
                        + (f", NaN {t.nan_a}/{t.nan_b}" if t.nan_a or t.nan_b else ""))
            lines.append(f"  changed  {name}: {what.strip()}")
        for name, other in list(self.renamed.items())[:10]:
            lines.append(f"  renamed  {name} -> {other}")
        lines += [f"  only A   {n}" for n in self.only_a[:10] if n not in self.renamed]
        lines += [f"  only B   {n}" for n in self.only_b[:10]
                  if n not in self.renamed.values()]
        return "\n".join(lines)


def _shape(s: tuple[int, ...] | None) -> str:
    return "?" if s is None else "x".join(map(str, s)) or "scalar"


# -- names ------------------------------------------------------------------------------------
def _strip(names: Iterable[str], prefix: str) -> dict[str, str] | None:
    """name -> name without ``prefix``, when every name has it; else None."""
    out = {}
    for n in names:
        if not n.startswith(prefix):
            return None
        out[n] = n[len(prefix):]
    return out


def _mapping(a: list[str], b: list[str], rename: Any) -> tuple[dict[str, str], str]:
    """A's names -> B's names, and the rule in words."""
    if rename is not None:
        if callable(rename):
            return {n: rename(n) for n in a}, "rename= (a function of A's names)"
        if isinstance(rename, Mapping):
            return {n: rename.get(n, n) for n in a}, "rename= (a dict, other names as they are)"
        raise TypeError(f"rename must be a callable or a dict, not {type(rename).__name__}")
    best = ({n: n for n in a}, "exact")
    b_set = set(b)
    score = sum(n in b_set for n in a)
    for prefix in COMMON_PREFIXES + _shared_prefixes(a, b):
        stripped = _strip(a, prefix)
        if stripped is not None:
            s = sum(v in b_set for v in stripped.values())
            if s > score:
                best, score = (stripped, f"{prefix!r} stripped from A's names"), s
        stripped_b = _strip(b, prefix)
        if stripped_b is not None:
            back = {v: k for k, v in stripped_b.items()}
            s = sum(n in back for n in a)
            if s > score:
                best, score = ({n: back.get(n, n) for n in a},
                               f"{prefix!r} stripped from B's names"), s
    return best


def _shared_prefixes(a: list[str], b: list[str]) -> tuple[str, ...]:
    """The first dotted component of every name on one side (a wrapper's prefix)."""
    out = []
    for names in (a, b):
        if names:
            head = names[0].split(".", 1)[0] + "."
            if all(n.startswith(head) for n in names) and head not in COMMON_PREFIXES:
                out.append(head)
    return tuple(out)


# -- values -----------------------------------------------------------------------------------
def dense_value(t: Any) -> tuple[Any, str]:
    """A tensor as the dense strided value to compare or measure, and how it was obtained:
    ``"values"`` (a dense tensor, as it is), ``"padded values"`` (nested, padded with 0),
    ``"dequantized values"``, ``"dense values"`` (sparse layouts)."""
    import torch

    if getattr(t, "is_nested", False):
        return torch.nested.to_padded_tensor(t, 0.0), "padded values"
    if t.is_quantized:
        return t.dequantize(), "dequantized values"
    if t.layout != torch.strided:
        return t.to_dense(), "dense values"
    return t, "values"


def _bytes_view(t: Any) -> Any:
    """A contiguous tensor's bytes as a flat tensor of 8-, 4- or 1-byte words (no copy where
    it is contiguous: comparing words is faster than comparing bytes)."""
    import torch

    t = t.detach().contiguous().reshape(-1)
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    for word, size in ((torch.int64, 8), (torch.int32, 4)):
        if raw.numel() % size == 0 and raw.data_ptr() % size == 0:
            return raw.view(word)
    return raw


def _raw(t: Any) -> bytes:
    view = _bytes_view(t)
    return view.numpy().tobytes() if view.numel() else b""  # (hashed for renames)


SLICE = 1 << 22  # elements compared in float64 at a time (32 MiB per side)


def _compare(ta: Any, tb: Any, atol: float, rtol: float) -> TensorDiff:
    import torch

    dtype = (str(ta.dtype).removeprefix("torch."), str(tb.dtype).removeprefix("torch."))
    shape = (tuple(ta.shape), tuple(tb.shape))
    va, how = dense_value(ta)
    vb, how_b = dense_value(tb)
    if how == how_b == "values" and dtype[0] == dtype[1] and shape[0] == shape[1] and \
            torch.equal(_bytes_view(ta), _bytes_view(tb)):
        nans = _nans(ta)
        return TensorDiff(True, dtype, shape, 0.0, 0.0, 1.0, 0, nans, nans, within=True)
    if va.shape != vb.shape:
        return TensorDiff(False, dtype, shape, compared=how)
    wide = torch.complex128 if va.is_complex() or vb.is_complex() else torch.float64
    fa, fb = va.detach().reshape(-1), vb.detach().reshape(-1)
    n_diff = nan_a = nan_b = 0
    max_abs = sa = sb = sd = 0.0
    dot = 0.0
    within = dtype[0] == dtype[1] and shape[0] == shape[1]
    for start in range(0, fa.numel(), SLICE):  # in slices: 32 MiB of float64 per side
        a = fa[start:start + SLICE].to(wide)
        b = fb[start:start + SLICE].to(wide)
        na_, nb_ = torch.isnan(a), torch.isnan(b)
        equal = (a == b) | (na_ & nb_)
        n_diff += int((~equal).sum())
        nan_a += int(na_.sum())
        nan_b += int(nb_.sum())
        ok = ~(na_ | nb_)
        a, b = a[ok], b[ok]
        delta = torch.where(a == b, torch.zeros_like(a), a - b)  # equal infinities: 0
        if delta.numel():
            max_abs = max(max_abs, float(delta.abs().max()))
        sa += float(torch.linalg.vector_norm(a)) ** 2
        sb += float(torch.linalg.vector_norm(b)) ** 2
        sd += float(torch.linalg.vector_norm(delta)) ** 2
        dot += float(torch.vdot(a, b).real if a.is_complex() else torch.dot(a, b)) \
            if a.numel() else 0.0
        if within:
            within = bool((equal[ok] | ((a - b).abs() <= atol + rtol * b.abs())).all()) and \
                bool((equal | ok).all())
    na, nb, nd = math.sqrt(sa), math.sqrt(sb), math.sqrt(sd)
    rel = 0.0 if nd == 0 else (math.inf if na == 0 else nd / na)
    cosine = 1.0 if na == 0 and nb == 0 else 0.0 if na == 0 or nb == 0 else dot / (na * nb)
    return TensorDiff(False, dtype, shape, max_abs, rel, cosine, n_diff, nan_a, nan_b,
                      within=within, compared=how)


def _nans(t: Any) -> int:
    """NaNs in ``t``: counted only where its sum is NaN (a NaN makes it one; one fast
    reduction instead of a mask in the usual case of none)."""
    import torch

    if not (t.is_floating_point() or t.is_complex()) or not t.numel():
        return 0
    total = t.sum()
    if not bool(torch.isnan(total).any()):
        return 0
    return int(torch.isnan(t).sum())


def _digest(ck: Any, name: str) -> str | None:
    """The sha256 of a tensor's bytes, None when it cannot be read."""
    try:
        t = ck.read(name)
    except Exception:  # a side that cannot be read is said, not raised
        return None
    return hashlib.sha256(_raw(t)).hexdigest()


def _renames(ck_a: Any, ck_b: Any, only_a: list[str], only_b: list[str]) -> dict[str, str]:
    """Tensors on one side only with the same dtype, shape and bytes as one on the other."""
    by_kind: dict[tuple[str, Any], list[str]] = {}
    for n in only_b:
        e = ck_b.tensors[n]
        by_kind.setdefault((e.dtype, e.shape), []).append(n)
    wanted = [n for n in only_a if (ck_a.tensors[n].dtype, ck_a.tensors[n].shape) in by_kind]
    if not wanted:
        return {}
    digests: dict[str, list[str]] = {}
    for names in by_kind.values():
        for n in names:
            d = _digest(ck_b, n)
            if d is not None:
                digests.setdefault(d, []).append(n)
    out = {}
    for n in wanted:
        d = _digest(ck_a, n)
        if d is not None and digests.get(d):
            out[n] = digests[d].pop(0)
    return out


def _open(x: Any) -> Any:
    from ckptlab.checkpoint import Checkpoint, open_checkpoint

    return x if isinstance(x, Checkpoint) else open_checkpoint(x)


def diff(a: Any, b: Any, *, rename: Callable[[str], str] | Mapping[str, str] | None = None,
         names: Callable[[str], bool] | None = None, atol: float = 0.0,
         rtol: float = 0.0) -> CheckpointDiff:
    """Compare two checkpoints of any formats, tensor by tensor (see the module docstring).

    Parameters
    ----------
    a, b
        Paths, URLs or :class:`~ckptlab.checkpoint.Checkpoint` objects.
    rename
        A's name -> B's name (a function or a dict), instead of the rule found.
    names
        Only compare A's tensors this is true for (and B's ones it is true for).
    atol, rtol
        Tolerances: a tensor is unchanged when every element is within ``atol + rtol *
        |b|`` of the other side's.

    Returns
    -------
    CheckpointDiff
    """
    ck_a, ck_b = _open(a), _open(b)
    keep = names or (lambda n: True)
    a_names = [n for n in ck_a.tensors if keep(n)]
    b_names = [n for n in ck_b.tensors if keep(n)]
    to_b, rule = _mapping(a_names, b_names, rename)
    b_set = set(b_names)
    common = [(n, to_b[n]) for n in a_names if to_b[n] in b_set]
    matched = {m for _, m in common}
    only_a = [n for n in a_names if to_b[n] not in b_set]
    only_b = [n for n in b_names if n not in matched]
    tensors = {}
    for na, nb in common:
        try:
            ta = ck_a.read(na)
            tb = ck_b.read(nb)
        except Exception as exc:  # said per tensor; the diff goes on
            ea, eb = ck_a.tensors[na], ck_b.tensors[nb]
            tensors[na] = TensorDiff(False, (ea.dtype, eb.dtype), (ea.shape, eb.shape),
                                     error=f"cannot be read: {exc}"[:300])
            continue
        tensors[na] = _compare(ta, tb, atol, rtol)
        del ta, tb
    renamed = _renames(ck_a, ck_b, only_a, only_b)
    return CheckpointDiff(ck_a.path, ck_b.path, rule, tuple(only_a), tuple(only_b), renamed,
                          tensors, atol, rtol)
