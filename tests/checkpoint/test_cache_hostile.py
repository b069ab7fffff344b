"""The inspection cache (``ckptlab.checkpoint._cache``) against a hostile or busy cache directory.

A cache entry is an optimisation: whatever sits at an entry's path (a FIFO, a link to a device,
a file that grows while read, a hand-edited header) is a miss, never a hang, an unbounded read
or an exception; a writer killed mid-store and entries removed by another process leave the
size bound intact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint._cache import (
    CACHE_VERSION,
    CheckpointIndex,
    InspectionCache,
    decode_index,
    encode_index,
    identity_of,
)
from ckptlab.errors import InvalidArgumentError

MAGIC = b"CKPTLAB-INDEX\n"


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.pt"
    torch.save({"layer.weight": torch.arange(6.0).reshape(2, 3), "layer.bias": torch.ones(3),
                "half": torch.zeros(4, dtype=torch.float16)}, path)
    return path


def _empty_index(path: Path) -> CheckpointIndex:
    return CheckpointIndex("torch-zip", str(path), (), (), (), (), (), (), (), (), (), (0,), (),
                           (), (), (), {}, ())


def _fill(path: Path, nbytes: int, mtime_ns: int) -> Path:
    path.write_bytes(b"\0" * nbytes)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_entry_is_a_miss_and_never_blocks(model_file, tmp_path):
    cache = InspectionCache(tmp_path / "cache")
    identity = identity_of(model_file)
    entry = cache._entry_path(identity)
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(cache.load(model_file, identity)),
                              daemon=True)
    reader.start()
    reader.join(10)
    blocked = reader.is_alive()
    if blocked:  # let the stuck reader go: a writer that opens and closes gives it an EOF
        try:
            os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        reader.join(10)
    assert not blocked, "load() blocked on a FIFO"
    assert result == [None] and cache.rejected == 1 and cache.misses == 1
    assert not os.path.lexists(entry)  # ours: removed
    # and the next look stores a real entry in its place, read back after
    assert cache.index_of(model_file)[1] is not None
    assert cache.index_of(model_file)[1] is None and entry.is_file()


_DEVZERO = """
import os, resource, sys
from ckptlab.checkpoint._cache import InspectionCache, identity_of
cache = InspectionCache(sys.argv[1], max_nbytes=1 << 20)
identity = identity_of(sys.argv[2])
entry = cache._entry_path(identity)
entry.parent.mkdir(parents=True)
os.symlink("/dev/zero", entry)  # a hand-edited cache directory
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, vm + 2**30))  # 1 GiB more at most
print(cache.load(sys.argv[2], identity), cache.rejected, os.path.lexists(entry))
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and os.path.exists("/dev/zero")),
                    reason="needs /dev/zero and /proc")
def test_a_link_to_a_device_is_a_miss_not_an_endless_read(model_file, tmp_path):
    # in a child with a bounded address space (a reader that follows the link fills it),
    # importing the ckptlab this process imported
    root = str(Path(cl.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _DEVZERO, str(tmp_path / "cache"),
                           str(model_file)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "1", "False"]  # a miss, rejected, the link removed


def test_an_entry_that_grows_after_its_size_is_checked_is_read_bounded(
        model_file, tmp_path, monkeypatch):
    """The entry changes between the look at its size and the read (another process writes
    into it, or replaces it): no more than the bound is read, and it is a miss."""
    cache = InspectionCache(tmp_path / "cache", max_nbytes=64 * 1024)
    identity = identity_of(model_file)
    assert cache.store(model_file, CheckpointIndex.from_checkpoint(cl.open(model_file)),
                       identity)
    entry = cache._entry_path(identity)
    grown: list[int] = []
    more = b"\0" * (16 * 2**20)  # made before memory is traced

    def grow_once() -> None:
        if not grown:
            grown.append(1)
            with open(entry, "ab") as f:
                f.write(more)

    real_stat, real_fstat = os.stat, os.fstat

    def stat(path, *args, **kwargs):
        out = real_stat(path, *args, **kwargs)
        if os.fspath(path) == str(entry):
            grow_once()
        return out

    def fstat(fd):
        out = real_fstat(fd)
        grow_once()
        return out

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "fstat", fstat)
    tracemalloc.start()
    try:
        index = cache.load(model_file, identity)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert grown, "the entry was not looked at"
    assert index is None and cache.rejected == 1
    assert peak < 2**20, f"{peak:,} bytes allocated to read a {cache.max_nbytes:,}-byte entry"


def _header_span(raw: bytes) -> tuple[int, int]:
    """Where the JSON header is in an entry (its start found by its first key)."""
    hlen = int.from_bytes(raw[len(MAGIC):len(MAGIC) + 8], "little")
    start = raw.index(b'{"version"')
    return start, start + hlen


def _with_header(raw: bytes, header: bytes) -> bytes:
    """``raw`` with another header: its length field set, every other byte kept (the
    checksum too)."""
    start, end = _header_span(raw)
    return (raw[:len(MAGIC)] + len(header).to_bytes(8, "little") + raw[len(MAGIC) + 8:start]
            + header + raw[end:])


