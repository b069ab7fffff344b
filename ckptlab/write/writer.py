"""``AsyncWriter``: a DCP StorageWriter that returns once the tensors are copied and writes in
the background with large aligned writes, committing ``.metadata`` last.

This module is the DCP protocol (``StorageWriter`` and ``AsyncStager``) and the writer's
public surface; the work is done by the modules beside it, in the order a save runs:
:mod:`~ckptlab.write._files` (names, generations, removal), :mod:`~ckptlab.write._save`
(one save's run: :mod:`~ckptlab.write._staging` copies into page-aligned memory,
:mod:`~ckptlab.write._placement` puts items at file offsets, :mod:`~ckptlab.write._worker`
writes them on persistent threads), :mod:`~ckptlab.write._commit` (ranks' markers, then
``.metadata``), with :mod:`~ckptlab.write._state` (one save's state, :class:`SaveHandle`).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from ckptlab._io.durable import METADATA as METADATA  # re-exported: its earlier home
from ckptlab._torch_compat import async_stager_sync_attribute
from ckptlab.errors import WriterError
from ckptlab.write._blob import BlobTemplates
from ckptlab.write._commit import MARKER as MARKER  # re-exported: its earlier home
from ckptlab.write._commit import CommitBoard, settle, start_commit, wait_for
from ckptlab.write._files import DATA_NAME as DATA_NAME  # re-exported: its earlier home
from ckptlab.write._files import data_prefix, prepare_directory, scan_directory
from ckptlab.write._save import SaveResources, run_save, stage_save
from ckptlab.write._staging import StagingArena
from ckptlab.write._state import SaveHandle, SavePrefix, SaveState, check_options
from ckptlab.write._worker import IoHook, WorkerPool
from ckptlab.write.timeline import Timeline

try:  # the base classes are torch's; ckptlab.write needs torch anyway
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.checkpoint.storage import StorageWriter
except ImportError:  # pragma: no cover - torch built without distributed
    StorageWriter = object  # type: ignore[assignment,misc]
    AsyncStager = object  # type: ignore[assignment,misc]

__all__ = ["AsyncWriter", "SaveHandle"]

COPY_THREADS = min(2, os.cpu_count() or 1)  # threads copying into staging (the caller's too)


class AsyncWriter(StorageWriter, AsyncStager):  # type: ignore[misc,valid-type]
    """A DCP ``StorageWriter`` that returns at memcpy speed and writes at disk speed.

    ::

        writer = AsyncWriter("ckpt/step_100")
        dcp.save(state_dict, storage_writer=writer)   # returns once tensors are copied
        ...                                           # train on; mutate the state dict freely
        writer.wait()                                 # raises WriterError if anything failed

    or ``dcp.async_save(state_dict, storage_writer=writer)``, whose future completes when the
    checkpoint is committed (a failure arrives as DCP's ``CheckpointException`` wrapping the
    :class:`~ckptlab.errors.WriterError`). Reuse one writer for every save: its worker
    threads and staging memory persist (``dcp.save(..., checkpoint_id=...)`` or
    ``reset(checkpoint_id)`` moves it to a new directory). The files are a standard DCP
    checkpoint that stock ``dcp.load`` reads; how a save runs is in :mod:`ckptlab.write`.

    **Overwriting never loses the previous checkpoint.** A save into a directory that holds
    one writes new file names, and ``.metadata`` is replaced by rename only after every
    bucket of every rank succeeded: a crash, a full disk or a dead rank leaves the old
    checkpoint or the new one, never none and never a mix (with ``fsync=False``: against
    process crashes, not power loss). A symbolic link at a name the save would write,
    replace or remove is refused with a :class:`~ckptlab.errors.WriterError` naming it.

    Parameters
    ----------
    path
        Checkpoint directory (created if missing).
    workers
        Persistent writer threads.
    buckets
        Data files per rank; defaults to ``workers``.
    separation_hint
        Key prefix whose items get files of their own (see :func:`assign_buckets`).
    direct
        Try ``O_DIRECT`` (falls back to buffered writes where the filesystem refuses it).
    fsync
        fsync data files, ``.metadata`` and the directory (``sync_files`` is the same
        switch, its earlier name).
    overwrite
        Allow saving into a directory that holds a committed checkpoint; with False such a
        save raises :class:`~ckptlab.errors.WriterError`.
    on_busy
        What a new save does while the previous one is still writing: ``"wait"`` blocks,
        ``"raise"`` raises :class:`~ckptlab.errors.WriterError`.
    commit_timeout_s
        How long the coordinator waits for the other ranks' markers (and other ranks for
        its verdict) before the save fails.
    io_hook
        For tests and tracing: ``io_hook(bucket, phase, file, offset, nbytes)`` runs on the
        worker before each ``"open"``, ``"write"`` and ``"fsync"``, and with ``bucket`` None
        before the commit (``"commit"``), the rename (``"rename"``) and each removal of an
        old data file (``"remove"``). What it raises fails that step as a real I/O error
        would.

    Notes
    -----
    Errors are never dropped: a failed save raises from :meth:`wait`, from the
    ``dcp.async_save`` future, or, if nobody asked, from the next save on this writer; at
    interpreter exit a pending save is waited for. Timings are in ``benchmarks/README.md``.
    """

    def __init__(self, path: str | os.PathLike[str], *, workers: int = 2,
                 buckets: int | None = None, separation_hint: str | None = None,
                 direct: bool = True, fsync: bool = True, overwrite: bool = True,
                 on_busy: Literal["wait", "raise"] = "wait", commit_timeout_s: float = 600.0,
                 io_hook: IoHook | None = None, sync_files: bool | None = None) -> None:
        super().__init__()
        self.buckets = check_options(workers, buckets, on_busy)
        self.path = os.fspath(path)
        self.workers, self.separation_hint = workers, separation_hint
        self.direct = direct
        self.fsync = fsync if sync_files is None else sync_files
        self.overwrite, self.on_busy = overwrite, on_busy
        self.commit_timeout_s = commit_timeout_s
        self.io_hook = io_hook
        self.save_id = uuid.uuid4().hex
        self._generation: int | None = None  # chosen by prepare_local_plan, used once
        self.rank = 0
        self._rank_from_plan = False
        self.is_coordinator = True
        self.use_collectives = True
        self._res = SaveResources(
            pool=WorkerPool(workers), lanes=COPY_THREADS, arena=StagingArena(),
            templates=BlobTemplates(),  # threads copying beside the caller:
            copiers=ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="ckptlab-copy")
            if COPY_THREADS > 1 else None)
        self._lock = threading.RLock()
        self._current: SaveState | None = None
        self._closed = False
        atexit.register(_drain_at_exit, weakref.ref(self))

    @property
    def sync_files(self) -> bool:
        """The ``fsync`` switch under its earlier name."""
        return self.fsync

    @sync_files.setter
    def sync_files(self, value: bool) -> None:
        self.fsync = value

    # -- the public extras ----------------------------------------------------------------
    @property
    def last(self) -> SaveHandle | None:
        """The most recent save (in flight or finished)."""
        return None if self._current is None else SaveHandle(self._current, self)

    def wait(self, timeout: float | None = None) -> Timeline | None:
        """Wait for the most recent save; see :meth:`SaveHandle.wait`. None if none ran."""
        save = self._current
        return None if save is None else self._wait_save(save, timeout)

    @property
    def staging_nbytes(self) -> int:
        """Bytes of staging memory this writer holds (reused by the next save)."""
        return self._res.arena.capacity_nbytes

    def reserve(self, nbytes: int) -> None:
        """Allocate and fault in ``nbytes`` of staging memory now, off the critical path."""
        with self._lock:
            self._await_idle()
            self._res.arena.begin(nbytes)

    def close(self) -> None:
        """Wait for the last save, then stop the workers and free the staging memory.

        Raises the last save's error if it failed and nobody has seen it.
        """
        if self._closed:
            return
        try:
            with self._lock:
                self._await_idle(for_close=True)
        finally:
            self._closed = True
            self._res.pool.close()
            if self._res.copiers is not None:
                self._res.copiers.shutdown(wait=True)
            self._res.arena.release()

    def __enter__(self) -> AsyncWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- AsyncStager ------------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict``'s tensors into this writer's staging memory (``dcp.async_save``).

        Returns the same structure with every tensor (DTensors: their local shard) replaced
        by a copy in page-aligned staging memory; the save that follows writes from there
        without a second copy, and its ``finish`` waits for the commit so that the
        ``async_save`` future means "committed".
        """
        with self._lock:
            self._check_open()
            self._await_idle()
            self._current = SaveState(self.path, self.rank, staged=True)
            return stage_save(self._current, self._res, state_dict)

    def synchronize_staging(self) -> None:  # the protocol's hook; stage() is synchronous
        return None

    # -- StorageWriter ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        with self._lock:
            self._check_open()
            adopting = self._current is not None and self._current.adoptable
            if not adopting:
                self._await_idle()
            if checkpoint_id:
                self.path = os.fspath(checkpoint_id)
                if adopting:
                    self._current.move(path=self.path)  # type: ignore[union-attr]
            self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self._check_open()
            self.is_coordinator = is_coordinator
            self.rank = int(kwargs.get("rank") or 0)
            # torch 2.7 passes no rank: write_data takes it from the coordinator's plan
            self._rank_from_plan = "rank" not in kwargs
            self.use_collectives = kwargs.get("use_collectives", True)
            if self._current is not None and self._current.adoptable:
                self._current.move(path=self.path, rank=self.rank)
            else:
                self._await_idle()
                self._current = SaveState(self.path, self.rank, staged=False)
            self._current.is_coordinator = is_coordinator or not self.use_collectives

    def prepare_local_plan(self, plan: Any) -> Any:
        os.makedirs(self.path, exist_ok=True)
        if self.is_coordinator or not self.use_collectives:
            # the old checkpoint stays whole: this save writes the next generation's file
            # names and the old files go only after the new .metadata is renamed in
            self._generation = prepare_directory(self.path, self._metadata_name(),
                                                 self._owner_rank(), overwrite=self.overwrite)
            if self.use_collectives:
                CommitBoard.clear_stale(self.path)
        if not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=SavePrefix(
                data_prefix(self.rank, self._take_generation()), uuid.uuid4().hex, 1))
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        token = uuid.uuid4().hex
        if all(isinstance(p.storage_data, SavePrefix) for p in plans):
            return plans
        generation = self._take_generation()
        return [dataclasses.replace(p, storage_data=SavePrefix(data_prefix(i, generation),
                                                               token, len(plans), i))
                if not isinstance(p.storage_data, SavePrefix) else p
                for i, p in enumerate(plans)]

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Stage this rank's items, start the workers, return the results at once."""
        from torch.futures import Future

        with self._lock:
            self._check_open()
            save = self._current
            if save is None or save.submitted.is_set():  # called without set_up: be lenient
                self._await_idle()
                save = self._current = SaveState(self.path, self.rank, staged=False)
            prefix = plan.storage_data
            if not isinstance(prefix, SavePrefix):  # planned without prepare_*_plan
                os.makedirs(self.path, exist_ok=True)
                generation = scan_directory(self.path, self._metadata_name(),
                                            self._owner_rank())
                prefix = SavePrefix(data_prefix(self.rank, generation), uuid.uuid4().hex, 1)
            save.prefix = prefix
            if self._rank_from_plan and prefix.rank is not None:
                self.rank = prefix.rank
                save.move(rank=prefix.rank)  # the timeline's rank too
            save.metadata_name = self._metadata_name()
            save.owner_rank = self._owner_rank()
            placed = run_save(save, plan, planner, self._res, directory=self.path,
                              prefix=prefix.prefix, buckets=self.buckets,
                              separation_hint=self.separation_hint, direct=self.direct,
                              sync=self.fsync, hook=self.io_hook)
        fut: Future = Future()
        fut.set_result(placed.results)
        return fut

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        """Commit ``.metadata`` in the background once every bucket of every rank succeeded.

        Inside ``dcp.async_save`` (after :meth:`stage`) this waits for the commit instead,
        so the async_save future reports the real outcome.
        """
        save = self._current
        if save is None or not save.submitted.is_set():
            raise WriterError("finish() called before write_data(): nothing to commit")
        start_commit(save, metadata, results, self.storage_meta(), sync=self.fsync,
                     hook=self.io_hook, timeout_s=self.commit_timeout_s)
        if save.staged:
            self._wait_save(save, None)

    def storage_meta(self) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        from torch.distributed.checkpoint.filesystem import FileSystem

        return FileSystem.validate_checkpoint_id(checkpoint_id)

    # -- internals ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise WriterError("this AsyncWriter was closed; create a new one")

    def _metadata_name(self) -> str:
        return METADATA if self.use_collectives else f"__{self.rank}{METADATA}"

    def _owner_rank(self) -> int | None:
        """Whose data files a save scans and removes: every rank's (None) when the
        coordinator commits for all, else only this rank's."""
        return None if self.use_collectives else self.rank

    def _take_generation(self) -> int:
        """The generation prepare_local_plan chose (scanning now if it did not run)."""
        generation, self._generation = self._generation, None
        if generation is None:
            os.makedirs(self.path, exist_ok=True)
            generation = scan_directory(self.path, self._metadata_name(), self._owner_rank())
        return generation

    def _await_idle(self, *, for_close: bool = False) -> None:
        """Before a new save: the previous one must be done (wait or raise), its error seen."""
        if self._current is not None:
            settle(self._current, raise_if_busy=self.on_busy == "raise" and not for_close,
                   timeout_s=self.commit_timeout_s)

    def _wait_save(self, save: SaveState, timeout: float | None) -> Timeline:
        return wait_for(save, timeout, self.commit_timeout_s)


# stage() is synchronous: DCP has nothing to wait for after it (a private AsyncStager flag)
setattr(AsyncWriter, async_stager_sync_attribute(), False)


def _drain_at_exit(ref: weakref.ReferenceType[AsyncWriter]) -> None:
    """At interpreter exit, let a pending save finish (daemon workers would die with it)."""
    writer = ref()
    if writer is None or writer._current is None:
        return
    save = writer._current
    try:
        if save.pending():
            writer._wait_save(save, writer.commit_timeout_s)
    except WriterError as exc:
        import sys

        print(f"ckptlab: an async save failed at exit: {exc}", file=sys.stderr)

