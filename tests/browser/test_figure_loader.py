"""The FigureWidget's front-end loader (ckptlab/widgets/_figure.py) where plotly's code cannot
come: no kernel (a saved page), or a kernel that never answers. The figure must say why it is
empty, in place, instead of staying a blank output forever."""

from __future__ import annotations

import json

from ckptlab.widgets import _figure

# runs the loader module against a stand-in anywidget model; resolves with the figure's text
RUN = """async ([src, kernel]) => {
  const url = URL.createObjectURL(new Blob([src], {type: "text/javascript"}));
  const mod = await import(url);
  const sent = [];
  const model = {
    get: () => null, on: () => {}, off: () => {}, send: (msg) => sent.push(msg),
    widget_manager: kernel ? {kernel: {status: "idle"}} : {kernel: null},
  };
  const widget = mod.default();
  widget.initialize({model});
  const el = document.createElement("div");
  document.body.appendChild(el);
  await widget.render({el});
  return [el.textContent, sent.length];
}"""


def _loader(timeout_ms: int) -> str:
    return _figure._LOADER % {
        "key": json.dumps(_figure._loader_key()), "py2js": json.dumps(list(_figure._PY2JS)),
        "wait_ms": _figure._WAIT_MS, "quiet_ms": 0, "bundle_timeout_ms": timeout_ms,
        "bundle_msg": json.dumps(_figure._BUNDLE_MSG),
        "comm_handler": json.dumps(_figure._COMM_HANDLER)}


def test_without_a_kernel_the_figure_says_why_it_is_empty(page) -> None:
    text, sent = page.evaluate(RUN, [_loader(60_000), False])
    assert "comes from the running kernel" in text and "no kernel" in text
    assert sent == 0  # nobody to ask


def test_a_kernel_that_never_answers_is_given_up_on(page) -> None:
    text, sent = page.evaluate(RUN, [_loader(300), True])
    assert sent == 1  # asked once
    assert "did not send plotly's code within 0.3 s" in text
