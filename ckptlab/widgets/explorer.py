"""Notebook widgets: the layout explorer and the alignment explorer (views over core objects)."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

import ipywidgets as w
import numpy as np

from ckptlab.checkpoint.model import is_checkpoint
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
from ckptlab.viz import ByteMap, alignment_figure, bytemap_figure, hex_html
from ckptlab.viz._style import html_table, human_nbytes
from ckptlab.viz.bytemap import bytemap_title, highlight_shapes, update_bytemap
from ckptlab.viz.checkpoint import (
    SORT_KEYS,
    query_tensors,
    safety_badge,
    tensor_parts,
    tensor_table,
)
from ckptlab.viz.checkpoint import summary_html as checkpoint_summary_html
from ckptlab.widgets._common import (
    HEX_NBYTES,
    as_layout,
    item_options,
    item_tensor_rows,
    progress,
    summary_html,
)
from ckptlab.widgets._figure import FigureWidget

__all__ = ["AlignmentExplorer", "LayoutExplorer"]

_SELECTION_COLOR = "rgba(0, 0, 0, 0.9)"
PAGE_ROWS = 200  # tensor rows listed at once: a page of the filtered, sorted table


def _stats_text(s: Any) -> str:
    """A tensor's statistics in a line (after " · "), or "" when not measured."""
    if s is None:
        return ""
    if s.error:
        return f" · {s.error}"
    if s.min is None:
        return f" · no finite value ({s.nan:,} NaN, {s.inf:,} Inf)"
    bad = (f", NaN {s.nan:,}" if s.nan else "") + (f", Inf {s.inf:,}" if s.inf else "")
    return (f" · min {s.min:.4g} max {s.max:.4g} mean {s.mean:.4g} std {s.std:.4g}"
            + bad)


