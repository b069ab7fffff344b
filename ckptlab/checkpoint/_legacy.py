"""Legacy ``torch.save`` files (``_use_new_zipfile_serialization=False``, and torch < 1.6).

The file is pickles and raw bytes back to back, as ``torch/serialization.py``'s
``_legacy_save`` writes them and ``_legacy_load`` reads them::

    pickle  magic number 0x1950a86a20f9469cfc6c        segment HEADER  "magic_number"
    pickle  protocol version 1001                      segment HEADER  "protocol_version"
    pickle  sys_info {protocol_version, little_endian,  segment HEADER  "sys_info"
            type_sizes}
    pickle  the object; storages are persistent ids    segment DATA    "pickle"
            ('storage', torch.XStorage, key, location, numel, view_metadata)
    pickle  sorted list of the root storage keys        segment HEADER  "storage_keys"
    then, for each key in that list:
      int64 little-endian element count (== numel)     segment HEADER_LENGTH  key
      numel * itemsize raw bytes                       segment DATA           key

``view_metadata`` is ``None`` in every file torch >= 0.4 writes; older files may name a view
``(view_key, offset, numel)`` of a root storage (offset and numel in elements), which this
module resolves to the root's bytes. A persistent id ``('module', cls, source_file, source)``
(a pickled ``nn.Module`` class) stands for the class itself.

Nothing is executed: the end of each pickle is found by walking its opcodes (lengths only,
payloads skipped, so a multi-GB file is never read whole), then the pickle is interpreted by
ckptlab's bounded interpreter. The storage bytes are never read here.

Protocol-2 files start with the magic pickle ``80 02 8a 0a ...`` (``detect_format`` kind
``legacy-pickle``); files saved with ``pickle_protocol`` 3-5 start with another PROTO or a
FRAME (kind ``pickle``), and are recognised by interpreting their first pickle.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ckptlab.checkpoint._tensors import entries_from_logical
from ckptlab.checkpoint.model import (
    FileEntry,
    TensorEntry,
    plain_value,
    span_nbytes,
    tensor_name,
)
from ckptlab.checkpoint.open import FileModel
from ckptlab.errors import (
    CkptlabError,
    CorruptArchiveError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format._optable import LENGTH_NBYTES, LINE, OPCODE_ARGUMENTS
from ckptlab.format._pickle import (  # the scan's own pieces, shared rather than copied
    PickleScan,
    ScannedTensor,
    scan_pickle_refs,
)
from ckptlab.format._records import replace as replace_record
from ckptlab.format._tensor_refs import StorageRef
from ckptlab.format._unpickle import (
    Global,
    PickleDataError,
    failure_offset,
    interpret,
)
from ckptlab.format.archive import largest_alignment
from ckptlab.format.inspect import not_a_checkpoint
from ckptlab.format.layout import ArchiveLayout, Segment, SegmentKind, StorageInfo
from ckptlab.source._bytes import ByteSource

__all__ = ["MAGIC_NUMBER", "PROTOCOL_VERSION", "check_grad", "check_parts_inside", "model_legacy",
           "model_pickle", "pickle_end", "scan_torch_pickle"]

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
PROTOCOL_VERSION = 1001  # torch.serialization.PROTOCOL_VERSION
COUNT_NBYTES = 8  # the int64 element count before each storage's bytes


# -- where a pickle ends ------------------------------------------------------------------------
_MAX_LINE = 4096  # as the interpreter: protocol-0 text arguments are short
_CHUNK = 1 << 16
_OPCODES = OPCODE_ARGUMENTS  # (the interpreter's table of argument layouts)
_STOP = ord(".")


def pickle_end(src: ByteSource, start: int, *, what: str) -> int:
    """Offset just past the STOP opcode of the pickle starting at ``start``.

    Walks opcodes and their argument lengths only: payloads (bytes, strings) are skipped, never
    read, so finding the end costs reads of the opcodes, not of the data.

    Raises
    ------
    TruncatedArchiveError
        The file ends inside the pickle.
    CorruptArchiveError
        An unknown opcode, a negative length or an over-long text line.
    """
    nbytes = src.nbytes
    buf = b""
    buf_start = start
    pos = start

    def window(n: int) -> int:
        """Make ``buf`` hold ``[pos, pos + n)``; returns the index of ``pos`` in it."""
        nonlocal buf, buf_start
        if pos + n > nbytes:
            raise TruncatedArchiveError(f"file ends inside the {what}", path=src.name,
                                        record=what, offset=pos,
                                        expected=f"{n} more bytes", actual=f"{nbytes - pos}")
        if pos < buf_start or pos + n > buf_start + len(buf):
            buf = src.read(pos, min(max(n, _CHUNK), nbytes - pos), what=what)
            buf_start = pos
        return pos - buf_start

    while True:
        op = pos
        at = window(1)  # (before reading buf: window() may replace it)
        code = buf[at]
        pos += 1
        spec = _OPCODES.get(code)
        if spec is None:
            raise CorruptArchiveError(f"unknown pickle opcode {code:#04x} in the {what}",
                                      path=src.name, record=what, offset=op)
        kind, count = spec
        if code == _STOP:
            return pos
        if kind > 0:
            window(kind)
            pos += kind
        elif kind == LINE:
            for _ in range(count):
                at = window(min(_MAX_LINE, nbytes - pos))
                newline = buf.find(b"\n", at, at + _MAX_LINE)
                if newline < 0 and nbytes - pos < _MAX_LINE:
                    raise TruncatedArchiveError(f"file ends inside the {what}", path=src.name,
                                                record=what, offset=op,
                                                expected="a newline", actual="end of file")
                if newline < 0:
                    raise CorruptArchiveError(
                        f"pickle text argument without a newline within {_MAX_LINE} bytes",
                        path=src.name, record=what, offset=op)
                pos += newline - at + 1
        elif kind < 0:
            width, signed = LENGTH_NBYTES[kind]
            at = window(width)
            length = int.from_bytes(buf[at:at + width], "little", signed=signed)
            pos += width
            if length < 0:
                raise CorruptArchiveError(f"negative length {length} in the {what}",
                                          path=src.name, record=what, offset=op)
            if pos + length > nbytes:
                raise TruncatedArchiveError(f"file ends inside the {what}", path=src.name,
                                            record=what, offset=op,
                                            expected=f"{length} bytes of payload",
                                            actual=f"{nbytes - pos} bytes left")
            pos += length


# -- a torch pickle with ckptlab's scan, and hooks ---------------------------------------------
# the shared scan with its hooks (persistent_load=, handlers=); the old name stays
scan_torch_pickle = scan_pickle_refs


def check_parts_inside(logical: Iterable[ScannedTensor], storages: dict[str, StorageInfo],
                       path: str) -> None:
    """Every part's elements lie inside its storage (torch's ``set_`` refuses the others)."""
    for t in logical:
        for role, info in t.parts:
            if not info.storage_key:
                continue
            storage = storages.get(info.storage_key)
            if storage is None:
                raise CorruptArchiveError(f"tensor views storage {info.storage_key!r}, which "
                                          "has no bytes in the file", path=path,
                                          record=tensor_label(t, role))
            itemsize = DTYPE_ITEMSIZE[info.dtype]
            span = span_nbytes(info.shape, info.stride, itemsize)
            end = info.storage_offset * itemsize + span
            if span and end > storage.nbytes:  # an empty view may start anywhere, as in torch
                raise CorruptArchiveError(
                    "tensor reaches past the end of its storage", path=path,
                    record=tensor_label(t, role), offset=storage.data_offset,
                    expected=f"<= {storage.nbytes} bytes of storage {info.storage_key!r}",
                    actual=f"{end} bytes (offset {info.storage_offset}, shape {info.shape}, "
                           f"stride {info.stride})")


def check_grad(entries: Iterable[TensorEntry], path: str) -> None:
    """``requires_grad`` only on floating and complex tensors (torch refuses the others)."""
    for e in entries:
        if e.requires_grad and not e.dtype.startswith(("float", "bfloat", "complex")):
            raise CorruptArchiveError(f"a {e.dtype} tensor saved with requires_grad (torch "
                                      "refuses: only floating point and complex tensors can "
                                      "require gradients)", path=path, record=e.name,
                                      offset=e.offset)


def tensor_label(t: ScannedTensor, role: str = "data") -> str:
    name = tensor_name(t.path)
    return name if role == "data" else f"{name} ({role})"


def storage_dtypes(scan: PickleScan) -> dict[str, str]:
    """The dtype each storage is first viewed with (what an ``UntypedStorage`` holds)."""
    out: dict[str, str] = {}
    for t in scan.tensors:
        out.setdefault(t.storage_key, t.dtype)
    return out


# -- the legacy file -----------------------------------------------------------------------------
class _LegacyIds:
    """Persistent ids of legacy files: 6-field storages (with views) and pickled classes."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.views: dict[str, tuple[str, int, int]] = {}  # view key -> (root key, offset, numel)
        self.view_refs: dict[str, StorageRef] = {}

    def __call__(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid:
            raise PickleDataError(f"unexpected persistent id of type {type(pid).__name__}")
        if pid[0] == "module" and len(pid) == 4:
            if not isinstance(pid[1], Global):
                raise PickleDataError("a 'module' persistent id without a class")
            return pid[1]
        if pid[0] != "storage" or len(pid) not in (5, 6):
            first = pid[0][:40] if isinstance(pid[0], str) else type(pid[0]).__name__
            raise PickleDataError(f"unexpected persistent id ({len(pid)} fields, first "
                                  f"{first!r})")
        storage_type = pid[1]
        if isinstance(storage_type, Global) and storage_type.module == "torch.cuda":
            storage_type = Global("torch", storage_type.name)  # pre-1.0 GPU files
        root = self.state.persistent_load(("storage", storage_type, *pid[2:5]))
        if root.key in self.views:
            raise PickleDataError(f"storage key {root.key[:40]!r} names both a storage and a "
                                  "view")
        view = pid[5] if len(pid) == 6 else None
        if view is None:
            return root
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str) and
                all(type(v) is int and v >= 0 for v in view[1:])):
            raise PickleDataError("storage view metadata is not (key, offset, numel)")
        key, offset, numel = view
        if key in self.state.storages:
            raise PickleDataError(f"storage key {key[:40]!r} names both a storage and a view")
        if offset + numel > root.numel:
            raise PickleDataError(f"storage view [{offset}, {offset + numel}) past the end of "
                                  f"its storage of {root.numel} elements")
        if key not in self.views:  # torch keeps the first view under a key
            self.views[key] = (root.key, offset, numel)
            self.view_refs[key] = StorageRef(key, root.storage_type, root.dtype, root.location,
                                             numel, numel * DTYPE_ITEMSIZE[root.dtype])
        return self.view_refs[key]


