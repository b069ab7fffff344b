"""The served workbench: a panel app over the same figures (``ckptlab serve [PATH]``).

Everything is served from the local server: BokehJS, panel's and plotly's JavaScript come
with the app (no CDN), so it works on a cluster node without internet.
"""

from __future__ import annotations

import html
from typing import Any

import panel as pn

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

__all__ = ["LayoutApp", "serve"]



def _alignment_options(layout: ArchiveLayout) -> list[int]:
    return sorted(set(DEFAULT_ALIGNMENTS) | {layout.storage_alignment or 64})


class LayoutApp:
    """The app's state and views for one checkpoint; ``.view`` is the panel layout.

    The alignment control shows the layout torch.save would write at another alignment (the
    same records re-placed, :func:`ckptlab.realign`); the file's own alignment shows the file
    as it is. Zooming the byte map re-bins it; clicking it, or picking an item, shows that
    item's bytes, tensors and hex.
    """

    def __init__(self, source: LayoutSource, *, bytemap: ByteMap | None = None,
                 costs: tuple[AlignmentCost, ...] | None = None) -> None:
        self.original: ArchiveLayout = as_layout(source)
        own = self.original.storage_alignment or 64
        options = _alignment_options(self.original)
        self.is_zip = self.original.format == "torch-zip"
        self.alignment = pn.widgets.DiscreteSlider(
            name="what-if storage alignment", options=options, value=own,
            disabled=not self.is_zip, width=520, css_classes=["ckptlab-alignment"])
        self.current = self.original
        self.bytemap = bytemap if bytemap is not None else ByteMap.from_layout(self.current)
        self.map_pane = pn.pane.Plotly(bytemap_figure(self.bytemap), sizing_mode="stretch_width",
                                       css_classes=["ckptlab-bytemap"])
        self.summary = pn.pane.HTML(summary_html(self.original), sizing_mode="stretch_width")
        self.items = pn.widgets.Select(name="items (file order)", size=14, width=380)
        self.details = pn.pane.HTML("<i>Click the byte map or pick an item.</i>",
                                    sizing_mode="stretch_width")
        self.hex = pn.pane.HTML("", sizing_mode="stretch_width", css_classes=["ckptlab-hex"])
        # the other tabs' figures are built when their tab is first opened (see _draw_tab)
        self.overhead_pane = pn.pane.Plotly(None, sizing_mode="stretch_width")
        self.cost_pane = pn.pane.Plotly(None, sizing_mode="stretch_width")
        self.tensor_pane = pn.pane.Plotly(None, sizing_mode="stretch_width")
        if costs is None:
            costs = alignment_costs(self.original, options) if self.is_zip else ()
        self.costs = costs
        self._stale = {1, 2, 3}
        self._fill_items()
        self.alignment.param.watch(self._on_alignment, "value")
        self.map_pane.param.watch(self._on_relayout, "relayout_data")
        self.map_pane.param.watch(self._on_click, "click_data")
        self.items.param.watch(self._on_item, "value")
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
        tabs.param.watch(lambda event: self._draw_tab(event.new), "active")

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
        own = self.original.storage_alignment or 64
        self.current = self.original if alignment == own else realign(self.original, alignment)
        self.bytemap = ByteMap.from_layout(self.current)
        title = None if alignment == own else (
            f"what-if: {plain_text(self.original.path.rsplit('/', 1)[-1])} at alignment "
            f"{alignment} · "
            f"{human_nbytes(self.current.file_nbytes)} "
            f"({self.current.file_nbytes - self.original.file_nbytes:+,} B)")
        self.map_pane.object = bytemap_figure(self.bytemap, title=title)
        self._stale = {1, 2, 3}
        self._draw_tab(self.tabs.active)
        self.summary.object = summary_html(self.current)
        selected = self.items.value
        self._fill_items(around=selected)
        if selected is not None and selected < len(self.bytemap.item_names):
            self.select(selected)  # the same item, at its place in the new layout
        else:
            self.details.object = "<i>Click the byte map or pick an item.</i>"
            self.hex.object = ""

    def _on_relayout(self, event: Any) -> None:
        data = event.new or {}
        if "xaxis.range[0]" in data and "xaxis.range[1]" in data:
            x_range = (data["xaxis.range[0]"], data["xaxis.range[1]"])
        elif "xaxis.range" in data:
            x_range = tuple(data["xaxis.range"])
        elif data.get("xaxis.autorange"):
            x_range = None
        else:
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


def serve(source: LayoutSource, *, port: int = 5006, address: str = "127.0.0.1",
          show: bool = False) -> None:
    """Serve the app for ``source`` on ``http://address:port/`` until interrupted.

    Every browser session gets its own :class:`LayoutApp` (the layout is inspected once).
    """
    layout = as_layout(source)
    # the same for every session: computed once (a 100k-record file takes seconds)
    bytemap = ByteMap.from_layout(layout)
    costs = (alignment_costs(layout, _alignment_options(layout))
             if layout.format == "torch-zip" else ())
    pn.extension("plotly", inline=True)
    origins = [f"{address}:{port}", f"localhost:{port}", f"127.0.0.1:{port}"]
    pn.serve({"/": lambda: LayoutApp(layout, bytemap=bytemap, costs=costs).view}, port=port,
             address=address, show=show,
             websocket_origin=origins, title="ckptlab", threaded=False, print_url=True)
