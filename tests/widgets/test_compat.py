"""Every private bokeh/panel/plotly/anywidget/ipywidgets API ckptlab uses exists on the installed
versions and behaves as ``ckptlab/widgets/_compat.py`` says, and nothing else in ``ckptlab/``
touches one."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import pathlib
import re
import socket
import subprocess
import sys
import threading
import types
import uuid
from typing import Any

import pytest

from ckptlab.errors import CkptlabError, LibraryInternalsError
from ckptlab.widgets import _compat

ROOT = pathlib.Path(__file__).resolve().parents[2] / "ckptlab"


# -- one check per use ------------------------------------------------------------------------
def _check_bokeh_server() -> None:
    """``Server._tornado`` is a tornado Application; after ``unlisten()`` and ``start()`` the
    server's own port is closed and the application still serves the requests given to it."""
    from bokeh.server.server import Server
    from tornado.httpclient import AsyncHTTPClient
    from tornado.httpserver import HTTPServer
    from tornado.netutil import bind_sockets
    from tornado.web import Application

    async def run() -> None:
        server = Server({"/": lambda doc: None}, port=0, address="127.0.0.1")
        own_port = server.port
        front = None
        try:
            app = _compat.bokeh_tornado_app(server)
            assert isinstance(app, Application), type(app)
            _compat.bokeh_unlisten(server)
            server.start()
            sockets = bind_sockets(0, "127.0.0.1")
            front = HTTPServer(app)
            front.add_sockets(sockets)
            port = sockets[0].getsockname()[1]
            reply = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}/", raise_error=False)
            assert reply.code == 200 and b"bokeh" in reply.body.lower(), reply.code
            await asyncio.sleep(0.05)  # the listener is closed on the loop
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", own_port), timeout=5).close()
        finally:
            if front is not None:
                front.stop()
            server.stop()

    # in a thread of its own: a test before this one may leave an event loop running in this
    # thread (Playwright's sync API does), and asyncio.run refuses to start inside one
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the bokeh server check hung"
    if errors:
        raise errors[0]


def _check_plotly_js_url() -> None:
    """A ``.js`` URL under panel's static extensions, naming a file panel ships."""
    import panel

    url = _compat.panel_plotly_js_url()
    prefix = "static/extensions/panel/"
    assert url.startswith(prefix) and url.endswith(".js") and "plotly" in url, url
    local = pathlib.Path(panel.__file__).parent / "dist" / url[len(prefix):]
    assert local.is_file() and local.stat().st_size > 1_000_000, local


def _check_document_extensions() -> None:
    """A mapping document -> extension names that ``pn.extension`` fills and panel reads when
    it lists the JavaScript a page carries."""
    import panel as pn
    import panel.models.plotly  # plotly's model, imported in the process
    from bokeh.document import Document
    from panel.io.resources import Resources
    from panel.io.state import set_curdoc

    table = _compat.panel_document_extensions()
    assert table is not None
    doc = Document()
    with set_curdoc(doc):
        pn.extension("tabulator")
        assert table[doc] == ["tabulator"]

        def plotly_js() -> list[str]:
            return [js for js in Resources(mode="server")._collect_external_resources(
                "__javascript__") if "plotly" in js]

        assert plotly_js() == []  # a page without plotly.js
        table[doc].append("plotly")
        assert _compat.panel_plotly_js_url() in plotly_js()
    del table[doc]


def _check_tabulator_hooks() -> None:
    """panel calls both hooks: the mapping is ours, and remote pages are sorted our way."""
    import pandas as pd
    import panel as pn

    calls: list[str] = []

    class Mapping(dict):
        pass

    class Table(_compat.TabulatorHooks, pn.widgets.Tabulator):
        def row_mapping(self, rows: Any) -> Any:
            calls.append("map")
            return Mapping(enumerate(rows.index))

        def sort_rows(self, df: Any) -> Any:
            calls.append("sort")
            return df.iloc[::-1] if self.sorters else df

    frame = pd.DataFrame({"a": [3, 1, 2, 5]})
    table = Table(frame, pagination="remote", page_size=2)
    assert "map" in calls and isinstance(table._index_mapping, Mapping)
    assert dict(table._index_mapping) == {0: 0, 1: 1, 2: 2, 3: 3}
    calls.clear()
    table.sorters = [{"field": "a", "dir": "asc"}]
    assert "sort" in calls
    assert list(table.current_view["a"]) == [5, 2, 1, 3]  # reversed: our sort, not panel's
    assert isinstance(table._index_mapping, Mapping) and table._index_mapping.get(0) == 3
    # the hooks' default: panel's own sort and dict
    plain = type("Plain", (_compat.TabulatorHooks, pn.widgets.Tabulator), {})(
        frame, pagination="remote", page_size=2, sorters=[{"field": "a", "dir": "asc"}])
    assert list(plain.current_view["a"]) == [1, 2, 3, 5]
    assert type(plain._index_mapping) is dict and plain._index_mapping[0] == 1


