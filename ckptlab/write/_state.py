"""The state of one save (:class:`SaveState`) and its public face, :class:`SaveHandle`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptlab._io.durable import METADATA
from ckptlab.errors import InvalidArgumentError, WriterError
from ckptlab.write.buckets import BucketAssignment
from ckptlab.write.timeline import Timeline, _Recorder

__all__ = ["SaveHandle", "SavePrefix", "SaveState", "check_options", "describe"]


def check_options(workers: Any, buckets: Any, on_busy: Any) -> int:
    """Check an AsyncWriter's options; the bucket count (``workers`` when ``buckets`` is
    None). Raises :class:`~ckptlab.errors.InvalidArgumentError`."""
    if type(workers) is not int or workers < 1:
        raise InvalidArgumentError(f"workers must be an int >= 1, got {workers!r}")
    buckets = workers if buckets is None else buckets
    if type(buckets) is not int or buckets < 1:
        raise InvalidArgumentError(f"buckets must be an int >= 1, got {buckets!r}")
    if on_busy not in ("wait", "raise"):
        raise InvalidArgumentError(f"on_busy must be 'wait' or 'raise', got {on_busy!r}")
    return buckets


def describe(exc: BaseException | str) -> str:
    """One line for an error: its type and message (a string as it is)."""
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else str(exc)


@dataclass(frozen=True)
class SavePrefix:
    """``SavePlan.storage_data`` of an AsyncWriter save: file prefix and the save's identity."""

    prefix: str  # data files are f"{prefix}{bucket}.distcp" (see data_prefix)
    token: str  # the same on every rank of one save (set by the coordinator)
    world: int  # ranks taking part; > 1 means ranks report completion through marker files
    rank: int | None = None  # the plan's place in the coordinator's list: this rank's number


class SaveState:
    """The state of one save, shared by the caller, the workers and the commit thread."""

    def __init__(self, path: str, rank: int, *, staged: bool) -> None:
        self.path = path
        self.rank = rank
        self.staged = staged  # stage() copied the tensors (dcp.async_save)
        self.recorder = _Recorder(path, rank)
        self.assignment = BucketAssignment((), None)
        self.futures: list[tuple[int, str, Future]] = []  # (bucket, file, future)
        self.submitted = threading.Event()  # write_data handed the buckets to the workers
        self.local_done = threading.Event()  # every bucket finished (well or not)
        self.local_failures: dict[object, BaseException | str] = {}
        self.prefix: SavePrefix | None = None
        self.created: dict[str, tuple[int, int]] = {}  # data files this save created: (dev, ino)
        self.owner_rank: int | None = None  # whose stale data files the commit removes
        self.is_coordinator = True
        self.metadata_name = METADATA
        self.commit_thread: threading.Thread | None = None
        self.committed = False
        self.error: WriterError | None = None
        self.error_seen = False
        self.finished = threading.Event()  # the outcome is known (commit done or failed)
        self.timeline: Timeline | None = None

    @property
    def multi_rank(self) -> bool:
        """Ranks report their outcome through marker files (a collective save of > 1 rank)."""
        return self.prefix is not None and self.prefix.world > 1

    @property
    def adoptable(self) -> bool:
        """``stage`` copied a state dict that no ``write_data`` has taken yet: the DCP calls
        that follow adopt this save instead of starting a new one."""
        return self.staged and not self.submitted.is_set()

    def move(self, *, path: str | None = None, rank: int | None = None) -> None:
        """Point an adoptable save at the directory and rank DCP set up after ``stage``."""
        if path is not None:
            self.path = self.recorder.path = path
        if rank is not None:
            self.rank = self.recorder.rank = rank

    def pending(self) -> bool:
        if self.staged and not self.submitted.is_set():
            return True
        if self.submitted.is_set() and not self.local_done.is_set():
            return True
        return self.commit_thread is not None and not self.finished.is_set()

    def message(self, failures: dict[object, BaseException | str]) -> str:
        """The WriterError text for ``failures``: the first one, and what is on disk."""
        key, first = next(iter(failures.items()))
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return (f"async save to {self.path} failed: {key}: {describe(first)}{more}; no "
                f"{self.metadata_name} was written, so the directory still holds its previous "
                "checkpoint, if it had one (this save wrote only new file names; other "
                "directories were not touched)")

    def fail(self, message: str, failures: dict[object, BaseException | str]) -> WriterError:
        err = WriterError(message, failures)
        first = next((f for f in failures.values() if isinstance(f, BaseException)), None)
        if first is not None:
            err.__cause__ = first
        self.error = err
        return err

    def snapshot(self) -> Timeline:
        """The events so far (not stored: only :meth:`freeze` sets the final timeline)."""
        return self.recorder.freeze(self.assignment, committed=self.committed,
                                    error=None if self.error is None else str(self.error))

    def freeze(self) -> Timeline:
        self.timeline = self.snapshot()
        return self.timeline


class SaveHandle:
    """The outcome of one save: wait for it, ask whether it is done, read its timeline."""

    def __init__(self, save: SaveState, writer: Any) -> None:
        self._save = save
        self._writer = writer

    @property
    def path(self) -> str:
        return self._save.path

    def done(self) -> bool:
        """True once the outcome is known (committed, or failed)."""
        save = self._save
        if save.is_coordinator:
            return save.finished.is_set()
        return save.local_done.is_set()

    def wait(self, timeout: float | None = None) -> Timeline:
        """Block until the checkpoint is committed; return its :class:`Timeline`.

        On the coordinator (rank 0, or the only process) this waits for every bucket of this
        rank, for the other ranks' completion markers and for ``.metadata``'s rename. On other
        ranks it waits for this rank's buckets and then for the coordinator's verdict.

        Raises
        ------
        WriterError
            If a bucket, a rank or the commit failed (``failures`` holds the real errors;
            no ``.metadata`` was written, the previous checkpoint is untouched), or
            ``timeout`` seconds passed.
        """
        return self._writer._wait_save(self._save, timeout)

    def progress(self) -> tuple[int, int]:
        """(bytes written so far, bytes the save writes in all) for this rank's data files.

        Cheap enough to poll; the total is known once ``write_data`` has placed the items
        (0 before). Writes cover whole 4096-byte blocks, so the total is each file's size
        rounded up to 4096.
        """
        rec = self._save.recorder
        with rec.lock:
            return rec.written_nbytes, rec.total_nbytes

    @property
    def timeline(self) -> Timeline:
        """The events so far (final once :meth:`done`)."""
        save = self._save
        if save.timeline is not None and save.finished.is_set():
            return save.timeline
        return save.snapshot()  # in flight: a snapshot must never replace the final one


def deadline_left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``time.monotonic()``), None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
