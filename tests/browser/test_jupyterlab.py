"""JupyterLab in headless chromium, offline: open a notebook, run all cells, check what renders.

One isolated JupyterLab serves a temp copy of notebooks/ for the whole module: its own
config, data, runtime and IPython dirs, a random token, 127.0.0.1 only, and
`expose_app_in_browser` so the test drives it through `window.jupyterapp`.

The tensor-first tests write four checkpoints of one state dict (torch.save, safetensors,
a Hugging Face sharded directory, a DCP directory) and one notebook that opens a
`LayoutExplorer` on each plus a `PlanExplorer`; it runs once, in one page that those tests
share (its kernel outlives each test). The dark-theme test saves JupyterLab's theme setting
as "JupyterLab Dark" the way JupyterLab does, reloads, and samples the colours drawn.
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
RENDER_TIMEOUT_MS = 60_000  # after execution: the widget view and its figure drawn
EXPLORER = ".ckptlab-layout-explorer"
PLAN_EXPLORER = ".ckptlab-plan-explorer"
WIDGET_NOTEBOOK = "browser_widget_smoke.ipynb"
FORMATS_NOTEBOOK = "browser_formats.ipynb"
THEME_NOTEBOOK = "browser_dark_theme.ipynb"


@dataclass
class Lab:
    server: ServedProcess
    token: str
    root: Path
    config_dir: Path | None = None  # JUPYTER_CONFIG_DIR: lab/user-settings lives there

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
        lab = Lab(server=server, token=token, root=root, config_dir=jupyter["config"])
        specs = lab.api("kernelspecs")
        assert specs["default"] == "python3" and "python3" in specs["kernelspecs"], specs
        yield lab


@pytest.fixture(autouse=True)
def _shut_down_sessions(lab: Lab):
    """Each test's kernels stop when it ends, so the next test has the CPU to itself (but
    the shared formats notebook's kernel, which its module fixture stops)."""
    yield
    for session in lab.api("sessions"):
        if session.get("path", "").endswith(FORMATS_NOTEBOOK):
            continue
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


def test_async_writing_notebook_runs_clean(lab: Lab, page, page_log, screenshot):
    """notebooks/06_async_writing.ipynb runs in JupyterLab with no error output and no
    JavaScript error (its page had one: issue 31), its figures drawn."""
    name = "06_async_writing.ipynb"
    _run_notebook(page, lab, name)
    page.wait_for_selector(".js-plotly-plot", state="attached", timeout=RENDER_TIMEOUT_MS)
    page.wait_for_timeout(1000)
    screenshot(name.split("_", 1)[0], full_page=False)
    _assert_no_error_outputs(page, name)
    page_log.assert_offline()
    page_log.assert_no_errors()


def test_safetensors_notebook_runs_clean(lab: Lab, page, page_log, screenshot):
    """notebooks/09_safetensors_and_hugging_face.ipynb runs in JupyterLab with no error output
    and no JavaScript error: its hex views of the header and its figure drawn."""
    name = "09_safetensors_and_hugging_face.ipynb"
    _run_notebook(page, lab, name)
    page.wait_for_selector(".js-plotly-plot", state="attached", timeout=RENDER_TIMEOUT_MS)
    page.wait_for_timeout(1000)
    screenshot(name.split("_", 1)[0], full_page=False)
    hexes = page.locator(".ckptlab-hex")
    if hexes.count():
        hexes.first.scroll_into_view_if_needed()
        screenshot("header-hex", hexes.first)
    _assert_no_error_outputs(page, name)
    page_log.assert_offline()
    page_log.assert_no_errors()


