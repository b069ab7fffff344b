"""What-if layouts: the exact archive torch.save would write, without writing it."""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptlab.errors import InvalidArgumentError, UnsupportedFormatError
from ckptlab.format import _zip
from ckptlab.format._pickle import scan_pickle
from ckptlab.format._records import replace as replace_record
from ckptlab.format.archive import largest_alignment, record_segments, storage_infos
from ckptlab.format.layout import ArchiveLayout, Record, StorageInfo, TensorInfo

__all__ = [
    "DEFAULT_ALIGNMENTS",
    "AlignmentCost",
    "alignment_costs",
    "archive_name_for",
    "layout_records",
    "predict_layout",
    "realign",
    "torch_records",
]

SERIALIZATION_ID_NBYTES = 40  # .data/serialization_id: 40 ASCII digits
VERSION_RECORD = b"3\n"  # kProducedFileFormatVersion as written by PyTorchFileWriter


def archive_name_for(path: str | os.PathLike[str]) -> str:
    """The archive name torch.save uses for a file path: basename up to its last dot.

    File objects and non-ASCII paths get ``"archive"``.
    """
    name = os.path.basename(os.fspath(path))
    if not name.isascii():
        return "archive"
    dot = name.rfind(".")
    return name[:dot] if dot >= 0 else name


