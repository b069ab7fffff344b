"""The quick first page of ``ckptlab serve`` (:mod:`ckptlab.widgets.quick`): its rows endpoint
(filter, sort, paging, bounds, escaping), its progress state on a cold cache, and the switch
of the public port to the panel workbench. (The page itself, in chromium:
tests/browser/test_quick_page.py.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tornado import web
from tornado.ioloop import IOLoop
from tornado.netutil import bind_sockets

from ckptlab.checkpoint._cache import InspectionCache
from ckptlab.checkpoint.query import natural_key
from ckptlab.errors import InvalidArgumentError
from ckptlab.widgets import quick
from ckptlab.widgets.quick import MAX_ROWS, CheckpointRows, QuickServer, page_html

TENSORS = 600
WAIT_S = 120  # a busy machine's worst case for anything below, never a timing assertion


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory: pytest.TempPathFactory, hostile_name: str) -> Path:
    """``TENSORS`` tensors ``layers.I.wJ`` of 1 to 7 float32 values, then ``hostile_name``."""
    import torch

    sd = {f"layers.{i // 5}.w{i % 5}": torch.zeros(i % 7 + 1) for i in range(TENSORS)}
    sd[hostile_name] = torch.zeros(3, 2)
    path = tmp_path_factory.mktemp("quick") / "rows.pt"
    torch.save(sd, path)
    return path


@pytest.fixture(scope="module")
def rows(rows_file: Path) -> CheckpointRows:
    return CheckpointRows(rows_file)


def _names(page: dict[str, Any]) -> list[str]:
    return [row[page["columns"].index("name")] for row in page["rows"]]


# -- the rows, without a server ----------------------------------------------------------------
def test_rows_are_the_workbench_tables(rows: CheckpointRows, hostile_name: str) -> None:
    from ckptlab.widgets._tensor_table import COLUMNS

    page = rows.page(limit=MAX_ROWS)
    assert page["total"] == page["matched"] == TENSORS + 1 == len(rows)
    assert page["columns"] == list(COLUMNS)
    frame = rows.frame
    assert page["rows"][:3] == frame.iloc[:3].astype(object).values.tolist()
    name, dtype, shape, kind, nbytes, params, file, offset = page["rows"][1]
    assert (name, dtype, shape, kind, nbytes, params, file) == (
        "layers.0.w1", "float32", "[2]", "dense", 8, 2, "rows.pt")
    assert type(offset) is int and offset > 0
    last = rows.page(offset=TENSORS)["rows"]
    assert _names({"columns": page["columns"], "rows": last}) == [hostile_name]
    assert "tensors" in rows.summary() and f"{TENSORS + 1:,} tensors" in rows.summary()


def test_rows_filter_by_name_part_or_glob(rows: CheckpointRows) -> None:
    page = rows.page("W3")  # case-insensitive
    assert page["matched"] == TENSORS // 5 and all(".w3" in n for n in _names(page))
    page = rows.page("layers.1?.w0")
    assert _names(page) == [f"layers.{i}.w0" for i in range(10, 20)]
    assert rows.page("no such tensor")["matched"] == 0
    assert rows.page("no such tensor")["rows"] == []


def test_rows_sort_by_any_column_both_ways(rows: CheckpointRows) -> None:
    page = rows.page(sort="bytes", desc=True, limit=MAX_ROWS)
    sizes = [row[4] for row in page["rows"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 28
    # ties keep the checkpoint's order, both ways
    top = _names(page)[:3]
    assert top == ["layers.1.w1", "layers.2.w3", "layers.4.w0"]
    assert _names(rows.page(sort="bytes"))[:3] == ["layers.0.w0", "layers.1.w2", "layers.2.w4"]
    names = _names(rows.page("w2", sort="name", desc=True, limit=MAX_ROWS))
    assert names == sorted(names, key=natural_key, reverse=True)  # layers.119 before .99
    assert names[0] == "layers.119.w2" and len(names) == TENSORS // 5
    with pytest.raises(InvalidArgumentError, match="sort: expected one of the columns"):
        rows.page(sort="size")


def test_rows_page_and_cap_the_limit(rows: CheckpointRows) -> None:
    first = rows.page("w4", limit=50)
    second = rows.page("w4", offset=50, limit=50)
    assert len(first["rows"]) == len(second["rows"]) == 50
    assert set(_names(first)).isdisjoint(_names(second))
    assert rows.page(limit=10**9)["limit"] == MAX_ROWS
    assert len(rows.page(limit=10**9)["rows"]) == MAX_ROWS
    assert rows.page(offset=10**9)["rows"] == []
    for bad in ({"offset": -1}, {"limit": 0}, {"limit": "5"}):
        with pytest.raises(InvalidArgumentError, match="expected an integer"):
            rows.page(**bad)


def test_the_page_escapes_the_name_and_loads_nothing_from_elsewhere() -> None:
    text = page_html('<img src=x onerror=alert(1)>.pt')
    assert "<img" not in text and "&lt;img src=x onerror=alert(1)&gt;.pt" in text
    assert "<title>ckptlab · &lt;img" in text and 'class="ckptlab-title"' in text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)
    assert "innerHTML" not in text  # every text goes in with textContent


def test_the_quick_page_imports_no_ui_library(sample_file: Path) -> None:
    """What serves the quick page (the CLI, the module, the rows, the page) imports neither
    panel nor bokeh, plotly, ipywidgets: they are what the workbench waits for."""
    code = (
        "import sys\n"
        "import ckptlab.cli\n"
        "from ckptlab.widgets.quick import CheckpointRows, QuickServer, page_html\n"
        f"rows = CheckpointRows({str(sample_file)!r})\n"
        "assert rows.page('', sort='bytes')['rows'] and rows.summary()\n"
        "assert page_html('x.pt')\n"
        "ui = ('panel', 'bokeh', 'plotly', 'ipywidgets', 'IPython', 'anywidget')\n"
        "print([m for m in ui if m in sys.modules])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- a real server on an ephemeral port ------------------------------------------------------
@contextlib.contextmanager
def _running(path: Path, cache_dir: Path) -> Iterator[dict[str, Any]]:
    """A QuickServer for ``path`` on its own IOLoop thread (no workbench is started)."""
    box: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        loop = IOLoop.current()
        sockets = bind_sockets(0, "127.0.0.1")
        front = QuickServer(path, inspection_cache=InspectionCache(cache_dir))
        server = front.listen(sockets)
        box.update(loop=loop, quick=front,
                   url=f"http://127.0.0.1:{sockets[0].getsockname()[1]}")
        started.set()
        loop.start()
        server.stop()
        loop.close(all_fds=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(WAIT_S)
    try:
        yield box
    finally:
        box["loop"].add_callback(box["loop"].stop)
        thread.join(WAIT_S)


def _get(url: str) -> tuple[int, bytes, Any]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT_S) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def _json(url: str) -> tuple[int, Any]:
    status, body, headers = _get(url)
    assert headers["Content-Type"].startswith("application/json")
    return status, json.loads(body)


def _rows_url(base: str, **args: Any) -> str:
    return f"{base}/ckptlab/quick/rows?{urllib.parse.urlencode(args)}"


def _wait_for(what: str, check: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"waited {WAIT_S} s for {what}")


def test_the_rows_endpoint(rows_file: Path, tmp_path: Path, hostile_name: str) -> None:
    with _running(rows_file, tmp_path / "cache") as srv:
        base = srv["url"]
        _wait_for("the index", lambda: _json(base + "/ckptlab/quick/state")[1]["index"] == "ready")
        status, page = _json(_rows_url(base, q="w3", sort="name", desc=1, offset=10, limit=5))
        assert status == 200 and page["matched"] == TENSORS // 5 and len(page["rows"]) == 5
        assert _names(page) == sorted(_names(page), reverse=True)
        # a name that is markup comes back as data: no "<" in the answer at all
        status, raw, headers = _get(_rows_url(base, q="<script>"))
        assert status == 200 and b"<" not in raw and b">" not in raw
        assert headers["Cache-Control"] == "no-store"
        assert _names(json.loads(raw)) == [hostile_name]
        status, page = _json(_rows_url(base, limit=100_000))
        assert status == 200 and len(page["rows"]) == MAX_ROWS
        for args, words in (({"limit": "x"}, "limit: expected an integer >= 1, got 'x'"),
                            ({"offset": -5}, "offset: expected an integer >= 0"),
                            ({"sort": "size"}, "sort: expected one of the columns"),
                            ({"desc": "maybe"}, "desc: expected 0 or 1"),
                            ({"q": "x" * 5000}, "q: expected at most 1,000 characters")):
            status, body = _json(_rows_url(base, **args))
            assert status == 400 and words in body["error"], (args, body)
        status, body, headers = _get(base + "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b"ckptlab \xc2\xb7 rows.pt" in body and b"ckptlab-quick" in body
        assert _get(base + "/static/js/bokeh.min.js")[0] == 404  # no workbench here


def test_a_cold_cache_shows_progress_then_rows(monkeypatch, rows_file: Path,
                                               tmp_path: Path) -> None:
    gate = threading.Event()
    made = quick.CheckpointRows.__init__

    def gated(self, *args, **kwargs):
        assert gate.wait(WAIT_S)
        made(self, *args, **kwargs)

    monkeypatch.setattr(quick.CheckpointRows, "__init__", gated)
    with _running(rows_file, tmp_path / "cache") as srv:
        base = srv["url"]
        status, state = _json(base + "/ckptlab/quick/state")
        assert status == 200 and state["index"] == "reading" and state["name"] == "rows.pt"
        assert state["nbytes"] == rows_file.stat().st_size and state["summary"] is None
        assert state["workbench"] is False
        status, body = _json(_rows_url(base))
        assert status == 503 and "the tensors of rows.pt are being read" in body["error"]
        gate.set()  # a page's long poll answers once the index is there (or after a second)
        state = _wait_for("the index", lambda: (
            s := _json(base + "/ckptlab/quick/state?wait=index")[1])["index"] == "ready" and s)
        assert state["total"] == TENSORS + 1 and "torch-zip" in state["summary"]
        status, page = _json(_rows_url(base))
        assert status == 200 and page["total"] == TENSORS + 1
        assert not srv["quick"].pending.rows.from_cache
    # the index went to the cache: the next server reads it back
    with _running(rows_file, tmp_path / "cache") as srv:
        _wait_for("the index", lambda: srv["quick"].pending.done.is_set())
        assert srv["quick"].pending.rows.from_cache


def test_an_index_that_fails_is_shown(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04 not a zip at all")
    with _running(bad, tmp_path / "cache") as srv:
        base = srv["url"]
        state = _wait_for("the failure", lambda: (
            s := _json(base + "/ckptlab/quick/state")[1])["index"] == "failed" and s)
        assert state["error"] and state["summary"] is None
        status, body = _json(_rows_url(base))
        assert status == 503 and "bad.pt could not be read" in body["error"]


def test_the_port_switches_to_the_workbench_but_the_quick_routes(rows_file: Path,
                                                                  tmp_path: Path) -> None:
    class Workbench(web.RequestHandler):
        def get(self, rest: str) -> None:
            self.finish(f"workbench /{rest}")

    with _running(rows_file, tmp_path / "cache") as srv:
        base, front = srv["url"], srv["quick"]
        assert b"ckptlab-quick" in _get(base + "/")[1]
        srv["loop"].add_callback(front.switch, web.Application([(r"/(.*)", Workbench)]))
        _wait_for("the switch", lambda: front.workbench is not None)
        assert _get(base + "/")[1] == b"workbench /"
        assert _get(base + "/static/js/x.js?v=1")[1] == b"workbench /static/js/x.js"
        assert _json(base + "/ckptlab/quick/state")[1]["workbench"] is True
        _wait_for("the index", lambda: front.pending.done.is_set())
        assert _json(_rows_url(base, q="w0"))[1]["matched"] == TENSORS // 5


# -- ckptlab serve: the quick page, then panel's workbench on the same port ------------------
def _run_async(coro: Any) -> Any:
    """``asyncio.run(coro)`` on a thread of its own: the suite may have left an event loop
    running on this one (a notebook kernel's, tornado's)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_becomes_the_workbench_on_the_same_port(sample_file: Path, tmp_path: Path) -> None:
    """The real thing: ``ckptlab serve`` answers the quick page, then (readiness flips) ``/``
    is panel's page, its JavaScript and its websocket come through the public port (the
    websocket's origin check accepts pages of that port only), the quick routes stay."""
    from tornado.httpclient import HTTPClientError, HTTPRequest
    from tornado.websocket import websocket_connect

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, CKPTLAB_CACHE_DIR=str(tmp_path / "cache"))
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "ckptlab", "serve", str(sample_file),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        def state() -> dict[str, Any] | None:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return _json(base + "/ckptlab/quick/state")[1]
            except OSError:
                return None

        first = _wait_for("the port", state)
        if not first["workbench"]:  # (a very fast machine may be past the quick page)
            assert b"ckptlab-quick" in _get(base + "/")[1]
        _wait_for("the workbench", lambda: state()["workbench"])
        status, page, _ = _get(base + "/")
        assert status == 200 and b"ckptlab-quick" not in page
        text = page.decode()
        assert "<title>ckptlab</title>" in text and "Bokeh" in text
        scripts = re.findall(r'src="(static/[^"]+\.js[^"]*)"', text)
        assert scripts and all(_get(f"{base}/{src}")[0] == 200 for src in scripts[:3])
        assert _json(_rows_url(base, q="data"))[0] == 200
        token = re.search(r'"token":\s*"([^"]+)"', text).group(1)

        async def connect(origin: str) -> str:
            request = HTTPRequest(f"ws://127.0.0.1:{port}/ws", headers={"Origin": origin})
            ws = await websocket_connect(request, subprotocols=["bokeh", token])
            message = await asyncio.wait_for(ws.read_message(), WAIT_S)
            ws.close()
            return message

        assert "ACK" in _run_async(connect(f"http://127.0.0.1:{port}"))  # bokeh's hello
        with pytest.raises(HTTPClientError, match="403"):
            _run_async(connect(f"http://127.0.0.1:{_free_port()}"))
        assert proc.poll() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def test_serve_of_a_checkpoint_that_cannot_be_read_is_a_one_line_error(sample_file: Path,
                                                                        tmp_path: Path) -> None:
    """A damaged checkpoint found while the port is being opened: the command fails with one
    line and exit status 2 (as before the quick page), and the port is free again."""
    bad = tmp_path / "bad.pt"
    data = bytearray(sample_file.read_bytes())
    at = data.find(b"data.pkl") + 60  # inside the pickle, past its local header
    data[at:at + 40] = b"\xff" * 40
    bad.write_bytes(bytes(data))
    port = _free_port()
    done = subprocess.run([sys.executable, "-m", "ckptlab", "serve", str(bad), "--port",
                           str(port)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, CKPTLAB_CACHE_DIR=str(tmp_path / "cache")))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptlab: error: ") and "bad.pt" in lines[0]
    assert "Traceback" not in done.stderr + done.stdout
    with socket.socket() as s:  # closed again
        s.bind(("127.0.0.1", port))
