"""A real DCP checkpoint directory, read safely: ``.metadata`` and every item in the data files.

``.metadata`` is a pickle. Loading it with ``pickle`` runs whatever it names, so it is read by
ckptlab's bounded interpreter and only an allow-list of DCP metadata classes, checked field by
field, becomes real objects (:mod:`ckptlab.plan._metadata_pickle`). Each item in a ``.distcp``
file is an independent torch.save zip; its layout is read with :mod:`ckptlab.format` through a
window on the file, without reading tensor bytes.

That general path costs about 2 ms an item (the interpreter builds ten objects per item, and
every zip is scanned): 5,000 items took 5 s of CPU. A directory in DCP's default format
(torch.save items, no transforms) is read instead as :func:`ckptlab.open` reads it:
``.metadata`` decoded into typed columns (:mod:`ckptlab.plan._metadata_columns`), and each
tensor item's layout shared with an earlier item whose bytes up to the data are the same
(:class:`_ItemLayouts`); ``DcpLayout.metadata`` is then decoded on first access. The result
is equal to the general path's (``tests/plan/test_inspect_dcp_fast.py``), which takes over for
anything else and for every error.

What ``FileSystemWriter`` puts in a data file (torch 2.13, ``filesystem.py``; checked by
``tests/checkpoint/test_dcp_variants.py``):

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
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format._paths import check_regular, open_inside, resolve_inside
from ckptlab.format._source import ByteSource
from ckptlab.format._window import FileWindow
from ckptlab.format.archive import largest_alignment, scan_torch_zip
from ckptlab.format.layout import ArchiveLayout, TensorInfo
from ckptlab.format.safetensors import looks_like_safetensors, scan_safetensors
from ckptlab.plan._metadata_pickle import MetadataDecodeError, decode_metadata

__all__ = ["DcpItem", "DcpLayout", "compression_of", "decode_compressed_chunk", "inflate_item",
           "inspect_dcp", "is_dcp_dir", "load_metadata"]

METADATA = ".metadata"
MAX_METADATA_NBYTES = 1 << 30
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


def load_metadata(path: str | os.PathLike[str]) -> Any:
    """``torch.distributed.checkpoint.metadata.Metadata`` of a DCP directory, read safely.

    Raises
    ------
    UnsupportedFormatError
        When ``.metadata`` names anything outside the allow-list (a malicious or foreign
        pickle): nothing it names is imported or called.
    ArchiveError
        When it is missing, truncated or not a pickle of DCP Metadata.
    """
    meta_path = os.path.join(os.fspath(path), METADATA)
    try:
        # a regular file inside the directory: not a symlink out of it, not a FIFO
        with open_inside(path, METADATA) as f:
            nbytes = os.fstat(f.fileno()).st_size
            if nbytes > MAX_METADATA_NBYTES:
                raise CorruptArchiveError("metadata larger than 1 GiB", path=meta_path,
                                          expected=f"<= {MAX_METADATA_NBYTES} bytes",
                                          actual=f"{nbytes} bytes")
            data = f.read(nbytes)  # read(n) allocates n bytes up front: never more than the file
    except OSError as exc:
        raise ArchiveError(f"cannot read DCP metadata: {exc.strerror}", path=meta_path) from None
    return metadata_of(data, meta_path)


def metadata_of(data: bytes, meta_path: str) -> Any:
    """:func:`load_metadata` of ``.metadata``'s bytes (read from ``meta_path``, which errors
    name): the same bounded decoding, the same errors."""
    try:
        return decode_metadata(data)
    except MetadataDecodeError as exc:
        error = UnsupportedFormatError if exc.foreign else CorruptArchiveError
        message = str(exc) if exc.offset is not None else \
            f"not DCP Metadata ckptlab can read safely: {exc}"
        raise error(message, path=meta_path, offset=exc.offset) from None


def is_dcp_dir(path: str | os.PathLike[str]) -> bool:
    # any .metadata that is not a directory: a FIFO or a symlink out of the directory is a DCP
    # directory that load_metadata refuses with the reason, not "not a checkpoint file"
    meta = os.path.join(os.fspath(path), METADATA)
    return os.path.isdir(path) and os.path.lexists(meta) and not os.path.isdir(meta)


@dataclass(frozen=True, slots=True)
class DcpItem:
    """One stored item: a chunk of a tensor, or a pickled object, in one data file."""

    fqn: str  # fully qualified name in the state dict ("model.layers.0.weight")
    kind: str  # "tensor" or "bytes"
    chunk_offsets: tuple[int, ...]  # where the chunk starts in the global tensor (tensor items)
    chunk_sizes: tuple[int, ...]  # the chunk's shape (tensor items)
    index: int | None  # the chunk's index in the tensor's chunk list
    file: str  # data file relative to the directory ("__0_0.distcp")
    offset: int  # first byte of the item (a torch.save zip, a zstd frame, a safetensors blob)
    nbytes: int  # bytes of the item as stored
    dtype: str | None  # tensor items: the tensor's dtype
    data_offset: int | None  # tensor items: where the chunk's bytes start in the file (None
    #                          when they are compressed)
    layout: ArchiveLayout | None  # the item's own layout, offsets inside the item: its
    #   torch.save zip (of the inflated bytes for a compressed object), or the file's safetensors
    #   blob (shared by the file's tensor items); None for a compressed tensor chunk
    serialization: str = "torch-save"  # "torch-save" (a zip per item) or "safetensors"
    compression: str | None = None  # "zstd" when the stored bytes must be inflated to read
    transforms: tuple[str, ...] = ()  # .metadata's transform_descriptors ("stream.zstd/1")

    @property
    def data_alignment(self) -> int | None:
        """Largest power of two (<= 4096) dividing ``data_offset``: what O_DIRECT / GDS see."""
        return None if self.data_offset is None else largest_alignment([self.data_offset])

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "kind": self.kind, "chunk_offsets": list(self.chunk_offsets),
                "chunk_sizes": list(self.chunk_sizes), "index": self.index, "file": self.file,
                "offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
                "data_offset": self.data_offset, "data_alignment": self.data_alignment,
                "serialization": self.serialization, "compression": self.compression,
                "transforms": list(self.transforms)}


@dataclass(frozen=True, slots=True)
class DcpLayout:
    """A DCP checkpoint directory: its metadata, its data files and every item in them."""

    path: str
    metadata: Any  # torch.distributed.checkpoint.metadata.Metadata (read safely)
    metadata_nbytes: int
    files: tuple[tuple[str, int], ...]  # (data file, bytes), sorted by name
    items: tuple[DcpItem, ...]  # in file, then offset order

    format = "dcp"

    @property
    def file_nbytes(self) -> int:
        """Bytes of the checkpoint: metadata plus every data file."""
        return self.metadata_nbytes + sum(n for _, n in self.files)

    @property
    def tensors(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """fqn -> (dtype, global shape, number of chunks) for every tensor in the metadata."""
        out = {}
        for fqn, md in self.metadata.state_dict_metadata.items():
            if hasattr(md, "chunks"):
                out[fqn] = (str(md.properties.dtype).removeprefix("torch."), tuple(md.size),
                            len(md.chunks))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``ckptlab inspect DIR --json`` object (DESIGN's schema plus ``items``)."""
        data = [i.data_offset for i in self.items if i.data_offset is not None and
                i.layout is not None and any(s.nbytes for s in i.layout.storages)]
        return {
            "format": "dcp", "path": self.path, "file_nbytes": self.file_nbytes,
            "archive_name": "", "alignment": largest_alignment(data) if data else 4096,
            "zip64": any(i.layout is not None and i.layout.zip64 for i in self.items),
            "metadata_nbytes": self.metadata_nbytes,
            "files": [{"name": n, "nbytes": b} for n, b in self.files],
            "records": [], "storages": [],
            "tensors": [{"path": [fqn], "dtype": dtype, "shape": list(shape), "chunks": n}
                        for fqn, (dtype, shape, n) in self.tensors.items()],
            "items": [i.to_dict() for i in self.items],
        }


