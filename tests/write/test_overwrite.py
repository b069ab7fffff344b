"""Saving over a committed checkpoint never loses it, and the writer never follows a link.

A save into a directory that holds a checkpoint writes the next generation's file names,
renames ``.metadata`` over the old one, and only then removes the old files. Killed with
SIGKILL at random moments, failing on a full disk, or meeting a symbolic link where it would
write, the directory always holds the old checkpoint or the new one, loadable by stock
``dcp.load``, bit for bit.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import async_workers
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptlab.errors import StorageIOError, WriterError
from ckptlab.plan import write_metadata
from ckptlab.write import AsyncWriter
from ckptlab.write.writer import DATA_NAME

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KILLS = 60
MAX_HOOK_SLEEP_S = 0.01  # each I/O hook sleeps up to this: spreads a save over its phases


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _save(path: Path, state: dict[str, Any], **kwargs: Any) -> None:
    with AsyncWriter(path, **kwargs) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        writer.wait()


def _same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.detach().contiguous().reshape(-1).view(torch.uint8),
            b.detach().contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    """Stock dcp.load (FileSystemReader) into a zeroed copy of ``like``'s structure."""
    target = async_workers.zeros_like_state(like)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


def _which(path: Path, old: dict[str, Any], new: dict[str, Any]) -> str:
    """'old', 'new', 'torn' (loads, but is neither exactly) or 'lost' (does not load)."""
    try:
        got = _load(path, old)
    except (Exception, CheckpointException):  # DCP's derives from BaseException
        return "lost"
    if _same_bits(got, old):
        return "old"
    if _same_bits(got, new):
        return "new"
    return "torn"


def _generations(path: Path) -> set[int]:
    return {int(m.group(1) or 0) for n in os.listdir(path) if (m := DATA_NAME.match(n))}


