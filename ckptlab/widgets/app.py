"""The served workbench: a panel app over the same figures (``ckptlab serve [PATH]``).

Everything is served from the local server: BokehJS, panel's and plotly's JavaScript come
with the app (no CDN), so it works on a cluster node without internet.

Tensor first, any format. :class:`CheckpointApp` opens on what :func:`ckptlab.open` reads (a
torch.save file, safetensors, a Hugging Face or DCP directory, legacy, TorchScript, .pt2): a
summary with totals by dtype, a searchable, sortable tensor table (the browser gets one page
of rows at a time; filter and sort run on the server), the non-tensor values, and the byte
map of a file with the selected tensor's parts outlined and its first bytes in hex.
Multi-file checkpoints get a file picker and a bytes-per-file overview. A torch.save zip also
gets :class:`LayoutApp`, the records and the alignment what-if, since there alignment is the
writer's choice.

First paint comes from the index. The table and the totals need only a
:class:`~ckptlab.checkpoint._cache.CheckpointIndex`, which :class:`ServedCheckpoint` reads from
the on-disk :class:`~ckptlab.checkpoint._cache.InspectionCache` when the file was seen before
(a fraction of a second at 100,000 tensors, where opening the file takes seconds). It is made
on a thread (:class:`PendingCheckpoint`): the port opens at once, or as soon as a cached or
small index is there, and a page that comes before the index shows the checkpoint's name and
how long it has been read (:class:`IndexProgress`), then the app in its place. The full
:class:`~ckptlab.checkpoint.Checkpoint`, which the byte map needs, is then opened on a thread
once the first page has been drawn, and every session draws its map when it is there.
Such a page comes without plotly.js (4.8 MB of its 8 MB of JavaScript): :class:`PlotlyLoader`
adds it after the table is drawn, and only then does the session add its plotly panes. The
imports behind the served app are the app's own (``ckptlab.widgets`` imports its notebook
explorers, and ipywidgets with them, only on first use); panel's plotly pane imports its
figure widget module (nbformat, jsonschema: seconds) on the loading thread, not before the
port opens.

``ckptlab serve`` comes sooner still: :func:`ckptlab.widgets.quick.serve` answers the port
with a quick page of the table (the same rows, :class:`~ckptlab.widgets.quick.CheckpointRows`)
before panel is even imported, then hands the port to the server of :func:`workbench_server`,
which listens on no port of its own. :func:`serve` here is the workbench alone (panel's own
server on the port), for a layout, a :class:`ServedCheckpoint`, or a caller that wants no
quick page.

Many sessions, one server. Panel runs every session's callbacks on one thread, so what a
session costs is what the next visitor waits for. Work that depends only on the file and an
alignment (the what-if layout, its byte map arrays, its summary, the alignment costs) is done
once per (file, alignment) in a :class:`LayoutCache` that the server owns and every session
reads; the tensor table's rows and the per-file byte maps are held once by the
:class:`ServedCheckpoint`. A session keeps only its own figures and widgets, and they are
freed when panel ends the session (``pn.state.on_session_destroyed``). The caches hold frozen
data and never a session's objects, and they are bounded (least recently used views go first).
"""

from __future__ import annotations

import ctypes
import gc
import html
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import panel as pn
import param

from ckptlab.checkpoint._cache import CheckpointIndex, InspectionCache
from ckptlab.errors import ArchiveError, CkptlabError, InvalidArgumentError
from ckptlab.format import AlignmentCost, ArchiveLayout, alignment_costs, read_range, realign
from ckptlab.format.predict import DEFAULT_ALIGNMENTS
from ckptlab.viz import (
    ByteMap,
    alignment_figure,
    bytemap_figure,
    hex_html,
    overhead_figure,
    storage_figure,
)
from ckptlab.viz._style import html_table, human_nbytes, plain_text
from ckptlab.viz.checkpoint import safety_badge
from ckptlab.widgets import _compat
from ckptlab.widgets._common import (
    HEX_NBYTES,
    LayoutSource,
    as_layout,
    item_options,
    item_tensor_rows,
    summary_html,
)
from ckptlab.widgets._tensor_table import (
    TABLE_CSS,
    TensorTable,
    index_summary_html,
    objects_html,
    tensor_details_html,
)
from ckptlab.widgets.quick import CheckpointRows, Pending

__all__ = ["CheckpointApp", "IndexProgress", "LayoutApp", "LayoutCache", "LayoutView",
           "PendingCheckpoint", "PlotlyLoader", "ServedCheckpoint", "serve", "workbench_server"]

PROMPT = "<i>Click the byte map or pick an item.</i>"
TENSOR_PROMPT = "<i>Pick a tensor in the table to see its parts, its bytes on the map and hex.</i>"
# A session nobody is connected to ends after SESSION_LIFETIME_MS (bokeh's default: a page
# connects its websocket only once its scripts ran, seconds after the GET that built its
# session on a busy machine). Bokeh looks for such sessions every 17 s by default; every 2 s,
# a closed page's session is freed 15-17 s after it closed.
SESSION_CHECK_MS = 2_000
SESSION_LIFETIME_MS = 15_000
POLL_MS = 300  # how often a session looks whether the byte map's data has arrived
# the full open starts this long after serving if no page asked first (a page asks once it
# has loaded: a thread opening the file while the first page loads slows that page 3x)
LOAD_FALLBACK_S = 30.0
# up to this many tensors the whole checkpoint is opened before serving (under a second); past
# it the table paints first and the byte map follows
EAGER_TENSORS = 20_000
# how long serve() waits for the index before it opens the port anyway (a cached index or a
# small file is there within it, and panel's warm-up session then builds the whole app); past
# it, pages show a progress state until the index is there
INDEX_WAIT_S = 1.0
MAX_FILES_LISTED = 1000  # file picker entries (the largest files, and the one shown)
MAX_SEARCH = 1000  # characters of a search carried over from the quick page (``?q=``)


def _index_differs(seen: CheckpointIndex, now: CheckpointIndex) -> str:
    """What differs between two indexes of one checkpoint in what the pages show (names,
    dtypes, shapes, parts and their places), in words; "" when nothing does."""
    for what in ("names", "dtypes", "shapes", "part_start", "part_file", "part_offset",
                 "part_nbytes", "files"):
        if tuple(getattr(seen, what)) != tuple(getattr(now, what)):
            return f"its {what.replace('_', ' ')} differ"
    return ""


