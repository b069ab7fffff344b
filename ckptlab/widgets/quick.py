"""The quick first page of ``ckptlab serve``: the tensor table before panel is imported.

Importing panel and bokeh takes about 1.5 s and a panel page about 2.5 s more (3.4 MB of
JavaScript, a bokeh session): the workbench's first paint cannot come within 3 s of starting
the server. So :func:`serve` binds the public port first (tornado only: nothing here imports
panel, bokeh, plotly or ipywidgets) and answers ``/`` with a small self-contained page
(inline CSS and JavaScript, nothing fetched from elsewhere): the checkpoint's name, a one-line
summary and its tensor table, searchable (a name part or a glob), sortable and paged, with
filter, sort and paging done on the server by the one tensor query
(:mod:`ckptlab.checkpoint.query`; ``GET /ckptlab/quick/rows``, at most :data:`MAX_ROWS` rows
an answer). While the index is being made (:class:`PendingRows`; a
cached index is read from the :class:`~ckptlab.checkpoint._cache.InspectionCache` in a
fraction of a second) the page shows a progress line and asks ``/ckptlab/quick/state``,
which holds its answer until the index is there (or a second has passed).

Then the workbench. Once the index is there (and the page has had its first rows, or a second
later) a thread imports panel and makes the
:class:`~ckptlab.widgets.app.ServedCheckpoint` over the same rows (the index first: on a cold
cache both are Python holding the GIL, and the table is what a visitor waits for), and the
IOLoop builds panel's server (:func:`ckptlab.widgets.app.workbench_server`), which listens on
no port of its own. :class:`QuickServer`, the public port's request router, then sends every
request but the quick routes (``/ckptlab/quick/...``) to panel's tornado application: its
page, its static JavaScript and its websocket come through the public port. The quick page
sees ``workbench`` turn true and reloads itself (its search text goes along as ``?q=``, which
the workbench puts in its own search box); from then on ``/`` is the workbench.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tornado import httputil, locks, web
from tornado.httpserver import HTTPServer
from tornado.ioloop import IOLoop

from ckptlab._words import plural
from ckptlab.checkpoint._cache import CheckpointIndex, InspectionCache
from ckptlab.errors import InvalidArgumentError
from ckptlab.viz._style import human_nbytes, plain_text
from ckptlab.widgets import _compat

if TYPE_CHECKING:  # pandas and numpy come with the index, on its thread
    import numpy as np
    import pandas as pd

    from ckptlab.checkpoint.query import TensorCatalog, TensorQuery

__all__ = ["MAX_ROWS", "PAGE_ROWS", "QUICK_PREFIX", "CheckpointRows", "Pending", "PendingRows",
           "QuickServer", "serve"]

QUICK_PREFIX = "/ckptlab/quick/"  # the quick page's JSON routes, kept after the switch
PAGE_ROWS = 100  # rows the page asks for at a time
MAX_ROWS = 500  # the most rows one answer holds (a larger limit is cut to it)
MAX_PATTERN = 1000  # the longest search accepted, in characters
NUMERIC = ("bytes", "parameters", "offset")
LONG_POLL_S = 1.0  # how long ``state?wait=...`` holds its answer for the change it waits for
# how long the workbench's panel import waits for the quick page's first rows to have been
# sent (both hold the GIL; a page open now sees its table first, none open loses little)
FIRST_ROWS_WAIT_S = 1.0
# how long serve() waits for the index before its loop starts: a checkpoint that cannot be
# read by then is an error of the command (one line, exit status 2), not a page that says so
FAIL_FAST_S = 1.0


def checkpoint_nbytes(path: str) -> int:
    """Bytes of a checkpoint file, or of the files directly inside a checkpoint directory."""
    if os.path.isdir(path):
        with os.scandir(path) as entries:
            return sum(e.stat().st_size for e in entries if e.is_file())
    return os.stat(path).st_size


def display_name(path: str) -> str:
    """A checkpoint's name as titles show it (the last part of its path, printable)."""
    return plain_text(path.rstrip("/").rsplit("/", 1)[-1] or path)


