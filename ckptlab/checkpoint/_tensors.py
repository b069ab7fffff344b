"""Tensor entries from a scanned pickle, and tensors rebuilt from the bytes of their parts.

Building never runs the file's pickle: the parts' bytes are read with ``os.pread`` and turned
into tensors with torch's own constructors (``set_`` on a storage, ``sparse_coo_tensor``,
``_empty_affine_quantized``, ``_nested_view_from_buffer``, ``NestedTensor``), the way torch's
rebuild functions do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

from ckptlab import _torch_compat as tc
from ckptlab.checkpoint.model import Part, TensorEntry, span_nbytes, tensor_name
from ckptlab.errors import CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._bulk import columns, fields
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format.layout import StorageInfo

__all__ = ["LazyEntries", "build_tensor", "entries_from_logical", "part_tensor",
           "tensor_from_bytes", "unique_names"]

NJT = "torch.nested._internal.nested_tensor.NestedTensor"


def entries_from_logical(logical: Iterable[Any], storages: dict[str, StorageInfo], file: str,
                         *, prefix: tuple[Any, ...] = ()) -> list[TensorEntry]:
    """:class:`TensorEntry` for each ``ScannedTensor``; parts located through ``storages``."""
    logical = list(logical)
    if logical and set(map(len, map(_PARTS, logical))) == {1}:
        fast = _dense_entries(logical, storages, file, prefix)
        if fast is not None:
            return fast
    return [_entry(t, storages, file, prefix) for t in logical]


def _entry(t: Any, storages: dict[str, StorageInfo], file: str, prefix: tuple[Any, ...]
           ) -> TensorEntry:
    """The :class:`TensorEntry` of one ``ScannedTensor``."""
    parts = []
    for role, info in t.parts:
        if not info.storage_key:
            continue  # a meta tensor: no bytes
        storage = storages[info.storage_key]
        itemsize = DTYPE_ITEMSIZE[info.dtype]
        span = span_nbytes(info.shape, info.stride, itemsize)
        if span and info.storage_offset * itemsize + span > storage.nbytes:
            raise _outside_error(file, tensor_name((*prefix, *t.path)), storage,
                                 info.storage_offset, itemsize, span, info.shape, info.stride)
        parts.append(Part(role, file, storage.data_offset + info.storage_offset * itemsize,
                          span, info.dtype, info.shape, info.stride, info.storage_offset,
                          info.storage_key))
    path = (*prefix, *t.path)
    return TensorEntry(tensor_name(path), path, t.dtype, t.shape, t.stride, t.kind,
                       tuple(parts), t.layout, t.requires_grad, t.is_parameter, t.subclass,
                       t.extra)


class LazyEntries(Sequence[TensorEntry]):
    """:func:`entries_from_logical`'s list, made when first iterated or indexed, and single
    entries (:meth:`entry`) made on their own before that.

    :meth:`deferrable` says whether every entry can be made later without an error (dense
    tensors, one part each, of storages and dtypes that exist, with sizes and strides whose
    span is computable); where it cannot, callers make the list at once (:meth:`value`), which
    raises what :func:`entries_from_logical` raises. The names (:meth:`names`) are the entries'
    ``name`` fields, known without making them.
    """

    def __init__(self, logical: Iterable[Any], storages: dict[str, StorageInfo], file: str,
                 *, prefix: tuple[Any, ...] = ()) -> None:
        # a scan's dense tensors come with their fields as columns (DenseLogical): single
        # entries and the checks are made from those, without making the scanned objects
        self._cols = getattr(logical, "columns", None) if getattr(
            logical, "built", True) is False else None
        self._logical: Sequence[Any] = logical if self._cols is not None else list(logical)
        self._storages = storages
        self._file = file
        self._prefix = prefix
        self._value: list[TensorEntry] | None = None
        self._names: list[str] | None = None
        self._deferrable: bool | None = None  # deferrable()'s answer, once asked

    @property
    def built(self) -> bool:
        """Whether the list has been made."""
        return self._value is not None

    def deferrable(self) -> bool:
        """Whether :meth:`entry` and :meth:`value` cannot fail (checked once, on columns)."""
        if self._deferrable is None:
            self._deferrable = self._check_deferrable()
        return self._deferrable

    def _check_deferrable(self) -> bool:
        logical = self._logical
        if not logical:
            return True
        try:
            cols = self._cols
            if cols is not None:  # (column by column, without a set of 100,000 keys)
                storages = self._storages
                if "" in cols.keys or not all(map(storages.__contains__, cols.keys)) or \
                        set(map(type, cols.offsets)) - {int} or \
                        not set(cols.dtypes) <= DTYPE_ITEMSIZE.keys():
                    return False
                # span_nbytes cannot fail on tuples of ints, whatever they pair with
                for dims in (*set(cols.shapes), *set(cols.strides)):
                    if type(dims) is not tuple or set(map(type, dims)) - {int}:
                        return False
                itemsizes = list(map(DTYPE_ITEMSIZE.__getitem__, cols.dtypes))
                if _first_outside(cols.keys, cols.offsets, itemsizes, _span_sizes(
                        cols.shapes, cols.strides, itemsizes), storages) is not None:
                    return False
                self.names()
                return True
            if set(map(len, map(_PARTS, logical))) != {1}:
                return False
            infos = list(map(itemgetter(1), map(itemgetter(0), map(_PARTS, logical))))
            keys, dtypes = set(map(_KEY, infos)), set(map(_DTYPE, infos))
            offsets, spans = set(map(_OFFSET, infos)), set(map(_SPAN_FIELDS, infos))
            if "" in keys or not keys <= self._storages.keys() or \
                    not dtypes <= DTYPE_ITEMSIZE.keys() or \
                    not all(type(o) is int for o in offsets):
                return False
            for shape, stride, dtype in spans:
                if type(shape) is not tuple or type(stride) is not tuple:
                    return False
                span_nbytes(shape, stride, DTYPE_ITEMSIZE[dtype])
            itemsizes = [DTYPE_ITEMSIZE[i.dtype] for i in infos]
            if _first_outside(list(map(_KEY, infos)), list(map(_OFFSET, infos)), itemsizes,
                              _span_sizes([i.shape for i in infos], [i.stride for i in infos],
                                          itemsizes), self._storages) is not None:
                return False
            self.names()
        except Exception:  # whatever it is, making the entries now raises it as before
            return False
        return True

    def names(self) -> list[str]:
        """Every entry's name, in order."""
        if self._names is None:
            if self._value is not None:
                self._names = [e.name for e in self._value]
            else:
                prefix = self._prefix
                paths = list(self._cols.paths if self._cols is not None else
                             map(_PATH, self._logical))
                if prefix:
                    paths = [(*prefix, *p) for p in paths]
                try:  # when every key is a string, in one map (as _dense_entries names them)
                    if () in paths:
                        raise TypeError
                    self._names = list(map(".".join, paths))
                except TypeError:
                    self._names = list(map(tensor_name, paths))
        return self._names

    def entry(self, index: int) -> TensorEntry:
        """Entry ``index`` (made alone, equal to the list's; the list's once it is made)."""
        if self._value is not None:
            return self._value[index]
        cols = self._cols
        if cols is None:
            return _entry(self._logical[index], self._storages, self._file, self._prefix)
        # what _entry makes of the ScannedTensor of a dense tensor (see _pickle._scanned)
        key, dtype, shape, stride, offset, subclass = (
            cols.keys[index], cols.dtypes[index], cols.shapes[index], cols.strides[index],
            cols.offsets[index], cols.subclasses[index])
        itemsize = DTYPE_ITEMSIZE[dtype]
        part = Part("data", self._file, self._storages[key].data_offset + offset * itemsize,
                    span_nbytes(shape, stride, itemsize), dtype, shape, stride, offset, key)
        path = (*self._prefix, *cols.paths[index])
        return TensorEntry(self.names()[index], path, dtype, shape, stride,
                           "subclass" if subclass else "dense", (part,), "strided",
                           cols.grads[index], cols.params[index], subclass, ())

    def value(self) -> list[TensorEntry]:
        """Every entry (made on the first call, as :func:`entries_from_logical` makes them)."""
        if self._value is None:
            if self._cols is not None and self._deferrable:
                # the entries :meth:`entry` makes, all at once from the columns (the scanned
                # objects are never made)
                self._value = self._from_columns()
            else:
                self._value = entries_from_logical(self._logical, self._storages, self._file,
                                                   prefix=self._prefix)
        return self._value

    def _from_columns(self) -> list[TensorEntry]:
        """Every entry from the dense columns (checked by :meth:`deferrable`)."""
        from ckptlab.format._bulk import build

        cols = self._cols
        count = len(self._logical)
        storages = self._storages
        itemsizes = list(map(DTYPE_ITEMSIZE.__getitem__, cols.dtypes))
        nbytes = _span_sizes(cols.shapes, cols.strides, itemsizes)
        starts = [storages[key].data_offset for key in cols.keys]
        parts = build(Part, count, repeat("data"), repeat(self._file),
                      list(map(int.__add__, starts, map(int.__mul__, cols.offsets, itemsizes))),
                      nbytes, cols.dtypes, cols.shapes, cols.strides, cols.offsets, cols.keys)
        prefix = self._prefix
        paths = [(*prefix, *p) for p in cols.paths] if prefix else cols.paths
        kinds = ["subclass" if sub else "dense" for sub in cols.subclasses]
        return build(TensorEntry, count, self.names(), paths, cols.dtypes, cols.shapes,
                     cols.strides, kinds, [(p,) for p in parts], repeat("strided"), cols.grads,
                     cols.params, cols.subclasses, repeat(()))

    def __len__(self) -> int:
        return len(self._logical) if self._value is None else len(self._value)

    def __getitem__(self, index: Any) -> Any:
        return self.value()[index]

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self.value())