class PlotlyLoader(pn.reactive.ReactiveHTML):
    """Loads plotly.js into the page once the page is up, and says so (``loaded``).

    plotly.js is 4.8 MB of the first page's 8 MB of JavaScript; the tensor table does not
    need it. A served page is sent without it (see :func:`_page_without_plotly`); this
    invisible element, placed where the byte map will go, adds plotly.js's ``<script>`` (from
    the local server, as panel itself would) after the table has rendered and sets ``loaded``
    when ``window.Plotly`` is there: only then does the session add its plotly panes, whose
    views need ``window.Plotly`` when they render.

    (Its name has no leading underscore because bokehJS cannot resolve a component class
    whose name starts with one.)
    """

    rendered = param.Boolean(default=False, doc="the page has drawn this element")
    loaded = param.Boolean(default=False, doc="plotly.js has run in the page")
    failed = param.Boolean(default=False, doc="plotly.js could not be loaded")
    src = param.String(default="", doc="plotly.js's URL, relative to the page")

    _template = '<div id="ckptlab_plotly_loader" class="ckptlab-plotly-loader"></div>'
    _scripts: ClassVar[dict[str, str]] = {"render": """
      data.rendered = true
      if (window.Plotly) { data.loaded = true; return }
      const id = 'ckptlab-plotly-js'
      let tag = document.getElementById(id)
      if (tag == null) {
        tag = document.createElement('script')
        tag.id = id
        tag.src = new URL(data.src, document.baseURI).href
        document.head.appendChild(tag)
      }
      tag.addEventListener('load', () => { data.loaded = true })
      tag.addEventListener('error', () => { data.failed = true })
    """}


def _warm_plotly() -> None:
    """Import what the first ``pn.pane.Plotly`` of a process imports (``go.FigureWidget``)."""
    import plotly.graph_objs as go

    try:
        go.FigureWidget  # noqa: B018 - the attribute access is the import
    except ImportError:  # the pane does without the figure widget (no anywidget)
        pass


def _plotly_src() -> str:
    """The URL (relative to the page) of the plotly.js that panel serves."""
    return _compat.panel_plotly_js_url()


def _page_without_plotly(doc: Any) -> bool:
    """Send session ``doc``'s page without plotly.js (and its stylesheet); True if done.

    Panel puts on a page the JavaScript of every extension model imported in the server
    process (once one session drew a byte map, every later page would carry plotly.js)
    unless the document has its own list of extensions: give it one without plotly. It is
    panel's private ``state._extensions_`` (panel 1.x); where that is missing the page simply
    carries plotly.js, as before.
    """
    table = _compat.panel_document_extensions()
    if doc is None or table is None:
        return False
    try:
        table[doc] = [name for name in table.get(doc, ["tabulator"]) if name != "plotly"] or (
            ["tabulator"])
    except TypeError:
        return False
    return True


def _sent_without_plotly(doc: Any) -> bool:
    """Whether session ``doc``'s page went out without plotly.js and has not loaded it since
    (a page that showed the index's progress first: its byte map, even one ready now, waits
    for :class:`PlotlyLoader`). Panel's own per-document extension list says so."""
    table = _compat.panel_document_extensions()
    try:
        return table is not None and doc in table and "plotly" not in table[doc]
    except TypeError:
        return False


def _plotly_now_loaded(doc: Any) -> None:
    """Tell panel that ``doc``'s page has plotly.js now (so a new Plotly pane does not warn
    that its extension is missing)."""
    table = _compat.panel_document_extensions()
    if doc is not None and table is not None and doc in table and "plotly" not in table[doc]:
        table[doc].append("plotly")


def _alignment_options(layout: ArchiveLayout) -> list[int]:
    return sorted(set(DEFAULT_ALIGNMENTS) | {layout.storage_alignment or 64})


def _own_alignment(layout: ArchiveLayout) -> int:
    return layout.storage_alignment or 64


def _relayout_x_range(data: dict[str, Any] | None) -> tuple[bool, tuple[float, float] | None]:
    """What a plotly ``relayout`` event says of the x axis: ``(True, (lo, hi))`` for a zoom,
    ``(True, None)`` for autorange (the whole file), ``(False, None)`` for anything else."""
    data = data or {}
    if "xaxis.range[0]" in data and "xaxis.range[1]" in data:
        return True, (data["xaxis.range[0]"], data["xaxis.range[1]"])
    if "xaxis.range" in data:
        return True, tuple(data["xaxis.range"])
    return bool(data.get("xaxis.autorange")), None


@dataclass(frozen=True, slots=True, eq=False)
class LayoutView:
    """A checkpoint's layout at one storage alignment, as every session shows it.

    Shared by sessions, so never changed: figures are built from it per session.
    """

    alignment: int
    layout: ArchiveLayout  # the file itself at its own alignment, else the what-if layout
    bytemap: ByteMap  # the arrays the byte map is binned from
    title: str | None  # the byte map's title; None: the file's own (bytemap_figure's default)
    summary: str  # summary_html(layout)


def _file_identity(layout: ArchiveLayout) -> Hashable:
    """The file a layout was read from, as the cache keys it: path, inode, size and mtime
    (a rewritten file is another file), or the layout object itself when there is no file
    behind it (bytes, a predicted layout)."""
    path = layout.path
    if not path.startswith("<"):
        try:
            st = os.stat(path)
        except OSError:
            pass
        else:
            return ("file", os.path.realpath(path), st.st_dev, st.st_ino, st.st_size,
                    st.st_mtime_ns, layout.file_nbytes)
    return ("object", id(layout))