class CheckpointRows:
    """A checkpoint's tensor table, as the quick page and the workbench both read it.

    ``index`` (a :class:`~ckptlab.checkpoint._cache.CheckpointIndex`) comes from
    ``inspection_cache`` when the checkpoint was seen before, else from opening it (then
    ``checkpoint`` is the opened :class:`~ckptlab.checkpoint.Checkpoint` and the index is
    stored); ``frame`` is the table's rows (:func:`~ckptlab.widgets._table_rows.tensor_frame`)
    and ``catalog`` (a :class:`~ckptlab.checkpoint.query.TensorCatalog`) searches and sorts
    them, keeping its sort orders and recent results. Shared by the workbench's sessions.

    Parameters
    ----------
    path
        A checkpoint file or directory (anything :func:`ckptlab.open` reads).
    inspection_cache
        The on-disk cache of indexes; None opens the checkpoint without one.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 inspection_cache: InspectionCache | None = None) -> None:
        from ckptlab.checkpoint.query import TensorCatalog
        from ckptlab.widgets._table_rows import tensor_frame

        self.path = os.fspath(path)
        start = time.perf_counter()
        self.checkpoint: Any
        if inspection_cache is not None:
            self.index, self.checkpoint = inspection_cache.index_of(self.path)
            self.from_cache = self.checkpoint is None
        else:
            from ckptlab.checkpoint.open import open_checkpoint

            self.checkpoint = open_checkpoint(self.path)
            self.index = CheckpointIndex.from_checkpoint(self.checkpoint)
            self.from_cache = False
        self.frame: pd.DataFrame = tensor_frame(self.index)
        self.catalog: TensorCatalog = TensorCatalog.of(self.index)
        self.index_s = time.perf_counter() - start
        self._columns: list[np.ndarray] | None = None
        self._summary: str | None = None

    def __len__(self) -> int:
        return len(self.frame)

    @property
    def columns(self) -> tuple[str, ...]:
        """The table's columns, in order (those of the workbench's table)."""
        return tuple(self.frame.columns)

    def summary(self) -> str:
        """One line: format, files, bytes on disk, tensors, parameters, bytes by dtype."""
        if self._summary is None:
            idx = self.index
            nfiles = len(idx.files)
            by_dtype = list(idx.totals_by_dtype().items())
            dtypes = ", ".join(f"{dtype} {human_nbytes(nb)}" for dtype, (_, _, nb)
                               in by_dtype[:8]) + (", …" if len(by_dtype) > 8 else "")
            self._summary = (f"{idx.format} · {nfiles:,} file{'s' * (nfiles != 1)} · "
                             f"{human_nbytes(idx.file_nbytes)} on disk · {plural(len(idx), 'tensor')} · "
                             f"{idx.total_parameters:,} parameters"
                             + (f" · tensor bytes by dtype: {dtypes}" if dtypes else ""))
        return self._summary

    def _query(self, pattern: str, sort: str, desc: bool, offset: int = 0,
               limit: int | None = None) -> TensorQuery:
        from ckptlab.checkpoint.query import TensorQuery
        from ckptlab.widgets._table_rows import column_sort_key

        if not sort:
            return TensorQuery(pattern, "order", False, offset, limit)
        return TensorQuery(pattern, column_sort_key(sort), bool(desc), offset, limit)

    def found(self, pattern: str = "", sort: str = "", desc: bool = False) -> np.ndarray:
        """Positions of the rows whose name matches ``pattern`` (a case-insensitive name part,
        or a glob with ``*``, ``?`` or ``[``), in checkpoint order or sorted by column
        ``sort`` (ascending, or descending if ``desc``): the one tensor query's."""
        return self.catalog.select(self._query(pattern, sort, desc)).rows

    def page(self, pattern: str = "", *, sort: str = "", desc: bool = False, offset: int = 0,
             limit: int = PAGE_ROWS) -> dict[str, Any]:
        """One page of the table, JSON-ready: ``total`` rows, ``matched`` by ``pattern``, the
        ``rows`` from ``offset`` (at most ``limit``, cut to :data:`MAX_ROWS`), each a list of
        the ``columns``' values."""
        if type(offset) is not int or offset < 0:
            raise InvalidArgumentError(f"offset: expected an integer >= 0, got {offset!r}")
        if type(limit) is not int or limit < 1:
            raise InvalidArgumentError(f"limit: expected an integer >= 1, got {limit!r}")
        limit = min(limit, MAX_ROWS)
        found = self.catalog.select(self._query(pattern, sort, desc, offset, limit))
        chosen = found.rows
        if self._columns is None:
            self._columns = [self.frame[c].to_numpy() for c in self.columns]
        values = [column[chosen].tolist() for column in self._columns]
        return {"total": len(self.frame), "matched": found.matched, "offset": offset,
                "limit": limit, "columns": list(self.columns),
                "rows": [list(row) for row in zip(*values)]}


class Pending:
    """Something a server shows, made on a thread (``ckptlab-index``) so that the port opens
    first: ``done`` is set when it is there, or ``error`` (and ``exception``) say why it is
    not. Subclasses make it in :meth:`make` (which returns nothing; it stores what it made);
    :meth:`finished` runs on the thread once ``done`` is set.

    Parameters
    ----------
    path
        A checkpoint file or directory.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.name = display_name(self.path)
        self.error: str | None = None
        self.exception: BaseException | None = None  # what ``error`` says
        self.done = threading.Event()
        self.started = time.perf_counter()
        try:
            self.nbytes = checkpoint_nbytes(self.path)
        except OSError:
            self.nbytes = 0

    def start(self) -> None:
        """Start making it, on its thread."""
        threading.Thread(target=self._run, name="ckptlab-index", daemon=True).start()

    def _run(self) -> None:
        try:
            self.make()
        except Exception as exc:  # any failure (a bug too): the pages show it
            self.error = f"{type(exc).__name__}: {exc}"
            self.exception = exc
        finally:
            self.done.set()
            self.finished()

    def make(self) -> None:
        raise NotImplementedError

    def finished(self) -> None:
        """Called on the thread once ``done`` is set (nothing here)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for ``done``; True if it is set."""
        return self.done.wait(timeout)


class PendingRows(Pending):
    """:class:`CheckpointRows` being made on a thread (a :class:`Pending`): ``rows``.

    Parameters
    ----------
    path
        A checkpoint file or directory.
    inspection_cache
        As for :class:`CheckpointRows`.
    on_done
        Called (on the thread) once ``done`` is set.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 inspection_cache: InspectionCache | None = None,
                 on_done: Callable[[], None] | None = None) -> None:
        super().__init__(path)
        self.rows: CheckpointRows | None = None
        self._inspection_cache = inspection_cache
        self._on_done = on_done
        self.start()

    def make(self) -> None:
        rows = CheckpointRows(self.path, inspection_cache=self._inspection_cache)
        rows.summary()  # and the first page's columns: here, not on the IOLoop
        rows.page(limit=1)
        self.rows = rows

    def finished(self) -> None:
        if self._on_done is not None:
            self._on_done()


