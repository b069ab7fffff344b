"""AsyncWriter failures: a worker that raises, a full disk (injected and real), a failed commit,
a process killed with SIGKILL mid-save, a failing rank. Each surfaces as WriterError with the
real error, commits no .metadata, and leaves the previous checkpoint alone."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import async_workers
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptlab.errors import StorageIOError, WriterError
from ckptlab.plan import run_ranks
from ckptlab.write import AsyncWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture
def previous(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A committed checkpoint next to the one each test breaks."""
    path = tmp_path / "step_1"
    with AsyncWriter(path) as writer:
        dcp.save(async_workers.mixed_state(5), storage_writer=writer, no_dist=True)
        writer.wait()
    return path, _digest(path)


def _assert_previous_intact(previous: tuple[Path, dict[str, str]]) -> None:
    path, digest = previous
    assert _digest(path) == digest
    want = async_workers.mixed_state(5)
    target = async_workers.zeros_like_state(want)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(target["model"]["big"], want["model"]["big"])


def _assert_nothing_committed(path: Path) -> None:
    assert not (path / ".metadata").exists()
    assert not (path / ".metadata.tmp").exists()


def test_worker_exception_surfaces_with_its_real_error(tmp_path: Path, previous) -> None:
    def boom(bucket, phase, file, offset, nbytes):
        if bucket == 1 and phase == "write":
            raise RuntimeError("injected worker failure")

    path = tmp_path / "step_2"
    writer = AsyncWriter(path, io_hook=boom)
    dcp.save(async_workers.mixed_state(), storage_writer=writer, no_dist=True)
    with pytest.raises(WriterError, match="injected worker failure") as info:
        writer.wait()
    err = info.value
    assert list(err.failures) == ["rank 0 bucket 1 (__0_1.distcp)"]
    assert isinstance(err.failures["rank 0 bucket 1 (__0_1.distcp)"], RuntimeError)
    assert "no .metadata was written" in str(err) and str(path) in str(err)
    assert writer.last.timeline.error is not None and not writer.last.timeline.committed
    _assert_nothing_committed(path)
    _assert_previous_intact(previous)
    # the workers survive a failed job: the next save on the same writer works
    writer.io_hook = None
    dcp.save(async_workers.mixed_state(), checkpoint_id=str(tmp_path / "step_3"),
             storage_writer=writer, no_dist=True)
    assert writer.wait().committed
    writer.close()


def test_injected_enospc_names_file_bucket_and_offset(tmp_path: Path, previous) -> None:
    def full(bucket, phase, file, offset, nbytes):
        if bucket == 0 and phase == "write" and offset >= 4096:
            raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "step_2"
    with AsyncWriter(path, io_hook=full) as writer:
        dcp.save(async_workers.mixed_state(), storage_writer=writer, no_dist=True)
        with pytest.raises(WriterError) as info:
            writer.wait()
        (cause,) = info.value.failures.values()
        assert isinstance(cause, StorageIOError) and cause.errno == errno.ENOSPC
        assert cause.path == str(path / "__0_0.distcp") and cause.offset >= 4096
        assert "No space left on device" in str(info.value) and "bucket 0" in str(info.value)
        assert info.value.__cause__ is cause
    _assert_nothing_committed(path)
    _assert_previous_intact(previous)


def test_failed_commit_leaves_no_metadata(tmp_path: Path, previous) -> None:
    def no_commit(bucket, phase, file, offset, nbytes):
        if phase == "commit":
            raise OSError(errno.EIO, "Input/output error")

    path = tmp_path / "step_2"
    with AsyncWriter(path, io_hook=no_commit) as writer:
        dcp.save(async_workers.mixed_state(), storage_writer=writer, no_dist=True)
        with pytest.raises(WriterError, match="Input/output error") as info:
            writer.wait()
    assert list(info.value.failures) == ["commit"]
    _assert_nothing_committed(path)
    _assert_previous_intact(previous)


def test_an_unwaited_failure_is_raised_by_the_next_save(tmp_path: Path) -> None:
    def boom(bucket, phase, file, offset, nbytes):
        if phase == "fsync":
            raise OSError(errno.EIO, "fsync failed for real")

    writer = AsyncWriter(tmp_path / "a", io_hook=boom)
    dcp.save(async_workers.mixed_state(), storage_writer=writer, no_dist=True)
    writer.io_hook = None
    with pytest.raises(WriterError, match="previous save failed and nobody called wait"):
        dcp.save(async_workers.mixed_state(), checkpoint_id=str(tmp_path / "b"),
                 storage_writer=writer, no_dist=True)
    # reported once: the retry goes through
    dcp.save(async_workers.mixed_state(), checkpoint_id=str(tmp_path / "b"),
             storage_writer=writer, no_dist=True)
    assert writer.wait().committed
    writer.close()
    _assert_nothing_committed(tmp_path / "a")