class LayoutCache:
    """Per-file, per-alignment work done once and shared by every session of a server.

    :meth:`view` gives the :class:`LayoutView` of a layout at an alignment (the what-if layout
    is placed by :func:`ckptlab.format.realign`, and its byte map arrays built, on the first request
    only); :meth:`costs` gives :func:`ckptlab.format.alignment_costs` of a file once. Keys are the
    file's identity (path, inode, size, mtime) and the alignment, so sessions that opened the
    same file share entries even when each inspected it. Entries hold frozen data only, never
    a session's objects; the least recently used go when there are more than ``max_views``
    views or ``max_costs`` cost tables. Safe to use from several threads: a miss is computed
    once while other callers of the same cache wait.

    ``hits`` and ``misses`` count :meth:`view` lookups.
    """

    def __init__(self, *, max_views: int = 8, max_costs: int = 4) -> None:
        for name, value in (("max_views", max_views), ("max_costs", max_costs)):
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        self.max_views = max_views
        self.max_costs = max_costs
        self.hits = 0
        self.misses = 0
        self._lock = threading.RLock()
        # key -> (the layout a what-if was placed from, kept so an id() key stays unique; view)
        self._views: OrderedDict[Hashable, tuple[ArchiveLayout, LayoutView]] = OrderedDict()
        self._costs: OrderedDict[Hashable, tuple[ArchiveLayout, tuple[AlignmentCost, ...]]] = (
            OrderedDict())

    def __len__(self) -> int:
        """The number of views held."""
        return len(self._views)

    def clear(self) -> None:
        """Drop every entry (the next requests compute them again)."""
        with self._lock:
            self._views.clear()
            self._costs.clear()

    def view(self, layout: ArchiveLayout, alignment: int) -> LayoutView:
        """``layout`` at storage ``alignment`` (``layout`` itself at its own alignment)."""
        key = (_file_identity(layout), int(alignment))
        return self._get(self._views, key, self.max_views, layout,
                         lambda: _compute_view(layout, int(alignment)), count=True)

    def costs(self, layout: ArchiveLayout,
              alignments: Sequence[int]) -> tuple[AlignmentCost, ...]:
        """:func:`ckptlab.format.alignment_costs` of ``layout`` at ``alignments``."""
        key = (_file_identity(layout), tuple(alignments))
        return self._get(self._costs, key, self.max_costs, layout,
                         lambda: alignment_costs(layout, list(alignments)))

    def _get(self, table: OrderedDict, key: Hashable, bound: int, layout: ArchiveLayout,
             compute: Callable[[], Any], *, count: bool = False) -> Any:
        with self._lock:
            entry = table.get(key)
            if entry is not None:
                table.move_to_end(key)
                if count:
                    self.hits += 1
                return entry[1]
            if count:
                self.misses += 1
            value = compute()
            table[key] = (layout, value)
            while len(table) > bound:
                table.popitem(last=False)
            return value


def _compute_view(original: ArchiveLayout, alignment: int) -> LayoutView:
    own = _own_alignment(original)
    if alignment == own:
        return LayoutView(alignment, original, ByteMap.from_layout(original), None,
                          summary_html(original))
    layout = realign(original, alignment)
    title = (f"what-if: {plain_text(original.path.rsplit('/', 1)[-1])} at alignment "
             f"{alignment} · {human_nbytes(layout.file_nbytes)} "
             f"({layout.file_nbytes - original.file_nbytes:+,} B)")
    return LayoutView(alignment, layout, ByteMap.from_layout(layout), title,
                      summary_html(layout))


class LayoutApp:
    """The app's state and views for one checkpoint; ``.view`` is the panel layout.

    The alignment control shows the layout torch.save would write at another alignment (the
    same records re-placed, :func:`ckptlab.format.realign`); the file's own alignment shows the file
    as it is. Zooming the byte map re-bins it; clicking it, or picking an item, shows that
    item's bytes, tensors and hex.

    ``cache`` holds the work every session of the same file shares (:class:`LayoutCache`);
    the server passes its own, and an app made without one gets a private cache.
    """

    def __init__(self, source: LayoutSource, *, cache: LayoutCache | None = None) -> None:
        self.original: ArchiveLayout = as_layout(source)
        self.cache = cache if cache is not None else LayoutCache()
        own = _own_alignment(self.original)
        options = _alignment_options(self.original)
        self.is_zip = self.original.format == "torch-zip"
        self.alignment = pn.widgets.DiscreteSlider(
            name="what-if storage alignment", options=options, value=own,
            disabled=not self.is_zip, width=520, css_classes=["ckptlab-alignment"])
        view = self.cache.view(self.original, own)
        self.current = self.original
        self.bytemap = view.bytemap
        self.map_pane = pn.pane.Plotly(bytemap_figure(self.bytemap), sizing_mode="stretch_width",
                                       css_classes=["ckptlab-bytemap"])
        self.summary = pn.pane.HTML(view.summary, sizing_mode="stretch_width")
        self.items = pn.widgets.Select(name="items (file order)", size=14, width=380)
        self.details = pn.pane.HTML(PROMPT, sizing_mode="stretch_width")
        self.hex = pn.pane.HTML("", sizing_mode="stretch_width", css_classes=["ckptlab-hex"])
        # the other tabs' figures are built when their tab is first opened (see _draw_tab)
        self.overhead_pane = pn.pane.Plotly(None, sizing_mode="stretch_width")
        self.cost_pane = pn.pane.Plotly(None, sizing_mode="stretch_width")
        self.tensor_pane = pn.pane.Plotly(None, sizing_mode="stretch_width")
        self.costs = self.cache.costs(self.original, options) if self.is_zip else ()
        self._stale = {1, 2, 3}
        self._fill_items()
        self._watchers = [
            self.alignment.param.watch(self._on_alignment, "value"),
            self.map_pane.param.watch(self._on_relayout, "relayout_data"),
            self.map_pane.param.watch(self._on_click, "click_data"),
            self.items.param.watch(self._on_item, "value"),
        ]
        self.tabs = tabs = pn.Tabs(
            ("Byte map", pn.Column(self.map_pane, pn.Row(self.items, pn.Column(
                self.details, self.hex, sizing_mode="stretch_width")),
                sizing_mode="stretch_width")),
            ("Overhead", self.overhead_pane),
            ("Alignment cost", self.cost_pane),
            ("Tensors → storages", self.tensor_pane),
            dynamic=True,  # draw a tab when it is opened: the byte map comes first
            sizing_mode="stretch_width")
        self.view = pn.Column(
            pn.pane.HTML("<h2 style='margin:4px 0'>ckptlab · checkpoint layout</h2>"),
            self.summary, self.alignment, tabs, sizing_mode="stretch_width",
            css_classes=["ckptlab-app"])
        self._watchers.append(tabs.param.watch(self._on_tab, "active"))

    def close(self) -> None:
        """Stop reacting to events and drop this session's figures and layouts.

        The server calls it when panel ends the session; the shared cache keeps its views.
        """
        for watcher in self._watchers:
            watcher.inst.param.unwatch(watcher)
        self._watchers = []
        self.view = self.tabs = None  # panel's models of this session go with the document
        self.current = self.bytemap = self.costs = None

    def _on_tab(self, event: Any) -> None:
        self._draw_tab(event.new)

    def _draw_tab(self, index: int) -> None:
        """Build tab ``index``'s figure if the layout changed since it was drawn."""
        if index not in self._stale:
            return
        self._stale.discard(index)
        if index == 1:
            self.overhead_pane.object = overhead_figure(self.bytemap)
        elif index == 2 and self.is_zip:
            self.cost_pane.object = alignment_figure(self.costs,
                                                     current=self.current.storage_alignment)
        elif index == 3:
            self.tensor_pane.object = storage_figure(self.current)

    def _fill_items(self, around: int | None = None) -> None:
        """List the items in the map's view (at most MAX_LISTED, always ``around``)."""
        lo, hi = self.map_pane.object.layout.meta["x_range"]
        if around is not None and around >= len(self.bytemap.item_names):
            around = None
        self.items.options = dict(item_options(self.bytemap, lo, hi, around=around))

    # -- events -----------------------------------------------------------------------------
    def _on_alignment(self, event: Any) -> None:
        self.show_alignment(event.new)

    def show_alignment(self, alignment: int) -> None:
        """Show the layout at ``alignment`` (the file itself at its own alignment)."""
        view = self.cache.view(self.original, alignment)
        self.current = self.original if alignment == _own_alignment(self.original) else (
            view.layout)
        self.bytemap = view.bytemap
        self.map_pane.object = bytemap_figure(self.bytemap, title=view.title)
        self._stale = {1, 2, 3}
        self._draw_tab(self.tabs.active)
        self.summary.object = view.summary
        selected = self.items.value
        self._fill_items(around=selected)
        if selected is not None and selected < len(self.bytemap.item_names):
            self.select(selected)  # the same item, at its place in the new layout
        else:
            self.details.object = PROMPT
            self.hex.object = ""

    def _on_relayout(self, event: Any) -> None:
        zoomed, x_range = _relayout_x_range(event.new)
        if not zoomed:
            return
        self.zoom(x_range)

    def zoom(self, x_range: tuple[float, float] | None) -> None:
        """Re-bin the byte map for bytes ``x_range`` (``None``: the whole file)."""
        fig = bytemap_figure(self.bytemap, x_range=x_range,
                             title=self.map_pane.object.layout.title.text)
        fig.layout.shapes = self.map_pane.object.layout.shapes
        self.map_pane.object = fig
        self._fill_items(around=self.items.value)

    def _on_click(self, event: Any) -> None:
        points = (event.new or {}).get("points") or []
        if points and "x" in points[0]:
            self.select(self.bytemap.item_at(int(points[0]["x"])))

    def _on_item(self, event: Any) -> None:
        if event.new is not None:
            self.select(event.new)

    def select(self, item: int) -> None:
        """Mark item ``item`` on the map and show its details and first bytes."""
        bm = self.bytemap
        lo, hi = bm.item_span(item)
        name = bm.item_names[item]
        if self.items.value != item:
            if item not in self.items.options.values():
                self._fill_items(around=item)
            self.items.value = item  # re-enters _on_item once, then stops here
            return
        fig = self.map_pane.object
        fig.layout.shapes = [dict(type="rect", xref="x", yref="paper", x0=lo, x1=hi, y0=0, y1=1,
                                  line={"color": "black", "width": 2},
                                  fillcolor="rgba(0,0,0,0.06)")]
        self.map_pane.object = fig
        rows = item_tensor_rows(self.current, name)
        self.details.object = (
            f"<b>#{item} {html.escape(name)}</b> · bytes [{lo:,}, {hi:,}) · {hi - lo:,} B"
            + (html_table(["tensor", "dtype", "shape", "stride", "storage_offset"], rows)
               if rows else ""))
        if self.current is self.original and not self.original.path.startswith("<"):
            self.hex.object = hex_html(read_range(self.original.path, lo, min(hi - lo, HEX_NBYTES)),
                                       lo, self.original)
        else:
            self.hex.object = "<i>A what-if layout has no bytes: pick the file's own alignment.</i>"