def test_comparing_checkpoints_draws_its_explorers(lab: Lab, page, page_log, screenshot):
    """notebooks/07_comparing_checkpoints.ipynb runs clean in the browser: its DiffExplorer
    draws the module bars and the picked tensor's three histograms (A, B, B - A), its
    StatsExplorer its histogram."""
    name = "07_comparing_checkpoints.ipynb"
    _run_notebook(page, lab, name)
    plots = page.locator(".ckptlab-diff-explorer .js-plotly-plot")
    plots.first.wait_for(timeout=RENDER_TIMEOUT_MS)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.ckptlab-diff-explorer .js-plotly-plot')]"
        ".map(p => (p.data || []).map(t => t.name).join(',')).includes('A,B,B - A')",
        timeout=RENDER_TIMEOUT_MS)
    metas = plots.evaluate_all("ps => ps.map(p => (p.layout.meta || {}).kind)")
    assert metas[:2] == ["diff", "hist"], metas
    screenshot("diff-explorer-modules", plots.nth(0))
    screenshot("diff-explorer-histograms", plots.nth(1))
    stats = page.locator(".ckptlab-stats-explorer .js-plotly-plot")
    stats.first.wait_for(timeout=RENDER_TIMEOUT_MS)
    page.wait_for_function(  # it opens on the tensor with the NaN
        "() => [...document.querySelectorAll('.ckptlab-stats-explorer .js-plotly-plot')]"
        ".some(p => (p.data || []).map(t => t.name).join() === 'blocks.1.norm.weight')",
        timeout=RENDER_TIMEOUT_MS)
    screenshot("stats-explorer", page.locator(".ckptlab-stats-explorer").first)
    _assert_no_error_outputs(page, name)
    page_log.assert_offline()
    page_log.assert_no_errors()


# -- ckptlab's FigureWidget: updates sent while the front end is still loading plotly -------------
UPDATES_NOTEBOOK = "browser_figure_updates.ipynb"
UPDATED_FIGURES = 4


