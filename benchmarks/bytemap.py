"""Benchmark: the byte map at 1k, 10k and 100k records — build, JSON, zoom, browser draw.

Run from the repository root::

    .venv/bin/python benchmarks/bytemap.py [--records 1000 10000 100000] [--repeat 5]
                                           [--browser] [--json out.json]

For each record count it writes a real torch.save checkpoint of that many small float32
tensors (16..1024 elements, seeded) into ``bench-out/bytemap/`` (kept between runs), inspects
it once, then measures:

- ``ByteMap.from_layout`` and ``bytemap_figure`` build time (median of ``--repeat``), and the
  figure's JSON size;
- zoom re-binning: ``bytemap_trace`` for 20 random windows (median and max);
- the map from a freshly opened ``Checkpoint`` (``ByteMap.from_checkpoint``: a torch.save
  file's map from its layout's columns) against the map from its entries
  (``ByteMap.from_file(entry, ck.tensors.values())``, which makes every TensorEntry), each on
  a checkpoint opened for it (median of ``--repeat``);
- the obvious alternative, one plotly bar per segment (``go.Bar`` with ``base``), built in the
  same run: build time and JSON size (the ratio is printed);
- with ``--browser``: draw time in Debian chromium (headless, Playwright) of the served app
  (``ckptlab serve FILE``, time from navigation to the heatmap in the DOM, second load, so the
  server has the layout) and of a static page of the figure; and of the per-segment bar figure
  at 1k and 10k records (it does not finish in reasonable time beyond).

Targets (issue 3): 100k-record figure built in < 1 s, drawn in the browser in < 3 s, zoom
re-binning < 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import plotly.graph_objects as go
import torch

import ckptlab
from ckptlab.viz import ByteMap, bytemap_figure, bytemap_trace
from ckptlab.viz._style import KIND_COLORS

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench-out" / "bytemap"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def checkpoint(n: int) -> Path:
    """A torch.save file of ``n`` small tensors (written once, kept in bench-out/)."""
    path = OUT / f"records-{n}.pt"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(n)
        sizes = rng.integers(16, 1025, size=n)
        state = {f"layers.{i}.weight": torch.zeros(int(s)) for i, s in enumerate(sizes)}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    return path


def timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def per_segment_bars(layout: ckptlab.format.ArchiveLayout) -> go.Figure:
    """The obvious alternative: one horizontal bar per segment, coloured by kind."""
    segs = layout.segments
    return go.Figure(go.Bar(
        y=[s.kind.value for s in segs], x=[s.nbytes for s in segs],
        base=[s.offset for s in segs], orientation="h",
        marker={"color": [KIND_COLORS[s.kind] for s in segs]},
        customdata=[[s.offset, s.nbytes] for s in segs]))


def browser_draw(html_path: Path | None = None, url: str | None = None,
                 timeout_s: float = 120.0) -> float:
    """Seconds from navigation to a plotly heatmap or bar drawn in the page."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        target = url or html_path.as_uri()  # type: ignore[union-attr]
        t = time.perf_counter()
        page.goto(target, timeout=timeout_s * 1000)
        page.wait_for_selector(".js-plotly-plot .hm image, .js-plotly-plot .hm, "
                               ".js-plotly-plot .bars .point", state="attached",
                               timeout=timeout_s * 1000)
        page.wait_for_function("() => new Promise(r => requestAnimationFrame(() => r(true)))")
        elapsed = time.perf_counter() - t
        browser.close()
    return elapsed


