"""The commit: ranks report through marker files, the coordinator renames ``.metadata`` in.

With more than one rank, each rank's buckets finish on that rank; the ranks tell the
coordinator through small files in the checkpoint directory (the *commit board*), so the
background commit needs no collective that would block a training loop:

1. each rank writes ``.ckptlab-{token}-{rank}.ok`` (its data files are fsynced) or
   ``.ckptlab-{token}-{rank}.err`` holding its errors;
2. the coordinator waits for every other rank's marker, then writes ``.metadata`` atomically
   (:func:`ckptlab._io.durable.write_metadata`) and removes the rank markers, or, if anything
   failed, writes ``.ckptlab-{token}.failed`` holding the error;
3. the other ranks wait until their ``.ok`` marker is gone and ``.metadata`` is there
   (committed), or ``.failed`` appears.

Markers of an earlier failed save are removed when the next save prepares its plan.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any

from ckptlab._io.durable import read_small, write_metadata, write_new_file
from ckptlab.errors import StorageIOError, WriterError
from ckptlab.write._files import remove_files, remove_stale
from ckptlab.write._state import SaveState, deadline_left, describe
from ckptlab.write.timeline import Timeline

__all__ = ["MARKER", "CommitBoard", "await_verdict", "commit", "report_buckets", "settle",
           "start_commit", "wait_for"]

MARKER = ".ckptlab-"  # rank completion markers: .ckptlab-{token}-{rank}.ok / .err, {token}.failed
POLL_S = 0.01


class CommitBoard:
    """The marker files of one multi-rank save in its checkpoint directory."""

    def __init__(self, directory: str, token: str, world: int) -> None:
        self.directory, self.token, self.world = directory, token, world

    def _rank(self, rank: int, suffix: str) -> str:
        return os.path.join(self.directory, f"{MARKER}{self.token}-{rank}{suffix}")

    @property
    def failed_path(self) -> str:
        return os.path.join(self.directory, f"{MARKER}{self.token}.failed")

    def report(self, rank: int, failures: dict[object, BaseException | str]) -> None:
        """Tell the coordinator how this rank's buckets went (raises OSError)."""
        if failures:
            text = "; ".join(f"{k}: {describe(v)}" for k, v in failures.items())
            write_new_file(self._rank(rank, ".err"), text.encode(), sync=False)
        else:
            write_new_file(self._rank(rank, ".ok"), b"", sync=False)  # data files are fsynced

    def collect(self, rank: int, timeout_s: float) -> dict[object, str]:
        """The coordinator: wait for every other rank's marker; their errors, by rank."""
        waiting = set(range(self.world)) - {rank}
        failures: dict[object, str] = {}
        deadline = time.monotonic() + timeout_s
        while waiting:
            for r in sorted(waiting):
                if os.path.exists(self._rank(r, ".ok")):
                    waiting.discard(r)
                elif os.path.exists(self._rank(r, ".err")):
                    failures[f"rank {r}"] = _text(self._rank(r, ".err"))
                    waiting.discard(r)
            if waiting and time.monotonic() > deadline:
                for r in sorted(waiting):
                    failures[f"rank {r}"] = (f"no completion marker within {timeout_s:.0f} s "
                                             "(rank died?)")
                break
            if waiting:
                time.sleep(POLL_S)
        return failures

    def post_failure(self, text: str) -> None:
        """The coordinator: tell every rank the save failed (best effort)."""
        try:
            write_new_file(self.failed_path, text.encode(), sync=False)
        except OSError:
            pass

    def clear(self) -> None:
        """After the commit: remove the rank markers of this save."""
        start = f"{MARKER}{self.token}-"
        for name in os.listdir(self.directory):
            if name.startswith(start):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass

    def await_verdict(self, rank: int, metadata_name: str,
                      timeout_s: float) -> tuple[str, str]:
        """Another rank: wait for the coordinator's verdict: ``("committed", "")``,
        ``("failed", the coordinator's error)`` or ``("timeout", "")``."""
        ok = self._rank(rank, ".ok")
        meta = os.path.join(self.directory, metadata_name)
        deadline = time.monotonic() + timeout_s
        while True:
            if os.path.exists(self.failed_path):
                return "failed", _text(self.failed_path)
            if not os.path.exists(ok) and os.path.exists(meta):
                return "committed", ""
            if time.monotonic() > deadline:
                return "timeout", ""
            time.sleep(POLL_S)

    @staticmethod
    def clear_stale(directory: str) -> None:
        """Before a save: remove the markers earlier failed saves left."""
        for name in os.listdir(directory):
            if name.startswith(MARKER):
                try:
                    os.unlink(os.path.join(directory, name))
                except FileNotFoundError:
                    pass


