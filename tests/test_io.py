"""The direct-I/O layer (``ckptlab._io``) and the durable-file helpers (``ckptlab._io.durable``)
on real files: a ramfs that refuses O_DIRECT, a tiny tmpfs that fills up, RLIMIT_FSIZE, and
``os.pwrite`` / ``os.preadv`` wrapped to move a few bytes per call (short transfers)."""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import signal
from pathlib import Path
from typing import Any

import pytest

from ckptlab import _io
from ckptlab._io import durable
from ckptlab.errors import InvalidArgumentError, StorageIOError
from ckptlab.testing.memory import mapping_flags
from ckptlab.testing.mounts import mounted

BLOCK = 4096
_PWRITE, _PREADV = os.pwrite, os.preadv


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def accepts_direct(directory: Path) -> bool:
    fd = _io.open_direct(str(directory / ".probe"), os.O_RDWR | os.O_CREAT)
    if fd >= 0:
        os.close(fd)
    (directory / ".probe").unlink(missing_ok=True)
    return fd >= 0


def test_alignment_arithmetic() -> None:
    assert _io.BLOCK == BLOCK
    assert [_io.align_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    assert [_io.align_down(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 0, 0, 4096, 4096]
    assert _io.align_up(5, 8) == 8 and _io.align_down(15, 8) == 8


def test_aligned_buffer_is_page_aligned_writable_and_zeroed() -> None:
    for n in (1, 4096, 5000, 1 << 20):
        buf = _io.aligned_buffer(n)
        assert len(buf) == n and _io.address_of(buf) % BLOCK == 0
        assert bytes(buf[:16]) == bytes(min(n, 16))
        buf[0] = 7
        assert buf[0] == 7
    with pytest.raises(InvalidArgumentError, match="positive"):
        _io.aligned_buffer(0)


@pytest.mark.skipif(mapping_flags(id(object())) is None, reason="no /proc/self/smaps here")
def test_aligned_buffer_is_private_and_huge_pages_only_on_request() -> None:
    """Private memory (Python's ``mmap(-1, n)`` alone would be shared shmem), advised for
    transparent huge pages only when asked and only from 2 MiB: read from the kernel's
    VmFlags of the mapping."""
    for n, huge, advised in ((4 << 20, True, True), (4 << 20, False, False),
                             (_io.HUGE_PAGE - 1, True, False)):
        buf = _io.aligned_buffer(n, huge_pages=huge)
        flags = mapping_flags(_io.address_of(buf))
        assert flags is not None and "sh" not in flags, flags
        assert ("hg" in flags) == advised, (n, huge, flags)
        buf[n - 1] = 1
        assert buf[n - 1] == 1 and address_aligned(buf)


def address_aligned(buf: memoryview) -> bool:
    return _io.address_of(buf) % BLOCK == 0


def test_address_of_read_only_and_empty_views() -> None:
    data = b"abcdef"
    assert _io.address_of(memoryview(data)) != 0
    assert _io.address_of(memoryview(data)[2:]) == _io.address_of(memoryview(data)) + 2
    assert _io.address_of(memoryview(b"")) == 0


def test_copy_bytes_copies_and_refuses_mismatched_sizes() -> None:
    src = memoryview(os.urandom(100_000))
    dst = memoryview(bytearray(100_000))
    _io.copy_bytes(dst, src)
    assert bytes(dst) == bytes(src)
    _io.copy_bytes(dst[:0], src[:0])  # empty: nothing to do
    with pytest.raises(InvalidArgumentError, match="expected 10 bytes, got 11"):
        _io.copy_bytes(dst[:10], src[:11])


def test_populate_faults_in_whole_pages_only() -> None:
    buf = _io.aligned_buffer(8 * BLOCK)
    assert _io.populate(_io.address_of(buf), len(buf)) is True
    assert _io.populate(_io.address_of(buf) + 1, BLOCK) is False  # no whole page inside


def test_refused_tells_einval_from_real_errors() -> None:
    assert _io.refused(OSError(errno.EINVAL, "Invalid argument"))
    assert not _io.refused(OSError(errno.EIO, "I/O error"))
    assert not _io.refused(StorageIOError("x", path="p", offset=0, nbytes=0,
                                          errno=errno.EINVAL))
    assert not _io.refused(ValueError("EINVAL"))


def test_open_and_enable_direct_where_the_filesystem_accepts_it(tmp_path: Path) -> None:
    if not accepts_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    fd = _io.open_direct(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
    try:
        assert is_direct(fd)
    finally:
        os.close(fd)
    fd = os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert not is_direct(fd)
        assert _io.enable_direct(fd) is True and is_direct(fd)
        _io.disable_direct(fd, str(tmp_path / "g"))
        assert not is_direct(fd)
    finally:
        os.close(fd)


def test_a_filesystem_that_refuses_o_direct_falls_back(tmp_path: Path) -> None:
    """ramfs refuses O_DIRECT at open with EINVAL: open_direct says -1, enable_direct False,
    and buffered writes there still work."""
    with mounted("ramfs", tmp_path / "ramfs") as d:
        path = str(d / "f")
        assert _io.open_direct(path, os.O_RDWR | os.O_CREAT) == -1
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            assert _io.enable_direct(fd) is False and not is_direct(fd)
            _io.pwrite_all(fd, memoryview(b"x" * 5000), 0, path)
            out = memoryview(bytearray(5000))
            _io.pread_all(fd, out, 0, path)
            assert bytes(out) == b"x" * 5000
        finally:
            os.close(fd)


def test_open_direct_reports_other_failures(tmp_path: Path) -> None:
    missing = str(tmp_path / "no" / "such")
    with pytest.raises(StorageIOError, match="cannot open with O_DIRECT") as info:
        _io.open_direct(missing, os.O_RDONLY)
    assert info.value.errno == errno.ENOENT and info.value.path == missing


def test_short_writes_and_reads_are_completed(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"pwrite": 0, "preadv": 0}

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls["pwrite"] += 1
        return _PWRITE(fd, memoryview(data)[:777], offset)

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        calls["preadv"] += 1
        return _PREADV(fd, [memoryview(buffers[0])[:555]], offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "preadv", preadv)
    payload = os.urandom(10_000)
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _io.pwrite_all(fd, memoryview(payload), 100, path)
        out = memoryview(bytearray(10_000))
        _io.pread_all(fd, out, 100, path)
    finally:
        os.close(fd)
    assert bytes(out) == payload
    assert calls == {"pwrite": -(-10_000 // 777), "preadv": -(-10_000 // 555)}
    assert Path(path).read_bytes()[100:] == payload


def test_a_write_that_makes_no_progress_is_an_error(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(StorageIOError, match="no progress") as info:
            _io.pwrite_all(fd, memoryview(b"abc"), 8, path)
    finally:
        os.close(fd)
    assert (info.value.path, info.value.offset, info.value.nbytes) == (path, 8, 3)


def test_reading_past_the_end(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"z" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(StorageIOError, match="file ends before the payload") as info:
            _io.pread_all(fd, memoryview(bytearray(150)), 0, str(path))
        assert (info.value.offset, info.value.nbytes) == (100, 50)
        _io.check_inside(fd, 0, 100, str(path))
        with pytest.raises(StorageIOError, match="read past the end of the file"):
            _io.check_inside(fd, 50, 51, str(path))
    finally:
        os.close(fd)


def test_a_full_disk_raises_enospc_naming_the_bytes(tmp_path: Path) -> None:
    with mounted("tmpfs", tmp_path / "tiny", "size=64k") as d:
        path = str(d / "f")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with pytest.raises(StorageIOError, match="write failed") as info:
                _io.pwrite_all(fd, memoryview(bytes(256 << 10)), 0, path)
        finally:
            os.close(fd)
    assert info.value.errno == errno.ENOSPC and info.value.path == path
    assert 0 <= info.value.offset <= 64 << 10 and info.value.offset + info.value.nbytes == 256 << 10


def test_a_file_size_limit_raises_efbig(tmp_path: Path) -> None:
    path = str(tmp_path / "f")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 * BLOCK, hard))
        try:
            with pytest.raises(StorageIOError) as info:
                _io.pwrite_all(fd, memoryview(bytes(5 * BLOCK)), 0, path)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    finally:
        os.close(fd)
        signal.signal(signal.SIGXFSZ, old)
    # the first write is cut short at the limit, the next one fails: the error names the rest
    assert info.value.errno == errno.EFBIG
    assert (info.value.offset, info.value.nbytes) == (3 * BLOCK, 2 * BLOCK)
    assert os.path.getsize(path) == 3 * BLOCK


def test_raw_mode_hands_the_os_error_over(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fd: int, *args: Any) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refuse)
    monkeypatch.setattr(os, "preadv", refuse)
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as info:
            _io.pwrite_all(fd, memoryview(b"a"), 0, path, raw=True)
        assert _io.refused(info.value)
        with pytest.raises(OSError) as info:
            _io.pread_all(fd, memoryview(bytearray(1)), 0, path, raw=True)
        assert _io.refused(info.value)
        with pytest.raises(StorageIOError, match="read failed"):
            _io.pread_all(fd, memoryview(bytearray(1)), 0, path)
    finally:
        os.close(fd)


# -- durable files -----------------------------------------------------------------------------
def test_write_metadata_replaces_atomically(tmp_path: Path) -> None:
    seen = []
    final = durable.write_metadata(tmp_path, b"one")
    assert final == tmp_path / durable.METADATA and final.read_bytes() == b"one"
    durable.write_metadata(tmp_path, b"two", before_rename=lambda: seen.append(
        (final.read_bytes(), (tmp_path / ".metadata.tmp").read_bytes())))
    assert seen == [(b"one", b"two")] and final.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata"]


def test_write_metadata_removes_a_stale_temporary_and_refuses_links(tmp_path: Path) -> None:
    (tmp_path / "m.tmp").write_bytes(b"left by a killed writer")
    durable.write_metadata(tmp_path, b"new", "m", sync=False)
    assert (tmp_path / "m").read_bytes() == b"new" and not (tmp_path / "m.tmp").exists()
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "m2").symlink_to(target)
    with pytest.raises(StorageIOError, match="symbolic link") as info:
        durable.write_metadata(tmp_path, b"x", "m2")
    assert info.value.errno == errno.ELOOP and target.read_bytes() == b"keep"


def test_write_metadata_failure_leaves_no_temporary(tmp_path: Path) -> None:
    def boom() -> None:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(StorageIOError, match="Input/output error"):
        durable.write_metadata(tmp_path, b"x", before_rename=boom)
    assert list(tmp_path.iterdir()) == []


def test_new_files_and_small_reads(tmp_path: Path) -> None:
    path = tmp_path / "marker"
    durable.write_new_file(path, b"ok", sync=True)
    assert durable.read_small(path) == b"ok"
    with pytest.raises(FileExistsError):
        durable.write_new_file(path, b"again", sync=False)
    link = tmp_path / "link"
    link.symlink_to(path)
    assert durable.read_small(link) is None  # never through a link
    with pytest.raises(OSError) as info:
        durable.write_new_file(link, b"x", sync=False)
    assert info.value.errno == errno.EEXIST and path.read_bytes() == b"ok"
    assert durable.read_small(tmp_path / "missing") is None
    durable.fsync_dir(tmp_path)


def test_new_file_reports_its_creation_once(tmp_path: Path) -> None:
    calls: list[bool] = []
    path = tmp_path / "f"
    durable.write_new_file(path, b"abc", sync=False,
                           on_created=lambda: calls.append(path.exists()))
    assert calls == [True] and path.read_bytes() == b"abc"
    with pytest.raises(FileExistsError):  # not created: not reported
        durable.write_new_file(path, b"x", sync=False, on_created=lambda: calls.append(False))
    assert calls == [True] and path.read_bytes() == b"abc"


def test_write_metadata_failed_write_removes_its_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def short_then_full(fd: int, data: Any) -> int:  # one byte goes in, then the disk is full
        if os.fstat(fd).st_size:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data[:1]))

    durable.write_metadata(tmp_path, b"old")
    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(StorageIOError, match="could not write the metadata \\(3 bytes\\): "
                       "No space left on device") as info:
        durable.write_metadata(tmp_path, b"new")
    assert info.value.errno == errno.ENOSPC and info.value.nbytes == 3
    assert info.value.path == str(tmp_path / durable.METADATA)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata"]
    assert (tmp_path / ".metadata").read_bytes() == b"old"


def test_write_metadata_never_removes_a_temporary_it_did_not_create(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open
    tmp = str(tmp_path / ".metadata.tmp")

    def raced(path: Any, flags: int, *args: Any) -> int:  # another writer got there first
        if os.fspath(path) == tmp and flags & os.O_EXCL:
            Path(tmp).write_bytes(b"theirs")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", raced)
    with pytest.raises(StorageIOError, match="File exists") as info:
        durable.write_metadata(tmp_path, b"mine")
    assert info.value.errno == errno.EEXIST
    assert Path(tmp).read_bytes() == b"theirs" and not (tmp_path / ".metadata").exists()


def test_plan_cache_keeps_its_durable_names() -> None:
    from ckptlab.plan import cache, write_metadata

    assert write_metadata is durable.write_metadata and cache.fsync_dir is durable.fsync_dir
