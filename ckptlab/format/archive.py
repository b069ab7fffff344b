"""Scan a torch.save zip archive into an :class:`ArchiveLayout`, every byte accounted for."""

from __future__ import annotations

import functools
import operator
import string
import zlib
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from ckptlab.errors import CorruptArchiveError, UnsupportedFormatError
from ckptlab.format import _zip
from ckptlab.format._bulk import LazyTuple, build, fields
from ckptlab.format._bulk import columns as _columns
from ckptlab.format._pickle import PickleScan, scan_pickle
from ckptlab.format.layout import (
    SEGMENT_KINDS,
    ArchiveLayout,
    Record,
    Segment,
    SegmentColumns,
    SegmentKind,
    SegmentTuple,
    StorageInfo,
)
from ckptlab.source._bytes import ByteSource

__all__ = ["largest_alignment", "scan_torch_zip"]

_SMALL_RECORDS = (".format_version", ".storage_alignment", "byteorder")
_MAX_SMALL_RECORD = 64


def largest_alignment(offsets: list[int], cap: int = 4096) -> int:
    """Largest power of two <= cap dividing every offset (cap when there is none)."""
    if cap > 0 and cap & (cap - 1) == 0:
        bits = functools.reduce(operator.or_, offsets, 0)  # the lowest set bit of any offset
        return cap if bits == 0 else min(cap, bits & -bits)
    alignment = cap
    for off in offsets:
        while off % alignment:
            alignment //= 2
    return alignment


def read_central_directory(src: ByteSource) -> tuple[_zip.Trailer, list[_zip.CentralEntry]]:
    """Trailer and central directory, in one or two reads."""
    trailer, cdir = read_central_directory_columns(src)
    return trailer, cdir.entries


def read_central_directory_columns(src: ByteSource) -> tuple[_zip.Trailer, _zip.CentralDirectory]:
    """:func:`read_central_directory` with the entries also as columns."""
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
    return trailer, _zip.central_directory(cd, trailer, src.name)


def fold_name(name: str) -> str:
    """A record name as torch's reader compares it: ASCII letters lowercased.

    torch looks records up with ``mz_zip_reader_locate_file(..., flags=0)``: a binary search
    over the names with ``MZ_TOLOWER``, so ``archive/DATA.PKL`` answers for
    ``archive/data.pkl`` and, of two names that differ only in case, the search decides which.
    """
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def fold_names(names: list[str]) -> list[str]:
    """:func:`fold_name` of every name (ASCII names lowercased in one call)."""
    joined = "\n".join(names)
    if joined.isascii() and joined.count("\n") == len(names) - 1:
        lowered = joined.lower()  # (torch's names are lower case already: nothing to split)
        return list(names) if lowered == joined else lowered.split("\n")
    return [name.translate(_ASCII_LOWER) for name in names]


