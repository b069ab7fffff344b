"""What one save did, when: per-bucket events with timestamps and bytes (frozen data)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ckptlab.write.buckets import BucketAssignment

__all__ = ["PHASES", "Timeline", "TimelineEvent"]

# phases roughly in the order a save goes through them. "reserve" (staging memory mapped and
# faulted in: a writer's first save, or one larger than any before), "plan" (bucket assignment),
# "metadata" (pickling .metadata in finish), "wait_ranks" (the coordinator waiting for the
# other ranks' markers) and "commit" belong to the whole save (bucket None); "stage" is per
# bucket, except after dcp.async_save's stage(), which is one save-wide event
PHASES = ("reserve", "plan", "stage", "open", "write", "fsync", "close", "metadata", "wait_ranks",
          "commit")


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One interval of work in a save."""

    bucket: int | None  # bucket (= data file, worker job) index; None for save-wide phases
    phase: str  # one of PHASES
    start_s: float  # seconds since the save started (Timeline.started_at)
    end_s: float
    nbytes: int  # bytes copied (stage), written (write) or 0
    file: str  # data file name relative to the checkpoint directory ("" for save-wide phases)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "phase": self.phase, "start_s": self.start_s,
                "end_s": self.end_s, "nbytes": self.nbytes, "file": self.file}


@dataclass(frozen=True, slots=True)
class Timeline:
    """Every event of one save, the bucket assignment it used, and its outcome."""

    path: str  # checkpoint directory
    rank: int  # this process's rank (0 without torch.distributed)
    started_at: float  # time.time() when the save started (write_data / stage)
    assignment: BucketAssignment
    files: tuple[tuple[int, str, int, str], ...]  # (bucket, file, bytes, "O_DIRECT" or "POSIX")
    events: tuple[TimelineEvent, ...]  # sorted by start
    returned_s: float | None  # when write_data handed control back to the caller
    finished_s: float | None  # when the last event ended (None while unfinished)
    committed: bool  # this process wrote .metadata (the coordinator) and it succeeded
    error: str | None = None  # the failure, if the save failed

    @property
    def nbytes(self) -> int:
        """Bytes written to data files."""
        return sum(e.nbytes for e in self.events if e.phase == "write")

    def phase_s(self, phase: str) -> float:
        """Total seconds spent in ``phase``, summed over buckets (overlaps count twice)."""
        return sum(e.duration_s for e in self.events if e.phase == phase)

    def bucket_events(self, bucket: int) -> tuple[TimelineEvent, ...]:
        return tuple(e for e in self.events if e.bucket == bucket)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "rank": self.rank, "started_at": self.started_at,
                "assignment": self.assignment.to_dict(),
                "files": [{"bucket": b, "file": f, "nbytes": n, "io_path": p}
                          for b, f, n, p in self.files],
                "events": [e.to_dict() for e in self.events], "returned_s": self.returned_s,
                "finished_s": self.finished_s, "committed": self.committed,
                "error": self.error, "nbytes": self.nbytes}


@dataclass
class _Recorder:
    """Collects events from the caller's thread and the workers (thread safe)."""

    path: str
    rank: int
    t0: float = field(default_factory=time.perf_counter)
    wall0: float = field(default_factory=time.time)
    events: list[TimelineEvent] = field(default_factory=list)
    files: dict[int, tuple[str, int, str]] = field(default_factory=dict)
    returned_s: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    written_nbytes: int = 0  # bytes of the "write" events so far
    total_nbytes: int = 0  # bytes the save's data files will take in writes (0: not known)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, bucket: int | None, phase: str, start_s: float, nbytes: int = 0,
            file: str = "") -> None:
        event = TimelineEvent(bucket, phase, start_s, self.now(), nbytes, file)
        with self.lock:
            self.events.append(event)
            if phase == "write":
                self.written_nbytes += nbytes

    def add_span(self, bucket: int | None, phase: str, start_s: float, end_s: float,
                 nbytes: int = 0, file: str = "") -> None:
        with self.lock:
            self.events.append(TimelineEvent(bucket, phase, start_s, end_s, nbytes, file))

    def file(self, bucket: int, name: str, nbytes: int, io_path: str) -> None:
        with self.lock:
            self.files[bucket] = (name, nbytes, io_path)

    def freeze(self, assignment: BucketAssignment, *, committed: bool,
               error: str | None) -> Timeline:
        with self.lock:
            events = tuple(sorted(self.events, key=lambda e: (e.start_s, e.end_s)))
            files = tuple((b, *v) for b, v in sorted(self.files.items()))
        return Timeline(self.path, self.rank, self.wall0, assignment, files, events,
                        self.returned_s, max((e.end_s for e in events), default=None),
                        committed, error)
