"""Storage offsets without random reads: torch's ``calculate_storage_offsets`` idea, verified.

torch (PR #143880) reads data/0's offset once and then derives every next storage's offset from
the previous one: header (30) + name + zip64 extra + 'FB' padding to the alignment + data +
descriptor. That trusts the write order: a record inserted between two storages silently
shifts every later offset. ckptlab does the same arithmetic but checks each predicted header
offset and size against the central directory it has already read, so an archive that does not
follow torch's write order is detected and handled by reading its local headers instead.

I/O: the trailer and central directory (one read, two for a very large directory), and one
read of the ``.storage_alignment`` record (with ``scan=True``: of the head of the file from
data.pkl to it): at most 3 reads whatever the number of storages.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import BinaryIO

from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format import _zip
from ckptlab.format._pickle import scan_pickle
from ckptlab.format._source import ByteSource
from ckptlab.format.archive import archive_prefix, read_central_directory
from ckptlab.format.inspect import not_a_checkpoint, sniff

__all__ = ["StorageOffsets", "storage_offsets"]

DEFAULT_ALIGNMENT = 64  # torch's default before .storage_alignment existed


@dataclass(frozen=True, slots=True)
class StorageOffsets:
    """Where each storage's bytes start, and what it cost to find out."""

    offsets: dict[str, int] = field(hash=False)  # storage key -> data offset, in file order (pickle order with scan=True)
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
                    scan: bool = False) -> StorageOffsets:
    """Data offset of every storage in a torch.save archive, in at most 3 reads.

    Parameters
    ----------
    source
        A path, a bytes-like object, or a binary file object with ``seek``/``read`` (an fsspec
        file, say); each read call is counted.
    scan
        Take the storage order and sizes from ``data.pkl`` with the safe scanner, as torch
        does, and check the pickle against the records. By default the storage records' order
        in the central directory is used: torch writes storages in pickle order, so for its
        files the two orders are the same, and every offset is verified against the
        directory either way. The scan adds CPU time proportional to the pickle (about four
        times the rest for 10k tensors), not reads.

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
    The arithmetic is verified against the central directory's header offset, size and
    descriptor flag of every storage, and the header offset of the record after the last
    storage. A writer that kept every header offset of torch's layout but changed local extra
    fields and descriptor lengths to compensate would not be detected; no known writer does
    that. The local headers' bytes are not read (that is the point), so a file whose headers
    were overwritten (say by a storage write padded to 4096 bytes) still gets its offsets:
    use :func:`inspect` to validate a file.
    """
    with ByteSource(source, cache=True) as src:
        try:
            trailer, entries = read_central_directory(src)
        except ArchiveError:
            kind = sniff(src)  # only on failure: say what the file is, if it is not a zip
            if kind != "torch-zip":
                raise not_a_checkpoint(src, kind) from None
            raise
        archive = archive_prefix(entries, src.name)
        prefix = f"{archive}/" if archive else ""
        storage_prefix = prefix + "data/"
        by_name = {e.name: e for e in entries}
        # the records the arithmetic needs, each from its header to the next header, read in
        # as few reads as possible: torch writes them next to each other at the head
        needed = [prefix + ".storage_alignment"] + ([prefix + "data.pkl"] if scan else [])
        spans = _record_spans([by_name[n] for n in needed if n in by_name], entries,
                              trailer.cd_offset)
        for lo, hi in spans:
            src.read(lo, hi - lo, what="records before the storages")
        span_end = {n: hi for n in needed if n in by_name for lo, hi in spans
                    if lo <= by_name[n].header_offset < hi}

        def payload(name: str) -> bytes:
            e = by_name[name]
            local = _zip.read_local_header(src, e, span_end.get(name))
            if e.method != 0:
                raise UnsupportedFormatError(f"record compressed with zip method {e.method}",
                                             path=src.name, record=name,
                                             offset=e.header_offset)
            return src.read(local.data_offset(e.header_offset, e.name_nbytes),
                            e.compressed_nbytes, what="record data", record=name)

        alignment = DEFAULT_ALIGNMENT
        if prefix + ".storage_alignment" in by_name:
            text = payload(prefix + ".storage_alignment")
            if not (text.isdigit() and len(text) <= 10 and
                    0 < int(text) <= _zip.MAX_RECORDED_ALIGNMENT):
                rec = by_name[prefix + ".storage_alignment"]
                raise CorruptArchiveError("bad .storage_alignment", path=src.name,
                                          record=rec.name, offset=rec.header_offset,
                                          expected=f"1..{_zip.MAX_RECORDED_ALIGNMENT}",
                                          actual=text[:20])
            alignment = int(text)
        if scan:
            pkl = by_name[prefix + "data.pkl"]
            scanned = scan_pickle(payload(pkl.name), path=src.name, record=pkl.name)
            order = []
            for s in scanned.storages:
                e = by_name.get(storage_prefix + s.key)
                if e is None:
                    raise CorruptArchiveError(f"the pickle references storage {s.key!r} but the "
                                              f"archive has no record {storage_prefix + s.key!r}",
                                              path=src.name, record=pkl.name,
                                              offset=pkl.header_offset)
                if e.uncompressed_nbytes != s.nbytes:
                    raise CorruptArchiveError("storage record size differs from the pickle",
                                              path=src.name, record=e.name,
                                              offset=e.header_offset, expected=s.nbytes,
                                              actual=e.uncompressed_nbytes)
                order.append(e)
        else:
            order = [e for e in entries if e.name.startswith(storage_prefix)]
        for e in order:
            if e.method != 0:  # compressed bytes have no offset a reader could map
                raise UnsupportedFormatError(
                    f"storage record compressed with zip method {e.method}: its bytes cannot "
                    "be read in place", path=src.name, record=e.name, offset=e.header_offset)
        keys = [e.name[len(storage_prefix):] for e in order]
        data_offsets, reason = _cursor_offsets(order, entries, trailer, alignment)
        if reason is None:
            method = "cursor"
        else:  # not torch's write order: read each storage's local header
            data_offsets = []
            for e in order:
                local = _zip.read_local_header(src, e)
                data_offsets.append(local.data_offset(e.header_offset, e.name_nbytes))
            method = "central_directory"
        return StorageOffsets(dict(zip(keys, data_offsets)), src.reads, src.bytes_read, method,
                              archive, alignment, reason)