_PARTS = attrgetter("parts")
_PATH = attrgetter("path")
_KEY, _DTYPE, _OFFSET = attrgetter("storage_key"), attrgetter("dtype"), attrgetter("storage_offset")
_SPAN_FIELDS = attrgetter("shape", "stride", "dtype")
_INFO_NAMES = ("storage_key", "dtype", "shape", "stride", "storage_offset")
_TENSOR_NAMES = ("path", "dtype", "shape", "stride", "kind", "layout", "requires_grad",
                 "is_parameter", "subclass", "extra")


def _span_sizes(shapes: Iterable[Any], strides: Iterable[Any], itemsizes: Iterable[int]
                ) -> list[int]:
    """:func:`span_nbytes` of each (shape, stride, itemsize), each distinct one worked out
    once (a checkpoint has few)."""
    spans: dict[tuple[Any, ...], int] = {}
    out = []
    for shape, stride, itemsize in zip(shapes, strides, itemsizes):
        span = spans.get((shape, stride, itemsize))
        if span is None:
            span = spans[shape, stride, itemsize] = span_nbytes(shape, stride, itemsize)
        out.append(span)
    return out


def _first_outside(keys: Sequence[str], offsets: Sequence[int], itemsizes: Sequence[int],
                   spans: Sequence[int], storages: dict[str, StorageInfo]) -> int | None:
    """The first tensor whose elements reach past the end of its storage (torch's ``set_``
    refuses it: "Trying to resize storage that is not resizable"), or None. An empty view may
    start anywhere, as in torch."""
    for i, (key, offset, itemsize, span) in enumerate(zip(keys, offsets, itemsizes, spans)):
        if span and offset * itemsize + span > storages[key].nbytes:
            return i
    return None