# -- tensor first, any format --------------------------------------------------------------------
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
        self._lock = threading.Lock()
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
        every page gets its byte map with its first paint), else on a timer
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
        _warm_plotly()

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
            self.safety_html = safety_badge(self.checkpoint)
            if self.is_zip:
                layout = self.checkpoint.files[0].layout
                self.layout_cache.view(layout, _own_alignment(layout))
                self.layout_cache.costs(layout, _alignment_options(layout))
            else:
                self.bytemap(self.default_file())
        except Exception as exc:  # any failure (a bug too): every session shows it
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.checkpoint is None and self.error is None:
                self.error = "the checkpoint could not be opened"
            self.ready.set()

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
        entry = ck.file(rel)
        bm = ByteMap.from_file(entry, ck.tensors.values())
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


def _part_ranges(index: CheckpointIndex, row: int, rel: str) -> list[tuple[int, int]]:
    return [(offset, nbytes) for _, file, offset, nbytes in index.parts_of(row) if file == rel]


def _marks(ranges: Sequence[tuple[int, int]], x_range: Sequence[float]) -> list[dict[str, Any]]:
    """Outlines of byte ranges ``(offset, nbytes)``, and a full-height line through each one
    too narrow to see at the map's zoom (a 64-byte tensor in a 30 MB file)."""
    lo, hi = float(x_range[0]), float(x_range[1])
    sliver = max(hi - lo, 1.0) / 400
    shapes: list[dict[str, Any]] = []
    for offset, nbytes in ranges:
        shapes.append(dict(type="rect", xref="x", yref="paper", x0=offset,
                           x1=offset + max(nbytes, 1), y0=0, y1=1,
                           line={"color": "black", "width": 2},
                           fillcolor="rgba(0,0,0,0.08)", name="selected tensor"))
        if nbytes < sliver:
            mid = offset + nbytes / 2
            shapes.append(dict(type="line", xref="x", yref="paper", x0=mid, x1=mid, y0=0,
                               y1=1, line={"color": "black", "width": 2, "dash": "dot"},
                               name="selected tensor"))
    return shapes


