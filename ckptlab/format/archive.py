"""Scan a torch.save zip archive into an :class:`ArchiveLayout`, every byte accounted for."""

from __future__ import annotations

import string
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
    trailer = _zip.parse_trailer(
        tail, tail_offset, src.nbytes, src.name,
        read=lambda offset, nbytes: src.read(offset, nbytes, what="zip signature"))
    if trailer.cd_offset >= tail_offset:
        start = trailer.cd_offset - tail_offset
        cd = tail[start:start + trailer.cd_nbytes]
    else:
        head = src.read(trailer.cd_offset, tail_offset - trailer.cd_offset,
                        what="central directory")
        cd = head + tail[: trailer.cd_offset + trailer.cd_nbytes - tail_offset]
    return trailer, _zip.parse_central_directory(cd, trailer, src.name)


def fold_name(name: str) -> str:
    """A record name as torch's reader compares it: ASCII letters lowercased.

    torch looks records up with ``mz_zip_reader_locate_file(..., flags=0)``: a binary search
    over the names with ``MZ_TOLOWER``, so ``archive/DATA.PKL`` answers for
    ``archive/data.pkl`` and, of two names that differ only in case, the search decides which.
    """
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def archive_prefix(entries: list[_zip.CentralEntry], path: str) -> str:
    """The archive prefix of a torch.save zip; other zips raise UnsupportedFormatError.

    Refuses (:class:`CorruptArchiveError`) names that only differ in case (torch's lookups
    ignore ASCII case, so which one it reads is up to its search), and a data.pkl outside the
    first record's directory (torch takes the archive name from the first record).
    """
    seen: dict[str, _zip.CentralEntry] = {}
    for e in entries:
        key = fold_name(e.name)
        if key in seen:
            first = seen[key]
            same = first.name == e.name
            raise CorruptArchiveError(
                "duplicate record name" if same else
                f"record names differ only in case ({first.name!r} at central directory offset "
                f"{first.entry_offset}): torch's reader ignores ASCII case and could read "
                "either", path=path, record=e.name, offset=e.entry_offset)
        seen[key] = e
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
    prefix = pkl[0][: -len("data.pkl")].rstrip("/")
    first = entries[0].name
    if "/" in first and fold_name(first.split("/", 1)[0]) != fold_name(prefix):
        raise UnsupportedFormatError(
            f"data.pkl is under {prefix + '/'!r} but the first record is {first!r}: torch "
            "takes the archive name from the first record and would not find this data.pkl",
            path=path, record=pkl[0], offset=entries[0].entry_offset)
    return prefix


# Inflating: a deflated record may expand up to 1032x. torch's reader inflates data.pkl whatever
# its size (miniz supports deflate; torch.load reads a data.pkl that Python's zipfile deflated),
# but a real pickle deflates only 2.5-5x (tiny_gpt 2.5x; 10k tensors, shared views, optimizer
# state 3.6-4.9x), so its uncompressed size stays under 5x the whole file. ckptlab inflates at
# most max(1 MiB, 16 x file size): three times that headroom, and inspecting a file never holds
# more than 16x its size (1 MiB for tiny files) of inflated bytes.
INFLATE_MIN_BUDGET = 1 << 20
INFLATE_FILE_RATIO = 16
_INFLATE_CHUNK = 1 << 20  # compressed bytes read and fed per step


def inflate_budget(file_nbytes: int) -> int:
    """Most uncompressed bytes ckptlab inflates from one record of a file of this size."""
    return max(INFLATE_MIN_BUDGET, INFLATE_FILE_RATIO * file_nbytes)


