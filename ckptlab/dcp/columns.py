"""DCP's ``.metadata`` straight into columns: the fast path of :mod:`._decode`.

A 1,000,000-item ``.metadata`` is about 135 MB of pickle. Turning it into DCP's own objects
(what ``pickle.load`` does, and what :func:`~ckptlab.dcp._decode.decode_metadata`
does after its bounded interpreter) makes some ten Python objects per item: gigabytes, and tens
of seconds. This module reads the opcodes ``pickle.dump`` writes for a ``Metadata`` (protocol
4 or 5: ``MEMOIZE``, ``STACK_GLOBAL``, ``NEWOBJ`` + ``BUILD`` of dataclasses, ``torch.Size``
reduced from a tuple of ints) with a loop of its own and keeps the per-item records as typed
arrays, not objects: each chunk's offsets and sizes, each storage entry's fqn, chunk index,
offsets, file, offset and length.

It is a *recogniser*, stricter than the interpreter, never more lenient:

- nothing is imported or called; globals are names, and only DCP's metadata classes,
  ``torch.Size``, ``torch.<dtype>``, ``torch.serialization._get_layout``,
  ``_MEM_FORMAT_ENCODING``, ``collections.OrderedDict`` and ``pathlib`` paths are accepted;
- every opcode outside the small set ``pickle.dump`` writes for DCP metadata, every type or
  shape of value DCP would not write, a memo reference to something it did not keep (it keeps
  names and small values, never the per-item records), a dict key that is not a str or int,
  more than :data:`MAX_INT_NBYTES`-byte ints... makes it give up and return ``None``;
- declared lengths are checked against the bytes left before they are read; the stack, memo
  and columns grow at most linearly in the input (a few bytes of columns per input byte).

The per-item records (``ChunkStorageMetadata``; ``MetadataIndex`` + ``_StorageInfo`` pairs)
repeat one shape. The first ones are matched one at a time by a regular expression whose
class and field-name refs are then made literal; after that, runs of them are read many at a
time with numpy (:func:`_vector`): every candidate record in a window of bytes is parsed from
its start by vectorised steps (each constant byte compared, refs and ints decoded by their
opcode), and only the prefix that chains record to record (FRAME headers between two
opcodes, and pickle's SETITEMS/APPENDS + MARK batch breaks, applied as the opcode loop applies
them) is taken; a record the steps do not accept goes to the regular expression and the
opcode loop, as before. ``decode_columns(data, vectorised=False)`` is the one-at-a-time path:
the two give equal columns, or both None, on every input
(``tests/dcp/test_columns_vector.py``).

``None`` means "not the plain shape this fast path knows": the caller then runs the bounded
interpreter and the field-by-field converter, which accept or refuse the file with their own
messages. So a hostile file gets exactly the errors it got before, and a file accepted here
decodes to the same values the converter gives (``tests/checkpoint/test_dcp_fast.py`` checks
both on real and mutated files).
"""

from __future__ import annotations

import functools
import re
import struct
from array import array
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptlab.dcp._decode import DTYPES as _DTYPES
from ckptlab.dcp._decode import LAYOUTS as _LAYOUTS
from ckptlab.format._unpickle import PATH_CLASSES, canonical_global, path_value

__all__ = ["EntryColumns", "MetadataColumns", "chunk_rows", "chunk_volumes", "decode_columns",
           "duplicate_keys"]

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_MAX_INDEX = (1 << 63) - 1
MAX_INT_NBYTES = 8
_MAX_PLAIN_DEPTH = 64

# torch's aliases -> the names str(torch.<alias>) prints
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64",
                  "int": "int32", "short": "int16", "cfloat": "complex64",
                  "cdouble": "complex128", "chalf": "complex32"}
_CLASSES = frozenset({f"{_MD}.Metadata", f"{_MD}.TensorStorageMetadata",
                      f"{_MD}.BytesStorageMetadata", f"{_MD}.ChunkStorageMetadata",
                      f"{_MD}.TensorProperties", f"{_MD}.MetadataIndex", f"{_MD}.StorageMeta",
                      f"{_FS}._StorageInfo"})
_CALLABLES = frozenset({"torch.Size", "torch.serialization._get_layout",
                        f"{_MD}._MEM_FORMAT_ENCODING", "collections.OrderedDict",
                        *(f"pathlib.{cls}" for cls in PATH_CLASSES)})
_CHUNK = f"{_MD}.ChunkStorageMetadata"
_INDEX = f"{_MD}.MetadataIndex"
_INFO = f"{_FS}._StorageInfo"
_HOT = frozenset({_CHUNK, _INDEX, _INFO})  # one per item: kept as rows, never memoised

_u16 = struct.Struct("<H").unpack_from
_u32 = struct.Struct("<I").unpack_from
_i32 = struct.Struct("<i").unpack_from
_u64 = struct.Struct("<Q").unpack_from
_f64 = struct.Struct(">d").unpack_from


class _GiveUp(Exception):
    """Not the plain shape the fast path reads: let the bounded interpreter decide."""


class _Global:
    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname


class _Size(tuple):  # type: ignore[type-arg]
    """``torch.Size(...)`` as the pickle builds it: a tuple of non-negative ints."""

    __slots__ = ()


class _Obj:
    __slots__ = ("cls", "state")

    def __init__(self, cls: str) -> None:
        self.cls = cls
        self.state: Any = None


class _Row:
    """One per-item record: a chunk stored as column row ``n``, or the checked fields of a
    ``MetadataIndex`` / ``_StorageInfo`` waiting for their ``storage_data`` pair."""

    __slots__ = ("cls", "fields", "n")

    def __init__(self, cls: str, n: int, fields: tuple[Any, ...] = ()) -> None:
        self.cls = cls
        self.n = n
        self.fields = fields


class _Layout:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _MemFormat:
    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code


class _Dict(dict):  # type: ignore[type-arg]
    """A pickled dict; storage entries (index -> info) go to the columns, not the dict, and
    mark it (``pairs``) as ``storage_data``."""

    __slots__ = ("pairs",)

    def __init__(self) -> None:
        super().__init__()
        self.pairs: object | None = None


class _List(list):  # type: ignore[type-arg]
    """A pickled list; chunk rows go to ``rows`` (as a run), not the list."""

    __slots__ = ("count", "first")

    def __init__(self) -> None:
        super().__init__()
        self.first = -1
        self.count = 0


class _Run:
    """``count`` consecutive per-item records on the stack as one value: chunk rows
    ``first..first+count`` (for a chunks list) or storage entries already in the columns
    (for the ``storage_data`` dict)."""

    __slots__ = ("cls", "count", "first")

    def __init__(self, cls: str, first: int, count: int) -> None:
        self.cls = cls
        self.first = first
        self.count = count


_PAIR = "storage_data pair"
_PAIRS = object()
_MARK = object()

# -- whole records in one regular-expression match ----------------------------------------
# The records ``pickle.dump`` repeats once per item, once their class and field names are in
# the memo (every record after the first): matched in one step, checked as the loop checks
# them, with the memo count advanced by the MEMOIZEs they hold. Anything else, and any match
# that would run across a frame boundary, goes through the opcode loop.
_REF = rb"(h.|j.{4})"
_INTB = rb"K.|M..|J.{4}|" + b"|".join(rb"\x8a\x%02x.{%d}" % (k, k) for k in range(1, 9))
_INT = rb"(" + _INTB + rb")"
_SIZE_ARGS = (rb"(?:\)|((?:" + _INTB + rb"){1,3}[\x85\x86\x87])\x94|\(((?:" + _INTB +
              rb")*)t\x94)\x85\x94R\x94")
