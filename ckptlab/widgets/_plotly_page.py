"""plotly.js on a served page only when the page needs it.

plotly.js is 4.8 MB of a served page's 8 MB of JavaScript and the tensor table does not need
it. A checkpoint's page goes out without it (:func:`page_without_plotly`, through panel's
per-document extension list); :class:`PlotlyLoader` adds it once the page is up, and only then
does the session add its plotly panes. :func:`warm_plotly` imports, on a thread, what panel's
first plotly pane of a process would import on the session's thread.
"""

from __future__ import annotations

from typing import Any, ClassVar

import panel as pn
import param

from ckptlab.widgets import _compat


class PlotlyLoader(pn.reactive.ReactiveHTML):
    """Loads plotly.js into the page once the page is up, and says so (``loaded``).

    plotly.js is 4.8 MB of the first page's 8 MB of JavaScript; the tensor table does not
    need it. A served page is sent without it (see :func:`page_without_plotly`); this
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


def warm_plotly() -> None:
    """Import what the first ``pn.pane.Plotly`` of a process imports (``go.FigureWidget``)."""
    import plotly.graph_objs as go

    try:
        go.FigureWidget  # noqa: B018 - the attribute access is the import
    except ImportError:  # the pane does without the figure widget (no anywidget)
        pass


def plotly_src() -> str:
    """The URL (relative to the page) of the plotly.js that panel serves."""
    return _compat.panel_plotly_js_url()


def page_without_plotly(doc: Any) -> bool:
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



def plotly_now_loaded(doc: Any) -> None:
    """Tell panel that ``doc``'s page has plotly.js now (so a new Plotly pane does not warn
    that its extension is missing)."""
    table = _compat.panel_document_extensions()
    if doc is not None and table is not None and doc in table and "plotly" not in table[doc]:
        table[doc].append("plotly")
