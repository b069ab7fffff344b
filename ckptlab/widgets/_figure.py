"""A plotly ``FigureWidget`` that draws on first display in JupyterLab and keeps updating.

Two front-end races made plotly's own ``go.FigureWidget`` unreliable in a notebook that
builds several figures at once (each explorer has one or more):

1. plotly opens the widget's comm in ``BaseFigure.__init__``, before it sets
   ``_widget_data`` and ``_widget_layout``, and sends those as a second message. The view
   draws from the model once, when it is displayed, so a view that renders before the
   second message is applied stays empty axes (-1..6) until the cell is run again.
2. anywidget (0.11 here) holds every comm message to a model until the model's ``_esm`` is
   imported and initialized, and gives up 2 s after the model was created: ``[anywidget]
   Failed to initialize model.`` is logged and the model's ``ready`` promise stays
   rejected, so *every* later message to that model is dropped (a file switch, a zoom, a
   selection outline never arrives). plotly's ``_esm`` is its whole 5 MB widget bundle,
   imported once per model (a distinct ``blob:`` module each); on a busy 2-core machine
   one import holds the page's main thread for about 2 s, so the models of a notebook that
   shows several figures miss that deadline.

Here the comm opens once the figure is complete (1), and ``_esm`` is a small loader (2): it
initializes at once and imports plotly's bundle once per page (shared by every figure of
that plotly version), when the kernel is idle, so that no widget is initializing while the
bundle holds the main thread. The bundle is not in each figure's state: the first figure of
a page asks the kernel for it (a custom message answered with one binary buffer).
Messages that arrive before the bundle is loaded are queued and replayed, in order, to
plotly's model once it exists; views render once it does. As a starved machine can still
miss anywidget's deadline, the loader also has the widget's comm hand messages to
ipywidgets' own handler, past anywidget's gate (where the host is the ipywidgets manager).
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from typing import Any

import plotly
import plotly.graph_objects as go
import traitlets

from ckptlab.widgets import _compat

__all__ = ["FigureWidget"]

# The _py2js_* traits plotly's front-end model acts on (basewidget.BaseFigureWidget).
_PY2JS = _compat.plotly_py2js_traits()
# ipywidgets' front-end comm message handler, which anywidget's model overrides (see below)
_COMM_HANDLER = _compat.ipywidgets_js_comm_handler()

# the first figure of a page imports plotly's bundle once the kernel is idle, or after _WAIT_MS,
# and _QUIET_MS later (see settled() below)
_WAIT_MS = 10_000
_QUIET_MS = 300
_BUNDLE_TIMEOUT_MS = 60_000  # no answer from the kernel by then: the figure says why it is empty
_BUNDLE_MSG = "ckptlab:plotly-bundle"  # the custom message that asks for (and brings) it

_LOADER = """\
const KEY = %(key)s;
const PY2JS = %(py2js)s;
const WAIT_MS = %(wait_ms)d;
const BUNDLE = %(bundle_msg)s;
const QUIET_MS = %(quiet_ms)d;
const BUNDLE_TIMEOUT_MS = %(bundle_timeout_ms)d;
const COMM_HANDLER = %(comm_handler)s;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function settled(model) {
  // Evaluating plotly's bundle holds the page's main thread for a second or more (seconds on
  // a busy machine); a widget model that is initializing meanwhile misses anywidget's 2 s
  // deadline and then drops every message sent to it. So the bundle is imported once the
  // kernel is idle (the cell that made the figures has finished: no new widget is on its
  // way) and the models that just arrived have had a moment to initialize; a kernel busy for
  // longer than WAIT_MS (a long-running cell) does not hold the figures back for longer.
  const kernel = model.widget_manager && model.widget_manager.kernel;
  const start = performance.now();
  while (kernel && typeof kernel.status === "string" && kernel.status !== "idle"
         && performance.now() - start < WAIT_MS) {
    await sleep(50);
  }
  await sleep(QUIET_MS);
}