_SIZE = _REF + _SIZE_ARGS
_NEW = rb"\)\x81\x94\}\x94\("
_CHUNK_RE = re.compile(_REF + _NEW + _REF + _SIZE + _REF + _SIZE + rb"ub", re.DOTALL)
_PAIR_RE = re.compile(_REF + _NEW + _REF + _REF + _REF + _INT + _REF + _SIZE + rb"ub" +
                      _REF + _NEW + _REF + _REF + _REF + _INT + _REF + _INT + rb"ub", re.DOTALL)


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


def _frame_headers(data: Any) -> list[int] | None:
    """Where each FRAME header (a buffering hint the interpreter reads straight on) starts,
    when the pickle after PROTO is one chain of frames; ``[]`` when it has no FRAME after
    PROTO; None when its frames do not chain (the interpreter decides about those)."""
    n = len(data)
    if n < 3 or data[2] != 0x95:
        return []
    heads = []
    p = 2
    while p < n:
        if data[p] != 0x95 or p + 9 > n:
            return None
        (length,) = _u64(data, p + 1)
        if length > n - p - 9:
            return None
        heads.append(p)
        p += 9 + length
    return heads


class _Reader:
    def __init__(self) -> None:
        self.chunk_ndim = array("b")
        self.chunk_start = array("q")
        self.chunk_values = array("q")
        self.fqn_ids: dict[str, int] = {}
        self.file_ids: dict[str, int] = {}
        self.entry_fqn = array("i")
        self.entry_index = array("q")
        self.entry_ndim = array("b")
        self.entry_offsets = array("q")
        self.index_values = array("q")
        self.entry_file = array("i")
        self.entry_offset = array("q")
        self.entry_length = array("q")
        self.transforms = False
        self.owner: _Dict | None = None  # the dict storage entries went to
        self.specs: dict[tuple[bytes, ...], Any] = {}  # checked refs -> their record's regex
        self.chunk_spec: Any = None  # the last ones used
        self.pair_spec: Any = None
        self.chunk_vec: Any = None  # their steps for :func:`_vector`
        self.pair_vec: Any = None
        self.bounds: list[int] = []  # the same, then len(data) + 1
        self.vectorised = True  # runs of records many at a time (:func:`_vector`)
        self.window = 0  # the longest run :func:`_vector` took
        self.fqn_table: list[Any] = []  # :func:`_names_of`'s resolved refs
        self.file_table: list[Any] = []

    # -- per-item records, checked as the converter checks them ----------------------------
    @staticmethod
    def _fields(state: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
        if state is None:
            state = {}
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]
        if type(state) is not _Dict or state.pairs is not None or any(k not in allowed
                                                                      for k in state):
            raise _GiveUp
        return state

    def chunk_row(self, state: Any) -> Any:
        f = self._fields(state, ("offsets", "sizes"))
        offsets, sizes = f.get("offsets"), f.get("sizes")
        if type(offsets) is not _Size or type(sizes) is not _Size or len(offsets) != len(sizes):
            raise _GiveUp
        n = len(self.chunk_ndim)
        self.chunk_ndim.append(len(offsets))
        self.chunk_start.append(len(self.chunk_values))
        self.chunk_values.extend(offsets)
        self.chunk_values.extend(sizes)
        return _Run(_CHUNK, n, 1)  # type: ignore[return-value]

    def index_row(self, state: Any) -> _Row:
        f = self._fields(state, ("fqn", "offset", "index"))
        fqn, offset, index = f.get("fqn"), f.get("offset"), f.get("index")
        if type(fqn) is not str:
            raise _GiveUp
        fid = self.fqn_ids.setdefault(fqn, len(self.fqn_ids))
        if index is None:
            index = -1
        elif type(index) is not int or not 0 <= index <= _MAX_INDEX:
            raise _GiveUp
        if offset is not None and type(offset) is not _Size:
            raise _GiveUp
        return _Row(_INDEX, 0, (fid, index, offset))

    def info_row(self, state: Any) -> _Row:
        f = self._fields(state, ("relative_path", "offset", "length", "transform_descriptors"))
        path, offset, length = f.get("relative_path"), f.get("offset"), f.get("length")
        if type(path) is not str or type(offset) is not int or type(length) is not int or not (
                0 <= offset <= _MAX_INDEX and 0 <= length <= _MAX_INDEX):
            raise _GiveUp
        descriptors = f.get("transform_descriptors")
        if descriptors is not None:
            if not (type(descriptors) in (list, tuple, _List) and
                    all(type(d) is str for d in descriptors)):
                raise _GiveUp
            if descriptors:
                self.transforms = True
        return _Row(_INFO, 0, (self.file_ids.setdefault(path, len(self.file_ids)), offset,
                               length))

    def add_entry(self, key: tuple[Any, ...], value: tuple[Any, ...]) -> None:
        fid, index, offset = key
        file, off, length = value
        self.entry_fqn.append(fid)
        self.entry_index.append(index)
        if offset is None:
            self.entry_ndim.append(0)
            self.entry_offsets.append(-1)
        else:
            self.entry_ndim.append(len(offset))
            self.entry_offsets.append(len(self.index_values))
            self.index_values.extend(offset)
        self.entry_file.append(file)
        self.entry_offset.append(off)
        self.entry_length.append(length)


def _call(func: Any, args: Any) -> Any:
    """REDUCE of one of the few callables DCP metadata pickles, applied to checked values."""
    if type(func) is not _Global or type(args) is not tuple:
        raise _GiveUp
    name = func.qualname
    if name == "torch.Size":
        if len(args) != 1:
            raise _GiveUp
        (value,) = args
        if type(value) not in (tuple, list, _List) or len(value) > 64:
            raise _GiveUp
        for v in value:
            if type(v) is not int or not 0 <= v <= _MAX_INDEX:
                raise _GiveUp
        return _Size(value)
    if name == "torch.serialization._get_layout":
        if len(args) != 1 or args[0] not in _LAYOUTS:
            raise _GiveUp
        return _Layout(args[0])
    if name == f"{_MD}._MEM_FORMAT_ENCODING":
        if len(args) != 1 or type(args[0]) is not int or args[0] not in (0, 1, 2, 3):
            raise _GiveUp
        return _MemFormat(args[0])
    if name == "collections.OrderedDict":
        if args not in ((), (None,)):
            raise _GiveUp
        return _Dict()
    if name.startswith("pathlib."):
        if not all(type(p) is str for p in args):
            raise _GiveUp
        return path_value(name.removeprefix("pathlib."), args)
    raise _GiveUp


