"""Hostile inputs: builders for named attack shapes and structure-aware fuzzing strategies.

Only tests import this module (it imports hypothesis). Builders return the bytes of one
pickle; :func:`torch_zip` wraps a pickle as the ``data.pkl`` of a minimal torch archive.
Strategies emit opcode streams (:func:`opcode_streams`), mutations of a real pickle at its
opcode arguments (:func:`pickle_mutations`, for DCP ``.metadata`` too), safetensors files
(:func:`safetensors_files`) and mutations of a real zip at its structural fields
(:func:`zip_mutations`).
"""

from __future__ import annotations

import io
import struct
import zipfile

from hypothesis import strategies as st

__all__ = [
    "amplifier",
    "deep_tuple_key",
    "distinct_globals",
    "opcode_streams",
    "pickle_mutations",
    "safetensors_files",
    "torch_zip",
    "zip_mutations",
]

PROTO2 = b"\x80\x02"
STOP = b"."


def torch_zip(pkl: bytes, archive: str = "archive") -> bytes:
    """A stored zip with ``pkl`` as ``archive/data.pkl`` (the records torch.load needs)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", pkl)
        z.writestr(f"{archive}/.format_version", "1")
        z.writestr(f"{archive}/byteorder", "little")
        z.writestr(f"{archive}/version", "3\n")
    return buf.getvalue()


def deep_tuple_key(depth: int) -> bytes:
    """``{((...(None,)...),): 1}`` with ``depth`` nested 1-tuples as the key."""
    return PROTO2 + b"}" + b"N" + b"\x85" * depth + b"K\x01s" + STOP


def amplifier(opcode: bytes, count: int, *, protocol: int = 4) -> bytes:
    """``count`` repetitions of a one-byte opcode that makes an object (EMPTY_SET, MARK...).

    MEMOIZE repeats over one ``None`` (a valid pickle); the others leave ``count`` objects on
    the stack, so the pickle is malformed only at its STOP: a reader must bound memory while
    reading it.
    """
    if opcode == b"\x94":
        return bytes([0x80, protocol]) + b"N" + opcode * count + STOP
    return bytes([0x80, protocol]) + opcode * count + b"N" + STOP


def distinct_globals(count: int) -> bytes:
    """``count`` distinct GLOBALs, each popped at once, then ``None``."""
    body = b"".join(b"cm%d\nn%d\n0" % (i, i) for i in range(count))
    return PROTO2 + body + b"N" + STOP


_GLOBALS = [
    b"torch._utils\n_rebuild_tensor_v2\n", b"torch\nFloatStorage\n", b"torch\nSize\n",
    b"collections\nOrderedDict\n", b"os\nsystem\n", b"builtins\nset\n",
    b"torch._utils\n_rebuild_sparse_tensor\n", b"torch._utils\n_rebuild_qtensor\n",
    b"torch.serialization\n_get_layout\n", b"torch\nper_channel_affine\n",
    b"torch.distributed.checkpoint.metadata\nMetadataIndex\n",
    b"torch.distributed.checkpoint.metadata\nMetadata\n",
    b"torch.distributed.checkpoint.filesystem\n_StorageInfo\n",
    b"torch._utils\n_rebuild_wrapper_subclass\n", b"copyreg\n_reconstructor\n",
    b"torch._tensor\n_rebuild_from_type_v2\n", b"torch\nfloat32\n",
]


def _op() -> st.SearchStrategy[bytes]:
    text = st.text(max_size=8).map(lambda s: s.encode("utf-8", "surrogatepass"))
    return st.one_of(
        st.sampled_from([b"N", b"\x88", b"\x89", b")", b"]", b"}", b"\x8f", b"(", b"t",
                         b"\x85", b"\x86", b"\x87", b"l", b"d", b"e", b"u", b"s", b"a",
                         b"\x90", b"\x91", b"\x94", b"2", b"0", b"1", b"R", b"b", b"\x81",
                         b"\x92", b"Q", b"\x93", b"."]),
        st.integers(0, 255).map(lambda k: b"K" + bytes([k])),
        st.integers(-(2**31), 2**31 - 1).map(lambda k: b"J" + struct.pack("<i", k)),
        st.binary(max_size=24).map(lambda b: b"\x8a" + bytes([len(b)]) + b),
        text.map(lambda b: b"X" + struct.pack("<I", len(b)) + b),
        st.binary(max_size=8).map(lambda b: b"C" + bytes([len(b)]) + b),
        st.sampled_from(_GLOBALS).map(lambda g: b"c" + g),
        st.integers(0, 12).map(lambda k: b"q" + bytes([k])),
        st.integers(0, 12).map(lambda k: b"h" + bytes([k])),
        st.integers(0, 2**32 - 1).map(lambda k: b"r" + struct.pack("<I", k)),
        st.integers(0, 2**32 - 1).map(lambda k: b"X" + struct.pack("<I", k)),  # lies
        st.integers(0, 2**64 - 1).map(lambda k: b"\x95" + struct.pack("<Q", k)),
        st.integers(0, 2**32 - 1).map(lambda k: b"\x8b" + struct.pack("<I", k)),
        st.sampled_from([b"\x82\x01", b"\x83\x01\x00", b"\x84\x01\x00\x00\x00",
                         b"\x97", b"\x98", b"\xff"]),
        st.tuples(st.sampled_from([b"FloatStorage", b"LongStorage", b"UntypedStorage"]),
                  st.integers(0, 2**40)).map(
            lambda t: b"(X\x07\x00\x00\x00storagectorch\n" + t[0]
            + b"\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu\x8a\x08" + struct.pack("<q", t[1])
            + b"tQ"),  # a persistent id ('storage', <type>, '0', 'cpu', numel)
    )


def opcode_streams(max_ops: int = 60) -> st.SearchStrategy[bytes]:
    """Pickles of random, mostly well-formed opcodes (protocol 2-5 header, STOP at the end)."""
    return st.tuples(st.integers(2, 5), st.lists(_op(), max_size=max_ops)).map(
        lambda t: bytes([0x80, t[0]]) + b"".join(t[1]) + STOP)


# -- safetensors headers -----------------------------------------------------------------------
_ST_TAGS = ["F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "U32",
            "U64", "C64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "F4",
            "F6_E2M3", "XX", ""]


def safetensors_files() -> st.SearchStrategy[bytes]:
    """safetensors files with plausible-to-hostile headers: odd names (lone surrogates,
    markup), every dtype tag and unknown ones, huge or negative dims, overlapping or lying
    offsets, wrong header lengths, short data."""
    import json

    dims = st.one_of(st.integers(0, 6), st.integers(-3, 2**70))
    entry = st.fixed_dictionaries({
        "dtype": st.sampled_from(_ST_TAGS),
        "shape": st.lists(dims, max_size=4),
        "data_offsets": st.lists(st.integers(-2, 200), min_size=2, max_size=3),
    })
    names = st.one_of(st.text(max_size=6), st.just("\ud800x"), st.just("<b>x</b>"))
    header = st.dictionaries(names, entry, max_size=4)

    def build(args: tuple[dict, int, int, bytes]) -> bytes:
        head, pad, lie, data = args
        raw = json.dumps(head).encode("utf-8", "surrogatepass") + b" " * pad
        length = len(raw) + lie
        return struct.pack("<Q", max(length, 0)) + raw + data

    return st.tuples(header, st.integers(0, 8), st.sampled_from([0, 0, 0, -1, 1, 2**40]),
                     st.binary(max_size=128)).map(build)


# -- zip structures ----------------------------------------------------------------------------
def zip_mutations(archive: bytes, fields: list[tuple[int, int]]) -> st.SearchStrategy[bytes]:
    """Mutations of a real archive at its structural fields: ``fields`` are (offset, width)
    of header/central-directory/end-record fields; each case overwrites a few of them with
    boundary values, truncates, appends a copy of the tail, or splices the archive twice."""
    def overwrite(args: tuple[list[tuple[int, int, int]], int]) -> bytes:
        edits, mode = args
        out = bytearray(archive)
        for index, kind, value in edits:
            offset, width = fields[index % len(fields)]
            limit = (1 << (8 * width)) - 1
            choice = [0, 1, limit, limit - 1, value % (limit + 1), len(archive),
                      (1 << (8 * width - 1))][kind % 7]
            out[offset:offset + width] = choice.to_bytes(width, "little")
        if mode == 1:
            return bytes(out[: max(1, len(out) - 7)])
        if mode == 2:
            return bytes(out) + bytes(out[-64:])
        if mode == 3:
            return bytes(out) + bytes(archive)
        return bytes(out)

    edit = st.tuples(st.integers(0, 10_000), st.integers(0, 6), st.integers(0, 2**64))
    return st.tuples(st.lists(edit, min_size=1, max_size=3), st.integers(0, 3)).map(overwrite)


def pickle_mutations(pkl: bytes) -> st.SearchStrategy[bytes]:
    """Mutations of a real pickle at its opcode arguments: an int or a string argument is
    replaced (by boundary ints, huge lengths, other strings), or an opcode is replaced."""
    import pickletools

    ops = [(pos, op.name, arg) for op, arg, pos in pickletools.genops(pkl)]

    def mutate(args: tuple[int, int, int]) -> bytes:
        index, kind, value = args
        pos, name, _ = ops[index % len(ops)]
        out = bytearray(pkl)
        if kind == 0:  # another opcode byte
            out[pos] = value % 256
        elif kind == 1 and name in ("BININT1", "BINGET", "BINPUT", "SHORT_BINUNICODE"):
            out[pos + 1] = value % 256
        elif kind == 2 and name in ("BININT", "LONG_BINGET", "LONG_BINPUT", "BINUNICODE"):
            out[pos + 1:pos + 5] = (value % 2**32).to_bytes(4, "little")
        else:  # delete one opcode's first byte
            del out[pos]
        return bytes(out)

    return st.tuples(st.integers(0, 10_000), st.integers(0, 3), st.integers(0, 2**64)).map(
        mutate)