class CheckpointApp:
    """The served app for any checkpoint, tensor first; ``.view`` is the panel layout.

    Parameters
    ----------
    source
        A checkpoint path (file or directory), or a :class:`ServedCheckpoint` a server shares
        between sessions.
    inspection_cache
        For a path: the on-disk index cache to use (None: open the checkpoint directly).

    Notes
    -----
    The summary, the tensor table and the values come from the index and show at once; the
    byte map section shows when the served checkpoint is ``ready`` (the session looks every
    ``POLL_MS``; :meth:`refresh` does it by hand).
    """

    def __init__(self, source: str | os.PathLike[str] | ServedCheckpoint, *,
                 inspection_cache: InspectionCache | None = None) -> None:
        if isinstance(source, ServedCheckpoint):
            self.served = source
        elif isinstance(source, (str, os.PathLike)):
            self.served = ServedCheckpoint(source, inspection_cache=inspection_cache)
            self.served.load()
        else:
            raise InvalidArgumentError(
                f"expected a checkpoint path or a ServedCheckpoint, got {type(source).__name__}")
        served = self.served
        self.index = served.index
        self.selected: int | None = None
        self.file: str | None = None  # the file the map shows (None: not drawn yet)
        self.layout_app: LayoutApp | None = None
        self.map_pane: Any = None
        self.file_picker: Any = None
        self._callback: Any = None
        self._watchers: list[Any] = []
        # set while the page is still loading plotly.js (the byte map waits for it)
        self._plotly_loader: PlotlyLoader | None = None
        self._doc: Any = None
        name = plain_text(served.path.rstrip("/").rsplit("/", 1)[-1])
        self.title = pn.pane.HTML(
            f"<h2 style='margin:4px 0'>ckptlab · {html.escape(name)}</h2>",
            css_classes=["ckptlab-title"], sizing_mode="stretch_width")
        self.summary = pn.pane.HTML(served.summary_html, sizing_mode="stretch_width",
                                    stylesheets=[TABLE_CSS],
                                    css_classes=["ckptlab-header"])
        self.safety = pn.pane.HTML(served.safety_html, sizing_mode="stretch_width",
                                   css_classes=["ckptlab-safety-pane"])
        self.tensors = TensorTable(served.frame, on_select=self.select_row,
                                   catalog=served.catalog)
        self.details = pn.pane.HTML(TENSOR_PROMPT, sizing_mode="stretch_width",
                                    stylesheets=[TABLE_CSS],
                                    css_classes=["ckptlab-tensor-details"])
        self.hex = pn.pane.HTML("", width=640, css_classes=["ckptlab-tensor-hex"])
        # statistics of the selected tensor, on demand (it is read once: a click, not a row)
        self.measure = pn.widgets.Button(name="statistics of this tensor", disabled=True,
                                         css_classes=["ckptlab-measure"], width=200)
        self.measure.on_click(lambda _: self.measure_selected())
        self.statistics = pn.pane.HTML("", sizing_mode="stretch_width",
                                       stylesheets=[TABLE_CSS],
                                       css_classes=["ckptlab-tensor-stats"])
        self.values = pn.pane.HTML(served.objects_html, sizing_mode="stretch_width",
                                    stylesheets=[TABLE_CSS],
                                   css_classes=["ckptlab-values-pane"])
        self.map_section = pn.Column(
            pn.pane.HTML(f"<i>Reading the byte layout of {html.escape(name)}…</i>",
                         css_classes=["ckptlab-map-loading"]),
            sizing_mode="stretch_width", css_classes=["ckptlab-map-section"])
        self.view = pn.Column(
            self.title, self.summary, self.safety,
            self.tensors.view,
            pn.Row(self.details, self.hex, sizing_mode="stretch_width"),
            pn.Row(self.measure, self.statistics, sizing_mode="stretch_width"),
            pn.pane.HTML("<h3 style='margin:8px 0 2px'>Values besides tensors</h3>"),
            self.values,
            self.map_section, sizing_mode="stretch_width", css_classes=["ckptlab-app"])
        doc = pn.state.curdoc
        if (doc is not None and doc.session_context is not None
                and (not served.ready.is_set() or _sent_without_plotly(doc))
                and _page_without_plotly(doc)):
            # a served page whose map comes later: sent without plotly.js (4.8 MB), which the
            # loader adds once the page is up (a map drawn now comes with its first page)
            self._doc = doc
            self._plotly_loader = PlotlyLoader(src=_plotly_src(), height=0, margin=0)
            self._watchers += [
                self._plotly_loader.param.watch(self._on_plotly, ["loaded", "failed"]),
                # the page is drawn: the full open may start (not when panel's warm-up
                # session, built before the port opens, runs its onload callbacks)
                self._plotly_loader.param.watch(lambda _: served.start_loading(), "rendered")]
            self.map_section.append(self._plotly_loader)
        if not self.refresh():
            if doc is not None and doc.session_context is not None:
                self._callback = pn.state.add_periodic_callback(self._poll, period=POLL_MS)
                if self._plotly_loader is None:
                    pn.state.onload(served.start_loading)

    def _on_plotly(self, event: Any) -> None:
        if not event.new or self.view is None:
            return
        if event.name == "failed":
            if self._callback is not None:
                self._callback.stop()
                self._callback = None
            self.map_section.objects = [pn.pane.HTML(
                "<b>The byte map is not available:</b> the page could not load plotly.js "
                f"({html.escape(_plotly_src())}) from this server.",
                css_classes=["ckptlab-map-error"])]
            self.file = ""
            return
        _plotly_now_loaded(self._doc)
        self._plotly_loader = None
        self.refresh()

    # -- the byte map section -----------------------------------------------------------------
    def _poll(self) -> None:
        if self.refresh() and self._callback is not None:
            self._callback.stop()
            self._callback = None

    def refresh(self) -> bool:
        """Draw the byte map section if the checkpoint is opened; True once it is drawn."""
        if self.file is not None or self.layout_app is not None:
            return True
        served = self.served
        if not served.ready.is_set() or self.view is None:
            return False
        if self.safety.object != served.safety_html:
            self.safety.object = served.safety_html
        if self._plotly_loader is not None:
            return False
        if served.error is not None:
            self.map_section.objects = [pn.pane.HTML(
                f"<b>The byte map is not available:</b> {html.escape(served.error)}",
                css_classes=["ckptlab-map-error"])]
            self.file = ""
            return True
        if served.is_zip:
            self._draw_zip()
        else:
            self._draw_files()
        if self.selected is not None:
            self.select_row(self.selected)
        return True

    def _draw_zip(self) -> None:
        layout = self.served.checkpoint.files[0].layout
        self.layout_app = app = LayoutApp(layout, cache=self.served.layout_cache)
        self.file = self.index.files[0][0]
        self.map_pane = app.map_pane
        self.map_section.objects = [
            pn.pane.HTML("<h3 style='margin:8px 0 2px'>torch.save layout: records, byte map "
                         "and the alignment what-if</h3>"),
            app.summary, app.alignment, app.tabs]

    def _draw_files(self) -> None:
        served = self.served
        files = self.index.files
        first = served.default_file()
        parts: list[Any] = [pn.pane.HTML("<h3 style='margin:8px 0 2px'>Bytes of the files</h3>")]
        if len(files) > 1:
            from ckptlab.viz.bytemap import files_figure

            parts.append(pn.pane.Plotly(files_figure(served.checkpoint),
                                        sizing_mode="stretch_width",
                                        css_classes=["ckptlab-files"]))
            ranked = sorted(files, key=lambda f: (-f[2], f[0]))[:MAX_FILES_LISTED]
            if all(f[0] != first for f in ranked):
                ranked.append(next(f for f in files if f[0] == first))
            options = {f"{f[0]} · {f[1]} · {human_nbytes(f[2])}": f[0]
                       for f in sorted(ranked, key=lambda f: f[0])}
            self.file_picker = pn.widgets.Select(name="file", options=options, value=first,
                                                 width=520, css_classes=["ckptlab-file-picker"])
            self._watchers.append(self.file_picker.param.watch(self._on_file, "value"))
            parts.append(self.file_picker)
        self.map_pane = pn.pane.Plotly(None, sizing_mode="stretch_width",
                                       css_classes=["ckptlab-bytemap"])
        self._watchers += [self.map_pane.param.watch(self._on_relayout, "relayout_data"),
                           self.map_pane.param.watch(self._on_click, "click_data")]
        parts.append(self.map_pane)
        self.map_section.objects = parts
        self.show_file(first)

    def _map_title(self, rel: str) -> str:
        fid = next((i for i, f in enumerate(self.index.files) if f[0] == rel), -1)
        nbytes = self.index.files[fid][2] if fid >= 0 else 0
        fmt = self.index.files[fid][1] if fid >= 0 else ""
        held = sum(1 for f in self.index.file if f == fid)
        return (f"{plain_text(rel)} · {plain_text(fmt)} · {human_nbytes(nbytes)} · "
                f"{held:,} tensor{'s' * (held != 1)} start here")

    def show_file(self, rel: str, x_range: tuple[float, float] | None = None) -> None:
        """Draw the byte map of file ``rel`` (a zip's own map is :class:`LayoutApp`'s)."""
        if self.layout_app is not None or self.map_pane is None:
            return
        bm = self.served.bytemap(rel)
        self.file = rel
        if self.file_picker is not None and self.file_picker.value != rel:
            self.file_picker.value = rel  # re-enters through _on_file, which stops here
        fig = bytemap_figure(bm, x_range=x_range, title=self._map_title(rel))
        fig.layout.shapes = self._selection_shapes(fig)
        self.map_pane.object = fig

    def _selection_shapes(self, fig: Any) -> list[dict[str, Any]]:
        if self.selected is None or self.file is None:
            return []
        ranges = _part_ranges(self.index, self.selected, self.file)
        return _marks(ranges, fig.layout.meta["x_range"]) if ranges else []

    def _on_file(self, event: Any) -> None:
        if event.new is not None and event.new != self.file:
            self.show_file(event.new)

    def _on_relayout(self, event: Any) -> None:
        zoomed, x_range = _relayout_x_range(event.new)
        if not zoomed:
            return
        if self.file:
            self.show_file(self.file, x_range)

    def _on_click(self, event: Any) -> None:
        points = (event.new or {}).get("points") or []
        if points and "x" in points[0] and self.file:
            row = self.served.tensor_at(self.file, int(points[0]["x"]))
            if row is not None:
                self.select_row(row)

    # -- selection ------------------------------------------------------------------------------
    def find(self, pattern: str) -> list[str]:
        """Filter the table by name as the search box does; the names now listed."""
        return list(self.tensors.find(pattern)["name"])

    def select(self, name: str) -> None:
        """Select tensor ``name`` (as clicking its row does)."""
        self.select_row(self.index.row_of(name))

    def select_row(self, row: int) -> None:
        """Show tensor ``row``: its details and first bytes, its parts outlined on the map."""
        index = self.index
        self.selected = row
        self.details.object = tensor_details_html(index, row)
        self.statistics.object = ""
        self.measure.disabled = False
        parts = index.parts_of(row)
        first = next(((file, offset, nbytes) for _, file, offset, nbytes in parts if file),
                     None)
        if first is None:
            self.hex.object = ""
            return
        file, offset, nbytes = first
        try:
            data = read_range(self.served.full_path(file), offset, min(nbytes, HEX_NBYTES))
        except (CkptlabError, OSError) as exc:
            self.hex.object = f"<i>Cannot read its bytes: {html.escape(str(exc))}</i>"
        else:
            self.details.object += (f'<div class="ckptlab-hex-caption">its first '
                                    f"{len(data):,} bytes, in {html.escape(file)} at offset "
                                    f"{offset:,}:</div>")
            self.hex.object = hex_html(data, offset, self.served.file_layout(file))
        if self.layout_app is not None:
            app = self.layout_app
            if app.current is app.original:
                # the records list follows the tensor: the record holding its first bytes
                app.select(app.bytemap.item_at(offset))
                fig = app.map_pane.object
                fig.layout.shapes = _marks(_part_ranges(index, row, file),
                                           fig.layout.meta["x_range"])
                app.map_pane.object = fig
        elif self.map_pane is not None:
            if file != self.file:
                self.show_file(file)
            else:
                fig = self.map_pane.object
                fig.layout.shapes = self._selection_shapes(fig)
                self.map_pane.object = fig

    def measure_selected(self) -> None:
        """The statistics of the selected tensor (:func:`ckptlab.stats`: min, max, mean,
        std, NaN/Inf/zero counts; it is read once, in pieces when large), under its
        details."""
        if self.selected is None:
            return
        from ckptlab.compare import health, stats
        from ckptlab.viz.compare import health_html, stats_table_html

        name = self.index.names[self.selected]
        if not self.served.ready.is_set():
            self.statistics.object = "<i>Still opening the checkpoint: try again shortly.</i>"
            return
        found = stats(self.served.checkpoint, [name])
        lines = health({name: found[name]})
        self.statistics.object = stats_table_html(found) + (health_html(lines) if lines else "")

    def close(self) -> None:
        """Stop reacting to events and drop this session's figures and widgets."""
        if self._callback is not None:
            self._callback.stop()
            self._callback = None
        for watcher in self._watchers:
            watcher.inst.param.unwatch(watcher)
        self._watchers = []
        self.tensors.close()
        if self.layout_app is not None:
            self.layout_app.close()
        self.view = self.map_section = self.map_pane = self.layout_app = None
        self._plotly_loader = self._doc = None