def archive_prefix(entries: list[_zip.CentralEntry] | _zip.CentralDirectory, path: str) -> str:
    """The archive prefix of a torch.save zip; other zips raise UnsupportedFormatError.

    Refuses (:class:`CorruptArchiveError`) names that only differ in case (torch's lookups
    ignore ASCII case, so which one it reads is up to its search), and a data.pkl outside the
    first record's directory (torch takes the archive name from the first record).
    """
    if isinstance(entries, _zip.CentralDirectory):
        cdir = entries
        names = cdir.names
    else:
        names = [e.name for e in entries]
        cdir = _zip.CentralDirectory(entries, names)
    folded = cdir.folded = fold_names(names)
    if len(set(folded)) != len(folded):
        _refuse_duplicates(cdir.entries, path)
    # the names one per line (when none holds a newline): the checks below are substring
    # searches over that text instead of a Python loop over every name
    joined = "\n".join(names)
    if joined.count("\n") == len(names) - 1:
        torchscript = any(short == "constants.pkl" for short in _lines_with(
            joined, "constants.pkl", short=True)) or any(
            short.startswith("code/") for short in _lines_with(joined, "code/", short=True))
        pkl = [name for name in _lines_with(joined, "data.pkl")
               if name.endswith("/data.pkl") or name == "data.pkl"]
    else:
        shorts = {name.split("/", 1)[1] if "/" in name else name for name in names}
        torchscript = "constants.pkl" in shorts or any(s.startswith("code/") for s in shorts)
        pkl = [name for name in names if name.endswith("/data.pkl") or name == "data.pkl"]
    if torchscript:
        raise UnsupportedFormatError(
            "a TorchScript archive (torch.jit.save), not a torch.save checkpoint: open it with "
            "ckptlab.open (`ckptlab inspect` without --records), or load it with "
            "torch.jit.load", path=path)
    if not pkl:
        from ckptlab.format._kinds import foreign_zip

        raise UnsupportedFormatError(foreign_zip(names), path=path)
    if len(pkl) > 1:
        raise UnsupportedFormatError(f"a zip archive with {len(pkl)} data.pkl records", path=path)
    prefix = pkl[0][: -len("data.pkl")].rstrip("/")
    first = names[0]
    if "/" in first and fold_name(first.split("/", 1)[0]) != fold_name(prefix):
        raise UnsupportedFormatError(
            f"data.pkl is under {prefix + '/'!r} but the first record is {first!r}: torch "
            "takes the archive name from the first record and would not find this data.pkl",
            path=path, record=pkl[0], offset=cdir.entry(0).entry_offset)
    return prefix


def _lines_with(joined: str, needle: str, *, short: bool = False) -> list[str]:
    """The lines of ``joined`` that contain ``needle``, in order (found by substring search,
    which skips the lines without it in C); with ``short``, each without its first
    ``/``-separated part, as :func:`archive_prefix` compares them."""
    out = []
    at = joined.find(needle)
    while at >= 0:
        start = joined.rfind("\n", 0, at) + 1
        end = joined.find("\n", at)
        end = len(joined) if end < 0 else end
        line = joined[start:end]
        out.append(line.split("/", 1)[1] if short and "/" in line else line)
        at = joined.find(needle, end)
    return out


def _refuse_duplicates(entries: list[_zip.CentralEntry], path: str) -> None:
    """Raise for the first record whose folded name was seen before (see archive_prefix)."""
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


def record_segments(records: list[Record] | tuple[Record, ...],
                    headers: dict[str, _zip.LocalHeader], trailer: _zip.Trailer,
                    file_nbytes: int, path: str) -> tuple[Segment, ...]:
    """Segments of every record (header, name, extra fields, data, descriptor) and of the
    trailer, tiling a file of ``file_nbytes``: gaps become UNKNOWN, an overlap raises
    :class:`CorruptArchiveError`. Any zip torch writes (torch.save, TorchScript, pt2)."""
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
    return _tile([s for s in segs if s.nbytes > 0], file_nbytes, path)


_segments = record_segments  # the name format/_remote_zip.py imports


def read_small_record(src: ByteSource, record: Record) -> str:
    """A small text record (``version``, ``byteorder``, ``.storage_alignment``...) as ASCII.

    Reads at most 64 bytes; anything not ASCII is :class:`CorruptArchiveError`.
    """
    raw = read_record_data(src, record, limit=_MAX_SMALL_RECORD)
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise CorruptArchiveError("record is not ASCII text", path=src.name,
                                  record=record.name, offset=record.data_offset) from None


def _tile(segs: list[Segment], file_nbytes: int, path: str) -> tuple[Segment, ...]:
    """``segs`` (sorted) with unknown segments in the gaps; an overlap is an error."""
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


_RECORD_KINDS = (SegmentKind.LOCAL_HEADER, SegmentKind.NAME, SegmentKind.ZIP64_EXTRA,
                 SegmentKind.PADDING, SegmentKind.DATA, SegmentKind.DESCRIPTOR)
_RECORD_KIND_CODES = tuple(SEGMENT_KINDS.index(k) for k in _RECORD_KINDS)