def served_draw(path: Path, port: int) -> tuple[float, float]:
    """(first, second) draw of `ckptlab serve path` in the browser."""
    proc = subprocess.Popen([sys.executable, "-m", "ckptlab", "serve", str(path), "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd=REPO)
    try:
        import socket

        deadline = time.time() + 180
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/"
        return browser_draw(url=url), browser_draw(url=url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


# the first map in a fresh interpreter: ckptlab.viz's import (plotly's) and the first build,
# after an untimed inspect (what a new notebook kernel or `ckptlab report` pays)
NEW_PROCESS = """
import json, sys, time
import ckptlab
layout = ckptlab.inspect(sys.argv[1])
t = time.perf_counter()
from ckptlab.viz import ByteMap, bytemap_figure
bytemap_figure(ByteMap.from_layout(layout))
print(json.dumps({"new_process_s": time.perf_counter() - t}))
"""


def new_process_build(path: Path, repeat: int) -> float:
    """Median seconds of :data:`NEW_PROCESS` over ``repeat`` fresh interpreters."""
    from _child import run_child

    return statistics.median(run_child(NEW_PROCESS, path)["new_process_s"]
                             for _ in range(max(1, min(repeat, 3))))


def checkpoint_maps(path: Path, repeat: int) -> tuple[float, float]:
    """Median seconds of ``ByteMap.from_checkpoint`` and of ``ByteMap.from_file`` with the
    checkpoint's entries, each on a checkpoint just opened (its entries not yet made)."""
    ours, entries = [], []
    for _ in range(repeat):
        ck = ckptlab.open(path)
        t = time.perf_counter()
        ByteMap.from_checkpoint(ck)
        ours.append(time.perf_counter() - t)
        ck = ckptlab.open(path)
        t = time.perf_counter()
        ByteMap.from_file(ck.files[0], ck.tensors.values())
        entries.append(time.perf_counter() - t)
    return statistics.median(ours), statistics.median(entries)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--browser", action="store_true", help="also time drawing in chromium")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(f"python {platform.python_version()} · torch {torch.__version__} · ckptlab "
          f"{ckptlab.__version__} · {os.cpu_count()} cpus · load {os.getloadavg()[0]:.2f}")
    rows = []
    for n in args.records:
        path = checkpoint(n)
        t = time.perf_counter()
        layout = ckptlab.inspect(path)
        t_inspect = time.perf_counter() - t
        t_map, bm = timed(lambda: ByteMap.from_layout(layout), args.repeat)  # noqa: B023
        t_fig, fig = timed(lambda: bytemap_figure(bm), args.repeat)  # noqa: B023
        t_json, js = timed(lambda: fig.to_json(), args.repeat)  # noqa: B023
        rng = np.random.default_rng(0)
        zooms = []
        for _ in range(20):
            lo, hi = sorted(rng.integers(0, layout.file_nbytes, size=2))
            t = time.perf_counter()
            bytemap_trace(bm, x_range=(float(lo), float(hi + 1)))
            zooms.append(time.perf_counter() - t)
        t_ck, t_entries = checkpoint_maps(path, args.repeat)
        t_bars, bars = timed(lambda: per_segment_bars(layout), 1)  # noqa: B023
        bars_json = bars.to_json()
        row: dict[str, Any] = {
            "records": len(layout.records), "segments": len(layout.segments),
            "file_nbytes": layout.file_nbytes, "inspect_s": t_inspect,
            "bytemap_arrays_s": t_map, "figure_s": t_fig, "build_s": t_map + t_fig,
            "to_json_s": t_json, "json_nbytes": len(js), "mode": fig.layout.meta["mode"],
            "zoom_median_s": statistics.median(zooms), "zoom_max_s": max(zooms),
            "from_checkpoint_s": t_ck, "from_entries_s": t_entries,
            "bars_build_s": t_bars, "bars_json_nbytes": len(bars_json),
            "new_process_s": new_process_build(path, args.repeat),
        }
        if args.browser:
            html = OUT / f"bytemap-{n}.html"
            fig.write_html(html, include_plotlyjs=True)
            row["browser_static_s"] = browser_draw(html)
            first, second = served_draw(path, 5300 + n % 1000)
            row["browser_served_first_s"], row["browser_served_s"] = first, second
            if n <= 10000:
                bars_html = OUT / f"bars-{n}.html"
                bars.write_html(bars_html, include_plotlyjs=True)
                row["bars_browser_s"] = browser_draw(bars_html, timeout_s=300)
        rows.append(row)
        print(json.dumps(row))
    print()
    head = (f"{'records':>8} {'segments':>9} {'build s':>8} {'json MB':>8} {'zoom med/max s':>15} "
            f"{'bars build s':>12} {'bars MB':>8} {'new process s':>13} "
            f"{'from ck / entries s':>19}"
            + (f" {'static draw s':>13} {'served draw s':>13} {'bars draw s':>11}"
               if args.browser else ""))
    print(head)
    for r in rows:
        line = (f"{r['records']:>8} {r['segments']:>9} {r['build_s']:>8.3f} "
                f"{r['json_nbytes'] / 1e6:>8.2f} "
                f"{r['zoom_median_s']:>7.3f}/{r['zoom_max_s']:<7.3f} {r['bars_build_s']:>12.3f} "
                f"{r['bars_json_nbytes'] / 1e6:>8.2f} {r['new_process_s']:>13.3f} "
                f"{r['from_checkpoint_s']:>9.3f}/{r['from_entries_s']:<9.3f}")
        if args.browser:
            bars_draw = f"{r['bars_browser_s']:>11.2f}" if "bars_browser_s" in r else f"{'-':>11}"
            line += (f" {r['browser_static_s']:>13.2f} {r['browser_served_s']:>13.2f} "
                     f"{bars_draw}")
        print(line)
    big = max(rows, key=lambda r: r["records"])
    print(f"\ntargets at {big['records']} records: build {big['build_s']:.3f} s (< 1 s: "
          f"{'met' if big['build_s'] < 1 else 'MISSED'}), zoom max {big['zoom_max_s']:.3f} s "
          f"(< 0.5 s: {'met' if big['zoom_max_s'] < 0.5 else 'MISSED'}), new process "
          f"{big['new_process_s']:.3f} s (< 1 s: {'met' if big['new_process_s'] < 1 else 'MISSED'})"
          + (f", served draw {big['browser_served_s']:.2f} s (< 3 s: "
             f"{'met' if big['browser_served_s'] < 3 else 'MISSED'})" if args.browser else ""))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