def _run(data: Any, heads: list[int], vectorised: bool = True) -> tuple[Any, _Reader]:
    n = len(data)
    heads = [*heads, n + 1]
    bound = heads[0]  # the next FRAME header: opcodes stop before it, records never span it
    next_head = 1
    if n < 3 or data[0] != 0x80 or data[1] not in (4, 5):
        raise _GiveUp
    reader = _Reader()
    reader.vectorised = vectorised
    reader.bounds = heads
    empty = _np().empty(0, dtype=_np().int64)
    reader.fqn_table = [empty, empty]
    reader.file_table = [empty, empty]
    stack: list[Any] = []
    marks: list[list[Any]] = []
    memo: dict[int, Any] = {}
    nmemo = 0
    globals_: dict[tuple[str, str], _Global] = {}
    p = 2
    push = stack.append
    pop = stack.pop
    while True:
        if p >= bound:  # an opcode must end where a frame ends; skip the next FRAME header
            if p != bound:
                raise _GiveUp
            p += 9
            bound = heads[next_head]
            next_head += 1
            continue
        if p >= n:
            raise _GiveUp
        code = data[p]
        p += 1
        if code == 0x94:  # MEMOIZE
            if not stack:
                raise _GiveUp
            top = stack[-1]
            kind = type(top)
            # names, small values, and containers that are not per item; per-item records and
            # the tuples/Sizes inside them are not kept (a reference to one gives up)
            if kind is str or kind is _Global or kind is _Layout or kind is _MemFormat or (
                    kind is _Obj and top.cls not in _HOT) or (
                    kind is tuple and not all(type(v) is int for v in top)):
                memo[nmemo] = top
            nmemo += 1
        elif code == 0x68 or code == 0x6A:  # BINGET, LONG_BINGET
            if code == 0x68:
                if p + 1 > n:
                    raise _GiveUp
                index = data[p]
                p += 1
            else:
                if p + 4 > n:
                    raise _GiveUp
                (index,) = _u32(data, p)
                p += 4
            try:
                value = memo[index]
            except KeyError:
                raise _GiveUp from None
            if type(value) is _Global and value.qualname in _HOT:
                start = p - (2 if code == 0x68 else 5)
                if value.qualname == _CHUNK:
                    p, nmemo, run = _chunks(data, start, bound, memo, nmemo, reader,
                                           stack, marks)
                elif value.qualname == _INDEX:
                    _flush_pairs(stack, reader)  # entries stay in storage_data order
                    p, nmemo, run = _pairs(data, start, bound, memo, nmemo, reader,
                                          stack, marks)
                else:
                    run = None
                if run is not None:
                    push(run)
                    while bound < p:  # runs taken at once end on record boundaries only
                        bound = heads[next_head]
                        next_head += 1
                    continue
                p = start + (2 if code == 0x68 else 5)
            push(value)
        elif code == 0x8C or code == 0x58:  # SHORT_BINUNICODE, BINUNICODE
            if code == 0x8C:
                if p + 1 > n:
                    raise _GiveUp
                length = data[p]
                p += 1
            else:
                if p + 4 > n:
                    raise _GiveUp
                (length,) = _u32(data, p)
                p += 4
            if length > n - p:
                raise _GiveUp
            try:
                push(data[p:p + length].decode("utf-8"))
            except UnicodeDecodeError:
                raise _GiveUp from None
            p += length
        elif code == 0x4B:  # BININT1
            if p + 1 > n:
                raise _GiveUp
            push(data[p])
            p += 1
        elif code == 0x4D:  # BININT2
            if p + 2 > n:
                raise _GiveUp
            push(_u16(data, p)[0])
            p += 2
        elif code == 0x4A:  # BININT
            if p + 4 > n:
                raise _GiveUp
            push(_i32(data, p)[0])
            p += 4
        elif code == 0x8A:  # LONG1
            if p + 1 > n:
                raise _GiveUp
            length = data[p]
            if length > MAX_INT_NBYTES or length > n - p - 1:
                raise _GiveUp
            push(int.from_bytes(data[p + 1:p + 1 + length], "little", signed=True))
            p += 1 + length
        elif code == 0x85:  # TUPLE1
            if not stack or stack[-1] is _MARK:
                raise _GiveUp
            stack[-1] = (stack[-1],)
        elif code == 0x86 or code == 0x87:  # TUPLE2, TUPLE3
            k = code - 0x84
            if len(stack) < k or any(v is _MARK for v in stack[-k:]):
                raise _GiveUp
            items = tuple(stack[-k:])
            del stack[-k:]
            push(items)
        elif code == 0x29:  # EMPTY_TUPLE
            push(())
        elif code == 0x28:  # MARK
            marks.append(stack)
            stack = []
            push = stack.append
            pop = stack.pop
        elif code in (0x74, 0x75, 0x65):  # TUPLE, SETITEMS, APPENDS
            if not marks:
                raise _GiveUp
            items = stack
            stack = marks.pop()
            push = stack.append
            pop = stack.pop
            if code == 0x74:
                push(tuple(items))
                continue
            if not stack:
                raise _GiveUp
            target = stack[-1]
            if code == 0x75:
                if type(target) is not _Dict:
                    raise _GiveUp
                _setitems(reader, target, items)
            else:
                if type(target) is not _List:
                    raise _GiveUp
                _appends(target, items)
        elif code == 0x73:  # SETITEM
            if len(stack) < 3 or type(stack[-3]) is not _Dict:
                raise _GiveUp
            items = stack[-2:]
            del stack[-2:]
            _setitems(reader, stack[-1], items)
        elif code == 0x61:  # APPEND
            if len(stack) < 2 or type(stack[-2]) is not _List:
                raise _GiveUp
            _appends(stack[-2], [pop()])
        elif code == 0x7D:  # EMPTY_DICT
            push(_Dict())
        elif code == 0x5D:  # EMPTY_LIST
            push(_List())
        elif code == 0x4E:  # NONE
            push(None)
        elif code == 0x88:  # NEWTRUE
            push(True)
        elif code == 0x89:  # NEWFALSE
            push(False)
        elif code == 0x47:  # BINFLOAT
            if p + 8 > n:
                raise _GiveUp
            push(_f64(data, p)[0])
            p += 8
        elif code == 0x93:  # STACK_GLOBAL
            if len(stack) < 2:
                raise _GiveUp
            name = pop()
            module = pop()
            if type(module) is not str or type(name) is not str:
                raise _GiveUp
            module, name = canonical_global(module, name)
            g = globals_.get((module, name))
            if g is None:
                qualname = f"{module}.{name}"
                if not (qualname in _CLASSES or qualname in _CALLABLES or (
                        module == "torch" and name in _DTYPES)):
                    raise _GiveUp
                g = globals_[(module, name)] = _Global(qualname)
            push(g)
        elif code == 0x81:  # NEWOBJ
            if len(stack) < 2:
                raise _GiveUp
            args = pop()
            cls = stack[-1]
            if args != () or type(args) is not tuple or type(cls) is not _Global or \
                    cls.qualname not in _CLASSES:
                raise _GiveUp
            stack[-1] = _Obj(cls.qualname)
        elif code == 0x52:  # REDUCE
            if len(stack) < 2:
                raise _GiveUp
            args = pop()
            stack[-1] = _call(stack[-1], args)
        elif code == 0x62:  # BUILD
            if len(stack) < 2:
                raise _GiveUp
            state = pop()
            obj = stack[-1]
            if type(obj) is not _Obj or obj.state is not None or state is None:
                raise _GiveUp
            cls = obj.cls
            if cls in _HOT:
                if cls == _CHUNK:
                    stack[-1] = reader.chunk_row(state)
                elif cls == _INDEX:
                    stack[-1] = reader.index_row(state)
                else:
                    stack[-1] = reader.info_row(state)
            else:
                obj.state = state
        elif code == 0x2E:  # STOP
            if len(stack) != 1 or marks or p != n:
                raise _GiveUp
            return stack[0], reader
        else:  # everything else: PUT/BINPUT, EXT, PERSID, INST, OBJ, bytes, sets, FRAME...
            raise _GiveUp


