"""Scan a torch.save zip archive into an :class:`ArchiveLayout`, every byte accounted for."""

from __future__ import annotations

import zlib

from ckptlab.errors import CorruptArchiveError, UnsupportedFormatError
from ckptlab.format import _zip
from ckptlab.format._pickle import PickleScan, scan_pickle
from ckptlab.format._source import ByteSource
from ckptlab.format.layout import ArchiveLayout, Record, Segment, SegmentKind, StorageInfo

__all__ = ["largest_alignment", "scan_torch_zip"]

_SMALL_RECORDS = (".format_version", ".storage_alignment", "byteorder")
_MAX_SMALL_RECORD = 64


def largest_alignment(offsets: list[int], cap: int = 4096) -> int:
    """Largest power of two <= cap dividing every offset (cap when there is none)."""
    alignment = cap
    for off in offsets:
        while off % alignment:
            alignment //= 2
    return alignment


def read_central_directory(src: ByteSource) -> tuple[_zip.Trailer, list[_zip.CentralEntry]]:
    """Trailer and central directory, in one or two reads."""
    window = _zip.tail_window(src.nbytes)
    tail_offset = src.nbytes - window
    tail = src.read(tail_offset, window, what="zip trailer")
    trailer = _zip.parse_trailer(tail, tail_offset, src.nbytes, src.name)
    if trailer.cd_offset >= tail_offset:
        start = trailer.cd_offset - tail_offset
        cd = tail[start:start + trailer.cd_nbytes]
    else:
        head = src.read(trailer.cd_offset, tail_offset - trailer.cd_offset,
                        what="central directory")
        cd = head + tail[: trailer.cd_offset + trailer.cd_nbytes - tail_offset]
    return trailer, _zip.parse_central_directory(cd, trailer, src.name)


def archive_prefix(entries: list[_zip.CentralEntry], path: str) -> str:
    """The archive prefix of a torch.save zip; other zips raise UnsupportedFormatError."""
    shorts = {e.name.split("/", 1)[1] if "/" in e.name else e.name for e in entries}
    if "constants.pkl" in shorts or any(s.startswith("code/") for s in shorts):
        raise UnsupportedFormatError(
            "a TorchScript archive (torch.jit.save); inspect a torch.save checkpoint, or load it "
            "with torch.jit.load", path=path)
    pkl = [e.name for e in entries if e.name.endswith("/data.pkl") or e.name == "data.pkl"]
    if not pkl:
        raise UnsupportedFormatError(
            f"a zip archive without data.pkl ({len(entries)} entries), not a torch.save "
            "checkpoint", path=path)
    if len(pkl) > 1:
        raise UnsupportedFormatError(f"a zip archive with {len(pkl)} data.pkl records", path=path)
    return pkl[0][: -len("data.pkl")].rstrip("/")


def read_record_data(src: ByteSource, record: Record, limit: int | None = None) -> bytes:
    """The (decompressed) payload of a record; ``limit`` bounds the uncompressed size."""
    if limit is not None and record.uncompressed_nbytes > limit:
        raise CorruptArchiveError("record is larger than the format allows", path=src.name,
                                  record=record.name, offset=record.data_offset,
                                  expected=f"<= {limit} bytes",
                                  actual=f"{record.uncompressed_nbytes} bytes")
    raw = src.read(record.data_offset, record.data_nbytes, what="record data",
                   record=record.name)
    if record.method == 0:
        return raw
    if record.method != 8:
        raise UnsupportedFormatError(f"record compressed with zip method {record.method}",
                                     path=src.name, record=record.name,
                                     offset=record.header_offset)
    if record.uncompressed_nbytes > 1032 * record.data_nbytes + 64:  # deflate's maximum ratio
        raise CorruptArchiveError("uncompressed size impossible for deflate", path=src.name,
                                  record=record.name, offset=record.header_offset,
                                  expected=f"<= {1032 * record.data_nbytes + 64} bytes",
                                  actual=f"{record.uncompressed_nbytes} bytes")
    inflater = zlib.decompressobj(-15)
    try:
        out = inflater.decompress(raw, record.uncompressed_nbytes + 1)
    except zlib.error as exc:
        raise CorruptArchiveError(f"cannot inflate record: {exc}", path=src.name,
                                  record=record.name, offset=record.data_offset) from None
    if len(out) != record.uncompressed_nbytes:
        raise CorruptArchiveError("inflated size differs from the central directory",
                                  path=src.name, record=record.name, offset=record.data_offset,
                                  expected=record.uncompressed_nbytes, actual=len(out))
    return out


