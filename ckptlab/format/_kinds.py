"""What a file ckptlab refuses is, from its magic bytes, and what to do with it.

Only the refusal path uses this module: :func:`ckptlab.format.inspect.not_a_checkpoint` asks
:func:`describe` about a file :func:`~ckptlab.format.detect_format` calls ``"unknown"`` or
``"pickle"``, and :func:`~ckptlab.format.archive.archive_prefix` asks :func:`foreign_zip`
about a zip without ``data.pkl``. Each kind is claimed only on bytes that can be checked:

==============  ===============================================================================
gzip            ``1f 8b 08`` (RFC 1952: ID1, ID2, CM = deflate)
zstd            ``28 b5 2f fd`` (RFC 8878 frame magic 0xFD2FB528, little-endian)
bzip2           ``BZh`` + block size ``1``-``9`` (+ the block or end-of-stream magic if present)
xz              ``fd 37 7a 58 5a 00``
NumPy .npy      ``\\x93NUMPY`` + major, minor version
NumPy .npz      a zip whose every member ends in ``.npy`` (what ``np.savez`` writes)
HDF5            ``89 48 44 46 0d 0a 1a 0a`` at offset 0 (the superblock signature; Keras .h5)
GGUF            ``GGUF`` + a uint32 version 1-3 (either byte order)
tensorizer      ``|TZR|`` + uint32 data version + 32 bytes of feature flags (encrypted: data
                version 3, or 4+ with flag bit 0), as tensorizer's ``_FileHeader`` writes it
ONNX            a protobuf ``ModelProto``: its first fields parse with ModelProto's field numbers
                and wire types, the first being ``ir_version`` (1-32); for a ``.onnx`` name one
                valid field is enough (onnx itself only goes by the extension)
pickle 2-5      ``80`` + protocol (``detect_format``'s ``"pickle"``); a first pickle that is
                torch's magic number makes it a legacy torch.save file
pickle 0/1      no magic: the first 64 KiB are walked by their opcodes' argument lengths
                and run by ckptlab's one interpreter, inertly (nothing imported or called):
                the file is one pickle, or pickles back to back, or its first 64 KiB are
                16 or more well-formed opcodes; a legacy torch.save file of protocol 0/1
                starts ``L119547037146038801333356L``
tar             ``ustar`` at 257 (``detect_format``'s ``"legacy-tar"``): torch < 0.4 when the
                first member is one of its records, else any tar
Git LFS         ``version https://git-lfs.github.com/spec/`` (a pointer, not the file)
HTML            ``<!doctype html`` or ``<html`` (a web page saved instead of the file)
safetensors     a header length and ``{`` whose header runs past the end of the file (cut short:
                a TruncatedArchiveError); a whole header is ``detect_format``'s, with its errors
==============  ===============================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["LEGACY_MAGIC_NUMBER", "Kind", "describe", "foreign_zip", "looks_like_export"]

LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
PICKLE_PROBE_NBYTES = 64 << 10  # bytes of a protocol 0/1 candidate walked
_MIN_PREFIX_OPS = 16  # opcodes a cut-off walk must have passed to call the file a pickle

_LEGACY_TAR_MEMBERS = frozenset({"sys_info", "pickle", "storages", "tensors"})


@dataclass(frozen=True, slots=True)
class Kind:
    """A refused file's kind: ``id`` (for tests), what it is and what to do, in words."""

    id: str
    what: str
    action: str
    truncated: bool = False  # a file of a format ckptlab reads, cut short

    def message(self, first: bytes) -> str:
        """The refusal: what the file is, what to do, then its first bytes in hex."""
        return f"{self.what}: {self.action} (first bytes {first.hex(' ')})"


# -- compressed files -----------------------------------------------------------------------------
def _decompress(id_: str, what: str, tool: str) -> Kind:
    return Kind(id_, f"{what}, not a checkpoint",
                f"decompress it first ({tool}) and open the file it holds")


_GZIP = _decompress("gzip", "a gzip-compressed file", "gunzip")
_ZSTD = _decompress("zstd", "a zstd-compressed file", "zstd -d")
_BZIP2 = _decompress("bzip2", "a bzip2-compressed file", "bunzip2")
_XZ = _decompress("xz", "an xz-compressed file", "unxz")

_PLAIN_PICKLE_ACTION = ("ckptlab does not run pickles (loading one runs its code); only if "
                        "you trust the file, load it with pickle.load and save its tensors "
                        "with torch.save or safetensors")
_LEGACY_0_1 = Kind(
    "legacy-pickle-0-1", "a legacy torch.save file written with pickle protocol 0 or 1",
    "ckptlab reads legacy files of protocol 2 and later; if you trust the file, load it with "
    "torch.load(weights_only=False) and save it again with torch.save")


