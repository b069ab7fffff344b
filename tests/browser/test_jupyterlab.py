"""JupyterLab in headless chromium, offline: open a notebook, run all cells, check what renders.

One isolated JupyterLab serves a temp copy of notebooks/ for the whole module: its own
config, data, runtime and IPython dirs, a random token, 127.0.0.1 only, and
`expose_app_in_browser` so the test drives it through `window.jupyterapp`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from browser_support import REPO, ServedProcess, free_port, serve_process

pytestmark = [pytest.mark.browser, pytest.mark.slow]

START_TIMEOUT_S = 90  # JupyterLab up and answering its REST API
PAGE_TIMEOUT_MS = 60_000  # lab loaded in the browser, notebook open, kernel connected
RUN_TIMEOUT_MS = 120_000  # all cells executed (nbmake gets the same 120 s)
RENDER_TIMEOUT_MS = 30_000  # after execution: the widget view and its figure drawn
EXPLORER = ".ckptlab-layout-explorer"
WIDGET_NOTEBOOK = "browser_widget_smoke.ipynb"


@dataclass
class Lab:
    server: ServedProcess
    token: str
    root: Path

    @property
    def url(self) -> str:
        return self.server.url

    def api(self, path: str, method: str = "GET"):
        """Call the server's REST API (JSON answer, or None for an empty one)."""
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None


def _write_widget_notebook(path: Path) -> None:
    """The JS widget stack the LayoutExplorer stands on: an ipywidgets box with the explorer's
    CSS class holding a plotly FigureWidget (an anywidget), plus the kernel's own prefix."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import sys\n"
            "import ipywidgets as widgets\n"
            "import plotly.graph_objects as go\n"
            "\n"
            "fig = go.FigureWidget(go.Bar(x=['header', 'padding', 'data'], y=[30, 34, 4096]))\n"
            "box = widgets.VBox([widgets.HTML('<b>widget stack smoke test</b>'), fig])\n"
            f"box.add_class({EXPLORER[1:]!r})\n"
            "box"
        ),
        nbformat.v4.new_code_cell("print('KERNEL_PREFIX=' + sys.prefix)"),
    ]
    nbformat.write(nb, path)


def _write_user_settings(config_dir: Path) -> None:
    """Never ask about (or fetch) the Jupyter news feed: no toast over the notebook."""
    settings = config_dir / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("jupyterlab")
    root = tmp / "notebooks"
    shutil.copytree(REPO / "notebooks", root,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    _write_widget_notebook(root / WIDGET_NOTEBOOK)
    jupyter = {name: tmp / name for name in ("config", "data", "runtime", "ipython")}
    _write_user_settings(jupyter["config"])
    env = dict(os.environ)
    for var in ("JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "JUPYTER_PLATFORM_DIRS",
                "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR"):
        env.pop(var, None)
    # User-level dirs are fresh and empty, so kernel `python3` comes from this interpreter's
    # prefix (the venv's ipykernel spec, whose argv "python" jupyter_client runs as
    # sys.executable) and no user config or extension leaks in.
    env.update(JUPYTER_CONFIG_DIR=str(jupyter["config"]), JUPYTER_DATA_DIR=str(jupyter["data"]),
               JUPYTER_RUNTIME_DIR=str(jupyter["runtime"]), IPYTHONDIR=str(jupyter["ipython"]))
    token = secrets.token_hex(24)
    port = free_port()
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.geteuid() == 0:  # CI containers run as root; jupyter refuses that without the flag
        cmd.append("--allow-root")
    with serve_process(cmd, port, env=env, cwd=root, timeout=START_TIMEOUT_S) as server:
        lab = Lab(server=server, token=token, root=root)
        specs = lab.api("kernelspecs")
        assert specs["default"] == "python3" and "python3" in specs["kernelspecs"], specs
        yield lab


@pytest.fixture(autouse=True)
def _shut_down_sessions(lab: Lab):
    """Each test's kernels stop when it ends, so the next test has the CPU to itself."""
    yield
    for session in lab.api("sessions"):
        lab.api(f"sessions/{session['id']}", method="DELETE")


OPEN_NOTEBOOK_JS = """async ([path, ms]) => {
  const timeout = new Promise((_, reject) => setTimeout(
    () => reject(new Error(`notebook ${path} not open with a kernel after ${ms} ms`)), ms));
  const open = (async () => {
    const app = window.jupyterapp;
    await app.restored;
    const panel = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
    await panel.context.ready;
    await panel.sessionContext.ready;
    app.shell.activateById(panel.id);
    window.__ckptlab = {panel, run: {done: false}};
    return panel.sessionContext.session.kernel.name;
  })();
  return await Promise.race([open, timeout]);
}"""

RUN_ALL_JS = """() => {
  const app = window.jupyterapp;
  const state = window.__ckptlab;
  app.shell.activateById(state.panel.id);
  app.commands.execute('notebook:run-all-cells').then(
    ok => { state.run = {done: true, ok}; },
    err => { state.run = {done: true, ok: false, error: String(err)}; });
}"""

CELLS_JS = """() => window.__ckptlab.panel.content.widgets.map((cell, index) => ({
  index,
  type: cell.model.type,
  count: cell.model.type === 'code' ? cell.model.executionCount : null,
  errors: cell.model.type === 'code'
    ? cell.model.outputs.toJSON().filter(o => o.output_type === 'error')
        .map(o => `${o.ename}: ${o.evalue}`)
    : [],
  text: cell.model.type === 'code'
    ? cell.model.outputs.toJSON().map(o => o.text || '').join('') : '',
}))"""