def _write_updates_notebook(path: Path) -> None:
    """Several ckptlab FigureWidgets shown and updated in the same cell: the restyle, the
    relayout and the shapes reach the front end while it is still loading plotly's bundle."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(
        "import ipywidgets as widgets\n"
        "import plotly.graph_objects as go\n"
        "from IPython.display import display\n"
        "from ckptlab.widgets._figure import FigureWidget\n"
        "\n"
        f"figs = [FigureWidget(go.Bar(x=['a', 'b', 'c'], y=[1, 2, 3]),\n"
        f"                     layout={{'title': {{'text': f'before {{k}}'}}}})\n"
        f"        for k in range({UPDATED_FIGURES})]\n"
        "box = widgets.VBox(figs)\n"
        "box.add_class('ckptlab-figure-updates')\n"
        "display(box)\n"
        "for k, fig in enumerate(figs):\n"
        "    with fig.batch_update():\n"
        "        fig.data[0].y = [10 * k + 4, 10 * k + 5, 10 * k + 6]\n"
        "        fig.layout.title.text = f'after {k}'\n"
        "    fig.layout.shapes = [dict(type='rect', xref='x', yref='paper', x0=0, x1=1,\n"
        "                              y0=0, y1=1)]\n"
    )]
    nbformat.write(nb, path)


UPDATED_JS = """([selector, n]) => {
  const plots = [...document.querySelectorAll(selector)];
  if (plots.length !== n) return false;
  const seen = plots.map(gd => gd._fullLayout && gd._fullData && gd._fullData.length ? {
    title: gd._fullLayout.title.text, y: Array.from(gd._fullData[0].y),
    shapes: (gd.layout.shapes || []).length,
    shapesDrawn: gd.querySelectorAll('.shapelayer path').length,
    bars: gd.querySelectorAll('.trace.bars .point').length} : null);
  return seen.every(s => s && s.title.startsWith('after') && s.shapesDrawn >= 1) ? seen : false;
}"""


def test_figure_widget_applies_updates_sent_while_loading(lab: Lab, page, page_log,
                                                           screenshot):
    """ckptlab's FigureWidget (every explorer's figure): updates sent right after display,
    before the page has loaded plotly's bundle, are all drawn; the page imports the bundle
    once for all the figures; and anywidget logs no "Failed to initialize model" (its 2 s
    deadline; see ckptlab.widgets._figure)."""
    _write_updates_notebook(lab.root / UPDATES_NOTEBOOK)
    _run_notebook(page, lab, UPDATES_NOTEBOOK)
    figures = ".ckptlab-figure-updates .js-plotly-plot"
    seen = page.wait_for_function(UPDATED_JS, arg=[figures, UPDATED_FIGURES],
                                  timeout=RENDER_TIMEOUT_MS).json_value()
    screenshot("updated", full_page=False)
    for k, fig in enumerate(seen):
        assert fig["title"] == f"after {k}", seen
        assert fig["y"] == [10 * k + 4, 10 * k + 5, 10 * k + 6], seen
        assert fig["shapes"] == 1 and fig["bars"] == 3, seen
    loads = page.evaluate("() => globalThis.__ckptlabPlotly ? globalThis.__ckptlabPlotly.size : 0")
    assert loads == 1, f"plotly's bundle imported for {loads} keys, expected one shared import"
    _assert_no_error_outputs(page, UPDATES_NOTEBOOK)
    page_log.assert_offline()
    page_log.assert_no_errors()

# -- tensor-first explorers on four formats -------------------------------------------------------
# One state dict in every format; TARGET is found by SEARCH alone (layers.1.mlp.fc1 is not).
STATE_SHAPES = (
    ("embed.weight", (64, 16)),
    ("layers.0.attn.q_proj.weight", (16, 16)),
    ("layers.0.mlp.fc1.weight", (32, 16)),
    ("layers.1.mlp.fc1.weight", (32, 16)),
    ("norm.bias", (16,)),
)
TARGET = "layers.0.mlp.fc1.weight"
SEARCH = "layers.0.mlp.fc1"
# where each format lies under the notebook folder (the kernel's working directory)
FORMATS = {
    "torch": "ckpts/model.pt",
    "safetensors": "ckpts/model.safetensors",
    "hf": "ckpts/hf",
    "dcp": "ckpts/dcp",
}
# the HF shards: TARGET in the second, smaller one, so selecting it changes the file shown
HF_SHARDS = {
    "model-00001-of-00002.safetensors": ("embed.weight", "layers.0.attn.q_proj.weight"),
    "model-00002-of-00002.safetensors": ("layers.0.mlp.fc1.weight", "layers.1.mlp.fc1.weight",
                                         "norm.bias"),
}
SHAPES_JS = """(selector) => {
  const gd = document.querySelector(selector);
  if (!gd || !gd.layout) return false;
  const shapes = (gd.layout.shapes || []).map(s => [s.x0, s.x1]);
  const drawn = gd.querySelectorAll('.shapelayer path').length;
  return shapes.length > 0 && drawn >= shapes.length ? {shapes, drawn,
    title: gd._fullLayout.title.text || ''} : false;
}"""


def _write_checkpoints(folder: Path) -> None:
    """STATE_SHAPES, seeded, saved as torch.save, safetensors, an HF sharded dir and DCP."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(12)
    state = {name: torch.randn(shape, generator=gen) for name, shape in STATE_SHAPES}
    folder.mkdir(parents=True)
    torch.save(state, folder / "model.pt")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = folder / "hf"
    hf.mkdir()
    weight_map = {}
    for shard, names in HF_SHARDS.items():
        save_file({n: state[n] for n in names}, str(hf / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=folder / "dcp", no_dist=True)


def _write_formats_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    cells = ["from ckptlab.widgets import LayoutExplorer, PlanExplorer"]
    for fmt, where in FORMATS.items():
        cells.append(f"explorer_{fmt} = LayoutExplorer({where!r})\n"
                     f"explorer_{fmt}.add_class('ckptlab-fmt-{fmt}')\n"
                     f"explorer_{fmt}")
    cells.append("plan = PlanExplorer()\nplan")
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)


# WCAG 2 contrast of each element's text colour on its effective background (the first
# ancestor with an opaque one, or the page's): the lowest ratio found, and where
CONTRAST_JS = """selectors => {
  const rgb = c => (c.match(/[\\d.]+/g) || []).map(Number)
  const lum = ([r, g, b]) => {
    const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4 }
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b)
  }
  const background = el => {
    for (let e = el; e; e = e.parentElement) {
      const c = rgb(getComputedStyle(e).backgroundColor)
      if (c.length >= 3 && (c.length === 3 || c[3] > 0.5)) return c.slice(0, 3)
    }
    return rgb(getComputedStyle(document.body).backgroundColor).slice(0, 3)
  }
  let worst = {ratio: 99, checked: 0}
  for (const sel of selectors) {
    for (const el of document.querySelectorAll(sel)) {
      if (!el.textContent.trim() || el.getClientRects().length === 0) continue
      const a = lum(rgb(getComputedStyle(el).color).slice(0, 3)), b = lum(background(el))
      const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)
      worst.checked += 1
      if (ratio < worst.ratio) worst = {ratio, checked: worst.checked, where: sel,
                                        text: el.textContent.slice(0, 40),
                                        color: getComputedStyle(el).color,
                                        background: background(el)}
    }
  }
  return worst
}"""