def _small_pickle(src: ByteSource, start: int, what: str) -> tuple[Any, int]:
    """Value and end of one of the small pickles (nothing in them runs or is imported)."""
    end = pickle_end(src, start, what=what)
    try:
        value = interpret(src.read(start, end - start, what=what)).root
    except PickleDataError as exc:
        raise CorruptArchiveError(f"the {what} pickle cannot be interpreted: {exc}",
                                  path=src.name, record=what,
                                  offset=start + failure_offset(exc)) from None
    return value, end


def _is_magic(src: ByteSource) -> bool:
    try:
        value, _ = _small_pickle(src, 0, "magic_number")
    except CkptlabError:
        return False
    return type(value) is int and value == MAGIC_NUMBER


def model_pickle(src: ByteSource, rel: str) -> FileModel:
    """A file that starts with a pickle: a legacy torch.save file of pickle protocol 3-5, or
    refused as a plain pickle."""
    if not _is_magic(src):
        raise not_a_checkpoint(src, "pickle")
    return model_legacy(src, rel)


def model_legacy(src: ByteSource, rel: str) -> FileModel:
    """The file model of a legacy torch.save file (see the module docstring)."""
    segments: list[Segment] = []
    magic, cursor = _small_pickle(src, 0, "magic_number")
    if not (type(magic) is int and magic == MAGIC_NUMBER):
        raise not_a_checkpoint(src, "pickle")
    segments.append(Segment(SegmentKind.HEADER, 0, cursor, "magic_number"))
    start = cursor
    version, cursor = _small_pickle(src, cursor, "protocol_version")
    if not (type(version) is int and version == PROTOCOL_VERSION):
        raise UnsupportedFormatError("legacy torch.save protocol version ckptlab does not know",
                                     path=src.name, record="protocol_version", offset=start,
                                     expected=PROTOCOL_VERSION,
                                     actual=repr(plain_value(version))[:60])
    segments.append(Segment(SegmentKind.HEADER, start, cursor - start, "protocol_version"))
    start = cursor
    sys_info, cursor = _small_pickle(src, cursor, "sys_info")
    segments.append(Segment(SegmentKind.HEADER, start, cursor - start, "sys_info"))

    start = cursor
    cursor = pickle_end(src, start, what="pickle")
    ids: list[_LegacyIds] = []  # the one reader the scan makes

    def loader(state: Any) -> _LegacyIds:
        ids.append(_LegacyIds(state))
        return ids[-1]

    scan, _ = scan_torch_pickle(src.read(start, cursor - start, what="object pickle"),
                                path=src.name, record="pickle", data_offset=start,
                                persistent_load=loader)
    segments.append(Segment(SegmentKind.DATA, start, cursor - start, "pickle"))
    views = ids[0].views if ids else {}

    start = cursor
    keys, cursor = _small_pickle(src, cursor, "storage_keys")
    segments.append(Segment(SegmentKind.HEADER, start, cursor - start, "storage_keys"))
    roots = {s.key: s for s in scan.storages}
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CorruptArchiveError("the storage key list is not a list of strings",
                                  path=src.name, record="storage_keys", offset=start)
    if len(set(keys)) != len(keys):
        raise CorruptArchiveError("the storage key list names a storage twice", path=src.name,
                                  record="storage_keys", offset=start)
    unknown = [k for k in keys if k not in roots]
    if unknown:
        raise CorruptArchiveError(f"the storage key list names {len(unknown)} storages the "
                                  f"pickle never uses (first {unknown[0][:40]!r})",
                                  path=src.name, record="storage_keys", offset=start)
    listed = set(keys)
    missing = [k for k in roots if k not in listed]
    if missing:
        raise CorruptArchiveError(f"{len(missing)} storages of the pickle have no bytes in the "
                                  f"file (first {missing[0][:40]!r} is not in the key list)",
                                  path=src.name, record="storage_keys", offset=start)

    dtypes = storage_dtypes(scan)
    infos: dict[str, StorageInfo] = {}
    for key in keys:
        ref = roots[key]
        raw = src.read(cursor, COUNT_NBYTES, what=f"element count of storage {key}", record=key)
        count = int.from_bytes(raw, "little", signed=True)
        if count != ref.numel:
            raise CorruptArchiveError("storage element count differs from the pickle's",
                                      path=src.name, record=key, offset=cursor,
                                      expected=f"{ref.numel} ({ref.storage_type})",
                                      actual=count)
        data_offset = cursor + COUNT_NBYTES
        if data_offset + ref.nbytes > src.nbytes:
            raise TruncatedArchiveError("file ends inside a storage's bytes", path=src.name,
                                        record=key, offset=data_offset,
                                        expected=f"{ref.nbytes} bytes",
                                        actual=f"{src.nbytes - data_offset} bytes")
        segments.append(Segment(SegmentKind.HEADER_LENGTH, cursor, COUNT_NBYTES, key))
        if ref.nbytes:
            segments.append(Segment(SegmentKind.DATA, data_offset, ref.nbytes, key))
        dtype = ref.dtype if ref.storage_type != "UntypedStorage" else dtypes.get(key, "uint8")
        infos[key] = StorageInfo(key, key, dtype, ref.nbytes, data_offset, ref.location,
                                 ref.storage_type)
        cursor = data_offset + ref.nbytes
    notes: tuple[str, ...] = ()
    if cursor < src.nbytes:
        segments.append(Segment(SegmentKind.UNKNOWN, cursor, src.nbytes - cursor))
        notes = (f"{src.nbytes - cursor} bytes after the last storage (torch.load ignores "
                 "them)",)
    for key, (root_key, offset, numel) in views.items():
        root = infos[root_key]
        itemsize = DTYPE_ITEMSIZE[root.dtype]
        infos[key] = replace_record(root, key=key, nbytes=numel * itemsize,
                                         data_offset=root.data_offset + offset * itemsize)
    check_parts_inside(scan.logical, infos, src.name)
    storages = tuple(infos.values())
    layout = ArchiveLayout(
        format="torch-legacy", path=src.name, file_nbytes=src.nbytes, archive_name="",
        records=(), storages=storages, tensors=scan.tensors, segments=tuple(segments),
        alignment=largest_alignment([s.data_offset for s in storages if s.nbytes]),
        zip64=False, pickle_protocol=scan.protocol,
        metadata={"magic_number": hex(MAGIC_NUMBER), "protocol_version": str(version),
                  "sys_info": json.dumps(plain_value(sys_info), sort_keys=True)},
        logical=scan.logical, objects=scan.objects)
    tensors = entries_from_logical(scan.logical, infos, rel)
    check_grad(tensors, src.name)
    entry = FileEntry(rel, "torch-legacy", src.nbytes, layout.segments, layout)
    return FileModel(entry, tensors, list(scan.objects), "torch-legacy", notes)
