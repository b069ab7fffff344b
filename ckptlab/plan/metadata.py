"""A real DCP checkpoint directory, read safely: ``.metadata`` and every item in the data files.

``.metadata`` is a pickle. Loading it with ``pickle`` runs whatever it names, so it is read by
ckptlab's bounded interpreter and only an allow-list of DCP metadata classes, checked field by
field, becomes real objects (:mod:`ckptlab.plan._metadata_pickle`). Each item in a ``.distcp``
file is an independent torch.save zip; its layout is read with :mod:`ckptlab.format` through a
window on the file, without reading tensor bytes.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._paths import check_regular, open_inside, resolve_inside
from ckptlab.format._source import ByteSource
from ckptlab.format._window import FileWindow
from ckptlab.format.archive import largest_alignment, scan_torch_zip
from ckptlab.format.layout import ArchiveLayout
from ckptlab.plan._metadata_pickle import MetadataDecodeError, decode_metadata

__all__ = ["DcpItem", "DcpLayout", "inspect_dcp", "is_dcp_dir", "load_metadata"]

METADATA = ".metadata"
MAX_METADATA_NBYTES = 1 << 30


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
    try:
        meta = decode_metadata(data)
    except MetadataDecodeError as exc:
        error = UnsupportedFormatError if exc.foreign else CorruptArchiveError
        message = str(exc) if exc.offset is not None else \
            f"not DCP Metadata ckptlab can read safely: {exc}"
        raise error(message, path=meta_path, offset=exc.offset) from None
    return meta


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


def _item_layout(f: io.BufferedReader, file: str, offset: int, nbytes: int) -> ArchiveLayout:
    name = f"{file}@{offset}"
    with ByteSource(FileWindow(f, offset, nbytes, name)) as src:
        return scan_torch_zip(src)


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
    metadata_nbytes = _data_files(path, [METADATA])[METADATA]
    files = _data_files(path, [name for name in sorted(os.listdir(path)) if name != METADATA],
                        listed=True)
    items = []
    handles: dict[str, io.BufferedReader] = {}
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
            layout = None
            data_offset = None
            if item_layouts and not getattr(info, "transform_descriptors", None):
                if file not in handles:
                    handles[file] = open_inside(path, file)  # inside the directory, regular
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