def _check_widget_bundle() -> None:
    """plotly's bundle: the JavaScript module of plotly's package data, megabytes of it."""
    import plotly

    text = _compat.plotly_widget_bundle()
    assert isinstance(text, str) and len(text) > 1_000_000
    shipped = pathlib.Path(plotly.__file__).parent / "package_data" / "widgetbundle.js"
    assert text == shipped.read_text(encoding="utf-8")
    assert re.search(r"\bexport\s*\{", text), "not an ES module"


def _check_py2js() -> None:
    """Exactly plotly's ``_py2js_*`` traits, each synced to the front end."""
    import plotly.graph_objects as go

    names = _compat.plotly_py2js_traits()
    installed = {n for n in go.FigureWidget.class_trait_names() if n.startswith("_py2js_")}
    assert set(names) == installed and len(names) == len(set(names))
    assert all(go.FigureWidget.class_traits()[n].metadata.get("sync") for n in names)


def _check_anywidget_esm() -> None:
    """An ``_esm`` set on the instance before ``AnyWidget.__init__`` is the synced module."""
    import anywidget

    source = "export default { render({ el }) { el.textContent = 'ok'; } };"

    class Widget(anywidget.AnyWidget):
        def __init__(self) -> None:
            _compat.anywidget_set_esm(self, source)
            super().__init__()

    widget = Widget()
    try:
        assert widget._esm == source and widget.trait_metadata("_esm", "sync")
        assert widget.get_state()["_esm"] == source
        with pytest.raises(LibraryInternalsError, match="_esm trait before __init__"):
            _compat.anywidget_set_esm(widget, source)  # too late: the trait exists
        assert Widget()._esm == source  # per instance, not once per class
    finally:
        widget.close()
    from ckptlab.widgets import _figure

    fig = _figure.FigureWidget()
    try:
        assert fig.get_state()["_esm"] == _figure._loader()
    finally:
        fig.close()


def _check_model_id() -> None:
    """The id set while a widget has no comm is its comm's id once it opens."""
    import ipywidgets

    class Deferred(ipywidgets.Widget):
        defer = True

        def open(self) -> None:
            if not self.defer:
                super().open()

    widget = Deferred()
    try:
        assert widget.comm is None
        wanted = uuid.uuid4().hex
        _compat.ipywidgets_set_model_id(widget, wanted)
        widget.defer = False
        widget.open()
        assert widget.model_id == wanted and widget.comm.comm_id == wanted
        with pytest.raises(LibraryInternalsError, match="has a comm already"):
            _compat.ipywidgets_set_model_id(widget, "late")
    finally:
        widget.close()
    from ckptlab.widgets import _figure

    fig = _figure.FigureWidget()
    try:
        assert fig.model_id == fig._ckptlab_model_id != ""
    finally:
        fig.close()


def _labextension(name: str) -> pathlib.Path | None:
    from jupyter_core.paths import jupyter_path

    for root in jupyter_path("labextensions"):
        static = pathlib.Path(root, name, "static")
        if static.is_dir():
            return static
    return None


def _check_comm_handler() -> None:
    """ipywidgets' JupyterLab front end defines the handler; anywidget's model overrides it;
    the loader names it."""
    from ckptlab.widgets import _figure

    name = _compat.ipywidgets_js_comm_handler()
    manager = _labextension("@jupyter-widgets/jupyterlab-manager")
    if manager is None:
        pytest.skip("ipywidgets' JupyterLab extension is not installed here")
    method = re.compile(rf"\b{re.escape(name)}\(\w*\)\s*\{{")
    assert any(method.search(p.read_text(encoding="utf-8", errors="replace"))
               for p in manager.glob("*.js")), f"no {name}() in {manager}"
    own = _labextension("anywidget")
    assert own is not None
    assert any(f'"{name}"' in p.read_text(encoding="utf-8", errors="replace")
               or method.search(p.read_text(encoding="utf-8", errors="replace"))
               for p in own.glob("*.js")), f"anywidget's model does not override {name}"
    assert f"const COMM_HANDLER = {name!r}".replace("'", '"') in _figure._loader()