def _fast_segments(records: Sequence[Record], cdir: _zip.CentralDirectory, cols: Any,
                   trailer: _zip.Trailer, file_nbytes: int, path: str) -> tuple[Segment, ...]:
    """:func:`_segments` from columns, when every record's extra fields are none, a zip64
    extra and/or torch's 'FB' field in that order (what :func:`_zip.local_headers` reads)."""
    import numpy as np

    order = np.argsort(cdir.header_offset, kind="stable")
    hdr = cdir.header_offset[order]
    name_nbytes = cdir.name_nbytes[order]
    zip64 = cols.zip64_extra_nbytes[order]
    data = cols.data_offset[order]
    data_nbytes = cdir.compressed_nbytes[order]
    extra = hdr + 30 + name_nbytes
    offsets = np.stack([hdr, hdr + 30, extra, extra + zip64, data, data + data_nbytes], 1)
    field = np.where(cols.has_padding_field[order], 4 + cols.padding_nbytes[order], 0)
    sizes = np.stack([np.full(len(hdr), 30), name_nbytes, zip64, field, data_nbytes,
                      cols.descriptor_nbytes[order]], 1)
    kinds = np.broadcast_to(np.arange(6), sizes.shape)
    owner = np.broadcast_to(order[:, None], sizes.shape)
    tail = [(SegmentKind.CENTRAL_DIRECTORY, trailer.cd_offset, trailer.cd_nbytes)]
    if trailer.zip64_eocd_offset is not None and trailer.zip64_locator_offset is not None:
        tail += [(SegmentKind.ZIP64_EOCD, trailer.zip64_eocd_offset, trailer.zip64_eocd_nbytes),
                 (SegmentKind.ZIP64_LOCATOR, trailer.zip64_locator_offset, _zip.ZIP64_LOCATOR.size)]
    tail.append((SegmentKind.EOCD, trailer.eocd_offset, trailer.eocd_nbytes))
    tail = [t for t in tail if t[2] > 0]
    keep = sizes.ravel() > 0
    offsets = offsets.ravel()[keep]
    sizes = sizes.ravel()[keep]
    kinds = kinds.ravel()[keep]
    owner = owner.ravel()[keep]
    names = cdir.names  # the records' names, in directory order
    count = len(offsets) + len(tail)

    def make() -> list[Segment]:
        return build(Segment, count,
                     list(map(_RECORD_KINDS.__getitem__, kinds.tolist())) + [t[0] for t in tail],
                     offsets.tolist() + [t[1] for t in tail],
                     sizes.tolist() + [t[2] for t in tail],
                     list(map(names.__getitem__, owner.tolist())) + [None] * len(tail))

    ends = [t[1] + t[2] for t in tail]
    starts_ok = len(offsets) == 0 or (offsets[0] == 0 and bool(
        (offsets[1:] == offsets[:-1] + sizes[:-1]).all()))
    joined = [int(offsets[-1] + sizes[-1])] if len(offsets) else [0]
    tail_ok = all(t[1] == e for t, e in zip(tail, joined + ends[:-1]))
    if starts_ok and tail_ok and (ends[-1] if ends else joined[0]) == file_nbytes:
        # they tile the file (no gap, no overlap): the objects are made when first looked at,
        # and their fields stay as columns for readers that want numbers (the byte map)
        columns = SegmentColumns(
            np.append(np.asarray(_RECORD_KIND_CODES)[kinds],
                      [SEGMENT_KINDS.index(t[0]) for t in tail]),
            np.append(offsets, [t[1] for t in tail]).astype(np.int64),
            np.append(sizes, [t[2] for t in tail]).astype(np.int64),
            np.append(owner, np.full(len(tail), -1)).astype(np.int64), names)
        return SegmentTuple(columns, make)  # type: ignore[return-value]
    return _tile(make(), file_nbytes, path)


def scan_torch_zip(src: ByteSource) -> ArchiveLayout:
    """Full layout of a torch.save zip archive (reads every header, descriptor and data.pkl)."""
    return _scan_torch_zip(src)


