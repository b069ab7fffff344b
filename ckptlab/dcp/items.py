"""The items of a DCP directory's data files: each one's own layout, read or shared.

What ``FileSystemWriter`` puts in a data file (torch 2.13, ``filesystem.py``; checked by
``tests/checkpoint/test_dcp_variants.py``), and so what an item is:

- ``SerializationFormat.TORCH_SAVE`` (the default): every item, tensor chunk or object, is one
  torch.save zip at ``[offset, offset + length)``.
- ``SerializationFormat.SAFETENSORS``: the object items are torch.save zips at the start of the
  file; the tensor items write nothing themselves, and one safetensors blob holding every tensor
  of the file (keyed by fqn, ``__metadata__["DCP_SHARDING_INFO"]`` giving each chunk's
  ``saved_offsets``) runs from there to the end of the file. Each tensor item's
  ``_StorageInfo`` says ``offset`` = the blob's first byte and ``length`` = the chunk's
  ``numel * itemsize``. ckptlab models such an item as the blob (``serialization=
  "safetensors"``, ``offset``/``nbytes``/``layout`` those of the blob, shared by the file's
  tensor items) with ``data_offset`` the chunk's bytes inside it. No torch reader reads these
  directories back (``FileSystemReader`` torch.loads every item).
- ``_extensions=[ZStandard()]``: each item's bytes go through a zstd stream writer, so the item
  is one zstd frame (no content size in its header) of the torch.save zip it would otherwise
  be; ``_StorageInfo.transform_descriptors`` is ``["stream.zstd/1"]`` (the only trace in
  ``.metadata``: no extension registry is pickled). Tensor items are not inflated to be
  described (``compression="zstd"``, ``layout=None``); object items are, at most
  :data:`MAX_OBJECT_NBYTES`, to show their values. With SAFETENSORS as well, each tensor item is
  an empty 9-byte frame (its ``length`` still the chunk's bytes) and the blob after the last
  one is not compressed.

Here: an item's layout read through a window on its file (:func:`item_layout`, never the
tensor bytes); the layouts of many items shared through templates (:class:`ItemLayouts`: an
item whose bytes up to its data are those of an item already scanned but for the data's CRC-32
has that item's layout); zstd items inflated, bounded (:func:`inflate_item`,
:func:`decode_compressed_chunk`); a data file's safetensors blob and its
``DCP_SHARDING_INFO`` (:func:`safetensors_blob`, :func:`sharding_offsets`).
"""

from __future__ import annotations

import bisect
import io
import json
import os
import threading
from collections import deque
from typing import Any

from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format.archive import scan_torch_zip
from ckptlab.format.layout import ArchiveLayout, TensorInfo
from ckptlab.format.safetensors import looks_like_safetensors, scan_safetensors
from ckptlab.source import ByteSource, FileWindow, LocalTree, PositionalFile, Tree

__all__ = ["ITEM_ARCHIVE_NBYTES", "MAX_HANDLES", "MAX_OBJECT_NBYTES", "ZIP_MAGIC", "ZSTD_MAGIC",
           "ItemLayouts", "compression_of", "decode_compressed_chunk", "head_nbytes",
           "inflate_item", "item_layout", "item_spans", "raw_items", "sharding_offsets"]

# a compressed object item is inflated to show its value: never to more than this
MAX_OBJECT_NBYTES = 64 << 20
# what the torch.save zip of one chunk adds to the chunk's bytes (record headers, names, the
# pickle, alignment padding, the central directory): about 1.5 KiB at the default 64-byte
# alignment; the bound a compressed chunk may inflate to is numel * itemsize plus this
ITEM_ARCHIVE_NBYTES = 1 << 20
ZIP_MAGIC = b"PK\x03\x04"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# transform descriptors DCP writes (Extension.get_descriptor) -> ckptlab's compression names
_TRANSFORMS = {"stream.zstd": "zstd"}
_SHARDING_INFO = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY


def item_layout(f: io.BufferedReader, file: str, offset: int, nbytes: int) -> ArchiveLayout:
    """The torch.save layout of the item ``[offset, offset + nbytes)`` of the open data file
    ``f`` (named ``file``), read through a window on it: offsets relative to the item, ``path``
    ``"FILE@OFFSET"``; no tensor bytes are read. Raises what a damaged archive raises."""
    name = f"{file}@{offset}"
    with ByteSource(FileWindow(f, offset, nbytes, name)) as src:
        return scan_torch_zip(src)


def _pread(f: io.BufferedReader, offset: int, nbytes: int) -> bytes:
    return os.pread(f.fileno(), nbytes, offset) if nbytes > 0 else b""


def compression_of(descriptors: Any) -> str | None:
    """ckptlab's name for an item's transform descriptors: ``"zstd"`` for
    ``["stream.zstd/1"]``, names joined with ``"+"`` for a chain (in the order they are
    undone, which is the order DCP lists them), a descriptor ckptlab does not know as it is."""
    names = []
    for descriptor in descriptors or ():
        name, _, version = str(descriptor).partition("/")
        known = _TRANSFORMS.get(name)
        names.append(known if known and version.partition(".")[0] == "1" else str(descriptor))
    return "+".join(names) if names else None


def _unzstd(data: bytes, limit: int, where: dict[str, Any]) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise UnsupportedFormatError(
            "the item is zstd-compressed (DCP's ZStandard extension); install the 'zstandard' "
            "package to read it", **where) from None
    if data[:4] != ZSTD_MAGIC:
        raise CorruptArchiveError("compressed item is not a zstd frame",
                                  expected="magic 28 b5 2f fd", actual=data[:4].hex(" "),
                                  **where)
    # zstd inflates at most 128 KiB per 4-byte block: a frame this small cannot hold more,
    # whatever .metadata's shapes claim (so a bogus shape never allocates terabytes)
    limit = min(limit, len(data) << 15)
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CorruptArchiveError(f"zstd frame header is damaged: {exc}", **where) from None
    if declared > limit:  # decompress() would allocate what the header declares
        raise CorruptArchiveError("zstd frame declares more bytes than the item can hold",
                                  expected=f"<= {limit} bytes", actual=f"{declared} bytes",
                                  **where)
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=max(limit, 1))
    except (zstandard.ZstdError, MemoryError) as exc:
        raise CorruptArchiveError(
            f"zstd frame does not inflate to at most {limit} bytes (damaged, truncated or a "
            f"bomb): {exc}", **where) from None


def inflate_item(stored: bytes, compression: str, limit: int, *, path: str,
                 record: str | None = None, offset: int | None = None) -> bytes:
    """An item's bytes as DCP wrote them before its transforms: at most ``limit`` bytes.

    Raises
    ------
    UnsupportedFormatError
        A transform ckptlab does not undo, or zstd without the ``zstandard`` package.
    CorruptArchiveError
        Not a zstd frame, a damaged or truncated one, or one that would inflate past ``limit``.
    """
    where: dict[str, Any] = {"path": path, "record": record, "offset": offset}
    data = stored
    for name in compression.split("+"):
        if name != "zstd":
            raise UnsupportedFormatError(
                f"item transformed by {name!r}, which ckptlab does not undo (it undoes "
                "stream.zstd/1)", **where)
        data = _unzstd(data, limit, where)
    return data


def _span_nbytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    if any(d == 0 for d in shape):
        return 0
    return (sum((d - 1) * s for d, s in zip(shape, stride)) + 1) * itemsize


def _only_tensor(layout: ArchiveLayout, where: dict[str, Any]) -> TensorInfo:
    tensors = [t for t in layout.tensors if t.path == ()]
    if len(tensors) != 1 or len(layout.tensors) != 1:
        raise CorruptArchiveError("a DCP tensor item must hold exactly one tensor",
                                  expected="1 tensor at the root",
                                  actual=f"{len(layout.tensors)} tensors", **where)
    return tensors[0]