def _outside_error(file: str, name: str, storage: StorageInfo, offset: int, itemsize: int,
                   span: int, shape: Any, stride: Any) -> CorruptArchiveError:
    return CorruptArchiveError(
        "tensor reaches past the end of its storage (torch.load refuses it)", path=file,
        record=name, offset=storage.data_offset,
        expected=f"<= {storage.nbytes} bytes of storage {storage.key!r}",
        actual=f"{offset * itemsize + span} bytes (offset {offset}, shape {shape}, stride "
               f"{stride})")


def _dense_entries(logical: list[Any], storages: dict[str, StorageInfo], file: str,
                   prefix: tuple[Any, ...]) -> list[TensorEntry] | None:
    """:func:`entries_from_logical` when every tensor has one part with a storage (dense
    tensors, the common case), built all at once; None for anything else."""
    from ckptlab.format._bulk import build

    return _dense_columns(logical, storages, file, prefix, build)


def _dense_columns(logical: list[Any], storages: dict[str, StorageInfo], file: str,
                   prefix: tuple[Any, ...], build: Any) -> list[TensorEntry] | None:
    """:func:`_dense_entries`' work."""
    count = len(logical)
    roles, infos = columns(list(map(itemgetter(0), map(_PARTS, logical))), 2)
    keys, dtypes, shapes, strides, offsets = fields(infos, _INFO_NAMES)
    if not all(keys):
        return None  # a meta tensor among them: no part
    located = list(map(storages.__getitem__, keys))
    itemsizes = list(map(DTYPE_ITEMSIZE.__getitem__, dtypes))
    nbytes = _span_sizes(shapes, strides, itemsizes)
    if _first_outside(keys, offsets, itemsizes, nbytes, storages) is not None:
        return None  # (_entry names the tensor)
    parts = build(Part, count, roles, repeat(file),
                  [s.data_offset + o * i for s, o, i in zip(located, offsets, itemsizes)],
                  nbytes, dtypes, shapes, strides, offsets, keys)
    (paths, t_dtypes, t_shapes, t_strides, kinds, layouts, grads, params, subclasses,
     extras) = fields(logical, _TENSOR_NAMES)
    if prefix:
        paths = tuple((*prefix, *p) for p in paths)
    try:  # tensor_name of every path; when they are all strings, in one map
        if () in paths:
            raise TypeError
        names = list(map(".".join, paths))
    except TypeError:
        names = list(map(tensor_name, paths))
    return build(TensorEntry, count, names, paths, t_dtypes, t_shapes, t_strides, kinds,
                 [(p,) for p in parts], layouts, grads, params, subclasses, extras)


