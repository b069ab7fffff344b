"""What changed between two checkpoints, of any two formats: :func:`diff`.

Names are matched exactly, or through a prefix one side has on every name and the other does
not (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``, ``model.``...): the rule that
matches the most names wins (``rename=`` overrides it). Tensors left on one side with the
same dtype, shape and bytes as one on the other are ``renamed``.

Each common tensor is read once per side (its bytes only, no pickle run), into memory kept
from one tensor to the next: one tensor of each side in memory at a time, or one piece of
at most :data:`~ckptlab.compare._kernels.CHUNK_NBYTES` of it for a larger dense one
(:meth:`~ckptlab.checkpoint.Checkpoint.read_pieces`). Equal dtypes, shapes and bytes are
``identical`` without any float work (one pass takes their NaNs and norm). Otherwise
both sides are compared in their value (sparse tensors dense, quantized ones dequantized) in
float64 arithmetic: every value of both sides is held exactly (bool, integers up to 2**53;
complex tensors as pairs of a real and an imaginary part, each counted as an element), NaN
equal to NaN. ``n_diff`` counts the elements that differ; ``max_abs`` is the largest ``|a -
b|`` where neither side is NaN (equal infinities differ by 0); ``rel_l2`` is ``||a - b|| /
||a||`` (0 when both are zero, inf when only ``a`` is); ``cosine`` is ``a . b / (||a||
||b||)`` (1 when both are zero, 0 when one is); NaN positions are left out of the three
norms. ``nan_a`` / ``nan_b`` count NaNs. The element loops are
:mod:`ckptlab.compare._kernels` (NumPy, or compiled where built), over slices of at most
:data:`~ckptlab.compare._kernels.SLICE` elements shared among a few threads. A tensor is
*changed* when its shape differs or some element is farther than ``atol + rtol * |b|``
(``torch.isclose``'s rule: NaN equal to NaN, an infinity close only to itself); a tensor cast
to another dtype whose every value is within the tolerances is *within tolerance* (the
summary says its dtypes), so that ``diff(a, b, rtol=2**-8)`` accepts a bfloat16 copy of a
float32 checkpoint.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptlab.compare import _kernels
from ckptlab.compare._kernels import elements, kernels, kind_of, moments_of, on_threads, slices
from ckptlab.format._dtypes import DTYPE_ITEMSIZE

__all__ = ["CheckpointDiff", "TensorDiff", "diff", "step_diffs"]

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
    within: bool = False  # the same shape, every element within the tolerances
    compared: str = "bytes"  # "bytes", "values", "dense values", "dequantized values"
    error: str | None = None  # a side that could not be read, in words
    norm_a: float | None = None  # ||a||, ||b|| (NaN positions left out), where compared
    norm_b: float | None = None

    @property
    def changed(self) -> bool:
        return not self.identical and not self.within

    def to_dict(self) -> dict[str, Any]:
        return {"identical": self.identical, "dtype": list(self.dtype),
                "shape": [None if s is None else list(s) for s in self.shape],
                "max_abs": _number(self.max_abs), "rel_l2": _number(self.rel_l2),
                "cosine": _number(self.cosine), "n_diff": self.n_diff, "nan_a": self.nan_a,
                "nan_b": self.nan_b, "changed": self.changed, "compared": self.compared,
                "error": self.error, "norm_a": _number(self.norm_a),
                "norm_b": _number(self.norm_b)}


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
    b_names: dict[str, str] = field(default_factory=dict)  # A's name -> B's, where they differ

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

    def by_module(self, depth: int | None = None) -> list[tuple[str, float, int, int]]:
        """How far each module moved, in A's order: ``(module, rel_l2, changed, tensors)``,
        a module being a tensor's name without its last dotted component (cut to ``depth``
        components when given) and its ``rel_l2`` ``||a - b|| / ||a||`` over all its tensors
        together (so a bias that starts at zero does not make its layer infinitely changed;
        tensors of another dtype are compared in value); inf where one of its tensors changed
        shape or could not be read."""
        groups: dict[str, list[Any]] = {}
        for name, t in self.tensors.items():
            parts = name.split(".")[:-1]
            module = ".".join(parts[:depth] if depth else parts) or "(top)"
            g = groups.setdefault(module, [0.0, 0.0, 0, 0, False])
            g[2] += t.changed
            g[3] += 1
            if t.norm_a is None or t.rel_l2 is None:  # shape differs, or unreadable
                g[4] = True
                continue
            g[1] += t.norm_a ** 2
            g[0] += (t.rel_l2 * t.norm_a) ** 2 if t.norm_a and math.isfinite(t.rel_l2) else \
                0.0 if t.rel_l2 == 0 else (t.norm_b or 0.0) ** 2  # (a all zero: ||b||)
        out = []
        for module, (d2, a2, changed, n, broken) in groups.items():
            rel = math.inf if broken else 0.0 if d2 == 0 else math.inf if a2 == 0 else \
                math.sqrt(d2 / a2)
            out.append((module, rel, int(changed), int(n)))
        return out

    def largest(self, n: int = 10) -> list[tuple[str, TensorDiff]]:
        """The ``n`` most changed tensors: a different dtype or shape (or unreadable) first,
        then by relative change (``rel_l2``), then those all zero in A (``rel_l2`` inf) by
        ``max_abs``."""
        def key(item: tuple[str, TensorDiff]) -> tuple[int, int, float, float]:
            t = item[1]
            rel = t.rel_l2 if t.rel_l2 is not None and not math.isnan(t.rel_l2) else math.inf
            return (t.dtype[0] == t.dtype[1] and t.shape[0] == t.shape[1] and not t.error,
                    math.isinf(rel), -rel if math.isfinite(rel) else 0.0,
                    -(t.max_abs or 0.0))

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
        recast = [(n, t) for n, t in self.tensors.items()
                  if t.within and not t.identical and t.dtype[0] != t.dtype[1]]
        for name, t in recast[:10]:
            lines.append(f"  dtype    {name}: {t.dtype[0]} -> {t.dtype[1]}, the values within "
                         "tolerance")
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

    if t.is_quantized:  # its stored integers (a byte view of a quantized tensor crashes)
        t = t.int_repr()
    t = t.detach().contiguous().reshape(-1)
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    for word, size in ((torch.int64, 8), (torch.int32, 4)):
        if raw.numel() % size == 0 and raw.data_ptr() % size == 0:
            return raw.view(word)
    return raw


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two dense tensors are the same bytes: dtype, shape and every byte equal."""
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes_view(a),
                                                                     _bytes_view(b))


