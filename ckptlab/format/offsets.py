"""Storage offsets without random reads: torch's ``calculate_storage_offsets`` idea, verified.

torch (PR #143880) reads data/0's offset once and then derives every next storage's offset from
the previous one: header (30) + name + zip64 extra + 'FB' padding to the alignment + data +
descriptor. That trusts the write order: a record inserted between two storages silently
shifts every later offset. ckptlab does the same arithmetic but checks each predicted header
offset and size against the central directory it has already read, so an archive that does not
follow torch's write order is detected and handled by reading its local headers instead.

I/O: the trailer and central directory (one read, two for a very large directory), and the
head of the file holding data.pkl and the small records (one read): at most 3 reads whatever
the number of storages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import BinaryIO

from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format import _zip
from ckptlab.format._pickle import scan_pickle
from ckptlab.format._source import ByteSource
from ckptlab.format.archive import _classify, read_central_directory
from ckptlab.format.inspect import not_a_checkpoint, sniff

__all__ = ["StorageOffsets", "storage_offsets"]

_HEAD_RECORDS = ("data.pkl", ".format_version", ".storage_alignment", "byteorder")
DEFAULT_ALIGNMENT = 64  # torch's default before .storage_alignment existed


@dataclass(frozen=True, slots=True)
class StorageOffsets:
    """Where each storage's bytes start, and what it cost to find out."""

    offsets: dict[str, int] = field(hash=False)  # storage key -> data offset, in pickle order
    reads: int  # read calls made on the file
    bytes_read: int
    method: str  # "cursor" (arithmetic, verified) or "central_directory" (local headers read)
    archive_name: str
    alignment: int  # the storage alignment the arithmetic used
    reason: str | None = None  # why the cursor method was not usable

    def to_dict(self) -> dict[str, object]:
        return {"offsets": dict(self.offsets), "reads": self.reads,
                "bytes_read": self.bytes_read, "method": self.method,
                "archive_name": self.archive_name, "alignment": self.alignment,
                "reason": self.reason}