def unique_names(entries: Iterable[TensorEntry]) -> dict[str, TensorEntry]:
    """Name -> entry; a name seen again (two paths rendering alike) gets ``#2``, ``#3``..."""
    import dataclasses

    out: dict[str, TensorEntry] = {}
    for e in entries:
        name, n = e.name, 1
        while name in out:
            n += 1
            name = f"{e.name}#{n}"
        out[name] = e if name == e.name else dataclasses.replace(e, name=name)
    return out


def torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedFormatError(f"dtype {name!r} is not in this torch ({torch.__version__})")
    return dtype


def tensor_from_bytes(raw: bytes | bytearray, dtype: str, shape: tuple[int, ...],
                      stride: tuple[int, ...]) -> Any:
    """A dense tensor viewing ``raw`` (its first element at byte 0) with shape and stride: on
    ``raw`` itself where it is writable memory read for it (a ``bytearray``, a slice of one),
    else on a copy."""
    import torch

    if isinstance(raw, memoryview) and not raw.readonly and raw.contiguous:
        buffer: Any = raw  # a slice of a bytearray read for this tensor: shared, not copied
    else:
        buffer = raw if isinstance(raw, bytearray) else bytearray(raw)
    storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage() if len(raw) \
        else torch.UntypedStorage(0)
    if dtype in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4"):
        tensor = tc.empty_affine_quantized()((0,), scale=1.0, zero_point=0,
                                             dtype=torch_dtype(dtype))
    else:
        tensor = torch.empty((0,), dtype=torch_dtype(dtype))
    return tensor.set_(storage, 0, shape, stride)


def part_tensor(part_bytes: Any, name_of: Any, part: Part) -> Any:
    """One part as a dense tensor (its own shape and stride), from ``part_bytes(part)``; a
    compressed part (a DCP item through ZStandard) is inflated, never past its chunk's bytes
    plus the torch.save framing (``name_of(file)``: the file as its errors name it)."""
    if part.compression is not None:
        from ckptlab.dcp.items import decode_compressed_chunk

        raw, stride = decode_compressed_chunk(
            part_bytes(part), part.compression, dtype=part.dtype, shape=part.shape,
            path=name_of(part.file), record=part.storage_key or part.role, offset=part.offset)
        return tensor_from_bytes(raw, part.dtype, part.shape, stride)
    return tensor_from_bytes(part_bytes(part), part.dtype, part.shape, part.stride)


def _assemble(entry: TensorEntry, part_bytes: Any, name_of: Any) -> Any:
    """A tensor saved in chunks: each DCP chunk copied into its box, each flat ``piece``
    (a run of elements of a DeepSpeed partition) to its row-major position."""
    import torch

    out = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    flat = out.view(-1)
    for p in entry.parts:
        chunk = part_tensor(part_bytes, name_of, p)
        if p.role == "piece":
            (at,) = p.chunk_offsets or (0,)
            flat[at:at + p.numel] = chunk
            continue
        box = tuple(slice(o, o + n) for o, n in zip(p.chunk_offsets or (), p.shape))
        out[box] = chunk
    if entry.requires_grad and (out.dtype.is_floating_point or out.dtype.is_complex):
        out.requires_grad_(True)
    return out