def _item_layout(f: io.BufferedReader, file: str, offset: int, nbytes: int) -> ArchiveLayout:
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


def _sharding_offsets(layout: ArchiveLayout) -> dict[str, Any]:
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


def _data_files(root: str, names: list[str], *, listed: bool = False) -> dict[str, int]:
    """Bytes of each file ``names`` gives, relative to ``root``; none may leave ``root``.

    Every name is resolved (:func:`ckptlab.format._paths.resolve_inside`): ``..``, absolute
    names and symlinks out of the directory raise :class:`ArchiveError`, and so does a
    FIFO, device or socket. With ``listed`` (names from ``os.listdir``, not from the
    metadata) such entries and subdirectories are left out instead, and a name that cannot be
    stat'ed is too; a name the metadata gives that does not exist is left out (the caller
    reports the missing file).
    """
    out = {}
    for name in names:
        full = os.path.join(root, name)
        try:
            real = resolve_inside(root, name)
            info = os.stat(real)
        except ArchiveError:
            if listed:
                continue
            raise
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and listed:
            continue
        if not stat.S_ISREG(info.st_mode):
            if listed:
                continue
            check_regular(info.st_mode, full)
        out[name] = info.st_size
    return out


# -- the fast path: .metadata as columns, item layouts shared through templates ---------------
_MAX_HANDLES = 32  # data files kept open at once by an _ItemLayouts


