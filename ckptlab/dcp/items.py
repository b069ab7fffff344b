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

import io
import json
import os
from typing import Any

from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format._paths import open_inside
from ckptlab.format._source import ByteSource
from ckptlab.format._window import FileWindow
from ckptlab.format.archive import scan_torch_zip
from ckptlab.format.layout import ArchiveLayout, TensorInfo
from ckptlab.format.safetensors import looks_like_safetensors, scan_safetensors

__all__ = ["ITEM_ARCHIVE_NBYTES", "MAX_HANDLES", "MAX_OBJECT_NBYTES", "ZIP_MAGIC", "ZSTD_MAGIC",
           "ItemLayouts", "compression_of", "decode_compressed_chunk", "inflate_item",
           "item_layout", "sharding_offsets"]

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


MAX_HANDLES = 32  # data files kept open at once by an ItemLayouts


class ItemLayouts:
    """Per-item layouts, read on demand and shared through templates: a tensor item whose
    bytes up to its data equal those of an item already scanned (same length, dtype and chunk
    shape: the *template*), but for the data record's CRC-32, has the template's layout; any
    other item is scanned in full (:func:`item_layout`). Each data file is opened once,
    inside the directory. Used by :func:`~ckptlab.dcp.inspect_dcp` and
    :mod:`ckptlab.checkpoint._dcp_fast`.

    An item that matches a template shares the template's :class:`ArchiveLayout` object: its
    offsets are relative to the item, so every offset, size, alignment and ``zip64`` is the
    item's own; only ``path`` (``"FILE@OFFSET"`` of the template) and the CRC-32 fields of the
    records (the data's, the serialization id's) are the template's. The bytes after the data
    (the last records and the zip directory) of such an item are not read.

    The bytes come through :meth:`read` and :meth:`scan_item`, local files here; a subclass
    reads them from elsewhere (:class:`ckptlab.dcp.remote.RemoteItems`: URLs).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.handles: dict[str, Any] = {}
        # (length, dtype, chunk sizes) -> [(layout, header bytes, crc position), ...]
        self.templates: dict[tuple[Any, ...], list[tuple[ArchiveLayout, bytes, int]]] = {}
        self.cache: dict[tuple[str, int], ArchiveLayout] = {}

    def handle(self, file: str) -> Any:
        f = self.handles.get(file)
        if f is None:
            if len(self.handles) >= MAX_HANDLES:  # the oldest goes: never 1,024 open files
                self.handles.pop(next(iter(self.handles))).close()
            f = self.handles[file] = open_inside(self.root, file)
        return f

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()

    def read(self, file: str, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` of ``file`` at ``offset`` (fewer at its end), as ``pread``."""
        return os.pread(self.handle(file).fileno(), nbytes, offset)

    def scan_item(self, file: str, offset: int, length: int) -> ArchiveLayout:
        """The layout of the item ``[offset, offset + length)`` of ``file``, read in full."""
        return item_layout(self.handle(file), file, offset, length)

    def scan(self, file: str, fqn: str, offset: int, length: int) -> ArchiveLayout:
        """The item's own layout, read in full (the general path's way)."""
        try:
            return self.scan_item(file, offset, length)
        except ArchiveError as exc:
            raise CorruptArchiveError(f"item is not a torch.save archive: {exc}",
                                      path=os.path.join(self.root, file), record=fqn,
                                      offset=offset) from None

    def layout(self, file: str, fqn: str, offset: int, length: int, key: Any) -> ArchiveLayout:
        """The layout of the tensor item at ``offset``: a template's when the item's bytes up
        to its data are the template's (but for the data record's CRC), else its own."""
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

