"""``ckptlab serve``'s quick first page in chromium (ckptlab.widgets.quick): the progress line
while the index is made, the table (search, sort, pages, a hostile name shown as text), then
the same page becomes the panel workbench by itself, with its search carried over."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from browser_support import free_port, serve_process

pytestmark = pytest.mark.browser

TENSORS = 3_000
QUICK_ROW = ".ckptlab-quick-row"
NAME_CELLS = f'{QUICK_ROW} td[data-col="name"]'
WORKBENCH_ROW = ".ckptlab-tensors .tabulator-row"

# ``ckptlab serve`` (ckptlab.widgets.quick.serve) with its index held back until the file
# ``gate``.index appears and its workbench until ``gate``.workbench does
GATED_SERVER = """
import os, sys, time
from ckptlab.widgets import quick
path, port, gate = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def gated(method, suffix):
    def wait_then(*args, **kwargs):
        while not os.path.exists(gate + suffix):
            time.sleep(0.05)
        return method(*args, **kwargs)
    return wait_then

quick.CheckpointRows.__init__ = gated(quick.CheckpointRows.__init__, ".index")
quick.QuickServer._make_workbench = gated(quick.QuickServer._make_workbench, ".workbench")
quick.serve(path, port=port)
"""


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory, hostile_name: str) -> Path:
    """``TENSORS`` tensors ``layers.I.wJ`` (1 to 7 float32 values), then ``hostile_name``."""
    import torch

    sd = {f"layers.{i // 10}.w{i % 10}": torch.zeros(i % 7 + 1) for i in range(TENSORS)}
    sd[hostile_name] = torch.zeros(2)
    path = tmp_path_factory.mktemp("quick") / "many.pt"
    torch.save(sd, path)
    return path


def test_the_quick_page_shows_the_table_then_becomes_the_workbench(
        page, page_log, many: Path, tmp_path: Path, hostile_name: str, screenshot) -> None:
    import os

    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    gate = str(tmp_path / "gate")
    port = free_port()
    env = dict(os.environ, CKPTLAB_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-c", GATED_SERVER, str(many), str(port), gate]
    with serve_process(cmd, port, timeout=120, env=env) as proc:
        page.goto(proc.url + "/")
        # the index is being made: the name and a progress line
        assert page.locator(".ckptlab-title h2").first.text_content() == "ckptlab · many.pt"
        progress = page.locator(".ckptlab-progress-text").first
        progress.wait_for()
        assert "Reading the tensors of many.pt" in progress.text_content()
        assert page.locator(QUICK_ROW).count() == 0
        Path(gate + ".index").write_text("go")
        # the table: the first page of rows, the summary, the count
        page.locator(QUICK_ROW).first.wait_for()
        assert page.locator(QUICK_ROW).count() == 100
        assert page.locator(NAME_CELLS).first.text_content() == "layers.0.w0"
        total = f"{TENSORS + 1:,}"
        assert page.locator(".ckptlab-quick-count").text_content() == f"{total} tensors"
        assert f"{total} tensors" in page.locator(".ckptlab-quick-summary").text_content()
        assert page.locator(".ckptlab-progress-text").count() == 0
        screenshot("quick-page")
        # next page, then sort by bytes (largest first on the second click)
        page.locator("#ckptlab-next").click()
        page.locator(NAME_CELLS, has_text="layers.10.w0").first.wait_for()
        assert page.locator("#ckptlab-range").text_content() == "rows 101–200"
        header = page.locator('.ckptlab-quick-table th[data-col="bytes"]')
        header.click()
        page.locator("#ckptlab-range", has_text="rows 1–100").wait_for()
        header.click()
        page.locator('.ckptlab-quick-table th[data-col="bytes"]', has_text="▼").wait_for()
        assert page.locator(f'{QUICK_ROW} td[data-col="bytes"]').first.text_content() == "28"
        # the search filters on the server; a name that is markup shows as text
        search = page.locator("#ckptlab-search")
        search.fill("<script")
        page.locator(".ckptlab-quick-count", has_text=f"1 of {total} tensors").wait_for()
        assert page.locator(NAME_CELLS).all_text_contents() == [hostile_name]
        search.fill("w3")
        page.locator(".ckptlab-quick-count",
                     has_text=f"{TENSORS // 10:,} of {total} tensors").wait_for()
        assert all(".w3" in n for n in page.locator(NAME_CELLS).all_text_contents())
        # the workbench is ready: the page becomes it by itself, the search goes along
        Path(gate + ".workbench").write_text("go")
        page.locator(WORKBENCH_ROW).first.wait_for(timeout=120_000)
        assert page.locator(QUICK_ROW).count() == 0
        assert page.locator(".ckptlab-search input").first.input_value() == "w3"
        page.locator(".ckptlab-count-text",
                     has_text=f"{TENSORS // 10:,} of {total} tensors").first.wait_for()
        assert "tensors" in page.locator(".ckptlab-summary").first.text_content()
        screenshot("quick-page-became-the-workbench")
        # a new page is the workbench at once
        page.goto(proc.url + "/")
        page.locator(WORKBENCH_ROW).first.wait_for()
        assert page.locator(".ckptlab-count-text").first.text_content() == f"{total} tensors"
    assert dialogs == []
    page_log.assert_offline()
    page_log.assert_no_errors()
