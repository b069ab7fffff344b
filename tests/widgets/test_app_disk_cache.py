"""The on-disk inspection cache (``ckptlab.checkpoint._cache``) the served app reads first.

Core module (no UI imports); tested here beside the app that uses it. Entries are columnar
files keyed by a checkpoint's identity; damaged, foreign or stale entries are ignored and
rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint._cache import (
    CACHE_VERSION,
    CheckpointIndex,
    InspectionCache,
    cache_dir,
    decode_index,
    encode_index,
    identity_of,
)
from ckptlab.errors import InvalidArgumentError


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"layer.weight": torch.arange(6.0).reshape(2, 3), "layer.bias": torch.ones(3),
                "step": 7, "lr": 0.5, "half": torch.zeros(4, dtype=torch.float16)}, path)
    return path


MAGIC = b"CKPTLAB-INDEX\n"
HEAD = len(MAGIC) + 8 + 32  # the magic, the header's length, the SHA-256 of the rest


def _entries(cache: InspectionCache) -> list:
    return sorted(cache.directory.glob("v*/*.ckix"))


def _split(raw: bytes) -> tuple[dict, bytearray]:
    """An entry's header and body (the format of ``encode_index``)."""
    assert raw.startswith(MAGIC)
    hlen = int.from_bytes(raw[len(MAGIC):len(MAGIC) + 8], "little")
    return json.loads(raw[HEAD:HEAD + hlen]), bytearray(raw[HEAD + hlen:])


def _entry(text: bytes, body: bytes, digest: bytes | None = None) -> bytes:
    """An entry of header ``text`` and ``body``; its SHA-256 the real one unless ``digest``."""
    head = MAGIC + len(text).to_bytes(8, "little")
    if digest is None:
        digest = hashlib.sha256(head + text + bytes(body)).digest()
    return head + digest + text + bytes(body)


def _join(header: dict, body: bytes, *, checksum: bool = True, raw: bytes = b"") -> bytes:
    """An entry from a header and a body; ``checksum``: the entry states its real SHA-256 (so
    that the entry's other checks are the ones that must catch a damage), else ``raw``'s."""
    return _entry(json.dumps(header).encode(), body,
                  None if checksum else raw[len(MAGIC) + 8:HEAD])


def _edit_column(name: str, row: int, value: int, dtype: str = "<i8"):
    """A damage: item ``row`` of column ``name`` set to ``value``, the checksum made right."""
    def damage(raw: bytes) -> bytes:
        header, body = _split(raw)
        start, nbytes = header["columns"][name]
        col = np.frombuffer(body, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize,
                            offset=start).copy()
        col[row] = value
        body[start:start + nbytes] = col.tobytes()
        return _join(header, body)
    return damage


def _edit_header(**fields):
    def damage(raw: bytes) -> bytes:
        header, body = _split(raw)
        return _join({**header, **fields}, body)
    return damage