def test_a_hand_edited_header_is_a_miss(model_file, tmp_path):
    """The checksum covers the header: a dtype renamed in the string table, or two columns'
    spans swapped, is caught (they were read back as float16 and as other bytes)."""
    index = CheckpointIndex.from_checkpoint(cl.open(model_file))
    identity = identity_of(model_file)
    raw = encode_index(index, identity)
    start, end = _header_span(raw)
    assert raw[start:end].count(b'"float32"') == 1
    renamed = raw[:start] + raw[start:end].replace(b'"float32"', b'"float16"') + raw[end:]
    header = json.loads(raw[start:end])
    cols = header["columns"]
    cols["offset"], cols["part_nbytes"] = cols["part_nbytes"], cols["offset"]
    swapped = _with_header(raw, json.dumps(header, separators=(",", ":")).encode())
    for edited in (renamed, swapped):
        assert edited != raw
        with pytest.raises(InvalidArgumentError, match="SHA-256"):
            decode_index(edited, identity)
    cache = InspectionCache(tmp_path / "cache")
    entry = cache._entry_path(identity)
    entry.parent.mkdir(parents=True)
    entry.write_bytes(renamed)
    assert cache.load(model_file, identity) is None and cache.rejected == 1
    assert decode_index(raw, identity).to_dict() == index.to_dict()


def test_an_index_that_breaks_its_invariants_is_not_stored(model_file, tmp_path):
    index = CheckpointIndex.from_checkpoint(cl.open(model_file))
    fields = {f: getattr(index, f) for f in index.__dataclass_fields__}
    cache = InspectionCache(tmp_path / "cache")
    for change in ({"nbytes": (1, *index.nbytes[1:])}, {"offset": (5, *index.offset[1:])},
                   {"file": (-1, *index.file[1:])}, {"names": index.names[:-1]}):
        bad = CheckpointIndex(**{**fields, **change})
        with pytest.raises(InvalidArgumentError, match=r"index of .*m\.pt"):
            encode_index(bad, identity_of(model_file))
        assert not cache.store(model_file, bad)
    assert not list(cache.directory.rglob("*.ckix"))


def test_temporary_files_of_killed_writers_are_pruned_and_live_ones_counted(tmp_path):
    cache = InspectionCache(tmp_path / "cache", max_nbytes=700_000)
    sub = tmp_path / "cache" / f"v{CACHE_VERSION}"
    sub.mkdir(parents=True)
    now = time.time_ns()
    hour = 3600 * 10**9
    dead = _fill(sub / ".tmp-dead.ckix", 4 << 20, now - hour)  # killed an hour ago
    live = _fill(sub / ".tmp-live.ckix", 300_000, now)  # a writer at work
    oldest = _fill(sub / ("0" * 40 + ".ckix"), 300_000, now - 3 * hour)
    older = _fill(sub / ("1" * 40 + ".ckix"), 300_000, now - 2 * hour)
    model = tmp_path / "m.pt"
    model.write_bytes(b"x")
    assert cache.store(model, _empty_index(model))
    assert not dead.exists() and live.exists()
    # 300,000 (live) + 2 x 300,000 + the new entry > 700,000: the oldest entry goes
    assert not oldest.exists() and older.exists() and cache.load(model) is not None
    assert sum(p.stat().st_size for p in sub.iterdir()) <= cache.max_nbytes


def test_an_entry_removed_by_another_process_during_prune_is_skipped(tmp_path, monkeypatch):
    cache = InspectionCache(tmp_path / "cache", max_nbytes=500_000)
    sub = tmp_path / "cache" / f"v{CACHE_VERSION}"
    sub.mkdir(parents=True)
    now = time.time_ns()
    entries = [_fill(sub / (f"{i}" * 40 + ".ckix"), 400_000, now - (10 - i) * 10**9)
               for i in range(5)]
    gone = entries[2]
    real_stat, real_lstat = os.stat, os.lstat

    removed: list[int] = []

    def vanish(path: object) -> None:  # another prune removes it right after it was listed
        if not removed and os.fspath(path) == str(gone):
            removed.append(1)
            os.unlink(gone)

    def stat(path, *args, **kwargs):
        vanish(path)
        return real_stat(path, *args, **kwargs)

    def lstat(path, *args, **kwargs):
        vanish(path)
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "lstat", lstat)
    model = tmp_path / "m.pt"
    model.write_bytes(b"x")
    assert cache.store(model, _empty_index(model))
    monkeypatch.undo()
    assert removed, "the entry was not looked at"
    left = sorted(sub.iterdir())
    assert not gone.exists() and sum(p.stat().st_size for p in left) <= cache.max_nbytes
    assert entries[4] in left  # the most recently used of the old ones stays


def test_the_index_has_no_json_reader_left():
    """``from_dict`` read the version-1 (JSON) entries; nothing calls it any more."""
    assert not hasattr(CheckpointIndex, "from_dict")
    assert "JSON (" not in (CheckpointIndex.__doc__ or "")