class LayoutExplorer(w.VBox):
    """A checkpoint, tensor first: summary, searchable tensor table, byte map, items and hex.

    It opens on a summary (tensors, parameters, bytes by dtype) and the tensor table: type
    in the search box (a substring, or a glob such as ``*.mlp.*``), pick the order, and pick
    a tensor: its parts are outlined on the byte map of its file and its first bytes shown
    in hex. Click the map and the item under the pointer is selected in the item list;
    select an item and the map marks its byte range. Zooming re-bins the map (exact
    segments once few enough are visible). A checkpoint of several files (Hugging Face
    shards, DCP ranks) has a file picker; each file has its own map. Tick "statistics" and
    the tensors listed are measured (:func:`ckptlab.stats`: each read once, on demand): their
    rows and the selected tensor's details gain min, max, mean, std and NaN/Inf counts, and a
    health line names what looks wrong.

    Parameters
    ----------
    source
        A :class:`~ckptlab.checkpoint.Checkpoint` (``ckptlab.open``), a path to anything
        ``ckptlab.open`` reads (a file or a directory), an :class:`~ckptlab.format.ArchiveLayout`
        (a predicted one too) or the bytes of a checkpoint file. Nothing is unpickled.
    data
        Where the hex view reads bytes from; by default the file on disk (``None`` for a
        predicted layout, which has no bytes: the hex view then says so).
    file
        For a checkpoint of several files: the file shown first (relative path); by
        default the largest that holds tensor bytes.

    Attributes
    ----------
    checkpoint : Checkpoint or None
        The opened checkpoint (None for a layout or bytes).
    archive : ArchiveLayout or None
        The layout of the file shown, when it has one (``layout`` is the ipywidgets CSS
        layout, as on every widget).
    table : ckptlab.viz.TensorTable
        The tensors (``search``, ``sort`` and ``tensors`` show a page of them).
    bytemap : ckptlab.viz.ByteMap
        The map of the file shown.
    figure : plotly.graph_objects.FigureWidget
        The byte map.
    items : ipywidgets.Select
        Items (records, tensors, trailer structures) in file order; ``value`` is an item.
    files : ipywidgets.Dropdown or None
        The file picker (None for a single file).
    selected : int or None
        The selected item.
    selected_tensor : str or None
        The selected tensor.
    what_if : ipywidgets.Accordion or None
        For a single torch.save zip: the alignment what-if, an :class:`AlignmentExplorer`
        built when the accordion is first opened (``aligner``); None for other formats,
        whose writers have no alignment to choose.
    """

    def __init__(self, source: Any, *, data: Any = "auto", file: str | None = None) -> None:
        self.checkpoint: Any = None
        layout: ArchiveLayout | None = None
        with progress(3, "opening") as bar:
            if is_checkpoint(source):
                self.checkpoint = source
            elif isinstance(source, (str, os.PathLike)):
                from ckptlab.checkpoint import open_checkpoint

                self.checkpoint = open_checkpoint(source)
            elif isinstance(source, (ArchiveLayout, bytes, bytearray)):
                layout = as_layout(source)
            else:
                raise InvalidArgumentError(
                    "expected a Checkpoint (ckptlab.open), a path, an ArchiveLayout or the "
                    f"bytes of a checkpoint, got {type(source).__name__}")
            bar.update(1)
            self.table = tensor_table(self.checkpoint if self.checkpoint is not None
                                      else layout)
            bar.update(1)
            self._maps: dict[str, ByteMap] = {}  # this view's own: one map per file shown
            self._layout_source = layout
            self._explicit_data = data
            if isinstance(data, str) and data == "auto" and isinstance(source, (bytes,
                                                                               bytearray)):
                self._explicit_data = source
            if self.checkpoint is not None:
                from ckptlab.viz._bytemap_model import checkpoint_file

                self._file = checkpoint_file(self.checkpoint, file).path
            else:
                self._file = ""
            self._use_file(self._file)
            bar.update(1)
        self.selected: int | None = None
        self.selected_tensor: str | None = None
        self.figure = FigureWidget(bytemap_figure(self.bytemap))
        self.figure.layout.on_change(self._on_range, "xaxis.range")
        self.figure.data[0].on_click(self._on_click)
        self._refilling = False
        self.items = w.Select(options=item_options(self.bytemap), value=None, rows=14,
                              layout=w.Layout(width="34%"), description="")
        self.items.observe(self._on_item, names="value")
        self.summary = w.HTML(self._summary())
        self.details = w.HTML("<i>Select a tensor or an item, or click the byte map.</i>")
        self.hex = w.HTML("")
        # the tensor table: search, order, a page of rows
        self.search = w.Text(placeholder="search tensors: a name part, or a glob like *.mlp.*",
                             continuous_update=True, layout=w.Layout(width="50%"),
                             description="")
        self.sort = w.Dropdown(options=[k for k in SORT_KEYS], value="order",
                               description="sort", layout=w.Layout(width="180px"))
        self.tensors = w.Select(options=[], value=None, rows=12,
                                layout=w.Layout(width="100%"), description="")
        self.tensors.add_class("ckptlab-tensor-table")
        self.page_info = w.HTML()
        self.prev_page = w.Button(description="◀", layout=w.Layout(width="44px"),
                                  tooltip="previous page")
        self.next_page = w.Button(description="▶", layout=w.Layout(width="44px"),
                                  tooltip="next page")
        self._page = 0
        self._view = np.arange(len(self.table))
        self.search.observe(lambda _: self._query(), names="value")
        self.sort.observe(lambda _: self._query(), names="value")
        # statistics on demand (a checkpoint's tensors only: a layout has no reader)
        self._stats: dict[str, Any] = {}
        self.statistics = w.Checkbox(
            value=False, description="statistics", indent=False, layout=w.Layout(width="110px"),
            disabled=self.checkpoint is None,
            tooltip="min, max, mean, std and NaN/Inf of the tensors listed (each read once)")
        self.health = w.HTML()
        self.statistics.observe(lambda _: self.show_page(self._page), names="value")
        self.prev_page.on_click(lambda _: self.show_page(self._page - 1))
        self.next_page.on_click(lambda _: self.show_page(self._page + 1))
        self.tensors.observe(self._on_tensor, names="value")
        self.files: w.Dropdown | None = None
        head: list[w.Widget] = [self.summary]
        if self.checkpoint is not None and len(self.checkpoint.files) > 1:
            self.files = w.Dropdown(
                options=[(f"{f.path} · {human_nbytes(f.nbytes)}", f.path)
                         for f in self.checkpoint.files],
                value=self._file, description="file", layout=w.Layout(width="60%"))
            self.files.observe(self._on_file, names="value")
            head.append(self.files)
        controls = w.HBox([self.search, self.sort, self.statistics, self.prev_page,
                           self.next_page, self.page_info])
        right = w.VBox([self.details, self.hex], layout=w.Layout(width="66%"))
        # the alignment what-if applies where the writer picks the alignment: torch.save zips
        self.what_if: w.Accordion | None = None
        self.aligner: AlignmentExplorer | None = None
        tail: list[w.Widget] = []
        if self._zip_archive() is not None:
            self.what_if = w.Accordion(children=[w.HTML("<i>opening…</i>")],
                                       selected_index=None)
            self.what_if.set_title(0, "alignment what-if: the same file at another alignment")
            self.what_if.observe(self._on_what_if, names="selected_index")
            tail.append(self.what_if)
        super().__init__([*head, controls, self.health, self.tensors, self.figure,
                          w.HBox([self.items, right]), *tail])
        self.add_class("ckptlab-layout-explorer")
        self._query()

    # -- the alignment what-if (torch.save zips) ----------------------------------------------
    def _zip_archive(self) -> ArchiveLayout | None:
        """The torch.save zip the what-if re-aligns: the single file shown, if it is one."""
        if self.archive is None or self.archive.format != "torch-zip":
            return None
        if self.checkpoint is not None and len(self.checkpoint.files) != 1:
            return None
        return self.archive

    def _on_what_if(self, change: dict[str, Any]) -> None:
        if change["new"] == 0:
            self.open_what_if()

    def open_what_if(self) -> AlignmentExplorer:
        """Build (once) and show the :class:`AlignmentExplorer` of this torch.save file."""
        archive = self._zip_archive()
        if archive is None or self.what_if is None:
            raise InvalidArgumentError(
                "the alignment what-if applies to a single torch.save zip; this is "
                + (self.checkpoint.format if self.checkpoint is not None
                   else (self.archive.format if self.archive is not None else "no file")))
        if self.aligner is None:
            with progress(1, "alignment what-if") as bar:
                self.aligner = AlignmentExplorer(archive)
                bar.update(1)
            self.what_if.children = [self.aligner]
        if self.what_if.selected_index != 0:
            self.what_if.selected_index = 0
        return self.aligner

    # -- files --------------------------------------------------------------------------------
    def _use_file(self, path: str) -> None:
        """Make ``path`` the file shown: its map (built once), layout and hex source."""
        bm = self._maps.get(path)
        if bm is None:
            if self.checkpoint is not None:
                bm = ByteMap.from_checkpoint(self.checkpoint, path)
            else:
                bm = ByteMap.from_layout(self._layout_source)
            self._maps[path] = bm
        self.bytemap = bm
        self._file = path
        if self.checkpoint is not None:
            entry = self.checkpoint.file(path)
            layout = entry.layout if isinstance(entry.layout, ArchiveLayout) else None
            self.archive = layout
            self._hex_layout = bm.layout
            default = entry.full_path or None
        else:
            self.archive = self._layout_source
            self._hex_layout = self.archive
            default = None if self.archive.path.startswith("<") else self.archive.path
        explicit = self._explicit_data
        self._data = default if isinstance(explicit, str) and explicit == "auto" else explicit

    def _on_file(self, change: dict[str, Any]) -> None:
        if change["new"] is not None and change["new"] != self._file:
            self.show_file(change["new"])

    def show_file(self, path: str) -> None:
        """Show the byte map of file ``path`` (relative, as in ``checkpoint.files``)."""
        if self.checkpoint is None or path not in {f.path for f in self.checkpoint.files}:
            raise InvalidArgumentError(f"no file {path!r} in this checkpoint")
        with progress(1, f"mapping {path}") as bar:
            self._use_file(path)
            bar.update(1)
        if self.files is not None and self.files.value != path:
            self.files.value = path
        self.selected = None
        update_bytemap(self.figure, self.bytemap)
        with self.figure.batch_update():
            self.figure.layout.title.text = bytemap_title(self.bytemap)
            self.figure.layout.shapes = []
        self._fill_items()

    def _summary(self) -> str:
        parts = []
        if self.checkpoint is not None:
            parts.append(safety_badge(self.checkpoint))
            parts.append(checkpoint_summary_html(self.checkpoint))
        else:
            parts.append(checkpoint_summary_html(self._layout_source))
        if self.archive is not None and self.archive.format == "torch-zip":
            parts.append(summary_html(self.archive))
        return "".join(parts)

    # -- the tensor table ---------------------------------------------------------------------
    def _query(self) -> None:
        self._view = query_tensors(self.table, self.search.value, self.sort.value)
        self.show_page(0)

    def show_page(self, page: int) -> None:
        """List page ``page`` of the filtered, sorted tensors (``PAGE_ROWS`` a page)."""
        pages = max(1, -(-len(self._view) // PAGE_ROWS))
        self._page = min(max(page, 0), pages - 1)
        rows = self._view[self._page * PAGE_ROWS : (self._page + 1) * PAGE_ROWS]
        t = self.table
        measured = self._measure([t.names[i] for i in rows.tolist()])
        options = [(f"{t.names[i]} · {t.dtypes[i]} {t.shapes[i]} · "
                    f"{human_nbytes(int(t.nbytes[i]))} · {int(t.parameters[i]):,} params"
                    + (f" · {t.files[i]}" if self.files is not None else "")
                    + _stats_text(measured.get(t.names[i])), t.names[i])
                   for i in rows.tolist()]
        self._refilling = True
        try:
            self.tensors.options = options
            self.tensors.value = (self.selected_tensor if self.selected_tensor in
                                  {v for _, v in options} else None)
        finally:
            self._refilling = False
        lo = self._page * PAGE_ROWS
        shown = (f"{lo + 1:,}–{lo + len(rows):,} of {len(self._view):,}" if len(rows)
                 else "no tensor matches")
        hidden = len(self.table) - len(self._view)
        self.page_info.value = (f'<span class="ckptlab-page-info">{shown}'
                                + (f" ({hidden:,} filtered out)" if hidden else "")
                                + "</span>")
        self.prev_page.disabled = self._page == 0
        self.next_page.disabled = self._page >= pages - 1

    def _measure(self, names: list[str]) -> dict[str, Any]:
        """The statistics of ``names`` when the statistics box is ticked (each tensor read
        once, kept for this view), and the health line of every tensor measured so far."""
        if not self.statistics.value or self.checkpoint is None:
            self.health.value = ""
            return {}
        from ckptlab.compare import health, stats
        from ckptlab.viz.compare import health_html

        todo = [n for n in names if n not in self._stats]
        with progress(len(todo), "measuring tensors") as bar:
            self._stats.update(stats(self.checkpoint, todo, measured=lambda _: bar.update(1)))
        self.health.value = (health_html(health(self._stats)) +
                             f'<span class="note">({len(self._stats):,} of '
                             f"{len(self.table):,} tensors measured: those listed)</span>")
        return {n: self._stats[n] for n in names}

    def _on_tensor(self, change: dict[str, Any]) -> None:
        if not self._refilling and change["new"] is not None and \
                change["new"] != self.selected_tensor:
            self.select_tensor(change["new"])

    def select_tensor(self, name: str) -> None:
        """Select tensor ``name``: its file's map, its parts outlined, its item and hex."""
        try:
            i = self.table.index(name)
        except KeyError:
            raise InvalidArgumentError(f"no tensor {name!r} in this checkpoint") from None
        self.selected_tensor = name
        file = self.table.files[i]
        if self.checkpoint is not None and file and file != self._file:
            self.show_file(file)
        source = self.checkpoint if self.checkpoint is not None else self.table
        ranges = tensor_parts(source, name, file if self.checkpoint is not None else None)
        if name in {v for _, v in self.tensors.options}:
            self._refilling = True
            try:
                self.tensors.value = name
            finally:
                self._refilling = False
        if not ranges:
            self.details.value = f"<b>{html.escape(name)}</b>: no bytes in any file"
            self.hex.value = ""
            self.figure.layout.shapes = []
            return
        offset, nbytes = ranges[0]
        self._select_item(self.bytemap.item_at(offset), ranges=ranges)
        row = self.table.row(i)
        facts = [["dtype", row["dtype"]], ["shape", row["shape"]], ["kind", row["kind"]],
                 ["bytes", f"{row['nbytes']:,}"], ["parameters", f"{row['parameters']:,}"],
                 ["parts", ", ".join(f"[{o:,}, {o + n:,})" for o, n in ranges[:8])
                  + (" …" if len(ranges) > 8 else "")]]
        if row["file"]:
            facts.insert(0, ["file", row["file"]])
        measured = self._stats.get(name)
        if measured is not None:
            facts.append(["statistics", _stats_text(measured).removeprefix(" · ")])
        self.details.value = (f"<b>{html.escape(name)}</b>" + html_table(["", ""], facts)
                              + self.details.value)
        self._show_hex(offset, min(max(nbytes, 1), HEX_NBYTES))

    # -- map -> list --------------------------------------------------------------------------
    def _fill_items(self, around: int | None = None) -> None:
        """List the items in the map's view (at most MAX_LISTED, always ``around``)."""
        lo, hi = self.figure.layout.meta["x_range"]
        self._refilling = True  # a new option list may move the value: not a user's pick
        try:
            self.items.options = item_options(self.bytemap, lo, hi, around=around)
            self.items.value = around
        finally:
            self._refilling = False

    def _on_click(self, trace: Any, points: Any, state: Any) -> None:
        if points.xs:
            self.select(self.bytemap.item_at(int(points.xs[0])))

    def _on_range(self, layout: Any, x_range: Sequence[float] | None) -> None:
        if x_range is not None and list(x_range) != list(self.figure.layout.meta["x_range"]):
            self.zoom(x_range[0], x_range[1])

    def zoom(self, lo: float | None = None, hi: float | None = None) -> None:
        """Show bytes ``[lo, hi)`` (the whole file with no arguments), re-binned for the view."""
        x_range = None if lo is None or hi is None else (lo, hi)
        update_bytemap(self.figure, self.bytemap, x_range=x_range)
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
        self._select_item(item)
        lo, hi = self.bytemap.item_span(item)
        self._show_hex(lo, min(hi - lo, HEX_NBYTES))

    def _select_item(self, item: int, ranges: Sequence[tuple[int, int]] = ()) -> None:
        self.selected = item
        if item in {i for _, i in self.items.options}:
            self._refilling = True
            try:
                self.items.value = item
            finally:
                self._refilling = False
        else:
            self._fill_items(around=item)
        lo, hi = self.bytemap.item_span(item)
        name = self.bytemap.item_names[item]
        self.figure.layout.shapes = highlight_shapes(ranges or [(lo, hi - lo)],
                                                     color=_SELECTION_COLOR)
        record = None
        rows: list[list[Any]] = []
        if self.archive is not None:
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
        elif self.bytemap.item_owners(item):
            facts.append(["tensors", ", ".join(lab for _, lab in
                                               self.bytemap.item_owners(item)[:6])])
        tensors = (html_table(["tensor", "dtype", "shape", "stride", "storage_offset"], rows)
                   if rows else "")
        self.details.value = (f"<b>#{item} {html.escape(name)}</b>" + html_table(["", ""], facts)
                              + tensors)

    def _show_hex(self, offset: int, nbytes: int) -> None:
        if self._data is None:
            self.hex.value = "<i>A predicted layout has no bytes to show.</i>"
        else:
            self.hex.value = hex_html(read_range(self._data, offset, nbytes), offset,
                                      self._hex_layout)


class AlignmentExplorer(w.VBox):
    """What-if alignment: pick a storage alignment, see the layout torch.save would write.

    Parameters
    ----------
    source
        A state dict (or anything torch.save accepts: pickled once by torch under
        ``skip_data``), an :class:`~ckptlab.format.ArchiveLayout`, or a path to a checkpoint.
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
        self.cost_figure = FigureWidget(alignment_figure(self.costs, current=start))
        self.predicted = realign(base, start)
        self.figure = FigureWidget(bytemap_figure(self.predicted,
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
        update_bytemap(self.figure, bm)  # numpy arrays: far cheaper than a dict dump
        self.figure.layout.title.text = _bytemap_title(self.predicted)
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