def _write_theme_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (
        "from ckptlab.widgets import LayoutExplorer, PlanExplorer",
        f"explorer = LayoutExplorer({FORMATS['torch']!r})\nexplorer",
        "plan = PlanExplorer()\nplan",
        # a tensor picked: its details table and its bytes in hex (the contrast check reads them)
        "explorer.select_tensor('layers.0.mlp.fc1.weight')",
    )]
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def checkpoints(lab: Lab) -> Path:
    """The four checkpoints under the notebook folder; their folder."""
    folder = lab.root / "ckpts"
    _write_checkpoints(folder)
    return folder


@pytest.fixture(scope="module")
def formats_page(lab: Lab, checkpoints: Path, browser, artifacts_dir: Path):
    """One page, shared by the tests below, with FORMATS_NOTEBOOK run (light theme) and its
    kernel alive; yields (page, its PageLog). The page's log (console errors, ignored ones
    too) is left in <artifacts>/formats_page.log."""
    from browser_support import PageLog, open_offline_page

    _write_formats_notebook(lab.root / FORMATS_NOTEBOOK)
    log = PageLog()
    page = open_offline_page(browser, log)
    try:
        _run_notebook(page, lab, FORMATS_NOTEBOOK)
        _assert_no_error_outputs(page, FORMATS_NOTEBOOK)
        yield page, log
    finally:
        (artifacts_dir / "formats_page.log").write_text(log.summary())
        page.context.close()
        for session in lab.api("sessions"):
            if session.get("path", "").endswith(FORMATS_NOTEBOOK):
                lab.api(f"sessions/{session['id']}", method="DELETE")


FIGURE_STATE_JS = """(selector) => {
  const gd = document.querySelector(selector);
  if (!gd) return {found: false, plots: document.querySelectorAll('.js-plotly-plot').length};
  const box = gd.getBoundingClientRect();
  return {found: true, fullData: gd._fullData ? gd._fullData.map(t => [t.type, t.visible]) : null,
    traces: gd.querySelectorAll('.main-svg .trace').length, width: box.width,
    height: box.height, html: gd.outerHTML.slice(0, 600)};
}"""


def _expected_parts(fmt: str, root: Path) -> tuple[str, list[tuple[int, int]], bytes]:
    """TARGET's file, its parts' byte ranges [offset, end) in that file and its first bytes,
    from the checkpoint model (the same ranges the explorer must outline)."""
    import ckptlab

    ck = ckptlab.open(root / FORMATS[fmt])
    parts = ck.tensors[TARGET].parts
    assert parts, f"{fmt}: {TARGET} has no parts"
    file = parts[0].file
    first = parts[0]
    with open(ck.file(file).full_path, "rb") as fh:
        fh.seek(first.offset)
        head = fh.read(8)
    return file, [(p.offset, p.offset + p.nbytes) for p in parts if p.file == file], head


ALL_DRAWN_JS = """(selectors) => selectors.every(s => {
  const gd = document.querySelector(s);
  return gd && gd._fullData && gd._fullData.length > 0
    && gd.querySelectorAll('.main-svg .trace, .main-svg .hm').length > 0; })"""


