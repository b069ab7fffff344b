"""Notebook widgets: the layout explorer and the alignment explorer (views over core objects)."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

import ipywidgets as w
import plotly.graph_objects as go

from ckptlab.errors import InvalidArgumentError
from ckptlab.format import (
    AlignmentCost,
    ArchiveLayout,
    alignment_costs,
    predict_layout,
    read_range,
    realign,
)
from ckptlab.format.predict import DEFAULT_ALIGNMENTS
from ckptlab.viz import ByteMap, alignment_figure, bytemap_figure, bytemap_trace, hex_html
from ckptlab.viz._style import html_table, human_nbytes
from ckptlab.widgets._common import (
    HEX_NBYTES,
    LayoutSource,
    as_layout,
    item_options,
    item_tensor_rows,
    summary_html,
)

__all__ = ["AlignmentExplorer", "LayoutExplorer"]

_SELECTION_COLOR = "rgba(0, 0, 0, 0.9)"


class LayoutExplorer(w.VBox):
    """Byte map, item list, tensors and hex of one checkpoint, with selection synced both ways.

    Click the map and the item under the pointer is selected in the list; select an item in
    the list and the map marks its byte range. Zooming the map re-bins it (exact segments
    once few enough are visible). The hex view shows the selected item's first bytes, each
    coloured by its segment kind.

    Parameters
    ----------
    source
        An :class:`~ckptlab.ArchiveLayout`, or a path / bytes of a checkpoint (inspected
        safely; nothing is unpickled).
    data
        Where the hex view reads bytes from; by default ``layout.path`` (``None`` for a
        predicted layout, which has no bytes: the hex view then says so).

    Attributes
    ----------
    archive : ArchiveLayout
        The inspected layout (``layout`` is the ipywidgets CSS layout, as on every widget).
    bytemap : ckptlab.viz.ByteMap
    figure : plotly.graph_objects.FigureWidget
        The byte map.
    items : ipywidgets.Select
        Items (records and trailer structures) in file order; ``value`` is an item index.
    selected : int or None
        The selected item.
    """

    def __init__(self, source: LayoutSource, *, data: Any = "auto") -> None:
        self.archive: ArchiveLayout = as_layout(source)
        self.bytemap = ByteMap.from_layout(self.archive)
        if isinstance(data, str) and data == "auto":
            data = source if isinstance(source, (str, os.PathLike, bytes, bytearray)) else (
                None if self.archive.path.startswith("<") else self.archive.path)
        self._data = data
        self.selected: int | None = None
        self.figure = go.FigureWidget(bytemap_figure(self.bytemap))
        self.figure.layout.on_change(self._on_range, "xaxis.range")
        self.figure.data[0].on_click(self._on_click)
        self._refilling = False
        self.items = w.Select(options=item_options(self.bytemap), value=None, rows=14,
                              layout=w.Layout(width="34%"), description="")
        self.items.observe(self._on_item, names="value")
        self.summary = w.HTML(summary_html(self.archive))
        self.details = w.HTML("<i>Select an item in the list or click the byte map.</i>")
        self.hex = w.HTML("")
        right = w.VBox([self.details, self.hex], layout=w.Layout(width="66%"))
        super().__init__([self.summary, self.figure, w.HBox([self.items, right])])
        self.add_class("ckptlab-layout-explorer")

    def _fill_items(self, around: int | None = None) -> None:
        """List the items in the map's view (at most MAX_LISTED, always ``around``)."""
        lo, hi = self.figure.layout.meta["x_range"]
        self._refilling = True  # a new option list may move the value: not a user's pick
        try:
            self.items.options = item_options(self.bytemap, lo, hi, around=around)
            self.items.value = around
        finally:
            self._refilling = False

    # -- map -> list --------------------------------------------------------------------------
    def _on_click(self, trace: Any, points: Any, state: Any) -> None:
        if points.xs:
            self.select(self.bytemap.item_at(int(points.xs[0])))

    def _on_range(self, layout: Any, x_range: Sequence[float] | None) -> None:
        if x_range is not None and list(x_range) != list(self.figure.layout.meta["x_range"]):
            self.zoom(x_range[0], x_range[1])

    def zoom(self, lo: float | None = None, hi: float | None = None) -> None:
        """Show bytes ``[lo, hi)`` (the whole file with no arguments), re-binned for the view."""
        x_range = None if lo is None or hi is None else (lo, hi)
        data = bytemap_trace(self.bytemap, x_range=x_range)
        meta = data.pop("meta")
        with self.figure.batch_update():
            self.figure.data[0].update(**data)
            self.figure.layout.meta = {**self.figure.layout.meta, **meta}
            self.figure.layout.xaxis.range = meta["x_range"]
        self._fill_items(around=self.selected)

    # -- list -> map --------------------------------------------------------------------------
    def _on_item(self, change: dict[str, Any]) -> None:
        if not self._refilling and change["new"] is not None and change["new"] != self.selected:
            self.select(change["new"])

    def select(self, item: int) -> None:
        """Select item ``item``: list, map mark, tensor table and hex view follow."""
        if type(item) is not int or not 0 <= item < len(self.bytemap.item_names):
            raise InvalidArgumentError(
                f"item must be an int in 0..{len(self.bytemap.item_names) - 1}, got {item!r}")
        self.selected = item
        if item in {i for _, i in self.items.options}:
            self.items.value = item
        else:
            self._fill_items(around=item)
        lo, hi = self.bytemap.item_span(item)
        name = self.bytemap.item_names[item]
        self.figure.layout.shapes = [dict(
            type="rect", xref="x", yref="paper", x0=lo, x1=hi, y0=0, y1=1,
            line={"color": _SELECTION_COLOR, "width": 2}, fillcolor="rgba(0,0,0,0.06)")]
        rows = item_tensor_rows(self.archive, name)
        record = next((r for r in self.archive.records if r.name == name), None)
        facts = [["bytes", f"[{lo:,}, {hi:,}) · {hi - lo:,} B"]]
        if record is not None:
            facts += [["data", f"[{record.data_offset:,}, "
                               f"{record.data_offset + record.data_nbytes:,}) · "
                               f"{record.data_nbytes:,} B"],
                      ["FB padding", f"{record.padding_nbytes} B"],
                      ["zip64 extra", f"{record.zip64_extra_nbytes} B"],
                      ["descriptor", f"{record.descriptor_nbytes} B"],
                      ["crc32", f"{record.crc32:#010x}"]]
        tensors = (html_table(["tensor", "dtype", "shape", "stride", "storage_offset"], rows)
                   if rows else "")
        self.details.value = (f"<b>#{item} {html.escape(name)}</b>" + html_table(["", ""], facts)
                              + tensors)
        if self._data is None:
            self.hex.value = "<i>A predicted layout has no bytes to show.</i>"
        else:
            n = min(hi - lo, HEX_NBYTES)
            self.hex.value = hex_html(read_range(self._data, lo, n), lo, self.archive)


