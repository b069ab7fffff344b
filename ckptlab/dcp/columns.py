"""DCP's ``.metadata`` into columns: one consumer of ckptlab's pickle interpreter.

A 1,000,000-item ``.metadata`` is about 130 MB of pickle. Turning it into DCP's own objects
(what ``pickle.load`` does, and what :func:`~ckptlab.dcp._decode.decode_metadata`'s
converter does) makes some ten Python objects per item: gigabytes, and tens of seconds.
Here the same interpreter (:func:`ckptlab.format._unpickle.interpreter`, compiled where
built, with :func:`ckptlab.dcp._decode.handlers`) runs the pickle, and the per-item records
never become objects: the three record classes there is one of per item
(``ChunkStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``) are built by handlers that
return a row number, and the ``BUILD`` that gives each its fields writes them into typed
arrays (:class:`_Rows`). What remains as records (``Metadata``, one
``TensorStorageMetadata`` and ``TensorProperties`` per tensor, ``StorageMeta``) is checked
field by field by :func:`_assemble`.

It is stricter than the converter, never more lenient: every check the converter makes on a
field is made here (types, ranges, field names, the globals the pickle names), and any shape
the columns do not represent (a chunk list that is not the chunks built for it in order, a
row used twice or never, storage entries anywhere but ``storage_data``) returns ``None``:
the caller then runs the converter, which accepts or refuses the file with its own message
(``tests/checkpoint/test_dcp_fast.py`` holds the two to the same values on real and mutated
files). Row numbers are floats (every check the converter makes on an int or a str refuses
them where a record does not belong) counted from a random 51-bit base drawn per call, so
no float a pickle writes can pass for a row either.
"""

from __future__ import annotations

import functools
import itertools
import secrets
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptlab.dcp._decode import (
    DTYPES,
    Layout,
    Size,
    foreign_global,
    handlers,
    record_state,
)
from ckptlab.format import _pickle
from ckptlab.format._unpickle import Global, PickleDataError, Reduced, interpreter

__all__ = ["EntryColumns", "MetadataColumns", "chunk_rows", "chunk_volumes", "decode_columns",
           "duplicate_keys"]

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_MAX_INDEX = (1 << 63) - 1
_MAX_PLAIN_DEPTH = 64
_SPAN = 1 << 40  # row numbers of one class: base + kind * _SPAN + row (floats, all exact)

# torch's aliases -> the names str(torch.<alias>) prints
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64",
                  "int": "int32", "short": "int16", "cfloat": "complex64",
                  "cdouble": "complex128", "chalf": "complex32"}
_MEMORY_FORMATS = frozenset({0, 1, 2, 3})  # torch's _MEM_FORMAT_ENCODING codes
_CHUNK, _INDEX, _INFO = 0, 1, 2
_INFO_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
# the columns, in :meth:`_Rows.columns` order: chunk ndim, start, values; entry fqn, index,
# ndim, offsets, index values; file, offset, length
_TYPECODES = ("b", "q", "q", "i", "q", "b", "q", "q", "i", "q", "q")
_COLUMNS = ("chunk_ndim", "chunk_start", "chunk_values", "entry_fqn", "entry_index",
            "entry_ndim", "entry_offsets", "index_values", "entry_file", "entry_offset",
            "entry_length")


def _typed(columns: tuple[Any, ...]) -> list[Any]:
    """The columns as typed sequences: arrays as they are, the compiled rows' bytearrays as
    memoryviews of their type (no copy)."""
    return [c if isinstance(c, array) else memoryview(c).cast(code)
            for c, code in zip(columns, _TYPECODES)]


class _GiveUp(PickleDataError):
    """Not a shape the columns represent: the converter decides."""


