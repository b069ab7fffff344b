"""Every private API of bokeh, panel, plotly, anywidget and ipywidgets that ckptlab uses.

The views need a few things these libraries do not offer publicly: the tornado application
inside bokeh's server (the quick page hands it the public port's requests), panel's
per-document extension list (a page sent without plotly.js), panel's bundled plotly.js, the
Tabulator's row mapping, plotly's widget bundle and message traits, and the hooks anywidget and
ipywidgets give a widget's front-end module and comm id. This module is the only place in
``ckptlab/`` that touches them (``tests/widgets/test_compat.py`` scans the source to keep it
so), and each use below says what it is, where ckptlab uses it, what breaks if it changes and
which versions it was checked on: the installed ones (run by the test) and the oldest that
``pyproject.toml``'s ``widgets`` extra allows, read in that release's wheel. A use that is
gone raises :class:`~ckptlab.errors.LibraryInternalsError` naming it and the installed
version, rather than an ``AttributeError`` deep inside a view; a use whose loss only costs
speed (the Tabulator's mapping, panel's extension list) falls back to the library's own way.

Nothing is imported at module import time: :mod:`ckptlab.widgets.quick` imports this module
before panel, bokeh or plotly is imported, and must not import them.

Names a ckptlab class defines through a library's *documented* extension points (anywidget's
``_esm``/``_css`` class attributes, panel ``ReactiveHTML``'s ``_template``/``_scripts``,
ipywidgets' ``_view_name``/``_model_name`` traits, IPython's ``_repr_*_``) are public API and
are not listed here.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import LibraryInternalsError

__all__ = [
    "CHECKED_ON",
    "SLOW_OPTIONAL_IMPORTS",
    "USES",
    "PrivateUse",
    "TabulatorHooks",
    "anywidget_set_esm",
    "bokeh_tornado_app",
    "bokeh_unlisten",
    "installed_version",
    "ipywidgets_js_comm_handler",
    "ipywidgets_set_model_id",
    "panel_document_extensions",
    "panel_plotly_js_url",
    "plotly_py2js_traits",
    "plotly_widget_bundle",
    "skip_slow_optional_imports",
]

#: distribution -> the versions the uses of it were checked on: the oldest the ``widgets``
#: extra allows (read in its wheel: the same names, the same behaviour ckptlab relies on) and
#: the installed one (run by tests/widgets/test_compat.py). plotly's first is 6.0.0, not the
#: extra's 5.20: plotly 5's FigureWidget is an ipywidgets DOMWidget without an anywidget
#: bundle (see :func:`plotly_widget_bundle`). jupyterlab_widgets is ipywidgets' JupyterLab
#: front end (3.0.7 is the oldest ipywidgets 8.1.0 takes).
CHECKED_ON: dict[str, tuple[str, ...]] = {
    "bokeh": ("3.4.0", "3.9.2"),
    "panel": ("1.4.0", "1.9.4"),
    "plotly": ("6.0.0", "7.1.0"),
    "anywidget": ("0.9.0", "0.11.0"),
    "ipywidgets": ("8.1.0", "8.1.9"),
    "jupyterlab_widgets": ("3.0.7", "3.0.17"),
}


@dataclass(frozen=True, slots=True)
class PrivateUse:
    """One private API of a third-party library that ckptlab relies on.

    Parameters
    ----------
    name
        The private thing, dotted (``bokeh.server.server.Server._tornado``).
    library
        The distribution that holds it (``bokeh``).
    use
        What ckptlab does with it, and where.
    breaks
        What stops working when it moves or changes.
    checked_on
        Versions of ``library`` on which it was checked.
    """

    name: str
    library: str
    use: str
    breaks: str
    checked_on: tuple[str, ...] = ()


def _use(name: str, library: str, use: str, breaks: str) -> tuple[str, PrivateUse]:
    return name, PrivateUse(name, library, use, breaks, CHECKED_ON[library])


#: name -> the use; every private bokeh/panel/plotly/anywidget/ipywidgets API ckptlab touches
USES: dict[str, PrivateUse] = dict([
    _use("bokeh.server.server.Server._tornado", "bokeh",
         "the server's tornado Application (BokehTornado): widgets/quick.py hands it every "
         "request of the public port but the quick page's, once the workbench is built",
         "the quick page never turns into the workbench (it says why)"),
    _use("bokeh.server.server.Server.unlisten", "bokeh",
         "closes the port bokeh bound for the workbench's server (made with start=False), "
         "which is then started and keeps serving the requests handed to its tornado "
         "application: widgets/app.py workbench_server. bokeh documents the server as "
         "unusable after unlisten(); it only stops its HTTPServer (_http.stop())",
         "the workbench's requests fail, or a second port stays open on 127.0.0.1"),
    _use("panel.models.plotly.PlotlyPlot.__javascript__", "panel",
         "the plotly.js panel serves (its first entry, a URL relative to the page, "
         "static/extensions/panel/bundled/plotlyplot/plotly-<v>.min.js): the PlotlyLoader "
         "of widgets/_plotly_page.py adds it to a page sent without it",
         "byte maps of a served page stay empty (the loader says plotly.js failed)"),
    _use("panel.io.state.state._extensions_", "panel",
         "panel's per-document list of extensions whose JavaScript a page carries (a "
         "WeakKeyDictionary, document -> names): widgets/_plotly_page.py sends a page without "
         "plotly.js and records when it has loaded it",
         "nothing breaks: every page carries plotly.js again (4.8 MB more before first paint)"),
    _use("panel.widgets.Tabulator._update_index_mapping", "panel",
         "panel's rebuild of Tabulator._index_mapping (shown position -> row label) from "
         "Tabulator._processed (the rows shown, a DataFrame), a dict over every row on each "
         "filter: widgets/_tensor_table.py's LazyRowsTabulator makes it a lazy mapping "
         "(TabulatorHooks.row_mapping)",
         "nothing breaks: the table builds panel's dict again (65 ms per filter at 100k rows); "
         "a mapping panel no longer reads would map a click to the wrong row"),
    _use("panel.widgets.Tabulator._sort_df", "panel",
         "panel's sort of the rows of each page it sends (remote pagination) by the table's "
         "sorters: widgets/_tensor_table.py's LazyRowsTabulator sorts as ckptlab's tensor "
         "query does instead (TabulatorHooks.sort_rows)",
         "nothing breaks: the table sorts as panel does (lower-cased text, so '10' before "
         "'2'), unlike the quick page and the CLI"),
    _use("plotly.graph_objects.FigureWidget._esm", "plotly",
         "plotly's anywidget front-end bundle (5 MB of JavaScript, from plotly 6.0): "
         "widgets/_figure.py sends it once per page, on request, instead of once per figure",
         "ckptlab's FigureWidget cannot be made (LibraryInternalsError names plotly's version)"),
    _use("plotly.basewidget.BaseFigureWidget._py2js_*", "plotly",
         "the synced traits through which plotly's Python side sends its front end each "
         "change (_py2js_addTraces, _py2js_restyle, ...): widgets/_figure.py's loader queues "
         "those that arrive before plotly's bundle is loaded and replays them",
         "a figure misses the updates sent while plotly.js loads (an empty or stale figure)"),
    _use("anywidget.AnyWidget.__init__ (instance _esm)", "anywidget",
         "AnyWidget.__init__ turns an _esm attribute it finds on the instance (not a trait "
         "yet) into the synced _esm trait: widgets/_figure.py gives each figure the small "
         "loader module instead of plotly's 5 MB bundle",
         "each figure sends plotly's whole bundle and imports it (anywidget drops the messages "
         "of figures made together: figures stay empty)"),
    _use("ipywidgets.Widget._model_id", "ipywidgets",
         "the comm id Widget.open() uses when it creates the comm: widgets/_figure.py opens "
         "the figure's comm itself, once the figure is complete, under an id it also gives "
         "the loader (which then takes the comm's messages directly)",
         "the loader cannot find its own model: messages after anywidget's 2 s deadline are "
         "dropped on a busy machine"),
    _use("@jupyter-widgets/base WidgetModel._handle_comm_msg", "jupyterlab_widgets",
         "ipywidgets' front-end handler of a model's comm messages (JavaScript), which "
         "anywidget's AnyModel overrides to hold messages until it is initialized (0.11.0; "
         "not 0.9.0): the loader of widgets/_figure.py calls ipywidgets' own, past "
         "anywidget's gate",
         "nothing breaks at once (the loader checks it is a function and otherwise skips): "
         "messages after anywidget's 2 s deadline are dropped on a busy machine"),
])


# Optional modules a served workbench would import only by chance, and which cost seconds:
# panel's plotly pane checks ``isinstance(obj, go.FigureWidget)``, plotly's figure widget
# imports nbformat, nbformat imports jsonschema, and jsonschema imports ``rfc3987_syntax``
# (when installed: jupyter's jsonschema[format-nongpl] brings it) to check the "iri" string
# format, which builds a Lark grammar at import: 2.2 s of the server's CPU before the first
# workbench page. No page validates an IRI.
SLOW_OPTIONAL_IMPORTS = ("rfc3987_syntax",)


def skip_slow_optional_imports() -> list[str]:
    """In a server process (``ckptlab serve``), make the modules of
    :data:`SLOW_OPTIONAL_IMPORTS` unimportable (``sys.modules[name] = None``: the library that
    wants them takes the ImportError path it has for when they are not installed), unless one
    is imported already. Returns the names skipped."""
    import sys

    skipped = []
    for name in SLOW_OPTIONAL_IMPORTS:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
            skipped.append(name)
    return skipped


def installed_version(library: str) -> str:
    """The installed version of distribution ``library``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _missing(name: str, why: str) -> LibraryInternalsError:
    use = USES[name]
    version = installed_version(use.library)
    return LibraryInternalsError(
        f"{use.library} {version} has no {name} ({why}); ckptlab uses it for {use.use}; "
        f"without it {use.breaks}. It was checked on {use.library} "
        f"{', '.join(use.checked_on)} (expected {name}, got {why}): install one of those "
        f"versions or report the change",
        symbol=name, library=use.library, version=version, checked_on=use.checked_on)


