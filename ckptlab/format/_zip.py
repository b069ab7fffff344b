"""Zip structures as torch's miniz writer lays them out, and a strict reader for any stored zip.

The write rules (``record_geometry``, ``central_directory_entry_nbytes``) follow
``caffe2/serialize/inline_container.cc`` (getPadding) and ``third_party/miniz-3.0.2/miniz.c``
(zip64 extra, data descriptor, central directory); every rule is checked against files torch
writes in ``tests/property``.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

from ckptlab.errors import CorruptArchiveError, TruncatedArchiveError, UnsupportedFormatError
from ckptlab.source._bytes import ByteSource

LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
CENTRAL_ENTRY = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes
EOCD = struct.Struct("<4sHHHHIIH")  # 22 bytes
ZIP64_LOCATOR = struct.Struct("<4sIQI")  # 20 bytes
ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes
LOCAL_SIG, CENTRAL_SIG, EOCD_SIG = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"
ZIP64_EOCD_SIG, ZIP64_LOCATOR_SIG, DESCRIPTOR_SIG = b"PK\x06\x06", b"PK\x06\x07", b"PK\x07\x08"
ZIP64_EXTRA_ID, FB_EXTRA_ID = 0x0001, 0x4246  # 'F','B' little-endian
U32_MAX, U16_MAX = 0xFFFFFFFF, 0xFFFF
TRAILER_NBYTES = ZIP64_EOCD.size + ZIP64_LOCATOR.size + EOCD.size  # 98: what torch writes
MAX_ALIGNMENT = 65504  # above this the FB extra length overflows its u16
# what a reader accepts in a .storage_alignment record: torch.load reads files written with
# larger alignments whenever each record's padding happens to fit (65536 often does); the
# data offsets themselves always come from the headers or are checked against them
MAX_RECORDED_ALIGNMENT = 1 << 30


@dataclass(frozen=True, slots=True)
class RecordGeometry:
    """Where torch's writer puts one record that starts at ``header_offset``."""

    header_offset: int
    zip64_extra_nbytes: int  # 0, 20 (size), 12 (offset) or 28 (both)
    padding_nbytes: int  # FB payload
    data_offset: int
    data_nbytes: int
    descriptor_nbytes: int  # 0 (empty), 16, or 24 (with zip64 extra)

    @property
    def end_offset(self) -> int:
        return self.data_offset + self.data_nbytes + self.descriptor_nbytes