def storage_offsets(source: str | os.PathLike[str] | BinaryIO | bytes, *,
                    scan: bool = True) -> StorageOffsets:
    """Data offset of every storage in a torch.save archive, in at most 3 reads.

    Parameters
    ----------
    source
        A path, a bytes-like object, or a binary file object with ``seek``/``read`` (an fsspec
        file, say); each read call is counted.
    scan
        Take the storage order and sizes from ``data.pkl`` (torch's way; also checks the pickle
        against the records). With ``False`` the central directory's order is used and the
        pickle is not parsed, which is faster for huge pickles.

    Returns
    -------
    StorageOffsets
        ``offsets`` maps storage keys to absolute data offsets; ``method`` says whether the
        arithmetic was verified (``"cursor"``) or local headers had to be read
        (``"central_directory"``, one read per storage, ``reason`` says why).

    Raises
    ------
    ArchiveError
        Truncated, corrupt, or not a torch.save zip archive.

    Notes
    -----
    The arithmetic is verified against the central directory's header offsets and sizes of
    every storage and of the record after the last storage. A writer that kept every header
    offset of torch's layout but changed local extra fields and descriptor lengths to
    compensate would not be detected; no known writer does that.
    """
    with ByteSource(source, cache=True) as src:
        try:
            trailer, entries = read_central_directory(src)
        except ArchiveError:
            kind = sniff(src)  # only on failure: say what the file is, if it is not a zip
            if kind != "torch-zip":
                raise not_a_checkpoint(src, kind) from None
            raise
        archive = _classify(entries, src.name)
        prefix = f"{archive}/" if archive else ""
        by_name = {e.name: e for e in entries}
        head_names = [prefix + n for n in _HEAD_RECORDS if prefix + n in by_name]
        storages_cd = [e for e in entries if e.name.startswith(prefix + "data/")]
        # one read covering data.pkl and the small records, which torch writes first
        others = [e.header_offset for e in entries if e.name not in head_names]
        head_end = min(others + [trailer.cd_offset])
        head_entries = [by_name[n] for n in head_names]
        in_head = all(e.header_offset < head_end for e in head_entries)
        if in_head:
            src.read(0, head_end, what="records before the storages")

        def payload(name: str) -> bytes:
            e = by_name[name]
            local = _zip.read_local_header(src, e, head_end if in_head else None)
            if e.method != 0:
                raise UnsupportedFormatError(f"record compressed with zip method {e.method}",
                                             path=src.name, record=name,
                                             offset=e.header_offset)
            return src.read(local.data_offset(e.header_offset, e.name_nbytes),
                            e.compressed_nbytes, what="record data", record=name)

        alignment = DEFAULT_ALIGNMENT
        if prefix + ".storage_alignment" in by_name:
            text = payload(prefix + ".storage_alignment")
            if not text.isdigit() or not 0 < int(text) <= _zip.MAX_ALIGNMENT:
                raise CorruptArchiveError("bad .storage_alignment", path=src.name,
                                          record=prefix + ".storage_alignment",
                                          expected=f"1..{_zip.MAX_ALIGNMENT}", actual=text[:20])
            alignment = int(text)
        if scan:
            pkl = by_name[prefix + "data.pkl"]
            scanned = scan_pickle(payload(pkl.name), path=src.name, record=pkl.name)
            order = [(f"{prefix}data/{s.key}", s.key, s.nbytes) for s in scanned.storages]
            for name, key, nbytes in order:
                e = by_name.get(name)
                if e is None:
                    raise CorruptArchiveError(f"the pickle references storage {key!r} but the "
                                              f"archive has no record {name!r}", path=src.name,
                                              record=name)
                if e.uncompressed_nbytes != nbytes:
                    raise CorruptArchiveError("storage record size differs from the pickle",
                                              path=src.name, record=name,
                                              offset=e.header_offset, expected=nbytes,
                                              actual=e.uncompressed_nbytes)
        else:
            order = [(e.name, e.name[len(prefix) + 5:], e.uncompressed_nbytes)
                     for e in storages_cd]
        reason = _verify_cursor(order, by_name, entries, trailer, alignment)
        if reason is None:
            offsets = {}
            cursor = by_name[order[0][0]].header_offset if order else 0
            for name, key, nbytes in order:
                geom = _zip.record_geometry(cursor, by_name[name].name_nbytes, nbytes, alignment)
                offsets[key] = geom.data_offset
                cursor = geom.end_offset
            method = "cursor"
        else:
            offsets = {}
            for name, key, _ in order:
                e = by_name[name]
                local = _zip.read_local_header(src, e)
                offsets[key] = local.data_offset(e.header_offset, e.name_nbytes)
            method = "central_directory"
        return StorageOffsets(offsets, src.reads, src.bytes_read, method, archive, alignment,
                              reason)


def _verify_cursor(order: list[tuple[str, str, int]], by_name: dict[str, _zip.CentralEntry],
                   entries: list[_zip.CentralEntry], trailer: _zip.Trailer,
                   alignment: int) -> str | None:
    """None if torch's arithmetic reproduces the central directory, else the first mismatch."""
    if not order:
        return None
    cursor = by_name[order[0][0]].header_offset
    for name, _, nbytes in order:
        e = by_name[name]
        if e.method != 0:
            return f"{name} is compressed (method {e.method})"
        if e.header_offset != cursor:
            return (f"{name}: central directory header offset {e.header_offset}, "
                    f"arithmetic predicts {cursor}")
        geom = _zip.record_geometry(cursor, e.name_nbytes, nbytes, alignment)
        if bool(e.flags & 0x8) != (geom.descriptor_nbytes > 0):
            return f"{name}: data descriptor flag differs from torch's writer"
        cursor = geom.end_offset
    last = by_name[order[-1][0]].header_offset
    following = min([x.header_offset for x in entries if x.header_offset > last]
                    + [trailer.cd_offset])
    if following != cursor:
        return (f"record after {order[-1][0]} starts at {following}, arithmetic predicts "
                f"{cursor}")
    return None