def _segments(records: list[Record], headers: dict[str, _zip.LocalHeader],
              trailer: _zip.Trailer, file_nbytes: int, path: str) -> tuple[Segment, ...]:
    segs: list[Segment] = []
    for r in sorted(records, key=lambda r: r.header_offset):
        segs.append(Segment(SegmentKind.LOCAL_HEADER, r.header_offset, 30, r.name))
        segs.append(Segment(SegmentKind.NAME, r.header_offset + 30, r.name_nbytes, r.name))
        for kind, off, nbytes in headers[r.name].fields:
            segs.append(Segment(SegmentKind(kind), off, nbytes, r.name))
        segs.append(Segment(SegmentKind.DATA, r.data_offset, r.data_nbytes, r.name))
        if r.descriptor_nbytes:
            segs.append(Segment(SegmentKind.DESCRIPTOR, r.data_offset + r.data_nbytes,
                                r.descriptor_nbytes, r.name))
    segs.append(Segment(SegmentKind.CENTRAL_DIRECTORY, trailer.cd_offset, trailer.cd_nbytes))
    if trailer.zip64_eocd_offset is not None and trailer.zip64_locator_offset is not None:
        segs.append(Segment(SegmentKind.ZIP64_EOCD, trailer.zip64_eocd_offset,
                            trailer.zip64_eocd_nbytes))
        segs.append(Segment(SegmentKind.ZIP64_LOCATOR, trailer.zip64_locator_offset,
                            _zip.ZIP64_LOCATOR.size))
    segs.append(Segment(SegmentKind.EOCD, trailer.eocd_offset, trailer.eocd_nbytes))
    segs = [s for s in segs if s.nbytes > 0]
    tiled: list[Segment] = []
    cursor = 0
    for s in segs:
        if s.offset < cursor:
            prev = tiled[-1]
            raise CorruptArchiveError(
                f"{s.kind.value} overlaps the {prev.kind.value} of {prev.record or 'the archive'}",
                path=path, record=s.record, offset=s.offset, expected=f">= {cursor}",
                actual=s.offset)
        if s.offset > cursor:
            tiled.append(Segment(SegmentKind.UNKNOWN, cursor, s.offset - cursor))
        tiled.append(s)
        cursor = s.end_offset
    if cursor < file_nbytes:
        tiled.append(Segment(SegmentKind.UNKNOWN, cursor, file_nbytes - cursor))
    return tuple(tiled)