def record_placement(header_offset: int, name_nbytes: int,
                     data_nbytes: int, alignment: int) -> tuple[int, int, int]:
    """(zip64 extra bytes, data offset, descriptor bytes) of a record torch.save writes.

    getPadding + miniz: the zip64 extra exists iff the size or the header offset is
    >= 0xFFFFFFFF (inclusive); the 'FB' padding field is always there (4 bytes + padding);
    the data descriptor is 24 bytes with a zip64 extra, 16 without, absent for an empty record.
    A plain tuple: :func:`storage_offsets` calls this once per storage.
    """
    big_size = data_nbytes >= U32_MAX
    big_offset = header_offset >= U32_MAX
    zip64 = (4 + 16 * big_size + 8 * big_offset) if (big_size or big_offset) else 0
    start = header_offset + LOCAL_HEADER.size + name_nbytes + zip64 + 4
    data_offset = -(-start // alignment) * alignment
    return zip64, data_offset, 0 if data_nbytes == 0 else (24 if zip64 else 16)


def record_geometry(header_offset: int, name_nbytes: int, data_nbytes: int,
                    alignment: int) -> RecordGeometry:
    """Layout of one record as torch.save writes it (see :func:`record_placement`)."""
    zip64, data_offset, descriptor = record_placement(header_offset, name_nbytes, data_nbytes,
                                                      alignment)
    padding = data_offset - (header_offset + LOCAL_HEADER.size + name_nbytes + zip64 + 4)
    return RecordGeometry(header_offset, zip64, padding, data_offset, data_nbytes, descriptor)


def central_directory_entry_nbytes(name_nbytes: int, data_nbytes: int, header_offset: int) -> int:
    """Bytes of one central directory entry as miniz writes it (no FB field there)."""
    fields = 2 * (data_nbytes >= U32_MAX) + (header_offset >= U32_MAX)
    return CENTRAL_ENTRY.size + name_nbytes + (4 + 8 * fields if fields else 0)


@dataclass(frozen=True, slots=True)
class Trailer:
    cd_offset: int
    cd_nbytes: int
    entries: int
    eocd_offset: int
    eocd_nbytes: int  # 22 + comment
    zip64_eocd_offset: int | None
    zip64_eocd_nbytes: int
    zip64_locator_offset: int | None


class CentralEntry(NamedTuple):  # a tuple: 10k of them are built per scan, so cheap matters
    name: str
    name_nbytes: int
    flags: int
    method: int
    crc32: int
    compressed_nbytes: int
    uncompressed_nbytes: int
    header_offset: int
    entry_offset: int  # where this entry sits in the central directory
    entry_nbytes: int


def tail_window(file_nbytes: int) -> int:
    """How many trailing bytes can hold the EOCD with the longest comment plus zip64 records."""
    return min(file_nbytes, EOCD.size + U16_MAX + ZIP64_LOCATOR.size + ZIP64_EOCD.size)


def locate_eocd(tail: bytes) -> int:
    """Index in ``tail`` of the end-of-central-directory record torch's reader takes, or -1.

    torch reads archives with miniz (``caffe2/serialize/inline_container.cc`` calls
    ``mz_zip_reader_init``); ``mz_zip_reader_locate_header_sig`` in
    ``third_party/miniz-3.0.2/miniz.c`` scans backwards from the end of the file in 4 KiB
    blocks and takes the *first* ``PK\\5\\6`` it meets that has at least 22 bytes after it. It
    never reads the comment length, so the record it takes is the last signature in the file
    (short of the final 21 bytes), wherever the comment of an earlier record says the file
    ends. ``tail`` must end at the end of the file and hold at least the last
    :func:`tail_window` bytes: miniz gives up only past 65,557 bytes from the end, so the
    nearest signature in that window is the one it finds.
    """
    return tail.rfind(EOCD_SIG, 0, max(0, len(tail) - EOCD.size + len(EOCD_SIG)))


_MAX_SIGNATURE_READS = 16


def _plausible_end_record(tail: bytes, pos: int, tail_offset: int, file_nbytes: int,
                          read: Callable[[int, int], bytes | None]) -> bool:
    """Whether the ``PK\\5\\6`` at ``tail[pos]`` is an end record a zip reader could load.

    Consistent fields (one disk, equal entry counts, the comment inside the file) and its
    central directory (or zip64 end record) where its absolute offsets say. A zip carried as
    bytes inside a checkpoint (a pickled ``bytes``, a uint8 tensor) has offsets relative to its
    own start, so it does not count. Bytes outside ``tail`` are fetched with ``read``; when it
    gives None they are assumed to match.
    """
    (_, disk, cd_disk, n_disk, n_total, cd_nbytes, cd_offset, comment) = EOCD.unpack_from(tail,
                                                                                         pos)
    at = tail_offset + pos
    if (disk, cd_disk) not in ((0, 0), (1, 1)) or n_disk != n_total:
        return False
    if at + EOCD.size + comment > file_nbytes:
        return False

    def has_sig(offset: int, sig: bytes) -> bool:
        if offset < 0 or offset + 4 > file_nbytes:
            return False
        if offset >= tail_offset:
            return tail[offset - tail_offset:offset - tail_offset + 4] == sig
        got = read(offset, 4)
        return got is None or got == sig

    lpos = pos - ZIP64_LOCATOR.size
    if lpos >= 0 and tail[lpos:lpos + 4] == ZIP64_LOCATOR_SIG:
        z64_offset = struct.unpack_from("<Q", tail, lpos + 8)[0]
        return z64_offset + ZIP64_EOCD.size <= at - ZIP64_LOCATOR.size and has_sig(
            z64_offset, ZIP64_EOCD_SIG)
    if n_total == 0 or cd_nbytes < n_total * CENTRAL_ENTRY.size or cd_offset + cd_nbytes > at:
        return False
    return has_sig(cd_offset, CENTRAL_SIG)


def parse_trailer(tail: bytes, tail_offset: int, file_nbytes: int, path: str,
                  read: Callable[[int, int], bytes] | None = None) -> Trailer:
    """Find the EOCD (and zip64 records) in ``tail``, which ends at the end of the file.

    The end record is the one torch's reader takes (:func:`locate_eocd`). Zip readers do not
    all agree on which record that is when a file holds more than one, so a file is refused
    (:class:`CorruptArchiveError`) when another reader could load a different archive than
    torch does:

    - the record's comment does not end exactly at the end of the file (bytes after it, or a
      record hidden in an earlier record's comment: Python's ``zipfile``, Go and Java check
      the comment length, miniz does not);
    - a record with a comment is followed by another ``PK\\5\\6`` (in the last 21 bytes, where
      miniz skips it and Python's ``zipfile`` takes it);
    - an earlier plausible end record sits in the tail (:func:`_plausible_end_record`);
    - the central directory, zip64 end record, zip64 locator and end record are not back to
      back (Python's ``zipfile`` shifts every offset by such a gap; it also reads the zip64
      end record right before the locator, of 56 bytes, where miniz follows the locator).

    ``read(offset, nbytes)`` fetches bytes outside ``tail`` for the plausibility check of an
    earlier signature (never needed for a file torch writes).
    """
    pos = locate_eocd(tail)
    if pos < 0:
        if file_nbytes < EOCD.size:
            raise TruncatedArchiveError("file too short for a zip end-of-central-directory record",
                                        path=path, offset=0, expected=f">= {EOCD.size} bytes",
                                        actual=f"{file_nbytes} bytes")
        raise TruncatedArchiveError("no zip end-of-central-directory record at the end of the file "
                                    "(truncated or not a zip archive)", path=path,
                                    offset=file_nbytes)
    eocd_offset = tail_offset + pos
    (_, disk, cd_disk, n_disk, n_total, cd_nbytes, cd_offset, comment) = EOCD.unpack_from(tail, pos)
    record_end = eocd_offset + EOCD.size + comment
    if record_end > file_nbytes:
        raise CorruptArchiveError(
            "the archive comment of the end-of-central-directory record torch's reader takes "
            "(the last one in the file) runs past the end of the file", path=path,
            offset=eocd_offset + 20,
            expected=f"a comment of {file_nbytes - eocd_offset - EOCD.size} bytes (to the end "
                     "of the file)", actual=f"{comment} bytes")
    if record_end < file_nbytes:
        raise CorruptArchiveError(
            f"{file_nbytes - record_end} byte{'s' if file_nbytes - record_end > 1 else ''} after "
            "the end-of-central-directory record and its comment: trailing data, or an end record hidden in another record's comment. "
            "torch's reader takes the last end record signature in the file, other zip readers "
            "may take another, so the archive shown could differ from the one torch loads",
            path=path, offset=record_end, expected=f"end of file at {record_end}",
            actual=f"file of {file_nbytes} bytes")
    # with a comment, Python's zipfile takes the last signature, even one overlapping the
    # record's own fields; without one it takes the last 22 bytes, which is this record
    hidden = tail.find(EOCD_SIG, pos + 1) if comment else -1
    if hidden >= 0:
        raise CorruptArchiveError(
            "an end-of-central-directory signature in the last 21 bytes, after a record with a "
            "comment: Python's zipfile takes it, torch's reader does not", path=path, offset=tail_offset + hidden,
            expected="a comment without PK\\x05\\x06", actual=bytes(tail[hidden:hidden + 8]))
    other = tail.rfind(EOCD_SIG, 0, pos)
    reads_left = [_MAX_SIGNATURE_READS]

    def read_some(offset: int, nbytes: int) -> bytes | None:
        # a tail crafted full of candidates must not cost a read each: past a few, assume
        # the signature is there (the file is refused)
        if read is None or reads_left[0] <= 0:
            return None
        reads_left[0] -= 1
        return read(offset, nbytes)

    while other >= 0:
        if _plausible_end_record(tail, other, tail_offset, file_nbytes, read_some):
            raise CorruptArchiveError(
                "a second, plausible end-of-central-directory record before the one torch's "
                "reader takes: a zip reader that passes over the last one would load another "
                "archive", path=path, offset=tail_offset + other,
                expected=f"one end record (at {eocd_offset})",
                actual=f"another at {tail_offset + other}")
        other = tail.rfind(EOCD_SIG, 0, other)
    if disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise UnsupportedFormatError("multi-disk zip archive", path=path, offset=eocd_offset)
    z64_offset: int | None = None
    z64_nbytes = 0
    loc_offset: int | None = None
    lpos = pos - ZIP64_LOCATOR.size
    if lpos >= 0 and tail[lpos:lpos + 4] == ZIP64_LOCATOR_SIG:
        loc_offset = eocd_offset - ZIP64_LOCATOR.size
        _, _, z64_offset, n_disks = ZIP64_LOCATOR.unpack_from(tail, lpos)
        zpos = z64_offset - tail_offset
        if not (0 <= z64_offset and zpos >= 0 and zpos + ZIP64_EOCD.size <= lpos):
            raise CorruptArchiveError("zip64 locator points outside the trailer", path=path,
                                      offset=loc_offset, expected=f"< {loc_offset}",
                                      actual=z64_offset)
        if n_disks != 1:  # miniz refuses anything else
            raise UnsupportedFormatError("multi-disk zip archive (zip64 locator)", path=path,
                                         offset=loc_offset, expected="1 disk",
                                         actual=f"{n_disks} disks")
        (sig, rec_nbytes, _, _, zdisk, zcd_disk, zn_disk, zn_total, zcd_nbytes,
         zcd_offset) = ZIP64_EOCD.unpack_from(tail, zpos)
        if sig != ZIP64_EOCD_SIG:
            raise CorruptArchiveError("bad zip64 end-of-central-directory signature", path=path,
                                      offset=z64_offset, expected=ZIP64_EOCD_SIG, actual=sig)
        z64_nbytes = 12 + rec_nbytes
        if z64_offset + z64_nbytes != loc_offset or rec_nbytes != ZIP64_EOCD.size - 12:
            # miniz follows the locator, Python's zipfile reads the 56 bytes before it: the
            # two agree only on a 56-byte record right before the locator
            raise CorruptArchiveError("zip64 end-of-central-directory record is not the 56 "
                                      "bytes right before the zip64 locator", path=path,
                                      offset=z64_offset,
                                      expected=f"44-byte record at {loc_offset - ZIP64_EOCD.size}",
                                      actual=f"{rec_nbytes}-byte record at {z64_offset}")
        if zdisk != 0 or zcd_disk != 0 or zn_disk != zn_total:
            raise UnsupportedFormatError("multi-disk zip archive", path=path, offset=z64_offset)
        n_total, cd_nbytes, cd_offset = zn_total, zcd_nbytes, zcd_offset
        cd_end_limit = z64_offset
    else:
        if U32_MAX in (cd_nbytes, cd_offset) or n_total == U16_MAX:
            raise CorruptArchiveError("end-of-central-directory record needs zip64 records that "
                                      "are missing", path=path, offset=eocd_offset)
        cd_end_limit = eocd_offset
    declared_at = eocd_offset if z64_offset is None else z64_offset  # the record with the bad numbers
    if cd_offset + cd_nbytes > cd_end_limit:
        raise CorruptArchiveError("central directory runs past the end-of-central-directory "
                                  "records", path=path, offset=declared_at,
                                  expected=f"end <= {cd_end_limit}",
                                  actual=f"end at {cd_offset + cd_nbytes}")
    if cd_offset + cd_nbytes != cd_end_limit:
        # Python's zipfile takes such a gap for data prepended to the archive and shifts every
        # offset by it: it would read another central directory than torch does
        raise CorruptArchiveError(f"{cd_end_limit - cd_offset - cd_nbytes} bytes between the "
                                  "central directory and the end-of-central-directory records",
                                  path=path, offset=cd_offset + cd_nbytes,
                                  expected=f"central directory ending at {cd_end_limit}",
                                  actual=f"end at {cd_offset + cd_nbytes}")
    if n_total * CENTRAL_ENTRY.size > cd_nbytes:
        raise CorruptArchiveError("central directory too small for its entry count", path=path,
                                  offset=declared_at,
                                  expected=f">= {n_total * CENTRAL_ENTRY.size} bytes",
                                  actual=f"{cd_nbytes} bytes")
    return Trailer(cd_offset, cd_nbytes, n_total, eocd_offset, EOCD.size + comment, z64_offset,
                   z64_nbytes, loc_offset)


def parse_central_directory(cd: bytes, trailer: Trailer, path: str) -> list[CentralEntry]:
    """Every central directory entry, with zip64 sizes and offsets resolved."""
    return central_directory(cd, trailer, path).entries


# Archives are read record by record in pure Python below VECTOR_MIN_ENTRIES entries, and
# with numpy from VECTOR_ALWAYS_ENTRIES on; in between with numpy only if it is already
# imported: importing it costs about what reading 5,000 records one by one does (the CLI
# inspects its 121-record sample without it). Either way gives the same result.
VECTOR_MIN_ENTRIES = 128
VECTOR_ALWAYS_ENTRIES = 5000


def vectorise(entries: int) -> bool:
    """Whether an archive of ``entries`` records is read with numpy (see above)."""
    return entries >= VECTOR_ALWAYS_ENTRIES or (
        entries >= VECTOR_MIN_ENTRIES and "numpy" in sys.modules)


class CentralDirectory:
    """The entries of a central directory: ``names``, and columns (numpy int64 arrays, None
    when :func:`vectorise` says no); ``entries`` (:class:`CentralEntry`) built on first use."""

    __slots__ = ("_entries", "compressed_nbytes", "crc32", "entry_nbytes", "entry_offset",
                 "exact", "flags", "folded", "header_offset", "method", "name_nbytes",
                 "name_starts", "names", "raw_names", "uncompressed_nbytes")

    def __init__(self, entries: list[CentralEntry] | None, names: list[str],
                 columns: dict[str, Any] | None = None) -> None:
        self._entries = entries
        self.names = names
        self.folded: list[str] | None = None  # the names ASCII-lowercased, once computed
        # columns built without entries hold every value exactly (no zip64 field, none
        # clipped to fit an int64): records can be built from them
        self.exact = entries is None
        for name in ("name_nbytes", "flags", "method", "crc32", "compressed_nbytes",
                     "uncompressed_nbytes", "header_offset", "entry_offset", "entry_nbytes",
                     "raw_names", "name_starts"):
            setattr(self, name, None if columns is None else columns[name])

    @property
    def entries(self) -> list[CentralEntry]:
        if self._entries is None:
            self._entries = list(map(tuple.__new__, repeat(CentralEntry), zip(
                self.names, *(getattr(self, c).tolist() for c in CentralEntry._fields[1:]))))
        return self._entries

    def entry(self, index: int) -> CentralEntry:
        """One entry (without building them all)."""
        if self._entries is not None:
            return self._entries[index]
        return CentralEntry(self.names[index], *(
            int(getattr(self, c)[index]) for c in CentralEntry._fields[1:]))


def central_directory(cd: bytes, trailer: Trailer, path: str) -> CentralDirectory:
    """:func:`parse_central_directory` with columns; the same entries and the same errors.

    Large directories are parsed with numpy: the entries are where the ``PK\\1\\2``
    signatures are, when following the lengths from the first one visits exactly those
    signatures; names are decoded in one call. Anything unusual (a signature inside a name,
    zip64 fields, a name that does not decode, any check that fails) takes the
    entry-by-entry parse, which raises what it always raised.
    """
    if not vectorise(trailer.entries):  # no columns: callers go record by record
        entries = _central_sequential(cd, trailer, path)
        return CentralDirectory(entries, [e.name for e in entries])
    import numpy as np

    fast = _central_vectorised(cd, trailer, path)
    if fast is not None:
        return fast
    entries = _central_sequential(cd, trailer, path)
    at = [e.entry_offset - trailer.cd_offset + CENTRAL_ENTRY.size for e in entries]
    raw = [cd[i:i + e.name_nbytes] for i, e in zip(at, entries)]
    columns: dict[str, Any] = {}
    for i, name in enumerate(CentralEntry._fields[1:], 1):
        # zip64 sizes may not fit an int64: columns only serve checks, and a clipped value
        # fails them (records are built from the entries)
        columns[name] = np.fromiter((min(e[i], _I64_MAX) for e in entries), np.int64,
                                    len(entries))
    columns["raw_names"] = np.frombuffer(b"".join(raw), np.uint8)
    columns["name_starts"] = np.cumsum(columns["name_nbytes"]) - columns["name_nbytes"]
    return CentralDirectory(entries, [e.name for e in entries], columns)


_I64_MAX = (1 << 63) - 1

# one central directory entry's fixed 46 bytes, as numpy reads them
_CENTRAL_FIELDS = [("sig", "<u4"), ("made_by", "<u2"), ("needed", "<u2"), ("flags", "<u2"),
                   ("method", "<u2"), ("time", "<u2"), ("date", "<u2"), ("crc32", "<u4"),
                   ("compressed", "<u4"), ("uncompressed", "<u4"), ("n_name", "<u2"),
                   ("n_extra", "<u2"), ("n_comment", "<u2"), ("disk", "<u2"), ("internal", "<u2"),
                   ("external", "<u4"), ("header_offset", "<u4")]


def _central_vectorised(cd: bytes, trailer: Trailer, path: str) -> CentralDirectory | None:
    import numpy as np

    count = trailer.entries
    a = np.frombuffer(cd, np.uint8)
    if count == 0 or len(a) < CENTRAL_ENTRY.size * count:
        return None
    at = np.flatnonzero((a[:-3] == 0x50) & (a[1:-2] == 0x4B) & (a[2:-1] == 1) & (a[3:] == 2))
    at = at[at + CENTRAL_ENTRY.size <= len(a)][:count + 1]
    if len(at) != count or at[0] != 0:
        return None
    fixed = a[at[:, None] + np.arange(CENTRAL_ENTRY.size)].view(np.dtype(_CENTRAL_FIELDS))[:, 0]
    n_name = fixed["n_name"].astype(np.int64)
    end = at + CENTRAL_ENTRY.size + n_name + fixed["n_extra"] + fixed["n_comment"]
    if end[-1] > len(a) or not np.array_equal(end[:-1], at[1:]):
        return None  # a signature inside a name or an extra field: entry by entry
    flags = fixed["flags"].astype(np.int64)
    method = fixed["method"].astype(np.int64)
    comp = fixed["compressed"].astype(np.int64)
    uncomp = fixed["uncompressed"].astype(np.int64)
    hdr = fixed["header_offset"].astype(np.int64)
    if ((comp == U32_MAX) | (uncomp == U32_MAX) | (hdr == U32_MAX)).any():
        return None  # zip64 fields: read from each entry's extra field
    if (((method == 0) & (comp != uncomp)) | ((uncomp != 0) & (comp == 0))).any() or (
            hdr + LOCAL_HEADER.size + n_name + comp > trailer.cd_offset).any():
        return None  # the entry-by-entry parse says which entry is wrong
    # every name, back to back; then decoded in one call, one per line
    name_starts = np.cumsum(n_name) - n_name
    total = int(name_starts[-1] + n_name[-1])
    src = np.arange(total) + np.repeat(at + CENTRAL_ENTRY.size - name_starts, n_name)
    raw_names = a[src]
    utf8 = (flags & 0x800) != 0
    codec = "utf-8" if utf8.all() else "cp437" if not utf8.any() else None
    joined = np.empty(total + count - 1, np.uint8)
    lines = name_starts + np.arange(count)
    joined[np.arange(total) + np.repeat(lines - name_starts, n_name)] = raw_names
    joined[lines[1:] - 1] = 0x0A
    text = joined.tobytes()
    if text.count(b"\n") != count - 1:
        return None  # a name with a newline
    if codec is None:
        if not text.isascii():
            return None  # mixed encodings: each name as its flag says
        codec = "ascii"
    try:
        names = text.decode(codec).split("\n")
    except UnicodeDecodeError:
        return None  # the entry-by-entry parse names the entry
    return CentralDirectory(None, names, {
        "name_nbytes": n_name, "flags": flags, "method": method,
        "crc32": fixed["crc32"].astype(np.int64), "compressed_nbytes": comp,
        "uncompressed_nbytes": uncomp, "header_offset": hdr,
        "entry_offset": at + trailer.cd_offset, "entry_nbytes": end - at,
        "raw_names": raw_names, "name_starts": name_starts})


def _central_sequential(cd: bytes, trailer: Trailer, path: str) -> list[CentralEntry]:
    """Entry by entry: the reference parse, and where every error comes from."""
    entries: list[CentralEntry] = []
    pos = 0
    unpack = CENTRAL_ENTRY.unpack_from
    for index in range(trailer.entries):
        at = trailer.cd_offset + pos
        if pos + CENTRAL_ENTRY.size > len(cd):
            raise CorruptArchiveError(f"central directory entry {index} runs past the directory",
                                      path=path, offset=at)
        (sig, _, _, flags, method, _, _, crc, comp, uncomp, n_name, n_extra, n_comment, _, _, _,
         hdr) = unpack(cd, pos)
        if sig != CENTRAL_SIG:
            raise CorruptArchiveError(f"bad signature of central directory entry {index}",
                                      path=path, offset=at, expected=CENTRAL_SIG, actual=sig)
        end = pos + CENTRAL_ENTRY.size + n_name + n_extra + n_comment
        if end > len(cd):
            raise CorruptArchiveError(f"central directory entry {index} runs past the directory",
                                      path=path, offset=at)
        raw_name = cd[pos + 46:pos + 46 + n_name]
        try:
            name = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
        except UnicodeDecodeError:
            raise CorruptArchiveError(f"central directory entry {index} has an undecodable name",
                                      path=path, offset=at + 46) from None
        if U32_MAX in (comp, uncomp, hdr):
            xpos, xend = pos + 46 + n_name, pos + 46 + n_name + n_extra
            while xpos + 4 <= xend:
                xid, xlen = struct.unpack_from("<HH", cd, xpos)
                if xid == ZIP64_EXTRA_ID:
                    fpos, fend = xpos + 4, min(xpos + 4 + xlen, xend)
                    values = []
                    while fpos + 8 <= fend:
                        values.append(struct.unpack_from("<Q", cd, fpos)[0])
                        fpos += 8
                    try:
                        if uncomp == U32_MAX:
                            uncomp = values.pop(0)
                        if comp == U32_MAX:
                            comp = values.pop(0)
                        if hdr == U32_MAX:
                            hdr = values.pop(0)
                    except IndexError:
                        raise CorruptArchiveError(f"zip64 extra of central directory entry "
                                                  f"{name!r} is too short", path=path,
                                                  record=name, offset=trailer.cd_offset + xpos
                                                  ) from None
                    break
                xpos += 4 + xlen
            if U32_MAX in (comp, uncomp, hdr) and comp != uncomp:
                raise CorruptArchiveError("central directory entry needs a zip64 extra that is "
                                          "missing", path=path, record=name, offset=at)
        if (method == 0 and comp != uncomp) or (uncomp and not comp):
            # miniz's mz_zip_reader_read_central_dir refuses these: torch cannot open the file
            raise CorruptArchiveError("central directory sizes impossible for the record's "
                                      f"method {method}", path=path, record=name, offset=at,
                                      expected="stored: equal sizes; any: data for any output",
                                      actual=f"{comp} stored bytes, {uncomp} uncompressed")
        if hdr + LOCAL_HEADER.size + n_name + comp > trailer.cd_offset:
            raise CorruptArchiveError("central directory entry places its record past the start "
                                      "of the central directory", path=path, record=name,
                                      offset=at, expected=f"record end <= {trailer.cd_offset}",
                                      actual=f"header at {hdr}, {comp} data bytes")
        entries.append(CentralEntry(name, n_name, flags, method, crc, comp, uncomp, hdr, at,
                                    end - pos))
        pos = end
    return entries


@dataclass(frozen=True, slots=True)
class LocalHeader:
    extra_nbytes: int
    zip64_extra_nbytes: int
    padding_nbytes: int  # FB payload
    fields: tuple[tuple[str, int, int], ...]  # (kind, offset, nbytes) for each extra field

    def data_offset(self, header_offset: int, name_nbytes: int) -> int:
        return header_offset + LOCAL_HEADER.size + name_nbytes + self.extra_nbytes


def read_local_header(src: ByteSource, entry: CentralEntry,
                      max_end: int | None = None) -> LocalHeader:
    """Read and check the local header of ``entry`` (name must match the central directory).

    One read usually: the fixed header, the name and up to 96 bytes of extra fields (never past
    ``max_end`` or the end of the file); a longer extra area takes a second read.
    """
    at = entry.header_offset
    want = LOCAL_HEADER.size + entry.name_nbytes
    if at + want > src.nbytes:  # the number is wrong, not the file short: point at the number
        raise CorruptArchiveError("central directory entry points past the end of the file",
                                  path=src.name, record=entry.name, offset=entry.entry_offset,
                                  expected=f"local header offset <= {src.nbytes - want}",
                                  actual=at)
    end = min(at + want + 96, src.nbytes if max_end is None else max_end)
    head = src.read(at, max(want, end - at), what="local header", record=entry.name)
    if len(head) < want:
        raise TruncatedArchiveError("file ends inside a local header", path=src.name,
                                    record=entry.name, offset=at, expected=f"{want} bytes",
                                    actual=f"{len(head)} bytes")
    sig, _, _, _, _, _, _, _, _, n_name, n_extra = LOCAL_HEADER.unpack_from(head)
    if sig != LOCAL_SIG:
        raise CorruptArchiveError("bad local header signature", path=src.name, record=entry.name,
                                  offset=at, expected=LOCAL_SIG, actual=sig)
    if n_name != entry.name_nbytes or head[30:30 + n_name] != entry.name.encode(
            "utf-8" if entry.flags & 0x800 else "cp437"):
        raise CorruptArchiveError("local header name differs from the central directory",
                                  path=src.name, record=entry.name, offset=at + 30,
                                  expected=entry.name, actual=bytes(head[30:30 + n_name]))
    if len(head) >= want + n_extra:
        extra = head[want:want + n_extra]
    else:
        extra = src.read(at + want, n_extra, what="local extra fields", record=entry.name)
    fields = []
    zip64 = padding = 0
    pos = 0
    while pos < n_extra:
        if pos + 4 > n_extra:
            raise CorruptArchiveError("truncated extra field header", path=src.name,
                                      record=entry.name, offset=at + want + pos)
        xid, xlen = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + xlen > n_extra:
            raise CorruptArchiveError("extra field runs past the local header", path=src.name,
                                      record=entry.name, offset=at + want + pos,
                                      expected=f"<= {n_extra - pos - 4} bytes", actual=xlen)
        kind = {ZIP64_EXTRA_ID: "zip64_extra", FB_EXTRA_ID: "padding"}.get(xid, "extra")
        if xid == ZIP64_EXTRA_ID:
            zip64 += 4 + xlen
        elif xid == FB_EXTRA_ID:
            padding += xlen
        fields.append((kind, at + want + pos, 4 + xlen))
        pos += 4 + xlen
    return LocalHeader(n_extra, zip64, padding, tuple(fields))


def descriptor_nbytes(src: ByteSource, entry: CentralEntry, data_end: int, zip64: bool) -> int:
    """Size of the data descriptor after a record's data (checked against the directory)."""
    if not entry.flags & 0x8:
        return 0
    nbytes = 24 if zip64 else 16
    head = src.read(data_end, min(nbytes, src.nbytes - data_end) if data_end < src.nbytes else 4,
                    what="data descriptor", record=entry.name)
    has_sig = head[:4] == DESCRIPTOR_SIG
    if not has_sig:
        nbytes -= 4
    if len(head) < nbytes:
        raise TruncatedArchiveError("file ends inside a data descriptor", path=src.name,
                                    record=entry.name, offset=data_end)
    body = head[4:nbytes] if has_sig else head[:nbytes]
    crc, comp, uncomp = struct.unpack_from("<IQQ" if zip64 else "<III", body)
    if (crc, comp, uncomp) != (entry.crc32, entry.compressed_nbytes, entry.uncompressed_nbytes):
        raise CorruptArchiveError("data descriptor disagrees with the central directory",
                                  path=src.name, record=entry.name, offset=data_end,
                                  expected=(entry.crc32, entry.compressed_nbytes,
                                            entry.uncompressed_nbytes),
                                  actual=(crc, comp, uncomp))
    return nbytes


class LocalHeaders(NamedTuple):
    """Local headers and data descriptors of many records, read and checked at once.

    Columns per central directory entry (numpy arrays). ``ok`` marks the records whose
    header, extra fields (none, torch's 'FB' padding field, a zip64 extra, or the zip64 extra
    then the 'FB' field), data bounds and descriptor passed every check
    :func:`read_local_header` and :func:`descriptor_nbytes` make; the others must be read by
    those functions, which raise what is wrong.
    """

    ok: Any
    extra_nbytes: Any
    zip64_extra_nbytes: Any
    padding_nbytes: Any  # the 'FB' payload
    has_padding_field: Any
    data_offset: Any
    descriptor_nbytes: Any
    reads: int


_SPAN_GAP = 512  # needed ranges this close are kept as one span of the buffer
_LOCAL_SIG = int.from_bytes(LOCAL_SIG, "little")
_DESCRIPTOR_SIG = int.from_bytes(DESCRIPTOR_SIG, "little")


def _gather_le(a: Any, at: Any, width: int) -> Any:
    """Little-endian unsigned ints of ``width`` bytes at positions ``at`` of byte array ``a``
    (positions past the end read the last byte: callers mask those records)."""
    import numpy as np

    last = len(a) - 1
    out = a[np.clip(at, 0, last)].astype(np.int64)
    for k in range(1, width):  # (a byte at a time: 2.5x a gather of (n, width) positions)
        out |= a[np.clip(at + k, 0, last)].astype(np.int64) << (8 * k)
    return out


def local_headers(src: ByteSource, cdir: CentralDirectory, cd_offset: int) -> LocalHeaders:
    """Read the local header (and data descriptor) of every entry of ``cdir`` at once.

    The ranges needed (each header with its name and up to 96 bytes of extra fields, and the
    24 bytes before it, where the previous record's descriptor ends in a torch file) are read
    back to back into one buffer by :meth:`ByteSource.gather_into`: from a file, hundreds of
    ranges a call with the data between them dropped; from a file object, ranges less than
    4 KiB apart as one request. Memory: the ranges, at most the file's size.
    """
    import numpy as np

    hdr = cdir.header_offset
    name_nbytes = cdir.name_nbytes
    lo = np.append(np.maximum(hdr - 24, 0), max(cd_offset - 24, 0))
    hi = np.append(np.minimum(hdr + LOCAL_HEADER.size + name_nbytes + 96, src.nbytes), cd_offset)
    hi = np.maximum(hi, lo)
    order = np.argsort(lo, kind="stable")
    lo_sorted, hi_sorted = lo[order], hi[order]
    reach = np.maximum.accumulate(hi_sorted)
    first = np.ones(len(lo_sorted), bool)
    first[1:] = lo_sorted[1:] > reach[:-1] + _SPAN_GAP
    firsts = np.flatnonzero(first)
    span_lo = lo_sorted[firsts]
    span_hi = np.maximum.reduceat(hi_sorted, firsts)
    reads_before = src.reads
    span_len = span_hi - span_lo
    span_base = np.cumsum(span_len) - span_len
    a = np.empty(int(span_len.sum()), np.uint8)  # every span, back to back
    src.gather_into(span_lo.tolist(), span_len.tolist(), memoryview(a), what="local headers")

    def where(offset: Any, nbytes: Any) -> tuple[Any, Any]:
        """Buffer positions of file ``offset``s, and whether ``nbytes`` from there were read."""
        k = np.searchsorted(span_lo, offset, "right") - 1
        inside = (k >= 0) & (offset + nbytes <= span_hi[np.maximum(k, 0)])
        return span_base[np.maximum(k, 0)] + offset - span_lo[np.maximum(k, 0)], inside

    at, _ = where(hdr, LOCAL_HEADER.size + name_nbytes)  # always read (see the ranges)
    ok = (_gather_le(a, at, 4) == _LOCAL_SIG) & (_gather_le(a, at + 26, 2) == name_nbytes)
    # the local name is the central directory's, byte for byte
    total = len(cdir.raw_names)
    if total:
        starts = cdir.name_starts
        local = a[np.minimum(np.arange(total) + np.repeat(at + LOCAL_HEADER.size - starts,
                                                          name_nbytes), len(a) - 1)]
        differ = np.flatnonzero(local != cdir.raw_names)
        ok[np.searchsorted(starts, differ, "right") - 1] = False
    extra_nbytes = _gather_le(a, at + 28, 2)
    extra_at = hdr + LOCAL_HEADER.size + name_nbytes
    ext, inside = where(extra_at, extra_nbytes)
    ok &= inside
    id0, len0 = _gather_le(a, ext, 2), _gather_le(a, ext + 2, 2)
    id1, len1 = _gather_le(a, ext + 4 + len0, 2), _gather_le(a, ext + 6 + len0, 2)
    none = extra_nbytes == 0
    fb_only = (extra_nbytes >= 4) & (id0 == FB_EXTRA_ID) & (4 + len0 == extra_nbytes)
    z64_only = (extra_nbytes >= 4) & (id0 == ZIP64_EXTRA_ID) & (4 + len0 == extra_nbytes)
    z64_fb = ((extra_nbytes >= 8 + len0) & (id0 == ZIP64_EXTRA_ID) & (id1 == FB_EXTRA_ID)
              & (8 + len0 + len1 == extra_nbytes))
    ok &= none | fb_only | z64_only | z64_fb
    zip64 = np.where(z64_only | z64_fb, 4 + len0, 0)
    padding = np.where(fb_only, len0, np.where(z64_fb, len1, 0))
    data_offset = extra_at + extra_nbytes
    comp = cdir.compressed_nbytes
    ok &= data_offset + comp <= cd_offset
    # data descriptors: 16 bytes (24 after a zip64 extra), the signature optional
    wants = (cdir.flags & 0x8) != 0
    desc_nbytes = np.where(zip64 > 0, 24, 16)
    data_end = data_offset + comp
    dat, inside = where(data_end, desc_nbytes)
    ok &= ~wants | inside
    has_sig = _gather_le(a, dat, 4) == _DESCRIPTOR_SIG
    body = dat + np.where(has_sig, 4, 0)
    crc = _gather_le(a, body, 4)
    wide = zip64 > 0
    d_comp = np.where(wide, _gather_le(a, body + 4, 8), _gather_le(a, body + 4, 4))
    d_uncomp = np.where(wide, _gather_le(a, body + 12, 8), _gather_le(a, body + 8, 4))
    ok &= ~wants | ((crc == cdir.crc32) & (d_comp == comp)
                    & (d_uncomp == cdir.uncompressed_nbytes))
    descriptor = np.where(wants, desc_nbytes - np.where(has_sig, 0, 4), 0)
    return LocalHeaders(ok, extra_nbytes, zip64, padding, fb_only | z64_fb, data_offset,
                        descriptor, src.reads - reads_before)
