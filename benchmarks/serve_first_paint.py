"""First paint of ``ckptlab serve`` on a 100,000-tensor torch.save file, cold and warm cache.

For each run: Debian chromium (headless, driven by Playwright, as tests/browser/ does) is
already started; the clock starts when ``python -m ckptlab serve FILE --port N`` is started as
a subprocess; the page is requested as soon as the port accepts connections; *first content*
is when the page's title is visible; *first paint (quick table)* when the quick page's first
row is (``ckptlab.widgets.quick``: served before panel is imported); *workbench paint* when
the panel workbench's tensor table (its Tabulator) shows its first row, after the quick page
reloaded itself into the workbench. Also reported: when the port opened, when the byte map
was drawn (it comes after the table: the full open runs on a thread), and the workbench
table's filter round trip in the browser (type a name part in the search box until the first
row shows a match; server-side filtering, one page of rows sent), measured twice: from
Playwright (its own polling included) and inside the page (input event to the first animation
frame whose rows all match); and the same in-page filter on the quick page, once, while it
is still there (none if the page became the workbench first).

Runs: *cold* (an empty ``CKPTLAB_CACHE_DIR``: the file is opened before serving and its index
stored) then *warm* (the same cache directory: the index is read back). Needs chromium
(``/usr/bin/chromium`` or ``$CKPTLAB_CHROMIUM``) and playwright (the dev extra); never runs
``playwright install``.

    .venv/bin/python benchmarks/serve_first_paint.py [--tensors 100000] [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "browser"))

from browser_support import CHROMIUM_ARGS, chromium_executable, is_external_url  # noqa: E402

TABLE_ROW = ".ckptlab-tensors .tabulator-row"
QUICK_ROW = ".ckptlab-quick-row"
TITLE = ".ckptlab-title h2"
MAP = ".ckptlab-bytemap .js-plotly-plot .hm"
SEARCH = ".ckptlab-search input"
# types ``pattern`` into the search box (one input event, as a keystroke or a paste sends) and
# resolves with the milliseconds until a frame shows rows that all contain it
IN_PAGE_FILTER = """([field, grid, pattern]) => new Promise(resolve => {
  const t0 = performance.now()
  field.value = pattern
  field.dispatchEvent(new Event('input', {bubbles: true}))
  const check = () => {
    const cells = grid.querySelectorAll('.tabulator-row .tabulator-cell[tabulator-field="name"]')
    if (cells.length && Array.from(cells).every(c => c.textContent.includes(pattern))) {
      resolve(performance.now() - t0)
      return
    }
    requestAnimationFrame(check)
  }
  requestAnimationFrame(check)
})"""


# the quick page's filter, timed inside it: from the input event to the first frame whose rows
# all match; the search box is emptied again then (its text would go to the workbench)
QUICK_FILTER = """(pattern) => new Promise(resolve => {
  const field = document.getElementById('ckptlab-search')
  if (!field) { resolve(null); return }
  const t0 = performance.now()
  field.value = pattern
  field.dispatchEvent(new Event('input', {bubbles: true}))
  const check = () => {
    const cells = document.querySelectorAll('.ckptlab-quick-row td[data-col="name"]')
    if (cells.length && Array.from(cells).every(c => c.textContent.includes(pattern))) {
      field.value = ''
      field.dispatchEvent(new Event('input', {bubbles: true}))
      resolve(performance.now() - t0)
      return
    }
    if (performance.now() - t0 > 3000) { resolve(null); return }
    requestAnimationFrame(check)
  }
  requestAnimationFrame(check)
})"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def write_file(path: Path, tensors: int) -> None:
    """``tensors`` small float32 tensors named like a model's (``model.layers.N.wK``)."""
    import torch

    sd = {f"model.layers.{i // 10}.w{i % 10}": torch.full((2,), float(i))
          for i in range(tensors)}
    torch.save(sd, path)