# -- bokeh -----------------------------------------------------------------------------------
def bokeh_tornado_app(server: Any) -> Any:
    """``bokeh.server.server.Server._tornado``: the server's tornado ``Application``
    (``BokehTornado``), which serves any request handed to it (an HTTP server connection
    delegate). Checked on bokeh 3.4.0 and 3.9.2.

    Raises
    ------
    LibraryInternalsError
        When the server has no such attribute.
    """
    try:
        return server._tornado
    except AttributeError:
        raise _missing("bokeh.server.server.Server._tornado",
                       f"{type(server).__name__} has no _tornado") from None


def bokeh_unlisten(server: Any) -> None:
    """Close the port a bokeh ``Server`` bound, keeping the server usable through
    :func:`bokeh_tornado_app` (call before ``server.start()``).

    ``Server.unlisten()`` is public, but documented as leaving the server unusable; on bokeh
    3.4.0 and 3.9.2 it only stops the server's ``HTTPServer`` (and closes its connections),
    and the tornado application keeps serving the requests given to it.

    Raises
    ------
    LibraryInternalsError
        When the server has no ``unlisten``.
    """
    unlisten = getattr(server, "unlisten", None)
    if not callable(unlisten):
        raise _missing("bokeh.server.server.Server.unlisten",
                       f"{type(server).__name__} has no unlisten()")
    unlisten()