def _ref(raw: bytes, memo: dict[int, Any]) -> Any:
    try:
        return memo[raw[1] if raw[0] == 0x68 else _u32(raw, 1)[0]]
    except KeyError:
        raise _GiveUp from None


def _is(value: Any, qualname: str) -> bool:
    return type(value) is _Global and value.qualname == qualname


def _int(raw: bytes) -> int:
    code = raw[0]
    if code == 0x4B:
        return raw[1]
    if code == 0x4D:
        return _u16(raw, 1)[0]
    if code == 0x4A:
        return _i32(raw, 1)[0]
    return int.from_bytes(raw[2:], "little", signed=True)


def _ints(run: bytes) -> tuple[int, ...]:
    half = len(run) >> 1
    if run[::2] == b"K" * half and len(run) == 2 * half:
        return tuple(run[1::2])
    out = []
    p = 0
    while p < len(run):
        code = run[p]
        width = 2 if code == 0x4B else 3 if code == 0x4D else 5 if code == 0x4A else \
            2 + run[p + 1]
        out.append(_int(run[p:p + width]))
        p += width
    return tuple(out)


def _size(memo: dict[int, Any], ref: bytes, run: bytes | None, marked: bytes | None
          ) -> tuple[tuple[int, ...], int]:
    """A ``torch.Size`` record's values and the MEMOIZEs it holds."""
    func = _ref(ref, memo)
    if type(func) is not _Global or func.qualname != "torch.Size":
        raise _GiveUp
    if run is not None:
        values = _ints(run[:-1])
        if len(values) != run[-1] - 0x84:
            raise _GiveUp
    elif marked is not None:
        values = _ints(marked)
    else:
        return (), 2
    for v in values:
        if v < 0:
            raise _GiveUp
    return values, 3


def _names(memo: dict[int, Any], refs: tuple[bytes, ...], expected: tuple[str, ...]) -> None:
    for raw, name in zip(refs, expected):
        if _ref(raw, memo) != name:
            raise _GiveUp


def _specialised(reader: _Reader, refs: tuple[bytes, ...], parts: tuple[Any, ...]) -> Any:
    """The record's regular expression with its checked refs (the 1-tuples of ``parts``) as
    literal bytes: compiled once per distinct set of refs, a few per file."""
    pattern = reader.specs.get(refs)
    if pattern is None:
        pattern = reader.specs[refs] = re.compile(b"".join(
            re.escape(x[0]) if type(x) is tuple else x for x in parts), re.DOTALL)
    return pattern


def _window(taken: int, reader: _Reader) -> int:
    """Bytes :func:`_vector` looks at: a few times what this run took so far, at least the
    longest run so far (the next list or dict is likely as long), within bounds."""
    return min(_VEC_MAX_WINDOW, max(_VEC_MIN_WINDOW, 8 * taken, reader.window + 4096))


def _split(stack: Any, marks: Any, reader: _Reader, run: _Run, setitems: bool) -> int:
    """SETITEMS (or APPENDS) then MARK between two records of one :func:`_vector` window:
    the current MARK's items (runs only) and ``run`` go to the dict (list) below it, as the
    opcode loop would apply them; the MARK's list is emptied for the next records. Returns
    where the next run starts."""
    items = [*stack, run]
    stack.clear()
    if not marks or not marks[-1]:
        raise _GiveUp
    target = marks[-1][-1]
    if setitems:
        if type(target) is not _Dict:
            raise _GiveUp
        _setitems(reader, target, items)
    else:
        if type(target) is not _List:
            raise _GiveUp
        _appends(target, items)
    return run.first + run.count


def _past_head(p: int, bound: int, reader: _Reader) -> tuple[int, int]:
    """Where the next record may start after one that ends at ``p`` (past a FRAME header
    that starts right there) and the next FRAME header after that."""
    if p < bound:
        return p, bound
    bounds = reader.bounds
    i = bisect_left(bounds, p)
    while bounds[i] == p:  # the header is skipped as the opcode loop skips it
        p += 9
        i += 1
    return p, bounds[i]


def _vector_step(vector: Callable[..., tuple[int, int, int, bool, list[int]]], kind: Any,
                 data: Any, p: int, p0: int, bound: int, first: int, count: int, nmemo: int,
                 reader: _Reader, stack: list[Any] | None, marks: list[list[Any]] | None
                 ) -> tuple[bool, int, int, int, int, int]:
    """One vectorised window of ``kind`` records (chunks or pairs) from ``p``, for the record
    loops of :func:`_chunks` and :func:`_pairs` (``p0``: where the loop started): the records
    ``vector`` takes are counted into the loop's run, split where an APPENDS / SETITEMS and a
    MARK fall between two of them (as the opcode loop splits them). Returns whether the window
    ran out with every record taken (the next one goes on from there) and the loop's new
    ``p, bound, first, count, nmemo``."""
    window = _window(p - p0, reader)
    split = stack is not None and all(type(x) is _Run for x in stack)
    k, end, memos, more, splits = vector(data, p, window, reader=reader, split=split)
    if not k:
        return False, p, bound, first, count, nmemo
    for c in splits:
        first, count = _split(stack, marks, reader, _Run(kind, first, count + c),
                              kind == _PAIR), -c
    p, bound = _past_head(end, bound, reader)
    reader.window = max(reader.window, p - p0)
    return more, p, bound, first, count + k, nmemo + memos


def _chunks(data: Any, p: int, bound: int, memo: dict[int, Any], nmemo: int,
            reader: _Reader, stack: list[Any] | None = None,
            marks: list[list[Any]] | None = None) -> tuple[int, int, _Run | None]:
    """Consecutive ChunkStorageMetadata records from ``p``, straight into the columns."""
    first = len(reader.chunk_ndim)
    count = 0
    ndims, starts, values = reader.chunk_ndim, reader.chunk_start, reader.chunk_values
    spec = reader.chunk_spec
    p0, cool, ready = p, 0, False
    while True:
        ready = ready or (count >= _VEC_AFTER and reader.vectorised)
        if ready and cool <= 0 and reader.chunk_vec is not None:
            more, p, bound, first, count, nmemo = _vector_step(
                _vector_chunks, _CHUNK, data, p, p0, bound, first, count, nmemo, reader,
                stack, marks)
            if more:  # the window ran out: the next one goes on from there
                continue
            cool = _VEC_COOL
        cool -= 1
        m = spec.match(data, p) if spec is not None else None
        if m is not None and m.end() <= bound:
            a1, b1, a2, b2 = m.groups()
        else:
            m = _CHUNK_RE.match(data, p)
            if m is None or m.end() > bound:
                break
            cls, k1, r1, a1, b1, k2, r2, a2, b2 = m.groups()
            if not (_is(_ref(cls, memo), _CHUNK) and _ref(k1, memo) == "offsets" and
                    _ref(k2, memo) == "sizes" and _is(_ref(r1, memo), "torch.Size") and
                    _is(_ref(r2, memo), "torch.Size")):
                break  # another field order or class: the opcode loop reads it
            spec = reader.chunk_spec = _specialised(reader, (cls, k1, r1, k2, r2), (
                (cls,), _NEW, (k1,), (r1,), _SIZE_ARGS, (k2,), (r2,), _SIZE_ARGS, b"ub"))
            reader.chunk_vec = _steps_chunk((cls, k1, r1, k2, r2))
        offsets, n1 = _size_values(a1, b1)
        sizes, n2 = _size_values(a2, b2)
        if len(offsets) != len(sizes):
            raise _GiveUp
        ndims.append(len(offsets))
        starts.append(len(values))
        values.extend(offsets)
        values.extend(sizes)
        nmemo += 2 + n1 + n2
        count += 1
        p = m.end()
    return p, nmemo, _Run(_CHUNK, first, count) if count else None