def test_async_save_future_raises_writer_error(tmp_path: Path) -> None:
    def full(bucket, phase, file, offset, nbytes):
        if phase == "write":
            raise OSError(errno.ENOSPC, "No space left on device")

    with AsyncWriter(tmp_path / "a", io_hook=full) as writer:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fut = async_workers.single_process_async_save(async_workers.mixed_state(), writer)
        # finish() raises inside dcp.save, which wraps it in a CheckpointException
        from torch.distributed.checkpoint.api import CheckpointException

        with pytest.raises(CheckpointException) as info:
            fut.result(timeout=60)
        cause = info.value.failures[0][0]
        assert isinstance(cause, WriterError) and "No space left" in str(cause)
        with pytest.raises(WriterError):  # already reported, still the outcome of that save
            writer.wait()
    _assert_nothing_committed(tmp_path / "a")


def test_real_enospc_on_a_tiny_filesystem(tiny_fs: Path) -> None:
    prev = tiny_fs / "small"
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    with AsyncWriter(prev) as writer:
        dcp.save(small, storage_writer=writer, no_dist=True)
        writer.wait()
    digest = _digest(prev)
    big = {"w": torch.randn(1024, 1024), "v": torch.randn(1024, 1024)}  # 8 MiB > 3 MiB
    path = tiny_fs / "big"
    with AsyncWriter(path) as writer:
        dcp.save(big, storage_writer=writer, no_dist=True)
        with pytest.raises(WriterError, match="No space left on device") as info:
            writer.wait()
    causes = [c for c in info.value.failures.values() if isinstance(c, OSError)]
    assert causes and all(c.errno == errno.ENOSPC for c in causes)
    _assert_nothing_committed(path)
    assert _digest(prev) == digest
    target = {"w": torch.zeros(1000)}
    dcp.load(target, checkpoint_id=str(prev), no_dist=True)
    assert torch.equal(target["w"], small["w"])


def test_sigkill_mid_write_commits_nothing(tmp_path: Path, previous) -> None:
    path = tmp_path / "step_2"
    code = textwrap.dedent(f"""
        import sys, time, warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed.checkpoint as dcp
        from ckptlab.write import AsyncWriter
        def slow(bucket, phase, file, offset, nbytes):
            if phase == "write" and offset > 0:
                time.sleep(120)
        writer = AsyncWriter({str(path)!r}, io_hook=slow)
        dcp.save({{"w": torch.randn(1024, 1024), "step": 3}}, storage_writer=writer,
                 no_dist=True)
        print("RETURNED", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "RETURNED"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert any(p.suffix == ".distcp" for p in path.iterdir())  # it had started writing
    _assert_nothing_committed(path)
    _assert_previous_intact(previous)


@pytest.mark.slow  # 26 s: spawns two ranks
def test_a_failing_rank_fails_the_whole_save(tmp_path: Path) -> None:
    path = tmp_path / "sharded"
    out = run_ranks(async_workers.save_sharded_failing, 2, str(path), timeout=180)
    assert "rank 1" in out[0]["error"] and "No space left on device" in out[0]["error"]
    assert "rank 1" in out[0]["failures"]
    assert "No space left on device" in out[1]["error"]
    _assert_nothing_committed(path)


def test_a_copy_that_fails_midway_stops_the_workers(tmp_path: Path) -> None:
    """The workers start on the first items while the rest are copied; if a later copy
    fails, they stop, nothing is committed, and the writer stays usable."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class MetaPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if write_item.index.fqn == "model.ids":  # a small item: copied last
                return torch.empty(data.shape, dtype=data.dtype, device="meta")
            return data

    path = tmp_path / "a"
    writer = AsyncWriter(path)
    with pytest.raises(CheckpointException):
        dcp.save(async_workers.mixed_state(), storage_writer=writer, planner=MetaPlanner(),
                 no_dist=True)
    _assert_nothing_committed(path)
    state = async_workers.mixed_state(2)
    dcp.save(state, checkpoint_id=str(tmp_path / "b"), storage_writer=writer, no_dist=True)
    assert writer.wait().committed
    writer.close()
    target = async_workers.zeros_like_state(state)
    dcp.load(target, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    assert torch.equal(target["model"]["big"], state["model"]["big"])
