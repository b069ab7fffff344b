"""The served app under load: 20 sessions on a 5,000-tensor torch.save file, 127.0.0.1 only.

`ckptlab serve` runs as a subprocess on a free port. Twenty sessions open at once: by default
one is a real page in Debian chromium and nineteen are protocol sessions, which do on the
wire what a browser page does, without running the page's JavaScript: GET / (panel builds
the session's document and puts its token in the page), a websocket to /ws with that token,
PULL-DOC (the whole document), PATCH-DOC of the PlotlyLoader's ``rendered`` and ``loaded`` (a
page comes without plotly.js; its loader says so once it ran it, and the session then adds the
byte map section), then PATCH-DOC moving the alignment slider one step (the
event noUiSlider makes BokehJS send) and the server's PATCH-DOCs back until the byte map's
new title and bins have arrived. Twenty chromium pages on 2 cores are not a server test:
each page costs about 3 s of CPU in chromium itself (plotly.js and BokehJS start-up), so the
browsers, not the server, set the time. ``CKPTLAB_LOAD_PAGES=N`` makes N of the 20 sessions
real pages (0 needs no chromium; 20 is the all-browser run in benchmarks/README.md).

Measured per session: page load (GET until the document is in; for a real page until the
byte map is drawn) and redraw (slider moved until the new map is in; for a real page until
its title shows). Measured on the server: RSS before, at the peak and after the sessions
closed and panel ended them, and CPU seconds per phase. Timings are reported (stdout and
<artifacts>/app_load/app_load.json; the targets are 10 s load, 3 s redraw), never asserted:
a load or redraw that has not finished after ``STEP_TIMEOUT_S`` fails as a hang. Memory is
checked against bounds well under what the app used before sessions shared their work (RSS
104 -> 324 -> 282 MiB).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from browser_support import (
    CHROMIUM_ARGS,
    CHROMIUM_MISSING,
    ServedProcess,
    chromium_executable,
    free_port,
    is_external_url,
    serve_process,
    wait_for_workbench,
)

from ckptlab.format.predict import DEFAULT_ALIGNMENTS
from ckptlab.widgets.app import SESSION_CHECK_MS, SESSION_LIFETIME_MS

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

SESSIONS = 20
TENSORS = 5_000
OWN_ALIGNMENT = 64  # torch.save's default, the file's own
NEXT_ALIGNMENT = 128  # one slider step to the right
STEP_TIMEOUT_S = 120.0  # any one load or redraw (20 chromium pages take 50 s): a hang guard
MAP = ".ckptlab-bytemap .js-plotly-plot"


def _real_pages() -> int:
    raw = os.environ.get("CKPTLAB_LOAD_PAGES", "1")
    try:
        pages = int(raw)
    except ValueError:
        pages = -1
    if not 0 <= pages <= SESSIONS:
        pytest.fail(f"CKPTLAB_LOAD_PAGES must be 0..{SESSIONS}, got {raw!r}", pytrace=False)
    return pages


def _chromium_or_skip() -> str:
    """As tests/browser/conftest.py: a missing browser skips, or fails when CI is set."""
    executable = chromium_executable()
    if executable is not None:
        return executable
    override = os.environ.get("CKPTLAB_CHROMIUM")
    reason = (f"CKPTLAB_CHROMIUM={override!r} is not an executable" if override
              else CHROMIUM_MISSING)
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5,000 small float32 tensors written by torch.save (5,000 storage records)."""
    import torch

    path = tmp_path_factory.mktemp("load") / "big.pt"
    torch.save({f"layers.{i}.weight": torch.full((16,), float(i)) for i in range(TENSORS)},
               path)
    return path


@pytest.fixture
def server(big_file: Path) -> Iterator[ServedProcess]:
    port = free_port()
    cmd = [sys.executable, "-m", "ckptlab", "serve", str(big_file), "--port", str(port)]
    with serve_process(cmd, port, timeout=120) as proc:
        wait_for_workbench(proc.url)  # the protocol sessions GET the workbench's page
        yield proc