def test_layout_explorer_maps_draw_on_first_run(formats_page):
    """Every format's explorer draws its byte map on the first run of its cell."""
    page, _ = formats_page
    figures = [f".ckptlab-fmt-{fmt} .js-plotly-plot" for fmt in FORMATS]
    try:
        page.wait_for_function(ALL_DRAWN_JS, arg=figures, timeout=RENDER_TIMEOUT_MS)
    except Exception as exc:
        states = {s: page.evaluate(FIGURE_STATE_JS, s) for s in figures}
        blank = {s: st.get("fullData") for s, st in states.items() if not st.get("traces")}
        raise AssertionError(f"byte maps drawn blank (no trace): {blank}") from exc


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_layout_explorer_finds_a_tensor_and_outlines_its_bytes(
        fmt: str, formats_page, lab: Lab, screenshot):
    """Every format: the search box filters the tensor table to the one tensor, and
    selecting it outlines its parts on the byte map and shows its hex."""
    page, log = formats_page
    root = f".ckptlab-fmt-{fmt}"
    figure = f"{root} .js-plotly-plot"
    assert page.locator(root).count() == 1, f"{fmt}: no explorer rendered"
    page.locator(figure).first.scroll_into_view_if_needed()
    options = page.locator(f"{root} .ckptlab-tensor-table select option")
    assert options.count() == len(STATE_SHAPES), options.all_inner_texts()

    page.locator(f'{root} input[placeholder^="search tensors"]').fill(SEARCH)
    page.wait_for_function(
        """([sel, n]) => document.querySelectorAll(sel).length === n""",
        arg=[f"{root} .ckptlab-tensor-table select option", 1], timeout=RENDER_TIMEOUT_MS)
    texts = options.all_inner_texts()
    assert len(texts) == 1 and texts[0].startswith(TARGET), texts
    info = page.locator(f"{root} .ckptlab-page-info").inner_text()
    assert f"({len(STATE_SHAPES) - 1} filtered out)" in info, info

    page.locator(f"{root} .ckptlab-tensor-table select").select_option(index=0)
    file, ranges, head = _expected_parts(fmt, lab.root)
    outlined = page.wait_for_function(SHAPES_JS, arg=figure,
                                      timeout=RENDER_TIMEOUT_MS).json_value()
    assert sorted(tuple(s) for s in outlined["shapes"]) == sorted(ranges), (
        f"{fmt}: outlines {outlined['shapes']} are not {TARGET}'s bytes {ranges} in {file}")
    if fmt == "hf":  # the second shard is shown now: the map's title names it
        assert file in outlined["title"], outlined["title"]
    hex_view = page.locator(f"{root} .ckptlab-hex")
    hex_view.wait_for(state="visible", timeout=RENDER_TIMEOUT_MS)
    first_line = hex_view.inner_text().splitlines()[0]
    assert first_line.split()[0] == f"{ranges[0][0]:,}", first_line
    assert " ".join(f"{b:02x}" for b in head) in " ".join(first_line.split()), (
        f"{fmt}: hex {first_line!r} does not start with the file's bytes {head.hex(' ')}")
    page.locator(figure).first.scroll_into_view_if_needed()
    screenshot(f"{fmt}-selected", target=page, full_page=False)
    screenshot(f"{fmt}-explorer", target=page.locator(root))
    log.assert_offline()


# -- figures: drawn on first run, nothing overlapping, the theme's colours ------------------------
PLOT_DRAWN_JS = """(gd) => {
  // what plotly drew: data traces with marks, and axes that are not the empty plot's
  if (!gd._fullData || !gd._fullLayout) return null;
  const traces = gd._fullData.filter(t => t.visible !== false);
  const axes = Object.keys(gd._fullLayout).filter(k => /^[xy]axis\\d*$/.test(k))
    .map(k => ({name: k, range: gd._fullLayout[k].range}));
  return {
    traces: traces.map(t => ({type: t.type,
      n: (t.x || t.z || t.values || []).length})),
    bars: gd.querySelectorAll('.trace.bars .point').length,
    points: gd.querySelectorAll('.trace.scatter .point, .trace.scatter .js-line').length,
    heatmaps: gd.querySelectorAll('.hm image, .heatmaplayer image').length,
    axes,
  };
}"""

