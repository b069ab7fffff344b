"""A torch.save archive read at the cost of its directory: in at most three requests.

:func:`ckptlab.format.archive.scan_torch_zip` reads every local header (a read per cluster of
headers: one per record when the storages are large), which where each read is a request
(a source with ``costly_reads``: behind a URL) is a round trip per tensor.
:func:`scan_torch_zip_cheapest` scans such a source here instead. Here the local headers of the storage records are not read: torch's writer places every
record by arithmetic (``_zip.record_placement``: 30-byte header, name, zip64 extra when sizes or
offsets pass 4 GiB, the 'FB' field padding the data to the storage alignment, a 16/24-byte
descriptor), so each record's layout follows from its central directory entry and the
alignment, and is verified against the directory: every record must end exactly where the next
one's header starts (the last where the directory starts), stored (method 0) with its
descriptor flag as torch writes it.

Requests: (1) the file's tail (a suffix request, which also gives its size) holding the
trailer and, up to about 15,000 records, the central directory; (2) the rest of the directory
when it is longer; (3) the records that are not storages, from their header to the next
header (``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder`` at the head;
``version`` and ``.data/serialization_id`` sit before the directory, in the tail already).

What is checked as on a local file: the trailer, the whole central directory (names, sizes,
duplicates, case collisions, bounds), the local headers, names and descriptors of every record
that is not a storage, the pickle (bounded scanner, nothing runs), every storage record against
the pickle (exists, size). What is not: the storage records' local header bytes and
descriptors (their signature, the name repeated in the header, the padding field's bytes, the
CRC and sizes in the descriptor). A file whose directory does not follow torch's placement is
scanned the local way instead (more requests), with a note saying so.
"""

from __future__ import annotations

from ckptlab.errors import CorruptArchiveError
from ckptlab.format import _zip
from ckptlab.format._pickle import scan_pickle
from ckptlab.format.archive import (
    _SMALL_RECORDS,
    archive_prefix,
    fold_name,
    fold_names,
    read_central_directory_columns,
    read_record_data,
    read_small_record,
    record_segments,
    scan_torch_zip,
    storage_alignment_value,
    storage_infos,
    torch_zip_layout,
)
from ckptlab.format.layout import ArchiveLayout, Record
from ckptlab.source import ByteSource

__all__ = ["NotTorchPlacementError", "looks_like_zip", "scan_torch_zip_cheapest",
           "scan_torch_zip_placed"]

_MERGE_GAP = 1 << 16  # fetch across gaps up to this size rather than make another request
_DEFAULT_ALIGNMENT = 64  # torch's before .storage_alignment existed


class NotTorchPlacementError(Exception):
    """The archive's records are not where torch's writer puts them (the reason in words)."""


def looks_like_zip(src: ByteSource) -> bool:
    """Whether the bytes already kept from the end of the file (a URL's first request moved
    them) hold a zip end record; False when none are kept (a local file: the caller sniffs
    its head)."""
    tail = src.kept(src.nbytes - _zip.tail_window(src.nbytes), _zip.tail_window(src.nbytes))
    return tail is not None and b"PK\x05\x06" in tail


def scan_torch_zip_cheapest(src: ByteSource) -> tuple[ArchiveLayout, str | None]:
    """The layout of a torch.save zip, read the way ``src`` reads cheapest, and a note when
    that was not the way asked: where reads are costly (``src.costly_reads``) the storage
    records' local headers are derived (:func:`scan_torch_zip_placed`), unless the records
    are not placed as torch places them (the note says why: every local header was read);
    every local header is read otherwise (:func:`~ckptlab.format.archive.scan_torch_zip`).

    Raises
    ------
    ArchiveError
        As :func:`~ckptlab.format.archive.scan_torch_zip`.
    """
    if src.costly_reads:
        try:
            return scan_torch_zip_placed(src), None
        except NotTorchPlacementError as exc:
            return scan_torch_zip(src), (
                f"records not placed as torch.save places them ({exc}); every local header "
                "was read, a request per record or cluster")
    return scan_torch_zip(src), None


def scan_torch_zip_placed(src: ByteSource) -> ArchiveLayout:
    """The :class:`ArchiveLayout` of a torch.save zip in at most 3 reads (requests).

    Raises
    ------
    NotTorchPlacementError
        The records are not placed as torch's writer places them: scan it with
        :func:`ckptlab.format.archive.scan_torch_zip` (a request per record or cluster).
    ArchiveError
        As :func:`~ckptlab.format.archive.scan_torch_zip`.
    """
    return _scan(src)