def read_record_data(src: ByteSource, record: Record, limit: int | None = None) -> bytes:
    """The (decompressed) payload of a record; ``limit`` bounds the uncompressed size.

    A deflated record is inflated in steps of 1 MiB of input, each bounded to the bytes still
    expected (``decompress(data, max_length)``), so memory stays within the declared size,
    which must be within :func:`inflate_budget`; a stream that would inflate past its
    declared size stops there.
    """
    if limit is not None and record.uncompressed_nbytes > limit:
        raise CorruptArchiveError("record is larger than the format allows", path=src.name,
                                  record=record.name, offset=record.data_offset,
                                  expected=f"<= {limit} bytes",
                                  actual=f"{record.uncompressed_nbytes} bytes")
    if record.method == 0:
        return src.read(record.data_offset, record.data_nbytes, what="record data",
                        record=record.name)
    if record.method != 8:
        raise UnsupportedFormatError(f"record compressed with zip method {record.method}",
                                     path=src.name, record=record.name,
                                     offset=record.header_offset)
    if record.uncompressed_nbytes > 1032 * record.data_nbytes + 64:  # deflate's maximum ratio
        raise CorruptArchiveError("uncompressed size impossible for deflate", path=src.name,
                                  record=record.name, offset=record.header_offset,
                                  expected=f"<= {1032 * record.data_nbytes + 64} bytes",
                                  actual=f"{record.uncompressed_nbytes} bytes")
    budget = inflate_budget(src.nbytes)
    if record.uncompressed_nbytes > budget:
        ratio = record.uncompressed_nbytes / max(1, record.data_nbytes)
        raise CorruptArchiveError(
            f"record inflates {ratio:.0f}x, from {record.data_nbytes} to "
            f"{record.uncompressed_nbytes} bytes, more than ckptlab inflates for a file of "
            f"{src.nbytes} bytes (max(1 MiB, {INFLATE_FILE_RATIO} x file size)): a zip bomb, "
            "or not a checkpoint pickle", path=src.name, record=record.name,
            offset=record.header_offset, expected=f"<= {budget} bytes uncompressed",
            actual=f"{record.uncompressed_nbytes} bytes")
    want = record.uncompressed_nbytes
    inflater = zlib.decompressobj(-15)
    parts: list[bytes] = []
    got = 0
    fed = 0
    try:
        while True:
            if inflater.unconsumed_tail:
                data = inflater.unconsumed_tail
            elif fed < record.data_nbytes:
                n = min(_INFLATE_CHUNK, record.data_nbytes - fed)
                data = src.read(record.data_offset + fed, n, what="record data",
                                record=record.name)
                fed += n
            else:
                break
            part = inflater.decompress(data, want + 1 - got)  # one byte more shows a liar
            parts.append(part)
            got += len(part)
            if got > want or inflater.eof:
                break
    except zlib.error as exc:
        raise CorruptArchiveError(f"cannot inflate record: {exc}", path=src.name,
                                  record=record.name, offset=record.data_offset) from None
    if got > want:
        raise CorruptArchiveError("record inflates past the size the central directory gives",
                                  path=src.name, record=record.name, offset=record.data_offset,
                                  expected=f"{want} bytes", actual=f"more than {want} bytes")
    if got != want:
        raise CorruptArchiveError("inflated size differs from the central directory",
                                  path=src.name, record=record.name, offset=record.data_offset,
                                  expected=want, actual=got)
    if not inflater.eof:  # torch's reader (tinfl) fails on a stream without its final block
        raise CorruptArchiveError("deflate stream ends without its final block",
                                  path=src.name, record=record.name,
                                  offset=record.data_offset + record.data_nbytes)
    return parts[0] if len(parts) == 1 else b"".join(parts)


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
    # looked up as torch does, ignoring ASCII case (archive_prefix refused names that collide)
    by_name = {fold_name(r.name): r for r in records}
    prefix = f"{archive}/" if archive else ""

    def small(name: str) -> str | None:
        rec = by_name.get(fold_name(prefix + name))
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
        if not (alignment_text.isdigit() and len(alignment_text) <= 10 and
                0 < int(alignment_text) <= _zip.MAX_RECORDED_ALIGNMENT):
            rec = by_name[fold_name(prefix + ".storage_alignment")]
            raise CorruptArchiveError("bad .storage_alignment", path=src.name, record=rec.name,
                                      offset=rec.data_offset,
                                      expected=f"1..{_zip.MAX_RECORDED_ALIGNMENT}",
                                      actual=repr(alignment_text))
        storage_alignment = int(alignment_text)
    pkl = by_name[fold_name(prefix + "data.pkl")]
    scan = scan_pickle(read_record_data(src, pkl), path=src.name, record=pkl.name,
                       data_offset=pkl.data_offset)
    storages = storage_infos(scan, by_name, prefix, src.name, pkl, fold=True)
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
        logical=scan.logical,
        objects=scan.objects,
    )


def storage_infos(scan: PickleScan, records: dict[str, Record], prefix: str,
                  path: str, pkl: Record, *, fold: bool = False) -> tuple[StorageInfo, ...]:
    """Join the pickle's storages with their records (each must exist with the right size).

    With ``fold``, ``records`` is keyed by :func:`fold_name` (torch's case-blind lookup).
    """
    view_dtype: dict[str, str] = {}
    for t in scan.tensors:
        view_dtype.setdefault(t.storage_key, t.dtype)
    out = []
    for s in scan.storages:
        name = f"{prefix}data/{s.key}"
        rec = records.get(fold_name(name) if fold else name)
        if rec is None:
            raise CorruptArchiveError(f"the pickle references storage {s.key!r} but the archive "
                                      f"has no record {name!r}", path=path, record=pkl.name,
                                      offset=pkl.header_offset)
        if rec.uncompressed_nbytes != s.nbytes:
            raise CorruptArchiveError("storage record size differs from the pickle's "
                                      f"{s.storage_type} of {s.numel} elements", path=path,
                                      record=rec.name, offset=rec.header_offset,
                                      expected=f"{s.nbytes} bytes",
                                      actual=f"{rec.uncompressed_nbytes} bytes")
        dtype = s.dtype if s.storage_type != "UntypedStorage" else view_dtype.get(s.key, "uint8")
        out.append(StorageInfo(s.key, rec.name, dtype, s.nbytes, rec.data_offset, s.location,
                               s.storage_type))
    return tuple(out)
