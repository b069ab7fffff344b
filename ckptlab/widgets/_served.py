"""One checkpoint as a server shows it to every session: the index now, the rest later.

:class:`ServedCheckpoint` holds what all sessions share: the index and the tensor table's rows
from the start (from the quick page, the on-disk index cache, or an open), then the opened
:class:`~ckptlab.checkpoint.Checkpoint`, its safety verdict and byte maps, loaded on a thread
(:meth:`ServedCheckpoint.start_loading`). :class:`PendingCheckpoint` makes it on a thread so
that the port opens first.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptlab.checkpoint._cache import CheckpointIndex, InspectionCache
from ckptlab.errors import ArchiveError
from ckptlab.format import ArchiveLayout
from ckptlab.viz import ByteMap
from ckptlab.viz.checkpoint import safety_badge
from ckptlab.widgets._layout_app import LayoutCache, alignment_options, own_alignment
from ckptlab.widgets._plotly_page import warm_plotly
from ckptlab.widgets._tensor_table import index_summary_html, objects_html
from ckptlab.widgets.quick import CheckpointRows, Pending

# the full open starts this long after serving if no page asked first (a page asks once it
# has loaded: a thread opening the file while the first page loads slows that page 3x)
LOAD_FALLBACK_S = 30.0
# up to this many tensors the whole checkpoint is opened before serving (under a second); past
# it the table paints first and the byte map follows
EAGER_TENSORS = 20_000


def _index_differs(seen: CheckpointIndex, now: CheckpointIndex) -> str:
    """What differs between two indexes of one checkpoint in what the pages show (names,
    dtypes, shapes, parts and their places), in words; "" when nothing does."""
    for what in ("names", "dtypes", "shapes", "part_start", "part_file", "part_offset",
                 "part_nbytes", "files"):
        if tuple(getattr(seen, what)) != tuple(getattr(now, what)):
            return f"its {what.replace('_', ' ')} differ"
    return ""


class ServedCheckpoint:
    """One checkpoint as a server shows it to every session: the index now, the rest later.

    ``index`` (a :class:`~ckptlab.checkpoint._cache.CheckpointIndex`) and ``frame`` (the
    tensor table's rows) are there from the start: those of ``rows`` (the
    :class:`~ckptlab.widgets.quick.CheckpointRows` the quick page served), else read from
    ``inspection_cache`` when the checkpoint was seen before, else from opening it (then
    stored). ``checkpoint`` (the opened :class:`~ckptlab.checkpoint.Checkpoint`) and the byte
    maps come from :meth:`load`, which :meth:`start_loading` runs on a thread; ``ready`` is
    set when they are there (or ``error`` says why they are not). Shared by sessions: holds
    frozen data only.

    Parameters
    ----------
    path
        A checkpoint file or directory (anything :func:`ckptlab.open` reads).
    inspection_cache
        The on-disk cache of indexes; None opens the checkpoint without one.
    layout_cache
        The torch.save what-if views shared by sessions (a new :class:`LayoutCache` if None).
    rows
        The checkpoint's rows, made already (then ``inspection_cache`` is not read).
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 inspection_cache: InspectionCache | None = None,
                 layout_cache: LayoutCache | None = None,
                 rows: CheckpointRows | None = None) -> None:
        self.path = os.fspath(path)
        self.layout_cache = layout_cache if layout_cache is not None else LayoutCache()
        self.inspection_cache = inspection_cache
        start = time.perf_counter()
        if rows is None:
            rows = CheckpointRows(self.path, inspection_cache=inspection_cache)
        self.rows = rows
        self.index = rows.index
        self.checkpoint = rows.checkpoint
        self.from_cache = rows.from_cache
        self.frame = rows.frame
        self.catalog = rows.catalog  # the one tensor query's, shared with the quick page
        self.summary_html = index_summary_html(self.index)  # what every session shows first
        self.objects_html = objects_html(self.index.objects)
        self.index_s = rows.index_s + time.perf_counter() - start
        self.ready = threading.Event()
        self.error: str | None = None
        # is it safe to load? (ckptlab.scan, run by load(): it imports torch for its rules)
        self.safety_html = "<i>Checking whether it is safe to load…</i>"
        self.safety_done = threading.Event()  # set once safety_html holds the verdict
        # every tensor's statistics (ckptlab.stats), measured once on demand for all sessions
        self.stats: dict[str, Any] | None = None
        self.stats_measured = 0  # tensors measured so far (the progress the pages show)
        self.stats_error: str | None = None
        self._lock = threading.Lock()
        self._started_jobs: set[str] = set()  # the jobs of _once_on_thread started
        self._started = False
        self._bytemaps: OrderedDict[str, ByteMap] = OrderedDict()
        self._file_parts: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @property
    def is_zip(self) -> bool:
        """A single torch.save zip: alignment is the writer's choice, records are shown."""
        return self.index.format == "torch-zip" and len(self.index.files) == 1

    def full_path(self, rel: str) -> str:
        """Where file ``rel`` of the checkpoint is on disk."""
        if os.path.isdir(self.path):
            return os.path.join(self.path, rel)
        return self.path

    def schedule_load(self) -> None:
        """Start the full open: now for a small checkpoint (up to ``EAGER_TENSORS`` tensors:
        every page draws its byte map as soon as its plotly.js is in), else on a timer
        (``LOAD_FALLBACK_S``; the first page's draw usually starts it sooner)."""
        _schedule_load(self)

    def start_loading(self) -> None:
        """Run :meth:`load` on a thread, then import what panel's plotly pane imports on
        first use (once; later calls do nothing).

        That import (plotly's figure widget module, with nbformat and jsonschema) takes
        1.8 s of CPU; done here, after the first page, neither the port nor the table waits
        for it, and it is done when a page's plotly.js has arrived.
        """
        with self._lock:
            if self._started or self.ready.is_set():  # opened before serving: nothing to do
                return
            self._started = True
        threading.Thread(target=self._load_and_warm, name="ckptlab-open", daemon=True).start()

    def _load_and_warm(self) -> None:
        self.load()
        warm_plotly()

    def load(self) -> None:
        """Open the checkpoint (when the index came from the cache) and build what the byte
        maps need; sets ``ready``. Errors are kept in ``error`` (shown by the sessions).
        Once ``ready``, later calls do nothing."""
        if self.ready.is_set():
            return
        try:
            if self.checkpoint is None:
                from ckptlab.checkpoint.open import open_checkpoint

                opened = open_checkpoint(self.path)
                changed = _index_differs(self.index, CheckpointIndex.from_checkpoint(opened))
                if changed:  # the table (a cached index) and the maps would disagree
                    raise ArchiveError(f"the checkpoint changed since its index was read "
                                       f"({changed}); restart the server to see it as it is",
                                       path=self.path)
                self.checkpoint = opened
            if self.is_zip:
                layout = self.checkpoint.files[0].layout
                self.layout_cache.view(layout, own_alignment(layout))
                self.layout_cache.costs(layout, alignment_options(layout))
            else:
                self.bytemap(self.default_file())
        except Exception as exc:  # any failure (a bug too): every session shows it
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.checkpoint is None and self.error is None:
                self.error = "the checkpoint could not be opened"
            if self.checkpoint is None:  # nothing to scan: the pages say why
                self.safety_html = "<i>Not checked: the checkpoint could not be opened.</i>"
                self.safety_done.set()
            self.ready.set()

    def check_safety(self) -> None:
        """Scan the opened checkpoint (:func:`ckptlab.scan`) on a thread of its own, once;
        ``safety_html`` holds the verdict and ``safety_done`` is set when it is there. Its
        rules come from torch (about 1.7 s to import), which neither the table nor the byte
        map needs: the sessions start it once their page is drawn, and show it when ready."""
        self._once_on_thread("scan", self._check_safety)

    def _check_safety(self) -> None:
        try:
            self.safety_html = safety_badge(self.checkpoint)
        except Exception as exc:  # any failure (a bug too): the pages say it
            self.safety_html = (f"<b>Whether it is safe to load could not be checked:</b> "
                                f"{type(exc).__name__}: {exc}")
        finally:
            self.safety_done.set()

    def measure_all(self) -> None:
        """Measure every tensor (:func:`ckptlab.stats`, one tensor at a time) on a thread,
        once for all sessions; ``stats`` is set when done (``stats_error`` says why not).
        Call it once the checkpoint is ``ready``; later calls do nothing."""
        self._once_on_thread("stats", self._measure)

    def _once_on_thread(self, job: str, target: Callable[[], None]) -> None:
        """Run ``target`` on a thread of its own (``ckptlab-<job>``), the first time only,
        and only once the checkpoint is open."""
        with self._lock:
            if job in self._started_jobs or self.checkpoint is None:
                return
            self._started_jobs.add(job)
        threading.Thread(target=target, name=f"ckptlab-{job}", daemon=True).start()

    def _measure(self) -> None:
        from ckptlab.compare import stats

        def measured(_: str) -> None:
            self.stats_measured += 1

        try:
            self.stats = stats(self.checkpoint, measured=measured)
        except Exception as exc:  # any failure (a bug too): the pages say it
            self.stats_error = f"{type(exc).__name__}: {exc}"

    def default_file(self) -> str:
        """The file the map shows first: the largest one holding tensor bytes."""
        holding = set(self.index.part_file)
        files = self.index.files
        ranked = sorted(range(len(files)), key=lambda i: (i not in holding, -files[i][2], i))
        return files[ranked[0]][0] if ranked else ""

    def bytemap(self, rel: str) -> ByteMap:
        """The byte map of file ``rel`` (built once; the 8 last used are kept)."""
        with self._lock:
            bm = self._bytemaps.get(rel)
            if bm is not None:
                self._bytemaps.move_to_end(rel)
                return bm
        ck = self.checkpoint
        bm = ByteMap.from_checkpoint(ck, rel)
        with self._lock:
            self._bytemaps[rel] = bm
            while len(self._bytemaps) > 8:
                self._bytemaps.popitem(last=False)
        return bm

    def file_layout(self, rel: str) -> ArchiveLayout | None:
        """The file's layout for the hex view's colours (None where the model has none)."""
        if self.checkpoint is None:
            return None
        try:
            layout = self.checkpoint.file(rel).layout
        except KeyError:
            return None
        if isinstance(layout, ArchiveLayout):
            return layout
        with self._lock:
            bm = self._bytemaps.get(rel)
        return bm.layout if bm is not None else None

    def tensor_at(self, rel: str, offset: int) -> int | None:
        """The row of a tensor with a part holding byte ``offset`` of file ``rel``."""
        with self._lock:
            found = self._file_parts.get(rel)
        if found is None:
            idx = self.index
            fid = next((i for i, f in enumerate(idx.files) if f[0] == rel), -1)
            pfile = np.asarray(idx.part_file, dtype=np.int64)
            sel = np.flatnonzero(pfile == fid)
            starts = np.asarray(idx.part_offset, dtype=np.int64)[sel]
            ends = starts + np.maximum(np.asarray(idx.part_nbytes, dtype=np.int64)[sel], 1)
            rows = np.searchsorted(np.asarray(idx.part_start, dtype=np.int64), sel,
                                   side="right") - 1
            order = np.argsort(starts, kind="stable")
            found = (starts[order], ends[order], rows[order])
            with self._lock:
                self._file_parts[rel] = found
        starts, ends, rows = found
        hi = int(np.searchsorted(starts, offset, side="right"))
        for i in range(hi - 1, max(hi - 65, -1), -1):  # parts that start before it, nearest first
            if ends[i] > offset:
                return int(rows[i])
        return None