def _schedule_load(served: ServedCheckpoint) -> None:
    """Start the full open: now for a small checkpoint (every page gets its byte map with its
    first paint), else on a timer (the first page's draw usually starts it sooner)."""
    if len(served.index) <= EAGER_TENSORS:
        served.load()
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


class IndexProgress:
    """A page's first view while its checkpoint's index is being made: the title, what is
    read and for how long (``.view``), replaced by the :class:`CheckpointApp` once
    :meth:`poll` finds the index there (``app``).

    Such a page goes out without plotly.js (the app's byte map then waits for
    :class:`PlotlyLoader`, as on any page whose map comes later).

    Parameters
    ----------
    pending
        The checkpoint being made.
    """

    def __init__(self, pending: PendingCheckpoint) -> None:
        self.pending = pending
        self.app: CheckpointApp | None = None
        self._callback: Any = None
        name = plain_text(pending.path.rstrip("/").rsplit("/", 1)[-1])
        self._name = html.escape(name)
        self.status = pn.pane.HTML(self._status_html(), sizing_mode="stretch_width",
                                   css_classes=["ckptlab-index-progress"])
        self.view = pn.Column(
            pn.pane.HTML(f"<h2 style='margin:4px 0'>ckptlab · {self._name}</h2>",
                         css_classes=["ckptlab-title"], sizing_mode="stretch_width"),
            self.status, sizing_mode="stretch_width", css_classes=["ckptlab-loading-app"])
        doc = pn.state.curdoc
        if doc is not None and doc.session_context is not None:
            _page_without_plotly(doc)
            self._callback = pn.state.add_periodic_callback(self.poll, period=POLL_MS)

    def _status_html(self) -> str:
        pending = self.pending
        if pending.error is not None:
            return (f'<div class="ckptlab-index-error"><b>{self._name} could not be read:</b> '
                    f"{html.escape(pending.error)}</div>")
        elapsed = time.perf_counter() - pending.started
        size = f" ({human_nbytes(pending.nbytes)})" if pending.nbytes else ""
        return (f'<div class="ckptlab-progress-text"><i>Reading the tensors of '
                f"{self._name}{size}: {elapsed:.0f} s…</i> "
                "The table appears here when the index is read; a checkpoint seen before "
                "opens at once (its index is cached on disk).</div>")

    def poll(self) -> bool:
        """Show the app if the index is there (True once shown, or once it failed)."""
        if self.app is not None or self.view is None:
            return True
        pending = self.pending
        if not pending.done.is_set() or (pending.served is None and pending.error is None):
            self.status.object = self._status_html()
            return False
        self._stop()
        if pending.served is None:
            self.status.object = self._status_html()
            return True
        self.app = CheckpointApp(pending.served)
        self.view.objects = [self.app.view]
        return True

    def _stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    def close(self) -> None:
        """Stop polling and close the app if it was made."""
        self._stop()
        if self.app is not None:
            self.app.close()
        self.view = None


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where there is none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _release_memory(trim: Callable[[int], int] | None) -> None:
    """Collect the ended sessions' cycles and hand the freed heap pages back to the OS.

    A session's objects go back to Python's allocator and glibc's heap, which keep the pages:
    measured with 20 sessions on a 5,000-tensor file, RSS stays at its peak (about 205 MiB)
    after the collection and drops by 20 MiB only once ``malloc_trim`` runs.
    """
    gc.collect()
    if trim is not None:
        trim(0)


