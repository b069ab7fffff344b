"""The torch.save layout app: records, byte map and the alignment what-if of one zip.

:class:`LayoutApp` is one session's view of a torch.save archive (or a layout without a
file): its byte map (zoom re-bins it, a click picks the record under it), the records list in
file order, a record's tensors and first bytes in hex, and the alignment what-if (the same
records re-placed by :func:`ckptlab.format.realign`). Work that depends only on the file and an
alignment is done once per server in a :class:`LayoutCache`, shared by every session.
"""

from __future__ import annotations

import html
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import panel as pn

from ckptlab.errors import InvalidArgumentError
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
from ckptlab.widgets._common import (
    HEX_NBYTES,
    LayoutSource,
    as_layout,
    item_options,
    item_tensor_rows,
    summary_html,
)

PROMPT = "<i>Click the byte map or pick an item.</i>"


def alignment_options(layout: ArchiveLayout) -> list[int]:
    """The alignments the what-if offers: torch's usual ones and the file's own."""
    return sorted(set(DEFAULT_ALIGNMENTS) | {layout.storage_alignment or 64})


def own_alignment(layout: ArchiveLayout) -> int:
    """The storage alignment the file was written with (64, torch's, when it has none)."""
    return layout.storage_alignment or 64


def relayout_x_range(data: dict[str, Any] | None) -> tuple[bool, tuple[float, float] | None]:
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
    own = own_alignment(original)
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
        own = own_alignment(self.original)
        options = alignment_options(self.original)
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
        self.current = self.original if alignment == own_alignment(self.original) else (
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
        zoomed, x_range = relayout_x_range(event.new)
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