def decode_compressed_chunk(stored: bytes, compression: str, *, dtype: str,
                            shape: tuple[int, ...], path: str, record: str | None = None,
                            offset: int | None = None) -> tuple[bytes, tuple[int, ...]]:
    """The bytes and stride of a compressed chunk: ``stored`` inflated (never past the chunk's
    ``numel * itemsize`` plus :data:`ITEM_ARCHIVE_NBYTES`), read as the torch.save zip DCP
    wrote, checked against the dtype and shape ``.metadata`` gives.

    Raises
    ------
    CorruptArchiveError
        A damaged stream, or an inflated item that is not a torch.save zip of one tensor of
        that dtype and shape.
    """
    where: dict[str, Any] = {"path": path, "record": record, "offset": offset}
    itemsize = DTYPE_ITEMSIZE.get(dtype, 1)
    numel = 1
    for d in shape:
        numel *= d
    raw = inflate_item(stored, compression, numel * itemsize + ITEM_ARCHIVE_NBYTES, **where)
    if raw[:4] != ZIP_MAGIC:
        raise CorruptArchiveError("inflated item is not a torch.save archive",
                                  expected="PK\\x03\\x04", actual=raw[:4].hex(" "), **where)
    try:
        with ByteSource(raw) as src:
            layout = scan_torch_zip(src)
    except ArchiveError as exc:
        raise CorruptArchiveError(f"inflated item is not a torch.save archive: {exc}",
                                  **where) from None
    info = _only_tensor(layout, where)
    if info.dtype != dtype or tuple(info.shape) != tuple(shape):
        raise CorruptArchiveError("inflated item holds another tensor than .metadata lists",
                                  expected=f"{dtype} {list(shape)}",
                                  actual=f"{info.dtype} {list(info.shape)}", **where)
    storage = next((s for s in layout.storages if s.key == info.storage_key), None)
    span = _span_nbytes(tuple(shape), tuple(info.stride), itemsize)
    start = info.storage_offset * itemsize
    if storage is None or start + span > storage.nbytes:
        raise CorruptArchiveError("inflated item's tensor runs past its storage",
                                  expected=f"<= {0 if storage is None else storage.nbytes} "
                                  "bytes", actual=f"{start + span} bytes", **where)
    begin = storage.data_offset + start
    return raw[begin:begin + span], tuple(info.stride)


def sharding_offsets(layout: ArchiveLayout) -> dict[str, Any]:
    """``__metadata__["DCP_SHARDING_INFO"]`` of a safetensors blob: fqn -> saved offsets."""
    text = (layout.metadata or {}).get(_SHARDING_INFO)
    if text is None:
        return {}
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):
        info = None
    if not isinstance(info, dict):
        raise CorruptArchiveError(f"{_SHARDING_INFO} is not a JSON object", path=layout.path,
                                  offset=8)
    out = {}
    for fqn, value in info.items():
        offsets = value.get("saved_offsets") if isinstance(value, dict) else None
        if not (isinstance(offsets, list) and all(type(o) is int and o >= 0 for o in offsets)):
            raise CorruptArchiveError(f"{_SHARDING_INFO} has no saved_offsets list of "
                                      "non-negative ints", path=layout.path, record=fqn,
                                      offset=8)
        out[fqn] = tuple(offsets)
    return out


def _safetensors_blob(f: io.BufferedReader, file: str, start: int, file_nbytes: int
                      ) -> ArchiveLayout | None:
    """The safetensors blob ``FileSystemWriter(serialization_format=SAFETENSORS)`` appends to a
    data file: from ``start`` to the end of the file; None when ``start`` holds none."""
    if not looks_like_safetensors(_pread(f, start, 9), file_nbytes - start):
        return None
    name = f"{file}@{start}"
    with ByteSource(FileWindow(f, start, file_nbytes - start, name)) as src:
        return scan_safetensors(src)