class _Server:
    """RSS and CPU seconds of the server process."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)

    def rss_mib(self) -> float:
        return self.proc.memory_info().rss / 2**20

    def cpu_s(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def settled_rss(self, *, within_s: float, still_s: float = 2.0) -> float:
        """RSS once it has not changed by 1 MiB for ``still_s`` (or after ``within_s``)."""
        deadline = time.monotonic() + within_s
        last, since = self.rss_mib(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.rss_mib()
            if abs(now - last) >= 1.0:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= still_s:
                break
        return self.rss_mib()


class ProtocolSession:
    """One page's conversation with the server in bokeh's protocol, without a browser.

    A message is three text frames (header, metadata, content) and, for each buffer its
    header names, a text frame and a binary one.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws = None
        self.slider_id: str | None = None
        self.slider_value: int | None = None

    async def _read(self) -> tuple[dict, str]:
        async def frame():
            data = await asyncio.wait_for(self.ws.read_message(), STEP_TIMEOUT_S)
            if data is None:
                raise ConnectionError("the server closed the websocket")
            return data

        header = json.loads(await frame())
        await frame()  # metadata
        content = await frame()
        for _ in range(2 * header.get("num_buffers", 0)):
            await frame()
        return header, content

    async def _send(self, msgtype: str, content: dict) -> None:
        header = {"msgid": uuid.uuid4().hex, "msgtype": msgtype}
        for part in (header, {}, content):
            await self.ws.write_message(json.dumps(part))

    async def load(self, http) -> float:
        """GET the page, connect, pull the document; seconds it took."""
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        start = time.monotonic()
        page = await http.fetch(self.url + "/", request_timeout=STEP_TIMEOUT_S)
        token = re.search(r'"token":\s*"([^"]+)"', page.body.decode()).group(1)
        request = HTTPRequest(self.url.replace("http://", "ws://") + "/ws",
                              headers={"Origin": self.url}, request_timeout=STEP_TIMEOUT_S)
        self.ws = await websocket_connect(request, subprotocols=["bokeh", token],
                                          max_message_size=256 * 2**20)
        header, _ = await self._read()
        assert header["msgtype"] == "ACK", header
        await self._send("PULL-DOC-REQ", {})
        while True:
            header, content = await self._read()
            if header["msgtype"] == "PULL-DOC-REPLY":
                break
        doc = json.loads(content)["doc"]
        assert "big.pt" in content
        # the page comes without plotly.js: a browser's PlotlyLoader says when it has run it,
        # then the session adds the byte map section (its slider and plotly panes)
        # (its data model: bokeh sends only the attributes off their defaults, here ``src``)
        (loader,) = [m for m in _objects(doc["roots"])
                     if str(m.get("attributes", {}).get("src", "")).endswith(".js")]
        await self._send("PATCH-DOC", {"events": [
            {"kind": "MessageSent", "msg_type": "bokeh_event",
             "msg_data": {"type": "event", "name": "document_ready",
                          "values": {"type": "map", "entries": []}}}]})
        await self._send("PATCH-DOC", {"events": [
            {"kind": "ModelChanged", "model": {"id": loader["id"]}, "attr": attr, "new": True}
            for attr in ("rendered", "loaded")]})
        while True:
            header, content = await self._read()
            if header["msgtype"] == "PATCH-DOC" and '"Slider"' in content:
                break
        elapsed = time.monotonic() - start
        (slider,) = _models_named(json.loads(content), "Slider")
        self.slider_id = slider["id"]
        self.slider_value = slider["attributes"]["value"]
        assert "PlotlyPlot" in content
        return elapsed

    async def move_slider(self, index: int, expect: str) -> float:
        """Send the slider's new value; seconds until the new title and bins are in."""
        start = time.monotonic()
        await self._send("PATCH-DOC", {"events": [
            {"kind": "ModelChanged", "model": {"id": self.slider_id}, "attr": attr, "new": index}
            for attr in ("value", "value_throttled")]})
        title = bins = False
        while not (title and bins):
            header, content = await self._read()
            if header["msgtype"] != "PATCH-DOC":
                continue
            title = title or expect in content
            bins = bins or any(event.get("kind") == "ColumnDataChanged"
                               for event in json.loads(content).get("events", []))
        return time.monotonic() - start

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


