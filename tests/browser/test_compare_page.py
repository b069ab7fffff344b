"""``ckptlab serve A --compare B`` in chromium, on a fine-tuning pair written by the libraries
(a safetensors base, a torch.save of the tuned weights): the page paints the module bars and
the table offline; typing in the search box lists a module's tensors; picking one draws its
histograms (A, B and B - A); clicking a module's bar narrows the picker to that module.
Screenshots go to ``.artifacts/browser/``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from browser_support import free_port, serve_process

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


def _pair(root: Path) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(3)
    base = {f"model.layers.{i}.{part}.weight": torch.randn(32, 32)
            for i in range(3) for part in ("attn", "mlp")}
    base["model.norm.weight"] = torch.ones(32)
    tuned = {k: v + (0.05 * torch.randn_like(v) if ".1." in k else 0) for k, v in base.items()}
    save_file(base, str(root / "base.safetensors"))
    torch.save(tuned, root / "tuned.pt")
    return root / "base.safetensors", root / "tuned.pt"


PLOTS = ".ckptlab-compare .js-plotly-plot"
OPTIONS = ".ckptlab-compare select option"


def _until(check, what: str, timeout: float = 60.0) -> None:
    """Poll ``check()`` (Playwright locators pierce panel's shadow roots; a page-side
    ``querySelectorAll`` would not) until it is true."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.2)


def test_the_compare_page(page, page_log, screenshot, tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "ckptlab", "serve", str(a), "--compare", str(b),
           "--port", str(port)]
    with serve_process(cmd, port, env=dict(os.environ), timeout=120):
        page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
        page.wait_for_selector(f"{PLOTS} .bars", timeout=60_000)
        assert page.get_by_text("2 changed", exact=False).count() >= 1
        table = page.locator("table.ckptlab-table").first.inner_text()
        assert table.count("changed") == 2 and "model.layers.1.mlp.weight" in table
        meta = page.locator(PLOTS).first.evaluate("p => p.layout.meta")
        assert meta["kind"] == "diff" and meta["changed"] == [0, 0, 1, 1, 0, 0, 0]
        screenshot("compare-page")
        search = page.locator(".ckptlab-compare input[type=text]").first
        search.fill("layers.1.")
        search.press("Enter")
        options = page.locator(OPTIONS)
        _until(lambda: sorted(options.all_inner_texts()) == [
            "model.layers.1.attn.weight", "model.layers.1.mlp.weight"], "layers.1. listed")
        traces = page.locator(PLOTS)
        _until(lambda: ["A", "B", "B - A"] in traces.evaluate_all(
            "ps => ps.map(p => (p.data || []).map(t => t.name))"), "the histograms drawn")
        screenshot("compare-page-histograms")
        # a click on a module's bar lists that module's tensors
        traces.first.evaluate(
            "p => { const i = p.data[0].y.indexOf('model.layers.2.attn');"
            " p.emit('plotly_click', {points: [{pointIndex: i, pointNumber: i,"
            " curveNumber: 0}]}) }")
        _until(lambda: options.all_inner_texts() == ["model.layers.2.attn.weight"],
               "the module's tensors listed")
    assert not page_log.blocked_urls, page_log.blocked_urls
    assert not page_log.page_errors, page_log.page_errors