def _size_values(run: bytes | None, marked: bytes | None) -> tuple[tuple[int, ...], int]:
    """The ints of a ``torch.Size`` record (its function checked by the caller) and the
    MEMOIZEs it holds."""
    if run is not None:
        k = len(run) - 1
        if k == 2 * (run[-1] - 0x84) and run[0:k:2] == b"KKK"[:k >> 1]:
            return tuple(run[1:k:2]), 3  # BININT1s: the common case
        values = _ints(run[:-1])
        if len(values) != run[-1] - 0x84:
            raise _GiveUp
    elif marked is not None:
        values = _ints(marked)
    else:
        return (), 2
    for v in values:
        if v < 0:
            raise _GiveUp
    return values, 3


_MAX_J = (1 << 31) - 1  # above this a 4-byte J is negative (and is checked as such)
_INDEX_FIELDS = ("fqn", "index", "offset")
_INFO_FIELDS = ("relative_path", "offset", "length")


def _pairs(data: Any, p: int, bound: int, memo: dict[int, Any], nmemo: int,
           reader: _Reader, stack: list[Any] | None = None,
           marks: list[list[Any]] | None = None) -> tuple[int, int, _Run | None]:
    """Consecutive (MetadataIndex, _StorageInfo) pairs of ``storage_data`` from ``p``, in
    the field orders DCP pickles them, straight into the columns."""
    first = len(reader.entry_fqn)
    count = 0
    fqn_ids, file_ids = reader.fqn_ids, reader.file_ids
    fqn_refs: dict[bytes, int] = {}
    path_refs: dict[bytes, int] = {}
    e_fqn, e_index, e_ndim = reader.entry_fqn, reader.entry_index, reader.entry_ndim
    e_offsets, i_values = reader.entry_offsets, reader.index_values
    e_file, e_offset, e_length = reader.entry_file, reader.entry_offset, reader.entry_length
    spec = reader.pair_spec
    from_bytes = int.from_bytes
    p0, cool, ready = p, 0, False
    while True:
        ready = ready or (count >= _VEC_AFTER and reader.vectorised)
        if ready and cool <= 0 and reader.pair_vec is not None:
            more, p, bound, first, count, nmemo = _vector_step(
                functools.partial(_vector_pairs, memo=memo), _PAIR, data, p, p0, bound, first,
                count, nmemo, reader, stack, marks)
            if more:  # the window ran out: the next one goes on from there
                continue
            cool = _VEC_COOL
        cool -= 1
        m = spec.match(data, p) if spec is not None else None
        if m is not None and m.end() <= bound:
            fqn, index, a, b, path, offset, length = m.groups()
        else:
            m = _PAIR_RE.match(data, p)
            if m is None or m.end() > bound:
                break
            (cls, kf, fqn, ki, index, ko, r, a, b,
             cls2, kp, path, ko2, offset, kl, length) = m.groups()
            if not (_is(_ref(cls, memo), _INDEX) and _is(_ref(cls2, memo), _INFO) and
                    _is(_ref(r, memo), "torch.Size") and
                    tuple(_ref(x, memo) for x in (kf, ki, ko)) == _INDEX_FIELDS and
                    tuple(_ref(x, memo) for x in (kp, ko2, kl)) == _INFO_FIELDS):
                break
            refs = (cls, kf, ki, ko, r, cls2, kp, ko2, kl)
            spec = reader.pair_spec = _specialised(reader, refs, (
                (cls,), _NEW, (kf,), _REF, (ki,), _INT, (ko,), (r,), _SIZE_ARGS, b"ub",
                (cls2,), _NEW, (kp,), _REF, (ko2,), _INT, (kl,), _INT, b"ub"))
            reader.pair_vec = _steps_pair(refs)
        fid = fqn_refs.get(fqn)
        if fid is None:
            name = _ref(fqn, memo)
            if type(name) is not str:
                raise _GiveUp
            fid = fqn_refs[fqn] = fqn_ids.setdefault(name, len(fqn_ids))
        file = path_refs.get(path)
        if file is None:
            name = _ref(path, memo)
            if type(name) is not str:
                raise _GiveUp
            file = path_refs[path] = file_ids.setdefault(name, len(file_ids))
        # K, M and J are little-endian after their opcode; J (signed) and LONG1 may be negative
        i = from_bytes(index[1:], "little") if index[0] != 0x8A else _int(index)
        o = from_bytes(offset[1:], "little") if offset[0] != 0x8A else _int(offset)
        n = from_bytes(length[1:], "little") if length[0] != 0x8A else _int(length)
        if i > _MAX_J or o > _MAX_J or n > _MAX_J or i < 0 or o < 0 or n < 0:
            if _int(index) < 0 or _int(offset) < 0 or _int(length) < 0:
                raise _GiveUp  # a negative index, offset or length
        values, k = _size_values(a, b)
        e_fqn.append(fid)
        e_index.append(i)
        e_ndim.append(len(values))
        e_offsets.append(len(i_values))
        i_values.extend(values)
        e_file.append(file)
        e_offset.append(o)
        e_length.append(n)
        nmemo += 4 + k
        count += 1
        p = m.end()
    return p, nmemo, _Run(_PAIR, first, count) if count else None


def _flush_pairs(stack: list[Any], reader: _Reader) -> None:
    """Put the (MetadataIndex, _StorageInfo) pairs the opcode loop left at the top of the
    stack into the columns, as one run, before the regular expressions add the next ones."""
    k = len(stack)
    while k >= 2 and type(stack[k - 1]) is _Row and type(stack[k - 2]) is _Row and \
            stack[k - 2].cls == _INDEX and stack[k - 1].cls == _INFO:
        k -= 2
    if k == len(stack):
        return
    first = len(reader.entry_fqn)
    for i in range(k, len(stack), 2):
        reader.add_entry(stack[i].fields, stack[i + 1].fields)
    del stack[k:]
    stack.append(_Run(_PAIR, first, len(reader.entry_fqn) - first))


def _setitems(reader: _Reader, target: _Dict, items: list[Any]) -> None:
    i = 0
    while i < len(items):
        key = items[i]
        if type(key) is _Run:
            if key.cls != _PAIR or (len(target) and target.pairs is None) or \
                    reader.owner not in (None, target):
                raise _GiveUp
            target.pairs = _PAIRS
            reader.owner = target
            i += 1
            continue
        if i + 1 >= len(items):
            raise _GiveUp
        value = items[i + 1]
        i += 2
        if type(key) is _Row:
            if key.cls != _INDEX or type(value) is not _Row or value.cls != _INFO or (
                    len(target) and target.pairs is None) or reader.owner not in (None, target):
                raise _GiveUp
            target.pairs = _PAIRS
            reader.owner = target
            reader.add_entry(key.fields, value.fields)
            continue
        if target.pairs is not None or type(key) not in (str, int, bool) or \
                type(value) in (_Row, _Run):
            raise _GiveUp
        target[key] = value