def _text(path: str) -> str:
    data = read_small(path)
    return f"(cannot read {path})" if data is None else data.decode("utf-8", errors="replace")


def board_of(save: SaveState) -> CommitBoard | None:
    """The commit board of a multi-rank save; None for a single-rank one."""
    if save.prefix is None or save.prefix.world <= 1:
        return None
    return CommitBoard(save.path, save.prefix.token, save.prefix.world)


def report_buckets(save: SaveState, hook: Any) -> None:
    """Wait for this rank's buckets; with several ranks, tell the coordinator."""
    from concurrent.futures import wait

    wait([f for _, _, f in save.futures])
    for bucket, name, fut in save.futures:
        exc = fut.exception()
        if exc is not None:
            save.local_failures[f"rank {save.rank} bucket {bucket} ({name})"] = exc
    board = board_of(save)
    if board is not None:
        try:
            board.report(save.rank, save.local_failures)
        except OSError as exc:
            save.local_failures[f"rank {save.rank} marker"] = exc
    if save.local_failures:  # this save cannot commit: free the space its files took
        remove_files(save.path, save.created, _remove_hook(hook))
    if not save.is_coordinator and save.local_failures:
        save.fail(save.message(save.local_failures), dict(save.local_failures))
    save.local_done.set()


def _remove_hook(hook: Any) -> Any:
    return None if hook is None else (lambda name, nbytes: hook(None, "remove", name, 0, nbytes))


def commit(save: SaveState, blob: bytes, keep: frozenset[str | None], *, sync: bool,
           hook: Any, timeout_s: float) -> None:
    """The coordinator's commit, on its own thread: wait for this rank's buckets and the other
    ranks' markers, then rename ``.metadata`` in and remove what it does not refer to."""
    rec = save.recorder
    board = board_of(save)
    try:
        save.local_done.wait()
        failures: dict[object, BaseException | str] = dict(save.local_failures)
        if board is not None:
            t = rec.now()
            failures.update(board.collect(save.rank, timeout_s))
            rec.add(None, "wait_ranks", t)
        if not failures:
            t = rec.now()
            try:
                if hook is not None:
                    hook(None, "commit", save.metadata_name, 0, len(blob))
                write_metadata(save.path, blob, save.metadata_name, sync=sync,
                               before_rename=None if hook is None else lambda: hook(
                                   None, "rename", save.metadata_name, 0, len(blob)))
            except Exception as exc:
                meta = os.path.join(save.path, save.metadata_name)
                failures = {"commit": exc if not isinstance(exc, OSError)
                            or isinstance(exc, StorageIOError) else StorageIOError(
                                f"commit failed: {exc.strerror or exc}", path=meta, offset=0,
                                nbytes=len(blob), errno=exc.errno)}
                if read_small(meta) != blob:
                    remove_files(save.path, save.created, _remove_hook(hook))  # not renamed in
            else:
                save.committed = True
                rec.add(None, "commit", t, len(blob), save.metadata_name)
        if failures:  # the one place a failed save is reported to the other ranks
            err = save.fail(save.message(failures), failures)
            if board is not None:
                board.post_failure(str(err))
            return
        if board is not None:
            board.clear()
        remove_stale(save.path, keep, save.owner_rank, sync=sync, hook=_remove_hook(hook))
    except BaseException as exc:  # pragma: no cover - a bug: still report it
        save.fail(save.message({"commit": exc}), {"commit": exc})
    finally:
        save.freeze()
        save.finished.set()


