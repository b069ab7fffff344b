"""A real DCP checkpoint directory, read safely: ``.metadata`` and every item in the data files.

``.metadata`` is a pickle. Loading it with ``pickle`` runs whatever it names, so it is read
with an unpickler that resolves an allow-list of DCP metadata classes and torch basics and
refuses everything else. Each item in a ``.distcp`` file is an independent torch.save zip;
its layout is read with :mod:`ckptlab.format` through a window on the file, without reading
tensor bytes.
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._source import ByteSource
from ckptlab.format.archive import largest_alignment, scan_torch_zip
from ckptlab.format.layout import ArchiveLayout

__all__ = ["DcpItem", "DcpLayout", "inspect_dcp", "is_dcp_dir", "load_metadata"]

METADATA = ".metadata"
MAX_METADATA_NBYTES = 1 << 30

_DCP = "torch.distributed.checkpoint"
# (module, name) pairs a DCP .metadata may name; nothing else is ever imported
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *((f"{_DCP}.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}._extension", "ExtensionRegistry"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
})
_DTYPES = frozenset({
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "qint8", "quint8", "qint32", "quint4x2", "half", "float", "double", "long", "int", "short",
    "cfloat", "cdouble", "chalf",
})


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsupportedFormatError(
            f"{METADATA} names {module}.{name}, which is not a DCP metadata class; refusing to "
            "load it (loading it with pickle would run it)", path=self._path)

    def persistent_load(self, pid: Any) -> Any:
        raise CorruptArchiveError(f"{METADATA} has a persistent id ({pid!r:.60}); DCP metadata "
                                  "never does", path=self._path)


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
        nbytes = os.path.getsize(meta_path)
        if nbytes > MAX_METADATA_NBYTES:
            raise CorruptArchiveError("metadata larger than 1 GiB", path=meta_path,
                                      expected=f"<= {MAX_METADATA_NBYTES} bytes",
                                      actual=f"{nbytes} bytes")
        with open(meta_path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ArchiveError(f"cannot read DCP metadata: {exc.strerror}", path=meta_path) from None
    import torch.distributed.checkpoint.metadata as dcp_metadata  # the allow-list's classes

    try:
        meta = _RestrictedUnpickler(io.BytesIO(data), meta_path).load()
    except ArchiveError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, RecursionError, MemoryError) as exc:
        raise CorruptArchiveError(f"not a readable pickle: {type(exc).__name__}: {exc}",
                                  path=meta_path, expected="a pickled DCP Metadata",
                                  actual=f"{len(data)} bytes") from None
    if not isinstance(meta, dcp_metadata.Metadata):
        raise CorruptArchiveError("the pickle is not DCP Metadata", path=meta_path,
                                  expected="torch.distributed.checkpoint.metadata.Metadata",
                                  actual=type(meta).__name__)
    return meta


def is_dcp_dir(path: str | os.PathLike[str]) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(os.fspath(path), METADATA))


@dataclass(frozen=True, slots=True)
class DcpItem:
    """One stored item: a chunk of a tensor, or a pickled object, in one data file."""

    fqn: str  # fully qualified name in the state dict ("model.layers.0.weight")
    kind: str  # "tensor" or "bytes"
    chunk_offsets: tuple[int, ...]  # where the chunk starts in the global tensor (tensor items)
    chunk_sizes: tuple[int, ...]  # the chunk's shape (tensor items)
    index: int | None  # the chunk's index in the tensor's chunk list
    file: str  # data file relative to the directory ("__0_0.distcp")
    offset: int  # first byte of the item (a torch.save zip) in the file
    nbytes: int  # bytes of the item
    dtype: str | None  # tensor items: the tensor's dtype
    data_offset: int | None  # tensor items: where the chunk's bytes start in the file
    layout: ArchiveLayout | None  # the item's own torch.save layout (offsets inside the item)

    @property
    def data_alignment(self) -> int | None:
        """Largest power of two (<= 4096) dividing ``data_offset``: what O_DIRECT / GDS see."""
        return None if self.data_offset is None else largest_alignment([self.data_offset])

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "kind": self.kind, "chunk_offsets": list(self.chunk_offsets),
                "chunk_sizes": list(self.chunk_sizes), "index": self.index, "file": self.file,
                "offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
                "data_offset": self.data_offset, "data_alignment": self.data_alignment}


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


class _Window(io.RawIOBase):
    """Bytes ``[start, start + nbytes)`` of a file, as a seekable file object."""

    def __init__(self, f: io.BufferedReader, start: int, nbytes: int, name: str) -> None:
        self._f, self._start, self._nbytes, self._pos = f, start, nbytes, 0
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._nbytes}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._nbytes - self._pos if n is None or n < 0 else min(n, self._nbytes - self._pos)
        if n <= 0:
            return b""
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data


def _item_layout(f: io.BufferedReader, file: str, offset: int, nbytes: int) -> ArchiveLayout:
    name = f"{file}@{offset}"
    with ByteSource(_Window(f, offset, nbytes, name)) as src:
        return scan_torch_zip(src)


def inspect_dcp(path: str | os.PathLike[str], *, item_layouts: bool = True) -> DcpLayout:
    """The layout of a DCP checkpoint directory, read without executing its pickle.

    Parameters
    ----------
    path
        The directory ``dcp.save`` wrote (``.metadata`` plus ``*.distcp`` files).
    item_layouts
        Also read each item's own torch.save layout (its headers, pickle and central
        directory; never the tensor bytes).

    Returns
    -------
    DcpLayout
        Items sorted by file and offset; tensor items carry their chunk's offsets and sizes in
        the global tensor and the absolute file offset of their bytes.
    """
    path = os.fspath(path)
    meta = load_metadata(path)
    metadata_nbytes = os.path.getsize(os.path.join(path, METADATA))
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name != METADATA and os.path.isfile(full):
            files[name] = os.path.getsize(full)
    items = []
    handles: dict[str, io.BufferedReader] = {}
    try:
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
            layout = None
            data_offset = None
            if item_layouts and not getattr(info, "transform_descriptors", None):
                if file not in handles:
                    handles[file] = open(os.path.join(path, file), "rb")
                try:
                    layout = _item_layout(handles[file], file, info.offset, info.length)
                except ArchiveError as exc:
                    raise CorruptArchiveError(
                        f"item is not a torch.save archive: {exc}", path=os.path.join(path, file),
                        record=index.fqn, offset=info.offset) from None
                if is_tensor and layout.storages:
                    data_offset = info.offset + layout.storages[0].data_offset
            items.append(DcpItem(
                fqn=index.fqn, kind="tensor" if is_tensor else "bytes",
                chunk_offsets=tuple(chunk.offsets) if chunk is not None else (),
                chunk_sizes=tuple(chunk.sizes) if chunk is not None else (),
                index=index.index, file=file, offset=info.offset, nbytes=info.length,
                dtype=str(md.properties.dtype).removeprefix("torch.") if is_tensor else None,
                data_offset=data_offset, layout=layout))
    finally:
        for f in handles.values():
            f.close()
    items.sort(key=lambda i: (i.file, i.offset))
    return DcpLayout(path, meta, metadata_nbytes, tuple(files.items()), tuple(items))