def describe(head: bytes, nbytes: int, name: str, more: Callable[[int], bytes],
             kind: str = "unknown") -> Kind | None:
    """The kind of a file :func:`~ckptlab.format.detect_format` calls ``kind``, if its bytes say.

    Parameters
    ----------
    head
        The file's first bytes (up to 512).
    nbytes
        The file's size.
    name
        What errors call the file (its extension counts for ONNX only).
    more
        ``more(n)``: the file's first ``n`` bytes (one read, only for a protocol 0/1 pickle
        candidate whose first 512 bytes are well-formed opcodes without the end of a pickle).
    kind
        ``"unknown"``, ``"pickle"``, ``"legacy-tar"`` or ``"tensorizer"``; other kinds give
        None.
    """
    if kind == "pickle":
        return _pickle_kind(head, nbytes, more)
    if kind == "legacy-tar":
        return _tar_kind(head)
    if kind == "tensorizer":  # refused where only torch.save files are read
        return _tensorizer_kind(head)
    if kind != "unknown":
        return None
    if head[:3] == b"\x1f\x8b\x08":
        return _GZIP
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return _ZSTD
    if _is_bzip2(head):
        return _BZIP2
    if head[:6] == b"\xfd7zXZ\x00":
        return _XZ
    if head[:6] == b"\x93NUMPY" and len(head) >= 8:
        return Kind("npy", f"a NumPy array (.npy, format {head[6]}.{head[7]}), not a checkpoint",
                    "np.load it (numpy.load(path) gives the array)")
    if head[:8] == b"\x89HDF\r\n\x1a\n":
        return Kind("hdf5", "an HDF5 file (Keras .h5 weights or other HDF5 data), not a "
                    "checkpoint", "ckptlab does not read HDF5; open it with h5py (or load it "
                    "with Keras)")
    gguf = _gguf_version(head)
    if gguf is not None:
        return Kind("gguf", f"a GGUF file (llama.cpp/ggml{gguf}), not a checkpoint",
                    "ckptlab does not read GGUF; read it with the gguf package "
                    "(gguf.GGUFReader) or llama.cpp")
    if head[:5] == b"|TZR|":
        return _tensorizer_kind(head)
    if head.startswith((b"version https://git-lfs.github.com/spec/",
                        b"version https://hawser.github.com/spec/")):
        return Kind("git-lfs", "a Git LFS pointer, not the checkpoint it points to",
                    "fetch the file itself (git lfs pull, or download it again)")
    if _is_html(head):
        return Kind("html", "an HTML page, not a checkpoint",
                    "download the file itself (on the Hugging Face Hub, a /resolve/ link, "
                    "not a /blob/ page)")
    cut = _cut_safetensors(head, nbytes)
    if cut is not None:
        return cut
    onnx = _onnx_ir_version(head, nbytes, name.lower().endswith(".onnx"))
    if onnx is not None:
        version = f", IR version {onnx}" if onnx else ""
        return Kind("onnx", f"an ONNX model (protobuf ModelProto{version}), not a checkpoint",
                    "ckptlab does not read ONNX; load it with onnx.load (its graph's "
                    "initializers hold the weights)")
    if head and _proto(head[:1]) in (0, 1):
        return _pickle_kind(head, nbytes, more)
    return None


def _cut_safetensors(head: bytes, nbytes: int) -> Kind | None:
    """A safetensors file whose header runs past its end (``looks_like_safetensors`` wants the
    whole header in the file)."""
    from ckptlab.format.safetensors import MAX_HEADER_NBYTES

    if len(head) < 9 or head[8:9] != b"{":
        return None
    n = int.from_bytes(head[:8], "little")
    if not nbytes - 8 < n <= MAX_HEADER_NBYTES:
        return None
    return Kind("safetensors-cut", f"a safetensors file cut short (its header is {n} bytes, "
                f"the file {nbytes})", "copy or download it again", truncated=True)


def _is_bzip2(head: bytes) -> bool:
    if len(head) < 4 or head[:3] != b"BZh" or not 0x31 <= head[3] <= 0x39:
        return False
    block = head[4:10]  # a block header's magic (pi) or the end-of-stream magic (sqrt(pi))
    return len(block) < 6 or block in (bytes.fromhex("314159265359"),
                                       bytes.fromhex("177245385090"))


def _is_html(head: bytes) -> bool:
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n").lower()
    return text.startswith((b"<!doctype html", b"<html"))