def _query_argument(name: str) -> str:
    """Query argument ``name`` of the page the current session is for ("" if none)."""
    try:
        values = pn.state.session_args.get(name) or []
    except Exception:  # no session (a warm-up, a notebook)
        return ""
    value = values[0] if values else b""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _Sessions:
    """The server's sessions: one app each (a :class:`CheckpointApp` over a
    :class:`ServedCheckpoint`, or a :class:`LayoutApp` for a layout without a file) over the
    shared caches. An ended session's app is closed, and memory is given back once per burst
    of endings."""

    def __init__(self, layout: ArchiveLayout | None, cache: LayoutCache, *,
                 served: ServedCheckpoint | None = None,
                 pending: PendingCheckpoint | None = None,
                 release_delay_s: float = 1.0) -> None:
        self.layout = layout
        self.cache = cache
        self.served = served
        self.pending = pending
        self.live = 0
        self.release_delay_s = release_delay_s
        self._release_pending = False
        self._frozen = False
        self._trim = _malloc_trim()

    def open(self) -> pn.Column:
        """A new session's view (panel calls this once per browser page)."""
        pending = self.pending
        if self.served is None and pending is not None:
            if pending.done.is_set() and pending.served is not None:
                self.served = pending.served
            else:  # the index is being made: a progress state, then the app
                app: CheckpointApp | LayoutApp | IndexProgress = IndexProgress(pending)
        if self.served is not None:
            app = CheckpointApp(self.served)
            search = _query_argument("q")
            if search.strip():  # the quick page's search, carried over
                app.tensors.find(search[:MAX_SEARCH])
        elif pending is None:
            app = LayoutApp(self.layout, cache=self.cache)
        doc = pn.state.curdoc
        if doc is not None and doc.session_context is not None:
            self.live += 1
            pn.state.on_session_destroyed(lambda context: self._ended(app))
        return app.view

    def _ended(self, app: CheckpointApp | LayoutApp | IndexProgress) -> None:
        if app.view is None:  # closed already
            return
        self.live -= 1
        app.close()
        if not self._release_pending:
            from tornado.ioloop import IOLoop

            self._release_pending = True
            IOLoop.current().call_later(self.release_delay_s, self._release)

    def _release(self) -> None:
        self._release_pending = False
        _release_memory(self._trim)
        if not self._frozen and self.live == 0:
            # The first release follows panel's warm-up session (``warm=True``): what is
            # alive now (the layout, the cache, every module a page needs) lives as long as
            # the server. Freezing it keeps the collector's full scans to the sessions'
            # objects: with a 5,000-tensor file one full scan walked 266k objects in 150 ms,
            # a pause every session waits through.
            self._frozen = True
            gc.freeze()


