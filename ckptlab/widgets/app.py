"""The served workbench: a panel app over the same figures (``ckptlab serve [PATH]``).

Everything is served from the local server: BokehJS, panel's and plotly's JavaScript come
with the app (no CDN), so it works on a cluster node without internet.

Tensor first, any format. :class:`CheckpointApp` opens on what :func:`ckptlab.open` reads (a
torch.save file, safetensors, a Hugging Face or DCP directory, legacy, TorchScript, .pt2): a
summary with totals by dtype, a searchable, sortable tensor table (the browser gets one page
of rows at a time; filter and sort run on the server), the non-tensor values, and the byte
map of a file with the selected tensor's parts outlined and its first bytes in hex.
Multi-file checkpoints get a file picker and a bytes-per-file overview. A torch.save zip also
gets :class:`LayoutApp`, the records and the alignment what-if, since there alignment is the
writer's choice.

First paint comes from the index. The table and the totals need only a
:class:`~ckptlab.checkpoint._cache.CheckpointIndex`, which :class:`ServedCheckpoint` reads from
the on-disk :class:`~ckptlab.checkpoint._cache.InspectionCache` when the file was seen before
(a fraction of a second at 100,000 tensors, where opening the file takes seconds). It is made
on a thread (:class:`PendingCheckpoint`): the port opens at once, or as soon as a cached or
small index is there, and a page that comes before the index shows the checkpoint's name and
how long it has been read (:class:`IndexProgress`), then the app in its place. The full
:class:`~ckptlab.checkpoint.Checkpoint`, which the byte map needs, is then opened on a thread
once the first page has been drawn, and every session draws its map when it is there.
Every page comes without plotly.js (4.8 MB of its 8 MB of JavaScript): :class:`PlotlyLoader`
adds it after the table is drawn, and only then does the session add its plotly panes (a map
that is ready at once waits too: parsing plotly.js first held the table back by seconds).
Whether the checkpoint is safe to load (:func:`ckptlab.scan`, whose rules import torch) is
found on a thread once the page is drawn, and shown when it is there. The
imports behind the served app are the app's own (``ckptlab.widgets`` imports its notebook
explorers, and ipywidgets with them, only on first use); panel's plotly pane imports its
figure widget module (nbformat, jsonschema: seconds) on the loading thread, not before the
port opens.

``ckptlab serve`` comes sooner still: :func:`ckptlab.widgets.quick.serve` answers the port
with a quick page of the table (the same rows, :class:`~ckptlab.widgets.quick.CheckpointRows`)
before panel is even imported, then hands the port to the server of :func:`workbench_server`,
which listens on no port of its own. :func:`serve` here is the workbench alone (panel's own
server on the port), for a layout, a :class:`ServedCheckpoint`, or a caller that wants no
quick page.

Many sessions, one server. Panel runs every session's callbacks on one thread, so what a
session costs is what the next visitor waits for. Work that depends only on the file and an
alignment (the what-if layout, its byte map arrays, its summary, the alignment costs) is done
once per (file, alignment) in a :class:`LayoutCache` that the server owns and every session
reads; the tensor table's rows and the per-file byte maps are held once by the
:class:`ServedCheckpoint`. A session keeps only its own figures and widgets, and they are
freed when panel ends the session (``pn.state.on_session_destroyed``). The caches hold frozen
data and never a session's objects, and they are bounded (least recently used views go first).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import panel as pn

from ckptlab.checkpoint._cache import InspectionCache
from ckptlab.format import ArchiveLayout
from ckptlab.widgets import _compat
from ckptlab.widgets._checkpoint_app import CheckpointApp, IndexProgress
from ckptlab.widgets._common import LayoutSource, as_layout
from ckptlab.widgets._layout_app import (
    LayoutApp,
    LayoutCache,
    LayoutView,
    alignment_options,
    own_alignment,
)
from ckptlab.widgets._plotly_page import PlotlyLoader
from ckptlab.widgets._served import PendingCheckpoint, ServedCheckpoint

__all__ = ["CheckpointApp", "IndexProgress", "LayoutApp", "LayoutCache", "LayoutView",
           "PendingCheckpoint", "PlotlyLoader", "ServedCheckpoint", "serve", "workbench_server"]

# A session nobody is connected to ends after SESSION_LIFETIME_MS (bokeh's default: a page
# connects its websocket only once its scripts ran, seconds after the GET that built its
# session on a busy machine). Bokeh looks for such sessions every 17 s by default; every 2 s,
# a closed page's session is freed 15-17 s after it closed.
SESSION_CHECK_MS = 2_000
SESSION_LIFETIME_MS = 15_000
# how long serve() waits for the index before it opens the port anyway (a cached index or a
# small file is there within it, and panel's warm-up session then builds the whole app); past
# it, pages show a progress state until the index is there
INDEX_WAIT_S = 1.0
MAX_SEARCH = 1000  # characters of a search carried over from the quick page (``?q=``)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where there is none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _release_memory(trim: Callable[[int], int] | None) -> None:
    """Collect the ended sessions' cycles and hand the freed heap pages back to the OS.

    A session's objects go back to Python's allocator and glibc's heap, which keep the pages:
    measured with 20 sessions on a 5,000-tensor file, RSS stays at its peak (about 205 MiB)
    after the collection and drops by 20 MiB only once ``malloc_trim`` runs.
    """
    gc.collect()
    if trim is not None:
        trim(0)


def _query_argument(name: str) -> str:
    """Query argument ``name`` of the page the current session is for ("" if none)."""
    try:
        values = pn.state.session_args.get(name) or []
    except Exception:  # no session (a warm-up, a notebook)
        return ""
    value = values[0] if values else b""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _Sessions:
    """The server's sessions: one app each (a :class:`CheckpointApp` over a
    :class:`ServedCheckpoint`, or a :class:`LayoutApp` for a layout without a file) over the
    shared caches. An ended session's app is closed, and memory is given back once per burst
    of endings."""

    def __init__(self, layout: ArchiveLayout | None, cache: LayoutCache, *,
                 served: ServedCheckpoint | None = None,
                 pending: PendingCheckpoint | None = None,
                 release_delay_s: float = 1.0) -> None:
        self.layout = layout
        self.cache = cache
        self.served = served
        self.pending = pending
        self.live = 0
        self.release_delay_s = release_delay_s
        self._release_pending = False
        self._frozen = False
        self._trim = _malloc_trim()

    def open(self) -> pn.Column:
        """A new session's view (panel calls this once per browser page)."""
        pending = self.pending
        if self.served is None and pending is not None:
            if pending.done.is_set() and pending.served is not None:
                self.served = pending.served
            else:  # the index is being made: a progress state, then the app
                app: CheckpointApp | LayoutApp | IndexProgress = IndexProgress(pending)
        if self.served is not None:
            app = CheckpointApp(self.served)
            search = _query_argument("q")
            if search.strip():  # the quick page's search, carried over
                app.tensors.find(search[:MAX_SEARCH])
        elif pending is None:
            app = LayoutApp(self.layout, cache=self.cache)
        doc = pn.state.curdoc
        if doc is not None and doc.session_context is not None:
            self.live += 1
            pn.state.on_session_destroyed(lambda context: self._ended(app))
        return app.view

    def _ended(self, app: CheckpointApp | LayoutApp | IndexProgress) -> None:
        if app.view is None:  # closed already
            return
        self.live -= 1
        app.close()
        if not self._release_pending:
            from tornado.ioloop import IOLoop

            self._release_pending = True
            IOLoop.current().call_later(self.release_delay_s, self._release)

    def _release(self) -> None:
        self._release_pending = False
        _release_memory(self._trim)
        if not self._frozen and self.live == 0:
            # The first release follows panel's warm-up session (``warm=True``): what is
            # alive now (the layout, the cache, every module a page needs) lives as long as
            # the server. Freezing it keeps the collector's full scans to the sessions'
            # objects: with a 5,000-tensor file one full scan walked 266k objects in 150 ms,
            # a pause every session waits through.
            self._frozen = True
            gc.freeze()


