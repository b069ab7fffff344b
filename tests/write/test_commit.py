"""The commit (``ckptlab.write._commit``): ranks' markers on the commit board, the
coordinator's verdict written once, ``.metadata`` renamed in last."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path

from ckptlab.write._commit import MARKER, CommitBoard, await_verdict, commit, report_buckets
from ckptlab.write._state import SavePrefix, SaveState


def markers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(MARKER))


def test_ranks_report_and_the_coordinator_collects(tmp_path: Path) -> None:
    board = CommitBoard(str(tmp_path), "tok", 3)
    board.report(1, {})
    board.report(2, {"rank 2 bucket 0 (__2_0.distcp)": OSError(28, "No space left on device")})
    assert markers(tmp_path) == [".ckptlab-tok-1.ok", ".ckptlab-tok-2.err"]
    failures = board.collect(0, timeout_s=5)
    assert list(failures) == ["rank 2"] and "No space left on device" in failures["rank 2"]
    board.clear()
    assert markers(tmp_path) == []


def test_a_missing_rank_times_out(tmp_path: Path) -> None:
    board = CommitBoard(str(tmp_path), "tok", 2)
    failures = board.collect(0, timeout_s=0.05)
    assert "no completion marker" in failures["rank 1"]
    assert board.await_verdict(1, ".metadata", 0.05) == ("timeout", "")


def test_the_verdict_other_ranks_see(tmp_path: Path) -> None:
    board = CommitBoard(str(tmp_path), "tok", 2)
    board.report(1, {})
    (tmp_path / ".metadata").write_bytes(b"m")
    assert board.await_verdict(1, ".metadata", 0.05) == ("timeout", "")  # marker not consumed
    board.clear()
    assert board.await_verdict(1, ".metadata", 5) == ("committed", "")
    board.post_failure("rank 0 bucket 1: EIO")
    board.post_failure("a second failure is not written over the first")
    assert board.await_verdict(1, ".metadata", 5) == ("failed", "rank 0 bucket 1: EIO")
    CommitBoard.clear_stale(str(tmp_path))
    assert markers(tmp_path) == []


def save_in(path: Path, rank: int, world: int, *, coordinator: bool) -> SaveState:
    save = SaveState(str(path), rank, staged=False)
    save.prefix = SavePrefix(f"__{rank}_", "tok", world)
    save.is_coordinator = coordinator
    save.submitted.set()
    return save


def done(exc: BaseException | None = None) -> Future:
    fut: Future = Future()
    if exc is None:
        fut.set_result(1)
    else:
        fut.set_exception(exc)
    return fut


def test_a_two_rank_commit(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"old")  # a previous generation, not kept
    (tmp_path / "g1__0_0.distcp").write_bytes(b"new")
    (tmp_path / "g1__1_0.distcp").write_bytes(b"new")
    other = save_in(tmp_path, 1, 2, coordinator=False)
    other.futures.append((0, "g1__1_0.distcp", done()))
    report_buckets(other, None)
    coord = save_in(tmp_path, 0, 2, coordinator=True)
    coord.futures.append((0, "g1__0_0.distcp", done()))
    report_buckets(coord, None)
    keep = frozenset({"g1__0_0.distcp", "g1__1_0.distcp"})
    verdict = threading.Thread(target=await_verdict, args=(other, 10))
    verdict.start()
    commit(coord, b"metadata", keep, sync=True, hook=None, timeout_s=10)
    verdict.join()
    assert coord.committed and coord.error is None and coord.finished.is_set()
    assert other.committed and other.error is None
    assert sorted(os.listdir(tmp_path)) == [".metadata", "g1__0_0.distcp", "g1__1_0.distcp"]
    assert (tmp_path / ".metadata").read_bytes() == b"metadata"
    assert coord.timeline is not None and coord.timeline.committed


def test_a_failed_rank_fails_the_commit_once_for_everyone(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"previous")
    other = save_in(tmp_path, 1, 2, coordinator=False)
    (tmp_path / "__1_0.distcp").write_bytes(b"partial")
    st = os.stat(tmp_path / "__1_0.distcp")
    other.created["__1_0.distcp"] = (st.st_dev, st.st_ino)
    other.futures.append((0, "__1_0.distcp", done(OSError(5, "Input/output error"))))
    report_buckets(other, None)
    assert other.error is not None and not (tmp_path / "__1_0.distcp").exists()
    coord = save_in(tmp_path, 0, 2, coordinator=True)
    report_buckets(coord, None)
    commit(coord, b"metadata", frozenset(), sync=False, hook=None, timeout_s=10)
    assert coord.error is not None and not coord.committed
    assert "rank 1" in coord.error.failures and "Input/output error" in str(coord.error)
    assert (tmp_path / ".metadata").read_bytes() == b"previous"  # the old checkpoint stays
    failed = [n for n in markers(tmp_path) if n.endswith(".failed")]
    assert failed == [".ckptlab-tok.failed"]
    late = save_in(tmp_path, 1, 2, coordinator=False)
    await_verdict(late, 5)
    assert late.error is not None and "did not commit" in str(late.error)


def test_a_failed_rename_removes_this_saves_files(tmp_path: Path) -> None:
    coord = save_in(tmp_path, 0, 1, coordinator=True)
    (tmp_path / "__0_0.distcp").write_bytes(b"data")
    st = os.stat(tmp_path / "__0_0.distcp")
    coord.created["__0_0.distcp"] = (st.st_dev, st.st_ino)
    report_buckets(coord, None)
    calls = []

    def hook(bucket: int | None, phase: str, file: str, offset: int, nbytes: int) -> None:
        calls.append(phase)
        if phase == "rename":
            raise OSError(28, "No space left on device")

    commit(coord, b"metadata", frozenset({"__0_0.distcp"}), sync=True, hook=hook, timeout_s=1)
    assert coord.error is not None and "No space left on device" in str(coord.error)
    assert calls == ["commit", "rename", "remove"]
    assert os.listdir(tmp_path) == []