def _same_parts(ck_a: Any, name_a: str, ck_b: Any, name_b: str) -> bool:
    """Whether two sparse, quantized or nested tensors are stored alike: the same kind,
    layout and parameters (scale, zero point...) and each part's bytes equal."""
    ea, eb = ck_a.tensors[name_a], ck_b.tensors[name_b]
    roles = [p.role for p in ea.parts]
    if (ea.kind == "dense" or (ea.kind, ea.layout, ea.extra) != (eb.kind, eb.layout, eb.extra)
            or roles != [p.role for p in eb.parts]):
        return False
    return all(same_bytes(ck_a.read_part(name_a, r), ck_b.read_part(name_b, r)) for r in roles)


def _raw(t: Any) -> bytes:
    view = _bytes_view(t)
    return view.numpy().tobytes() if view.numel() else b""  # (hashed for renames)


def _pieces(ck: Any, name: str, most: int, scratch: Any) -> Iterator[tuple[Any, str]]:
    """Tensor ``name`` of ``ck`` as flat dense pieces of ``most`` elements (the last one
    shorter), each with how its value was obtained (:func:`dense_value`): read piece by piece
    where :meth:`~ckptlab.checkpoint.Checkpoint.read_pieces` can, else read whole and cut."""
    for piece in ck.read_pieces(name, most=most, scratch=scratch):
        value, how = dense_value(piece)
        flat = value.detach().reshape(-1)
        for start in range(0, max(flat.numel(), 1), most):
            yield flat[start:start + most], how