_MERGE_GAP = 1 << 16  # read across gaps up to this size rather than make another read


def _record_spans(wanted: list[_zip.CentralEntry], entries: list[_zip.CentralEntry],
                  cd_offset: int) -> list[tuple[int, int]]:
    """Byte ranges [header, next header) of ``wanted`` records, merged when close together."""
    # parse_central_directory guarantees every record ends before the directory, so each
    # wanted header has a next start (another header, or the directory itself)
    starts = sorted({e.header_offset for e in entries} | {cd_offset})
    ranges = [(e.header_offset, starts[bisect.bisect_right(starts, e.header_offset)])
              for e in wanted]
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + _MERGE_GAP:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _cursor_offsets(order: list[_zip.CentralEntry], entries: list[_zip.CentralEntry],
                    trailer: _zip.Trailer, alignment: int) -> tuple[list[int], str | None]:
    """torch's cursor arithmetic over ``order``, checked record by record against the directory.

    Returns the data offsets, and None or the first disagreement (then the offsets are void).
    """
    offsets: list[int] = []
    if not order:
        return offsets, None
    place = _zip.record_placement
    cursor = order[0].header_offset
    for e in order:  # callers have rejected compressed records
        nbytes = e.uncompressed_nbytes
        if e.compressed_nbytes != nbytes:
            return offsets, (f"{e.name}: stored size {e.compressed_nbytes} differs from its "
                             f"uncompressed size {nbytes}")
        if e.header_offset != cursor:
            return offsets, (f"{e.name}: central directory header offset {e.header_offset}, "
                             f"arithmetic predicts {cursor}")
        _, data_offset, descriptor = place(cursor, e.name_nbytes, nbytes, alignment)
        if bool(e.flags & 0x8) != bool(descriptor):
            return offsets, f"{e.name}: data descriptor flag differs from torch's writer"
        offsets.append(data_offset)
        cursor = data_offset + nbytes + descriptor
    last = order[-1].header_offset
    following = min([x.header_offset for x in entries if x.header_offset > last]
                    + [trailer.cd_offset])
    if following != cursor:
        return offsets, (f"record after {order[-1].name} starts at {following}, arithmetic "
                         f"predicts {cursor}")
    return offsets, None