class QuickServer(httputil.HTTPServerConnectionDelegate):
    """What the public port answers: the quick page, then the workbench.

    A :class:`tornado.httputil.HTTPServerConnectionDelegate` (give it to a
    :class:`tornado.httpserver.HTTPServer`, or call :meth:`listen`): each request goes to the
    quick page's application (``app``) until :meth:`switch` is given the workbench's tornado
    application, then to the workbench, but for the quick routes (:data:`QUICK_PREFIX`).
    Make it on the thread of the IOLoop that serves it: its methods run there, but
    :meth:`start_workbench`'s thread.

    Parameters
    ----------
    path
        A checkpoint file or directory; its index is made at once, on a thread.
    inspection_cache
        The on-disk index cache (:class:`~ckptlab.checkpoint._cache.InspectionCache`).
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 inspection_cache: InspectionCache | None = None) -> None:
        self._loop = IOLoop.current()
        # what ``state?wait=`` waits for (set on the IOLoop: tornado's Event is not threadsafe)
        self.changed = {"index": locks.Event(), "workbench": locks.Event()}
        self.first_rows = threading.Event()  # the quick page has had its first rows
        self.pending = PendingRows(path, inspection_cache=inspection_cache,
                                   on_done=self._changed("index"))
        self.inspection_cache = inspection_cache
        self.workbench: httputil.HTTPServerConnectionDelegate | None = None
        self.workbench_error: str | None = None
        self.server: Any = None  # the workbench's bokeh server, once made
        routes: list[Any] = [(r"/", _PageHandler, {"quick": self}),
                             (QUICK_PREFIX + "state", _StateHandler, {"quick": self}),
                             (QUICK_PREFIX + "rows", _RowsHandler, {"quick": self})]
        self.app = web.Application(routes, log_function=lambda handler: None)

    # -- routing -----------------------------------------------------------------------------
    def start_request(self, server_conn: object,
                      request_conn: httputil.HTTPConnection) -> httputil.HTTPMessageDelegate:
        """A request has started: route it once its first line has come."""
        return _Routed(self, server_conn, request_conn)

    def target(self, path: str) -> httputil.HTTPServerConnectionDelegate:
        """The application a request for ``path`` goes to."""
        if self.workbench is None or path.startswith(QUICK_PREFIX):
            return self.app
        return self.workbench

    def switch(self, workbench: httputil.HTTPServerConnectionDelegate) -> None:
        """Send every request but the quick routes to ``workbench`` from now on."""
        self.workbench = workbench
        self.changed["workbench"].set()

    def _changed(self, what: str) -> Callable[[], None]:
        """A function any thread may call to wake the pages waiting for ``what``."""
        return lambda: self._loop.add_callback(self.changed[what].set)

    def listen(self, sockets: Sequence[Any]) -> HTTPServer:
        """Serve on ``sockets`` (bound by :func:`tornado.netutil.bind_sockets`)."""
        server = HTTPServer(self)
        server.add_sockets(sockets)
        return server

    # -- the workbench -------------------------------------------------------------------------
    def start_workbench(self, *, port: int, address: str) -> None:
        """Make the workbench on a thread once the index is there (and the quick page has
        had its first rows, or ``FIRST_ROWS_WAIT_S`` later), then switch to it on the IOLoop;
        its websocket accepts pages of ``address:port``."""
        threading.Thread(target=self._make_workbench, args=(port, address),
                         name="ckptlab-workbench", daemon=True).start()

    def _make_workbench(self, port: int, address: str) -> None:
        self.pending.wait()  # the table first: the index and panel's import both hold the GIL
        rows = self.pending.rows
        if rows is None:  # the page shows why
            return
        rows.catalog.prepare()  # what a search reads, before panel's import takes the GIL
        self.first_rows.wait(FIRST_ROWS_WAIT_S)
        try:
            from ckptlab.widgets import app  # panel, bokeh: about 1.5 s

            served = app.ServedCheckpoint(rows.path, rows=rows,
                                          inspection_cache=self.inspection_cache)
            served.schedule_load()  # (a small one: opened, and plotly's widget imported)
        except Exception as exc:  # any failure (a bug too): the page says so, the table stays
            self.workbench_error = f"{type(exc).__name__}: {exc}"
            self._changed("workbench")()
            return
        self._loop.add_callback(self._switch_to_workbench, app.workbench_server, served, port,
                                address)

    def _switch_to_workbench(self, build: Callable[..., Any], served: Any, port: int,
                             address: str) -> None:
        try:
            self.server = build(served, port=port, address=address)
            workbench = _compat.bokeh_tornado_app(self.server)  # a tornado Application
        except Exception as exc:
            self.workbench_error = f"{type(exc).__name__}: {exc}"
            self.changed["workbench"].set()
            return
        self.switch(workbench)

    # -- what the page reads -----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-ready: the index's state (``reading``, ``ready``, ``failed``) and the
        workbench's (``workbench``: ready; ``workbench_error``)."""
        pending = self.pending
        rows = pending.rows
        index = ("ready" if rows is not None else "failed" if pending.done.is_set()
                 else "reading")
        return {"name": pending.name, "index": index, "nbytes": pending.nbytes,
                "elapsed_s": round(time.perf_counter() - pending.started, 1),
                "error": pending.error, "summary": rows.summary() if rows is not None else None,
                "total": len(rows) if rows is not None else None,
                "workbench": self.workbench is not None,
                "workbench_error": self.workbench_error}