OVERLAP_JS = """(gd) => {
  // boxes that must not intersect: the title, the toolbar, axis titles, subplot titles
  // (annotations), the legend, the colour bar, and each of those against tick labels
  const boxes = [];
  const add = (el, group, label) => {
    const r = el.getBoundingClientRect();
    if (r.width < 1 || r.height < 1) return;
    if (el.tagName === 'text' && !el.textContent.trim()) return;
    boxes.push({group, label, l: r.left, t: r.top, r: r.right, b: r.bottom});
  };
  gd.querySelectorAll('.main-svg .gtitle').forEach(e => add(e, 'title', 'title'));
  gd.querySelectorAll('.modebar').forEach(e => add(e, 'modebar', 'toolbar'));
  const own = e => !e.closest('.colorbar');  // a colour bar's title and ticks are its own
  gd.querySelectorAll('.main-svg text[class$="title"]:not(.gtitle)').forEach(
    e => own(e) && add(e, 'axis-title ' + e.getAttribute('class') + ' ' + e.textContent,
             e.getAttribute('class') + ' "' + e.textContent.slice(0, 40) + '"'));
  gd.querySelectorAll('.main-svg .annotation').forEach(
    e => add(e, 'annotation ' + e.textContent, 'annotation "' + e.textContent.slice(0, 40) + '"'));
  gd.querySelectorAll('.main-svg .legend .bg').forEach(e => add(e, 'legend', 'legend'));
  gd.querySelectorAll('.main-svg .colorbar .cbbg').forEach(e => add(e, 'colorbar', 'colorbar'));
  gd.querySelectorAll('.main-svg .xtick text, .main-svg .ytick text, .main-svg [class*="tick"] text')
    .forEach(e => own(e) && add(e, 'ticks', 'tick "' + e.textContent + '"'));
  const hits = [];
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const a = boxes[i], b = boxes[j];
    if (a.group === b.group) continue;
    if (a.l < b.r - 1 && b.l < a.r - 1 && a.t < b.b - 1 && b.t < a.b - 1)
      hits.push(`${a.label} [${[a.l, a.t, a.r, a.b].map(Math.round)}] overlaps ` +
                `${b.label} [${[b.l, b.t, b.r, b.b].map(Math.round)}]`);
  }
  return {checked: boxes.length, groups: [...new Set(boxes.map(b => b.group))], hits};
}"""

SIBLINGS_OVERLAP_JS = """(root) => {
  // the widget's own parts (summary, controls, table, figures, labels): in every box,
  // no two visible children intersect
  const hits = [];
  const boxes = [root, ...root.querySelectorAll('.widget-box, .widget-hbox, .widget-vbox')]
    .filter(b => !b.closest('.js-plotly-plot'));
  for (const box of boxes) {
    const kids = [...box.children].map(e => [e, e.getBoundingClientRect()])
      .filter(([e, r]) => r.width >= 1 && r.height >= 1);
    for (let i = 0; i < kids.length; i++) for (let j = i + 1; j < kids.length; j++) {
      const [ea, a] = kids[i], [eb, b] = kids[j];
      if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1
          && b.top < a.bottom - 1)
        hits.push(`${ea.className} overlaps ${eb.className}`);
    }
  }
  return hits;
}"""

COLORS_JS = """(gd) => {
  // the colours a reader sees: the figure's effective background (the first opaque
  // ancestor background behind the transparent paper), the plot area, the text
  const rgb = c => { const m = c && c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const v = m[1].split(',').map(Number); return {r: v[0], g: v[1], b: v[2],
      a: v.length > 3 ? v[3] : 1}; };
  const lum = c => c ? (0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b) / 255 : null;
  const behind = el => { for (let e = el; e; e = e.parentElement) {
      const c = rgb(getComputedStyle(e).backgroundColor); if (c && c.a > 0.5) return c; }
    return {r: 255, g: 255, b: 255, a: 1}; };
  const svg = gd.querySelector('.main-svg');
  const paper = rgb(getComputedStyle(svg).backgroundColor);
  const effective = paper && paper.a > 0.5 ? paper : behind(svg.parentElement);
  const plot = gd.querySelector('.main-svg .bg');
  const title = gd.querySelector('.main-svg .gtitle');
  const tick = gd.querySelector('.main-svg .xtick text, .main-svg .ytick text');
  return {
    background: lum(effective),
    plot: plot ? lum(rgb(getComputedStyle(plot).fill)) : null,
    title: title ? lum(rgb(getComputedStyle(title).fill)) : null,
    tick: tick ? lum(rgb(getComputedStyle(tick).fill)) : null,
    page: lum(behind(document.querySelector('.jp-NotebookPanel') || document.body)),
    themeLight: document.body.dataset.jpThemeLight,
    themeName: document.body.dataset.jpThemeName,
  };
}"""


def _figures(page, scope: str, at_least: int = 1) -> list:
    """The plotly figures under `scope`, once at least `at_least` are there (a view draws
    once the page has loaded plotly's bundle, after the cell that made it has finished)."""
    page.wait_for_function("([sel, n]) => document.querySelectorAll(sel).length >= n",
                           arg=[f"{scope} .js-plotly-plot", at_least],
                           timeout=RENDER_TIMEOUT_MS)
    return page.locator(f"{scope} .js-plotly-plot").all()