def _scan(src: ByteSource) -> ArchiveLayout:
    trailer, cdir = read_central_directory_columns(src)
    archive = archive_prefix(cdir, src.name)
    prefix = f"{archive}/" if archive else ""
    entries = sorted(cdir.entries, key=lambda e: e.header_offset)
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for e in cdir.entries:
            if e.name in seen:
                raise CorruptArchiveError("duplicate record name", path=src.name, record=e.name,
                                          offset=e.entry_offset)
            seen.add(e.name)
    ends = [e.header_offset for e in entries[1:]] + [trailer.cd_offset]
    storage_start = fold_name(prefix + "data/")
    folded = fold_names(names)
    # every record that is not a storage, from its header to the next: one request for the
    # head of the file (the tail holds those before the directory)
    wanted = sorted((e.header_offset, end) for e, end, f in zip(entries, ends, folded)
                    if not f.startswith(storage_start))
    merged: list[tuple[int, int]] = []
    for lo, hi in wanted:
        if merged and lo <= merged[-1][1] + _MERGE_GAP:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    src.prefetch(merged)
    kept = src.kept_ranges()

    def is_kept(lo: int, hi: int) -> bool:
        return any(a <= lo and hi <= b for a, b in kept)

    # the records whose bytes are here are read as on a local file, every check made
    real: dict[str, tuple[_zip.LocalHeader, int]] = {}
    for e, end in zip(entries, ends):
        if e.header_offset < end and is_kept(e.header_offset, end):
            local = _zip.read_local_header(src, e, end)
            data_at = local.data_offset(e.header_offset, e.name_nbytes)
            if data_at + e.compressed_nbytes > trailer.cd_offset:
                raise CorruptArchiveError("record data runs into the central directory",
                                          path=src.name, record=e.name, offset=data_at,
                                          expected=f"end <= {trailer.cd_offset}",
                                          actual=f"end at {data_at + e.compressed_nbytes}")
            desc = _zip.descriptor_nbytes(src, e, data_at + e.compressed_nbytes,
                                          local.zip64_extra_nbytes > 0)
            real[e.name] = (local, desc)
    by_folded = dict(zip(folded, entries))

    def small_text(name: str) -> str | None:
        e = by_folded.get(fold_name(prefix + name))
        if e is None or e.name not in real:
            return None
        local, _ = real[e.name]
        return read_small_record(src, _record(e, local, real[e.name][1]))

    format_version, alignment_text, byteorder = (small_text(n) for n in _SMALL_RECORDS)
    storage_alignment = None
    if alignment_text is not None:
        e = by_folded[fold_name(prefix + ".storage_alignment")]
        storage_alignment = storage_alignment_value(alignment_text, path=src.name,
                                                    record=e.name, offset=e.header_offset)
    alignment = storage_alignment or _DEFAULT_ALIGNMENT

    records: list[Record] = []
    headers: dict[str, _zip.LocalHeader] = {}
    for e, end in zip(entries, ends):
        if e.name in real:
            local, desc = real[e.name]
        else:
            local, desc = _placed(e, end, alignment, src.name)
        headers[e.name] = local
        records.append(_record(e, local, desc))
    segments = record_segments(records, headers, trailer, src.nbytes, src.name)
    by_name = dict(zip(fold_names([r.name for r in records]), records))
    pkl = by_name.get(fold_name(prefix + "data.pkl"))
    if pkl is None or pkl.name not in real:  # archive_prefix found it: it must be a record
        raise NotTorchPlacementError("data.pkl is not among the records read")
    scan = scan_pickle(read_record_data(src, pkl), path=src.name, record=pkl.name,
                       data_offset=pkl.data_offset)
    storages = storage_infos(scan, by_name, prefix, src.name, pkl, fold=True)
    order = {r.name: i for i, r in enumerate(records)}
    records_cd = [records[order[e.name]] for e in cdir.entries]  # central directory order
    return torch_zip_layout(src, archive, records_cd, segments, trailer, scan, storages,
                            storage_alignment=storage_alignment, format_version=format_version,
                            byteorder=byteorder)


def _record(e: _zip.CentralEntry, local: _zip.LocalHeader, descriptor: int) -> Record:
    return Record(e.name, e.header_offset, e.name_nbytes, local.extra_nbytes,
                  local.zip64_extra_nbytes, local.padding_nbytes,
                  local.data_offset(e.header_offset, e.name_nbytes), e.compressed_nbytes,
                  descriptor, e.crc32, e.uncompressed_nbytes, e.method)


def _placed(e: _zip.CentralEntry, next_header: int, alignment: int,
            path: str) -> tuple[_zip.LocalHeader, int]:
    """The local header torch's writer gives ``e`` (not read), checked against where the
    next record (or the directory) starts; NotTorchPlacementError when it does not fit."""
    nbytes = e.uncompressed_nbytes
    if e.method != 0 or e.compressed_nbytes != nbytes:
        raise NotTorchPlacementError(f"{e.name}: compressed (method {e.method})")
    zip64, data_offset, descriptor = _zip.record_placement(e.header_offset, e.name_nbytes,
                                                           nbytes, alignment)
    if bool(e.flags & 0x8) != bool(descriptor):
        raise NotTorchPlacementError(f"{e.name}: data descriptor flag differs from torch's")
    if data_offset + nbytes + descriptor != next_header:
        raise NotTorchPlacementError(
            f"{e.name}: torch's placement ends it at {data_offset + nbytes + descriptor}, the "
            f"next record starts at {next_header}")
    at = e.header_offset + _zip.LOCAL_HEADER.size + e.name_nbytes
    padding = data_offset - (at + zip64 + 4)
    fields = ((("zip64_extra", at, zip64),) if zip64 else ()) + (
        ("padding", at + zip64, 4 + padding),)
    return _zip.LocalHeader(zip64 + 4 + padding, zip64, padding, fields), descriptor
