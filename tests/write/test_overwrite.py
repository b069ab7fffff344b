"""Saving over a committed checkpoint never loses it, and the writer never follows a link.

A save into a directory that holds a checkpoint writes the next generation's file names,
renames ``.metadata`` over the old one, and only then removes the old files. Killed with
SIGKILL in every phase of the save, failing on a full disk, or meeting a symbolic link where
it would write, the directory always holds the old checkpoint or the new one, loadable by
stock ``dcp.load``, bit for bit.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import async_workers
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptlab.errors import StorageIOError, WriterError
from ckptlab.plan import write_metadata
from ckptlab.testing.kill_server import kill_state
from ckptlab.write import AsyncWriter
from ckptlab.write.writer import DATA_NAME

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


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
    """``python -m ckptlab.testing.kill_server``: a Python with torch imported once, forking
    one child per save, which kills itself at the step it is told: every kill costs a fork,
    not a torch import."""

    def __init__(self, path: Path, log: Path) -> None:
        self._log = open(log, "w")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptlab.testing.kill_server", str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        assert self._ask(None) == "READY"

    def _ask(self, line: str | None) -> str:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer, f"the fork server died; see {self._log.name}"
        return answer

    def save(self, seed: int, phases: Path, die_at: str = "-") -> int:
        """Save kill_state(seed) in a child that SIGKILLs itself on entering step ``die_at``
        (``-``: none; ``plan``; ``PHASE:J``); its wait status."""
        pid = int(self._ask(f"save {seed} {phases} {die_at}"))
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


def _run_to_end(server: _ForkServer, seed: int, phases: Path) -> list[str]:
    """A whole save in a child; the steps it went through (``plan``, the phases, ``done``)."""
    status = server.save(seed, phases)
    assert os.waitstatus_to_exitcode(status) == 0, (phases.read_text(), status)
    return phases.read_text().split()


def _kill_points(steps: list[str]) -> list[str]:
    """Where to stop saves: before the save, and at every step of each phase ``steps`` went
    through (a save here has ten: two opens, writes and fsyncs, a commit, a rename, two
    removes), or its first, its last and six spread ones where a phase has more than eight."""
    counts = collections.Counter(steps[1:-1])
    points = ["plan"]
    for phase, n in counts.items():
        picks = sorted({1, n, *(1 + (n - 1) * i // 7 for i in range(1, 7))})
        points += [f"{phase}:{j}" for j in picks]
    return points


# a kill at the step before the rename leaves the old checkpoint, one after it the new one
_OUTCOME = {"plan": "old", "open": "old", "write": "old", "fsync": "old", "commit": "old",
            "rename": "old", "remove": "new"}


def test_sigkill_at_every_phase_never_loses_the_old_checkpoint(
        tmp_path: Path, fork_server: _ForkServer) -> None:
    """Saves of a different state dict over a committed checkpoint, each stopped with SIGKILL
    by the saving process itself on entering a chosen I/O step (ckptlab.testing.kill_server):
    before the save, at each open, write and fsync of the data files (the other worker thread
    wherever it is then), before .metadata.tmp is written, between its fsync and the rename,
    and before each removal of an old file.
    Chosen steps, not moments: every phase is hit on every run, and each kill's outcome is
    known: stock dcp.load gives exactly the old state dict for a kill before the rename and
    exactly the new one after it. Each save starts over what the killed ones left (stale data
    files, a stale .metadata.tmp)."""
    path = tmp_path / "ckpt"
    phases = tmp_path / "phases"
    _save(path, kill_state(0))
    steps = _run_to_end(fork_server, 1, phases)  # the steps of a save here
    assert _which(path, kill_state(0), kill_state(1)) == "new"
    assert set(steps) == {*_OUTCOME, "done"}, steps
    current = 1
    by_phase: collections.Counter[tuple[str, str]] = collections.Counter()
    points = _kill_points(steps)
    for i, die_at in enumerate(points):
        seed = 100 + i
        old, new = kill_state(current), kill_state(seed)
        status = fork_server.save(seed, phases, die_at)
        noted = phases.read_text().split()
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the save to be killed at {die_at} was not (status {status}): {noted}")
        phase = die_at.split(":")[0]
        assert noted and noted[-1] == phase, (die_at, noted)
        outcome = _which(path, old, new)
        by_phase[phase, outcome] += 1
        assert outcome == _OUTCOME[phase], (die_at, outcome, noted, sorted(os.listdir(path)))
        if outcome == "new":
            current = seed
    print(f"\n{len(points)} kills over the {len(steps) - 2} steps of a save: (phase, outcome) "
          f"{dict(sorted(by_phase.items()))}")
    # one save to the end removes everything the killed ones left
    _run_to_end(fork_server, 999, phases)
    names = sorted(os.listdir(path))
    (generation,) = _generations(path)
    assert names == [".metadata"] + sorted(n for n in names if DATA_NAME.match(n))
    assert _same_bits(_load(path, kill_state(999)), kill_state(999))
    assert generation > 1


def test_stale_files_of_a_killed_save_do_not_block_the_next(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, kill_state(0))
    (path / ".metadata.tmp").write_bytes(b"half a pickle")
    (path / "g7__0_0.distcp").write_bytes(b"x" * 5000)  # a killed save's generation 7
    (path / "g7__0_1.distcp").write_bytes(b"")
    state = kill_state(1)
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
        dcp.save(kill_state(1), storage_writer=writer, no_dist=True)
    err = _plan_error(info)
    assert str(link) in str(err) and "symbolic link" in str(err)
    assert target.read_bytes() == data and link.is_symlink()
    assert not (path / ".metadata").exists()


def test_a_data_file_name_symlinked_mid_save_is_refused(tmp_path: Path, victim) -> None:
    """The link appears between the directory scan and the open (a race): the open
    (O_CREAT | O_EXCL | O_NOFOLLOW) refuses it and the old checkpoint stays."""
    target, data = victim
    path = tmp_path / "ckpt"
    old = kill_state(0)
    _save(path, old)

    def plant(bucket, phase, file, offset, nbytes):
        if phase == "open" and bucket == 0:
            os.symlink(target, path / file)

    with AsyncWriter(path, io_hook=plant) as writer:
        dcp.save(kill_state(1), storage_writer=writer, no_dist=True)
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
    old = kill_state(0)
    _save(path, old)
    link = path / ".metadata.tmp"
    link.symlink_to(target)
    with AsyncWriter(path) as writer, pytest.raises(CheckpointException) as info:
        dcp.save(kill_state(1), storage_writer=writer, no_dist=True)
    err = _plan_error(info)
    assert str(link) in str(err) and "symbolic link" in str(err)
    assert target.read_bytes() == data and link.is_symlink()
    assert _same_bits(_load(path, old), old)


def test_a_metadata_tmp_symlinked_mid_save_is_refused(tmp_path: Path, victim) -> None:
    target, data = victim
    path = tmp_path / "ckpt"
    old = kill_state(0)
    _save(path, old)
    link = path / ".metadata.tmp"

    def plant(bucket, phase, file, offset, nbytes):
        if phase == "commit":
            link.symlink_to(target)

    with AsyncWriter(path, io_hook=plant) as writer:
        dcp.save(kill_state(1), storage_writer=writer, no_dist=True)
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
    new = kill_state(2)
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
