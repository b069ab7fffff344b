"""``AsyncWriter``: a DCP StorageWriter that returns once the tensors are copied and writes in
the background with large aligned writes, committing ``.metadata`` last."""

from __future__ import annotations

import atexit
import dataclasses
import io
import itertools
import os
import pickle
import re
import stat
import threading
import time
import uuid
import weakref
from concurrent.futures import Future as _CFuture
from concurrent.futures import wait as _cf_wait
from dataclasses import dataclass
from typing import Any, Literal

from ckptlab.errors import InvalidArgumentError, StorageIOError, WriterError
from ckptlab.plan.cache import fsync_dir, write_metadata
from ckptlab.write._blob import BlobTemplates
from ckptlab.write._io import (
    FileJob,
    IoHook,
    Segment,
    StagingArena,
    StagingState,
    WorkerPool,
    _FileWriter,
    align_up,
    place_item,
)
from ckptlab.write.buckets import BucketAssignment, assign_buckets, item_nbytes
from ckptlab.write.timeline import Timeline, _Recorder

try:  # the base classes are torch's; ckptlab.write needs torch anyway
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.checkpoint.storage import StorageWriter
except ImportError:  # pragma: no cover - torch built without distributed
    StorageWriter = object  # type: ignore[assignment,misc]
    AsyncStager = object  # type: ignore[assignment,misc]

__all__ = ["AsyncWriter", "SaveHandle"]

METADATA = ".metadata"
MARKER = ".ckptlab-"  # rank completion markers: .ckptlab-{token}-{rank}.ok / .err, {token}.failed
POLL_S = 0.01
# the data files this writer (and torch's FileSystemWriter, generation 0) names:
# [g{generation}]__{rank}_{bucket}.distcp
DATA_NAME = re.compile(r"^(?:g([1-9][0-9]*))?__([0-9]+)_([0-9]+)\.distcp$")
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)


def data_prefix(rank: int, generation: int) -> str:
    """The start of a data file name: ``__{rank}_`` (generation 0), ``g{N}__{rank}_``.

    A save into a directory that already holds data files uses the next generation, so it
    never writes a byte of a file the committed ``.metadata`` refers to.
    """
    return f"__{rank}_" if generation == 0 else f"g{generation}__{rank}_"


def _symlink_error(path: str) -> WriterError:
    try:
        target = os.readlink(path)
    except OSError:  # pragma: no cover - raced away
        target = "?"
    return WriterError(
        f"{path} is a symbolic link (to {target!r}): AsyncWriter never writes through, "
        "replaces or removes a link in a checkpoint directory; remove the link or save to "
        "another directory")


def _scan_directory(path: str, metadata_name: str, rank: int | None) -> int:
    """The generation a new save into ``path`` uses: one past every data file there.

    ``rank`` None: every rank's files count (the coordinator of a collective save), else
    only that rank's. Refuses (WriterError) a symbolic link at any name the save may write,
    replace or remove.
    """
    newest = -1
    try:
        entries = list(os.scandir(path))
    except OSError as exc:
        raise WriterError(f"cannot list the checkpoint directory {path}: {exc}") from exc
    for entry in entries:
        m = DATA_NAME.match(entry.name)
        ours = m is not None and (rank is None or int(m.group(2)) == rank)
        if not ours and entry.name not in (metadata_name, metadata_name + ".tmp"):
            continue
        if entry.is_symlink():
            raise _symlink_error(entry.path)
        if ours:
            newest = max(newest, int(m.group(1) or 0))  # type: ignore[union-attr]
    return newest + 1


@dataclass(frozen=True)
class _AsyncPrefix:
    """``SavePlan.storage_data`` of an AsyncWriter save: file prefix and the save's identity."""

    prefix: str  # data files are f"{prefix}{bucket}.distcp" (see data_prefix)
    token: str  # the same on every rank of one save (set by the coordinator)
    world: int  # ranks taking part; > 1 means ranks report completion through marker files