def _appends(target: _List, items: list[Any]) -> None:
    for item in items:
        if type(item) is _Run:
            if item.cls != _CHUNK or len(target) or (
                    target.count and item.first != target.first + target.count):
                raise _GiveUp
            if not target.count:
                target.first = item.first
            target.count += item.count
            continue
        if target.count or type(item) is _Row:
            raise _GiveUp
        target.append(item)


def _plain(value: Any, depth: int = 0) -> Any:
    kind = type(value)
    if kind in (str, int, float, bool) or value is None:
        return value
    if kind is _Size:
        return value
    if depth >= _MAX_PLAIN_DEPTH:
        raise _GiveUp
    if kind is tuple:
        return tuple(_plain(v, depth + 1) for v in value)
    if kind is _List:
        if value.count:
            raise _GiveUp
        return [_plain(v, depth + 1) for v in value]
    if kind is _Dict:
        if value.pairs is not None:
            raise _GiveUp
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    raise _GiveUp


def _state(obj: Any, cls: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if type(obj) is not _Obj or obj.cls != cls:
        raise _GiveUp
    return _Reader._fields(obj.state, allowed)


def _assemble(root: Any, reader: _Reader) -> MetadataColumns:
    top = _state(root, f"{_MD}.Metadata", ("state_dict_metadata", "planner_data",
                                          "storage_data", "storage_meta", "version"))
    sdm = top.get("state_dict_metadata")
    if type(sdm) is not _Dict or sdm.pairs is not None:
        raise _GiveUp
    tensors: dict[str, tuple[str, bool, tuple[int, ...], int, int]] = {}
    objects = []
    for fqn, md in sdm.items():
        if type(fqn) is not str or type(md) is not _Obj:
            raise _GiveUp
        if md.cls == f"{_MD}.BytesStorageMetadata":
            if md.state is not None:
                _state(md, md.cls, ())
            objects.append(fqn)
            continue
        f = _state(md, f"{_MD}.TensorStorageMetadata", ("properties", "size", "chunks"))
        props, size, chunks = f.get("properties"), f.get("size"), f.get("chunks")
        if type(size) is not _Size or type(chunks) is not _List or len(chunks):
            raise _GiveUp
        if type(props) is not _Obj or props.cls != f"{_MD}.TensorProperties":
            raise _GiveUp
        state = props.state
        if not (type(state) is tuple and len(state) == 5):
            raise _GiveUp
        dtype, layout, requires_grad, fmt, pin = state
        if type(dtype) is not _Global or not dtype.qualname.startswith("torch.") or \
                type(layout) is not _Layout or type(fmt) is not _MemFormat or \
                type(requires_grad) is not bool or type(pin) is not bool:
            raise _GiveUp
        name = dtype.qualname[6:]
        if name not in _DTYPES:
            raise _GiveUp
        tensors[fqn] = (_DTYPE_ALIASES.get(name, name), requires_grad, tuple(size),
                        chunks.first if chunks.count else 0, chunks.count)
    storage_data = top.get("storage_data")
    if storage_data is not None and (type(storage_data) is not _Dict or len(storage_data)):
        raise _GiveUp  # only the column pairs (or an empty dict)
    if reader.owner is not None and storage_data is not reader.owner:
        raise _GiveUp  # storage entries somewhere else than storage_data
    meta = top.get("storage_meta")
    storage_meta = None
    if meta is not None:
        f = _state(meta, f"{_MD}.StorageMeta", ("checkpoint_id", "save_id", "load_id",
                                                "modules"))
        for key in ("checkpoint_id", "save_id", "load_id"):
            if f.get(key) is not None and type(f.get(key)) is not str:
                raise _GiveUp
        modules = f.get("modules") or _List()
        if type(modules) is not _List or modules.count or not all(type(m) is str
                                                                  for m in modules):
            raise _GiveUp
        storage_meta = {"checkpoint_id": f.get("checkpoint_id"), "save_id": f.get("save_id"),
                        "load_id": f.get("load_id"), "modules": list(modules)}
    version = top.get("version")
    if version is not None and type(version) is not str:
        raise _GiveUp
    planner = top.get("planner_data")
    return MetadataColumns(
        tensors=tensors, objects=tuple(objects), planner_data=_plain(planner),
        storage_meta=storage_meta, version=version, has_storage_data=storage_data is not None,
        chunk_ndim=reader.chunk_ndim, chunk_start=reader.chunk_start,
        chunk_values=reader.chunk_values, fqns=list(reader.fqn_ids),
        files=list(reader.file_ids), entry_fqn=reader.entry_fqn,
        entry_index=reader.entry_index, entry_ndim=reader.entry_ndim,
        entry_offsets=reader.entry_offsets, index_values=reader.index_values,
        entry_file=reader.entry_file, entry_offset=reader.entry_offset,
        entry_length=reader.entry_length, transforms=reader.transforms)


# -- runs of records at once, with numpy ------------------------------------------------------
# Once a record's regular expression has been specialised (its class and field-name refs
# checked and made literal), the records after it are checked and decoded many at a time:
# candidate starts are where the record's first constant bytes are, every candidate is parsed
# from its start by vectorised steps (constant bytes compared, refs and ints decoded by their
# opcode, torch.Size arguments of every arity the regular expression takes), and the records
# taken are the longest prefix that chains (each one starts where the previous one ends) and
# that the regular expression would match with the same groups (a FRAME header may lie
# between two of a record's opcodes, as the opcode loop allows; a batch break, SETITEMS or
# APPENDS + MARK, between two records is applied as the opcode loop applies it). A record the
# steps do not accept is left to the regular expression and the opcode loop, one at a time,
# as before.
_K, _M, _J, _L1 = 0x4B, 0x4D, 0x4A, 0x8A
_MAX_VEC_NDIM = 8  # torch.Size arguments decoded at once; longer ones: one record at a time
_VEC_AFTER = 16  # records the regular expression takes first (short runs never pay numpy)
_VEC_MIN_WINDOW = 1 << 14
_VEC_MAX_WINDOW = 1 << 18  # bounds the temporaries: a few MB whatever the file
_VEC_COOL = 32  # records taken one at a time after a window that stopped short
_AR8 = None  # numpy.arange(8), set on first use


def _np() -> Any:
    import numpy as np

    return np


def _steps_pair(refs: tuple[bytes, ...]) -> tuple[Any, ...]:
    cls, kf, ki, ko, r, cls2, kp, ko2, kl = refs
    new = b")\x81\x94}\x94("
    return ((cls + new + kf), "ref", ki, "int", ko + r, "size", b"ub" + cls2 + new + kp,
            "ref", ko2, "int", kl, "int", b"ub")


def _steps_chunk(refs: tuple[bytes, ...]) -> tuple[Any, ...]:
    cls, k1, r1, k2, r2 = refs
    return (cls + b")\x81\x94}\x94(" + k1 + r1, "size", k2 + r2, "size", b"ub")


class _Vec:
    """Vectorised parse of the candidates at ``cur`` (offsets into ``a``)."""

    def __init__(self, a: Any, cur: Any) -> None:
        np = _np()
        self.np = np
        self.a = a
        self.cur = cur
        self.ok = np.ones(len(cur), dtype=bool)
        self.neg = np.zeros(len(cur), dtype=bool)  # a negative int: the slow path gives up
        self.consts: list[tuple[Any, bytes]] = []

    def take(self, width: int) -> Any:
        np = self.np
        return np.take(self.a, self.cur[:, None] + np.arange(width), mode="clip")

    def const(self, raw: bytes) -> None:
        """Constant bytes: compared with the others at the end (:meth:`check`)."""
        self.consts.append((self.cur, raw))
        self.cur = self.cur + len(raw)

    def check(self) -> None:
        """Every record's constant bytes compared at once."""
        np = self.np
        if self.consts:
            where = np.concatenate([c[:, None] + np.arange(len(raw)) for c, raw in self.consts],
                                   axis=1)
            want = np.frombuffer(b"".join(raw for _, raw in self.consts), dtype=np.uint8)
            self.ok &= (self.a.take(where, mode="clip") == want).all(axis=1)
            self.consts = []

    def ref(self) -> Any:
        np = self.np
        b = self.take(5)
        is_h = b[:, 0] == 0x68
        self.ok &= is_h | (b[:, 0] == 0x6A)
        u32 = np.ascontiguousarray(b[:, 1:5]).view("<u4").ravel().astype(np.int64)
        self.cur = self.cur + np.where(is_h, 2, 5)
        return np.where(is_h, b[:, 1].astype(np.int64), u32)

    def int_at(self, cur: Any, active: Any = None) -> tuple[Any, Any, Any]:
        """(valid, value, width) of the int opcode at ``cur``: BININT1, BININT2 (unsigned),
        BININT (signed 4 bytes), LONG1 of 1..8 bytes (signed). ``active``: the rows that
        count (the others' results are not used)."""
        np = self.np
        a = self.a
        op = a.take(cur, mode="clip")
        is_k = op == _K
        if (is_k.all() if active is None else (is_k | ~active).all()):  # the common case
            return is_k, a.take(cur + 1, mode="clip").astype(np.int64), 2
        is_m = op == _M
        short = is_k | is_m
        if (short.all() if active is None else (short | ~active).all()):  # BININT1/2 only
            low = a.take(cur + 1, mode="clip").astype(np.int64)
            high = a.take(cur + 2, mode="clip").astype(np.int64)
            return short, np.where(is_m, low | (high << 8), low), 2 + is_m
        w = a.take((cur + 1)[:, None] + _AR8, mode="clip").view("<u8").ravel()
        is_j, is_l = op == _J, op == _L1
        value = np.where(is_k, w & 0xFF, np.where(is_m, w & 0xFFFF, 0)).view(np.int64)
        value = np.where(is_j, (w & 0xFFFFFFFF).astype(np.uint32).view(np.int32), value)
        width = 2 + is_m + 3 * is_j
        if is_l.any():  # LONG1: a length byte, then that many bytes, signed
            nl = (w & 0xFF).astype(np.int64)
            is_l &= (nl >= 1) & (nl <= 8)
            shift = (64 - 8 * np.clip(nl, 1, 8)).astype(np.uint64)
            w2 = a.take((cur + 2)[:, None] + _AR8, mode="clip").view("<u8").ravel()
            signed = (w2 << shift).view(np.int64) >> shift.astype(np.int64)
            value = np.where(is_l, signed, value)
            width = np.where(is_l, 2 + nl, width)
        return is_k | is_m | is_j | is_l, value, width

    def int(self) -> Any:
        valid, value, width = self.int_at(self.cur)
        self.ok &= valid
        self.neg |= valid & (value < 0)
        self.cur = self.cur + width
        return value

    def size(self) -> tuple[Any, Any, Any]:
        """A ``torch.Size`` record's arguments as the regular expression reads them:
        (values (rows, _MAX_VEC_NDIM), count, MEMOIZEs)."""
        np = self.np
        op = np.take(self.a, self.cur, mode="clip")
        empty, marked = op == 0x29, op == 0x28
        cur = self.cur + (empty | marked)
        rows = len(cur)
        values = np.zeros((rows, _MAX_VEC_NDIM), dtype=np.int64)
        count = np.zeros(rows, dtype=np.int64)
        active = ~empty
        for j in range(_MAX_VEC_NDIM + 1):
            if not active.any():
                break
            valid, value, width = self.int_at(cur, active)
            active &= valid
            if j == _MAX_VEC_NDIM:
                self.ok &= ~active  # more values than decoded at once
                break
            values[:, j] = np.where(active, value, 0)
            self.neg |= active & (value < 0)
            cur = cur + np.where(active, width, 0)
            count += active
        close = np.take(self.a, cur, mode="clip")
        tuple_form = ~empty & ~marked
        self.ok &= np.where(marked, close == 0x74, np.where(
            tuple_form, (close.astype(np.int64) - 0x84 == count) & (count >= 1) & (count <= 3),
            True))
        cur = cur + ~empty
        self.ok &= empty | (np.take(self.a, cur, mode="clip") == 0x94)
        self.cur = cur + ~empty
        self.const(b"\x85\x94R\x94")
        return values, count, np.where(empty, 2, 3)


def _vector(data: Any, p: int, window: int, steps: tuple[Any, ...], reader: _Reader,
            split: bytes = b"") -> tuple[int, int, list[Any], bool, list[int]]:
    """The records of template ``steps`` from ``p`` that chain, within ``window`` bytes:
    (how many, where the last one ends, the fields of each step that has some, whether the
    window ran out before a record that does not chain or match, the records that follow
    ``split`` + MARK instead of the previous record: SETITEMS or APPENDS between them).

    FRAME headers in the window are cut out first; a record they fall inside is taken only
    when the header lies between two of its opcodes (as the opcode loop requires)."""
    global _AR8
    np = _np()
    if _AR8 is None:
        _AR8 = np.arange(8)
    end = min(len(data), p + window)
    bounds = reader.bounds
    lo = bisect_left(bounds, p + 1)
    hi = bisect_left(bounds, end)
    if lo == hi:
        a = np.frombuffer(data, dtype=np.uint8, count=end - p, offset=p)
        cuts: Any = ()
    else:  # a copy of the window without its FRAME headers; cuts: where they were
        pieces, cuts, at = [], [], p
        for h in bounds[lo:hi]:
            pieces.append(np.frombuffer(data, dtype=np.uint8, count=h - at, offset=at))
            cuts.append(sum(len(x) for x in pieces))
            at = min(h + 9, end)
        pieces.append(np.frombuffer(data, dtype=np.uint8, count=end - at, offset=at))
        a = np.concatenate(pieces)
        cuts = np.array(cuts, dtype=np.int64)
    head = steps[0]
    at = head.index(b"\x81")
    cand = np.flatnonzero(a[at:] == 0x81)
    if not len(cand) or cand[0] != 0:
        return 0, p, [], False, []
    cand = cand[(a.take(cand[:, None] + np.arange(len(head)), mode="clip") ==
                 np.frombuffer(head, dtype=np.uint8)).all(axis=1)]
    if not len(cand) or cand[0] != 0:
        return 0, p, [], False, []
    vec = _Vec(a, cand + len(head))
    fields = []
    for step in steps[1:]:
        if type(step) is bytes:
            vec.const(step)
        else:
            fields.append(getattr(vec, step)())
    vec.check()
    ends = vec.cur
    ok = vec.ok & (ends <= len(a))
    bad = ~ok
    chained = ends[:-1] == cand[1:]
    if split:
        after = (ends[:-1] + 2 == cand[1:]) & (a.take(ends[:-1], mode="clip") == split[0]) & (
            a.take(ends[:-1] + 1, mode="clip") == 0x28)
        chained |= after
    bad[1:] |= ~chained
    k = int(np.argmax(bad)) if bad.any() else len(bad)
    more = k == len(bad) or bool(ends[k] > len(a))  # cut by the window's end
    if len(cuts) and k:
        # a header inside a taken record must lie between two of its opcodes
        inside = np.searchsorted(cand[:k], cuts, side="right") - 1
        for c, r in zip(cuts.tolist(), inside.tolist()):
            if r >= 0 and cand[r] < c < ends[r] and c not in _opcode_starts(
                    a, int(cand[r]), int(ends[r])):
                k = r
                more = False
                break
    if not k:
        return 0, p, [], more, []
    if vec.neg[:k].any():
        raise _GiveUp  # what the regular expression's record would raise
    last = int(ends[k - 1])
    last += p + 9 * (int(np.searchsorted(cuts, last)) if len(cuts) else 0)
    splits = (np.flatnonzero(after[:k - 1]) + 1).tolist() if split else []
    return k, last, [f[:k] if type(f) is not tuple else
                     tuple(x[:k] for x in f) for f in fields], more, splits


def _opcode_starts(a: Any, start: int, end: int) -> set[int]:
    """Where the opcodes of a record the steps accepted start (and where it ends)."""
    out = {start}
    raw = a[start:end].tobytes()
    i = 0
    while i < len(raw):
        op = raw[i]
        i += 1 + (1 if op in (0x68, 0x4B) else 2 if op == 0x4D else 4 if op in (0x6A, 0x4A)
                  else 1 + raw[i] if op == 0x8A else 0)
        out.add(start + i)
    return out


def _names_of(refs: Any, memo: dict[int, Any], ids: dict[str, int], table: list[Any]
              ) -> Any:
    """Column ids of the names a run of refs (memo indices) points at, assigned in order of
    first appearance as the one-at-a-time path assigns them. ``table`` keeps the refs already
    resolved (sorted) and their ids: a memo index names one value for the whole decode."""
    np = _np()
    keys, values = table
    where = np.minimum(np.searchsorted(keys, refs), max(len(keys) - 1, 0))
    known = keys[where] == refs if len(keys) else np.zeros(len(refs), dtype=bool)
    if not known.all():
        new, first = np.unique(refs[~known], return_index=True)
        got = np.empty(len(new), dtype=np.int64)
        for u in np.argsort(first, kind="stable").tolist():
            try:
                name = memo[int(new[u])]
            except KeyError:
                raise _GiveUp from None
            if type(name) is not str:
                raise _GiveUp
            got[u] = ids.setdefault(name, len(ids))
        keys = np.concatenate((keys, new))
        order = np.argsort(keys, kind="stable")
        table[0], table[1] = keys[order], np.concatenate((values, got))[order]
        keys, values = table
        where = np.searchsorted(keys, refs)
    return values[where]


def _flat(values: Any, count: Any) -> Any:
    np = _np()
    return values[np.arange(values.shape[1])[None, :] < count[:, None]]


def _vector_pairs(data: Any, p: int, window: int, memo: dict[int, Any], reader: _Reader,
                  split: bool) -> tuple[int, int, int, bool, list[int]]:
    """:func:`_vector` of storage_data pairs into the columns: (pairs, end, MEMOIZEs, more)."""
    np = _np()
    k, end, fields, more, splits = _vector(data, p, window, reader.pair_vec, reader,
                                           b"u" if split else b"")
    if not k:
        return 0, p, 0, more, []
    fqn_ref, index, (values, count, memos), path_ref, offset, length = fields
    fid = _names_of(fqn_ref, memo, reader.fqn_ids, reader.fqn_table)
    file = _names_of(path_ref, memo, reader.file_ids, reader.file_table)
    i_values = reader.index_values
    starts = len(i_values) + np.concatenate(([0], np.cumsum(count)[:-1]))
    reader.entry_fqn.frombytes(fid.astype(np.int32).tobytes())
    reader.entry_index.frombytes(index.astype(np.int64).tobytes())
    reader.entry_ndim.frombytes(count.astype(np.int8).tobytes())
    reader.entry_offsets.frombytes(starts.astype(np.int64).tobytes())
    i_values.frombytes(_flat(values, count).astype(np.int64).tobytes())
    reader.entry_file.frombytes(file.astype(np.int32).tobytes())
    reader.entry_offset.frombytes(offset.astype(np.int64).tobytes())
    reader.entry_length.frombytes(length.astype(np.int64).tobytes())
    return k, end, int(4 * k + memos.sum()), more, splits


def _vector_chunks(data: Any, p: int, window: int, reader: _Reader, split: bool
                   ) -> tuple[int, int, int, bool, list[int]]:
    """:func:`_vector` of ChunkStorageMetadata records into the columns."""
    np = _np()
    k, end, fields, more, splits = _vector(data, p, window, reader.chunk_vec, reader,
                                           b"e" if split else b"")
    if not k:
        return 0, p, 0, more, []
    (v1, c1, m1), (v2, c2, m2) = fields
    if (c1 != c2).any():
        raise _GiveUp  # offsets and sizes of different lengths
    values = np.concatenate((v1, v2), axis=1)
    width = np.arange(_MAX_VEC_NDIM)[None, :] < c1[:, None]
    flat = values[np.concatenate((width, width), axis=1)]
    reader.chunk_ndim.frombytes(c1.astype(np.int8).tobytes())
    starts = len(reader.chunk_values) + np.concatenate(([0], np.cumsum(2 * c1)[:-1]))
    reader.chunk_start.frombytes(starts.astype(np.int64).tobytes())
    reader.chunk_values.frombytes(flat.astype(np.int64).tobytes())
    return k, end, int(2 * k + m1.sum() + m2.sum()), more, splits


def decode_columns(data: bytes | bytearray | memoryview | Any, *,
                   vectorised: bool = True) -> MetadataColumns | None:
    """``.metadata`` bytes as :class:`MetadataColumns`, or None when they are not the plain
    ``pickle.dump`` of a DCP ``Metadata`` this fast path reads (the caller then decodes them
    with the bounded interpreter, which accepts or refuses them with its own error).

    ``data`` is any bytes-like object (an ``mmap`` of the file too: nothing is copied); it is
    only read. ``vectorised=False`` reads the per-item records one at a time only (never
    many at once with numpy): the reference the tests compare the default with, which gives
    the same result on every input.
    """
    try:
        heads = _frame_headers(data)
        if heads is None:
            return None
        root, reader = _run(data, heads, vectorised)
        return _assemble(root, reader)
    except (_GiveUp, RecursionError, MemoryError):
        return None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, struct.error):
        return None  # a shape no check above foresaw: the interpreter decides


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