function bundle(model) {
  // plotly's bundle: in the model's state if it came with it, else asked of the kernel (a
  // 5 MB binary buffer, once per page rather than 5 MB of JSON with every figure)
  const inline = model.get("_plotly_bundle");
  if (inline) return Promise.resolve(new Blob([inline], {type: "text/javascript"}));
  const manager = model.widget_manager;
  if (manager && "kernel" in manager && !manager.kernel) {
    return Promise.reject(new Error("no kernel to ask for plotly's code"));
  }
  return new Promise((resolve, reject) => {
    const answer = (content, buffers) => {
      if (!content || content.type !== BUNDLE || content.key !== KEY || !buffers?.length) return;
      clearTimeout(timer);
      model.off("msg:custom", answer);
      resolve(new Blob([buffers[0]], {type: "text/javascript"}));
    };
    // no answer (a kernel restarted or gone, a saved page): give up, so that the next
    // figure asks again and this one says why it is empty
    const timer = setTimeout(() => {
      model.off("msg:custom", answer);
      reject(new Error(`the kernel did not send plotly's code within ${BUNDLE_TIMEOUT_MS / 1000} s`));
    }, BUNDLE_TIMEOUT_MS);
    model.on("msg:custom", answer);
    model.send({type: BUNDLE, key: KEY});
  });
}

function plotlyModule(model) {
  // one import per page and bundle: every figure shares the module (plotly's default export
  // is a factory, so each figure still gets its own model and view objects)
  const cache = (globalThis.__ckptlabPlotly ??= new Map());
  if (!cache.has(KEY)) {
    const loading = settled(model).then(() => bundle(model)).then((blob) => {
      const url = URL.createObjectURL(blob);
      return import(url).finally(() => URL.revokeObjectURL(url));
    });
    loading.catch(() => cache.delete(KEY));  // a failed load may be retried by the next figure
    cache.set(KEY, loading);
  }
  return cache.get(KEY);
}

async function takeMessages(model) {
  // anywidget (0.11) holds each message to a model until the model is initialized and drops
  // them all, for good, once 2 s have passed since the model was made: on a starved machine
  // even this small module can miss that. This model takes its messages as soon as
  // initialize() runs (it queues what plotly's model cannot take yet), so its comm hands
  // them to ipywidgets' own handler directly. Skipped where the host is not the ipywidgets
  // manager this is written against.
  const id = model.get("_ckptlab_model_id");
  const manager = model.widget_manager;
  if (!id || !manager || typeof manager.get_model !== "function") return;
  const real = await manager.get_model(id);
  const own = real && Object.getPrototypeOf(real);
  const base = own && Object.getPrototypeOf(own);
  if (!own || !Object.prototype.hasOwnProperty.call(own, COMM_HANDLER) || !base
      || typeof base[COMM_HANDLER] !== "function" || !real.comm
      || typeof real.comm.on_msg !== "function") return;
  real.comm.on_msg((msg) => base[COMM_HANDLER].call(real, msg));
}