def _check_figure(page, figure, what: str) -> dict:
    """Scroll `figure` (a Locator) into view, wait for it to be drawn, show its toolbar
    (hover), and assert that none of its title / toolbar / label boxes intersect."""
    figure.scroll_into_view_if_needed()
    figure.wait_for(state="visible", timeout=RENDER_TIMEOUT_MS)
    handle = figure.element_handle()
    page.wait_for_function(
        "(gd) => gd._fullData && gd.querySelectorAll('.main-svg .trace, .main-svg .hm').length",
        arg=handle, timeout=RENDER_TIMEOUT_MS)
    figure.hover(position={"x": 20, "y": 20})
    overlap = page.evaluate(OVERLAP_JS, handle)
    assert overlap["checked"] >= 3 and "title" in overlap["groups"] and \
        "modebar" in overlap["groups"], f"{what}: too few boxes to check: {overlap}"
    assert not overlap["hits"], f"{what}: {overlap['hits']}"
    return overlap


def test_explorer_boxes_do_not_overlap(formats_page, screenshot):
    """Every figure the four explorers show, and their own widgets: title, toolbar, axis
    titles, tick labels, legend and sibling widgets have disjoint boxes."""
    page, log = formats_page
    checked = 0
    figures = [f".ckptlab-fmt-{fmt} .js-plotly-plot" for fmt in FORMATS]
    page.wait_for_function(ALL_DRAWN_JS, arg=figures, timeout=RENDER_TIMEOUT_MS)
    for fmt in FORMATS:
        root = f".ckptlab-fmt-{fmt}"
        for k, figure in enumerate(_figures(page, root)):
            _check_figure(page, figure, f"{fmt} explorer figure {k}")
            checked += 1
        hits = page.evaluate(SIBLINGS_OVERLAP_JS, page.locator(root).element_handle())
        assert not hits, f"{fmt} explorer: {hits}"
        screenshot(f"{fmt}-boxes", target=page, full_page=False)
    assert checked >= len(FORMATS)
    log.assert_no_errors()


def _assert_plan_drawn(page, what: str) -> list[dict]:
    """The PlanExplorer's three figures have data drawn: bars per rank, the shard map's and
    the resharded load's heatmaps, axes fitted to the data (not plotly's empty -1..6)."""
    figures = _figures(page, PLAN_EXPLORER, at_least=3)
    assert len(figures) == 3, f"{what}: {len(figures)} plan figures"
    stats = []
    for k, figure in enumerate(figures):
        figure.scroll_into_view_if_needed()
        handle = figure.element_handle()
        page.wait_for_function(FIGURE_DRAWN_JS, arg=f"{PLAN_EXPLORER} .js-plotly-plot",
                               timeout=RENDER_TIMEOUT_MS)
        drawn = page.wait_for_function(
            f"(gd) => {{ const s = ({PLOT_DRAWN_JS})(gd); "
            "return s && (s.bars + s.heatmaps) > 0 ? s : false; }",
            arg=handle, timeout=RENDER_TIMEOUT_MS).json_value()
        assert drawn["traces"] and all(t["n"] > 0 for t in drawn["traces"]), (
            f"{what} figure {k}: empty traces {drawn['traces']}")
        for axis in drawn["axes"]:
            assert axis["range"] not in ([-1, 6], [-1, 4]), (
                f"{what} figure {k}: {axis['name']} has the empty plot's range {axis['range']}")
        _check_figure(page, figure, f"{what} figure {k}")
        stats.append(drawn)
    bars = stats[0]["bars"]
    assert bars == 8, f"{what}: bytes per rank drew {bars} bars for 8 ranks: {stats[0]}"
    assert stats[1]["heatmaps"] >= 1 and stats[2]["heatmaps"] >= 3, stats
    hits = page.evaluate(SIBLINGS_OVERLAP_JS, page.locator(PLAN_EXPLORER).element_handle())
    assert not hits, f"{what}: {hits}"
    return stats




