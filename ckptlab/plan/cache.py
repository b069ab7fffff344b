"""A save-plan cache that is an object you hold, keyed by what is being saved.

torch's planner caches in class-level dictionaries keyed by the planner's class name, so a
model planner and an optimizer planner saving alternately evict each other on every save, and
one changed rank recomputes the whole global plan. Here the cache is an explicit
:class:`PlanCache`; an entry is keyed by a **namespace** (``"model"``, ``"optim"``) and a
**fingerprint of the structure** (every rank's plan fingerprint), and:

- a **hit** (same namespace, same structure) returns the stored :class:`GlobalPlan`;
- a **delta** (same namespace and world size, some ranks changed) re-plans only what changed
  (:meth:`PlanBook.update`);
- a **miss** plans from scratch.

Every lookup is recorded in :attr:`PlanCache.events` (for the cache timeline view).
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckptlab._io.durable import fsync_dir, write_metadata  # re-exported: their old home
from ckptlab.errors import InvalidArgumentError, PlanError
from ckptlab.plan.items import LocalPlan
from ckptlab.plan.planning import GlobalPlan, PlanBook, raise_problems

__all__ = ["CacheEvent", "PlanCache", "fsync_dir", "structure_fingerprint", "write_metadata"]


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """One lookup: its namespace, outcome (``"hit"``, ``"delta"`` or ``"miss"``), the ranks
    re-planned, and the time it took."""

    namespace: str
    status: str
    changed_ranks: tuple[int, ...]
    world_size: int
    duration_s: float
    started_s: float  # time.perf_counter() at the start

    @property
    def seconds(self) -> float:
        """Deprecated name of :attr:`duration_s`."""
        warnings.warn("CacheEvent.seconds is deprecated; use CacheEvent.duration_s",
                      DeprecationWarning, stacklevel=2)
        return self.duration_s

    @property
    def started(self) -> float:
        """Deprecated name of :attr:`started_s`."""
        warnings.warn("CacheEvent.started is deprecated; use CacheEvent.started_s",
                      DeprecationWarning, stacklevel=2)
        return self.started_s


def structure_fingerprint(fingerprints: Sequence[str]) -> str:
    """One fingerprint for a whole set of per-rank plan fingerprints."""
    h = hashlib.blake2b(digest_size=16)
    for fp in fingerprints:
        h.update(fp.encode())
        h.update(b"\n")
    return h.hexdigest()


class PlanCache:
    """Global plans by namespace and structure, re-planned incrementally.

    Parameters
    ----------
    max_entries
        How many (namespace, structure) results to keep (least recently used go first).

    Examples
    --------
    >>> cache = PlanCache()
    >>> plan = cache.plan("model", local_plans)        # miss: plans from scratch
    >>> plan = cache.plan("model", local_plans)        # hit
    >>> plan = cache.plan("optim", optim_plans)        # its own entry: no eviction
    """

    def __init__(self, max_entries: int = 16) -> None:
        if max_entries < 1:
            raise InvalidArgumentError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._results: OrderedDict[tuple[str, str], tuple[GlobalPlan, tuple[str, ...]]] = \
            OrderedDict()
        self._books: dict[str, PlanBook] = {}  # the latest planning state per namespace
        self._metadata: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        # what CachedSavePlanner keeps between saves, per namespace: this process's last plan
        # as a rank, and the coordinator's last answers (ckptlab.plan.planner)
        self.rank_states: dict[str, Any] = {}
        self.coordinator_states: dict[str, Any] = {}
        self.events: list[CacheEvent] = []

    def plan(self, namespace: str, local_plans: Sequence[LocalPlan | str], *,
             validate: bool = True) -> GlobalPlan:
        """The global plan for ``local_plans`` under ``namespace``.

        An entry may be a rank's fingerprint (``str``) instead of its plan: the rank's plan
        did not change since the namespace's last plan.

        Raises
        ------
        PlanError
            If the plan is invalid (and ``validate``), or a rank sent a fingerprint the cache
            does not hold.
        """
        t0 = time.perf_counter()
        fps = tuple(p if isinstance(p, str) else p.fingerprint for p in local_plans)
        key = (namespace, structure_fingerprint(fps))
        stored = self._results.get(key)
        book = self._books.get(namespace)
        if stored is not None:
            self._results.move_to_end(key)
            result, status, changed = stored[0], "hit", ()
            if book is not None and book.plans and tuple(
                    p.fingerprint for p in book.plans) != fps:
                self._books.pop(namespace)  # the book is for another structure now
        elif book is not None and len(book.plans) == len(fps):
            try:
                diff = book.update(local_plans)
            except BaseException:
                self._books.pop(namespace)  # a half-applied update: plan afresh next time
                raise
            result, status, changed = book.result, "delta", diff.changed
        else:
            plans = [p for p in local_plans if isinstance(p, LocalPlan)]
            if len(plans) != len(local_plans):
                raise PlanError(f"{namespace}: a rank sent only a fingerprint but the cache "
                                "holds no plan for this namespace and world size")
            book = self._books[namespace] = PlanBook(plans)
            result, status, changed = book.result, "miss", tuple(range(len(plans)))
        if status != "hit":
            self._results[key] = (result, fps)
            while len(self._results) > self.max_entries:
                self._results.popitem(last=False)
        self.events.append(CacheEvent(namespace, status, changed, len(fps),
                                      time.perf_counter() - t0, t0))
        if validate:
            raise_problems(result)
        return result

    def metadata(self, namespace: str, result_fingerprints: Sequence[str],
                 build: Callable[[], bytes]) -> bytes:
        """The serialized checkpoint metadata for a save's write results, cached.

        The finish step gathers every rank's write results (file, offset, length per item)
        and pickles the metadata; with the same plan and the same item sizes the results
        repeat from save to save. Each rank sends a fingerprint of its results; when they
        all match a stored entry, its bytes are returned and ``build`` is not called.
        Recorded in :attr:`events` with status ``"hit"`` or ``"miss"`` (namespace suffixed
        ``/metadata``).
        """
        t0 = time.perf_counter()
        key = (namespace + "/metadata", structure_fingerprint(result_fingerprints))
        data = self._metadata.get(key)
        status = "hit"
        if data is None:
            data = build()
            if not isinstance(data, bytes):
                raise InvalidArgumentError(f"build() must return bytes, got "
                                           f"{type(data).__name__}")
            self._metadata[key] = data
            status = "miss"
            while len(self._metadata) > self.max_entries:
                self._metadata.popitem(last=False)
        else:
            self._metadata.move_to_end(key)
        self.events.append(CacheEvent(key[0], status, (), len(result_fingerprints),
                                      time.perf_counter() - t0, t0))
        return data

    def __len__(self) -> int:
        return len(self._results)

    def clear(self) -> None:
        """Forget every entry (the events stay)."""
        self._results.clear()
        self._books.clear()
        self._metadata.clear()