def _zstd_frame_end(f: io.BufferedReader, offset: int) -> int | None:
    """Where the zstd frame at ``offset`` ends if it is an empty one (what a tensor item with
    ZStandard writes in the SAFETENSORS format, its ``length`` then being the chunk's bytes, not
    the frame's), else None. Reads at most 64 bytes, which inflate to at most 2 MiB."""
    try:
        import zstandard
    except ImportError:
        return None
    head = _pread(f, offset, 64)
    if head[:4] != ZSTD_MAGIC:
        return None
    try:
        # an empty frame needs no window; a header asking for a large one is not that frame
        obj = zstandard.ZstdDecompressor(max_window_size=1 << 20).decompressobj()
        out = obj.decompress(head)
    except zstandard.ZstdError:
        return None
    if out or not obj.eof:
        return None
    return offset + len(head) - len(obj.unused_data)



def _inflated_object(stored: bytes, compression: str, full: str, fqn: str,
                     offset: int) -> ArchiveLayout | None:
    """The torch.save layout of a compressed object item's inflated bytes (None when ckptlab
    cannot undo its transform: its value then shows as a placeholder)."""
    try:
        raw = inflate_item(stored, compression, MAX_OBJECT_NBYTES, path=full, record=fqn,
                           offset=offset)
    except UnsupportedFormatError:
        return None
    try:
        with ByteSource(raw) as src:
            return scan_torch_zip(src)
    except ArchiveError as exc:
        raise CorruptArchiveError(f"inflated item is not a torch.save archive: {exc}",
                                  path=full, record=fqn, offset=offset) from None


MAX_HANDLES = 32  # local data files kept open at once by an ItemLayouts

# reading items where every read is a request (a source with ``costly_reads``: a URL)
_HEAD = 4096  # bytes of an item read with its head: its records' headers and its pickle
_AHEAD_GAP = 1 << 20  # read-ahead: a gap up to this between item heads is moved through...
_AHEAD_SPAN = 16 << 20  # ... in one request of at most this many bytes
_KEEP = 64 << 20  # bytes of read-ahead and scans kept, over every file (oldest first out)
_WHOLE = 1 << 20  # an item scanned in full is moved whole up to this size...
_EDGE = 64 << 10  # ... else its first this many bytes (what a scan reads)...
_TAIL = _EDGE + 1024  # ... and last (the end-of-directory search reads 64 KiB + 97 bytes)