CHECKS = {
    "bokeh.server.server.Server._tornado": _check_bokeh_server,
    "bokeh.server.server.Server.unlisten": _check_bokeh_server,
    "panel.models.plotly.PlotlyPlot.__javascript__": _check_plotly_js_url,
    "panel.io.state.state._extensions_": _check_document_extensions,
    "panel.widgets.Tabulator._update_index_mapping": _check_tabulator_hooks,
    "panel.widgets.Tabulator._sort_df": _check_tabulator_hooks,
    "plotly.graph_objects.FigureWidget._esm": _check_widget_bundle,
    "plotly.basewidget.BaseFigureWidget._py2js_*": _check_py2js,
    "anywidget.AnyWidget.__init__ (instance _esm)": _check_anywidget_esm,
    "ipywidgets.Widget._model_id": _check_model_id,
    "@jupyter-widgets/base WidgetModel._handle_comm_msg": _check_comm_handler,
}


def test_every_use_has_a_check() -> None:
    assert set(CHECKS) == set(_compat.USES)


@pytest.mark.parametrize("check", sorted(set(CHECKS.values()), key=lambda f: f.__name__),
                         ids=lambda f: f.__name__.removeprefix("_check_"))
def test_private_use_holds_on_installed_version(check: Any) -> None:
    check()


@pytest.mark.parametrize("name", sorted(_compat.USES))
def test_use_names_the_versions_it_was_checked_on(name: str) -> None:
    use = _compat.USES[name]
    assert use.use and use.breaks and use.checked_on
    installed = _compat.installed_version(use.library)
    assert installed in use.checked_on, (
        f"{use.library} {installed} is installed but {name} was checked on "
        f"{', '.join(use.checked_on)}: run tests/widgets/test_compat.py and, if it passes, "
        f"add {installed} to _compat.CHECKED_ON")


def test_a_missing_private_is_a_clear_ckptlab_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import bokeh
    import plotly.graph_objects as go
    from plotly.basewidget import BaseFigureWidget

    with pytest.raises(LibraryInternalsError) as info:
        _compat.bokeh_tornado_app(object())
    err = info.value
    assert isinstance(err, CkptlabError) and isinstance(err, RuntimeError)
    assert err.symbol == "bokeh.server.server.Server._tornado" and err.library == "bokeh"
    assert err.version == bokeh.__version__
    text = str(err)
    assert bokeh.__version__ in text and "3.4.0" in text and "expected" in text
    assert "got" in text and "quick page" in text  # what breaks
    with pytest.raises(LibraryInternalsError, match="no unlisten"):
        _compat.bokeh_unlisten(object())
    monkeypatch.delattr(BaseFigureWidget, "_esm")
    assert not hasattr(go.FigureWidget, "_esm")
    with pytest.raises(LibraryInternalsError, match=r"plotly .* has no plotly\.graph_objects"):
        _compat.plotly_widget_bundle()