def one_run(browser, path: Path, cache_dir: Path, tensors: int, filters: list[str],
            timeout_s: float = 240.0) -> dict:
    port = _free_port()
    env = dict(os.environ, CKPTLAB_CACHE_DIR=str(cache_dir))
    log = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ckptlab", "serve", str(path), "--port",
                             str(port)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    out: dict = {}
    import psutil

    def cpu_s() -> float:  # the server's own CPU seconds: what a busy machine does not inflate
        try:
            t = psutil.Process(proc.pid).cpu_times()
        except psutil.Error:
            return float("nan")
        return t.user + t.system

    try:
        deadline = start + timeout_s
        while not _port_open(port):
            if proc.poll() is not None or time.perf_counter() > deadline:
                log.seek(0)
                raise RuntimeError(f"the server did not start: {log.read()[-2000:]!r}")
            time.sleep(0.02)
        out["port_open_s"] = time.perf_counter() - start
        out["server_cpu_at_port_s"] = cpu_s()
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.route(is_external_url, lambda route: route.abort("blockedbyclient"))
        page = context.new_page()
        page.set_default_timeout(timeout_s * 1000)
        page.goto(f"http://127.0.0.1:{port}/")
        page.locator(TITLE).first.wait_for(state="visible")
        out["first_content_s"] = time.perf_counter() - start
        page.locator(f"{QUICK_ROW}, {TABLE_ROW}").first.wait_for(state="visible")
        out["first_paint_s"] = time.perf_counter() - start  # the quick table, as a rule
        out["server_cpu_at_paint_s"] = cpu_s()
        out["first_paint_was_quick"] = page.locator(QUICK_ROW).count() > 0
        try:  # while the quick page is still there
            ms = page.evaluate(QUICK_FILTER, filters[0])
        except Exception:  # it became the workbench meanwhile
            ms = None
        out["quick_filter_in_page_ms"] = round(ms, 1) if ms is not None else None
        page.locator(TABLE_ROW).first.wait_for(state="visible")
        out["workbench_paint_s"] = time.perf_counter() - start
        out["server_cpu_at_workbench_s"] = cpu_s()
        count = page.locator(".ckptlab-count-text").first.text_content()
        out["count_text"] = count
        page.locator(MAP).first.wait_for(state="attached")
        out["byte_map_s"] = time.perf_counter() - start
        times = []
        search = page.locator(SEARCH).first
        names = page.locator(f'{TABLE_ROW} .tabulator-cell[tabulator-field="name"]')
        all_names = [f"model.layers.{i // 10}.w{i % 10}" for i in range(tensors)]
        for pattern in filters:
            expected = sum(pattern.lower() in name.lower() for name in all_names)
            count = page.locator(".ckptlab-count-text",
                                 has_text=f"{expected:,} of {tensors:,} tensors").first
            t = time.perf_counter()
            search.fill(pattern)
            count.wait_for(timeout=30_000)  # the server's answer has arrived
            until = time.perf_counter() + 30
            while True:  # and the page of rows shown is the filtered one
                shown = names.all_text_contents()
                if (shown and all(pattern in name for name in shown)) or (
                        expected == 0 and not shown):
                    break
                if time.perf_counter() > until:
                    raise RuntimeError(f"the rows shown for {pattern!r} never matched: "
                                       f"{shown[:3]}")
                time.sleep(0.005)
            times.append(time.perf_counter() - t)
        out["rows_after_filter"] = names.count()
        out["filter_ms"] = [round(1000 * x, 1) for x in times]
        out["filter_median_ms"] = round(1000 * statistics.median(times), 1)
        # the same filters timed inside the page (no Playwright round trips): from the input
        # event to the first animation frame whose rows all match
        field = search.element_handle()
        grid = page.locator(".ckptlab-tensors .tabulator").first.element_handle()
        # rotated: each pattern differs from the one before (whose rows it does not match)
        in_page = [page.evaluate(IN_PAGE_FILTER, [field, grid, p])
                   for p in filters[1:] + filters[:1]]
        out["filter_in_page_ms"] = [round(x, 1) for x in in_page]
        out["filter_in_page_median_ms"] = round(statistics.median(in_page), 1)
        context.close()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=1, help="cold+warm pairs")
    parser.add_argument("--file", type=Path, help="reuse this file (written if missing)")
    args = parser.parse_args()
    executable = chromium_executable()
    if executable is None:
        print("chromium not found (/usr/bin/chromium or $CKPTLAB_CHROMIUM)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="ckptlab-paint-"))
    path = args.file or work / "big.pt"
    try:
        if not path.exists():
            t = time.perf_counter()
            write_file(path, args.tensors)
            print(f"wrote {path} ({path.stat().st_size:,} B, {args.tensors:,} tensors) in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
        n = args.tensors
        # each matches some rows at any size (layers.4242. at 100,000 tensors)
        filters = [f"layers.{n // 10 - 1}.w3", f"layers.{max(n // 10 * 4242 // 10_000, 1)}.",
                   "w7", f"layers.{n // 20}."]
        results = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=executable, headless=True,
                                         args=list(CHROMIUM_ARGS))
            for run in range(args.runs):
                cache_dir = work / f"cache-{run}"
                for label in ("cold", "warm"):
                    r = one_run(browser, path, cache_dir, n, filters)
                    r.update(run=run, cache=label, tensors=n)
                    results.append(r)
                    print(json.dumps(r), flush=True)
            browser.close()
        print(f"\n{n:,} tensors, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}")
        for r in results:
            quick = r["quick_filter_in_page_ms"]
            print(f"  {r['cache']:>4}: port open {r['port_open_s']:.2f} s, first content "
                  f"{r['first_content_s']:.2f} s, first paint (quick table) "
                  f"{r['first_paint_s']:.2f} s, workbench paint {r['workbench_paint_s']:.2f} s, "
                  f"byte map {r['byte_map_s']:.2f} s; filter on the workbench: median "
                  f"{r['filter_median_ms']:.0f} ms ({r['filter_ms']}), in the page "
                  f"{r['filter_in_page_median_ms']:.0f} ms ({r['filter_in_page_ms']}); on the "
                  f"quick page, in the page: {'-' if quick is None else f'{quick:.0f} ms'}; "
                  f"server CPU {r['server_cpu_at_port_s']:.2f} s at port open, "
                  f"{r['server_cpu_at_paint_s']:.2f} s at first paint, "
                  f"{r['server_cpu_at_workbench_s']:.2f} s at workbench paint")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
