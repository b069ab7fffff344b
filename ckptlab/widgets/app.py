"""The served workbench: a panel app over the same figures (``ckptlab serve [PATH]``).

Everything is served from the local server: BokehJS, panel's and plotly's JavaScript come
with the app (no CDN), so it works on a cluster node without internet.
"""

from __future__ import annotations

import html
from typing import Any

import panel as pn

from ckptlab.format import ArchiveLayout, alignment_costs, read_range, realign
from ckptlab.format.predict import DEFAULT_ALIGNMENTS
from ckptlab.viz import (
    ByteMap,
    alignment_figure,
    bytemap_figure,
    hex_html,
    overhead_figure,
    storage_figure,
)
from ckptlab.viz._style import html_table, human_nbytes
from ckptlab.widgets._common import (
    LayoutSource,
    as_layout,
    item_tensor_rows,
    summary_html,
)

__all__ = ["LayoutApp", "serve"]

HEX_NBYTES = 512


class LayoutApp:
    """The app's state and views for one checkpoint; ``.view`` is the panel layout.

    The alignment control shows the layout torch.save would write at another alignment (the
    same records re-placed, :func:`ckptlab.realign`); the file's own alignment shows the file
    as it is. Zooming the byte map re-bins it; clicking it, or picking an item, shows that
    item's bytes, tensors and hex.
    """

    def __init__(self, source: LayoutSource) -> None:
        self.original: ArchiveLayout = as_layout(source)
        own = self.original.storage_alignment or 64
        options = sorted(set(DEFAULT_ALIGNMENTS) | {own})
        self.is_zip = self.original.format == "torch-zip"
        self.alignment = pn.widgets.DiscreteSlider(
            name="what-if storage alignment", options=options, value=own,
            disabled=not self.is_zip, width=520, css_classes=["ckptlab-alignment"])
        self.current = self.original
        self.bytemap = ByteMap.from_layout(self.current)
        self.map_pane = pn.pane.Plotly(bytemap_figure(self.bytemap), sizing_mode="stretch_width",
                                       css_classes=["ckptlab-bytemap"])
        self.summary = pn.pane.HTML(summary_html(self.original), sizing_mode="stretch_width")
        self.items = pn.widgets.Select(name="items (file order)", size=14, width=380)
        self.details = pn.pane.HTML("<i>Click the byte map or pick an item.</i>",
                                    sizing_mode="stretch_width")
        self.hex = pn.pane.HTML("", sizing_mode="stretch_width", css_classes=["ckptlab-hex"])
        self.overhead_pane = pn.pane.Plotly(overhead_figure(self.bytemap),
                                            sizing_mode="stretch_width")
        self.tensor_pane = pn.pane.Plotly(storage_figure(self.original),
                                          sizing_mode="stretch_width")
        self.costs = alignment_costs(self.original, options) if self.is_zip else ()
        self.cost_pane = pn.pane.Plotly(
            alignment_figure(self.costs, current=own) if self.is_zip else None,
            sizing_mode="stretch_width")
        self._fill_items()
        self.alignment.param.watch(self._on_alignment, "value")
        self.map_pane.param.watch(self._on_relayout, "relayout_data")
        self.map_pane.param.watch(self._on_click, "click_data")
        self.items.param.watch(self._on_item, "value")
        tabs = pn.Tabs(
            ("Byte map", pn.Column(self.map_pane, pn.Row(self.items, pn.Column(
                self.details, self.hex, sizing_mode="stretch_width")),
                sizing_mode="stretch_width")),
            ("Overhead", self.overhead_pane),
            ("Alignment cost", self.cost_pane),
            ("Tensors → storages", self.tensor_pane),
            sizing_mode="stretch_width")
        self.view = pn.Column(
            pn.pane.HTML("<h2 style='margin:4px 0'>ckptlab · checkpoint layout</h2>"),
            self.summary, self.alignment, tabs, sizing_mode="stretch_width",
            css_classes=["ckptlab-app"])

    def _fill_items(self) -> None:
        bm = self.bytemap
        options = {}
        for i, name in enumerate(bm.item_names):
            lo, hi = bm.item_span(i)
            options[f"#{i} {name} · {human_nbytes(hi - lo)}"] = i
        self.items.options = options

    # -- events -----------------------------------------------------------------------------
    def _on_alignment(self, event: Any) -> None:
        self.show_alignment(event.new)

    def show_alignment(self, alignment: int) -> None:
        """Show the layout at ``alignment`` (the file itself at its own alignment)."""
        own = self.original.storage_alignment or 64
        self.current = self.original if alignment == own else realign(self.original, alignment)
        self.bytemap = ByteMap.from_layout(self.current)
        title = None if alignment == own else (
            f"what-if: {self.original.path.rsplit('/', 1)[-1]} at alignment {alignment} · "
            f"{human_nbytes(self.current.file_nbytes)} "
            f"({self.current.file_nbytes - self.original.file_nbytes:+,} B)")
        self.map_pane.object = bytemap_figure(self.bytemap, title=title)
        self.overhead_pane.object = overhead_figure(self.bytemap)
        self.cost_pane.object = alignment_figure(self.costs, current=alignment)
        self.summary.object = summary_html(self.current)
        selected = self.items.value
        self._fill_items()
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
    pn.extension("plotly", inline=True)
    origins = [f"{address}:{port}", f"localhost:{port}", f"127.0.0.1:{port}"]
    pn.serve({"/": lambda: LayoutApp(layout).view}, port=port, address=address, show=show,
             websocket_origin=origins, title="ckptlab", threaded=False, print_url=True)
