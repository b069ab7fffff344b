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
from ckptlab.format.archive import (
    archive_prefix,
    read_central_directory_columns,
    storage_alignment_value,
)
from ckptlab.format.inspect import not_a_checkpoint, sniff
from ckptlab.source._bytes import ByteSource

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
    alignment: int  # recorded: the .storage_alignment record (else torch's 64) the arithmetic used
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
            trailer, cdir = read_central_directory_columns(src)
        except ArchiveError:
            kind = sniff(src)  # only on failure: say what the file is, if it is not a zip
            if kind != "torch-zip":
                raise not_a_checkpoint(src, kind) from None
            raise
        names = cdir.names
        archive = archive_prefix(cdir, src.name)
        prefix = f"{archive}/" if archive else ""
        storage_prefix = prefix + "data/"
        # record name -> row: a dict when the pickle names every storage, else a few searches
        row_of = {name: i for i, name in enumerate(names)} if scan else None

        def find(name: str) -> _zip.CentralEntry | None:
            if row_of is not None:
                i = row_of.get(name)
                return None if i is None else cdir.entry(i)
            try:
                return cdir.entry(names.index(name))
            except ValueError:
                return None

        # the records the arithmetic needs, each from its header to the next header, read in
        # as few reads as possible: torch writes them next to each other at the head
        needed = [e for e in map(find, [prefix + ".storage_alignment"] + (
            [prefix + "data.pkl"] if scan else [])) if e is not None]
        spans = _record_spans(needed, cdir, trailer.cd_offset)
        for lo, hi in spans:
            src.read(lo, hi - lo, what="records before the storages")
        span_end = {e.name: hi for e in needed for lo, hi in spans
                    if lo <= e.header_offset < hi}

        def payload(e: _zip.CentralEntry) -> bytes:
            local = _zip.read_local_header(src, e, span_end.get(e.name))
            if e.method != 0:
                raise UnsupportedFormatError(f"record compressed with zip method {e.method}",
                                             path=src.name, record=e.name,
                                             offset=e.header_offset)
            return src.read(local.data_offset(e.header_offset, e.name_nbytes),
                            e.compressed_nbytes, what="record data", record=e.name)

        alignment = DEFAULT_ALIGNMENT
        rec = find(prefix + ".storage_alignment")
        if rec is not None:
            alignment = storage_alignment_value(payload(rec), path=src.name, record=rec.name,
                                                offset=rec.header_offset)
        if scan:
            assert row_of is not None
            pkl = cdir.entry(row_of[prefix + "data.pkl"])
            scanned = scan_pickle(payload(pkl), path=src.name, record=pkl.name)
            rows = []
            for s in scanned.storages:
                i = row_of.get(storage_prefix + s.key)
                if i is None:
                    raise CorruptArchiveError(f"the pickle references storage {s.key!r} but the "
                                              f"archive has no record {storage_prefix + s.key!r}",
                                              path=src.name, record=pkl.name,
                                              offset=pkl.header_offset)
                e = cdir.entry(i)
                if e.uncompressed_nbytes != s.nbytes:
                    raise CorruptArchiveError("storage record size differs from the pickle",
                                              path=src.name, record=e.name,
                                              offset=e.header_offset, expected=s.nbytes,
                                              actual=e.uncompressed_nbytes)
                rows.append(i)
        else:
            rows = _rows_starting(cdir, storage_prefix)
        suspects = rows  # the storages that may be compressed, in order
        if cdir.method is not None and rows:
            suspects = [rows[i] for i in (cdir.method[rows] != 0).nonzero()[0][:1].tolist()]
        for e in map(cdir.entry, suspects):
            if e.method != 0:  # compressed bytes have no offset a reader could map
                raise UnsupportedFormatError(
                    f"storage record compressed with zip method {e.method}: its bytes cannot "
                    "be read in place", path=src.name, record=e.name, offset=e.header_offset)
        keys = _cut(names, rows, storage_prefix)
        data_offsets = _cursor_columns(cdir, rows, trailer, alignment)
        reason = None
        if data_offsets is None:  # a small archive, or the arithmetic disagrees: say where
            entries = cdir.entries
            order = [entries[i] for i in rows]
            data_offsets, reason = _cursor_offsets(order, entries, trailer, alignment)
            if reason is not None:  # not torch's write order: read each storage's header
                data_offsets = []
                for e in order:
                    local = _zip.read_local_header(src, e)
                    data_offsets.append(local.data_offset(e.header_offset, e.name_nbytes))
        return StorageOffsets(dict(zip(keys, data_offsets)), src.reads, src.bytes_read,
                              "cursor" if reason is None else "central_directory", archive,
                              alignment, reason)