class AlignmentExplorer(w.VBox):
    """What-if alignment: pick a storage alignment, see the layout torch.save would write.

    Parameters
    ----------
    source
        A state dict (or anything torch.save accepts: pickled once by torch under
        ``skip_data``), an :class:`~ckptlab.ArchiveLayout`, or a path to a checkpoint.
    alignments
        The choices, 1..65504 each.
    value
        The alignment selected first (default: the checkpoint's own, or 64).
    archive_name
        Record prefix for a state dict.

    Attributes
    ----------
    control : ipywidgets.SelectionSlider
    costs : tuple of AlignmentCost
    predicted : ArchiveLayout
        The layout at the selected alignment.
    """

    def __init__(self, source: Any, *, alignments: Sequence[int] = DEFAULT_ALIGNMENTS,
                 value: int | None = None, archive_name: str = "archive") -> None:
        if isinstance(source, (ArchiveLayout, str, os.PathLike, bytes, bytearray)):
            base = as_layout(source)
        else:
            base = predict_layout(source, archive_name=archive_name)
        if base.format != "torch-zip":
            raise InvalidArgumentError(
                f"alignment applies to torch.save archives, got a {base.format} file")
        self.base = base
        self.costs: tuple[AlignmentCost, ...] = alignment_costs(base, tuple(alignments))
        if value is not None and value not in alignments:
            raise InvalidArgumentError(
                f"value must be one of the alignments {list(alignments)}, got {value!r}")
        start = value if value is not None else (
            base.storage_alignment if base.storage_alignment in alignments else alignments[0])
        self.control = w.SelectionSlider(options=list(alignments), value=start,
                                         description="alignment", continuous_update=False,
                                         layout=w.Layout(width="70%"))
        self.cost_figure = go.FigureWidget(alignment_figure(self.costs, current=start))
        self.predicted = realign(base, start)
        self.figure = go.FigureWidget(bytemap_figure(self.predicted,
                                                     title=_bytemap_title(self.predicted)))
        self.summary = w.HTML()
        self.control.observe(self._on_alignment, names="value")
        super().__init__([self.control, self.summary, self.figure, self.cost_figure])
        self.add_class("ckptlab-alignment-explorer")
        self._show(start)

    def _on_alignment(self, change: dict[str, Any]) -> None:
        self.show(change["new"])

    def show(self, alignment: int) -> None:
        """Select ``alignment``: control, byte map, cost highlight and summary follow."""
        if self.control.value != alignment:
            self.control.value = alignment  # re-enters through the observer
            return
        self._show(alignment)

    def _show(self, alignment: int) -> None:
        self.predicted = realign(self.base, alignment)
        bm = ByteMap.from_layout(self.predicted)
        data = bytemap_trace(bm)  # numpy arrays: far cheaper to hand plotly than a dict dump
        meta = data.pop("meta")
        with self.figure.batch_update():
            self.figure.data[0].update(**data)
            self.figure.layout.title.text = _bytemap_title(self.predicted)
            self.figure.layout.height = 90 + 28 * len(data["y"])
            self.figure.layout.xaxis.range = meta["x_range"]
            self.figure.layout.meta = {**self.figure.layout.meta, **meta,
                                       "lanes": [k.value for k in bm.lanes],
                                       "file_nbytes": self.predicted.file_nbytes}
        fresh_cost = alignment_figure(self.costs, current=alignment)
        with self.cost_figure.batch_update():
            self.cost_figure.data[0].marker = fresh_cost.data[0].marker
            self.cost_figure.layout.meta = fresh_cost.layout.meta
        self.summary.value = self._summary(alignment)

    def _summary(self, alignment: int) -> str:
        row = next(c for c in self.costs if c.alignment == alignment)
        ref = next((c for c in self.costs if c.alignment == 64), None)
        delta = "" if ref is None else (
            f" ({row.file_nbytes - ref.file_nbytes:+,} B vs alignment 64)")
        ready = row.storages_4k_aligned == row.storages and row.storages > 0
        verdict = ('<b style="color:#2e7d32">4 KiB ready</b>: every storage starts on a '
                   "4096-byte boundary (O_DIRECT / GPUDirect Storage can read it in place)"
                   if ready else
                   f'<b style="color:#c75000">not 4 KiB ready</b>: {row.storages_4k_aligned} of '
                   f"{row.storages} storages start on a 4096-byte boundary")
        return (f'<div class="ckptlab-alignment-summary">alignment <b>{alignment}</b>: file '
                f"{row.file_nbytes:,} B{delta}, FB padding {row.padding_nbytes:,} B, overhead "
                f"{100 * row.overhead_fraction:.2f}% · {verdict}</div>")


def _bytemap_title(layout: ArchiveLayout) -> str:
    return (f"what-if layout at alignment {layout.storage_alignment} · "
            f"{human_nbytes(layout.file_nbytes)} · {len(layout.records)} records")
