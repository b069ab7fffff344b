"""The on-disk inspection cache (``ckptlab.checkpoint._cache``) the served app reads first.

Core module (no UI imports); tested here beside the app that uses it. Entries are JSON keyed
by a checkpoint's identity; damaged, foreign or stale entries are ignored and rebuilt.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint._cache import (
    CACHE_VERSION,
    CheckpointIndex,
    InspectionCache,
    cache_dir,
    identity_of,
)
from ckptlab.errors import InvalidArgumentError


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"layer.weight": torch.arange(6.0).reshape(2, 3), "layer.bias": torch.ones(3),
                "step": 7, "lr": 0.5, "half": torch.zeros(4, dtype=torch.float16)}, path)
    return path


def _entries(cache: InspectionCache) -> list:
    return sorted(cache.directory.glob("v*/*.json"))


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
    raw = json.loads(entry.read_text())
    assert raw["version"] == CACHE_VERSION and raw["identity"] == identity_of(model_file)
    second, ck2 = cache.index_of(model_file, opener)
    assert ck2 is None and len(opened) == 1 and cache.hits == 1
    assert second.to_dict() == first.to_dict()
    # a JSON file only: no temporary file is left behind
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
    lambda raw: b"{not json",
    lambda raw: b"",
    lambda raw: raw[: len(raw) // 2],
    lambda raw: json.dumps({**json.loads(raw), "version": CACHE_VERSION + 1}).encode(),
    lambda raw: json.dumps({**json.loads(raw), "identity": {"path": "/elsewhere"}}).encode(),
    lambda raw: json.dumps({**json.loads(raw), "index": {"names": "x"}}).encode(),
    lambda raw: raw.replace(b'"part_start":[0,', b'"part_start":[5,'),
    lambda raw: raw.replace(b'"file":[0,', b'"file":[9,'),
    lambda raw: raw.replace(b'"names":["layer.weight"', b'"names":[17'),
    lambda raw: b"[" * 100_000,
    lambda raw: raw.replace(b'"nbytes":[24,', b'"nbytes":[true,'),
    lambda raw: raw.replace(b'"part_start":[0,1,', b'"part_start":[0,9,'),
    lambda raw: raw.replace(b'"part_file":[0,', b'"part_file":[-2,'),
], ids=["garbage", "empty", "truncated", "version", "identity", "columns", "part_start",
        "file-index", "name-type", "deep", "bool-for-int", "part-start-descends",
        "part-file-below"])
def test_a_damaged_entry_is_ignored_and_rebuilt(model_file, tmp_path, damage):
    cache = InspectionCache(tmp_path / "cache")
    good, _ = cache.index_of(model_file)
    (entry,) = _entries(cache)
    raw = entry.read_bytes()
    entry.write_bytes(damage(raw))
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