def build_tensor(entry: TensorEntry, part_bytes: Any, name_of: Any, *,
                 source: str = "") -> Any:
    """The tensor ``entry`` describes, from its parts' bytes (``part_bytes(part) -> bytes``,
    checked for length; ``name_of(file)``: the file as errors name it)."""
    import torch

    parts = {p.role: p for p in entry.parts}

    def part(role: str) -> Any:
        if role not in parts:
            raise CorruptArchiveError(f"tensor has no {role!r} part", path=source,
                                      record=entry.name)
        return part_tensor(part_bytes, name_of, parts[role])

    extra = dict(entry.extra)
    if entry.parts and all(p.chunk_offsets is not None for p in entry.parts):
        return _assemble(entry, part_bytes, name_of)
    if entry.kind in ("dense", "subclass") and entry.layout == "strided" and \
            list(parts) == ["data"]:
        tensor = part("data")
    elif not entry.parts and entry.kind == "dense" and extra.get("zeros"):
        tensor = torch.zeros(entry.shape, dtype=torch_dtype(entry.dtype))  # tensorizer's meta
    elif not entry.parts and entry.kind == "dense":  # a meta tensor: no bytes in the file
        tensor = torch.empty_strided(entry.shape, entry.stride, dtype=torch_dtype(entry.dtype),
                                     device="meta")
    elif entry.kind == "sparse":
        size = entry.shape
        if entry.layout == "sparse_coo":
            tensor = torch.sparse_coo_tensor(part("indices"), part("values"), size,
                                             check_invariants=False,
                                             is_coalesced=extra.get("is_coalesced"))
        else:
            row = entry.layout in ("sparse_csr", "sparse_bsr")
            tensor = torch.sparse_compressed_tensor(
                part("crow_indices" if row else "ccol_indices"),
                part("col_indices" if row else "row_indices"), part("values"), size,
                layout=getattr(torch, entry.layout), check_invariants=False)
    elif entry.kind == "quantized":
        data = parts["data"]
        raw = part_bytes(data)
        storage = torch.frombuffer(bytearray(raw), dtype=torch.uint8).untyped_storage() \
            if raw else torch.UntypedStorage(0)
        dtype = torch_dtype(entry.dtype)
        scheme = extra["qscheme"]
        if scheme == "per_tensor_affine":
            tensor = tc.empty_affine_quantized()(data.shape, scale=extra["scale"],
                                                 zero_point=extra["zero_point"], dtype=dtype)
        else:
            scales = part("scales") if "scales" in parts else torch.tensor(
                extra["scales"], dtype=torch.double if scheme == "per_channel_affine"
                else torch.float)
            zero_points = part("zero_points") if "zero_points" in parts else torch.tensor(
                extra["zero_points"], dtype=torch.long if scheme == "per_channel_affine"
                else torch.float)
            tensor = tc.empty_per_channel_affine_quantized()(
                data.shape, scales=scales, zero_points=zero_points, axis=extra["axis"],
                dtype=dtype)
        tensor.set_(storage, 0, data.shape, data.stride)
    elif entry.kind == "nested" and entry.layout == "strided":
        tensor = tc.nested_view_from_buffer()(part("buffer"), part("nested_sizes"),
                                              part("nested_strides"), part("storage_offsets"))
    elif entry.kind == "nested" and entry.layout == "jagged" and entry.subclass == NJT:
        NestedTensor = tc.nested_tensor_class()

        cache = {k: part(k) for k in ("min_seqlen", "max_seqlen") if k in parts}
        tensor = NestedTensor(values=part("values"), offsets=part("offsets"),
                              lengths=part("lengths") if "lengths" in parts else None,
                              _ragged_idx=extra.get("ragged_idx", 1), _metadata_cache=cache)
    else:
        raise UnsupportedFormatError(
            f"{entry.kind} tensor of {entry.subclass or entry.layout}: ckptlab never imports a "
            "class a file names; read its parts with Checkpoint.read_part(name, role)",
            path=source, record=entry.name)
    if extra.get("conj"):  # saved with the conjugate bit: torch.load's tensor is the view
        tensor = tensor.conj()
    if extra.get("neg"):  # and with the negative bit
        tensor = tc.neg_view()(tensor)
    if entry.requires_grad and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        raise CorruptArchiveError(
            f"a {entry.dtype} tensor that requires grad: torch allows that only for floating "
            "point and complex tensors (torch.load fails on it too)", path=source,
            record=entry.name)
    if entry.requires_grad:
        tensor.requires_grad_(True)
    if entry.is_parameter:
        tensor = torch.nn.Parameter(tensor, requires_grad=entry.requires_grad)
    return tensor
