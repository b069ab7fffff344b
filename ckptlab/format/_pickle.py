"""torch's pickles read safely: which storages, which tensors, and what else the file holds.

:func:`scan_pickle` runs a torch pickle through ckptlab's bounded interpreter
(:mod:`ckptlab.format._unpickle`: it never imports or runs anything) with torch's handlers
(:mod:`ckptlab.format._torch_handlers`), which make inert records
(:mod:`ckptlab.format._tensor_refs`) instead of dense, sparse, quantized, nested and
wrapper-subclass tensors. It then walks the result (:mod:`ckptlab.format._pickle_walk`), which
names every tensor by its path from the root object, the way ``torch.load`` would reach it
(``dd['k']`` for a ``defaultdict``), and collects the non-tensor values beside them.

The scan (:class:`PickleScan`) holds each tensor as a user knows it (:class:`ScannedTensor`)
and the storage-backed tensors they are made of (:class:`~ckptlab.format.layout.TensorInfo`);
where every tensor is dense, both are made when first looked at, from columns of fields
(:class:`DenseLogical`, :class:`DenseColumns`). :data:`_IMPL` picks the implementation a scan
uses, of the interpreter, the handlers and the walk alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

from ckptlab.errors import CorruptArchiveError
from ckptlab.format._bulk import LazyTuple, build, columns, fields
from ckptlab.format._pickle_walk import _walk
from ckptlab.format._tensor_refs import _DENSE, StorageRef, _TensorRef
from ckptlab.format._torch_handlers import _TorchHandlers, torch_handlers
from ckptlab.format._unpickle import (
    PickleBudgetError,
    PickleDataError,
    failure_offset,
    interpreter,
)
from ckptlab.format.layout import TensorInfo

__all__ = ["PickleScan", "ScannedTensor", "scan_pickle"]


@dataclass(frozen=True, slots=True)
class ScannedTensor:
    """One tensor as a user knows it, with the storage-backed tensors it is made of.

    ``parts`` pairs a role (``"data"`` for a dense tensor; ``"indices"``/``"values"``,
    ``"crow_indices"``, ``"scales"``, ``"buffer"``, an attribute name, ...) with a
    :class:`TensorInfo` whose ``path`` is this tensor's path plus the role for composites.
    """

    path: tuple[Any, ...]
    kind: str  # dense | sparse | quantized | nested | subclass
    dtype: str
    shape: tuple[int, ...] | None  # None where only the bytes know it (strided nested)
    stride: tuple[int, ...] | None
    requires_grad: bool
    is_parameter: bool
    layout: str  # torch layout name without prefix: strided, sparse_coo, sparse_csr, jagged...
    parts: tuple[tuple[str, TensorInfo], ...]
    subclass: str | None = None  # qualified name of a Tensor subclass
    extra: tuple[tuple[str, Any], ...] = ()  # qscheme, scale, zero_point, axis, ragged_idx...


@dataclass(frozen=True, slots=True)
class PickleScan:
    """What a scan of a torch pickle found."""

    storages: tuple[StorageRef, ...]  # in first-encounter (pickle) order
    tensors: tuple[TensorInfo, ...]  # storage-backed tensors (composites' parts too), walk order
    protocol: int
    globals: tuple[str, ...]  # every global the pickle named, in order (module.name)
    root: Any  # the scanned object tree: containers, inert records, plain values
    logical: tuple[ScannedTensor, ...] = ()  # every tensor as a user knows it, walk order
    objects: tuple[tuple[tuple[Any, ...], Any], ...] = ()  # (path, value) of non-tensor values


def _info(path: tuple[Any, ...], t: _TensorRef) -> TensorInfo:
    return TensorInfo(path, t.storage.key if t.storage is not None else "", t.dtype, t.shape,
                      t.stride, t.storage_offset, t.requires_grad, t.is_parameter)


def _scanned(path: tuple[Any, ...], ref: Any) -> ScannedTensor:
    if isinstance(ref, _DENSE):
        return ScannedTensor(path, "subclass" if ref.subclass else "dense", ref.dtype, ref.shape,
                             ref.stride, ref.requires_grad, ref.is_parameter, "strided",
                             (("data", _info(path, ref)),), ref.subclass,
                             getattr(ref, "metadata", ()))
    parts = tuple((role, _info((*path, role), p)) for role, p in ref.parts)
    return ScannedTensor(path, ref.kind, ref.dtype, ref.shape, ref.stride, ref.requires_grad,
                         False, ref.layout, parts, ref.subclass, tuple(ref.extra.items()))


_DENSE_NAMES = ("storage", "dtype", "shape", "stride", "storage_offset", "requires_grad",
                "is_parameter", "subclass")


_METADATA = attrgetter("metadata")


def _logical(found: list[tuple[tuple[Any, ...], Any]]
             ) -> tuple[tuple[ScannedTensor, ...], tuple[TensorInfo, ...]]:
    """:func:`_scanned` of every tensor found, and the storage-backed tensors among their parts.

    Dense tensors (most checkpoints hold nothing else) are built all at once, field by field
    (:func:`ckptlab.format._bulk.build`); anything else one by one.
    """
    if not found or set(map(type, map(itemgetter(1), found))) != {_TensorRef} or \
            any(map(_METADATA, map(itemgetter(1), found))):
        logical = tuple(_scanned(p, ref) for p, ref in found)
        return logical, tuple(info for t in logical for _, info in t.parts
                              if info.storage_key or t.kind == "dense")
    count = len(found)
    paths, refs = columns(found, 2)
    (storages, dtypes, shapes, strides, offsets, grads, params,
     subclasses) = fields(refs, _DENSE_NAMES)
    keys = [s.key if s is not None else "" for s in storages]
    cols = DenseColumns(paths, keys, dtypes, shapes, strides, offsets, grads, params,
                        subclasses)
    plain = not any(subclasses)
    kept = count if plain else sum(1 for k, s in zip(keys, subclasses) if k or not s)

    def make_infos() -> list[TensorInfo]:
        return build(TensorInfo, count, paths, keys, dtypes, shapes, strides, offsets, grads,
                     params)

    every_info = LazyTuple(count, make_infos)

    def make_logical() -> list[ScannedTensor]:
        kinds = repeat("dense") if plain else ["subclass" if s else "dense" for s in subclasses]
        return build(ScannedTensor, count, paths, kinds, dtypes, shapes, strides, grads,
                     params, repeat("strided"),
                     [(("data", info),) for info in every_info.value()], subclasses, repeat(()))

    def make_kept() -> tuple[TensorInfo, ...]:
        return tuple(info for info, s in zip(every_info.value(), subclasses)
                     if info.storage_key or not s)

    # made when first looked at (the layout of 100,000 tensors need not hold 200,000 objects
    # nobody asked for); the scanned tensors hold the same TensorInfo objects as the tensors
    logical = DenseLogical(count, make_logical, cols)
    return logical, every_info if plain else LazyTuple(kept, make_kept)  # type: ignore[return-value]


class DenseColumns:
    """The fields of dense tensors found by a scan, one list per field, in walk order (what
    :class:`ScannedTensor` and :class:`TensorInfo` objects are made from)."""

    __slots__ = ("dtypes", "grads", "keys", "offsets", "params", "paths", "shapes", "strides",
                 "subclasses")

    def __init__(self, paths: Sequence[Any], keys: list[str], dtypes: Sequence[str],
                 shapes: Sequence[Any], strides: Sequence[Any], offsets: Sequence[int],
                 grads: Sequence[bool], params: Sequence[bool],
                 subclasses: Sequence[str | None]) -> None:
        self.paths = paths
        self.keys = keys
        self.dtypes = dtypes
        self.shapes = shapes
        self.strides = strides
        self.offsets = offsets
        self.grads = grads
        self.params = params
        self.subclasses = subclasses


class DenseLogical(LazyTuple[ScannedTensor]):
    """``PickleScan.logical`` of dense tensors: the :class:`ScannedTensor` objects made when
    first used, and their fields as columns (:attr:`columns`) before that."""

    __slots__ = ("columns",)

    def __init__(self, count: int, make: Callable[[], Any], columns: DenseColumns) -> None:
        super().__init__(count, make)
        self.columns = columns


PersistentLoad = Callable[[Any], Any]


def scan_pickle(data: bytes, *, path: str = "<bytes>", record: str = "data.pkl",
                data_offset: int = 0,
                persistent_load: Callable[[Any], PersistentLoad] | None = None,
                handlers: dict[tuple[str, str], Any] | None = None) -> PickleScan:
    """Interpret a torch pickle without importing or calling anything it names.

    Parameters
    ----------
    data
        The bytes of ``data.pkl`` (or any torch pickle whose storages are persistent ids).
    path, record, data_offset
        Where the bytes came from, for error messages (offsets are reported in the file).
    persistent_load
        Makes the persistent-id reader from the scan's handler state (its storage table):
        ``persistent_load(state) -> (pid -> object)``. Default: torch.save's
        ``('storage', cls, key, location, numel)`` ids. Legacy files use six fields.
    handlers
        Global handlers ``{(module, name): callable}`` added to (or replacing) torch's, e.g.
        TorchScript's ``restore_type_tag``.

    Returns
    -------
    PickleScan
        Storages in pickle order, tensors with their paths from the root object.

    Raises
    ------
    CorruptArchiveError
        The pickle is malformed, truncated, over budget, or rebuilds tensors from nonsense.
    """
    return _scan(data, path, record, data_offset, persistent_load, handlers)[0]


def scan_pickle_refs(data: bytes, *, path: str, record: str, data_offset: int,
                     persistent_load: Callable[[Any], PersistentLoad] | None = None,
                     handlers: dict[tuple[str, str], Any] | None = None
                     ) -> tuple[PickleScan, tuple[Any, ...]]:
    """:func:`scan_pickle`, and the tensor record behind each ``scan.logical`` entry (the
    objects in ``scan.root``), so a caller that walks the root itself can find the entry of
    each tensor it meets (legacy, TorchScript and pt2 readers)."""
    scan, found = _scan(data, path, record, data_offset, persistent_load, handlers)
    return scan, tuple(ref for _, ref in found)


def _interpret(data: bytes, persistent_load: Callable[[Any], PersistentLoad] | None,
               extra_handlers: dict[tuple[str, str], Any] | None
               ) -> tuple[_TorchHandlers, Any]:
    """The interpreter (:func:`ckptlab.format._unpickle.interpreter`) with new torch handlers
    (:func:`torch_handlers`; and ``extra_handlers``), both of the implementation :data:`_IMPL`
    names."""
    impl = _IMPL
    handlers, table = torch_handlers(impl)
    if extra_handlers:
        table.update(extra_handlers)
    load = handlers.load_pid if persistent_load is None else persistent_load(handlers)
    return handlers, interpreter(impl)(data, handlers=table, persistent_load=load,
                                       build=handlers.build)


# Which implementation scans use, of the interpreter and the torch handlers alike: "python",
# "c" or None (the compiled ones where ckptlab's extension is built). One switch, for tests.
_IMPL: str | None = None


def _scan(data: bytes, path: str, record: str, data_offset: int,
          persistent_load: Callable[[Any], PersistentLoad] | None,
          extra_handlers: dict[tuple[str, str], Any] | None
          ) -> tuple[PickleScan, list[tuple[tuple[Any, ...], Any]]]:
    try:
        handlers, result = _interpret(data, persistent_load, extra_handlers)
        found, values = _walk(result.root, _IMPL)
    except PickleDataError as exc:
        kind = "is over ckptlab's budget" if isinstance(exc, PickleBudgetError) \
            else "cannot be interpreted"
        raise CorruptArchiveError(f"the pickle {kind}: {exc}", path=path, record=record,
                                  offset=data_offset + failure_offset(exc)) from None
    except TypeError as exc:  # a persistent-id reader called with arguments it does not take
        raise CorruptArchiveError(f"the pickle calls a torch function with arguments it does "
                                  f"not take: {str(exc)[:120]}", path=path, record=record,
                                  offset=data_offset) from None
    if result.end != len(data):
        raise CorruptArchiveError("bytes after the pickle's STOP opcode", path=path,
                                  record=record, offset=data_offset + result.end,
                                  expected=f"{len(data)} bytes of pickle",
                                  actual=f"STOP at byte {result.end}")
    logical, tensors = _logical(found)
    storages = tuple(map(handlers.storages.__getitem__, handlers.storage_order))
    if not isinstance(values, LazyTuple):  # (a module's are listed when first looked at)
        values = tuple(values)
    return PickleScan(storages, tensors, result.protocol, tuple(result.globals), result.root,
                      logical, values), found
