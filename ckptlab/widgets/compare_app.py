"""The served comparison page (``ckptlab serve A --compare B``): what changed between two
checkpoints, in a browser. A panel view over :class:`~ckptlab.viz.compare.DiffBrowser`, the
same logic as the notebook's :class:`~ckptlab.widgets.DiffExplorer`: how far each module
moved (click a bar to list its tensors), a tensor search and picker, the histograms of the
tensor picked on both sides and of its changes, and the table of every difference.

The diff is computed once, before the port opens; every page (session) gets its own view
over it and over the two checkpoints, opened once and shared.
"""

from __future__ import annotations

import html
import os
from typing import Any

import panel as pn

from ckptlab.viz.compare import DiffBrowser, counts_text, diff_table_html, hist_figure

__all__ = ["CompareApp", "serve_compare"]


class CompareApp:
    """One page's view of a comparison.

    Parameters
    ----------
    browser
        The :class:`~ckptlab.viz.compare.DiffBrowser` (the diff and its two sides).

    Attributes
    ----------
    view : panel.Column
        What the page shows.
    """

    def __init__(self, browser: DiffBrowser) -> None:
        self.browser = browser
        d = browser.diff
        head = (f"<h2 style='margin:4px 0'>{html.escape(d.a)} (A) vs {html.escape(d.b)} (B)"
                f"</h2><p>{html.escape(counts_text(d))}</p>")
        self.figure = pn.pane.Plotly(browser.figure(theme="light"), sizing_mode="stretch_width",
                                     config={"displaylogo": False, "responsive": True})
        self.figure.param.watch(self._clicked, "click_data")
        self.search = pn.widgets.TextInput(placeholder="tensor: a substring or a glob (*.mlp.*)",
                                           width=340)
        self.search.param.watch(lambda _: self._list(), "value_input")
        self.picker = pn.widgets.Select(name="", width=560)
        self.picker.param.watch(lambda e: self._show(e.new), "value")
        self.note = pn.pane.HTML("", styles={"font-size": "12px"})
        self.hist = pn.pane.Plotly(hist_figure({}, title="Pick a tensor", theme="light"),
                                   sizing_mode="stretch_width",
                                   config={"displaylogo": False, "responsive": True})
        self.table = pn.pane.HTML(diff_table_html(d), sizing_mode="stretch_width",
                                  styles={"overflow-x": "auto"})
        self.view = pn.Column(pn.pane.HTML(head, sizing_mode="stretch_width"), self.figure,
                              pn.Row(self.search, self.picker), self.note, self.hist,
                              pn.pane.HTML("<h3>What differs, the largest changes first</h3>"),
                              self.table, sizing_mode="stretch_width",
                              css_classes=["ckptlab-compare"])
        self._list()

    def _clicked(self, event: Any) -> None:
        points = (event.new or {}).get("points") or []
        bar = points[0].get("pointIndex", points[0].get("pointNumber")) if points else None
        if bar is not None:
            self.search.value = self.search.value_input = self.browser.module_search(int(bar))
            self._list()

    def _list(self) -> None:
        names, line = self.browser.listing(self.search.value_input or "")
        self.picker.options = names
        self.note.object = html.escape(line)
        if names and self.picker.value not in names:
            self.picker.value = names[0]

    def select(self, name: str) -> None:
        """Show tensor ``name`` (A's name): listed, picked, its histograms drawn."""
        if name not in self.browser.diff.tensors:
            raise KeyError(f"{name!r} is not a tensor both sides have")
        self.search.value = self.search.value_input = ""
        self._list()
        self.picker.value = name

    def _show(self, name: str | None) -> None:
        if name:
            self.hist.object = self.browser.histogram(name, theme="light")


def serve_compare(a: str | os.PathLike[str], b: str | os.PathLike[str], *,
                  port: int = 5006, address: str = "127.0.0.1", show: bool = False,
                  **options: Any) -> None:
    """Serve the comparison of checkpoints ``a`` and ``b`` (paths of any formats
    :func:`ckptlab.open` reads) on ``http://address:port/`` until interrupted; ``options``
    go to :func:`ckptlab.diff`. Every JavaScript file is served inline (no CDN)."""
    from ckptlab.checkpoint import open_checkpoint
    from ckptlab.compare import diff
    from ckptlab.widgets.app import _origins

    sides = open_checkpoint(a), open_checkpoint(b)
    browser = DiffBrowser(diff(*sides, **options), *sides)
    pn.extension("plotly", inline=True)
    pn.serve({"/": lambda: CompareApp(browser).view}, port=port, address=address, show=show,
             websocket_origin=_origins(address, port), title="ckptlab compare",
             threaded=False, print_url=True)