class _ItemLayouts:
    """Per-item layouts, read on demand and shared through templates: a tensor item whose
    bytes up to its data equal those of an item already scanned (same length, dtype and chunk
    shape: the *template*), but for the data record's CRC-32, has the template's layout; any
    other item is scanned in full (:func:`_item_layout`). Each data file is opened once,
    inside the directory. Used by :func:`inspect_dcp` and :mod:`ckptlab.checkpoint._dcp_fast`.

    An item that matches a template shares the template's :class:`ArchiveLayout` object: its
    offsets are relative to the item, so every offset, size, alignment and ``zip64`` is the
    item's own; only ``path`` (``"FILE@OFFSET"`` of the template) and the CRC-32 fields of the
    records (the data's, the serialization id's) are the template's. The bytes after the data
    (the last records and the zip directory) of such an item are not read.

    The bytes come through :meth:`read` and :meth:`scan_item`, local files here; a subclass
    reads them from elsewhere (:class:`ckptlab.checkpoint._dcp_remote.RemoteItems`: URLs).
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
            if len(self.handles) >= _MAX_HANDLES:  # the oldest goes: never 1,024 open files
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
        return _item_layout(self.handle(file), file, offset, length)

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


def _metadata_identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _read_columns(root: str) -> tuple[Any, int, tuple[int, ...]] | None:
    """``.metadata`` (a regular file inside ``root``, at most 1 GiB) decoded into columns
    (:func:`ckptlab.plan._metadata_columns.decode_columns`), with its size and identity
    (device, inode, size, mtime); None where the general path should decide (and say what is
    wrong).

    The file is mapped, not copied: the decoder reads the pages straight from the page cache,
    so a 127 MB ``.metadata`` does not become 127 MB of process memory."""
    import mmap

    from ckptlab.plan._metadata_columns import decode_columns

    try:
        with open_inside(root, METADATA) as f:
            info = os.fstat(f.fileno())
            nbytes = info.st_size
            if not 0 < nbytes <= MAX_METADATA_NBYTES:
                return None
            with mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ) as data:
                cols = decode_columns(data)
    except (OSError, ValueError, ArchiveError):
        return None
    return (cols, nbytes, _metadata_identity(info)) if cols is not None else None


def _load_unchanged(root: str, identity: tuple[int, ...]) -> Any:
    """:func:`load_metadata` of ``root``, refused when ``.metadata`` is no longer the file the
    layout was built from (another inode, size or mtime)."""
    meta_path = os.path.join(root, METADATA)
    try:
        now = _metadata_identity(os.stat(meta_path))
    except OSError as exc:
        raise ArchiveError(f"cannot read DCP metadata: {exc.strerror}", path=meta_path) from None
    if now != identity:
        raise CorruptArchiveError(
            ".metadata changed since the directory was inspected; inspect it again",
            path=meta_path, expected=f"size {identity[2]}, mtime_ns {identity[3]}",
            actual=f"size {now[2]}, mtime_ns {now[3]}")
    return load_metadata(root)


_PENDING = object()
_METADATA_SLOT = DcpLayout.__dict__["metadata"]  # the slot under the property below


class _ColumnarDcpLayout(DcpLayout):
    """A :class:`DcpLayout` built from ``.metadata``'s columns: ``tensors`` comes from the
    columns, and ``metadata`` (DCP's ``Metadata`` object, which the bounded interpreter
    takes about 10x longer to build than the columns) is decoded on first access, from the
    same file (refused if it changed since). Equal to, and pickled as, a plain
    :class:`DcpLayout`."""

    __slots__ = ("_loader", "_tensor_rows")

    def __init__(self, path: str, metadata: Any, metadata_nbytes: int,
                 files: tuple[tuple[str, int], ...], items: tuple[DcpItem, ...], *,
                 tensors: dict[str, tuple[str, tuple[int, ...], int]] | None = None,
                 loader: Any = None) -> None:
        for name, value in (("path", path), ("metadata_nbytes", metadata_nbytes),
                            ("files", files), ("items", items)):
            DcpLayout.__dict__[name].__set__(self, value)
        _METADATA_SLOT.__set__(self, metadata)
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_tensor_rows", tensors)

    @property  # type: ignore[override]
    def metadata(self) -> Any:
        value = _METADATA_SLOT.__get__(self, type(self))
        if value is _PENDING:
            value = self._loader()
            _METADATA_SLOT.__set__(self, value)
        return value

    @property
    def tensors(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        if self._tensor_rows is not None:
            return dict(self._tensor_rows)
        return DcpLayout.tensors.fget(self)  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DcpLayout):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name)
                   for f in dataclasses.fields(DcpLayout))

    __hash__ = DcpLayout.__hash__

    def __reduce__(self) -> Any:
        return (DcpLayout, (self.path, self.metadata, self.metadata_nbytes, self.files,
                            self.items))


def _columns_layout(root: str, cols: Any, metadata_nbytes: int, identity: tuple[int, ...],
                   files: dict[str, int], layouts: _ItemLayouts, rows: Any, *,
                   object_layouts: dict[int, ArchiveLayout] | None = None,
                   item_layouts: bool = True, loader: Any = None) -> DcpLayout:
    """The :class:`DcpLayout` of a directory in DCP's default format (torch.save items, no
    transforms, no overlapping items, no duplicate keys: the caller checked) from its
    columns: the same items, in the same order, with the same fields as the general path of
    :func:`inspect_dcp`, each tensor item's layout from ``layouts`` (templates).

    ``rows`` maps each storage entry to its chunk row (-1: none;
    :func:`ckptlab.plan._metadata_columns.chunk_rows`); ``object_layouts`` holds the layouts
    of object entries already scanned (by entry); ``loader`` decodes ``.metadata`` when the
    layout's ``metadata`` is first asked for (default: from ``root``, refused if it changed
    since it had ``identity``). Raises what a damaged item raises.
    """
    fqns, names = cols.fqns, cols.files
    e_fqn, e_file, e_index = cols.entry_fqn, cols.entry_file, cols.entry_index
    e_offset, e_length = cols.entry_offset, cols.entry_length
    tensors = cols.tensors
    known = object_layouts or {}
    items = []
    for e in range(cols.entries):
        fqn = fqns[e_fqn[e]]
        file = names[e_file[e]]
        offset = e_offset[e]
        length = e_length[e]
        if file not in files:
            raise CorruptArchiveError("an item's data file is missing",
                                      path=os.path.join(root, file), record=fqn)
        if offset + length > files[file]:
            raise CorruptArchiveError(
                "an item runs past the end of its data file", path=os.path.join(root, file),
                record=fqn, offset=offset, expected=f"end <= {files[file]}",
                actual=f"end {offset + length}")
        index = e_index[e]
        t = tensors.get(fqn)
        if t is None:
            layout = None
            if item_layouts:
                layout = known.get(e) or layouts.scan(file, fqn, offset, length)
            items.append(DcpItem(fqn, "bytes", (), (), index if index >= 0 else None, file,
                                 offset, length, None, None, layout))
            continue
        row = int(rows[e])
        chunk_offsets, sizes = cols.chunk(row) if row >= 0 else ((), ())
        data_offset = layout = None
        if item_layouts:
            layout = layouts.layout(file, fqn, offset, length, (length, t[0], sizes))
            if layout.storages:
                data_offset = offset + layout.storages[0].data_offset
        items.append(DcpItem(fqn, "tensor", chunk_offsets, sizes,
                             index if index >= 0 else None, file, offset, length, t[0],
                             data_offset, layout))
    items.sort(key=lambda i: (i.file, i.offset))
    return _ColumnarDcpLayout(
        root, _PENDING, metadata_nbytes, tuple(files.items()), tuple(items),
        tensors={fqn: (t[0], t[2], t[4]) for fqn, t in tensors.items()},
        loader=loader or (lambda: _load_unchanged(root, identity)))


def _inspect_columns(path: str, item_layouts: bool) -> DcpLayout | None:
    """:func:`inspect_dcp` through the columns, or None where the general path must decide:
    a ``.metadata`` the columnar decoder does not read, transforms, items that overlap
    (SAFETENSORS), equal storage keys, or anything wrong (the general path then raises its
    own error, or reads an item the fast path does not, such as a safetensors blob)."""
    from ckptlab.plan._metadata_columns import EntryColumns

    read = _read_columns(path)
    if read is None:
        return None
    cols, metadata_nbytes, identity = read
    if cols.transforms or not cols.has_storage_data:
        return None
    entries = EntryColumns(cols)
    if entries.order is None:  # overlapping items (SAFETENSORS), equal keys
        return None
    layouts = _ItemLayouts(path)
    try:
        files = _data_files(path, [name for name in sorted(os.listdir(path))
                                   if name != METADATA], listed=True)
        files.update(_data_files(path, sorted(set(cols.files) - set(files))))
        return _columns_layout(path, cols, metadata_nbytes, identity, files, layouts,
                              entries.rows, item_layouts=item_layouts)
    except (ArchiveError, OSError):
        return None
    finally:
        layouts.close()


def inspect_dcp(path: str | os.PathLike[str], *, item_layouts: bool = True,
                fast: bool = True) -> DcpLayout:
    """The layout of a DCP checkpoint directory, read without executing its pickle.

    Parameters
    ----------
    path
        The directory ``dcp.save`` wrote (``.metadata`` plus ``*.distcp`` files).
    item_layouts
        Also read each item's own layout (its torch.save headers, pickle and central directory,
        or its file's safetensors header; never the tensor bytes). Without it nothing but
        ``.metadata`` is read, and every item is taken for a torch.save zip.
    fast
        Read a directory in DCP's default format (torch.save items, no transforms) the way
        :func:`ckptlab.open` does: ``.metadata`` decoded into columns, never into one object
        per item, and each tensor item's layout shared with an earlier item whose bytes up to
        the data are the same but for the data's CRC-32 (only items that differ are scanned
        in full; the bytes after a shared item's data are not read). The result is equal to
        the general path's (``fast=False``: every item scanned, ``.metadata`` decoded by the
        bounded interpreter), which takes over for every other directory and for any error.
        ``metadata`` is then decoded on first access.

    Returns
    -------
    DcpLayout
        Items sorted by file and offset; tensor items carry their chunk's offsets and sizes in
        the global tensor and the absolute file offset of their bytes (see the module docstring
        for the SAFETENSORS serialization and compressed items).
    """
    path = os.fspath(path)
    if fast:
        quick = _inspect_columns(path, item_layouts)
        if quick is not None:
            return quick
    meta = load_metadata(path)
    metadata_nbytes = _data_files(path, [METADATA])[METADATA]
    files = _data_files(path, [name for name in sorted(os.listdir(path)) if name != METADATA],
                        listed=True)
    entries = []
    handles: dict[str, io.BufferedReader] = {}

    def handle(file: str) -> io.BufferedReader:
        if file not in handles:
            handles[file] = open_inside(path, file)  # inside the directory, regular
        return handles[file]

    try:
        referenced = {str(info.relative_path) for info in meta.storage_data.values()}
        files.update(_data_files(path, sorted(referenced - set(files))))  # refuses escapes
        for index, info in meta.storage_data.items():
            file = str(info.relative_path)
            if file not in files:
                raise CorruptArchiveError("an item's data file is missing",
                                          path=os.path.join(path, file), record=index.fqn)
            if info.offset < 0 or info.length < 0 or info.offset + info.length > files[file]:
                raise CorruptArchiveError(
                    "an item runs past the end of its data file", path=os.path.join(path, file),
                    record=index.fqn, offset=info.offset,
                    expected=f"end <= {files[file]}", actual=f"end {info.offset + info.length}")
            md = meta.state_dict_metadata.get(index.fqn)
            is_tensor = md is not None and hasattr(md, "chunks")
            chunk = None
            if is_tensor:
                chunk = (md.chunks[index.index] if index.index is not None
                         and index.index < len(md.chunks) else None)
                if chunk is None:
                    chunk = next((c for c in md.chunks if index.offset is not None
                                  and tuple(c.offsets) == tuple(index.offset)), None)
            transforms = tuple(getattr(info, "transform_descriptors", None) or ())
            entries.append((index, info, file, md if is_tensor else None, chunk, transforms))
        # which tensor items are in a safetensors blob, and where each file's blob starts
        serialization: dict[int, str] = {}
        blob_start: dict[str, int] = {}
        for n, (_, info, file, md, _, transforms) in enumerate(entries):
            if md is None or not item_layouts:
                continue
            if not transforms:
                head = _pread(handle(file), info.offset, 9)
                if head[:4] != ZIP_MAGIC and looks_like_safetensors(head,
                                                                    files[file] - info.offset):
                    serialization[n] = "safetensors"
                    blob_start[file] = max(blob_start.get(file, 0), info.offset)
            elif compression_of(transforms) is not None:
                end = _zstd_frame_end(handle(file), info.offset)
                if end is not None:  # an empty frame: the chunk is in the blob after it
                    serialization[n] = "safetensors"
                    blob_start[file] = max(blob_start.get(file, 0), end)
        blobs: dict[str, ArchiveLayout] = {}
        for file, start in blob_start.items():
            full = os.path.join(path, file)
            try:
                blob = _safetensors_blob(handle(file), file, start, files[file])
            except ArchiveError as exc:
                raise CorruptArchiveError(f"the file's safetensors blob is damaged: {exc}",
                                          path=full, offset=start) from None
            if blob is None:
                raise CorruptArchiveError("no safetensors blob where the file's tensor items "
                                          "end", path=full, offset=start)
            blobs[file] = blob
        items = []
        for n, (index, info, file, md, chunk, transforms) in enumerate(entries):
            full = os.path.join(path, file)
            compression = compression_of(transforms)
            dtype = str(md.properties.dtype).removeprefix("torch.") if md is not None else None
            item = DcpItem(
                fqn=index.fqn, kind="tensor" if md is not None else "bytes",
                chunk_offsets=tuple(chunk.offsets) if chunk is not None else (),
                chunk_sizes=tuple(chunk.sizes) if chunk is not None else (),
                index=index.index, file=file, offset=info.offset, nbytes=info.length,
                dtype=dtype, data_offset=None, layout=None, compression=compression,
                transforms=transforms)
            if not item_layouts:
                pass
            elif serialization.get(n) == "safetensors":
                item = _blob_item(item, blobs[file], blob_start[file], full)
            elif compression is not None:
                if md is None:  # an object: inflate it (bounded) to show its value
                    item = dataclasses.replace(item, layout=_inflated_object(
                        _pread(handle(file), info.offset, info.length), compression, full,
                        index.fqn, info.offset))
            else:
                try:
                    layout = _item_layout(handle(file), file, info.offset, info.length)
                except ArchiveError as exc:
                    raise CorruptArchiveError(
                        f"item is not a torch.save archive: {exc}", path=full,
                        record=index.fqn, offset=info.offset) from None
                data_offset = info.offset + layout.storages[0].data_offset \
                    if md is not None and layout.storages else None
                item = dataclasses.replace(item, layout=layout, data_offset=data_offset)
            items.append(item)
    finally:
        for f in handles.values():
            f.close()
    items.sort(key=lambda i: (i.file, i.offset))
    return DcpLayout(path, meta, metadata_nbytes, tuple(files.items()), tuple(items))


def _blob_item(item: DcpItem, blob: ArchiveLayout, start: int, full: str) -> DcpItem:
    """A tensor item of the SAFETENSORS serialization: the file's blob, checked against the
    chunk ``.metadata`` lists (torch keys the blob by fqn, so a second chunk of one fqn in one
    file overwrote the first: that shows here as a mismatch)."""
    where = {"path": full, "record": item.fqn, "offset": start}
    storage = next((s for s in blob.storages if s.key == item.fqn), None)
    tensor = next((t for t in blob.tensors if t.storage_key == item.fqn), None)
    if storage is None or tensor is None:
        raise CorruptArchiveError("the file's safetensors blob has no tensor of this name",
                                  **where)
    saved = _sharding_offsets(blob).get(item.fqn)
    if tensor.dtype != item.dtype or tuple(tensor.shape) != item.chunk_sizes or (
            saved is not None and saved != item.chunk_offsets):
        raise CorruptArchiveError(
            "the safetensors blob holds another chunk than .metadata lists",
            expected=f"{item.dtype} {list(item.chunk_sizes)} at {list(item.chunk_offsets)}",
            actual=f"{tensor.dtype} {list(tensor.shape)} at "
                   f"{list(saved) if saved is not None else '?'}", **where)
    if item.nbytes != storage.nbytes:
        raise CorruptArchiveError("the item's length is not its chunk's bytes",
                                  expected=f"{storage.nbytes} bytes",
                                  actual=f"{item.nbytes} bytes", **where)
    return dataclasses.replace(item, offset=start, nbytes=blob.file_nbytes,
                               data_offset=start + storage.data_offset, layout=blob,
                               serialization="safetensors", compression=None)


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