def _schedule_load(served: ServedCheckpoint) -> None:
    """Start the full open: now for a small checkpoint, with the import its first byte map
    would make (plotly's figure widget: done here, not in a session on the server's IOLoop),
    else on a timer (the first page's draw usually starts it sooner)."""
    if len(served.index) <= EAGER_TENSORS:
        served._load_and_warm()
    else:
        timer = threading.Timer(LOAD_FALLBACK_S, served.start_loading)
        timer.daemon = True
        timer.start()


class PendingCheckpoint(Pending):
    """A :class:`ServedCheckpoint` being made on a thread, so that the port opens first (a
    :class:`~ckptlab.widgets.quick.Pending`).

    At 100,000 tensors without a cached index, the index is the file's open (seconds): the
    server listens meanwhile and every page shows a progress state (:class:`IndexProgress`)
    until ``done`` is set; then ``served`` is the checkpoint, or ``error`` says why there is
    none. Past ``EAGER_TENSORS`` tensors the byte maps' open is left to the first page (or
    ``LOAD_FALLBACK_S`` later); below, it is done here, before ``done``.

    Parameters
    ----------
    path
        A checkpoint file or directory.
    inspection_cache, layout_cache
        As for :class:`ServedCheckpoint`.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 inspection_cache: InspectionCache | None = None,
                 layout_cache: LayoutCache | None = None) -> None:
        super().__init__(path)
        self.served: ServedCheckpoint | None = None
        self._inspection_cache = inspection_cache
        self._layout_cache = layout_cache
        self.start()

    def make(self) -> None:
        served = ServedCheckpoint(self.path, inspection_cache=self._inspection_cache,
                                  layout_cache=self._layout_cache)
        _schedule_load(served)
        self.served = served
