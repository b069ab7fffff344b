"""What-if layouts: the exact archive torch.save would write, without writing it."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Sequence
from typing import Any

from ckptlab.errors import InvalidArgumentError
from ckptlab.format import _zip
from ckptlab.format._pickle import scan_pickle
from ckptlab.format.archive import _segments, largest_alignment, storage_infos
from ckptlab.format.layout import ArchiveLayout, Record

__all__ = ["archive_name_for", "layout_records", "predict_layout", "torch_records"]

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


def torch_records(obj: Any, *, alignment: int = 64, pickle_protocol: int = 2,
                  disable_byteorder_record: bool = False) -> tuple[list[tuple[str, int]], bytes]:
    """(record name, nbytes) in write order, and the data.pkl bytes, for ``torch.save(obj)``.

    Runs torch's own pickling (``torch.serialization._save``) against a recorder instead of a
    zip writer, under ``skip_data`` so no storage is copied (GPU tensors stay on the GPU).
    """
    import torch.serialization as ts

    recorder = _Recorder()
    with ts.skip_data():
        ts._save(obj, recorder, pickle, pickle_protocol, disable_byteorder_record)
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
            f"writes an unloadable file above {_zip.MAX_ALIGNMENT}), got {alignment!r}")


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
        Anything torch.save accepts (a state dict, a model, nested containers).
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
    path = "<predicted>"
    segments = _segments(placed, headers, trailer, file_nbytes, path)
    scan = scan_pickle(data_pkl, path=path)
    by_name = {r.name: r for r in placed}
    storages = storage_infos(scan, by_name, f"{archive_name}/", path,
                             by_name[f"{archive_name}/data.pkl"])
    return ArchiveLayout(
        format="torch-zip", path=path, file_nbytes=file_nbytes, archive_name=archive_name,
        records=tuple(placed), storages=storages, tensors=scan.tensors, segments=segments,
        alignment=largest_alignment([s.data_offset for s in storages if s.nbytes]),
        zip64=any(r.zip64_extra_nbytes for r in placed), central_directory_offset=cd_offset,
        central_directory_nbytes=cd_nbytes, zip64_eocd_offset=z64_offset,
        zip64_locator_offset=z64_offset + 56, eocd_offset=z64_offset + 76,
        storage_alignment=alignment, format_version="1",
        byteorder=sys.byteorder, pickle_protocol=scan.protocol,
    )