def _records(src: ByteSource, trailer: _zip.Trailer, cdir: _zip.CentralDirectory
             ) -> tuple[RecordTuple, dict[str, _zip.LocalHeader] | None, Any]:
    """Every record, from the local headers read at once (:func:`_zip.local_headers`).

    A record those checks do not pass is read on its own, in central directory order, by the
    functions that say what is wrong with it. Returns the records, the local headers of all
    records when some was read on its own (else None), and the columns.
    """
    names = cdir.names
    if len(set(names)) != len(names):
        seen = set()
        for e in cdir.entries:
            if e.name in seen:
                raise CorruptArchiveError("duplicate record name", path=src.name, record=e.name,
                                          offset=e.entry_offset)
            seen.add(e.name)
    cols = _zip.local_headers(src, cdir, trailer.cd_offset)
    extra, zip64, padding, data_offset, descriptor = (
        cols.extra_nbytes.tolist(), cols.zip64_extra_nbytes.tolist(),
        cols.padding_nbytes.tolist(), cols.data_offset.tolist(),
        cols.descriptor_nbytes.tolist())
    alone = (~cols.ok).nonzero()[0].tolist()
    headers: dict[str, _zip.LocalHeader] | None = None
    if alone:
        headers = {}
        for i in alone:  # in central directory order: the first one wrong raises
            e = cdir.entry(i)
            local, data_at, descriptor[i] = read_local_record(src, e, trailer.cd_offset)
            extra[i], zip64[i], padding[i] = (local.extra_nbytes, local.zip64_extra_nbytes,
                                              local.padding_nbytes)
            data_offset[i] = data_at
            headers[e.name] = local
        has_field = cols.has_padding_field.tolist()
        for i, e in enumerate(cdir.entries):
            if e.name not in headers:
                at = e.header_offset + 30 + e.name_nbytes
                fields = ((("zip64_extra", at, zip64[i]),) if zip64[i] else ()) + (
                    (("padding", at + zip64[i], 4 + padding[i]),) if has_field[i] else ())
                headers[e.name] = _zip.LocalHeader(extra[i], zip64[i], padding[i], fields)
    if cdir.exact:  # the columns are the entries' values (no zip64 field was clipped)
        hdr, name_nbytes, method, crc32, comp, uncomp = (getattr(cdir, c).tolist() for c in (
            "header_offset", "name_nbytes", "method", "crc32", "compressed_nbytes",
            "uncompressed_nbytes"))
    else:
        _, name_nbytes, _, method, crc32, comp, uncomp, hdr, _, _ = _columns(cdir.entries, 10)
    columns = (names, hdr, name_nbytes, extra, zip64, padding, data_offset, comp, descriptor,
               crc32, uncomp, method)
    return RecordTuple(columns), headers, cols


class RecordTuple(LazyTuple[Record]):
    """A layout's records, made when first used (a :class:`LazyTuple`), from ``columns`` (one
    list per :class:`Record` field, in field order); :meth:`at` makes one record alone."""

    __slots__ = ("columns",)

    def __init__(self, columns: tuple[Sequence[Any], ...]) -> None:
        super().__init__(len(columns[0]), lambda: build(Record, len(columns[0]), *columns))
        self.columns = columns

    def at(self, i: int) -> Record:
        """Record ``i`` (the tuple's, once it is made)."""
        if self.built:
            return self.value()[i]
        return Record(*(column[i] for column in self.columns))


class _ByName:
    """Folded record name -> :class:`Record` of a :class:`RecordTuple` (or a list), each made
    alone when looked up (the few small records, ``data.pkl``); :func:`storage_infos` reads
    the storages' columns through it instead."""

    def __init__(self, folded: list[str], records: Sequence[Record]) -> None:
        self.index = dict(zip(folded, range(len(folded))))
        self.records = records

    def get(self, name: str) -> Record | None:
        i = self.index.get(name)
        if i is None:
            return None
        records = self.records
        return records.at(i) if isinstance(records, RecordTuple) else records[i]

    def __getitem__(self, name: str) -> Record:
        found = self.get(name)
        if found is None:
            raise KeyError(name)
        return found