def _write_small(path: str, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, _NEW_FILE, 0o644)  # marker names are new (random token): never follow
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _read_small(path: str, *, binary: bool = False) -> Any:
    """A small file's text (or bytes), read without following a link."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return None if binary else f"(cannot read {path}: {exc})"
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return data if binary else data.decode("utf-8", errors="replace")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True, slots=True)
class _Copy:
    """One tensor chunk still to be copied into its staging slot."""

    bucket: int
    file: str
    slot: Any  # uint8 tensor over the slot
    tensor: Any  # the caller's tensor (CPU or device)
    nbytes: int
    ready: threading.Event


class _Save:
    """The state of one save (internal); :class:`SaveHandle` is its public face."""

    def __init__(self, path: str, rank: int, *, staged: bool) -> None:
        self.path = path
        self.rank = rank
        self.staged = staged  # stage() copied the tensors (dcp.async_save)
        self.recorder = _Recorder(path, rank)
        self.assignment = BucketAssignment((), None)
        self.futures: list[tuple[int, str, _CFuture]] = []  # (bucket, file, future)
        self.submitted = threading.Event()  # write_data handed the buckets to the workers
        self.local_done = threading.Event()  # every bucket finished (well or not)
        self.local_failures: dict[object, BaseException | str] = {}
        self.prefix: _AsyncPrefix | None = None
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

    # -- completion -----------------------------------------------------------------------
    def pending(self) -> bool:
        if self.staged and not self.submitted.is_set():
            return True
        if self.submitted.is_set() and not self.local_done.is_set():
            return True
        return self.commit_thread is not None and not self.finished.is_set()

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

    def __init__(self, save: _Save, writer: AsyncWriter) -> None:
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


class AsyncWriter(StorageWriter, AsyncStager):  # type: ignore[misc,valid-type]
    """A DCP ``StorageWriter`` that returns at memcpy speed and writes at disk speed.

    Use it wherever DCP takes a storage writer::

        writer = AsyncWriter("ckpt/step_100")
        dcp.save(state_dict, storage_writer=writer)   # returns once tensors are copied
        ...                                           # train on; mutate the state dict freely
        writer.wait()                                 # raises WriterError if anything failed

    or ``dcp.async_save(state_dict, storage_writer=writer)``, whose future then completes
    when the checkpoint is committed; if the save fails, the future raises DCP's
    ``CheckpointException`` wrapping the :class:`~ckptlab.errors.WriterError` (DCP wraps
    whatever ``finish`` raises), and :meth:`wait` raises the WriterError itself.
    Reuse one writer for every save: its workers and staging memory persist
    (``reset(checkpoint_id)`` or ``dcp.save(..., checkpoint_id=...)`` moves it to a new
    directory).

    What a save does:

    1. ``write_data`` splits the rank's items into ``buckets`` with :func:`assign_buckets`
       (one data file each), copies every tensor chunk into reusable page-aligned staging
       memory (a snapshot: the caller may change its tensors as soon as the call returns),
       places each item at a 4096-aligned file offset as a ``torch.save`` blob with storage
       alignment 4096 (so the tensor's bytes are 4096-aligned in the file), hands the
       buckets to the persistent worker threads, and returns the ``WriteResult`` s at once.
    2. Each worker writes its file with large aligned writes (``O_DIRECT`` where the
       filesystem accepts it, buffered writes otherwise), truncates it to size and fsyncs it.
    3. ``finish`` (the coordinator) pickles the metadata immediately and commits in the
       background, only after every bucket of every rank succeeded: ``.metadata.tmp`` is
       created new, written and fsynced, renamed to ``.metadata``, and the directory is
       fsynced. With more than one rank, ranks report their buckets' outcome through small
       marker files in the checkpoint directory, which the commit removes.
    4. Then the data files of the previous checkpoint (and whatever killed or failed saves
       left under the writer's file names) are removed: every ``[g{N}]__{rank}_{b}.distcp``
       the new ``.metadata`` does not refer to.

    **Overwriting never loses the previous checkpoint.** A save into a directory that holds
    data files writes the next *generation*: ``g{N}__{rank}_{bucket}.distcp`` with ``N``
    one past every generation there (a fresh directory gets FileSystemWriter's names,
    ``__{rank}_{bucket}.distcp``, generation 0). No byte of a file the committed
    ``.metadata`` refers to is written, and the old ``.metadata`` stays until the new one
    replaces it by rename, so a crash (``kill -9``), a full disk or any failure at any
    moment leaves the old checkpoint or the new one, loadable by stock ``dcp.load``, never
    none and never a mix (with ``sync_files=False`` this holds against process crashes, not
    power loss). Until the commit the disk holds both checkpoints. A failed save removes
    the files it created; a killed one leaves them for the next successful save to remove.
    Every file is created new (``O_EXCL``) and opened without following links
    (``O_NOFOLLOW``): a symbolic link at a name the save would write, replace or remove
    (data files, ``.metadata``, ``.metadata.tmp``) is refused with
    :class:`~ckptlab.errors.WriterError` naming it, and its target is never opened.

    The files are a standard DCP checkpoint: stock ``dcp.load`` (``FileSystemReader``) reads
    them.

    Parameters
    ----------
    path
        Checkpoint directory (created if missing).
    workers
        Persistent writer threads (see Notes for why threads).
    buckets
        Data files per rank; defaults to ``workers``.
    separation_hint
        Key prefix whose items get files of their own (see :func:`assign_buckets`).
    direct
        Try ``O_DIRECT`` (falls back to buffered writes where the filesystem refuses it).
    sync_files
        fsync data files, ``.metadata`` and the directory. Without it a crash can leave a
        committed checkpoint whose data is not on disk.
    overwrite
        Allow saving into a directory that holds a committed checkpoint (``.metadata``
        exists). The old checkpoint stays loadable until the new ``.metadata`` is renamed
        over it; its data files are removed after that. With False such a save raises
        :class:`~ckptlab.errors.WriterError` (DCP wraps it in ``CheckpointException``).
    on_busy
        What a new save does while the previous one is still writing: ``"wait"`` (default)
        blocks until it is done, ``"raise"`` raises :class:`~ckptlab.errors.WriterError`.
        Two saves never write at once, so staging memory is never shared.
    commit_timeout_s
        How long the coordinator waits for the other ranks' markers (and other ranks for
        the coordinator's verdict) before the save fails.
    io_hook
        For tests and tracing: ``io_hook(bucket, phase, file, offset, nbytes)`` is called on
        the worker before each ``"open"``, ``"write"`` and ``"fsync"``, and with ``bucket``
        None before the commit (``"commit"``), once ``.metadata.tmp`` is complete
        (``"rename"``) and before each removal of a data file (``"remove"``). What it
        raises fails that bucket or the commit as a real I/O error would (a ``"remove"``
        error only leaves that file for the next save).

    Notes
    -----
    **Threads, not processes.** A worker spends its time in ``pwrite`` and ``fsync``,
    which release the GIL, and in numpy copies of small pieces (which release it too); the
    staging copy happens in the caller (overlapping the first writes) before ``write_data``
    returns. Threads share the staging memory directly (no shared-memory segments, no
    pickling of buckets, no stale copy-on-write pages after ``fork``) and an exception in a
    worker arrives as the real exception object. Measured on 2 cores
    (``benchmarks/async_write.py``, 1 GiB, see ``benchmarks/README.md``): two threads wrote
    two files with O_DIRECT in 0.44 s, as fast as one thread (0.46 s), while two forked
    processes took 0.71 s and slowed a concurrent compute loop more (1.56x against 1.24x).
    A worker thread cannot be killed on its own; a dead *process* takes its workers with
    it, and since ``.metadata`` is renamed into place last, the directory then holds the
    previous checkpoint, or none if it had none (tests kill saving processes with SIGKILL
    at random moments over a committed checkpoint).

    **Errors are never dropped.** A failed save raises from :meth:`wait`, from the
    ``dcp.async_save`` future, or, if nobody asked, from the next save on this writer.
    At interpreter exit pending saves are waited for.

    Data files are named like ``FileSystemWriter``'s (``__{rank}_{bucket}.distcp``), with
    ``g{N}`` in front from the second generation in a directory on; bytes items come first
    in each file, then tensors, largest first. CRC fields of the
    ``torch.save`` blobs are 0 (as ``torch.serialization.set_crc32_options(False)`` writes
    them; ``torch.load`` does not check them).
    """

    _synchronize_after_execute = False  # stage() is synchronous: nothing to wait for later

    def __init__(self, path: str | os.PathLike[str], *, workers: int = 2,
                 buckets: int | None = None, separation_hint: str | None = None,
                 direct: bool = True, sync_files: bool = True, overwrite: bool = True,
                 on_busy: Literal["wait", "raise"] = "wait", commit_timeout_s: float = 600.0,
                 io_hook: IoHook | None = None) -> None:
        super().__init__()
        if type(workers) is not int or workers < 1:
            raise InvalidArgumentError(f"workers must be an int >= 1, got {workers!r}")
        buckets = workers if buckets is None else buckets
        if type(buckets) is not int or buckets < 1:
            raise InvalidArgumentError(f"buckets must be an int >= 1, got {buckets!r}")
        if on_busy not in ("wait", "raise"):
            raise InvalidArgumentError(f"on_busy must be 'wait' or 'raise', got {on_busy!r}")
        self.path = os.fspath(path)
        self.workers = workers
        self.buckets = buckets
        self.separation_hint = separation_hint
        self.direct = direct
        self.sync_files = sync_files
        self.overwrite = overwrite
        self.on_busy = on_busy
        self.commit_timeout_s = commit_timeout_s
        self.io_hook = io_hook
        self.save_id = uuid.uuid4().hex
        self._generation: int | None = None  # chosen by prepare_local_plan, used once
        self.rank = 0
        self.is_coordinator = True
        self.use_collectives = True
        self._pool = WorkerPool(workers)
        self._arena = StagingArena()
        self._templates = BlobTemplates()
        self._lock = threading.RLock()
        self._current: _Save | None = None
        self._closed = False
        atexit.register(_drain_at_exit, weakref.ref(self))

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
        return self._arena.capacity_nbytes

    def reserve(self, nbytes: int) -> None:
        """Allocate and fault in ``nbytes`` of staging memory now, off the critical path."""
        with self._lock:
            self._await_idle()
            self._arena.begin(nbytes)

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
            self._pool.close()
            self._arena.release()

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
            save = _Save(self.path, self.rank, staged=True)
            self._current = save
            t = save.recorder.now()
            self._arena.begin(_tensor_nbytes(state_dict))
            try:
                staged, nbytes = self._stage_tree(state_dict)
            except BaseException:
                save.staged = False  # nothing in flight: the next save may start
                raise
            save.recorder.add(None, "stage", t, nbytes)
            return staged

    def _stage_tree(self, obj: Any) -> tuple[Any, int]:
        import torch

        if isinstance(obj, torch.Tensor):
            to_local = getattr(obj, "to_local", None)
            if to_local is not None and hasattr(obj, "device_mesh"):
                from torch.distributed.tensor import DTensor

                local, n = self._stage_tensor(to_local())
                return DTensor.from_local(local, obj.device_mesh, obj.placements,
                                          run_check=False, shape=obj.shape,
                                          stride=obj.stride()), n
            if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
                return self._stage_tensor(obj)
            return obj.detach().clone(), 0  # other subclasses: a private copy
        if isinstance(obj, dict):
            out, total = {}, 0
            for k, v in obj.items():
                out[k], n = self._stage_tree(v)
                total += n
            return out, total
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            items = [self._stage_tree(v) for v in obj]
            return type(obj)(v for v, _ in items), sum(n for _, n in items)
        import copy

        return copy.deepcopy(obj), 0

    def _stage_tensor(self, tensor: Any) -> tuple[Any, int]:
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        slot, _ = self._arena.alloc(nbytes)
        out = slot.view(tensor.dtype).view(tensor.shape) if nbytes else \
            _empty_like(tensor)
        if nbytes:
            out.copy_(tensor)
        return out, nbytes

    def synchronize_staging(self) -> None:  # the protocol's hook; stage() is synchronous
        return None

    # -- StorageWriter ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        with self._lock:
            self._check_open()
            current = self._current
            adopting = current is not None and current.staged and not current.submitted.is_set()
            if not adopting:
                self._await_idle()
            if checkpoint_id:
                self.path = os.fspath(checkpoint_id)
                if adopting:
                    current.path = current.recorder.path = self.path
            self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self._check_open()
            self.is_coordinator = is_coordinator
            self.rank = int(kwargs.get("rank") or 0)
            self.use_collectives = kwargs.get("use_collectives", True)
            current = self._current
            if current is not None and current.staged and not current.submitted.is_set():
                current.rank = current.recorder.rank = self.rank
                current.path = current.recorder.path = self.path
            else:
                self._await_idle()
                self._current = _Save(self.path, self.rank, staged=False)
            self._current.is_coordinator = is_coordinator or not self.use_collectives

    def prepare_local_plan(self, plan: Any) -> Any:
        os.makedirs(self.path, exist_ok=True)
        meta = self._metadata_name()
        if self.is_coordinator or not self.use_collectives:
            meta_path = os.path.join(self.path, meta)
            if os.path.lexists(meta_path) and not self.overwrite:
                raise WriterError(
                    f"{self.path} already holds a checkpoint ({meta} exists) and "
                    "overwrite=False: pick a new directory or pass overwrite=True")
            # the old checkpoint stays whole: this save writes the next generation's file
            # names and the old files go only after the new .metadata is renamed in
            self._generation = _scan_directory(self.path, meta, self._owner_rank())
            for name in os.listdir(self.path):  # stale markers of an earlier failed save
                if name.startswith(MARKER) and self.use_collectives:
                    try:
                        os.unlink(os.path.join(self.path, name))
                    except FileNotFoundError:
                        pass
        if not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_AsyncPrefix(
                data_prefix(self.rank, self._take_generation()), uuid.uuid4().hex, 1))
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        token = uuid.uuid4().hex
        if all(isinstance(p.storage_data, _AsyncPrefix) for p in plans):
            return plans
        generation = self._take_generation()
        return [dataclasses.replace(p, storage_data=_AsyncPrefix(data_prefix(i, generation),
                                                                 token, len(plans)))
                if not isinstance(p.storage_data, _AsyncPrefix) else p
                for i, p in enumerate(plans)]

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Stage this rank's items, start the workers, return the results at once."""
        from torch.futures import Future

        with self._lock:
            self._check_open()
            save = self._current
            if save is None or save.submitted.is_set():  # called without set_up: be lenient
                self._await_idle()
                save = self._current = _Save(self.path, self.rank, staged=False)
            prefix = plan.storage_data
            if not isinstance(prefix, _AsyncPrefix):  # planned without prepare_*_plan
                os.makedirs(self.path, exist_ok=True)
                generation = _scan_directory(self.path, self._metadata_name(),
                                             self._owner_rank())
                prefix = _AsyncPrefix(data_prefix(self.rank, generation), uuid.uuid4().hex, 1)
            save.prefix = prefix
            save.metadata_name = self._metadata_name()
            save.owner_rank = self._owner_rank()
            try:
                results, jobs, copies = self._place(save, plan, planner)
            except BaseException:
                save.staged = False
                raise
            # every write covers whole 4096-byte blocks; the file is truncated after
            save.recorder.total_nbytes = sum(-(-job.nbytes // 4096) * 4096 for job in jobs)
            for job in jobs:  # the workers start on what is copied while the rest is copied
                fut = self._pool.submit(self._bucket_fn(job, save))
                save.futures.append((job.bucket, job.name, fut))
            save.submitted.set()
            threading.Thread(target=self._monitor, args=(save,), daemon=True,
                             name="ckptlab-writer-monitor").start()
            staging = jobs[0].staging if jobs else None
            try:
                self._copy(save, copies)
            except BaseException as exc:
                if staging is not None:
                    staging.abort(exc)  # the workers stop; nothing is committed
                raise
            save.recorder.returned_s = save.recorder.now()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        """Commit ``.metadata`` in the background once every bucket of every rank succeeded.

        Inside ``dcp.async_save`` (after :meth:`stage`) this waits for the commit instead,
        so the async_save future reports the real outcome.
        """
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        save = self._current
        if save is None or not save.submitted.is_set():
            raise WriterError("finish() called before write_data(): nothing to commit")
        t = save.recorder.now()
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)  # now: the caller may reuse the metadata object
        keep = frozenset(getattr(sd, "relative_path", None)
                         for sd in metadata.storage_data.values())
        save.recorder.add(None, "metadata", t, len(blob))
        save.commit_thread = threading.Thread(target=self._commit, args=(save, blob, keep),
                                              daemon=True, name="ckptlab-writer-commit")
        save.commit_thread.start()
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
        generation = self._generation
        self._generation = None
        if generation is None:
            os.makedirs(self.path, exist_ok=True)
            generation = _scan_directory(self.path, self._metadata_name(), self._owner_rank())
        return generation

    def _await_idle(self, *, for_close: bool = False) -> None:
        """Before a new save: the previous one must be done (wait or raise), its error seen."""
        prev = self._current
        if prev is None:
            return
        if prev.pending():
            if self.on_busy == "raise" and not for_close:
                raise WriterError(
                    f"a save to {prev.path} is still in flight and on_busy='raise'; call "
                    "wait() first (or use on_busy='wait')")
            if prev.staged and not prev.submitted.wait(self.commit_timeout_s):
                raise WriterError(
                    f"the state dict staged for {prev.path} was not written within "
                    f"{self.commit_timeout_s:.0f} s (did its dcp.async_save fail?); its "
                    "staging memory is still reserved, so this save cannot start")
            prev.local_done.wait()
            if prev.commit_thread is not None:
                prev.finished.wait()
        if prev.error is not None and not prev.error_seen:
            prev.error_seen = True
            raise WriterError(f"the previous save failed and nobody called wait(): {prev.error}",
                              prev.error.failures) from prev.error

    def _wait_save(self, save: _Save, timeout: float | None) -> Timeline:
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if not save.submitted.wait(left()) or not save.local_done.wait(left()):
            raise WriterError(f"the save to {save.path} did not finish within {timeout} s")
        if save.is_coordinator:
            if save.commit_thread is None:
                if save.error is None:
                    save.fail(f"the save to {save.path} never reached finish() (dcp.save "
                              "failed after write_data?); nothing was committed",
                              dict(save.local_failures))
            elif not save.finished.wait(left()):
                raise WriterError(f"the save to {save.path} did not commit within {timeout} s")
        else:
            self._await_verdict(save, left())
        save.freeze()
        if save.error is not None:
            save.error_seen = True
            raise save.error
        return save.timeline  # type: ignore[return-value]

    def _place(self, save: _Save, plan: Any, planner: Any) -> tuple[list[Any], list[FileJob],
                                                                   list[list[_Copy]]]:
        """Resolve every item, give each tensor a staging slot and each item its file offset.

        Nothing is copied yet: the copies (per bucket, in file order) are returned so that
        the workers can start as soon as the first ones land.
        """
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult

        rec = save.recorder
        t = rec.now()
        assignment = assign_buckets(plan.items, self.buckets, self.separation_hint)
        save.assignment = assignment
        if not save.staged:
            self._arena.begin(sum(align_up(item_nbytes(i)) for i in plan.items))
        staging = StagingState()
        results: list[Any] = []
        jobs: list[FileJob] = []
        copies: list[list[_Copy]] = []
        for bucket in assignment.buckets:
            if not bucket.items:
                continue
            name = f"{save.prefix.prefix}{bucket.index}{DEFAULT_SUFFIX}"  # type: ignore[union-attr]
            segments: list[Segment] = []
            todo: list[_Copy] = []
            cursor = 0
            for item in bucket.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    segments.append(Segment(cursor, raw))
                    results.append(WriteResult(index=item.index, size_in_bytes=len(raw),
                                               storage_data=_StorageInfo(name, cursor, len(raw))))
                    cursor += len(raw)
                    continue
                tensor = self._local_chunk(item, data)
                template = self._templates.get(tensor.dtype, tuple(tensor.shape))
                view = self._arena.find(tensor) if save.staged else None
                ready = None
                if view is None:
                    nbytes = tensor.numel() * tensor.element_size()
                    slot, view = self._arena.alloc(nbytes)
                    if nbytes:
                        ready = staging.event()
                        todo.append(_Copy(bucket.index, name, slot, tensor, nbytes, ready))
                start, cursor = place_item(cursor, template, view, segments, ready)
                results.append(WriteResult(index=item.index, size_in_bytes=template.nbytes,
                                           storage_data=_StorageInfo(name, start, template.nbytes)))
            jobs.append(FileJob(bucket.index, os.path.join(self.path, name), name,
                                tuple(segments), cursor, staging))
            copies.append(todo)
        rec.add(None, "plan", t)
        return results, jobs, copies

    def _copy(self, save: _Save, copies: list[list[_Copy]]) -> None:
        """Copy the tensors in, one item per bucket in turn, so every worker starts early."""
        rec = save.recorder
        spans: dict[int, list[Any]] = {}
        for batch in itertools.zip_longest(*copies):
            for c in batch:
                if c is None:
                    continue
                t = rec.now()
                c.slot.view(c.tensor.dtype).view(c.tensor.shape).copy_(c.tensor)
                c.ready.set()
                span = spans.setdefault(c.bucket, [t, 0.0, 0, c.file])
                span[1] = rec.now()
                span[2] += c.nbytes
        for bucket, (start, end, nbytes, file) in spans.items():
            rec.add_span(bucket, "stage", start, end, nbytes, file)

    def _local_chunk(self, item: Any, data: Any) -> Any:
        """The resolved tensor of a chunk, checked against the plan."""
        if hasattr(data, "to_local") and hasattr(data, "device_mesh"):
            data = data.to_local()
        data = data.detach()
        shape = tuple(item.tensor_data.chunk.sizes)
        if tuple(data.shape) != shape:
            raise WriterError(f"item {item.index.fqn}: the planner resolved a tensor of shape "
                              f"{tuple(data.shape)} for a chunk of shape {shape}")
        return data

    def _bucket_fn(self, job: FileJob, save: _Save) -> Any:
        def run(bounce: memoryview) -> int:
            writer = _FileWriter(job, bounce, direct=self.direct, sync=self.sync_files,
                                 recorder=save.recorder, hook=self.io_hook,
                                 created=save.created)
            writer.run()
            return writer.written
        return run

    def _monitor(self, save: _Save) -> None:
        """Wait for this rank's buckets; with several ranks, tell the coordinator."""
        _cf_wait([f for _, _, f in save.futures])
        for bucket, name, fut in save.futures:
            exc = fut.exception()
            if exc is not None:
                save.local_failures[f"rank {save.rank} bucket {bucket} ({name})"] = exc
        prefix = save.prefix
        if prefix is not None and prefix.world > 1:
            base = os.path.join(save.path, f"{MARKER}{prefix.token}-{save.rank}")
            try:
                if save.local_failures:
                    text = "; ".join(f"{k}: {_describe(v) if isinstance(v, BaseException) else v}"
                                     for k, v in save.local_failures.items())
                    _write_small(base + ".err", text.encode(), sync=False)
                else:
                    _write_small(base + ".ok", b"", sync=False)  # data files are fsynced
            except OSError as exc:
                save.local_failures[f"rank {save.rank} marker"] = exc
        if save.local_failures:  # this save cannot commit: free the space its files took
            self._remove_files(save, save.created)
        if not save.is_coordinator and save.local_failures:
            save.fail(self._message(save, save.local_failures), dict(save.local_failures))
        save.local_done.set()

    def _await_verdict(self, save: _Save, timeout: float | None) -> None:
        """Non-coordinator: wait until the coordinator committed (our marker consumed and
        .metadata present) or reported failure."""
        prefix = save.prefix
        if save.error is not None or prefix is None or prefix.world <= 1:
            save.finished.set()
            return
        ok = os.path.join(save.path, f"{MARKER}{prefix.token}-{save.rank}.ok")
        failed = os.path.join(save.path, f"{MARKER}{prefix.token}.failed")
        meta = os.path.join(save.path, save.metadata_name)
        limit = self.commit_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            if os.path.exists(failed):
                text = _read_small(failed)
                save.fail(f"the coordinator did not commit {save.path}: {text}",
                          {"coordinator": text})
                break
            if not os.path.exists(ok) and os.path.exists(meta):
                save.committed = True
                break
            if time.monotonic() > deadline:
                save.fail(f"no verdict from the coordinator on {save.path} within {limit:.0f} s",
                          {"coordinator": "timeout"})
                break
            time.sleep(POLL_S)
        save.finished.set()

    def _message(self, save: _Save, failures: dict[object, BaseException | str]) -> str:
        key, first = next(iter(failures.items()))
        what = _describe(first) if isinstance(first, BaseException) else str(first)
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return (f"async save to {save.path} failed: {key}: {what}{more}; no {save.metadata_name} "
                "was written, so the directory still holds its previous checkpoint, if it had "
                "one (this save wrote only new file names; other directories were not touched)")

    def _remove_files(self, save: _Save, names: Any) -> int:
        """Unlink regular files among ``names`` in the save's directory; errors ignored (a
        later save removes what is left). ``names`` a dict: only files whose (dev, ino) match.
        """
        removed = 0
        for name in sorted(names):
            path = os.path.join(save.path, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    continue  # never a link, never a directory
                if isinstance(names, dict) and names[name] != (st.st_dev, st.st_ino):
                    continue  # not the file this save created
                if self.io_hook is not None:
                    self.io_hook(None, "remove", name, 0, st.st_size)
                os.unlink(path)
                removed += 1
            except Exception:  # the checkpoint's fate does not hang on a leftover file
                continue
        return removed

    def _remove_stale(self, save: _Save, keep: frozenset[str | None]) -> None:
        """After the commit: remove every data file of the writer's naming (this rank's, or
        every rank's for a collective save) that the new ``.metadata`` does not refer to:
        the previous generation, and what killed or failed saves left."""
        owner = save.owner_rank
        try:
            names = os.listdir(save.path)
        except OSError:
            return
        stale = [n for n in names if n not in keep and (m := DATA_NAME.match(n)) is not None
                 and (owner is None or int(m.group(2)) == owner)]
        if stale and self._remove_files(save, stale) and self.sync_files:
            try:
                fsync_dir(save.path)
            except OSError:
                pass

    def _commit(self, save: _Save, blob: bytes, keep: frozenset[str | None]) -> None:
        rec = save.recorder
        try:
            save.local_done.wait()
            failures: dict[object, BaseException | str] = dict(save.local_failures)
            prefix = save.prefix
            if prefix is not None and prefix.world > 1:
                t = rec.now()
                failures.update(self._collect_markers(save, prefix))
                rec.add(None, "wait_ranks", t)
            if failures:
                err = save.fail(self._message(save, failures), failures)
                if prefix is not None and prefix.world > 1:
                    try:
                        _write_small(os.path.join(save.path, f"{MARKER}{prefix.token}.failed"),
                                     str(err).encode(), sync=False)
                    except OSError:
                        pass
                return
            t = rec.now()
            try:
                hook = self.io_hook
                if hook is not None:
                    hook(None, "commit", save.metadata_name, 0, len(blob))
                write_metadata(save.path, blob, save.metadata_name, sync=self.sync_files,
                               before_rename=None if hook is None else lambda: hook(
                                   None, "rename", save.metadata_name, 0, len(blob)))
            except Exception as exc:
                meta = os.path.join(save.path, save.metadata_name)
                io_err = exc if not isinstance(exc, OSError) or isinstance(exc, StorageIOError) \
                    else StorageIOError(f"commit failed: {exc.strerror or exc}", path=meta,
                                        offset=0, nbytes=len(blob), errno=exc.errno)
                save.fail(self._message(save, {"commit": io_err}), {"commit": io_err})
                if _read_small(os.path.join(save.path, save.metadata_name), binary=True) != blob:
                    self._remove_files(save, save.created)  # not renamed in: free the space
                if prefix is not None and prefix.world > 1:
                    try:
                        _write_small(os.path.join(save.path, f"{MARKER}{prefix.token}.failed"),
                                     str(save.error).encode(), sync=False)
                    except OSError:
                        pass
                return
            save.committed = True
            rec.add(None, "commit", t, len(blob), save.metadata_name)
            if prefix is not None and prefix.world > 1:
                for name in os.listdir(save.path):
                    if name.startswith(f"{MARKER}{prefix.token}-"):
                        try:
                            os.unlink(os.path.join(save.path, name))
                        except FileNotFoundError:
                            pass
            self._remove_stale(save, keep)
        except BaseException as exc:  # pragma: no cover - a bug: still report it
            save.fail(self._message(save, {"commit": exc}), {"commit": exc})
        finally:
            save.freeze()
            save.finished.set()

    def _collect_markers(self, save: _Save, prefix: _AsyncPrefix) -> dict[object, str]:
        """Wait for every other rank's marker; their errors, by rank."""
        waiting = set(range(prefix.world)) - {save.rank}
        failures: dict[object, str] = {}
        deadline = time.monotonic() + self.commit_timeout_s
        while waiting:
            for r in sorted(waiting):
                base = os.path.join(save.path, f"{MARKER}{prefix.token}-{r}")
                if os.path.exists(base + ".ok"):
                    waiting.discard(r)
                elif os.path.exists(base + ".err"):
                    failures[f"rank {r}"] = _read_small(base + ".err")
                    waiting.discard(r)
            if waiting and time.monotonic() > deadline:
                for r in sorted(waiting):
                    failures[f"rank {r}"] = (f"no completion marker within "
                                             f"{self.commit_timeout_s:.0f} s (rank died?)")
                break
            if waiting:
                time.sleep(POLL_S)
        return failures


def _empty_like(tensor: Any) -> Any:
    import torch

    return torch.empty(tensor.shape, dtype=tensor.dtype)


def _tensor_nbytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") and hasattr(obj, "device_mesh") \
            else obj
        return align_up(local.numel() * local.element_size())
    if isinstance(obj, dict):
        return sum(_tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_nbytes(v) for v in obj)
    return 0


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