def start_commit(save: SaveState, metadata: Any, results: list[list[Any]], storage_meta: Any,
                 *, sync: bool, hook: Any, timeout_s: float) -> None:
    """``finish``'s work: complete DCP's ``metadata`` (version, where each item is, the
    storage meta), pickle it now (the caller may reuse the object) and start :func:`commit`
    on its own thread."""
    from torch.distributed.checkpoint import filesystem

    t = save.recorder.now()
    version = getattr(filesystem, "CURRENT_DCP_VERSION", None)
    if version is not None:  # torch 2.7's Metadata has no version field
        metadata.version = version
    metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
    metadata.storage_meta = storage_meta
    blob = pickle.dumps(metadata)
    keep = frozenset(getattr(sd, "relative_path", None)
                     for sd in metadata.storage_data.values())
    save.recorder.add(None, "metadata", t, len(blob))
    save.commit_thread = threading.Thread(
        target=commit, args=(save, blob, keep),
        kwargs={"sync": sync, "hook": hook, "timeout_s": timeout_s},
        daemon=True, name="ckptlab-writer-commit")
    save.commit_thread.start()


def await_verdict(save: SaveState, timeout_s: float) -> None:
    """Another rank: wait until the coordinator committed or reported failure."""
    board = board_of(save)
    if save.error is not None or board is None:
        save.finished.set()
        return
    verdict, text = board.await_verdict(save.rank, save.metadata_name, timeout_s)
    if verdict == "committed":
        save.committed = True
    elif verdict == "failed":
        save.fail(f"the coordinator did not commit {save.path}: {text}", {"coordinator": text})
    else:
        save.fail(f"no verdict from the coordinator on {save.path} within {timeout_s:.0f} s",
                  {"coordinator": "timeout"})
    save.finished.set()


def wait_for(save: SaveState, timeout: float | None, commit_timeout_s: float) -> Timeline:
    """Block until ``save`` is committed (coordinator) or the coordinator's verdict is in
    (other ranks); its final timeline, or its :class:`~ckptlab.errors.WriterError`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not save.submitted.wait(deadline_left(deadline)) \
            or not save.local_done.wait(deadline_left(deadline)):
        raise WriterError(f"the save to {save.path} did not finish within {timeout} s")
    if save.is_coordinator:
        if save.commit_thread is None:
            if save.error is None:
                save.fail(f"the save to {save.path} never reached finish() (dcp.save "
                          "failed after write_data?); nothing was committed",
                          dict(save.local_failures))
        elif not save.finished.wait(deadline_left(deadline)):
            raise WriterError(f"the save to {save.path} did not commit within {timeout} s")
    else:
        left = deadline_left(deadline)
        await_verdict(save, commit_timeout_s if left is None else left)
    save.freeze()
    if save.error is not None:
        save.error_seen = True
        raise save.error
    return save.timeline  # type: ignore[return-value]


def settle(prev: SaveState, *, raise_if_busy: bool, timeout_s: float) -> None:
    """Before a new save: let the previous one finish (or refuse while it runs), and raise
    its error if it failed and nobody has seen it."""
    if prev.pending():
        if raise_if_busy:
            raise WriterError(
                f"a save to {prev.path} is still in flight and on_busy='raise'; call "
                "wait() first (or use on_busy='wait')")
        if prev.staged and not prev.submitted.wait(timeout_s):
            raise WriterError(
                f"the state dict staged for {prev.path} was not written within "
                f"{timeout_s:.0f} s (did its dcp.async_save fail?); its staging memory is "
                "still reserved, so this save cannot start")
        prev.local_done.wait()
        if prev.commit_thread is not None:
            prev.finished.wait()
    if prev.error is not None and not prev.error_seen:
        prev.error_seen = True
        raise WriterError(f"the previous save failed and nobody called wait(): {prev.error}",
                          prev.error.failures) from prev.error