def read_local_record(src: ByteSource, e: _zip.CentralEntry, cd_offset: int
                      ) -> tuple[_zip.LocalHeader, int, int]:
    """One record's local header, data offset and data descriptor size, read on its own.

    The data must end before the central directory (at ``cd_offset``).
    """
    local = _zip.read_local_header(src, e)
    data_offset = local.data_offset(e.header_offset, e.name_nbytes)
    end = data_offset + e.compressed_nbytes
    if end > cd_offset:
        raise CorruptArchiveError("record data runs into the central directory",
                                  path=src.name, record=e.name, offset=data_offset,
                                  expected=f"end <= {cd_offset}", actual=f"end at {end}")
    return local, data_offset, _zip.descriptor_nbytes(src, e, end, local.zip64_extra_nbytes > 0)


def records_one_by_one(src: ByteSource, trailer: _zip.Trailer,
                       entries: list[_zip.CentralEntry]
                       ) -> tuple[list[Record], dict[str, _zip.LocalHeader]]:
    """Every record and its local header, one read each (small archives, and the zips
    :mod:`ckptlab.checkpoint._torchscript` reads).

    Names equal but for ASCII case are refused first (torch's reader ignores case); each
    record's data must end before the central directory.
    """
    folded = fold_names([e.name for e in entries])
    if len(set(folded)) != len(folded):
        _refuse_duplicates(entries, src.name)
    records: list[Record] = []
    headers: dict[str, _zip.LocalHeader] = {}
    for e in entries:
        record, headers[e.name] = local_record(src, e, trailer.cd_offset)
        records.append(record)
    return records, headers


def local_record(src: ByteSource, e: _zip.CentralEntry, cd_offset: int
                 ) -> tuple[Record, _zip.LocalHeader]:
    """One record as its central entry and its local header (read alone) give it."""
    local, data_offset, desc = read_local_record(src, e, cd_offset)
    return Record(e.name, e.header_offset, e.name_nbytes, local.extra_nbytes,
                  local.zip64_extra_nbytes, local.padding_nbytes, data_offset,
                  e.compressed_nbytes, desc, e.crc32, e.uncompressed_nbytes, e.method), local


def _scan_torch_zip(src: ByteSource) -> ArchiveLayout:
    trailer, cdir = read_central_directory_columns(src)
    archive = archive_prefix(cdir, src.name)
    if cdir.header_offset is None:  # a small archive
        records, headers = records_one_by_one(src, trailer, cdir.entries)
        segments = record_segments(records, headers, trailer, src.nbytes, src.name)
    else:
        records, maybe_headers, cols = _records(src, trailer, cdir)
        if maybe_headers is None:
            segments = _fast_segments(records, cdir, cols, trailer, src.nbytes, src.name)
        else:
            segments = record_segments(records, maybe_headers, trailer, src.nbytes, src.name)
    # looked up as torch does, ignoring ASCII case (archive_prefix refused names that collide)
    folded = cdir.folded if cdir.folded is not None and len(cdir.folded) == len(records) \
        else fold_names([r.name for r in records])  # (records come in directory order)
    by_name = _ByName(folded, records)
    prefix = f"{archive}/" if archive else ""

    def small(name: str) -> str | None:
        rec = by_name.get(fold_name(prefix + name))
        return None if rec is None else read_small_record(src, rec)

    format_version, alignment_text, byteorder = (small(n) for n in _SMALL_RECORDS)
    storage_alignment = None
    if alignment_text is not None:
        rec = by_name[fold_name(prefix + ".storage_alignment")]
        storage_alignment = storage_alignment_value(alignment_text, path=src.name,
                                                    record=rec.name, offset=rec.data_offset)
    pkl = by_name[fold_name(prefix + "data.pkl")]
    scan = scan_pickle(read_record_data(src, pkl), path=src.name, record=pkl.name,
                       data_offset=pkl.data_offset)
    storages = storage_infos(scan, by_name, prefix, src.name, pkl, fold=True)
    return torch_zip_layout(src, archive, records, segments, trailer, scan, storages,
                            storage_alignment=storage_alignment,
                            format_version=format_version, byteorder=byteorder)