# The figure inside the explorer is drawn: plotly has laid out at least one visible trace
# and put it in the SVG (or a WebGL canvas).
FIGURE_DRAWN_JS = """(selector) => {
  const gd = document.querySelector(selector);
  if (!gd || !gd._fullData) return false;
  const traces = gd._fullData.filter(t => t.visible !== false).length;
  const drawn = gd.querySelectorAll('.main-svg .trace, .main-svg .hm, .gl-container canvas').length;
  const box = gd.getBoundingClientRect();
  return traces > 0 && drawn > 0 && box.width > 0 && box.height > 0
    ? {traces, drawn, width: box.width, height: box.height} : false;
}"""


def _run_notebook(page, lab: Lab, name: str) -> list[dict]:
    """Open `name` in JupyterLab, run all cells and wait for the kernel to finish them.
    Returns the cells (index, type, execution count, error outputs, stream text)."""
    page.goto(f"{lab.url}/lab?reset&token={lab.token}", wait_until="domcontentloaded",
              timeout=PAGE_TIMEOUT_MS)
    page.wait_for_function("() => window.jupyterapp !== undefined", timeout=PAGE_TIMEOUT_MS)
    kernel = page.evaluate(OPEN_NOTEBOOK_JS, [name, PAGE_TIMEOUT_MS])
    assert kernel == "python3", f"{name} opened with kernel {kernel!r}, not python3"
    page.evaluate(RUN_ALL_JS)
    try:
        page.wait_for_function("() => window.__ckptlab.run.done", timeout=RUN_TIMEOUT_MS)
    except Exception as exc:
        pending = [c["index"] for c in page.evaluate(CELLS_JS) if c["type"] == "code"
                   and c["count"] is None]
        raise AssertionError(f"{name}: run-all not finished after {RUN_TIMEOUT_MS // 1000} s; "
                             f"cells without an execution count: {pending}\n"
                             f"server output ends:\n{lab.server.output(3000)}") from exc
    cells = page.evaluate(CELLS_JS)
    errors = {c["index"]: c["errors"] for c in cells if c["errors"]}
    assert not errors, f"{name}: cells raised {errors}"
    not_run = [c["index"] for c in cells if c["type"] == "code" and c["count"] is None]
    assert not not_run, f"{name}: cells not executed: {not_run}"
    run = page.evaluate("() => window.__ckptlab.run")
    assert run.get("ok") is True, f"{name}: run-all reported {run}"
    return cells


STDERR_OUTPUT = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'


def _assert_no_error_outputs(page, name: str) -> None:
    """No traceback, no widget that failed to display, and no stderr output at all (a warning
    box in a workbench notebook is a defect too)."""
    tracebacks = page.locator(STDERR_OUTPUT, has_text="Traceback")
    assert tracebacks.count() == 0, f"{name}: kernel errors shown: {tracebacks.all_inner_texts()}"
    widget_errors = page.locator(".jupyter-widgets-error-widget, .jp-OutputArea-output",
                                 has_text="Error displaying widget")
    assert widget_errors.count() == 0, f"{name}: {widget_errors.all_inner_texts()}"
    stderr = page.locator(STDERR_OUTPUT)
    assert stderr.count() == 0, f"{name}: stderr shown: {stderr.all_inner_texts()}"


def _wait_for_explorer_figure(page) -> dict:
    """Wait until the explorer's figure is drawn and scrolled into view; return its stats."""
    figure = f"{EXPLORER} .js-plotly-plot"
    page.wait_for_selector(figure, state="attached", timeout=RENDER_TIMEOUT_MS)
    page.locator(figure).first.scroll_into_view_if_needed()
    handle = page.wait_for_function(FIGURE_DRAWN_JS, arg=figure, timeout=RENDER_TIMEOUT_MS)
    return handle.json_value()


def test_jupyterlab_renders_plotly_figurewidget(lab: Lab, page, page_log, screenshot):
    """ipywidgets + anywidget + plotly FigureWidget render in JupyterLab with no network."""
    cells = _run_notebook(page, lab, WIDGET_NOTEBOOK)
    figure = _wait_for_explorer_figure(page)
    screenshot("explorer", full_page=False)  # JupyterLab scrolls inside a fixed viewport
    assert figure["traces"] == 1, figure
    assert page.locator(f"{EXPLORER} .js-plotly-plot .trace.bars .point").count() == 3
    kernel_prefix = "".join(c["text"] for c in cells).partition("KERNEL_PREFIX=")[2].strip()
    assert Path(kernel_prefix).resolve() == Path(sys.prefix).resolve(), (
        f"kernel python3 runs in {kernel_prefix!r}, not this interpreter's {sys.prefix!r}")
    _assert_no_error_outputs(page, WIDGET_NOTEBOOK)
    page_log.assert_offline()
    page_log.assert_no_errors()


def test_start_here_shows_layout_explorer(lab: Lab, page, page_log, screenshot):
    """notebooks/00_start_here.ipynb runs clean in the browser and draws its LayoutExplorer."""
    name = "00_start_here.ipynb"
    _run_notebook(page, lab, name)
    figure = _wait_for_explorer_figure(page)
    screenshot("explorer", full_page=False)
    assert figure["traces"] >= 1, figure
    _assert_no_error_outputs(page, name)
    page_log.assert_offline()
    page_log.assert_no_errors()