def _gguf_version(head: bytes) -> str | None:
    """``", version N"`` (and the byte order if big-endian) for a GGUF header, else None."""
    if head[:4] != b"GGUF" or len(head) < 8:
        return None
    little, big = (int.from_bytes(head[4:8], order) for order in ("little", "big"))
    if 1 <= little <= 3:
        return f", version {little}"
    if 1 <= big <= 3:
        return f", version {big}, big-endian"
    return None


def _tensorizer_kind(head: bytes) -> Kind:
    what, action = "a tensorizer file", "ckptlab.open reads it (ckptlab inspect)"
    if len(head) >= 9:
        version = int.from_bytes(head[5:9], "little")
        flags = int.from_bytes(head[9:41], "little") if len(head) >= 41 else 0
        if version == 3 or (version >= 4 and flags & 1):  # tensorizer's _has_crypt_info
            what = f"an encrypted tensorizer file (data version {version})"
            action = ("ckptlab does not decrypt: load it with tensorizer's TensorDeserializer "
                      "and the key it was encrypted with")
        else:
            what = f"a tensorizer file (data version {version})"
    return Kind("tensorizer", f"{what}, not a torch.save checkpoint", action)


def _tar_kind(head: bytes) -> Kind:
    first = head[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
    if first in _LEGACY_TAR_MEMBERS:
        return Kind("legacy-tar", "a legacy torch.save tar archive (torch < 0.4)",
                    "ckptlab does not read those; if you trust the file, load it with "
                    "torch.load(weights_only=False) and save it again with torch.save")
    return Kind("tar", f"a tar archive (first member {first!r}), not a checkpoint",
                "extract it (tar -xf) and open the checkpoint inside (a torch < 0.4 "
                "torch.save tar starts with sys_info, pickle, storages or tensors)")


# -- ONNX ---------------------------------------------------------------------------------------
# onnx.proto's ModelProto: field number -> wire type (0 varint, 2 length-delimited)
_MODEL_PROTO = {1: 0, 2: 2, 3: 2, 4: 2, 5: 0, 6: 2, 7: 2, 8: 2, 14: 2, 20: 2, 25: 2, 26: 2}


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def _onnx_ir_version(head: bytes, nbytes: int, named_onnx: bool) -> int | None:
    """The IR version (0: not in the head) of what parses as an ONNX ModelProto, else None.

    Every field in ``head`` must be one of ModelProto's with its wire type; a length-delimited
    field may run past ``head`` but not past the file. Without a ``.onnx`` name the first field
    must be ``ir_version`` (1-32; serializers write fields in number order) and a second
    field must follow.
    """
    pos, fields, version = 0, 0, 0
    while pos < len(head):
        key = _varint(head, pos)
        if key is None:
            break  # cut by the end of the head
        (tag, pos) = key
        number, wire = tag >> 3, tag & 7
        if _MODEL_PROTO.get(number) != wire:
            return None
        value = _varint(head, pos)
        if value is None:
            break
        (value_, pos) = value
        if fields == 0 and number == 1:
            if not 1 <= value_ <= 32:
                return None
            version = value_
        elif fields == 0 and not named_onnx:
            return None
        fields += 1
        if wire == 2:
            if pos + value_ > nbytes:
                return None
            pos += value_
    if fields >= 2 or (fields == 1 and named_onnx):
        return version
    return None


# -- pickles ------------------------------------------------------------------------------------
def _proto(code: bytes) -> int | None:
    """The protocol that introduced the opcode ``code``, or None if it is none."""
    from ckptlab.format._optable import OPCODE_NAMES

    known = OPCODE_NAMES.get(code[0])
    return None if known is None else known[1]


@dataclass(frozen=True, slots=True)
class _Walk:
    ops: list[str]  # the first opcodes' names
    count: int  # opcodes walked
    complete: bool  # the first pickle's STOP was reached
    max_proto: int
    end: int = 0  # where the pickle ends (complete walks)
    root: object = None  # what the pickle is (complete walks), as the interpreter makes it


def _walk(data: bytes, nbytes: int) -> _Walk | None:
    """The first pickle in ``data`` (the file's first bytes), without running anything: its
    opcodes walked by their argument lengths (:func:`ckptlab.format._optable.opcode_spans`)
    and the pickle run by ckptlab's one interpreter, inertly (every call a record, every
    persistent id a value). None when it is not a well-formed pickle; ``complete`` False when
    it went well up to the end of ``data``, shorter than the file.
    """
    from ckptlab.format._optable import OPCODE_NAMES, opcode_spans
    from ckptlab.format._unpickle import PickleDataError, failure_offset, interpreter

    ops: list[str] = []
    count = max_proto = 0
    last = end = -1
    try:
        for at, code in opcode_spans(data):
            name, proto = OPCODE_NAMES[code]
            count += 1
            max_proto = max(max_proto, proto)
            if len(ops) < 8:
                ops.append(name)
            last = at
            if code == 0x2E:
                end = at + 1
    except ValueError:
        return None
    run = interpreter()
    try:
        result = run(data[:end] if end > 0 else data, persistent_load=lambda pid: pid,
                     build=lambda target, state: None)
    except PickleDataError as exc:
        cut = end < 0 and len(data) < nbytes and failure_offset(exc) >= last
        return _Walk(ops, count, False, max_proto) if cut else None
    if end < 0:
        return None  # (a STOP the walk did not see)
    return _Walk(ops, count, True, max_proto, end, result.root)


def _is_magic(walk: _Walk) -> bool:
    """Whether the walked pickle is torch's legacy magic number alone."""
    ops = [name for name in walk.ops if name not in ("PROTO", "FRAME")]
    return (walk.complete and len(ops) == 2 and ops[1] == "STOP"
            and ops[0] in ("LONG", "LONG1", "LONG4", "INT")
            and type(walk.root) is int and walk.root == LEGACY_MAGIC_NUMBER)


def _pickle_kind(head: bytes, nbytes: int, more: Callable[[int], bytes]) -> Kind | None:
    walk = _walk(head, nbytes)
    if head[:1] == b"\x80" and len(head) > 1:  # PROTO: a pickle whatever the walk says
        if walk is not None and _is_magic(walk):
            return Kind("legacy-pickle", f"a legacy torch.save file (pickle protocol {head[1]})",
                        "ckptlab.open reads it (`ckptlab inspect` without --records); "
                        "re-save it with torch.save to get a zip archive")
        return Kind("pickle", f"a plain pickle (protocol {head[1]}), not a torch.save archive",
                    _PLAIN_PICKLE_ACTION)
    data = head
    if walk is None or walk.count < 2 or walk.max_proto > 1:
        return None  # (a first opcode whose argument runs past the head tells nothing)
    if not walk.complete and len(head) < PICKLE_PROBE_NBYTES:
        data = more(min(PICKLE_PROBE_NBYTES, nbytes))  # the head went well: walk further
        walk = _walk(data, nbytes)
        if walk is None or walk.max_proto > 1:
            return None
    if _is_magic(walk):
        return _LEGACY_0_1
    if walk.complete:
        if walk.end < nbytes and walk.end >= len(data):
            return None  # what follows is unread: a pickle's worth of bytes then anything
        if walk.end < nbytes:  # another pickle must follow (or 16 good opcodes of one)
            after = _walk(data[walk.end:], nbytes - walk.end)
            if after is None or not (after.complete or after.count >= _MIN_PREFIX_OPS):
                return None
        return Kind("pickle", "a plain pickle (protocol 0 or 1), not a torch.save archive",
                    _PLAIN_PICKLE_ACTION)
    if walk.count < _MIN_PREFIX_OPS:
        return None
    return Kind("pickle", f"what looks like a plain pickle (protocol 0 or 1: its first "
                f"{len(data)} bytes are well-formed pickle opcodes), not a torch.save archive",
                _PLAIN_PICKLE_ACTION)


# -- zips ---------------------------------------------------------------------------------------
def looks_like_export(names: Sequence[str]) -> bool:
    """Whether a zip's names are those of a torch.export archive (``archive_format``, or the
    ``serialized_exported_program.json`` of torch 2.7 and earlier)."""
    return any(n.rsplit("/", 1)[-1] in ("archive_format", "serialized_exported_program.json")
               for n in names)


def foreign_zip(names: Sequence[str], *, export_checked: bool = False) -> str:
    """The refusal of a zip without ``data.pkl``: what its members say it is, what to do.

    ``export_checked``: its records were read and it is no torch.export archive, whatever its
    names suggest.
    """
    if names and all(n.endswith(".npy") for n in names):
        arrays = ", ".join(repr(n[:-4]) for n in names[:5]) + (", ..." if len(names) > 5 else "")
        return (f"a NumPy .npz archive (np.savez: arrays {arrays}), not a checkpoint: np.load it "
                "(numpy.load(path) gives its arrays by name)")
    if not export_checked and looks_like_export(names):
        return ("a torch.export archive (.pt2), not a torch.save checkpoint: open it with "
                "ckptlab.open (`ckptlab inspect` without --records)")
    first = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return (f"a zip archive of other files (first members: {first}; {len(names)} in all), "
            "not a torch.save checkpoint (no data.pkl): if it holds a checkpoint, extract it "
            "(unzip) and open that file")