_MERGE_GAP = 1 << 16  # read across gaps up to this size rather than make another read


def _rows_starting(cdir: _zip.CentralDirectory, prefix: str) -> list[int]:
    """Rows of the names that start with ``prefix``, in order."""
    if cdir.raw_names is None or not prefix.isascii() or not prefix or not len(cdir.raw_names):
        return [i for i, name in enumerate(cdir.names) if name.startswith(prefix)]
    import numpy as np

    # an ASCII prefix is the same bytes in UTF-8 and cp437 names, and no other bytes decode to
    # it: compare the raw names' first bytes
    want = np.frombuffer(prefix.encode("ascii"), np.uint8)
    long_enough = cdir.name_nbytes >= len(want)
    at = np.minimum(cdir.name_starts[:, None] + np.arange(len(want)), len(cdir.raw_names) - 1)
    same = (cdir.raw_names[at] == want).all(axis=1) & long_enough
    return same.nonzero()[0].tolist()


def _cut(names: list[str], rows: list[int], prefix: str) -> list[str]:
    """``names[i][len(prefix):]`` for each row (all start with ``prefix``)."""
    cut = len(prefix)
    if rows and rows[-1] - rows[0] == len(rows) - 1:  # consecutive rows: one slice of names
        block = "\n".join(names[rows[0]:rows[-1] + 1])
        if block.count("\n") == len(rows) - 1:  # no name with a newline
            return ("\n" + block).replace("\n" + prefix, "\n")[1:].split("\n")
    return [names[i][cut:] for i in rows]


def _record_spans(wanted: list[_zip.CentralEntry], cdir: _zip.CentralDirectory,
                  cd_offset: int) -> list[tuple[int, int]]:
    """Byte ranges [header, next header) of ``wanted`` records, merged when close together."""
    # parse_central_directory guarantees every record ends before the directory, so each
    # wanted header has a next start (another header, or the directory itself)
    if cdir.header_offset is not None:
        heads = cdir.header_offset
        ranges = [(e.header_offset, min(int(heads[heads > e.header_offset].min(initial=cd_offset)),
                                        cd_offset)) for e in wanted]
    else:
        heads = sorted({e.header_offset for e in cdir.entries} | {cd_offset})
        ranges = [(e.header_offset, heads[bisect.bisect_right(heads, e.header_offset)])
                  for e in wanted]
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + _MERGE_GAP:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _cursor_columns(cdir: _zip.CentralDirectory, rows: list[int], trailer: _zip.Trailer,
                    alignment: int) -> list[int] | None:
    """:func:`_cursor_offsets` with numpy, when it would find no disagreement (else None).

    torch's cursor starts at the first storage's header and moves to the end of each record;
    checking every header offset against the cursor is checking that each record starts where
    the previous one ends, so every record's placement can be computed from its own header.
    """
    if cdir.header_offset is None:
        return None  # a small archive: record by record
    if not rows:
        return []
    import numpy as np

    at = np.asarray(rows, np.int64)
    hdr = cdir.header_offset[at]
    name_nbytes = cdir.name_nbytes[at]
    nbytes = cdir.uncompressed_nbytes[at]
    if hdr.max() >= 1 << 62 or nbytes.max() >= 1 << 62:
        return None
    big_size = nbytes >= _zip.U32_MAX
    big_offset = hdr >= _zip.U32_MAX
    zip64 = np.where(big_size | big_offset, 4 + 16 * big_size + 8 * big_offset, 0)
    start = hdr + _zip.LOCAL_HEADER.size + name_nbytes + zip64 + 4
    data = -(-start // alignment) * alignment
    descriptor = np.where(nbytes == 0, 0, np.where(zip64 > 0, 24, 16))
    end = data + nbytes + descriptor
    if not ((cdir.compressed_nbytes[at] == nbytes).all()
            and ((cdir.flags[at] & 0x8 != 0) == (descriptor != 0)).all()
            and (hdr[1:] == end[:-1]).all()):
        return None
    after = cdir.header_offset[cdir.header_offset > hdr[-1]]
    following = min(int(after.min()), trailer.cd_offset) if len(after) else trailer.cd_offset
    return data.tolist() if following == end[-1] else None


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