def _flip_body_byte(raw: bytes) -> bytes:
    header, body = _split(raw)
    body[len(body) // 2] ^= 0x40
    return _join(header, body, checksum=False, raw=raw)


def _edit_header_keeping_the_checksum(raw: bytes) -> bytes:
    """A hand edit of the header (a dtype renamed) with the entry's old SHA-256 kept."""
    header, body = _split(raw)
    header["tables"]["dtypes"] = ["float16" if t == "float32" else t
                                  for t in header["tables"]["dtypes"]]
    return _join(header, body, checksum=False, raw=raw)


def _swap_spans(first: str, second: str):
    """A damage: two columns' [start, nbytes] swapped in the header, the checksum made right
    (the fixture's 3 tensors have 3 parts: the spans are of one length)."""
    def damage(raw: bytes) -> bytes:
        header, body = _split(raw)
        cols = header["columns"]
        cols[first], cols[second] = cols[second], cols[first]
        return _join(header, body)
    return damage


def _swap_items(name: str, dtype: str = "<i8"):
    """A damage: items 0 and 1 of column ``name`` swapped, the checksum made right."""
    def damage(raw: bytes) -> bytes:
        header, body = _split(raw)
        start, nbytes = header["columns"][name]
        col = np.frombuffer(body, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize,
                            offset=start).copy()
        col[[0, 1]] = col[[1, 0]]
        body[start:start + nbytes] = col.tobytes()
        return _join(header, body)
    return damage


def test_index_matches_the_checkpoint(model_file):
    ck = cl.open(model_file)
    index = CheckpointIndex.from_checkpoint(ck)
    assert index.format == "torch-zip" and index.files == (("m.pt", "torch-zip",
                                                             model_file.stat().st_size),)
    assert list(index.names) == list(ck.tensors)
    for row, t in enumerate(ck.tensors.values()):
        assert index.dtypes[row] == t.dtype
        assert index.shapes[row] == "[" + ", ".join(map(str, t.shape)) + "]"
        assert index.nbytes[row] == t.nbytes and index.parameters[row] == t.parameters
        assert index.offset[row] == t.parts[0].offset
        assert index.parts_of(row) == [(p.role, p.file, p.offset, p.nbytes) for p in t.parts]
    assert index.objects == {"step": 7, "lr": 0.5}
    assert index.total_parameters == 6 + 3 + 4
    assert index.totals_by_dtype() == {"float32": (2, 9, 36), "float16": (1, 4, 8)}
    assert index.row_of("layer.bias") == 1
    with pytest.raises(KeyError):
        index.row_of("nope")


def test_a_second_look_reads_the_cache(model_file, tmp_path):
    cache = InspectionCache(tmp_path / "cache")
    opened = []

    def opener(path):
        opened.append(path)
        return cl.open(path)

    first, ck = cache.index_of(model_file, opener)
    assert ck is not None and len(opened) == 1 and cache.misses == 1
    (entry,) = _entries(cache)
    assert entry.parent.name == f"v{CACHE_VERSION}"
    header, _ = _split(entry.read_bytes())
    assert header["version"] == CACHE_VERSION and header["identity"] == identity_of(model_file)
    second, ck2 = cache.index_of(model_file, opener)
    assert ck2 is None and len(opened) == 1 and cache.hits == 1
    assert second.to_dict() == first.to_dict()
    # the entry file only: no temporary file is left behind
    assert not list(cache.directory.rglob(".tmp-*"))


def test_a_rewritten_file_is_another_entry(model_file, tmp_path):
    cache = InspectionCache(tmp_path / "cache")
    cache.index_of(model_file)
    torch.save({"other": torch.zeros(2)}, model_file)
    os.utime(model_file, ns=(1, 1))  # even with an older mtime, the bytes differ
    second, ck = cache.index_of(model_file)
    assert ck is not None and list(second.names) == ["other"]
    assert len(_entries(cache)) == 2


@pytest.mark.parametrize("damage", [
    lambda raw: b"{not an entry",
    lambda raw: b"",
    lambda raw: raw[: len(raw) // 2],
    lambda raw: raw[:-1],
    lambda raw: _entry(b"[" * 100_000, b""),
    lambda raw: raw[: len(MAGIC)] + (2**62).to_bytes(8, "little") + raw[len(MAGIC) + 8:],
    _flip_body_byte,
    _edit_header_keeping_the_checksum,
    lambda raw: raw[:HEAD - 1] + bytes([raw[HEAD - 1] ^ 1]) + raw[HEAD:],
    _edit_header(version=CACHE_VERSION + 1),
    _edit_header(version=2),
    _edit_header(identity={"path": "/elsewhere"}),
    _edit_header(tensors=2),
    _edit_header(tensors=-1),
    _edit_header(tensors=True),
    _edit_header(columns={"names": "x"}),
    _edit_header(files=[["m.pt", "torch-zip"]]),
    _edit_header(tables={"dtypes": [], "shapes": [], "kinds": [], "part_role": []}),
    _edit_header(objects=[1]),
    _edit_header(notes=[17]),
    _edit_header(format=None),
    _edit_column("part_start", 0, 5),
    _edit_column("part_start", 1, 9),
    _edit_column("file", 0, 9),
    _edit_column("part_file", 0, -2),
    _edit_column("dtypes", 0, 7, "<i4"),
    _edit_column("name_ends", 0, 10**6),
    _edit_column("name_ends", 0, 23),  # past the second name's end (22)
    _swap_spans("offset", "part_nbytes"),
    _swap_spans("nbytes", "parameters"),
    _edit_header(columns={"extra": [0, 0]}),
    _edit_column("nbytes", 0, 16),
    _edit_column("part_nbytes", 0, 16),
    _edit_column("part_nbytes", 0, -24),
    _edit_column("offset", 1, 64),
    _edit_column("part_offset", 2, 64),
    _edit_column("file", 0, -1),
    _swap_items("part_offset"),
], ids=["garbage", "empty", "truncated", "last-byte", "deep-header", "huge-header",
        "bit-flip", "header-edit", "digest-flip", "version", "version-2", "identity",
        "tensor-count", "negative-count", "bool-count", "columns", "files", "tables",
        "objects", "notes", "format", "part_start", "part-start-descends", "file-index",
        "part-file-below", "dtype-code", "name-end-past", "name-ends-descend", "swapped-spans",
        "swapped-int-spans", "extra-column", "nbytes-not-parts", "part-nbytes-not-nbytes",
        "part-nbytes-negative", "offset-not-first-part", "part-offset-not-offset",
        "file-not-first-part", "part-offsets-swapped"])
def test_a_damaged_entry_is_ignored_and_rebuilt(model_file, tmp_path, damage):
    cache = InspectionCache(tmp_path / "cache")
    good, _ = cache.index_of(model_file)
    (entry,) = _entries(cache)
    raw = entry.read_bytes()
    damaged = damage(raw)
    assert damaged != raw
    entry.write_bytes(damaged)
    index, ck = cache.index_of(model_file)
    assert ck is not None, "the damaged entry was used"
    assert cache.rejected == 1
    assert index.to_dict() == good.to_dict()
    assert entry.read_bytes() == raw  # rebuilt in place
    assert cache.index_of(model_file)[1] is None  # and read back next time


def test_directories_are_keyed_by_each_member(tmp_path):
    from safetensors.torch import save_file

    root = tmp_path / "hf"
    root.mkdir()
    save_file({"a": torch.zeros(3)}, root / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(2)}, root / "model-00002-of-00002.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 20}, "weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    identity = identity_of(root)
    assert identity["kind"] == "dir" and sorted(identity["files"]) == sorted(os.listdir(root))
    cache = InspectionCache(tmp_path / "cache")
    index, ck = cache.index_of(root)
    assert ck is not None and index.format == "hf" and set(index.names) == {"a", "b"}
    assert cache.index_of(root)[1] is None
    save_file({"b": torch.ones(2) * 2}, root / "model-00002-of-00002.safetensors")
    assert identity_of(root) != identity
    assert cache.index_of(root)[1] is not None  # one shard changed: opened again


def test_the_cache_is_bounded(tmp_path):
    paths = []
    for i in range(4):
        path = tmp_path / f"m{i}.pt"
        torch.save({f"w{j}": torch.zeros(1) for j in range(20)}, path)
        paths.append(path)
    probe = InspectionCache(tmp_path / "probe")
    probe.index_of(paths[0])
    one = _entries(probe)[0].stat().st_size
    cache = InspectionCache(tmp_path / "cache", max_nbytes=int(one * 2.5))
    for path in paths:
        cache.index_of(path)
    entries = _entries(cache)
    assert len(entries) == 2 and sum(e.stat().st_size for e in entries) <= cache.max_nbytes
    # the two most recently stored remain
    assert cache.index_of(paths[3])[1] is None and cache.index_of(paths[2])[1] is None
    assert cache.index_of(paths[0])[1] is not None
    # an entry larger than the whole cache is not stored
    tiny = InspectionCache(tmp_path / "tiny", max_nbytes=10)
    assert tiny.index_of(paths[0])[1] is not None and not _entries(tiny)
    for bad in (0, -1, 1.5, None):
        with pytest.raises(InvalidArgumentError, match="max_nbytes"):
            InspectionCache(tmp_path, max_nbytes=bad)


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0,
                    reason="root writes into read-only directories")
def test_an_unwritable_directory_makes_the_cache_a_no_op(model_file, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        cache = InspectionCache(ro / "cache")
        index, ck = cache.index_of(model_file)
        assert ck is not None and len(index) == 3
    finally:
        ro.chmod(0o700)


def test_an_unwritable_path_makes_the_cache_a_no_op(model_file, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = InspectionCache(blocker / "cache")  # mkdir fails: a file is in the way
    index, ck = cache.index_of(model_file)
    assert ck is not None and len(index) == 3
    assert not cache.store(model_file, index)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTLAB_CACHE_DIR", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("CKPTLAB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ckptlab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ckptlab"
    assert InspectionCache().directory == cache_dir()


def test_identity_hashes_both_ends(tmp_path):
    path = tmp_path / "f.bin"
    data = bytearray(300_000)
    path.write_bytes(data)
    st = path.stat()
    first = identity_of(path)
    data[-1] = 1  # the last 64 KiB change, size and mtime kept
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = identity_of(path)
    assert second["head"] == first["head"] and second["tail"] != first["tail"]
    assert second["mtime_ns"] == first["mtime_ns"] and second != first


def test_the_columnar_entry_round_trips_any_text_and_large_numbers(tmp_path):
    """Names and values outside ASCII (a lone surrogate, a newline, a NUL), numbers past
    32 bits, a tensor without parts and an empty checkpoint all come back as they went in."""
    names = ("a\nb", "é·λ", "\x00", "lone\udc80", "")
    index = CheckpointIndex(
        "torch-zip", "/x/m.pt", (("m.pt", "torch-zip", 2**40),), names,
        ("float32", "bfloat16", "float32", "int8", "float32"), ("[2]", "[]", "?", "[1]", "[3]"),
        ("tensor",) * 5, (8, 2, 0, 2**35, 12), (2, 1, 0, 2**35, 3), (0, 0, -1, 0, 0),
        (64, 2**33, -1, 2**34, 99), (0, 1, 2, 2, 3, 4), ("data", "data", "data", "data"),
        (0, 0, 0, 0), (64, 2**33, 2**34, 99), (8, 2, 2**35, 12), {"step": 7}, ("a note",))
    identity = {"path": "/x/m.pt", "kind": "file", "nbytes": 1}
    back = decode_index(encode_index(index, identity), identity)
    assert back.to_dict() == index.to_dict()
    empty = CheckpointIndex("safetensors", "/e", (("e", "safetensors", 8),), (), (), (), (), (),
                            (), (), (), (0,), (), (), (), (), {}, ())
    assert decode_index(encode_index(empty, identity)).to_dict() == empty.to_dict()
    with pytest.raises(InvalidArgumentError, match="identity"):
        decode_index(encode_index(index, identity), {**identity, "nbytes": 2})
    with pytest.raises(InvalidArgumentError, match=r"m\.ckix.*offset 0: expected the magic"):
        decode_index(b"PK\x03\x04", where="m.ckix")
    # a number past int64 is not stored (False), never wrapped
    big = CheckpointIndex(**{**{f: getattr(index, f) for f in index.__dataclass_fields__},
                             "nbytes": (8, 2, 0, 2**70, 12)})
    cache = InspectionCache(tmp_path / "cache")
    model = tmp_path / "m.pt"
    model.write_bytes(b"x")
    assert not cache.store(model, big) and not _entries(cache)
    assert cache.store(model, index) and cache.load(model).to_dict() == index.to_dict()


def test_entries_of_the_json_version_are_never_read_and_are_pruned(model_file, tmp_path):
    cache = InspectionCache(tmp_path / "cache")
    old = tmp_path / "cache" / "v1" / ("0" * 40 + ".json")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"{" + b" " * 4096 + b"}")
    os.utime(old, ns=(1, 1))  # the least recently used
    index, ck = cache.index_of(model_file)
    assert ck is not None and cache.misses == 1 and old.exists()
    (entry,) = _entries(cache)
    small = InspectionCache(tmp_path / "cache", max_nbytes=entry.stat().st_size + 10)
    small.store(model_file, index)
    assert not old.exists() and entry.exists()  # the old entry went first