class _Recorder:
    """Stands in for torch's PyTorchFileWriter inside torch.serialization._save."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int]] = []
        self.pickle = b""

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if name == "data.pkl":
            self.pickle = bytes(data)
        self.records.append((name, nbytes))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        self.records.append((name, nbytes))


@contextlib.contextmanager
def skeleton_errors(what: str, path: str | None = None) -> Iterator[None]:
    """torch's refusals to pickle or rebuild an object without its data, as ckptlab errors.

    ``skip_data`` cannot write tensors whose pickle needs their values (quantized tensors keep
    scales in the quantizer, strided nested tensors their sizes in buffers), and a skeleton
    load cannot rebuild wrapper subclasses on a callable ``map_location``; torch raises a
    bare ``RuntimeError`` for each.
    """
    try:
        yield
    except (RuntimeError, NotImplementedError, pickle.PicklingError) as exc:
        raise UnsupportedFormatError(
            f"{what} needs torch to handle the object without its data, and torch refuses: "
            f"{str(exc).splitlines()[0][:200]} (use torch.save / torch.load for it)",
            path=path) from None


def torch_records(obj: Any, *, alignment: int = 64, pickle_protocol: int = 2,
                  disable_byteorder_record: bool = False) -> tuple[list[tuple[str, int]], bytes]:
    """(record name, nbytes) in write order, and the data.pkl bytes, for ``torch.save(obj)``.

    Runs torch's own pickling (``torch.serialization._save``) against a recorder instead of a
    zip writer, under ``skip_data`` so no storage is copied (GPU tensors stay on the GPU).
    """
    import torch.serialization as ts

    from ckptlab._torch_compat import torch_save_pickle

    save = torch_save_pickle()
    recorder = _Recorder()
    with skeleton_errors("predicting the layout"), ts.skip_data():
        save(obj, recorder, pickle, pickle_protocol, disable_byteorder_record)
    records = [(n, len(str(alignment)) if n == ".storage_alignment" else nbytes)
               for n, nbytes in recorder.records]
    records.append(("version", len(VERSION_RECORD)))
    if disable_byteorder_record:
        records.append(("byteorder", len(sys.byteorder)))  # torch writes it at the end then
    records.append((".data/serialization_id", SERIALIZATION_ID_NBYTES))
    return records, recorder.pickle


def _check_alignment(alignment: int) -> None:
    if type(alignment) is not int or not 1 <= alignment <= _zip.MAX_ALIGNMENT:
        raise InvalidArgumentError(
            f"alignment must be an int in 1..{_zip.MAX_ALIGNMENT} (torch.save crashes on 0 and "
            f"can write an unloadable file above {_zip.MAX_ALIGNMENT}), got {alignment!r}")


def layout_records(records: Sequence[tuple[str, int]], *, alignment: int = 64,
                   archive_name: str = "archive") -> tuple[list[Record], int, int]:
    """Place records the way torch's writer does.

    Returns the records, the central directory offset and its size in bytes.
    """
    _check_alignment(alignment)
    cursor = 0
    out = []
    cd_nbytes = 0
    for short, nbytes in records:
        name = f"{archive_name}/{short}"
        n_name = len(name.encode())
        geom = _zip.record_geometry(cursor, n_name, nbytes, alignment)
        extra = geom.zip64_extra_nbytes + 4 + geom.padding_nbytes
        out.append(Record(name, cursor, n_name, extra, geom.zip64_extra_nbytes,
                          geom.padding_nbytes, geom.data_offset, nbytes, geom.descriptor_nbytes,
                          0, nbytes))
        cd_nbytes += _zip.central_directory_entry_nbytes(n_name, nbytes, cursor)
        cursor = geom.end_offset
    return out, cursor, cd_nbytes


def predict_layout(obj: Any, *, alignment: int = 64, archive_name: str = "archive",
                   pickle_protocol: int = 2,
                   disable_byteorder_record: bool = False) -> ArchiveLayout:
    """The layout ``torch.save(obj, f)`` would write with ``storage_alignment=alignment``.

    Parameters
    ----------
    obj
        What torch.save accepts and can pickle without the tensors' values (a state dict, a
        model, nested containers): quantized tensors and strided nested tensors cannot be,
        since torch's ``skip_data`` needs their values (their scales, their sizes), and are
        refused with :class:`~ckptlab.errors.UnsupportedFormatError`.
    alignment
        ``torch.utils.serialization.config.save.storage_alignment``: 1..65504, any integer.
    archive_name
        The record prefix; use :func:`archive_name_for` for the path you would save to
        (``"archive"`` for file objects).
    pickle_protocol, disable_byteorder_record
        As for ``torch.save``.

    Returns
    -------
    ArchiveLayout
        Byte-exact offsets and sizes of every record, the central directory and the trailer;
        CRCs are 0 (they depend on the data, which is never read).

    Notes
    -----
    The pickle is produced by torch's own ``torch.serialization._save`` so its length is
    exact; record placement follows miniz and getPadding (see ``ckptlab.format._zip``),
    including the zip64 thresholds (size or header offset >= 0xFFFFFFFF).
    """
    _check_alignment(alignment)
    records, data_pkl = torch_records(obj, alignment=alignment, pickle_protocol=pickle_protocol,
                                      disable_byteorder_record=disable_byteorder_record)
    placed, cd_offset, cd_nbytes = layout_records(records, alignment=alignment,
                                                  archive_name=archive_name)
    path = "<predicted>"
    scan = scan_pickle(data_pkl, path=path)
    by_name = {r.name: r for r in placed}
    storages = storage_infos(scan, by_name, f"{archive_name}/", path,
                             by_name[f"{archive_name}/data.pkl"])
    return _assemble(placed, cd_offset, cd_nbytes, path=path, archive_name=archive_name,
                     storages=storages, tensors=scan.tensors, alignment=alignment,
                     byteorder=sys.byteorder, pickle_protocol=scan.protocol)


def realign(layout: ArchiveLayout, alignment: int) -> ArchiveLayout:
    """The layout of the same archive written with ``storage_alignment=alignment``.

    The what-if for a file that already exists: the same records, in the same order, with the
    same payload sizes, placed the way torch's writer places them at ``alignment``. Nothing is
    read or unpickled; storages keep their keys and move to their new data offsets.

    Parameters
    ----------
    layout
        A torch.save zip layout (from :func:`inspect` or :func:`predict_layout`).
    alignment
        The storage alignment to place records at, 1..65504.

    Returns
    -------
    ArchiveLayout
        ``path`` is ``"<realigned from PATH>"``. CRCs are kept (the payloads do not change),
        except for ``.storage_alignment`` whose text changes (CRC 0).

    Raises
    ------
    InvalidArgumentError
        For a safetensors layout or an alignment outside 1..65504.

    Examples
    --------
    >>> import ckptlab as cl
    >>> layout = cl.inspect(cl.samples.sample_path())
    >>> cl.format.realign(layout, 4096).alignment
    4096
    """
    _check_alignment(alignment)
    if layout.format != "torch-zip":
        raise InvalidArgumentError(
            f"realign needs a torch-zip layout, got a {layout.format} layout of {layout.path}")
    ordered = sorted(layout.records, key=lambda r: r.header_offset)
    placed, cd_offset, cd_nbytes = layout_records(
        _sizes_at(ordered, alignment), alignment=alignment, archive_name=layout.archive_name)
    placed = [replace(p, crc32=0 if o.short_name == ".storage_alignment" else o.crc32)
              for p, o in zip(placed, ordered)]
    by_name = {r.name: r for r in placed}
    storages = tuple(replace_record(s, data_offset=by_name[s.record].data_offset)
                     for s in layout.storages)
    return _assemble(placed, cd_offset, cd_nbytes, path=f"<realigned from {layout.path}>",
                     archive_name=layout.archive_name, storages=storages,
                     tensors=layout.tensors, alignment=alignment,
                     byteorder=layout.byteorder, pickle_protocol=layout.pickle_protocol,
                     format_version=layout.format_version)


@dataclass(frozen=True, slots=True)
class AlignmentCost:
    """What one storage alignment costs a checkpoint (one row of :func:`alignment_costs`)."""

    alignment: int  # storage_alignment
    file_nbytes: int  # size of the archive
    data_nbytes: int  # payload bytes of every record (the same at every alignment)
    padding_nbytes: int  # bytes of FB padding payload
    overhead_nbytes: int  # file_nbytes - data_nbytes: headers, names, extras, descriptors, trailer
    storages: int  # non-empty storages
    storages_4k_aligned: int  # of those, how many start on a 4096-byte boundary (GDS / O_DIRECT)

    @property
    def overhead_fraction(self) -> float:
        return self.overhead_nbytes / self.file_nbytes


DEFAULT_ALIGNMENTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                      32768, _zip.MAX_ALIGNMENT)


def alignment_costs(source: Any, alignments: Sequence[int] = DEFAULT_ALIGNMENTS, *,
                    archive_name: str = "archive") -> tuple[AlignmentCost, ...]:
    """File size, padding and 4 KiB readiness of one checkpoint at each alignment.

    Parameters
    ----------
    source
        An :class:`ArchiveLayout` of a torch.save zip (an existing file: nothing is read), or
        any object torch.save accepts (pickled once by torch, under ``skip_data``).
    alignments
        Storage alignments to evaluate, each 1..65504. The default sweeps the powers of two
        up to 32768, and 65504, the largest torch can write.
    archive_name
        Record prefix for an object (a layout keeps its own).

    Returns
    -------
    tuple of AlignmentCost
        One row per alignment, in the order given. Placement only: no pickling per row.
    """
    for a in alignments:
        _check_alignment(a)
    if isinstance(source, ArchiveLayout):
        if source.format != "torch-zip":
            raise InvalidArgumentError(
                f"alignment_costs needs a torch-zip layout, got a {source.format} layout")
        archive_name = source.archive_name
        names = [(r.short_name, r.data_nbytes)
                 for r in sorted(source.records, key=lambda r: r.header_offset)]
        storage_records = {s.record for s in source.storages if s.nbytes}
    else:
        names, data_pkl = torch_records(source)
        scan = scan_pickle(data_pkl, path="<predicted>")
        storage_records = {f"{archive_name}/data/{s.key}" for s in scan.storages if s.nbytes}
    prefix = len(archive_name.encode()) + 1
    items = [(prefix + len(short.encode()), nbytes, f"{archive_name}/{short}" in storage_records,
              short == ".storage_alignment") for short, nbytes in names]
    rows = []
    for a in alignments:
        file_nbytes, data, padding, starts, aligned = _place_totals(items, a)
        rows.append(AlignmentCost(a, file_nbytes, data, padding, file_nbytes - data, starts,
                                  aligned))
    return tuple(rows)


def _place_totals(items: list[tuple[int, int, bool, bool]],
                  alignment: int) -> tuple[int, int, int, int, int]:
    """File size, payload, padding, storages and 4 KiB-aligned storages at ``alignment``.

    The arithmetic of :func:`layout_records` without building records (``alignment_costs``
    runs it once per alignment over every record). ``items``: (name bytes, payload bytes,
    is a storage, is ``.storage_alignment``).
    """
    cursor = cd_nbytes = data = padding = starts = aligned = 0
    place, entry = _zip.record_placement, _zip.central_directory_entry_nbytes
    fixed = _zip.LOCAL_HEADER.size + 4  # local header + the FB field's own header
    for name_nbytes, nbytes, is_storage, is_alignment_record in items:
        if is_alignment_record:
            nbytes = len(str(alignment))
        zip64, data_offset, descriptor = place(cursor, name_nbytes, nbytes, alignment)
        padding += data_offset - (cursor + fixed + name_nbytes + zip64)
        if is_storage:
            starts += 1
            aligned += data_offset % 4096 == 0
        cd_nbytes += entry(name_nbytes, nbytes, cursor)
        data += nbytes
        cursor = data_offset + nbytes + descriptor
    return cursor + cd_nbytes + _zip.TRAILER_NBYTES, data, padding, starts, aligned


def _sizes_at(ordered: Sequence[Record], alignment: int) -> list[tuple[str, int]]:
    return [(r.short_name, len(str(alignment)) if r.short_name == ".storage_alignment"
             else r.data_nbytes) for r in ordered]


def _assemble(placed: list[Record], cd_offset: int, cd_nbytes: int, *, path: str,
              archive_name: str, storages: tuple[StorageInfo, ...],
              tensors: tuple[TensorInfo, ...], alignment: int, byteorder: str | None,
              pickle_protocol: int | None, format_version: str | None = "1") -> ArchiveLayout:
    """An ArchiveLayout for records placed by :func:`layout_records`, with torch's trailer."""
    z64_offset = cd_offset + cd_nbytes
    trailer = _zip.Trailer(cd_offset, cd_nbytes, len(placed), z64_offset + 76, _zip.EOCD.size,
                           z64_offset, _zip.ZIP64_EOCD.size, z64_offset + 56)
    file_nbytes = z64_offset + _zip.TRAILER_NBYTES
    headers = {r.name: _zip.LocalHeader(
        r.extra_nbytes, r.zip64_extra_nbytes, r.padding_nbytes,
        tuple(f for f in (("zip64_extra", r.header_offset + 30 + r.name_nbytes,
                           r.zip64_extra_nbytes),
                          ("padding", r.data_offset - r.padding_nbytes - 4,
                           4 + r.padding_nbytes)) if f[2])) for r in placed}
    return ArchiveLayout(
        format="torch-zip", path=path, file_nbytes=file_nbytes, archive_name=archive_name,
        records=tuple(placed), storages=storages, tensors=tensors,
        segments=record_segments(placed, headers, trailer, file_nbytes, path),
        alignment=largest_alignment([s.data_offset for s in storages if s.nbytes]),
        zip64=any(r.zip64_extra_nbytes for r in placed), central_directory_offset=cd_offset,
        central_directory_nbytes=cd_nbytes, zip64_eocd_offset=z64_offset,
        zip64_locator_offset=z64_offset + 56, eocd_offset=z64_offset + 76,
        storage_alignment=alignment, format_version=format_version,
        byteorder=byteorder, pickle_protocol=pickle_protocol,
    )