class _Routed(httputil.HTTPMessageDelegate):
    """One request, handed to the application :meth:`QuickServer.target` picks for its path
    (known once the request line has come)."""

    def __init__(self, front: QuickServer, server_conn: object,
                 request_conn: httputil.HTTPConnection) -> None:
        self._front = front
        self._server_conn = server_conn
        self._request_conn = request_conn
        self._delegate: httputil.HTTPMessageDelegate | None = None

    def headers_received(self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
                         headers: httputil.HTTPHeaders) -> Any:
        path = getattr(start_line, "path", "/")
        target = self._front.target(path)
        self._delegate = target.start_request(self._server_conn, self._request_conn)
        return self._delegate.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Any:
        assert self._delegate is not None
        return self._delegate.data_received(chunk)

    def finish(self) -> None:
        assert self._delegate is not None
        self._delegate.finish()

    def on_connection_close(self) -> None:
        if self._delegate is not None:
            self._delegate.on_connection_close()


def _json_text(obj: Any) -> str:
    """JSON safe anywhere in a page: ASCII only, no ``<`` (a name can hold ``</script>``)."""
    return json.dumps(obj, ensure_ascii=True).replace("<", "\\u003c").replace(">", "\\u003e")


class _QuickHandler(web.RequestHandler):
    quick: QuickServer

    def initialize(self, quick: QuickServer) -> None:
        self.quick = quick

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")  # `/` becomes the workbench
        self.set_header("X-Content-Type-Options", "nosniff")

    def send_json(self, obj: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(_json_text(obj))


class _StateHandler(_QuickHandler):
    """``GET /ckptlab/quick/state[?wait=index|workbench]``: with ``wait``, the answer comes
    when that is ready (or failed), or after ``LONG_POLL_S``: a page learns at once."""

    async def get(self) -> None:
        event = self.quick.changed.get(self.get_argument("wait", ""))
        if event is not None and not event.is_set():
            try:
                await event.wait(timeout=datetime.timedelta(seconds=LONG_POLL_S))
            except TimeoutError:
                pass
        self.send_json(self.quick.state())


def _int_argument(handler: web.RequestHandler, name: str, default: int, lowest: int) -> int:
    text = handler.get_argument(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < lowest:
        raise InvalidArgumentError(f"{name}: expected an integer >= {lowest}, got {text[:40]!r}")
    return value


class _RowsHandler(_QuickHandler):
    """``GET /ckptlab/quick/rows?q=&sort=&desc=&offset=&limit=``: one page of the table."""

    def get(self) -> None:
        pending = self.quick.pending
        rows = pending.rows
        if rows is None:
            what = (f"{pending.name} could not be read: {pending.error}" if pending.done.is_set()
                    else f"the tensors of {pending.name} are being read: ask again")
            self.send_json({"error": what}, status=503)
            return
        try:
            pattern = self.get_argument("q", "")
            if len(pattern) > MAX_PATTERN:
                raise InvalidArgumentError(f"q: expected at most {MAX_PATTERN:,} characters, "
                                           f"got {len(pattern):,}")
            desc = self.get_argument("desc", "0").strip().lower()
            if desc not in ("", "0", "1", "false", "true"):
                raise InvalidArgumentError(f"desc: expected 0 or 1, got {desc[:40]!r}")
            page = rows.page(pattern, sort=self.get_argument("sort", "").strip(),
                             desc=desc in ("1", "true"),
                             offset=_int_argument(self, "offset", 0, 0),
                             limit=_int_argument(self, "limit", PAGE_ROWS, 1))
        except InvalidArgumentError as exc:
            self.send_json({"error": str(exc)}, status=400)
            return
        self.send_json(page)
        self.quick.first_rows.set()


class _PageHandler(_QuickHandler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(page_html(self.quick.pending.name))


def page_html(name: str) -> str:
    """The quick page for checkpoint ``name``: self-contained HTML (inline CSS and JS)."""
    title = html.escape(f"ckptlab · {name}")
    from ckptlab.widgets._table_rows import SORT_KEY_OF_COLUMN

    script = (_PAGE_JS.replace("__NUMERIC__", _json_text(list(NUMERIC)))
              .replace("__SORTABLE__", _json_text(list(SORT_KEY_OF_COLUMN)))
              .replace("__LIMIT__", str(PAGE_ROWS)))
    return (_PAGE_HTML.replace("__TITLE__", title).replace("__CSS__", _PAGE_CSS)
            .replace("__JS__", script))


_PAGE_CSS = """
body{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
  font-size:14px;margin:8px 16px;color:#222}
.ckptlab-title h2{margin:4px 0}
.ckptlab-quick-summary{margin:4px 0 8px}
.ckptlab-index-error{color:#a00}
.ckptlab-quick-search{width:100%;box-sizing:border-box;padding:6px 8px;font-size:14px;
  border:1px solid #bbb;border-radius:4px}
.ckptlab-quick-bar{display:flex;gap:12px;align-items:center;margin:6px 0}
.ckptlab-quick-note{color:#666;font-style:italic}
.ckptlab-quick-table{border-collapse:collapse;width:100%;table-layout:fixed}
.ckptlab-quick-table th,.ckptlab-quick-table td{padding:3px 8px;text-align:left;
  white-space:nowrap;overflow:hidden;text-overflow:ellipsis;border-bottom:1px solid #eee}
.ckptlab-quick-table th{cursor:pointer;user-select:none;background:#f4f4f4;
  border-bottom:1px solid #ccc}
.ckptlab-quick-table th:not([title]){cursor:default}
.ckptlab-quick-table .num{text-align:right;font-variant-numeric:tabular-nums}
"""

_PAGE_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>__TITLE__</title>
<style>__CSS__</style></head>
<body class="ckptlab-quick">
<div class="ckptlab-title"><h2>__TITLE__</h2></div>
<div id="ckptlab-status"></div>
<div id="ckptlab-summary" class="ckptlab-quick-summary"></div>
<div id="ckptlab-table" hidden>
<input id="ckptlab-search" class="ckptlab-quick-search" type="search" autocomplete="off"
 placeholder="find a tensor by name: a part of it, or a glob such as *.mlp.*">
<div class="ckptlab-quick-bar"><span id="ckptlab-count" class="ckptlab-quick-count"></span>
<button id="ckptlab-prev" type="button">&lsaquo; previous</button>
<span id="ckptlab-range"></span>
<button id="ckptlab-next" type="button">next &rsaquo;</button>
<span id="ckptlab-note" class="ckptlab-quick-note"></span></div>
<table class="ckptlab-quick-table"><colgroup id="ckptlab-cols"></colgroup>
<thead><tr id="ckptlab-head"></tr></thead><tbody id="ckptlab-rows"></tbody></table>
</div>
<script>__JS__</script>
</body></html>
"""

# every text from the server goes in with textContent: nothing it sends is markup
_PAGE_JS = r"""
(() => {
  const NUMERIC = new Set(__NUMERIC__), SORTABLE = new Set(__SORTABLE__), LIMIT = __LIMIT__
  const WIDTHS = {dtype: 110, shape: 110, kind: 90, bytes: 100, parameters: 135, file: 120,
                  offset: 120}
  const $ = id => document.getElementById('ckptlab-' + id)
  const fmt = n => Number(n).toLocaleString('en-US')
  const el = (tag, cls, text) => {
    const e = document.createElement(tag)
    if (cls) e.className = cls
    if (text !== undefined) e.textContent = text
    return e
  }
  const S = {q: new URLSearchParams(location.search).get('q') || '', sort: '', desc: false,
             offset: 0, seq: 0, shown: false, waiting: 'index'}
  $('search').value = S.q
  const heads = {}
  function header(columns) {  // from the first page of rows: the workbench's columns
    for (const c of columns) {
      const col = el('col')
      if (WIDTHS[c]) col.style.width = WIDTHS[c] + 'px'
      $('cols').appendChild(col)
      const th = el('th', NUMERIC.has(c) ? 'num' : '', c)
      th.dataset.col = c
      if (SORTABLE.has(c)) {
        th.title = 'sort by ' + c
        th.addEventListener('click', () => {
          S.desc = S.sort === c ? !S.desc : false
          S.sort = c
          S.offset = 0
          load()
        })
      }
      heads[c] = th
      $('head').appendChild(th)
    }
  }
  async function getJSON(url) {
    const r = await fetch(url, {cache: 'no-store'})
    return {ok: r.ok, body: await r.json()}
  }
  async function load() {
    const seq = ++S.seq
    const args = new URLSearchParams({q: S.q, sort: S.sort, desc: S.desc ? '1' : '0',
                                      offset: String(S.offset), limit: String(LIMIT)})
    let got
    try { got = await getJSON('/ckptlab/quick/rows?' + args) } catch (e) { return }
    if (seq !== S.seq) return  // a newer search or page was asked for
    if (!got.ok) { $('note').textContent = got.body.error || 'the rows could not be read'; return }
    draw(got.body)
  }
  function draw(page) {
    if (!Object.keys(heads).length) header(page.columns)
    const frag = document.createDocumentFragment()
    for (const row of page.rows) {
      const tr = el('tr', 'ckptlab-quick-row')
      row.forEach((v, i) => {
        const numeric = NUMERIC.has(page.columns[i])
        const td = el('td', numeric ? 'num' : '', numeric ? fmt(v) : String(v))
        td.dataset.col = page.columns[i]
        td.title = td.textContent
        tr.appendChild(td)
      })
      frag.appendChild(tr)
    }
    $('rows').replaceChildren(frag)
    const tensors = `tensor${page.total === 1 ? '' : 's'}`
    $('count').textContent = page.matched === page.total ? `${fmt(page.total)} ${tensors}`
      : `${fmt(page.matched)} of ${fmt(page.total)} ${tensors}`
    const end = page.offset + page.rows.length
    $('range').textContent = page.rows.length ? `rows ${fmt(page.offset + 1)}–${fmt(end)}` : ''
    $('prev').disabled = page.offset <= 0
    $('next').disabled = end >= page.matched
    for (const c of page.columns)
      heads[c].textContent = c + (S.sort === c ? (S.desc ? ' ▼' : ' ▲') : '')
  }
  let typing = null
  $('search').addEventListener('input', () => {
    clearTimeout(typing)
    typing = setTimeout(() => { S.q = $('search').value; S.offset = 0; load() }, 30)
  })
  $('prev').addEventListener('click', () => { S.offset = Math.max(S.offset - LIMIT, 0); load() })
  $('next').addEventListener('click', () => { S.offset += LIMIT; load() })
  function status(cls, bold, text) {
    const box = el('div', cls)
    if (bold) box.appendChild(el(cls === 'ckptlab-index-error' ? 'b' : 'i', '', bold))
    if (text) box.appendChild(document.createTextNode(' ' + text))
    $('status').replaceChildren(box)
  }
  function toWorkbench() {  // `/` is the workbench now; the search goes along
    const url = new URL(location.href)
    const q = $('search').value.trim()
    if (q) url.searchParams.set('q', q)
    else url.searchParams.delete('q')
    location.replace(url.href)
  }
  async function poll() {
    let st
    try { st = (await getJSON('/ckptlab/quick/state?wait=' + S.waiting)).body } catch (e) {
      setTimeout(poll, 1000)
      return
    }
    if (st.index === 'reading') {
      const size = st.nbytes ? ` (${(st.nbytes / 2 ** 20).toFixed(1)} MiB)` : ''
      status('ckptlab-progress-text',
             `Reading the tensors of ${st.name}${size}: ${Math.round(st.elapsed_s)} s…`,
             'The table appears here when the index is read; a checkpoint seen before opens ' +
             'at once (its index is cached on disk).')
    } else if (st.index === 'failed') {
      status('ckptlab-index-error', `${st.name} could not be read:`, st.error)
      return
    } else {
      if (!S.shown) {
        S.shown = true
        $('status').replaceChildren()
        $('summary').textContent = st.summary
        $('table').hidden = false
        load()
      }
      if (st.workbench) { toWorkbench(); return }
      if (st.workbench_error) {
        $('note').textContent = 'The workbench could not start: ' + st.workbench_error
        return
      }
      $('note').textContent = 'opening the workbench (details, byte map)…'
      S.waiting = 'workbench'
    }
    setTimeout(poll, 20)  // the server holds each answer until a change, or a second
  }
  poll()
})()
"""


def serve(path: str | os.PathLike[str], *, port: int = 5006, address: str = "127.0.0.1",
          show: bool = False, inspection_cache: InspectionCache | None = None) -> None:
    """Serve checkpoint ``path`` on ``http://address:port/`` until interrupted: the quick
    page at once, then the workbench (:mod:`ckptlab.widgets.app`) on the same port.

    Parameters
    ----------
    path
        A checkpoint file or directory of any format :func:`ckptlab.open` reads.
    port, address
        Where to listen (``127.0.0.1``: this machine only; port 0: one the system picks).
    show
        Open a browser tab.
    inspection_cache
        The on-disk index cache (by default one in ``$CKPTLAB_CACHE_DIR`` or
        ``~/.cache/ckptlab``): a checkpoint seen before shows its table without being opened.

    Raises
    ------
    OSError
        The port cannot be bound (in use, or an address of another machine).
    ArchiveError
        The checkpoint cannot be read, found within ``FAIL_FAST_S`` (the port is closed
        again); found later, the page says so instead.
    """
    from tornado.netutil import bind_sockets

    try:  # before anything slow: the port is open now
        sockets = bind_sockets(port, address)
    except OSError as exc:  # taken since the CLI looked, or not this machine's address
        raise OSError(exc.errno, f"cannot listen on {address}:{port}: "
                      f"{exc.strerror or exc}") from None
    port = sockets[0].getsockname()[1]
    _compat.skip_slow_optional_imports()  # this process serves pages: 2 s less before them
    loop = IOLoop.current()
    quick = QuickServer(path, inspection_cache=inspection_cache if inspection_cache is not None
                        else InspectionCache())
    pending = quick.pending
    if pending.wait(FAIL_FAST_S) and pending.exception is not None:
        for sock in sockets:  # nobody was answered: the command fails instead
            sock.close()
        raise pending.exception
    quick.listen(sockets)
    url = f"http://{address}:{port}/"
    print(f"ckptlab: serving {quick.pending.name} at {url}", flush=True)
    quick.start_workbench(port=port, address=address)
    if show:
        import webbrowser

        loop.add_callback(webbrowser.open, url)
    loop.start()