# -- panel -----------------------------------------------------------------------------------
def panel_plotly_js_url() -> str:
    """The URL (relative to the page) of the plotly.js panel serves:
    ``panel.models.plotly.PlotlyPlot.__javascript__[0]`` (bokeh's per-model resource list,
    ``static/extensions/panel/bundled/plotlyplot/plotly-<v>.min.js``). Checked on panel 1.4.0
    and 1.9.4.

    Raises
    ------
    LibraryInternalsError
        When the list is missing, empty, or its first entry is not a ``.js`` URL.
    """
    name = "panel.models.plotly.PlotlyPlot.__javascript__"
    try:
        from panel.models.plotly import PlotlyPlot

        scripts = PlotlyPlot.__javascript__
    except (ImportError, AttributeError) as exc:
        raise _missing(name, f"{type(exc).__name__}: {exc}") from None
    if not scripts or not str(scripts[0]).endswith(".js"):
        raise _missing(name, f"its first entry is not plotly.js: {scripts!r}")
    return str(scripts[0])


def panel_document_extensions() -> MutableMapping[Any, list[str]] | None:
    """``panel.io.state.state._extensions_``: document -> the extensions (``"tabulator"``,
    ``"plotly"``) whose JavaScript panel puts on that document's page, or None where this
    panel has no such table (the page then carries every extension imported: it still works).
    Checked on panel 1.4.0 and 1.9.4 (a class-level ``WeakKeyDictionary``)."""
    try:
        from panel.io.state import state
    except ImportError:
        return None
    table = getattr(state, "_extensions_", None)
    return table if isinstance(table, MutableMapping) else None