def _objects(node) -> list[dict]:
    """Every model object in a bokeh document's JSON."""
    found = []
    if isinstance(node, dict):
        if node.get("type") == "object":
            found.append(node)
        for value in node.values():
            found.extend(_objects(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_objects(value))
    return found


def _models_named(node, name: str) -> list[dict]:
    found = []
    if isinstance(node, dict):
        if node.get("type") == "object" and node.get("name") == name:
            found.append(node)
        for value in node.values():
            found.extend(_models_named(value, name))
    elif isinstance(node, list):
        for value in node:
            found.extend(_models_named(value, name))
    return found


class BrowserPage:
    """A real chromium page: load until the byte map is drawn, redraw until the title says so."""

    def __init__(self, context, url: str) -> None:
        self.context = context
        self.url = url
        self.page = None

    async def load(self) -> float:
        self.page = await self.context.new_page()
        start = time.monotonic()
        await self.page.goto(self.url + "/", timeout=STEP_TIMEOUT_S * 1000)
        await self.page.locator(f"{MAP} .hm").first.wait_for(state="attached")
        await self.page.locator(f"{MAP} .gtitle").first.wait_for()
        return time.monotonic() - start

    async def move_slider(self, expect: str) -> float:
        handle = self.page.locator(".ckptlab-alignment .noUi-handle").first
        await handle.focus()
        title = await self.page.locator(f"{MAP} .gtitle").first.element_handle()
        start = time.monotonic()
        await self.page.keyboard.press("ArrowRight")
        await self.page.wait_for_function("([el, text]) => el.textContent.includes(text)",
                                          arg=[title, expect], timeout=STEP_TIMEOUT_S * 1000)
        return time.monotonic() - start

    async def close(self) -> None:
        await self.page.close()


async def _drive(url: str, pages: int, server: _Server, executable: str | None) -> dict:
    """Open the 20 sessions at once, move every slider at once, close them all."""
    from tornado.httpclient import AsyncHTTPClient

    options = sorted(set(DEFAULT_ALIGNMENTS) | {OWN_ALIGNMENT})
    expect = f"at alignment {NEXT_ALIGNMENT}"
    http = AsyncHTTPClient(force_instance=True, max_clients=SESSIONS)
    protocol = [ProtocolSession(url) for _ in range(SESSIONS - pages)]
    figures: dict = {}
    pw = browser = None
    try:
        browsers: list[BrowserPage] = []
        if pages:
            from playwright.async_api import async_playwright

            pw = await async_playwright().start()
            browser = await pw.chromium.launch(executable_path=executable, headless=True,
                                               args=list(CHROMIUM_ARGS), timeout=30_000)
            context = await browser.new_context(viewport={"width": 1280, "height": 900},
                                                service_workers="block")
            context.set_default_timeout(STEP_TIMEOUT_S * 1000)
            await context.route(is_external_url, lambda route: route.abort("blockedbyclient"))
            browsers = [BrowserPage(context, url) for _ in range(pages)]

        cpu = server.cpu_s()
        loads = await asyncio.gather(*(s.load(http) for s in protocol),
                                     *(b.load() for b in browsers))
        figures["server_cpu_load_s"] = server.cpu_s() - cpu
        figures["rss_loaded_mib"] = server.rss_mib()
        assert all(s.slider_value == options.index(OWN_ALIGNMENT) for s in protocol)

        cpu = server.cpu_s()
        index = options.index(NEXT_ALIGNMENT)
        redraws = await asyncio.gather(*(s.move_slider(index, expect) for s in protocol),
                                       *(b.move_slider(expect) for b in browsers))
        figures["server_cpu_redraw_s"] = server.cpu_s() - cpu
        figures["rss_peak_mib"] = server.rss_mib()
        n = len(protocol)  # protocol sessions first, then the pages
        figures["load_s"] = [round(t, 3) for t in loads[:n]]
        figures["redraw_s"] = [round(t, 3) for t in redraws[:n]]
        figures["page_load_s"] = [round(t, 3) for t in loads[n:]]
        figures["page_redraw_s"] = [round(t, 3) for t in redraws[n:]]
        for b in browsers:
            await b.close()
    finally:
        for s in protocol:
            s.close()
        http.close()
        if browser is not None:
            await browser.close()
        if pw is not None:
            await pw.stop()
    return figures


def test_twenty_sessions_share_the_work_and_are_freed(server: ServedProcess,
                                                      artifacts_dir: Path) -> None:
    pages = _real_pages()
    executable = _chromium_or_skip() if pages else None
    watch = _Server(server.proc.pid)
    # panel builds and ends one warm-up session before it serves; wait for its release
    rss_before = watch.settled_rss(within_s=15)

    # on a thread of its own: the session's sync Playwright (other browser tests) keeps an
    # event loop running on this one, where asyncio.run refuses to start another
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        figures = pool.submit(asyncio.run, _drive(server.url, pages, watch, executable)).result()

    # panel ends a session SESSION_LIFETIME_MS after its websocket closed (checked every
    # SESSION_CHECK_MS); the app then frees it and gives the memory back a second later
    time.sleep((SESSION_LIFETIME_MS + SESSION_CHECK_MS) / 1000)
    rss_after = watch.settled_rss(within_s=SESSION_CHECK_MS / 1000 + 10)
    loads = figures["load_s"] + figures["page_load_s"]
    redraws = figures["redraw_s"] + figures["page_redraw_s"]
    figures.update(
        sessions=SESSIONS, real_pages=pages, tensors=TENSORS, cpus=os.cpu_count(),
        load_avg=os.getloadavg(), rss_before_mib=rss_before, rss_after_mib=rss_after,
        load_max_s=max(loads), redraw_max_s=max(redraws))
    out = artifacts_dir / "app_load"
    out.mkdir(parents=True, exist_ok=True)
    (out / "app_load.json").write_text(json.dumps(figures, indent=1))

    def span(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f} s" if values else "-"

    print(f"\n{SESSIONS} sessions on {TENSORS} tensors, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}: {SESSIONS - pages} protocol sessions load "
          f"{span(figures['load_s'])}, redraw {span(figures['redraw_s'])}; {pages} chromium "
          f"page(s) load {span(figures['page_load_s'])}, redraw "
          f"{span(figures['page_redraw_s'])}; server RSS {rss_before:.0f} -> "
          f"{figures['rss_loaded_mib']:.0f} (loaded) -> {figures['rss_peak_mib']:.0f} "
          f"(redrawn) -> {rss_after:.0f} MiB (closed); server CPU "
          f"{figures['server_cpu_load_s']:.1f} s loading, "
          f"{figures['server_cpu_redraw_s']:.1f} s redrawing")

    # every session loaded and redrew (each within STEP_TIMEOUT_S, or it failed as a hang);
    # how long they took is reported above, not asserted
    assert len(loads) == len(redraws) == SESSIONS
    # one what-if layout for all sessions: before they shared it, 20 sessions took 220 MiB
    assert figures["rss_peak_mib"] - rss_before < 150, figures
    # the sessions were freed: before, 180 MiB stayed after every browser had closed
    assert rss_after - rss_before < 100, figures
    assert rss_after < figures["rss_peak_mib"] - 5, figures