def test_import_is_cheap() -> None:
    code = ("import sys, ckptlab.widgets._compat; "
            "print(sorted(m for m in ('bokeh', 'panel', 'plotly', 'anywidget', 'ipywidgets', "
            "'tornado') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(ROOT.parent)})
    assert out.stdout.strip() == "[]"


# -- nothing else in ckptlab/ touches a private third-party API -------------------------------
THIRD_PARTY = frozenset({
    "bokeh", "panel", "plotly", "anywidget", "ipywidgets", "tornado", "param", "traitlets",
    "jupyter_core", "jupyterlab", "jupyter_server", "jupyterlab_widgets", "comm", "ipykernel",
    "IPython", "pyviz_comms", "pandas"})
# Python's own dunders (``type(x).__name__``, ``object.__setattr__``, ``plotly.__version__``)
PY_DUNDERS = frozenset(
    {n for t in (object, type, types.FunctionType, types.ModuleType, types.MethodType, int,
                 dict, list, BaseException, property, staticmethod, classmethod)
     for n in dir(t) if n.startswith("__")}
    | {"__version__", "__all__", "__path__", "__file__", "__wrapped__", "__enter__",
       "__exit__", "__post_init__", "__slots__", "__dataclass_fields__", "__annotations__",
       "__fspath__", "__iter__", "__next__", "__len__", "__getitem__", "__call__", "__get__",
       "__set__", "__mro__", "__bases__", "__func__", "__self__", "__code__", "__main__"})
# underscore names the libraries document as their extension points (public API)
DOCUMENTED = frozenset({
    "_esm", "_css",  # anywidget: a subclass's front-end module and style
    "_view_name", "_view_module", "_view_module_version", "_model_name", "_model_module",
    "_model_module_version",  # ipywidgets: custom widget traits
    "_template", "_scripts", "_dom_events", "_child_config", "_extension_name",  # ReactiveHTML
})
SKIP = {"widgets/_compat.py", "_torch_compat.py"}
# the standard library's documented names with one underscore (os._exit, namedtuple's API)
STDLIB_DOCUMENTED = frozenset({"_exit", "_asdict", "_replace", "_fields", "_make",
                               "_field_defaults"})


def _private(name: str) -> bool:
    if name.startswith("__") and name.endswith("__"):
        return name not in PY_DUNDERS
    return name.startswith("_") and not (name.startswith("_repr_") or
                                         name.startswith("_ipython_"))


def _sources() -> dict[str, ast.Module]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(encoding="utf-8"))
            for p in sorted(ROOT.rglob("*.py"))}


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """Every name ckptlab itself defines (functions, classes, assigned names and attributes,
    arguments, module names): a private attribute of one of these is ckptlab's own."""
    own = {p.rsplit("/", 1)[-1].removesuffix(".py") for p in trees}
    own |= {p.parent.name for p in ROOT.rglob("__init__.py")}
    for rel, tree in trees.items():
        if rel in SKIP:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(
                    node.ctx, ast.Store):
                own.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "__setattr__" and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant):
                own.add(str(node.args[1].value))  # object.__setattr__(self, "_memo", ...)
    return own


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Names bound to third-party modules or objects -> what they name (dotted)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in THIRD_PARTY:
                    if a.asname:
                        names[a.asname] = a.name
                    else:
                        names[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] in THIRD_PARTY:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _is_member(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: what a class's own members are reached through."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and ast.unparse(node) == "super()"


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _string_attribute(node: ast.Call) -> tuple[ast.AST, str] | None:
    """``getattr(obj, "_x", ...)`` (and setattr, hasattr, delattr) -> (obj, "_x")."""
    if isinstance(node.func, ast.Name) and node.func.id in (
            "getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
            isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return node.args[0], node.args[1].value
    return None


def _third_party_privates(cls: type) -> set[str]:
    """Private names the third-party classes of ``cls``'s MRO define: class attributes and
    methods, and attributes their methods assign on ``self``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in THIRD_PARTY:
            continue
        names.update(n for n in vars(klass) if _private(n))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        import textwrap

        for node in ast.walk(ast.parse(textwrap.dedent(source))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self" and \
                    _private(node.attr):
                names.add(node.attr)
    return names


def _class_uses(node: ast.ClassDef) -> dict[str, int]:
    """Private names a class body defines (but the documented extension points) or uses on
    self / super() (all: ``self._esm = ...`` in a method is not anywidget's documented way)."""
    found: dict[str, int] = {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.setdefault(item.name, item.lineno)
        targets = item.targets if isinstance(item, ast.Assign) else (
            [item.target] if isinstance(item, ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Name) and t.id not in DOCUMENTED:
                found.setdefault(t.id, item.lineno)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and _is_member(sub.value):
            found.setdefault(sub.attr, sub.lineno)
        elif isinstance(sub, ast.Call) and (pair := _string_attribute(sub)) and \
                _is_member(pair[0]):
            found.setdefault(pair[1], sub.lineno)
    return {n: line for n, line in found.items() if _private(n)}


# JavaScript in ckptlab's strings: a private member of a library's front end (``obj._x``,
# ``"_x"``) names ckptlab's own traits only
_JS = re.compile(r"=>|\bfunction\b|\bdocument\.|\bconst\b")
_JS_PRIVATE = re.compile(r"\.(_[A-Za-z]\w*)|[\"'`](_[A-Za-z]\w*)[\"'`]")


def _private_uses(rel: str, tree: ast.Module, own: set[str]) -> list[str]:
    aliases = _aliases(tree)
    module = "ckptlab." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] in THIRD_PARTY:
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in node.module.split(".")) or \
                    any(_private(n) for n in names):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found.extend(f"{node.lineno}: import {a.name}" for a in node.names
                         if a.name.split(".")[0] in THIRD_PARTY
                         and any(p.startswith("_") for p in a.name.split(".")))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            if _is_member(node.value):
                continue  # a class's own members: checked against its bases below
            if root not in aliases and node.attr in STDLIB_DOCUMENTED:
                continue
            if root in aliases or node.attr not in own:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and (pair := _string_attribute(node)) and \
                _private(pair[1]):
            obj, name = pair
            if _is_member(obj):
                continue
            if _root(obj) in aliases or name not in own:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                _JS.search(node.value):
            for m in _JS_PRIVATE.finditer(node.value):
                name = m.group(1) or m.group(2)
                if name not in own and not name.startswith("__ckptlab"):
                    found.append(f"{node.lineno}: {name!r} in JavaScript")
    # classes with a third-party base: their own private names must not be the bases'
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or not node.bases:
            continue
        cls = getattr(importlib.import_module(module), node.name, None)
        if not isinstance(cls, type):
            continue
        theirs = _third_party_privates(cls)
        found.extend(f"{line}: {node.name}.{name} (private in a base class)"
                     for name, line in _class_uses(node).items() if name in theirs)
    return found


def test_private_uses_only_in_compat() -> None:
    """Every private bokeh/panel/plotly/anywidget/ipywidgets/tornado/param/traitlets/jupyter
    name is reached through ckptlab/widgets/_compat.py (or ckptlab/_torch_compat.py for
    torch): a new one gets its accessor, its versions and its test there."""
    trees = _sources()
    own = _own_names(trees)
    offenders = {}
    for rel, tree in trees.items():
        scanned = rel.startswith(("widgets/", "viz/", "cli/", "testing/")) or _aliases(tree)
        if rel in SKIP or not scanned:
            continue
        found = _private_uses(rel, tree, own)
        if found:
            offenders[rel] = found
    assert not offenders, (
        f"private third-party APIs outside ckptlab/widgets/_compat.py: {offenders}")


def test_the_scan_finds_what_it_is_for() -> None:
    """The scan itself: each kind of private use is caught, ckptlab's own names are not."""
    source = '''
import panel as pn
from bokeh.server.server import Server
from plotly.basewidget import _private_helper

def f(server, fig):
    a = server._tornado
    b = pn.state._extensions_
    c = getattr(pn.state, "_extensions_", None)
    d = Server.__javascript__
    e = fig._ckptlab_own
    g = type(fig).__name__
    h = "const x = () => base._handle_comm_msg(msg)"
    return a, b, c, d, e, g, h
'''
    tree = ast.parse(source)
    own = {"_ckptlab_own", "f", "server", "fig"}
    found = "\n".join(_private_uses("testing/probe.py", tree, own))
    for expected in ("_private_helper", "server._tornado", "pn.state._extensions_",
                     "getattr(pn.state, '_extensions_', None)", "Server.__javascript__",
                     "'_handle_comm_msg' in JavaScript"):
        assert expected in found, (expected, found)
    assert "_ckptlab_own" not in found and "__name__" not in found
    import panel as pn

    probe = ast.parse("class Table(pn.widgets.Tabulator):\n"
                      "    _template = '<div></div>'\n"
                      "    def _sort_df(self, df):\n"
                      "        return self._processed\n"
                      "    def row_mapping(self, rows):\n"
                      "        return self._own\n")
    theirs = _third_party_privates(pn.widgets.Tabulator)
    assert {n for n in _class_uses(probe.body[0]) if n in theirs} == {"_sort_df", "_processed"}


def test_a_server_skips_slow_optional_imports() -> None:
    """In a fresh process: after skip_slow_optional_imports, plotly's figure widget (which a
    served page's plotly pane imports) comes without rfc3987_syntax, jsonschema still
    validates, and a module imported already is left alone."""
    code = (
        "import sys, json\n"
        "from ckptlab.widgets import _compat\n"
        "skipped = _compat.skip_slow_optional_imports()\n"
        "import plotly.graph_objs as go\n"
        "go.FigureWidget\n"
        "import jsonschema\n"
        "jsonschema.validate({'a': 1}, {'type': 'object', 'properties': {'a': {'type': 'integer'}}})\n"
        "print(json.dumps([skipped, sys.modules.get('rfc3987_syntax', 'absent') is None,"
        " _compat.skip_slow_optional_imports()]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    skipped, blocked, again = json.loads(out.stdout.strip().splitlines()[-1])
    assert skipped == list(_compat.SLOW_OPTIONAL_IMPORTS) and blocked and again == []