class _ForkServer:
    """A Python with torch imported once, forking one child per save (tests/write/
    async_workers.serve_saves): 60 kills cost 60 forks, not 60 torch imports."""

    def __init__(self, path: Path, log: Path) -> None:
        self._log = open(log, "w")  # closed in close()
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import async_workers; async_workers.serve_saves({str(path)!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        assert self._ask(None) == "READY"

    def _ask(self, line: str | None) -> str:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer, f"the fork server died; see {self._log.name}"
        return answer

    def start(self, seed: int, hook_seed: int, phases: Path,
              max_sleep_s: float = MAX_HOOK_SLEEP_S) -> int:
        return int(self._ask(f"save {seed} {hook_seed} {phases} {max_sleep_s}"))

    def reap(self, pid: int) -> int:
        return int(self._ask(f"reap {pid}"))

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()


@pytest.fixture
def fork_server(tmp_path: Path):
    server = _ForkServer(tmp_path / "ckpt", tmp_path / "fork_server.log")
    try:
        yield server
    finally:
        server.close()


def _run_to_end(server: _ForkServer, seed: int, phases: Path) -> float:
    t0 = time.monotonic()
    status = server.reap(server.start(seed, seed, phases))
    assert os.waitstatus_to_exitcode(status) == 0, (phases.read_text(), status)
    return time.monotonic() - t0


@pytest.mark.slow  # about 15-25 s on 2 cores, fork server start included
def test_sigkill_at_random_moments_never_loses_the_old_checkpoint(
        tmp_path: Path, fork_server: _ForkServer) -> None:
    """KILLS saves of a different state dict over a committed checkpoint, each killed with
    SIGKILL after a random delay: stock dcp.load must give exactly the old state dict or
    exactly the new one every time. Kills land in every phase: before any file is opened,
    while data files are written and fsynced, while .metadata.tmp is written, between its
    fsync and the rename, while old files are removed, or after the save ended. Each save
    starts over what the killed ones left (stale data files, a stale .metadata.tmp)."""
    path = tmp_path / "ckpt"
    phases = tmp_path / "phases"
    _save(path, async_workers.kill_state(0))
    # the time a whole save takes here, from fork to exit (the median of four)
    span_s = sorted(_run_to_end(fork_server, seed, phases) for seed in (1, 2, 3, 4))[2]
    assert _which(path, async_workers.kill_state(3), async_workers.kill_state(4)) == "new"
    current = 4
    rng = random.Random(15)
    outcomes: collections.Counter[str] = collections.Counter()
    landed: collections.Counter[str] = collections.Counter()  # phase -> kills
    by_phase: collections.Counter[tuple[str, str]] = collections.Counter()
    for i in range(KILLS):
        seed = 100 + i
        old, new = async_workers.kill_state(current), async_workers.kill_state(seed)
        phases.write_text("")  # a child killed before it opens the file notes nothing
        pid = fork_server.start(seed, rng.randrange(1 << 30), phases)
        time.sleep(rng.uniform(0.0, span_s))
        os.kill(pid, signal.SIGKILL)  # a child that already ended is a zombie until reaped
        status = fork_server.reap(pid)
        killed = os.WIFSIGNALED(status)
        assert killed or os.waitstatus_to_exitcode(status) == 0, \
            f"save {i} failed on its own (stale files blocked it?): {phases.read_text()}"
        noted = phases.read_text().split()
        phase = (noted[-1] if noted else "fork") if killed else "finished"
        landed[phase] += 1
        outcome = _which(path, old, new)
        outcomes[outcome] += 1
        by_phase[phase, outcome] += 1
        assert outcome in ("old", "new"), (i, outcome, noted, sorted(os.listdir(path)))
        if outcome == "new":
            current = seed
    print(f"\n{KILLS} kills over {span_s * 1000:.0f} ms: outcomes {dict(outcomes)}; "
          f"last phase entered when killed {dict(sorted(landed.items()))}; "
          f"(phase, outcome) {dict(sorted(by_phase.items()))}")
    assert outcomes["lost"] == 0 and outcomes["torn"] == 0
    assert outcomes["old"] > 0 and outcomes["new"] > 0  # kills landed before and after
    assert len(landed) >= 4  # and in several phases
    # one save to the end removes everything the killed ones left
    _run_to_end(fork_server, 999, phases)
    names = sorted(os.listdir(path))
    (generation,) = _generations(path)
    assert names == [".metadata"] + sorted(n for n in names if DATA_NAME.match(n))
    assert _same_bits(_load(path, async_workers.kill_state(999)), async_workers.kill_state(999))
    assert generation > 1


def test_stale_files_of_a_killed_save_do_not_block_the_next(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, async_workers.kill_state(0))
    (path / ".metadata.tmp").write_bytes(b"half a pickle")
    (path / "g7__0_0.distcp").write_bytes(b"x" * 5000)  # a killed save's generation 7
    (path / "g7__0_1.distcp").write_bytes(b"")
    state = async_workers.kill_state(1)
    _save(path, state)
    assert sorted(os.listdir(path)) == [".metadata", "g8__0_0.distcp", "g8__0_1.distcp"]
    assert _same_bits(_load(path, state), state)


def test_a_failed_save_over_a_checkpoint_leaves_it_byte_for_byte(tmp_path: Path) -> None:
    """Injected ENOSPC on the second write of bucket 1: WriterError, the old checkpoint
    loads, and the files the failed save created are gone again."""
    path = tmp_path / "ckpt"
    old = async_workers.mixed_state(5)
    _save(path, old)
    before = _digest(path)

    def full(bucket, phase, file, offset, nbytes):
        if bucket == 1 and phase == "write":
            raise OSError(errno.ENOSPC, "No space left on device")

    with AsyncWriter(path, io_hook=full) as writer:
        dcp.save(async_workers.mixed_state(6), storage_writer=writer, no_dist=True)
        with pytest.raises(WriterError, match="No space left on device") as info:
            writer.wait()
    (cause,) = info.value.failures.values()
    assert isinstance(cause, StorageIOError) and cause.path == str(path / "g1__0_1.distcp")
    assert "still holds its previous checkpoint" in str(info.value)
    assert _digest(path) == before
    assert _same_bits(_load(path, old), old)


def test_real_enospc_over_a_checkpoint_on_a_tiny_filesystem(tiny_fs: Path) -> None:
    path = tiny_fs / "ckpt"
    small = {"w": torch.arange(100_000, dtype=torch.float32), "step": 1}  # 400 kB
    _save(path, small)
    before = _digest(path)
    big = {"w": torch.randn(1024, 1024), "v": torch.randn(1024, 1024), "step": 2}  # 8 MiB
    with AsyncWriter(path) as writer:
        dcp.save(big, storage_writer=writer, no_dist=True)
        with pytest.raises(WriterError, match="No space left on device") as info:
            writer.wait()
    causes = [c for c in info.value.failures.values() if isinstance(c, OSError)]
    assert causes and all(c.errno == errno.ENOSPC for c in causes)
    assert _digest(path) == before  # the partial new files were removed
    assert _same_bits(_load(path, small), small)
    # the space they took is free again: a save of the same size goes through
    again = {"w": torch.arange(100_000, dtype=torch.float32) + 1, "step": 3}
    _save(path, again)
    assert _same_bits(_load(path, again), again)
    assert _generations(path) == {1}  # the failed save's names were never committed: free


# -- symbolic links ------------------------------------------------------------------------
@pytest.fixture
def victim(tmp_path: Path) -> tuple[Path, bytes]:
    """A file outside the checkpoint that a link points at: it must never change."""
    target = tmp_path / "precious.bin"
    data = b"do not touch " * 1000
    target.write_bytes(data)
    return target, data


def _plan_error(info: pytest.ExceptionInfo[CheckpointException]) -> WriterError:
    cause = info.value.failures[0][0]  # DCP wraps what prepare_local_plan raises
    assert isinstance(cause, WriterError), cause
    return cause


def test_a_symlinked_data_file_name_is_refused(tmp_path: Path, victim) -> None:
    target, data = victim
    path = tmp_path / "ckpt"
    path.mkdir()
    link = path / "__0_0.distcp"  # the name a save into this directory would write
    link.symlink_to(target)
    with AsyncWriter(path) as writer, pytest.raises(CheckpointException) as info:
        dcp.save(async_workers.kill_state(1), storage_writer=writer, no_dist=True)
    err = _plan_error(info)
    assert str(link) in str(err) and "symbolic link" in str(err)
    assert target.read_bytes() == data and link.is_symlink()
    assert not (path / ".metadata").exists()


def test_a_data_file_name_symlinked_mid_save_is_refused(tmp_path: Path, victim) -> None:
    """The link appears between the directory scan and the open (a race): the open
    (O_CREAT | O_EXCL | O_NOFOLLOW) refuses it and the old checkpoint stays."""
    target, data = victim
    path = tmp_path / "ckpt"
    old = async_workers.kill_state(0)
    _save(path, old)

    def plant(bucket, phase, file, offset, nbytes):
        if phase == "open" and bucket == 0:
            os.symlink(target, path / file)

    with AsyncWriter(path, io_hook=plant) as writer:
        dcp.save(async_workers.kill_state(1), storage_writer=writer, no_dist=True)
        with pytest.raises(WriterError, match="symbolic link") as info:
            writer.wait()
    (cause,) = info.value.failures.values()
    assert isinstance(cause, StorageIOError) and cause.errno == errno.ELOOP
    assert cause.path == str(path / "g1__0_0.distcp") and cause.path in str(info.value)
    assert target.read_bytes() == data and (path / "g1__0_0.distcp").is_symlink()
    assert _same_bits(_load(path, old), old)


def test_a_symlinked_metadata_tmp_is_refused(tmp_path: Path, victim) -> None:
    target, data = victim
    path = tmp_path / "ckpt"
    old = async_workers.kill_state(0)
    _save(path, old)
    link = path / ".metadata.tmp"
    link.symlink_to(target)
    with AsyncWriter(path) as writer, pytest.raises(CheckpointException) as info:
        dcp.save(async_workers.kill_state(1), storage_writer=writer, no_dist=True)
    err = _plan_error(info)
    assert str(link) in str(err) and "symbolic link" in str(err)
    assert target.read_bytes() == data and link.is_symlink()
    assert _same_bits(_load(path, old), old)


def test_a_metadata_tmp_symlinked_mid_save_is_refused(tmp_path: Path, victim) -> None:
    target, data = victim
    path = tmp_path / "ckpt"
    old = async_workers.kill_state(0)
    _save(path, old)
    link = path / ".metadata.tmp"

    def plant(bucket, phase, file, offset, nbytes):
        if phase == "commit":
            link.symlink_to(target)

    with AsyncWriter(path, io_hook=plant) as writer:
        dcp.save(async_workers.kill_state(1), storage_writer=writer, no_dist=True)
        with pytest.raises(WriterError, match="symbolic link") as info:
            writer.wait()
    cause = info.value.failures["commit"]
    assert isinstance(cause, StorageIOError) and cause.errno == errno.ELOOP
    assert cause.path == str(link) and str(link) in str(info.value)
    assert target.read_bytes() == data and link.is_symlink()
    assert _same_bits(_load(path, old), old)
    # the failed save removed its files (the rename never happened); the link stays
    assert sorted(os.listdir(path)) == [".metadata", ".metadata.tmp", "__0_0.distcp",
                                        "__0_1.distcp"]
    link.unlink()
    new = async_workers.kill_state(2)
    _save(path, new)
    assert _same_bits(_load(path, new), new) and _generations(path) == {1}


def test_write_metadata_never_writes_through_a_link(tmp_path: Path, victim) -> None:
    target, data = victim
    (tmp_path / ".metadata.tmp").symlink_to(target)
    with pytest.raises(StorageIOError, match="symbolic link") as info:
        write_metadata(tmp_path, b"new metadata")
    assert info.value.errno == errno.ELOOP and info.value.path == str(tmp_path / ".metadata.tmp")
    (tmp_path / ".metadata.tmp").unlink()
    (tmp_path / ".metadata").symlink_to(target)
    with pytest.raises(StorageIOError, match="symbolic link"):
        write_metadata(tmp_path, b"new metadata")
    assert target.read_bytes() == data
    assert not (tmp_path / ".metadata.tmp").exists()
    (tmp_path / ".metadata").unlink()
    (tmp_path / ".metadata.tmp").write_bytes(b"stale")  # a killed writer's: replaced
    assert write_metadata(tmp_path, b"new metadata").read_bytes() == b"new metadata"
    assert sorted(os.listdir(tmp_path)) == [".metadata", "precious.bin"]
