"""The workbench of any checkpoint, tensor first: one session's view of a served checkpoint.

:class:`CheckpointApp` shows what the index holds at once (the summary, the searchable tensor
table, the values besides tensors) and the byte map section once the served checkpoint is
opened: a torch.save zip's :class:`~ckptlab.widgets._layout_app.LayoutApp`, else the chosen
file's byte map with the selected tensor's parts outlined. :class:`IndexProgress` is a page's
first view while the index is still being read.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import panel as pn
import param

from ckptlab.checkpoint._cache import CheckpointIndex, InspectionCache
from ckptlab.errors import CkptlabError, InvalidArgumentError
from ckptlab.format import read_range
from ckptlab.viz import bytemap_figure, hex_html
from ckptlab.viz._style import human_nbytes, plain_text
from ckptlab.widgets._layout_app import LayoutApp, relayout_x_range
from ckptlab.widgets._plotly_page import (
    PlotlyLoader,
    page_without_plotly,
    plotly_now_loaded,
    plotly_src,
)
from ckptlab.widgets._served import PendingCheckpoint, ServedCheckpoint
from ckptlab.widgets._tensor_table import (
    TABLE_CSS,
    TensorTable,
    tensor_details_html,
)

TENSOR_PROMPT = "<i>Pick a tensor in the table to see its parts, its bytes on the map and hex.</i>"
POLL_MS = 300  # how often a session looks whether the byte map's data has arrived
MAX_FILES_LISTED = 1000  # file picker entries (the largest files, and the one shown)
# bytes of the selected tensor shown in hex (16 lines: the map under it stays near the table)
TENSOR_HEX_NBYTES = 256
# a selected tensor's map shows it in a window this many times its size (see neighbourhood)
NEIGHBOURHOOD = 20
MIN_WINDOW = 4096


class ScrollIntoView(pn.reactive.ReactiveHTML):
    """An invisible mark that scrolls the page just enough to show itself when ``ticket``
    changes (``scrollIntoView({block: "nearest"})``): placed under the byte map, a picked row
    brings the map's outline, and the details and hex above it, into view. (No leading
    underscore: bokehJS cannot resolve such a component class.)"""

    ticket = param.Integer(default=0, doc="bumped by the server to scroll")

    _template = '<div id="mark" class="ckptlab-follow"></div>'
    _scripts: ClassVar[dict[str, str]] = {
        "ticket": "mark.scrollIntoView({block: 'nearest', behavior: 'instant'})"}


def neighbourhood(offset: int, nbytes: int, file_nbytes: int) -> tuple[int, int]:
    """The bytes a map shows around a selected tensor at ``offset`` (``nbytes`` long): a
    window :data:`NEIGHBOURHOOD` times its size (at least :data:`MIN_WINDOW` bytes) centred
    on it, so that it and its neighbours both show, within the file; the whole file when that
    window would be most of it (a large tensor, a one-tensor shard)."""
    width = max(NEIGHBOURHOOD * max(nbytes, 1), MIN_WINDOW)
    if width >= file_nbytes * 0.75:
        return 0, file_nbytes
    lo = min(max(offset + nbytes // 2 - width // 2, 0), file_nbytes - width)
    return lo, lo + width


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
        # every tensor's statistics as table columns, and the health line, on demand
        self.measure_all = pn.widgets.Button(name="statistics of every tensor", width=220,
                                             css_classes=["ckptlab-measure-all"])
        self.measure_all.on_click(lambda _: self.measure_every_tensor())
        self.health = pn.pane.HTML("", sizing_mode="stretch_width",
                                   css_classes=["ckptlab-health-pane"])
        self._stats_callback: Any = None
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
        # the selection's parts right under the table: its details and bytes, then the map
        # with its outline (scrolled into view by ``follow`` when a row is picked)
        self.follow = ScrollIntoView(height=0, margin=0)
        self.view = pn.Column(
            self.title, self.summary, self.safety,
            pn.Row(self.measure_all, self.health, sizing_mode="stretch_width"),
            self.tensors.view,
            pn.Row(pn.Column(self.details, self.measure, self.statistics,
                             sizing_mode="stretch_width"),
                   self.hex, sizing_mode="stretch_width"),
            self.map_section,
            pn.pane.HTML("<h3 style='margin:8px 0 2px'>Values besides tensors</h3>"),
            self.values, sizing_mode="stretch_width", css_classes=["ckptlab-app"])
        doc = pn.state.curdoc
        if (doc is not None and doc.session_context is not None
                and page_without_plotly(doc)):
            # every served page goes without plotly.js (4.8 MB of its 8 MB of JavaScript),
            # which the loader adds once the table is up; the map follows (also one that is
            # ready now: parsing plotly.js first held the table back by seconds)
            self._doc = doc
            self._plotly_loader = PlotlyLoader(src=plotly_src(), height=0, margin=0)
            self._watchers += [
                self._plotly_loader.param.watch(self._on_plotly, ["loaded", "failed"]),
                # the page is drawn: the full open may start (not when panel's warm-up
                # session, built before the port opens, runs its onload callbacks)
                self._plotly_loader.param.watch(lambda _: served.start_loading(), "rendered")]
            self.map_section.append(self._plotly_loader)
        if served.stats is not None:  # measured for an earlier page: shown at once
            self._show_stats()
        self._safety_callback: Any = None
        if not served.safety_done.is_set():  # the verdict comes on its own thread
            if doc is not None and doc.session_context is not None:
                # started once the page is drawn (the browser is busy then, not this
                # process), shown by this session's poll
                pn.state.onload(served.check_safety)
                self._safety_callback = pn.state.add_periodic_callback(self._poll_safety,
                                                                       period=POLL_MS)
            else:  # no page to poll for it (a notebook, a test): found now
                served.check_safety()
                if served.checkpoint is not None:
                    served.safety_done.wait()
                    self.safety.object = served.safety_html
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
                f"({html.escape(plotly_src())}) from this server.",
                css_classes=["ckptlab-map-error"])]
            self.file = ""
            return
        plotly_now_loaded(self._doc)
        self._plotly_loader = None
        self.refresh()

    # -- the byte map section -----------------------------------------------------------------
    def _poll(self) -> None:
        if self.served.ready.is_set():  # a large checkpoint, opened after its first page
            self.served.check_safety()
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
        app.tabs.objects[0].insert(1, self.follow)  # under the map, in its tab

    def _draw_files(self) -> None:
        served = self.served
        files = self.index.files
        first = served.default_file()
        parts: list[Any] = [pn.pane.HTML("<h3 style='margin:8px 0 2px'>Bytes of the files</h3>")]
        overview: list[Any] = []
        if len(files) > 1:
            from ckptlab.viz.bytemap import files_figure

            ranked = sorted(files, key=lambda f: (-f[2], f[0]))[:MAX_FILES_LISTED]
            if all(f[0] != first for f in ranked):
                ranked.append(next(f for f in files if f[0] == first))
            options = {f"{f[0]} · {f[1]} · {human_nbytes(f[2])}": f[0]
                       for f in sorted(ranked, key=lambda f: f[0])}
            self.file_picker = pn.widgets.Select(name="file", options=options, value=first,
                                                 width=520, css_classes=["ckptlab-file-picker"])
            self._watchers.append(self.file_picker.param.watch(self._on_file, "value"))
            parts.append(self.file_picker)
            # every file's bytes, under the map of the one picked (the selection's comes first)
            overview.append(pn.pane.Plotly(files_figure(served.checkpoint),
                                           sizing_mode="stretch_width",
                                           css_classes=["ckptlab-files"]))
        self.map_pane = pn.pane.Plotly(None, sizing_mode="stretch_width",
                                       css_classes=["ckptlab-bytemap"])
        self._watchers += [self.map_pane.param.watch(self._on_relayout, "relayout_data"),
                           self.map_pane.param.watch(self._on_click, "click_data")]
        parts += [self.map_pane, self.follow, *overview]
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
        zoomed, x_range = relayout_x_range(event.new)
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
            data = read_range(self.served.full_path(file), offset, min(nbytes, TENSOR_HEX_NBYTES))
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
                around = neighbourhood(offset, nbytes, app.original.file_nbytes)
                if around != tuple(app.map_pane.object.layout.meta["x_range"]):
                    app.zoom(around)
                fig = app.map_pane.object
                fig.layout.shapes = _marks(_part_ranges(index, row, file),
                                           fig.layout.meta["x_range"])
                app.map_pane.object = fig
        elif self.map_pane is not None:
            around = neighbourhood(offset, nbytes, self.served.bytemap(file).file_nbytes)
            if file != self.file or around != tuple(self.map_pane.object.layout.meta["x_range"]):
                self.show_file(file, around)
            else:
                fig = self.map_pane.object
                fig.layout.shapes = self._selection_shapes(fig)
                self.map_pane.object = fig
        else:
            return
        self.follow.ticket += 1  # the map and its outline into view

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

    def measure_every_tensor(self) -> None:
        """Measure every tensor (:func:`ckptlab.stats`, once for all sessions, on the served
        checkpoint's thread) and show the statistics as table columns with the health line
        above the table (``health``): at once when they are there, else when the session's
        poll finds them."""
        served = self.served
        if served.stats is not None:
            self._show_stats()
            return
        if not served.ready.is_set() or served.checkpoint is None:
            self.health.object = "<i>Still opening the checkpoint: try again shortly.</i>"
            return
        served.measure_all()
        self.measure_all.disabled = True
        self._poll_stats()
        doc = pn.state.curdoc
        if self._stats_callback is None and doc is not None and doc.session_context is not None:
            self._stats_callback = pn.state.add_periodic_callback(self._poll_stats,
                                                                  period=POLL_MS)

    def _poll_safety(self) -> None:
        """Show the served checkpoint's safety verdict once it is there."""
        served = self.served
        done = served.safety_done.is_set()  # read first: once set, safety_html is final
        if self.safety.object != served.safety_html:
            self.safety.object = served.safety_html
        if done and self._safety_callback is not None:
            self._safety_callback.stop()
            self._safety_callback = None

    def _poll_stats(self) -> bool:
        """Show the statistics if they are measured (True), else the progress."""
        served = self.served
        if self.view is None:
            return True
        if served.stats is None and served.stats_error is None:
            self.health.object = (f"<i>Measuring every tensor: {served.stats_measured:,} of "
                                  f"{len(self.index):,}…</i>")
            return False
        if self._stats_callback is not None:
            self._stats_callback.stop()
            self._stats_callback = None
        if served.stats_error is not None:
            self.health.object = ("<b>The statistics could not be measured:</b> "
                                  f"{html.escape(served.stats_error)}")
            self.measure_all.disabled = False
        else:
            self._show_stats()
        return True

    def _show_stats(self) -> None:
        from ckptlab.compare import health
        from ckptlab.viz.compare import health_html

        found = self.served.stats
        self.tensors.show_stats(found)
        unreadable = sum(1 for s in found.values() if s.error)
        self.health.object = health_html(health(found)) + (
            f'<p class="ckptlab-health">{unreadable:,} tensor{"s" * (unreadable != 1)} could '
            "not be read (see its statistics).</p>" if unreadable else "")
        self.measure_all.disabled = True

    def close(self) -> None:
        """Stop reacting to events and drop this session's figures and widgets."""
        for callback in (self._callback, self._stats_callback, self._safety_callback):
            if callback is not None:
                callback.stop()
        self._callback = self._stats_callback = self._safety_callback = None
        for watcher in self._watchers:
            watcher.inst.param.unwatch(watcher)
        self._watchers = []
        self.tensors.close()
        if self.layout_app is not None:
            self.layout_app.close()
        self.view = self.map_section = self.map_pane = self.layout_app = None
        self._plotly_loader = self._doc = None


class IndexProgress:
    """A page's first view while its checkpoint's index is being made: the title, what is
    read and for how long (``.view``), replaced by the :class:`CheckpointApp` once
    :meth:`poll` finds the index there (``app``).

    Such a page goes out without plotly.js (the app's byte map then waits for
    :class:`PlotlyLoader`, as on every page).

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
            page_without_plotly(doc)
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
