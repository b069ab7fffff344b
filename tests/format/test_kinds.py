"""Refusals name the file's kind from its magic bytes and say what to do (issue 28, item 6).

Each kind is written by its real library where it is installed here (gzip, bz2, lzma, zipfile,
pickle, numpy, torch, tarfile, zstandard), else built from its spec (tensorizer's
``_FileHeader``, ONNX's ``ModelProto``, GGUF's header, HDF5's superblock signature, a Git LFS
pointer). ``ckptlab.open`` raises a ckptlab error naming the file, the kind, the action and
the first bytes; ``ckptlab inspect`` exits 2 with one ``ckptlab: error:`` line.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import pickle
import random
import struct
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptlab
from ckptlab.cli import main
from ckptlab.errors import ArchiveError, TruncatedArchiveError, UnsupportedFormatError
from ckptlab.format import detect_format
from ckptlab.format._kinds import describe
from ckptlab.testing.archives import save_bytes

STATE = {"w": torch.arange(6, dtype=torch.float32)}


def torch_bytes() -> bytes:
    return save_bytes(STATE)


def zstd_bytes(data: bytes) -> bytes:
    try:
        import zstandard
    except ImportError:  # the frame magic (RFC 8878 section 3.1.1) and a frame that says little
        return bytes.fromhex("28b52ffd") + b"\x00" * 16
    return zstandard.ZstdCompressor().compress(data)


def tensorizer_bytes(version: int, flags: int = 0) -> bytes:
    """A tensorizer header as its ``_FileHeader.to_bytes`` writes one: magic, uint32 data
    version, 32 bytes of feature flags (version 4+; zeros before), uint64 tensor bytes, 8
    unused bytes, uint64 tensor count; then the uint64 metadata size and that many bytes."""
    flag_bytes = flags.to_bytes(32, "little") if version >= 4 else bytes(32)
    header = b"|TZR|" + struct.pack("<I", version) + flag_bytes + struct.pack("<Q8xQ", 0, 0)
    return header + struct.pack("<Q", 64) + bytes(64)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def onnx_bytes() -> bytes:
    """A ModelProto in field order, as protobuf serializes it: ir_version 10, producer name and
    version, a graph (one initializer) and an opset import (onnx.proto's field numbers)."""
    tensor = field(1, 2) + field(2, 1) + field(8, b"w") + field(9, bytes(8))
    graph = field(5, tensor) + field(2, b"main_graph")
    opset = field(1, b"") + field(2, 17)
    return (field(1, 10) + field(2, b"pytorch") + field(3, b"2.13.0") + field(7, graph)
            + field(8, opset))


def gguf_bytes() -> bytes:
    """GGUF's header: magic, uint32 version 3, uint64 tensor count, uint64 key-value count,
    then one key-value pair (general.architecture = "llama")."""
    key = b"general.architecture"
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<I", 8) + struct.pack("<Q", 5) + b"llama")


def hdf5_bytes() -> bytes:
    """HDF5's format signature then a version 0 superblock's first bytes (versions, sizes)."""
    return b"\x89HDF\r\n\x1a\n" + bytes([0, 0, 0, 0, 0, 8, 8, 0]) + bytes(80)


def npz_bytes(compressed: bool) -> bytes:
    out = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(out, weight=np.ones(3), bias=np.zeros(2))
    return out.getvalue()


def zip_bytes() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("model/config.json", "{}")
        zf.writestr("model/weights.bin", b"\0" * 64)
        zf.writestr("notes\nwith a newline.txt", b"x")
        zf.writestr("more.txt", b"y")
    return out.getvalue()


def tar_bytes(member: str) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(member)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    return out.getvalue()


def legacy_bytes(protocol: int) -> bytes:
    out = io.BytesIO()
    torch.save(STATE, out, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    return out.getvalue()


def npy_bytes() -> bytes:
    out = io.BytesIO()
    np.save(out, np.arange(4, dtype=np.float32))
    return out.getvalue()


def big_pickle(protocol: int) -> bytes:
    return pickle.dumps({f"layer{i}": [float(i)] * 16 for i in range(4000)}, protocol=protocol)


def safetensors_cut() -> bytes:
    from safetensors.torch import save

    data = save(STATE)
    return data[:40]  # inside the JSON header


# (id, file name, bytes, words the message holds: the kind and the action, first bytes shown)
KINDS: list[tuple[str, str, Callable[[], bytes], list[str], bool]] = [
    ("gzip", "model.pt.gz", lambda: gzip.compress(torch_bytes()),
     ["gzip", "decompress it first", "gunzip"], True),
    ("zstd", "model.pt.zst", lambda: zstd_bytes(torch_bytes()),
     ["zstd", "decompress it first", "zstd -d"], True),
    ("bzip2", "model.pt.bz2", lambda: bz2.compress(torch_bytes()),
     ["bzip2", "decompress it first", "bunzip2"], True),
    ("xz", "model.pt.xz", lambda: lzma.compress(torch_bytes()),
     ["xz", "decompress it first", "unxz"], True),
    ("npy", "weights.npy", npy_bytes, ["NumPy array", ".npy", "np.load it"], True),
    ("npz", "weights.npz", lambda: npz_bytes(False),
     ["NumPy .npz archive", "'weight'", "np.load it"], False),
    ("npz-compressed", "weights.npz", lambda: npz_bytes(True),
     ["NumPy .npz archive", "np.load it"], False),
    ("zip", "bundle.zip", zip_bytes,
     ["zip archive of other files", "'model/config.json'", "4 in all", "no data.pkl",
      "extract it"], False),
    *((f"pickle-{p}", "state.pkl", lambda p=p: pickle.dumps({"w": [1.0, 2.0]}, protocol=p),
       ["plain pickle", f"protocol {p}", "not a torch.save archive",
        "ckptlab does not run pickles"], True) for p in (2, 3, 4, 5)),
    *((f"pickle-{p}", "state.pkl", lambda p=p: pickle.dumps({"w": [1.0, 2.0]}, protocol=p),
       ["plain pickle", "protocol 0 or 1", "ckptlab does not run pickles"], True)
      for p in (0, 1)),
    *((f"pickle-{p}-large", "state.pkl", lambda p=p: big_pickle(p),
       ["looks like a plain pickle", "protocol 0 or 1", "ckptlab does not run pickles"], True)
      for p in (0, 1)),
    *((f"legacy-torch-protocol-{p}", "old.pt", lambda p=p: legacy_bytes(p),
       ["legacy torch.save file", "protocol 0 or 1", "torch.load(weights_only=False)",
        "torch.save"], True) for p in (0, 1)),
    # (unencrypted tensorizer files open: tests/format/test_tensorizer.py)
    ("tensorizer-encrypted-v3", "model.tensors", lambda: tensorizer_bytes(3),
     ["an encrypted tensorizer file", "does not decrypt", "key"], False),
    ("tensorizer-encrypted-v4", "model.tensors", lambda: tensorizer_bytes(4, flags=1),
     ["an encrypted tensorizer file (data version 4)", "does not decrypt", "key"], False),
    ("onnx", "model.bin", onnx_bytes, ["ONNX model", "IR version 10", "onnx.load"], True),
    ("onnx-named", "model.onnx", lambda: field(2, b"pytorch") + field(7, b"\0" * 20),
     ["ONNX model", "onnx.load"], True),
    ("gguf", "model.gguf", gguf_bytes, ["GGUF file", "version 3", "GGUFReader"], True),
    ("hdf5", "model.h5", hdf5_bytes, ["HDF5 file", "Keras", "h5py"], True),
    ("tar", "checkpoints.tar", lambda: tar_bytes("model.pt"),
     ["tar archive", "'model.pt'", "tar -xf"], True),
    ("legacy-tar", "old.tar", lambda: tar_bytes("sys_info"),
     ["legacy torch.save tar archive", "torch.load(weights_only=False)"], True),
    ("git-lfs", "model.safetensors", lambda: (
        b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32
        + b"\nsize 123456\n"), ["Git LFS pointer", "git lfs pull"], True),
    ("html", "pytorch_model.bin", lambda: b"<!DOCTYPE html>\n<html><body>x</body></html>\n",
     ["HTML page", "/resolve/"], True),
]


@pytest.mark.parametrize("name,make,words,first", [k[1:] for k in KINDS],
                         ids=[k[0] for k in KINDS])
def test_refusal_names_the_kind_and_what_to_do(name: str, make: Callable[[], bytes],
                                               words: list[str], first: bool,
                                               tmp_path: Path, capsys) -> None:
    path = tmp_path / name
    data = make()
    path.write_bytes(data)
    with pytest.raises(UnsupportedFormatError) as info:
        ckptlab.open(path)
    message = str(info.value)
    assert info.value.path == str(path) and message.startswith(f"{path}"), message
    for word in words:
        assert word in message, (word, message)
    assert "\n" not in message
    if first:
        assert f"(first bytes {data[:8].hex(' ')})" in message and info.value.offset == 0
    # the same words from bytes and a file object (their own names; ONNX may go by the name)
    for source in (data, io.BytesIO(data)) if path.suffix != ".onnx" else ():
        with pytest.raises(UnsupportedFormatError) as again:
            ckptlab.open(source)
        assert words[0] in str(again.value)
    assert main(["inspect", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line == f"ckptlab: error: {message}"


@pytest.mark.parametrize("name,make,words,first", [k[1:] for k in KINDS],
                         ids=[k[0] for k in KINDS])
def test_the_format_level_refusals_say_the_same(name: str, make: Callable[[], bytes],
                                                words: list[str], first: bool,
                                                tmp_path: Path) -> None:
    """``ckptlab.inspect`` and ``storage_offsets`` (torch.save files only) say the same."""
    path = tmp_path / name
    path.write_bytes(make())
    for call in (ckptlab.inspect, ckptlab.storage_offsets):
        with pytest.raises(UnsupportedFormatError) as info:
            call(path)
        assert words[0] in str(info.value), str(info.value)


def test_detect_format_kinds_are_unchanged() -> None:
    """The kinds are the refusal's words: ``detect_format`` (and so every dispatch on it)
    still says ``unknown`` for them, ``pickle`` for protocols 2-5, ``torch-zip`` for zips."""
    for ident, _, make, _, _ in KINDS:
        data = make()
        kind = detect_format(data[:512], len(data))
        if ident.startswith(("npz", "zip")):
            assert kind == "torch-zip", ident
        elif ident.startswith("pickle-") and ident[7] in "2345":
            assert kind == "pickle", ident
        elif "tar" in ident and "tensorizer" not in ident:
            assert kind == "legacy-tar", ident
        elif ident.startswith("tensorizer"):  # read by ckptlab.format.tensorizer
            assert kind == "tensorizer", ident
        else:
            assert kind == "unknown", ident


def test_torch_export_names_at_the_format_level(tmp_path: Path) -> None:
    """A torch.export archive refused by the torch.save scan is named as one; ckptlab.open
    reads it. A zip that only has such a name, but is none, is refused as a zip."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    path = tmp_path / "m.pt2"
    torch.export.save(program, path)
    with pytest.raises(UnsupportedFormatError, match=r"a torch\.export archive \(\.pt2\)"):
        ckptlab.inspect(path)
    assert ckptlab.open(path).format == "pt2"
    fake = tmp_path / "fake.zip"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr("x/archive_format", "not-pt2")
    with pytest.raises(UnsupportedFormatError, match=r"a torch\.export archive"):
        ckptlab.inspect(fake)  # the names alone
    with pytest.raises(UnsupportedFormatError) as info:
        ckptlab.open(fake)  # its records read: no torch.export archive
    assert "zip archive of other files" in str(info.value)


def test_legacy_torch_files_are_still_read(tmp_path: Path) -> None:
    """Legacy torch.save files of protocols 2-5 are pickles with a magic number first: still
    read by ckptlab.open, and named as legacy (not plain pickles) by the format level."""
    for protocol in (2, 3, 4, 5):
        path = tmp_path / f"legacy{protocol}.pt"
        path.write_bytes(legacy_bytes(protocol))
        ck = ckptlab.open(path)
        assert list(ck.tensors) == ["w"] and torch.equal(ck.read("w"), STATE["w"])
        with pytest.raises(UnsupportedFormatError) as info:
            ckptlab.inspect(path)
        message = str(info.value)
        assert "legacy torch.save file" in message and "plain pickle" not in message, message
        assert "ckptlab.open reads it" in message


def test_a_cut_safetensors_header_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_cut())
    with pytest.raises(TruncatedArchiveError, match="a safetensors file cut short"):
        ckptlab.open(path)


def test_broken_safetensors_keep_their_own_errors() -> None:
    """A whole header is detect_format's: its errors are the safetensors reader's."""
    from safetensors.torch import save

    data = bytearray(save(STATE))
    n = int.from_bytes(data[:8], "little")
    data[8 + n - 2:8 + n] = b"!!"  # the header's JSON broken
    with pytest.raises(ArchiveError) as info:
        ckptlab.open(bytes(data))
    assert "first bytes" not in str(info.value) and "safetensors" in str(info.value)


def test_unknown_bytes_are_not_claimed() -> None:
    """Random bytes and text (of which many letters are pickle opcodes) claim no kind."""
    rng = random.Random(28)
    for i in range(3000):
        nbytes = rng.choice([1, 9, 100, 600, 5000, 200_000])
        data = rng.randbytes(min(nbytes, 70_000))
        if i % 8 == 0:  # one in 8 starts with a weak magic: an ONNX tag or a pickle opcode
            data = rng.choice([b"\x08", b"(", b"}", b"]", b"c", b"I"]) + data[1:]
        kind = describe(data[:512], nbytes, "x.bin", lambda n, d=data: d[:n])
        assert kind is None, (i, data[:16], kind)
    for text in (b"hello world, not a checkpoint", b"just some text, not a checkpoint\n" * 20,
                 b"The quick brown fox", b"(not a pickle)", b"{\"a\": 1}", b"cat dog\n",
                 b"Invalid request\n", b"0123456789"):
        assert describe(text[:512], len(text), "t.pt", lambda n, t=text: t[:n]) is None, text


def test_a_pickle_probe_reads_little(tmp_path: Path) -> None:
    """Text whose first byte is a pickle opcode is decided from its first 512 bytes (no
    further read); a protocol 0/1 pickle reads at most 64 KiB more, once."""
    reads: list[int] = []

    def more(data: bytes) -> Callable[[int], bytes]:
        def read(n: int) -> bytes:
            reads.append(n)
            return data[:n]
        return read

    text = b"The first line of a long text file\n" * 10_000
    assert describe(text[:512], len(text), "t", more(text)) is None and reads == []
    data = big_pickle(0)
    kind = describe(data[:512], len(data), "p", more(data))
    assert kind is not None and kind.id == "pickle" and reads == [64 << 10]


def test_opcode_spans_walk_by_argument_lengths() -> None:
    """The walk ``_kinds`` uses: each opcode's offset, by ``OPCODE_ARGUMENTS`` alone, as
    pickletools lists them; it stops at STOP, at a cut, and refuses an unknown opcode."""
    import pickle
    import pickletools

    from ckptlab.format._optable import opcode_spans

    obj = {"a": [1, 2.5, "x" * 300, b"y" * 1000], "b": (None, True, 2**70)}  # (lines < 4 KiB)
    for protocol in range(6):
        data = pickle.dumps(obj, protocol=protocol)
        want = [(pos, data[pos]) for _, _, pos in pickletools.genops(data)]
        assert list(opcode_spans(data + b"trailing")) == want
        cut = list(opcode_spans(data[:len(data) // 2]))
        assert cut == want[:len(cut)] and len(cut) < len(want)
    with pytest.raises(ValueError, match="unknown opcode"):
        list(opcode_spans(b"\x80\x02\xff."))