def storage_alignment_value(text: str | bytes, *, path: str, record: str, offset: int) -> int:
    """The content of a ``.storage_alignment`` record as an int: digits, 1..2**30.

    Raises
    ------
    CorruptArchiveError
        Anything else, naming the record and what it holds.
    """
    if not (text.isdigit() and len(text) <= 10 and
            0 < int(text) <= _zip.MAX_RECORDED_ALIGNMENT):
        shown = text.decode("ascii", "replace") if isinstance(text, bytes) else text
        raise CorruptArchiveError("bad .storage_alignment", path=path, record=record,
                                  offset=offset, expected=f"1..{_zip.MAX_RECORDED_ALIGNMENT}",
                                  actual=repr(shown[:20]))
    return int(text)


def torch_zip_layout(src: ByteSource, archive: str, records: list[Record] | tuple[Record, ...],
                     segments: tuple[Segment, ...], trailer: _zip.Trailer, scan: PickleScan,
                     storages: tuple[StorageInfo, ...], *, storage_alignment: int | None,
                     format_version: str | None, byteorder: str | None) -> ArchiveLayout:
    """The :class:`ArchiveLayout` of a torch.save archive from its parts (every reader of a
    torch.save zip, local or remote, ends here)."""
    return ArchiveLayout(
        format="torch-zip",
        path=src.name,
        file_nbytes=src.nbytes,
        archive_name=archive,
        records=records if isinstance(records, RecordTuple) else tuple(records),
        storages=storages,
        tensors=scan.tensors,
        segments=segments,
        alignment=largest_alignment([s.data_offset for s in storages if s.nbytes]),
        zip64=any(records.columns[4]) if isinstance(records, RecordTuple)
        else any(map(_ZIP64_EXTRA, records)),
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


_STORAGE_NAMES = ("key", "dtype", "nbytes", "location", "storage_type")
_NAME = attrgetter("name")
_UNCOMPRESSED, _DATA_OFFSET = attrgetter("uncompressed_nbytes"), attrgetter("data_offset")
_ZIP64_EXTRA = attrgetter("zip64_extra_nbytes")


def storage_infos(scan: PickleScan, records: dict[str, Record] | _ByName, prefix: str,
                  path: str, pkl: Record, *, fold: bool = False) -> tuple[StorageInfo, ...]:
    """Join the pickle's storages with their records (each must exist with the right size).

    With ``fold``, ``records`` is keyed by :func:`fold_name` (torch's case-blind lookup).
    """
    storages = scan.storages
    if storages:
        keys, dtypes, nbytes, locations, types = fields(storages, _STORAGE_NAMES)
        nbytes = tuple(nbytes)
        start = f"{prefix}data/"
        names = [start + key for key in keys]
        looked_up = fold_names(names) if fold else names
        if isinstance(records, _ByName) and isinstance(records.records, RecordTuple):
            # the records' columns, never the records
            rows = list(map(records.index.get, looked_up))
            if None not in rows and "UntypedStorage" not in types:
                columns = records.records.columns
                if tuple(map(columns[10].__getitem__, rows)) == nbytes:
                    return tuple(build(StorageInfo, len(storages), keys,
                                       list(map(columns[0].__getitem__, rows)), dtypes, nbytes,
                                       list(map(columns[6].__getitem__, rows)), locations,
                                       types))
        found = list(map(records.get, looked_up))
        if len(list(filter(None, found))) == len(found) and "UntypedStorage" not in types \
                and tuple(map(_UNCOMPRESSED, found)) == nbytes:
            # every storage has its record, of its size: all at once
            return tuple(build(StorageInfo, len(storages), keys, list(map(_NAME, found)),
                               dtypes, nbytes, list(map(_DATA_OFFSET, found)), locations,
                               types))
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