def serve(source: LayoutSource | ServedCheckpoint, *, port: int = 5006,
          address: str = "127.0.0.1", show: bool = False, cache: LayoutCache | None = None,
          inspection_cache: InspectionCache | None = None) -> None:
    """Serve the app for ``source`` on ``http://address:port/`` until interrupted.

    Parameters
    ----------
    source
        A checkpoint file or directory of any format :func:`ckptlab.open` reads (each
        session gets a :class:`CheckpointApp`), a :class:`ServedCheckpoint`, or an
        :class:`~ckptlab.format.ArchiveLayout` or bytes (a :class:`LayoutApp`: records and the
        alignment what-if only).
    port, address
        Where to listen (``127.0.0.1``: this machine only).
    show
        Open a browser tab.
    cache
        The torch.save what-if views shared by sessions (a new :class:`LayoutCache` if None).
    inspection_cache
        The on-disk index cache (:class:`~ckptlab.checkpoint._cache.InspectionCache`; by
        default one in ``$CKPTLAB_CACHE_DIR`` or ``~/.cache/ckptlab``): a checkpoint seen
        before shows its tensor table without being opened first.

    Notes
    -----
    The index is read (or the checkpoint opened) once, on a thread: the port opens when it is
    there or after ``INDEX_WAIT_S``, whichever comes first; until it is there, pages show
    its progress (:class:`IndexProgress`) and then the app. Past
    ``EAGER_TENSORS`` tensors the full checkpoint for the byte maps is opened on a thread
    when the first page has loaded (or ``LOAD_FALLBACK_S`` after serving); below, before
    serving. A session is freed 15-17 s after its page closed
    (``SESSION_LIFETIME_MS`` unconnected, looked for every ``SESSION_CHECK_MS``).
    """
    cache = cache if cache is not None else LayoutCache()
    served: ServedCheckpoint | None = None
    pending: PendingCheckpoint | None = None
    layout: ArchiveLayout | None = None
    if isinstance(source, ServedCheckpoint):
        served = source
    elif isinstance(source, (str, os.PathLike)):
        # the index is made on a thread; a cached or small one is there within INDEX_WAIT_S
        # and is served as before, else the port opens now and pages show its progress
        pending = PendingCheckpoint(
            source, layout_cache=cache,
            inspection_cache=inspection_cache if inspection_cache is not None
            else InspectionCache())
        if pending.wait(INDEX_WAIT_S) and pending.served is not None:
            served, pending = pending.served, None
    else:
        layout = as_layout(source)
        # the first visitor must not wait for the file's own view and costs: compute them
        # now, and let panel build (and end) one session before serving (``warm=True``),
        # which imports what a page needs (plotly's figure widget module alone takes seconds)
        cache.view(layout, _own_alignment(layout))
        if layout.format == "torch-zip":
            cache.costs(layout, _alignment_options(layout))
    sessions = _Sessions(layout, served.layout_cache if served is not None else cache,
                         served=served, pending=pending)
    # a checkpoint's pages come without plotly.js (CheckpointApp loads it after the table);
    # a layout's page opens on its byte map
    pn.extension(*(("plotly", "tabulator") if layout is not None else ("tabulator",)),
                 inline=True)
    # plotly's panel model, so that a page panel cannot send without plotly.js (no
    # _page_without_plotly) carries it
    import panel.models.plotly  # noqa: F401
    if isinstance(source, ServedCheckpoint):  # (a path's PendingCheckpoint did this)
        _schedule_load(served)
    pn.serve({"/": sessions.open}, port=port, address=address, show=show,
             websocket_origin=_origins(address, port), title="ckptlab", threaded=False,
             print_url=True, warm=True, **_SESSION_OPTIONS)


# bokeh's session bookkeeping, the same for every server of the app
_SESSION_OPTIONS = {"check_unused_sessions_milliseconds": SESSION_CHECK_MS,
                    "unused_session_lifetime_milliseconds": SESSION_LIFETIME_MS}


def _origins(address: str, port: int) -> list[str]:
    """The pages whose websocket the server accepts: those of ``address:port``."""
    return [f"{address}:{port}", f"localhost:{port}", f"127.0.0.1:{port}"]


def workbench_server(served: ServedCheckpoint, *, port: int, address: str) -> Any:
    """Panel's server of the workbench over ``served``, for a front on ``address:port``.

    The server of :func:`ckptlab.widgets.quick.serve`: the same sessions and options as
    :func:`serve` (one warm-up session built here, session lifetimes, websockets of pages of
    ``address:port`` only), started, but listening on no port of its own: the front
    (:class:`~ckptlab.widgets.quick.QuickServer`) hands it its requests, through its tornado
    application (bokeh's ``Server._tornado``). Call it on the IOLoop's thread.

    Parameters
    ----------
    served
        The checkpoint every session shows (its full open scheduled already).
    port, address
        Where the front listens: the pages' origin.

    Returns
    -------
    bokeh.server.server.Server
        Started; its own port (an ephemeral one on 127.0.0.1) closed.
    """
    from panel.io.server import get_server

    sessions = _Sessions(None, served.layout_cache, served=served)
    pn.extension("tabulator", inline=True)  # pages come without plotly.js (see serve)
    import panel.models.plotly  # noqa: F401
    server = get_server({"/": sessions.open}, port=0, address="127.0.0.1",
                        websocket_origin=_origins(address, port), title="ckptlab",
                        start=False, warm=True, **_SESSION_OPTIONS)
    _compat.bokeh_unlisten(server)  # the port bokeh bound: requests come through the front
    server.start()  # bokeh's periodic work (unused sessions), not the IOLoop
    return server


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckptlab.widgets.app PATH [--port N] [--address A]``: serve any checkpoint.

    The same as ``ckptlab serve`` (:func:`ckptlab.widgets.quick.serve`: the quick page, then
    the workbench) without its format check (for the browser tests and the first-paint
    benchmark while the CLI refuses formats other than torch.save files).
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ckptlab.widgets.app")
    parser.add_argument("path")
    parser.add_argument("--port", type=int, default=5006)
    parser.add_argument("--address", default="127.0.0.1")
    args = parser.parse_args(argv)
    from ckptlab.widgets.quick import serve as serve_quick

    serve_quick(args.path, port=args.port, address=args.address)
    return 0


if __name__ == "__main__":
    # run as a script, this file is __main__: serve with the module's own classes, as a
    # server started by ``ckptlab serve`` does (one PlotlyLoader model, not two)
    from ckptlab.widgets.app import main as _main

    sys.exit(_main())