class ItemLayouts:
    """Per-item layouts, read on demand and shared through templates: a tensor item whose
    bytes up to its data equal those of an item already scanned (same length, dtype and chunk
    shape: the *template*), but for the data record's CRC-32, has the template's layout; any
    other item is scanned in full (:func:`item_layout`). Used by
    :func:`~ckptlab.dcp.inspect_dcp` and :mod:`ckptlab.checkpoint._dcp_fast`.

    An item that matches a template shares the template's :class:`ArchiveLayout` object: its
    offsets are relative to the item, so every offset, size, alignment and ``zip64`` is the
    item's own; only ``path`` (``"FILE@OFFSET"`` of the template) and the CRC-32 fields of the
    records (the data's, the serialization id's) are the template's. The bytes after the data
    (the last records and the zip directory) of such an item are not read.

    The data files are the ``tree``'s (a directory path is a :class:`~ckptlab.source.
    LocalTree`), each opened once as a :class:`~ckptlab.source.ByteSource` (at most
    :data:`MAX_HANDLES` holding a descriptor at once). Where reads are costly (a URL: every
    read a request), a read that misses moves the heads of the neighbouring items with it,
    while the gaps stay under 1 MiB and the request under 16 MiB (a listing of many small
    items costs a few requests, in whichever order it walks the file; one of large items one
    head each); of what it moves, the range asked for and the item heads (4 KiB) are kept, up
    to 64 MiB over every file (oldest first out), not the data between them. An item scanned
    in full is moved whole up to 1 MiB, else its first 64 KiB and last 65 KiB. ``spans`` (file
    -> item starts and ends, in offset order; or a function giving them) is what that
    read-ahead walks. Thread-safe: sources and kept bytes change under :attr:`lock` only.
    """

    def __init__(self, tree: Tree | str | os.PathLike[str],
                 spans: Any = None) -> None:
        self.tree = tree if isinstance(tree, Tree) else LocalTree(tree)
        self.root = self.tree.name
        self.sources: dict[str, ByteSource] = {}  # data file -> its open source
        self._held: dict[str, None] = {}  # files whose source holds a descriptor, oldest first
        self._spans = spans
        self.lock = threading.RLock()
        # (length, dtype, chunk sizes) -> [(layout, header bytes, crc position), ...]
        self.templates: dict[tuple[Any, ...], list[tuple[ArchiveLayout, bytes, int]]] = {}
        self.cache: dict[tuple[str, int], ArchiveLayout] = {}
        self._kept: deque[tuple[str, int, int]] = deque()  # (file, lo, hi) kept, in order
        self._kept_nbytes = 0

    @property
    def spans(self) -> dict[str, tuple[list[int], list[int]]]:
        if callable(self._spans):
            self._spans = self._spans()
        return self._spans or {}

    def source(self, file: str, *, head: int | None = None) -> ByteSource:
        """The data file's source, opened on first use (``head``: the bytes of its head the
        first read wants); the oldest local one is closed past :data:`MAX_HANDLES` (never
        1,024 open files)."""
        with self.lock:
            src = self.sources.get(file)
            if src is None:
                if len(self._held) >= MAX_HANDLES:
                    oldest = next(iter(self._held))
                    del self._held[oldest]
                    self.sources.pop(oldest).close()
                src = self.sources[file] = self.tree.source(file, head=head)
                if src.holds_descriptor:
                    self._held[file] = None
            return src

    def close(self) -> None:
        """Close every source (their kept bytes go with them)."""
        with self.lock:
            for src in self.sources.values():
                src.close()
            self.sources.clear()
            self._held.clear()
            self._kept.clear()
            self._kept_nbytes = 0

    def forget(self) -> None:
        """Drop every kept byte; the sources stay open."""
        with self.lock:
            for src in self.sources.values():
                src.forget()
            self._kept.clear()
            self._kept_nbytes = 0

    def read(self, file: str, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` of ``file`` at ``offset`` (fewer at its end)."""
        with self.lock:
            src = self.sources.get(file) or self.source(file)
            end = min(offset + nbytes, src.nbytes)
            if end <= offset:
                return b""
            if src.costly_reads and src.kept(offset, end - offset) is None:
                self._move(file, *self._around(file, offset, end, max(_HEAD, nbytes)))
            return src.read(offset, end - offset)

    def scan_item(self, file: str, offset: int, length: int) -> ArchiveLayout:
        """The layout of the item ``[offset, offset + length)`` of ``file``, read in full."""
        with self.lock:
            src = self.source(file)
            if src.costly_reads:  # moved in one or two requests, not a request per record
                head = length if length <= _WHOLE else _EDGE
                if src.kept(offset, head) is None:  # else _around would move it again
                    self._move(file, *self._around(file, offset, offset + head))
                if head < length:
                    self._move(file, max(offset + head, offset + length - _TAIL),
                               offset + length)
            return item_layout(PositionalFile(src), file, offset, length)

    # -- moving bytes where reads are costly (under the lock) --------------------------------
    def _move(self, file: str, lo: int, hi: int,
              keep: list[tuple[int, int]] | None = None) -> None:
        """Move ``[lo, hi)`` in one request, unless all of it is kept, and keep it (only the
        ranges ``keep`` of it, when given), dropping the oldest kept ranges past
        :data:`_KEEP`."""
        src = self.sources[file]
        hi = min(hi, src.nbytes)
        if hi <= lo or src.kept(lo, hi - lo) is not None:
            return
        src.forget(lo, hi)  # what is missing is then one range: one request
        src.prefetch([(lo, hi)])
        pieces = [(lo, hi)] if keep is None else _merged(
            [(max(a, lo), min(b, hi)) for a, b in keep if min(b, hi) > max(a, lo)])
        cursor = lo
        for a, b in pieces:  # drop what is not kept (the tensor data moved through)
            if a > cursor:
                src.forget(cursor, a)
            cursor = b
        if cursor < hi:
            src.forget(cursor, hi)
        for a, b in pieces:
            self._kept.append((file, a, b))
            self._kept_nbytes += b - a
        while self._kept_nbytes > _KEEP and len(self._kept) > 1:
            old_file, old_lo, old_hi = self._kept.popleft()
            self._kept_nbytes -= old_hi - old_lo
            old = self.sources.get(old_file)
            if old is not None:
                old.forget(old_lo, old_hi)

    def _around(self, file: str, lo: int, hi: int, head: int = _HEAD
                ) -> tuple[int, int, list[tuple[int, int]]]:
        """What a read of ``[lo, hi)`` that missed moves, and what of it is kept.

        It moves also the heads of the items next to it, before and after (a listing may
        walk a file either way), while the gaps stay under :data:`_AHEAD_GAP` and the span
        under :data:`_AHEAD_SPAN`, and without a kept range inside (so the miss is one
        request, and what is kept is not moved again). It keeps ``[lo, hi)`` and the first
        ``head`` bytes of each item it covers (what is compared with a template): not the
        tensor data after them."""
        starts, ends = self.spans.get(file, ([], []))
        src = self.sources[file]
        kept = src.kept_ranges()
        k = bisect.bisect_right(kept, (lo, float("inf")))
        floor = kept[k - 1][1] if k else 0  # past lo when lo is kept: nothing before
        stop = kept[k][0] if k < len(kept) else src.nbytes
        keep = [(lo, hi)]
        # before: items wholly before lo, nearest first
        j = bisect.bisect_right(starts, lo) - 1
        if j >= 0 and starts[j] < lo < ends[j]:
            j -= 1  # lo is inside item j: its head is moved by the read itself or was before
        first = lo
        while j >= 0:
            a, b = starts[j], min(ends[j], starts[j] + head)
            if first - b > _AHEAD_GAP or hi - a > _AHEAD_SPAN // 2 or a < floor:
                break
            first = a
            keep.append((a, b))
            j -= 1
        # after
        j = bisect.bisect_right(starts, lo)
        while j < len(starts):
            a, b = starts[j], min(ends[j], starts[j] + head)
            if a - hi > _AHEAD_GAP or b - first > _AHEAD_SPAN or b > stop:
                break
            hi = max(hi, b)
            keep.append((a, b))
            j += 1
        return first, hi, keep

    def scan(self, file: str, fqn: str, offset: int, length: int) -> ArchiveLayout:
        """The item's own layout, read in full (the general path's way)."""
        try:
            with self.lock:
                return self.scan_item(file, offset, length)
        except ArchiveError as exc:
            raise CorruptArchiveError(f"item is not a torch.save archive: {exc}",
                                      path=os.path.join(self.root, file), record=fqn,
                                      offset=offset) from None

    def layout(self, file: str, fqn: str, offset: int, length: int, key: Any) -> ArchiveLayout:
        """The layout of the tensor item at ``offset``: a template's when the item's bytes up
        to its data are the template's (but for the data record's CRC), else its own."""
        hit = self.cache.get((file, offset))  # (a dict lookup: safe beside other threads)
        if hit is not None:
            return hit
        with self.lock:
            return self._layout(file, fqn, offset, length, key)

    def _layout(self, file: str, fqn: str, offset: int, length: int, key: Any
                ) -> ArchiveLayout:
        hit = self.cache.get((file, offset))
        if hit is not None:
            return hit
        candidates = self.templates.setdefault(key, [])
        layout = None
        if candidates:
            n = len(candidates[0][1])
            head = self.read(file, offset, n)
            for template, expected, crc in candidates:
                if len(expected) == len(head) and (
                        head[:crc] == expected[:crc] and head[crc + 4:] == expected[crc + 4:]):
                    layout = template
                    break
        if layout is None:
            layout = self.scan(file, fqn, offset, length)
            template = self._template(file, offset, layout)
            if template is not None and len(candidates) < 8:
                candidates.append(template)
        self.cache[(file, offset)] = layout
        return layout

    def blob_first(self, entries: Any) -> bool:
        """Whether some data file's first tensor item (``entries``: the directory's
        :class:`~ckptlab.dcp.columns.EntryColumns`) is not a torch.save zip: a SAFETENSORS
        blob holding a single tensor item (several overlap, which sends the file to the
        general path already). One 4-byte read per data file; a file that cannot be read is
        left to the checks that say why."""
        import numpy as np

        files, file_of, offset = entries.cols.files, entries.file_of, entries.offset
        idx = np.nonzero(entries.tensor_item)[0]
        if not len(idx):
            return False
        order = idx[np.lexsort((offset[idx], file_of[idx]))]
        first = order[np.r_[True, file_of[order][1:] != file_of[order][:-1]]]
        for e in first:
            try:
                head = self.read(files[file_of[e]], int(offset[e]), 4)
            except (OSError, ArchiveError):
                return False
            if head != ZIP_MAGIC:
                return True
        return False

    def _template(self, file: str, offset: int, layout: ArchiveLayout
                  ) -> tuple[ArchiveLayout, bytes, int] | None:
        """A scanned tensor item as a template: its bytes up to the data and where the data
        record's CRC-32 sits in them (the only header field that depends on the data)."""
        if len(layout.storages) != 1 or len(layout.tensors) != 1:
            return None
        storage = layout.storages[0]
        record = next((r for r in layout.records if r.data_offset == storage.data_offset), None)
        if record is None or storage.data_offset > (1 << 20):
            return None
        head = self.read(file, offset, storage.data_offset)
        if len(head) != storage.data_offset:
            return None
        return layout, head, record.header_offset + 14



def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, those that overlap or touch merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


# -- what the columns of .metadata say about the items (no item bytes read) --------------------
def head_nbytes(cols: Any, entries: Any) -> Any:
    """Per data file (an array by file id): how many bytes of its head an open needs (the
    object items before the first tensor item, and that item's 4-byte magic); at least 1
    (behind a URL the size comes with them, in one request)."""
    import numpy as np

    file_of, offset, tensor_item = entries.file_of, entries.offset, entries.tensor_item
    nf = len(cols.files)
    first = np.full(nf, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, file_of[tensor_item], offset[tensor_item])
    need = np.where(first < np.iinfo(np.int64).max, first + 4, 1)
    obj = ~tensor_item
    before = offset[obj] < first[file_of[obj]]
    np.maximum.at(need, file_of[obj][before], (offset + entries.length)[obj][before])
    return need


def raw_items(cols: Any, entries: Any) -> bool:
    """Whether some tensor item is no longer than its chunk's raw bytes: not a torch.save
    zip (which adds its headers, pickle and directory to them) but a SAFETENSORS blob of one
    tensor (several overlap, which ``entries.order`` finds). Decided from the columns, before
    any data file is read."""
    import numpy as np

    volume = entries.volumes  # -1 (no chunk, or too large to say): never raw
    itemsize = np.array([DTYPE_ITEMSIZE.get(cols.tensors[f][0], 1) if f in cols.tensors else 1
                         for f in cols.fqns], dtype=np.int64)[entries.fqn_of]
    return bool(((volume >= 0) & (entries.length <= volume * itemsize)).any())


def item_spans(cols: Any, entries: Any) -> dict[str, tuple[list[int], list[int]]]:
    """Data file -> (item starts, item ends), in offset order (what read-ahead walks)."""
    import numpy as np

    order, file_of, offset, length = entries.order, entries.file_of, entries.offset, \
        entries.length
    spans: dict[str, tuple[list[int], list[int]]] = {}
    if cols.entries and order is not None:
        bounds = np.flatnonzero(np.diff(file_of[order])) + 1
        for group in np.split(order, bounds):
            spans[cols.files[file_of[group[0]]]] = (offset[group].tolist(),
                                                    (offset + length)[group].tolist())
    return spans