def serve(source: LayoutSource | ServedCheckpoint, *, port: int = 5006,
          address: str = "127.0.0.1", show: bool = False, cache: LayoutCache | None = None,
          inspection_cache: InspectionCache | None = None) -> None:
    """Serve the app for ``source`` on ``http://address:port/`` until interrupted.

    Parameters
    ----------
    source
        A checkpoint file or directory of any format :func:`ckptlab.open` reads (each
        session gets a :class:`CheckpointApp`), a :class:`ServedCheckpoint`, or an
        :class:`~ckptlab.format.ArchiveLayout` or bytes (a :class:`LayoutApp`: records and the
        alignment what-if only).
    port, address
        Where to listen (``127.0.0.1``: this machine only).
    show
        Open a browser tab.
    cache
        The torch.save what-if views shared by sessions (a new :class:`LayoutCache` if None).
    inspection_cache
        The on-disk index cache (:class:`~ckptlab.checkpoint._cache.InspectionCache`; by
        default one in ``$CKPTLAB_CACHE_DIR`` or ``~/.cache/ckptlab``): a checkpoint seen
        before shows its tensor table without being opened first.

    Notes
    -----
    The index is read (or the checkpoint opened) once, on a thread: the port opens when it is
    there or after ``INDEX_WAIT_S``, whichever comes first; until it is there, pages show
    its progress (:class:`IndexProgress`) and then the app. Past
    ``EAGER_TENSORS`` tensors the full checkpoint for the byte maps is opened on a thread
    when the first page has loaded (or ``LOAD_FALLBACK_S`` after serving); below, before
    serving. A session is freed 15-17 s after its page closed
    (``SESSION_LIFETIME_MS`` unconnected, looked for every ``SESSION_CHECK_MS``).
    """
    _compat.skip_slow_optional_imports()  # this process serves pages
    cache = cache if cache is not None else LayoutCache()
    served: ServedCheckpoint | None = None
    pending: PendingCheckpoint | None = None
    layout: ArchiveLayout | None = None
    if isinstance(source, ServedCheckpoint):
        served = source
    elif isinstance(source, (str, os.PathLike)):
        # the index is made on a thread; a cached or small one is there within INDEX_WAIT_S
        # and is served as before, else the port opens now and pages show its progress
        pending = PendingCheckpoint(
            source, layout_cache=cache,
            inspection_cache=inspection_cache if inspection_cache is not None
            else InspectionCache())
        if pending.wait(INDEX_WAIT_S) and pending.served is not None:
            served, pending = pending.served, None
    else:
        layout = as_layout(source)
        # the first visitor must not wait for the file's own view and costs: compute them
        # now, and let panel build (and end) one session before serving (``warm=True``),
        # which imports what a page needs (plotly's figure widget module alone takes seconds)
        cache.view(layout, own_alignment(layout))
        if layout.format == "torch-zip":
            cache.costs(layout, alignment_options(layout))
    sessions = _Sessions(layout, served.layout_cache if served is not None else cache,
                         served=served, pending=pending)
    # a checkpoint's pages come without plotly.js (CheckpointApp loads it after the table);
    # a layout's page opens on its byte map
    pn.extension(*(("plotly", "tabulator") if layout is not None else ("tabulator",)),
                 inline=True)
    # plotly's panel model, so that a page panel cannot send without plotly.js (no
    # page_without_plotly) carries it
    import panel.models.plotly  # noqa: F401
    if isinstance(source, ServedCheckpoint):  # (a path's PendingCheckpoint did this)
        served.schedule_load()
    pn.serve({"/": sessions.open}, port=port, address=address, show=show,
             websocket_origin=_origins(address, port), title="ckptlab", threaded=False,
             print_url=True, warm=True, **_SESSION_OPTIONS)