class TabulatorHooks:
    """A mixin for ``panel.widgets.Tabulator`` (put it before Tabulator among the bases) with
    two public hooks over panel's private ones: :meth:`row_mapping` and :meth:`sort_rows`.

    - Panel keeps the position -> row label mapping of the shown rows in
      ``Tabulator._index_mapping`` (read to map a click's row), rebuilt as a dict over every
      row by ``_update_index_mapping()`` from ``_processed`` (the rows shown, after filters
      and sorts) on each filter and at creation. The mixin overrides
      ``_update_index_mapping`` to set :meth:`row_mapping`'s mapping instead.
    - Panel sorts the rows of every page it sends (remote pagination) and of every selection
      in ``Tabulator._sort_df(df)`` by its ``sorters``. The mixin overrides it with
      :meth:`sort_rows`.

    Where a hook returns None (the default) panel's own runs. Checked on panel 1.4.0 and
    1.9.4. If panel stops calling them, panel's own dict and sort are used (correct, slower;
    sorted as panel sorts).
    """

    def row_mapping(self, rows: Any) -> Mapping[int, Any] | None:
        """The position -> label mapping of ``rows`` (the shown rows, a pandas DataFrame), or
        None for panel's own dict."""
        return None

    def sort_rows(self, df: Any) -> Any:
        """``df`` (a pandas DataFrame of rows) in the table's sort order, or None for panel's
        own sort."""
        return None

    def _update_index_mapping(self) -> None:
        rows = getattr(self, "_processed", None)
        mapping = self.row_mapping(rows) if rows is not None else None
        if mapping is None:
            super()._update_index_mapping()  # type: ignore[misc]
        else:
            self._index_mapping = mapping

    def _sort_df(self, df: Any) -> Any:
        rows = self.sort_rows(df)
        return super()._sort_df(df) if rows is None else rows  # type: ignore[misc]


# -- plotly ----------------------------------------------------------------------------------
# the _py2js_* traits of plotly.basewidget.BaseFigureWidget (plotly 6.0.0 and 7.1.0)
_PY2JS = ("_py2js_addTraces", "_py2js_deleteTraces", "_py2js_moveTraces", "_py2js_restyle",
          "_py2js_relayout", "_py2js_update", "_py2js_animate", "_py2js_removeLayoutProps",
          "_py2js_removeTraceProps")


def plotly_widget_bundle() -> str:
    """plotly's anywidget front-end module, ``plotly.graph_objects.FigureWidget._esm`` (the
    text of ``plotly/package_data/widgetbundle.js``). Checked on plotly 6.0.0 and 7.1.0; plotly
    5's FigureWidget is an ipywidgets DOMWidget and has none. Read it once (5 MB).

    Raises
    ------
    LibraryInternalsError
        When ``FigureWidget`` has no ``_esm`` or it is empty.
    """
    name = "plotly.graph_objects.FigureWidget._esm"
    try:
        import plotly.graph_objects as go

        esm = go.FigureWidget._esm
    except (ImportError, AttributeError) as exc:
        raise _missing(name, f"{type(exc).__name__}: {exc}") from None
    text = str(esm)
    if not text.strip():
        raise _missing(name, "it is empty")
    return text


def plotly_py2js_traits() -> tuple[str, ...]:
    """The names of plotly's ``_py2js_*`` traits (``BaseFigureWidget``): every message plotly's
    Python side sends its front end goes through one of them. Checked on plotly 6.0.0 and
    7.1.0 (the test compares them with the installed plotly's)."""
    return _PY2JS


# -- anywidget and ipywidgets ---------------------------------------------------------------
def anywidget_set_esm(widget: Any, source: str) -> None:
    """Give one AnyWidget instance its own front-end module: call it in the subclass's
    ``__init__`` before ``AnyWidget.__init__``, which makes an ``_esm`` it finds on the
    instance (not a trait yet) the synced ``_esm`` trait. Checked on anywidget 0.9.0 and
    0.11.0.

    Raises
    ------
    LibraryInternalsError
        When ``widget`` already has an ``_esm`` trait (called after ``AnyWidget.__init__``,
        or an anywidget that makes it a trait of the class: the source would be ignored).
    """
    has_trait = getattr(widget, "has_trait", None)
    if callable(has_trait) and has_trait("_esm"):
        raise _missing("anywidget.AnyWidget.__init__ (instance _esm)",
                       f"{type(widget).__name__} has an _esm trait before __init__")
    widget._esm = source


def ipywidgets_set_model_id(widget: Any, model_id: str) -> None:
    """Set the comm id ``Widget.open()`` will use (``ipywidgets.Widget._model_id``): call it
    while the widget has no comm (``widget.comm is None``). Checked on ipywidgets 8.1.0 and
    8.1.9.

    Raises
    ------
    LibraryInternalsError
        When the widget has a comm already (the id would be ignored).
    """
    if getattr(widget, "comm", None) is not None:
        raise _missing("ipywidgets.Widget._model_id",
                       f"{type(widget).__name__} has a comm already")
    widget._model_id = model_id


def ipywidgets_js_comm_handler() -> str:
    """The name of ipywidgets' front-end ``WidgetModel`` method that handles a comm message
    (``_handle_comm_msg``). Checked on the JupyterLab front end of ipywidgets
    (jupyterlab_widgets 3.0.7 and 3.0.17). anywidget 0.11.0's ``AnyModel`` overrides it to
    hold messages until the model is initialized; 0.9.0's does not (the loader then leaves
    the comm alone: there is no gate to get past)."""
    return "_handle_comm_msg"