def _compare(ck_a: Any, name_a: str, ck_b: Any, name_b: str, atol: float, rtol: float,
             scratches: tuple[Any, Any] = (None, None), impl: str | None = None) -> TensorDiff:
    """Tensor ``name_a`` of ``ck_a`` against ``name_b`` of ``ck_b`` (see the module
    docstring), one piece of at most :data:`~ckptlab.compare._kernels.CHUNK_NBYTES` of each
    side in memory at a time:
    pieces with equal bytes count as equal without float work (only their NaNs and norm are
    taken, in one pass), the others are compared element by element."""
    import torch

    ea, eb = ck_a.tensors[name_a], ck_b.tensors[name_b]
    dtype = (ea.dtype, eb.dtype)
    shape = (ea.shape, eb.shape)
    if ea.shape != eb.shape and ea.shape is not None and eb.shape is not None:
        return TensorDiff(False, dtype, shape, compared="values")
    most = _kernels.piece_elements(max(DTYPE_ITEMSIZE.get(ea.dtype, 8),
                                       DTYPE_ITEMSIZE.get(eb.dtype, 8)))
    k = kernels(impl)
    n_diff = nan_a = nan_b = 0
    max_abs = sa = sb = sd = dot = 0.0
    within = True
    identical = True
    how = "values"
    pairs = itertools.zip_longest(_pieces(ck_a, name_a, most, scratches[0]),
                                  _pieces(ck_b, name_b, most, scratches[1]))
    for one, other in pairs:
        if one is None or other is None or one[0].numel() != other[0].numel():
            # dense values of another size (nested tensors: the shapes are in the bytes)
            return TensorDiff(False, dtype, shape, compared=(one or other)[1])
        (fa, how), (fb, how_b) = one, other
        if dtype[0] == dtype[1] and how == how_b == "values" and fa.dtype == fb.dtype and \
                torch.equal(_bytes_view(fa), _bytes_view(fb)):  # (no float work)
            nans, squares, infinite = _nans_and_squares(fa, k)
            nan_a, nan_b = nan_a + nans, nan_b + nans
            sa, sb = sa + squares, sb + squares
            dot += squares
            if infinite:
                sa = sb = dot = math.inf
            continue
        identical = False
        if fa.is_complex() or fb.is_complex():  # as pairs of reals: (re, im) side by side
            fa, fb = (torch.view_as_real(f.to(torch.complex128).resolve_conj()).reshape(-1)
                      for f in (fa, fb))
            how = how + " (complex as real and imaginary parts)"
        kind = "f" if kind_of(fa) == kind_of(fb) == "f" else "d"

        def part(span: tuple[int, int], fa: Any = fa, fb: Any = fb, kind: str = kind
                 ) -> tuple[Any, ...]:
            return k.compare(elements(fa[span[0]:span[1]], kind),
                             elements(fb[span[0]:span[1]], kind), kind, atol, rtol)

        for d, x, y, m, a2, b2, d2, ab, close in on_threads(part, slices(fa.numel())):
            n_diff, nan_a, nan_b = n_diff + d, nan_a + x, nan_b + y
            max_abs, sa, sb, sd, dot = max(max_abs, m), sa + a2, sb + b2, sd + d2, dot + ab
            within = within and close
    na, nb = math.sqrt(sa), math.sqrt(sb)
    if identical or (n_diff == 0 and _same_parts(ck_a, name_a, ck_b, name_b)):
        return TensorDiff(True, dtype, shape, 0.0, 0.0, 1.0, 0, nan_a, nan_b, within=True,
                          norm_a=na, norm_b=nb)
    nd = math.sqrt(sd)
    rel = 0.0 if nd == 0 else (math.inf if na == 0 else nd / na)
    cosine = 1.0 if na == 0 and nb == 0 else 0.0 if na == 0 or nb == 0 else dot / (na * nb)
    return TensorDiff(False, dtype, shape, max_abs, rel, cosine, n_diff, nan_a, nan_b,
                      within=within and shape[0] == shape[1], compared=how, norm_a=na,
                      norm_b=nb)


def _nans_and_squares(t: Any, k: Any) -> tuple[int, float, bool]:
    """NaNs in flat ``t``, the sum of the squares of its finite elements, and whether it
    holds an infinity: one pass (``moments``)."""
    import torch

    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj()).reshape(-1)
    found = moments_of(t, k)
    return found[0], found[7], found[1] > 0


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
    from ckptlab.checkpoint import Scratch, as_checkpoint

    ck_a, ck_b = as_checkpoint(a), as_checkpoint(b)
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
    scratches = (Scratch(), Scratch())  # one piece of each side at a time
    for na, nb in common:
        try:
            tensors[na] = _compare(ck_a, na, ck_b, nb, atol, rtol, scratches)
        except Exception as exc:  # said per tensor; the diff goes on
            ea, eb = ck_a.tensors[na], ck_b.tensors[nb]
            tensors[na] = TensorDiff(False, (ea.dtype, eb.dtype), (ea.shape, eb.shape),
                                     error=f"cannot be read: {exc}"[:300])
    renamed = _renames(ck_a, ck_b, only_a, only_b)
    return CheckpointDiff(ck_a.path, ck_b.path, rule, tuple(only_a), tuple(only_b), renamed,
                          tensors, atol, rtol, {na: nb for na, nb in common if na != nb})


def step_diffs(source: Any, **options: Any) -> list[tuple[str, str, CheckpointDiff]]:
    """Each complete save of a training run against the one before it: ``(earlier, later,
    diff)`` by save name, in the run's order. ``source`` is the run's local directory (any
    layout :func:`~ckptlab.checkpoint.runs.find_run` knows), its ``Run``, or a checkpoint
    opened from one; ``options`` go to :func:`diff`. Each save is opened once."""
    import os

    from ckptlab.checkpoint import Checkpoint, as_checkpoint
    from ckptlab.checkpoint.runs import RUN_LAYOUTS, Run, find_run
    from ckptlab.errors import UnsupportedFormatError

    if isinstance(source, Run):
        run = source
    elif isinstance(source, Checkpoint) and source.run is not None:
        run = source.run
    else:
        path = source.path if isinstance(source, Checkpoint) else os.fspath(source)
        run = find_run(path)
        if run is None:
            raise UnsupportedFormatError(
                f"not a training run's directory (saves side by side: {RUN_LAYOUTS})",
                path=path)
    saves = [s for s in run.steps if s.complete]
    opened = [as_checkpoint(os.path.join(run.path, s.name)) for s in saves]
    return [(saves[i].name, saves[i + 1].name, diff(opened[i], opened[i + 1], **options))
            for i in range(len(saves) - 1)]