def scan_torch_zip(src: ByteSource) -> ArchiveLayout:
    """Full layout of a torch.save zip archive (reads every header, descriptor and data.pkl)."""
    trailer, entries = read_central_directory(src)
    archive = archive_prefix(entries, src.name)
    records: list[Record] = []
    headers: dict[str, _zip.LocalHeader] = {}
    for e in entries:
        if e.name in headers:
            raise CorruptArchiveError("duplicate record name", path=src.name, record=e.name,
                                      offset=e.entry_offset)
        local = _zip.read_local_header(src, e)
        data_offset = local.data_offset(e.header_offset, e.name_nbytes)
        if data_offset + e.compressed_nbytes > trailer.cd_offset:
            raise CorruptArchiveError("record data runs into the central directory",
                                      path=src.name, record=e.name, offset=data_offset,
                                      expected=f"end <= {trailer.cd_offset}",
                                      actual=f"end at {data_offset + e.compressed_nbytes}")
        desc = _zip.descriptor_nbytes(src, e, data_offset + e.compressed_nbytes,
                                      local.zip64_extra_nbytes > 0)
        headers[e.name] = local
        records.append(Record(e.name, e.header_offset, e.name_nbytes, local.extra_nbytes,
                              local.zip64_extra_nbytes, local.padding_nbytes, data_offset,
                              e.compressed_nbytes, desc, e.crc32, e.uncompressed_nbytes,
                              e.method))
    segments = _segments(records, headers, trailer, src.nbytes, src.name)
    by_name = {r.name: r for r in records}
    prefix = f"{archive}/" if archive else ""

    def small(name: str) -> str | None:
        rec = by_name.get(prefix + name)
        if rec is None:
            return None
        raw = read_record_data(src, rec, limit=_MAX_SMALL_RECORD)
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise CorruptArchiveError("record is not ASCII text", path=src.name,
                                      record=rec.name, offset=rec.data_offset) from None

    format_version, alignment_text, byteorder = (small(n) for n in _SMALL_RECORDS)
    storage_alignment = None
    if alignment_text is not None:
        if not alignment_text.isdigit() or not 0 < int(alignment_text) <= _zip.MAX_ALIGNMENT:
            rec = by_name[prefix + ".storage_alignment"]
            raise CorruptArchiveError("bad .storage_alignment", path=src.name, record=rec.name,
                                      offset=rec.data_offset, expected=f"1..{_zip.MAX_ALIGNMENT}",
                                      actual=repr(alignment_text))
        storage_alignment = int(alignment_text)
    pkl = by_name[prefix + "data.pkl"]
    scan = scan_pickle(read_record_data(src, pkl), path=src.name, record=pkl.name,
                       data_offset=pkl.data_offset)
    storages = storage_infos(scan, by_name, prefix, src.name, pkl)
    return ArchiveLayout(
        format="torch-zip",
        path=src.name,
        file_nbytes=src.nbytes,
        archive_name=archive,
        records=tuple(records),
        storages=storages,
        tensors=scan.tensors,
        segments=segments,
        alignment=largest_alignment([s.data_offset for s in storages if s.nbytes]),
        zip64=any(r.zip64_extra_nbytes for r in records),
        central_directory_offset=trailer.cd_offset,
        central_directory_nbytes=trailer.cd_nbytes,
        zip64_eocd_offset=trailer.zip64_eocd_offset,
        zip64_locator_offset=trailer.zip64_locator_offset,
        eocd_offset=trailer.eocd_offset,
        storage_alignment=storage_alignment,
        format_version=format_version,
        byteorder=byteorder,
        pickle_protocol=scan.protocol,
    )


def storage_infos(scan: PickleScan, records: dict[str, Record], prefix: str,
                  path: str, pkl: Record) -> tuple[StorageInfo, ...]:
    """Join the pickle's storages with their records (each must exist with the right size)."""
    view_dtype: dict[str, str] = {}
    for t in scan.tensors:
        view_dtype.setdefault(t.storage_key, t.dtype)
    out = []
    for s in scan.storages:
        name = f"{prefix}data/{s.key}"
        rec = records.get(name)
        if rec is None:
            raise CorruptArchiveError(f"the pickle references storage {s.key!r} but the archive "
                                      f"has no record {name!r}", path=path, record=pkl.name,
                                      offset=pkl.header_offset)
        if rec.uncompressed_nbytes != s.nbytes:
            raise CorruptArchiveError("storage record size differs from the pickle's "
                                      f"{s.storage_type} of {s.numel} elements", path=path,
                                      record=name, offset=rec.header_offset,
                                      expected=f"{s.nbytes} bytes",
                                      actual=f"{rec.uncompressed_nbytes} bytes")
        dtype = s.dtype if s.storage_type != "UntypedStorage" else view_dtype.get(s.key, "uint8")
        out.append(StorageInfo(s.key, name, dtype, s.nbytes, rec.data_offset, s.location,
                               s.storage_type))
    return tuple(out)