# bokeh's session bookkeeping, the same for every server of the app
_SESSION_OPTIONS = {"check_unused_sessions_milliseconds": SESSION_CHECK_MS,
                    "unused_session_lifetime_milliseconds": SESSION_LIFETIME_MS}


def _origins(address: str, port: int) -> list[str]:
    """The pages whose websocket the server accepts: those of ``address:port``."""
    return [f"{address}:{port}", f"localhost:{port}", f"127.0.0.1:{port}"]


def workbench_server(served: ServedCheckpoint, *, port: int, address: str) -> Any:
    """Panel's server of the workbench over ``served``, for a front on ``address:port``.

    The server of :func:`ckptlab.widgets.quick.serve`: the same sessions and options as
    :func:`serve` (one warm-up session built here, session lifetimes, websockets of pages of
    ``address:port`` only), started, but listening on no port of its own: the front
    (:class:`~ckptlab.widgets.quick.QuickServer`) hands it its requests, through its tornado
    application (bokeh's ``Server._tornado``). Call it on the IOLoop's thread.

    Parameters
    ----------
    served
        The checkpoint every session shows (its full open scheduled already).
    port, address
        Where the front listens: the pages' origin.

    Returns
    -------
    bokeh.server.server.Server
        Started; its own port (an ephemeral one on 127.0.0.1) closed.
    """
    from panel.io.server import get_server

    sessions = _Sessions(None, served.layout_cache, served=served)
    pn.extension("tabulator", inline=True)  # pages come without plotly.js (see serve)
    import panel.models.plotly  # noqa: F401
    server = get_server({"/": sessions.open}, port=0, address="127.0.0.1",
                        websocket_origin=_origins(address, port), title="ckptlab",
                        start=False, warm=True, **_SESSION_OPTIONS)
    _compat.bokeh_unlisten(server)  # the port bokeh bound: requests come through the front
    server.start()  # bokeh's periodic work (unused sessions), not the IOLoop
    return server


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckptlab.widgets.app PATH [--port N] [--address A]``: serve any checkpoint.

    The same as ``ckptlab serve`` (:func:`ckptlab.widgets.quick.serve`: the quick page, then
    the workbench) without its format check (for the browser tests and the first-paint
    benchmark while the CLI refuses formats other than torch.save files).
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ckptlab.widgets.app")
    parser.add_argument("path")
    parser.add_argument("--port", type=int, default=5006)
    parser.add_argument("--address", default="127.0.0.1")
    args = parser.parse_args(argv)
    from ckptlab.widgets.quick import serve as serve_quick

    serve_quick(args.path, port=args.port, address=args.address)
    return 0


if __name__ == "__main__":
    # run as a script, this file is __main__: serve with the module's own classes, as a
    # server started by ``ckptlab serve`` does (one PlotlyLoader model, not two)
    from ckptlab.widgets.app import main as _main

    sys.exit(_main())