export default () => {
  let loaded;
  return {
    initialize({ model }) {
      // Return at once, so anywidget's model is ready well within its 2 s; hold the _py2js
      // messages that arrive before plotly's model exists, then replay them to it in order.
      const queue = [];
      let live = false;
      const hold = (name) => () => {
        const value = model.get(name);
        if (!live && value !== null && value !== undefined) queue.push([name, value]);
      };
      for (const name of PY2JS) model.on(`change:${name}`, hold(name));
      takeMessages(model).catch(() => {});
      loaded = plotlyModule(model).then(async (mod) => {
        const widget = typeof mod.default === "function" ? await mod.default() : mod.default;
        const handlers = new Map();
        const replaying = new Map();
        const wrapped = new WeakMap();
        const proxy = {  // anywidget's model API, with the replayed value shown while replaying
          get: (name) => (replaying.has(name) ? replaying.get(name) : model.get(name)),
          set: (...args) => model.set(...args),
          save_changes: () => model.save_changes(),
          send: (...args) => model.send(...args),
          on: (event, callback) => {
            // until the queue is replayed, plotly's handlers run only from the replay
            if (!handlers.has(event)) handlers.set(event, []);
            handlers.get(event).push(callback);
            const gated = (...args) => live && callback(...args);
            wrapped.set(callback, gated);
            model.on(event, gated);
          },
          off: (event, callback) => model.off(event, callback && (wrapped.get(callback) ?? callback)),
          widget_manager: model.widget_manager,
        };
        await widget.initialize({ model: proxy });
        for (const [name, value] of queue) {
          replaying.set(name, value);
          try {
            for (const callback of handlers.get(`change:${name}`) ?? []) callback();
          } finally {
            replaying.delete(name);
          }
        }
        queue.length = 0;
        live = true;
        return widget;
      });
      loaded.catch((error) => console.error("[ckptlab] plotly widget bundle failed to load", error));
    },
    async render({ el }) {
      let widget;
      try {
        widget = await loaded;
      } catch (error) {
        // say so where the figure would be, instead of an empty output
        const note = document.createElement("div");
        note.className = "ckptlab-figure-unavailable";
        note.style.cssText = "padding:8px;border:1px dashed #999;color:#666;font:13px sans-serif";
        note.textContent = "This figure is drawn by plotly's code, which comes from the running "
          + `kernel, and it could not be loaded (${error?.message ?? error}). Run the cell `
          + "again in a live kernel.";
        el.appendChild(note);
        return;
      }
      return widget.render({ el });
    },
  };
};
"""


@functools.cache
def _plotly_bundle() -> str:
    """plotly's anywidget bundle (:func:`~ckptlab.widgets._compat.plotly_widget_bundle`),
    read once."""
    return _compat.plotly_widget_bundle()


@functools.cache
def _loader_key() -> str:
    """Names the bundle in the page's cache: plotly's version and the bundle's digest."""
    digest = hashlib.sha256(_plotly_bundle().encode()).hexdigest()[:16]
    return f"plotly {plotly.__version__} {digest}"


@functools.cache
def _loader() -> str:
    return _LOADER % {"key": json.dumps(_loader_key()), "py2js": json.dumps(list(_PY2JS)),
                      "wait_ms": _WAIT_MS, "quiet_ms": _QUIET_MS,
                      "bundle_timeout_ms": _BUNDLE_TIMEOUT_MS,
                      "bundle_msg": json.dumps(_BUNDLE_MSG),
                      "comm_handler": json.dumps(_COMM_HANDLER)}


class FigureWidget(go.FigureWidget):
    """A ``go.FigureWidget`` that draws on first display and receives every later update.

    The comm opens once the figure is complete, so its first message carries the traces and
    the layout; the front end's module is a small loader that shares one import of plotly's
    widget bundle among all figures of a page and queues updates until it is loaded (see
    the module notes). It is a ``go.FigureWidget`` in every other respect.
    """

    _plotly_bundle = traitlets.Unicode().tag(sync=True)  # empty: the front end asks for it
    _ckptlab_model_id = traitlets.Unicode().tag(sync=True)  # the comm's id, for the loader

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _compat.anywidget_set_esm(self, _loader())  # before AnyWidget.__init__
        self._defer_open = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._defer_open = False
        self.on_msg(self._send_bundle)
        if self.comm is None:
            self._ckptlab_model_id = uuid.uuid4().hex
            _compat.ipywidgets_set_model_id(self, self._ckptlab_model_id)
        self.open()

    def _send_bundle(self, widget: Any, content: Any, buffers: Any) -> None:
        """Answer the loader's request for plotly's bundle (one binary buffer)."""
        if isinstance(content, dict) and content.get("type") == _BUNDLE_MSG:
            key = _loader_key()
            if content.get("key") == key:
                self.send({"type": _BUNDLE_MSG, "key": key},
                          buffers=[_plotly_bundle().encode()])

    def open(self) -> None:
        """Open the comm, unless the figure is still being built (see the class notes)."""
        if not getattr(self, "_defer_open", False):
            super().open()


def replace_figure(target: go.FigureWidget, new: go.Figure) -> None:
    """Show ``new`` in ``target`` (same trace count: updated in place, else rebuilt)."""
    if len(target.data) == len(new.data):
        with target.batch_update():
            for old, trace in zip(target.data, new.data):
                old.update(trace.to_plotly_json(), overwrite=True)
            target.layout.update(new.layout.to_plotly_json(), overwrite=True)
        return
    target.data = ()
    target.add_traces(list(new.data))
    target.layout.update(new.layout.to_plotly_json(), overwrite=True)
