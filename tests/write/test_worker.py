"""The workers (``ckptlab.write._worker``): a data file written with aligned writes, O_DIRECT
where the filesystem takes it, buffered where it refuses (at open on a ramfs, or at the first
write), and real errors (a full disk, a name that exists or is a link) reported per bucket."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptlab._io import aligned_buffer
from ckptlab.errors import StorageIOError
from ckptlab.testing.mounts import mounted
from ckptlab.write._placement import Extent, FileJob
from ckptlab.write._staging import StagingState
from ckptlab.write._worker import DIRECT_MIN_NBYTES, FileWriter, WorkerPool
from ckptlab.write.timeline import _Recorder

_PWRITE = os.pwrite


def job_in(directory: Path, *, big: int = 2 * DIRECT_MIN_NBYTES + 100,
           ready: threading.Event | None = None,
           staging: StagingState | None = None) -> tuple[FileJob, bytes]:
    """A file of a small header, an aligned tensor body from page-aligned memory, a tail."""
    rng = np.random.default_rng(0)
    data = aligned_buffer(big)
    data[:] = rng.integers(0, 256, big, dtype=np.uint8).tobytes()
    head, tail = b"H" * 300, b"T" * 77
    segs = (Extent(0, head), Extent(4096, data, data=True, ready=ready),
            Extent(4096 + big, tail))
    expected = head + bytes(4096 - 300) + bytes(data) + tail
    return FileJob(0, str(directory / "__0_0.distcp"), "__0_0.distcp", segs, len(expected),
                   staging), expected


def run(job: FileJob, **kw: Any) -> FileWriter:
    writer = FileWriter(job, memoryview(mmap.mmap(-1, 1 << 20)), recorder=_Recorder("d", 0),
                        hook=kw.pop("hook", None), direct=kw.pop("direct", True),
                        sync=kw.pop("sync", True), **kw)
    writer.run()
    return writer


def direct_accepted(directory: Path) -> bool:
    try:
        fd = os.open(directory / ".probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    (directory / ".probe").unlink()
    return True


def test_a_file_is_written_whole_with_o_direct(tmp_path: Path) -> None:
    if not direct_accepted(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    job, expected = job_in(tmp_path)
    created: dict[str, tuple[int, int]] = {}
    writer = run(job, created=created)
    assert writer.io_path == "O_DIRECT"
    assert Path(job.path).read_bytes() == expected
    st = os.stat(job.path)
    assert created == {job.name: (st.st_dev, st.st_ino)}
    assert writer.written == -(-len(expected) // 4096) * 4096  # whole blocks, then truncated
    phases = [e.phase for e in writer.recorder.events]
    assert phases[0] == "open" and "fsync" in phases and phases[-1] == "close"


def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(tmp_path: Path) -> None:
    with mounted("ramfs", tmp_path / "ramfs") as d:
        job, expected = job_in(d)
        writer = run(job)
        assert writer.io_path == "POSIX" and Path(job.path).read_bytes() == expected
        assert writer.recorder.files[0][2] == "POSIX"


def test_einval_at_the_first_write_drops_o_direct_on_the_same_descriptor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not direct_accepted(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    refused = []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return _PWRITE(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    job, expected = job_in(tmp_path)
    writer = run(job)
    assert refused == [0] and writer.io_path == "POSIX"
    assert Path(job.path).read_bytes() == expected


def test_a_real_io_error_is_not_mistaken_for_a_refusal(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def pwrite(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", pwrite)
    job, _ = job_in(tmp_path)
    with pytest.raises(StorageIOError, match="bucket 0: write failed: Input/output error") as info:
        run(job)
    assert info.value.errno == errno.EIO and info.value.path == job.path


def test_a_full_disk_fails_the_bucket_with_enospc(tmp_path: Path) -> None:
    with mounted("tmpfs", tmp_path / "tiny", "size=1m") as d:
        job, _ = job_in(d)
        with pytest.raises(StorageIOError, match="No space left on device") as info:
            run(job)
    assert info.value.errno == errno.ENOSPC and "bucket 0" in str(info.value)


def test_an_existing_file_or_a_link_is_never_written(tmp_path: Path) -> None:
    job, _ = job_in(tmp_path)
    Path(job.path).write_bytes(b"old")
    with pytest.raises(StorageIOError, match="already exists") as info:
        run(job)
    assert info.value.errno == errno.EEXIST and Path(job.path).read_bytes() == b"old"
    os.unlink(job.path)
    target = tmp_path / "elsewhere"
    os.symlink(target, job.path)
    with pytest.raises(StorageIOError, match="symbolic link") as info:
        run(job)
    assert info.value.errno == errno.ELOOP and not target.exists()


def test_a_failed_staging_stops_the_worker(tmp_path: Path) -> None:
    staging = StagingState()
    ready = staging.event()
    job, _ = job_in(tmp_path, ready=ready, staging=staging)
    staging.abort(RuntimeError("the copy failed"))
    with pytest.raises(RuntimeError, match="staging failed"):
        run(job)


def test_a_worker_writes_nothing_before_the_whole_copy_is_done(tmp_path: Path) -> None:
    """Its own item copied is not enough: the worker opens its file, then waits for every
    item of the save (O_DIRECT writes beside the copy slow the copy the caller waits on)."""
    staging = StagingState()
    own, other = staging.event(), staging.event()
    job, expected = job_in(tmp_path, ready=own, staging=staging)
    own.set()
    opened, phases = threading.Event(), []

    def hook(bucket: int | None, phase: str, file: str, offset: int, nbytes: int) -> None:
        phases.append(phase)
        if phase == "open":
            opened.set()

    done: list[FileWriter] = []
    worker = threading.Thread(target=lambda: done.append(run(job, hook=hook)))
    worker.start()
    try:
        assert opened.wait(60)
        worker.join(0.5)  # the failure this detects: writes that do not wait
        assert worker.is_alive() and phases == ["open"] and not done
    finally:
        other.set()
        worker.join(60)
    assert done and "write" in phases and Path(job.path).read_bytes() == expected


def test_hooks_see_every_step_and_can_fail_it(tmp_path: Path) -> None:
    seen = []

    def hook(bucket: int | None, phase: str, file: str, offset: int, nbytes: int) -> None:
        seen.append((bucket, phase, offset))
        if phase == "fsync":
            raise OSError(errno.EIO, "Input/output error")

    job, _ = job_in(tmp_path)
    with pytest.raises(StorageIOError, match="fsync failed"):
        run(job, hook=hook)
    assert seen[0] == (0, "open", 0) and seen[-1][1] == "fsync"
    assert next(o for _, p, o in seen if p == "write") == 0


def test_the_pool_runs_jobs_on_persistent_threads_and_reports_errors() -> None:
    pool = WorkerPool(2)
    try:
        sizes = [pool.submit(lambda bounce: len(bounce)).result() for _ in range(4)]
        assert sizes == [8 << 20] * 4 and pool.alive == 2

        def fail(bounce: memoryview) -> None:
            raise ValueError("job failed")

        with pytest.raises(ValueError, match="job failed"):
            pool.submit(fail).result()
        assert pool.alive == 2  # a worker never dies of a job
    finally:
        pool.close()
    assert pool.alive == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda bounce: None)