@dataclass(frozen=True, slots=True)
class MetadataColumns:
    """A DCP ``Metadata`` with its per-item records as arrays (see the module docstring).

    ``tensors`` is fqn -> (dtype name without ``torch.``, requires_grad, global shape, first
    chunk row, number of chunks); ``objects`` the fqns of ``BytesStorageMetadata`` entries,
    both in ``state_dict_metadata`` order. Chunk row ``c`` has ``chunk_ndim[c]`` offsets at
    ``chunk_values[chunk_start[c]:]`` followed by as many sizes. Storage entry ``e`` (in
    ``storage_data`` order) names ``fqns[entry_fqn[e]]``, chunk ``entry_index[e]`` (-1: None),
    offsets at ``index_values[entry_offsets[e]:]`` with ``entry_ndim[e]`` values
    (``entry_offsets[e] == -1``: None), and stores its bytes in ``files[entry_file[e]]`` at
    ``entry_offset[e]``, ``entry_length[e]`` bytes. ``transforms`` is True when some entry has
    ``transform_descriptors`` (the caller then takes the general path).
    """

    tensors: dict[str, tuple[str, bool, tuple[int, ...], int, int]]
    objects: tuple[str, ...]
    planner_data: Any
    storage_meta: dict[str, Any] | None
    version: str | None
    has_storage_data: bool
    chunk_ndim: array
    chunk_start: array
    chunk_values: array
    fqns: list[str]
    files: list[str]
    entry_fqn: array
    entry_index: array
    entry_ndim: array
    entry_offsets: array
    index_values: array
    entry_file: array
    entry_offset: array
    entry_length: array
    transforms: bool

    @property
    def entries(self) -> int:
        return len(self.entry_fqn)

    def chunk(self, row: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of chunk row ``row``."""
        n = self.chunk_ndim[row]
        s = self.chunk_start[row]
        values = self.chunk_values
        return tuple(values[s:s + n]), tuple(values[s + n:s + 2 * n])

    def entry_chunk_offsets(self, e: int) -> tuple[int, ...] | None:
        s = self.entry_offsets[e]
        if s < 0:
            return None
        return tuple(self.index_values[s:s + self.entry_ndim[e]])


class _Rows:
    """The per-item records as columns, filled by ``BUILD``: the Python implementation of
    the one interface :class:`ckptlab.format._interp.DcpRows` (``ckptlab/dcp/_rows.c``)
    compiles (``tests/dcp/test_columns.py`` runs against both).

    ``size`` is the ``torch.Size`` handler (:func:`ckptlab.dcp._decode.handlers`' rule);
    ``build`` the interpreter's ``build`` hook: ``target`` a row number (the float ``base +
    kind * span + row``), built once and in the order made, ``state`` its fields, checked
    as the converter checks them; anything else raises ``give_up``."""

    def __init__(self, base: float, span: float, size_type: type, data_error: type,
                 give_up: type) -> None:
        self.built = [0, 0, 0]
        self.fqn_ids: dict[str, int] = {}
        self.file_ids: dict[str, int] = {}
        self.transforms = False
        self.size = handlers()[("torch", "Size")]  # (Size, PickleDataError: the same types)
        self._cols = tuple(array(code) for code in _TYPECODES)
        self.build = self._hook(base, span, give_up)

    def columns(self) -> tuple[array, ...]:
        return self._cols

    def _hook(self, fbase: float, span: float, give_up: type) -> Callable[[Any, Any], None]:
        built = self.built
        fqn_ids, file_ids = self.fqn_ids, self.file_ids
        (chunk_ndim, chunk_start, chunk_values, key_fqn, key_index, key_ndim, key_offsets,
         index_values, info_file, info_offset, info_length) = self._cols
        index_fields, info_fields = frozenset(("fqn", "offset", "index")), frozenset(
            _INFO_FIELDS)
        refuse = give_up

        def build(target: Any, state: Any) -> None:
            if type(target) is not float:
                raise refuse  # a BUILD of something that is not a row
            row = target - fbase
            kind = _CHUNK if 0.0 <= row < span else _INDEX if span <= row < 2 * span else \
                _INFO if 2 * span <= row < 3 * span else -1
            if kind < 0 or row - kind * span != built[kind]:
                raise refuse  # not a row, or a row built twice or out of order
            built[kind] += 1
            if type(state) is not dict:
                state = record_state(state)
                if type(state) is not dict:
                    raise refuse
            if kind == _CHUNK:
                if len(state) != 2:
                    raise refuse
                offsets, sizes = state.get("offsets"), state.get("sizes")
                if type(offsets) is not Size or type(sizes) is not Size or \
                        len(offsets) != len(sizes):
                    raise refuse
                chunk_ndim.append(len(offsets))
                chunk_start.append(len(chunk_values))
                chunk_values.extend(offsets)
                chunk_values.extend(sizes)
            elif kind == _INDEX:
                fqn, offset, index = state.get("fqn"), state.get("offset"), state.get("index")
                if type(fqn) is not str or not state.keys() <= index_fields:
                    raise refuse
                if index is None:
                    index = -1
                elif type(index) is not int or not 0 <= index <= _MAX_INDEX:
                    raise refuse
                if offset is None:
                    key_ndim.append(0)
                    key_offsets.append(-1)
                elif type(offset) is Size:
                    key_ndim.append(len(offset))
                    key_offsets.append(len(index_values))
                    index_values.extend(offset)
                else:
                    raise refuse
                key_fqn.append(fqn_ids.setdefault(fqn, len(fqn_ids)))
                key_index.append(index)
            else:
                path, offset, length = (state.get("relative_path"), state.get("offset"),
                                        state.get("length"))
                if type(path) is not str or type(offset) is not int or \
                        type(length) is not int or not 0 <= offset <= _MAX_INDEX or \
                        not 0 <= length <= _MAX_INDEX or not state.keys() <= info_fields:
                    raise refuse
                descriptors = state.get("transform_descriptors")
                if descriptors is not None:
                    if type(descriptors) not in (list, tuple) or not all(
                            type(d) is str for d in descriptors):
                        raise refuse
                    if descriptors:
                        self.transforms = True  # (a closure of the instance)
                info_file.append(file_ids.setdefault(path, len(file_ids)))
                info_offset.append(offset)
                info_length.append(length)

        return build


class _Decoding:
    """One decode's row numbers: a random base, the handlers that make rows, and the rows
    (compiled where ckptlab's extension is built: the switch ``_pickle._IMPL``)."""

    def __init__(self) -> None:
        self.base = secrets.randbits(51)
        self.made = [itertools.count(float(self.base + kind * _SPAN)) for kind in range(3)]
        rows_type: Any = _Rows
        if _pickle._IMPL != "python":
            try:
                from ckptlab.format._interp import DcpRows as rows_type
            except ImportError:
                if _pickle._IMPL == "c":
                    raise
        self.rows = rows_type(float(self.base), float(_SPAN), Size, PickleDataError, _GiveUp)

    @property
    def built(self) -> list[int]:
        return self.rows.built

    def handlers(self) -> dict[tuple[str, str], Any]:
        table = handlers()
        table[("torch", "Size")] = self.rows.size
        table[(_MD, "ChunkStorageMetadata")] = self.made[_CHUNK].__next__
        table[(_MD, "MetadataIndex")] = self.made[_INDEX].__next__
        table[(_FS, "_StorageInfo")] = self.made[_INFO].__next__
        return table

    def kind(self, value: Any) -> tuple[int, int]:
        """(class, row) of a row number; (-1, -1) for any other value."""
        if type(value) is float and self.base <= value < self.base + 3 * _SPAN:
            kind, row = divmod(int(value) - self.base, _SPAN)
            if row < self.built[kind] and value == int(value):
                return kind, row
        return -1, -1

    def made_count(self, kind: int) -> int:
        return int(next(self.made[kind])) - self.base - kind * _SPAN


def _fields(value: Any, cls: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The fields of a record of class ``cls`` (the converter's ``fields``)."""
    if type(value) is not Reduced or value.func.qualname != cls or value.args or \
            value.kwargs or value.items or value.pairs:
        raise _GiveUp
    state = record_state(value.state)
    if type(state) is not dict or not all(type(k) is str and k in allowed for k in state):
        raise _GiveUp
    return state


def _plain(value: Any, rows: _Decoding, depth: int = 0) -> Any:
    """``planner_data``: str/int/float/bool/None/bytes in lists, tuples and dicts (a
    ``torch.Size`` as a tuple); a row (a record) is not plain."""
    kind = type(value)
    if kind in (str, int, bool, bytes) or value is None:
        return value
    if kind is float:
        if rows.kind(value)[0] >= 0:
            raise _GiveUp
        return value
    if kind is Size:
        return tuple(value)
    if depth >= _MAX_PLAIN_DEPTH:
        raise _GiveUp
    if kind in (list, tuple):
        return kind(_plain(v, rows, depth + 1) for v in value)
    if kind is dict:
        for k in value:
            if type(k) not in (str, int, bool, float, bytes, tuple) or (
                    type(k) is tuple and not all(type(e) in (str, int) for e in k)) or (
                    type(k) is float and rows.kind(k)[0] >= 0):
                raise _GiveUp
        return {k: _plain(v, rows, depth + 1) for k, v in value.items()}
    raise _GiveUp


def _properties(value: Any) -> tuple[str, bool]:
    """(dtype name, requires_grad) of a ``TensorProperties`` record."""
    if type(value) is not Reduced or value.func.qualname != f"{_MD}.TensorProperties" or \
            value.args or value.kwargs or value.items or value.pairs:
        raise _GiveUp
    state = value.state
    if type(state) is not tuple or len(state) != 5:
        raise _GiveUp
    dtype, layout, requires_grad, fmt, pin = state
    if type(dtype) is not Global or dtype.module != "torch" or dtype.name not in DTYPES:
        raise _GiveUp
    if type(layout) is not Layout or type(requires_grad) is not bool or type(pin) is not bool:
        raise _GiveUp
    if not (type(fmt) is Reduced and fmt.func.qualname == f"{_MD}._MEM_FORMAT_ENCODING" and
            len(fmt.args) == 1 and not fmt.kwargs and type(fmt.args[0]) is int and
            fmt.args[0] in _MEMORY_FORMATS):
        raise _GiveUp
    return _DTYPE_ALIASES.get(dtype.name, dtype.name), requires_grad


def _chunk_run(chunks: Any, rows: _Decoding, first_free: int) -> tuple[int, int]:
    """(first row, count) of a tensor's chunk list: the chunks built for it, in order."""
    if type(chunks) is not list:
        raise _GiveUp
    if not chunks:
        return 0, 0
    start = float(rows.base + _CHUNK * _SPAN + first_free)
    if chunks[0] != start or chunks != [start + i for i in range(len(chunks))] or \
            first_free + len(chunks) > rows.built[_CHUNK]:
        raise _GiveUp
    return first_free, len(chunks)


def _entries(storage_data: Any, rows: _Decoding) -> None:
    """Check that ``storage_data`` holds every key and info row, each once, paired in the
    order they were made (as ``pickle.dump`` writes a dict: each key, then its value); any
    other pairing is for the converter."""
    if type(storage_data) is not dict:
        raise _GiveUp
    n = len(storage_data)
    if n != rows.built[_INDEX] or n != rows.built[_INFO]:
        raise _GiveUp  # a row made but not an entry (or an entry that is not a row)
    index_base = float(rows.base + _INDEX * _SPAN)
    info_base = float(rows.base + _INFO * _SPAN)
    if list(storage_data) != [index_base + i for i in range(n)] or \
            list(storage_data.values()) != [info_base + i for i in range(n)]:
        raise _GiveUp


def _assemble(root: Any, rows: _Decoding) -> MetadataColumns:
    top = _fields(root, f"{_MD}.Metadata", ("state_dict_metadata", "planner_data",
                                           "storage_data", "storage_meta", "version"))
    sdm = top.get("state_dict_metadata")
    if type(sdm) is not dict:
        raise _GiveUp
    tensors: dict[str, tuple[str, bool, tuple[int, ...], int, int]] = {}
    objects = []
    next_chunk = 0
    for fqn, md in sdm.items():
        if type(fqn) is not str or type(md) is not Reduced:
            raise _GiveUp
        if md.func.qualname == f"{_MD}.BytesStorageMetadata":
            _fields(md, md.func.qualname, ())
            objects.append(fqn)
            continue
        f = _fields(md, f"{_MD}.TensorStorageMetadata", ("properties", "size", "chunks"))
        size = f.get("size")
        if type(size) is not Size:
            raise _GiveUp
        dtype, requires_grad = _properties(f.get("properties"))
        first, count = _chunk_run(f.get("chunks"), rows, next_chunk)
        next_chunk += count
        tensors[fqn] = (dtype, requires_grad, tuple(size), first, count)
    if next_chunk != rows.built[_CHUNK]:
        raise _GiveUp  # chunks built but in no tensor's list
    storage_data = top.get("storage_data")
    if storage_data is not None:
        _entries(storage_data, rows)
    elif rows.built[_INDEX] or rows.built[_INFO]:
        raise _GiveUp
    meta = top.get("storage_meta")
    storage_meta = None
    if meta is not None:
        f = _fields(meta, f"{_MD}.StorageMeta", ("checkpoint_id", "save_id", "load_id",
                                                 "modules"))
        for key in ("checkpoint_id", "save_id", "load_id"):
            if f.get(key) is not None and type(f.get(key)) is not str:
                raise _GiveUp
        modules = f.get("modules") or []
        if type(modules) is not list or not all(type(m) is str for m in modules):
            raise _GiveUp
        storage_meta = {"checkpoint_id": f.get("checkpoint_id"), "save_id": f.get("save_id"),
                        "load_id": f.get("load_id"), "modules": list(modules)}
    version = top.get("version")
    if version is not None and type(version) is not str:
        raise _GiveUp
    return MetadataColumns(
        tensors=tensors, objects=tuple(objects), planner_data=_plain(top.get("planner_data"), rows),
        storage_meta=storage_meta, version=version, has_storage_data=storage_data is not None,
        **dict(zip(_COLUMNS, _typed(rows.rows.columns()))), fqns=list(rows.rows.fqn_ids),
        files=list(rows.rows.file_ids), transforms=rows.rows.transforms)


def decode_columns(data: bytes | bytearray | memoryview | Any) -> MetadataColumns | None:
    """``.metadata`` bytes as :class:`MetadataColumns`, or None when they are not a DCP
    ``Metadata`` the columns represent (the caller then decodes them with the converter,
    which accepts or refuses them with its own error).

    ``data`` is any bytes-like object (an ``mmap`` of the file too: nothing is copied); it is
    only read.
    """
    rows = _Decoding()
    try:
        result = interpreter(_pickle._IMPL)(data, handlers=rows.handlers(),
                                            build=rows.rows.build)
        if result.end != len(data) or foreign_global(result.globals) is not None:
            return None
        if any(rows.made_count(kind) != rows.built[kind] for kind in range(3)):
            return None  # a record made and never given its fields
        return _assemble(result.root, rows)
    except (_GiveUp, PickleDataError, RecursionError, MemoryError):
        return None


# -- what the fast DCP paths (open, inspect) derive from the columns ---------------------------
def duplicate_keys(cols: Any, n: int) -> bool:
    """Whether two storage entries have equal ``MetadataIndex`` keys (fqn and offsets; the
    chunk index does not take part in equality): a 64-bit hash of each key, sorted; equal
    hashes (a real duplicate, or a collision) send the file to the general path."""
    import numpy as np

    if n < 2:
        return False
    fqn = np.frombuffer(cols.entry_fqn, dtype=np.int32).astype(np.uint64)
    ndim = np.frombuffer(cols.entry_ndim, dtype=np.int8)
    where = np.frombuffer(cols.entry_offsets, dtype=np.int64)
    values = np.frombuffer(cols.index_values, dtype=np.int64).view(np.uint64) if len(
        cols.index_values) else np.empty(0, np.uint64)
    with np.errstate(over="ignore"):
        h = (fqn + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        h ^= np.where(where < 0, np.uint64(0xFFFF), ndim.astype(np.uint64))
        for d in np.unique(ndim[where >= 0]):
            d = int(d)
            sel = np.nonzero((ndim == d) & (where >= 0))[0]
            for j in range(d):
                h[sel] = (h[sel] ^ values[where[sel] + j]) * np.uint64(0xBF58476D1CE4E5B9)
                h[sel] ^= h[sel] >> np.uint64(31)
    h.sort()
    return bool((h[1:] == h[:-1]).any())

class EntryColumns:
    """A directory's storage entries (``cols``: :class:`MetadataColumns`) as numpy arrays,
    with what the fast DCP paths (open, inspect, remote open) derive from them, each worked
    out once, when first asked for."""

    def __init__(self, cols: Any) -> None:
        import numpy as np

        n = cols.entries

        def column(buf: Any, dtype: Any) -> Any:
            return np.frombuffer(buf, dtype=dtype) if n else np.empty(0, dtype)

        self.cols = cols
        self.file_of = column(cols.entry_file, np.int32)
        self.offset = column(cols.entry_offset, np.int64)
        self.length = column(cols.entry_length, np.int64)
        self.fqn_of = column(cols.entry_fqn, np.int32)
        is_tensor = np.array([f in cols.tensors for f in cols.fqns], dtype=bool)
        self.tensor_item = is_tensor[self.fqn_of] if n else np.zeros(0, bool)

    @functools.cached_property
    def order(self) -> Any:
        """The entries in file, then offset order; None where the general path must decide
        from the columns alone: items that overlap (torch.save items lie back to back: an
        overlap means another serialization, SAFETENSORS items sharing their blob, or a
        damaged file) or equal keys (a dict keeps one of them: the general path reads it as
        Python does)."""
        import numpy as np

        cols, file_of, offset = self.cols, self.file_of, self.offset
        order = np.lexsort((offset, file_of))
        if cols.entries > 1:
            same = file_of[order][1:] == file_of[order][:-1]
            if (same & (offset[order][1:] < (offset + self.length)[order][:-1])).any():
                return None
        return None if duplicate_keys(cols, cols.entries) else order

    @functools.cached_property
    def rows(self) -> Any:
        """Entry -> its chunk row (:func:`chunk_rows`)."""
        return chunk_rows(self.cols, self.fqn_of, self.tensor_item)

    @functools.cached_property
    def volumes(self) -> Any:
        """Entry -> the volume of its chunk (the product of its sizes), as int64; -1 for an
        entry without a chunk row (object items) and where the product would not fit."""
        import numpy as np

        cols = self.cols
        out = np.full(cols.entries, -1, dtype=np.int64)
        have = np.nonzero(self.tensor_item & (self.rows >= 0))[0]
        if len(have):
            values = np.frombuffer(cols.chunk_values, dtype=np.int64) if len(
                cols.chunk_values) else np.empty(0, np.int64)
            start = np.frombuffer(cols.chunk_start, dtype=np.int64)
            ndim = np.frombuffer(cols.chunk_ndim, dtype=np.int8).astype(np.int64)
            for lo in range(0, len(have), 1 << 16):  # in slices: small temporaries
                some = have[lo:lo + (1 << 16)]
                used = self.rows[some]
                out[some] = chunk_volumes(values, start[used], ndim[used])
        return out


def chunk_volumes(values: Any, start: Any, ndim: Any) -> Any:
    """Per chunk row: the product of its sizes (``ndim[i]`` values after its offsets at
    ``values[start[i]:]``), as int64; -1 where the product would not fit (callers check those
    exactly)."""
    import numpy as np

    out = np.ones(len(start), dtype=np.int64)
    for d in np.unique(ndim):
        if d == 0:
            continue
        rows = np.nonzero(ndim == d)[0]
        block = values[start[rows, None] + d + np.arange(d)[None, :]]
        fits = np.log2(np.maximum(block, 1)).sum(axis=1) < 62
        out[rows] = np.where(fits, np.prod(np.where(fits[:, None], block, 1), axis=1), -1)
    return out


def chunk_rows(cols: Any, fqn_of: Any, tensor_item: Any) -> Any:
    """Entry -> its chunk's row, as the general path finds it: ``index`` when it is in range,
    else the chunk whose offsets are the entry's; -1 for none (and for object items)."""
    import numpy as np

    n = cols.entries
    rows = np.full(n, -1, dtype=np.int64)
    if not n:
        return rows
    first = np.zeros(len(cols.fqns), dtype=np.int64)
    count = np.zeros(len(cols.fqns), dtype=np.int64)
    for i, name in enumerate(cols.fqns):
        t = cols.tensors.get(name)
        if t is not None:
            first[i], count[i] = t[3], t[4]
    index = np.frombuffer(cols.entry_index, dtype=np.int64)
    ok = tensor_item & (index >= 0) & (index < count[fqn_of])
    rows[ok] = first[fqn_of[ok]] + index[ok]
    for e in np.nonzero(tensor_item & ~ok)[0]:  # rare: search by offsets
        e = int(e)
        want = cols.entry_chunk_offsets(e)
        if want is None:
            continue
        f = int(fqn_of[e])
        for r in range(int(first[f]), int(first[f] + count[f])):
            if cols.chunk(r)[0] == want:
                rows[e] = r
                break
    return rows