def test_plan_explorer_draws_on_first_run(formats_page, screenshot):
    """PlanExplorer() run once (run-all, no re-run) draws all three figures."""
    page, log = formats_page
    _assert_plan_drawn(page, "PlanExplorer")
    page.locator(PLAN_EXPLORER).scroll_into_view_if_needed()
    screenshot("plan-explorer", target=page.locator(PLAN_EXPLORER))
    log.assert_no_errors()


def _assert_theme(page, scope: str, dark: bool) -> list[dict]:
    """Every figure under `scope` reads as `dark` (or light): its background, plot area and
    text, and the notebook page behind it."""
    seen = []
    for k, figure in enumerate(_figures(page, scope)):
        figure.scroll_into_view_if_needed()
        c = page.evaluate(COLORS_JS, figure.element_handle())
        what = f"{scope} figure {k} ({'dark' if dark else 'light'} theme): {c}"
        assert c["themeLight"] == ("false" if dark else "true"), what
        text = [v for v in (c["title"], c["tick"]) if v is not None]
        assert text, what
        if dark:
            assert c["page"] < 0.25 and c["background"] < 0.25, what
            assert c["plot"] is None or c["plot"] < 0.25, what
            assert min(text) > 0.55, what
        else:
            assert c["page"] > 0.8 and c["background"] > 0.8, what
            assert c["plot"] is None or c["plot"] > 0.8, what
            assert max(text) < 0.45, what
        seen.append(c)
    assert seen, f"no figure under {scope}"
    return seen


def test_light_theme_renders_light(formats_page):
    """JupyterLab's default (light) theme: the figures are light with dark text."""
    page, _ = formats_page
    _assert_theme(page, ".ckptlab-fmt-torch", dark=False)
    _assert_theme(page, PLAN_EXPLORER, dark=False)


THEME_SETTINGS = """{
    // Theme
    // @jupyterlab/apputils-extension:themes
    // Theme manager settings.
    // *************************************

    // Selected Theme
    // Application-level visual styling theme
    "theme": "JupyterLab Dark"
}
"""


def test_dark_theme_renders_dark(lab: Lab, checkpoints: Path, page, page_log, screenshot):
    """With "JupyterLab Dark" saved as JupyterLab's theme (as its Settings menu saves it),
    the explorer's and PlanExplorer's figures draw dark with light text, without overlaps.
    Runs last: the other tests' kernels would build dark figures while the setting is saved."""
    settings = (lab.config_dir / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
                / "themes.jupyterlab-settings")
    _write_theme_notebook(lab.root / THEME_NOTEBOOK)
    settings.write_text(THEME_SETTINGS)
    try:
        _run_notebook(page, lab, THEME_NOTEBOOK)
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'",
                               timeout=RENDER_TIMEOUT_MS)
        _assert_plan_drawn(page, "PlanExplorer (dark)")
        _assert_theme(page, PLAN_EXPLORER, dark=True)
        page.locator(PLAN_EXPLORER).scroll_into_view_if_needed()
        screenshot("dark-plan", full_page=False)
        _assert_no_error_outputs(page, THEME_NOTEBOOK)
        page_log.assert_offline()
        explorer_map = f"{EXPLORER} .js-plotly-plot"
        page.locator(explorer_map).first.scroll_into_view_if_needed()
        page.wait_for_function(ALL_DRAWN_JS, arg=[explorer_map], timeout=RENDER_TIMEOUT_MS)
        _assert_theme(page, EXPLORER, dark=True)
        for k, figure in enumerate(_figures(page, EXPLORER)):
            _check_figure(page, figure, f"dark explorer figure {k}")
        # every glyph of the hex view and the tables reads at WCAG AA (4.5:1) on dark
        page.locator(f"{EXPLORER} pre.ckptlab-hex").first.wait_for(timeout=RENDER_TIMEOUT_MS)
        worst = page.evaluate(CONTRAST_JS, [f"{EXPLORER} pre.ckptlab-hex span",
                                            f"{EXPLORER} table td", f"{EXPLORER} table th"])
        assert worst["checked"] > 50, worst
        assert worst["ratio"] >= 4.5, f"text at {worst['ratio']:.2f}:1 in dark theme: {worst}"
        page.locator(f"{EXPLORER} pre.ckptlab-hex").first.scroll_into_view_if_needed()
        screenshot("dark-explorer", full_page=False)
        page_log.assert_no_errors()
    finally:
        settings.unlink(missing_ok=True)
