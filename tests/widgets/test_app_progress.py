"""``ckptlab serve`` opens its port before the index is made: :class:`PendingCheckpoint`
makes the :class:`ServedCheckpoint` on a thread, pages show :class:`IndexProgress` until it is
there. And the tensor table's column widths. (The page itself, in chromium:
tests/browser/test_browser_app.py.)
"""

from __future__ import annotations

import threading

import pandas as pd
import panel as pn
import pytest

from ckptlab.viz._style import human_nbytes
from ckptlab.widgets import app as app_module
from ckptlab.widgets._tensor_table import COLUMN_WIDTHS, FILE_WIDTH, column_widths, tensor_frame

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Widget.name is deprecated:PendingDeprecationWarning"),
]


@pytest.fixture
def gate(monkeypatch) -> threading.Event:
    """ServedCheckpoint waits for this event before it makes anything."""
    event = threading.Event()
    made = app_module.ServedCheckpoint.__init__

    def gated(self, *args, **kwargs):
        assert event.wait(60)
        made(self, *args, **kwargs)

    monkeypatch.setattr(app_module.ServedCheckpoint, "__init__", gated)
    return event


def _serve(monkeypatch, source, tmp_path, **kwargs) -> dict:
    calls: dict = {}
    monkeypatch.setattr(pn, "extension", lambda *args, **kw: calls.update(extensions=args))
    monkeypatch.setattr(pn, "serve", lambda routes, **kw: calls.update(routes=routes))
    app_module.serve(source, port=5126, inspection_cache=app_module.InspectionCache(
        tmp_path / "cache"), **kwargs)
    return calls


def test_the_port_opens_while_the_index_is_made(monkeypatch, sample_file, tmp_path, gate):
    monkeypatch.setattr(app_module, "INDEX_WAIT_S", 0.05)
    made: list[app_module.IndexProgress] = []

    class Recorded(app_module.IndexProgress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(app_module, "IndexProgress", Recorded)
    calls = _serve(monkeypatch, sample_file, tmp_path)
    assert "routes" in calls  # served although no index is there
    assert calls["extensions"] == ("tabulator",)  # the pages go out without plotly.js
    view = calls["routes"]["/"]()
    assert "ckptlab-loading-app" in view.css_classes
    text = view.objects[1].object
    assert "Reading the tensors of sample.pt" in text
    assert f"({human_nbytes(sample_file.stat().st_size)})" in text
    (progress,) = made
    assert progress.poll() is False and progress.app is None  # not yet
    gate.set()
    assert progress.pending.wait(60) and progress.pending.error is None
    served = progress.pending.served
    assert served.ready.is_set()  # small: opened in full before `done`
    assert progress.poll() is True and progress.app is not None
    assert view.objects == [progress.app.view]  # the same page now shows the app
    assert progress.app.tensors.table.value is served.frame
    # a page opened now gets the app at once, over the same checkpoint
    again = calls["routes"]["/"]()
    assert "ckptlab-app" in again.css_classes and again.objects[1].object == served.summary_html
    progress.close()
    assert progress.view is None and progress.app.view is None
    assert progress.poll() is True  # closed: nothing more to do


def test_an_index_that_fails_is_shown_on_every_page(monkeypatch, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04 not a zip at all")
    monkeypatch.setattr(app_module, "INDEX_WAIT_S", 0.0)
    calls = _serve(monkeypatch, bad, tmp_path)
    sessions = calls["routes"]["/"].__self__
    assert sessions.pending.wait(60) and sessions.pending.served is None
    assert sessions.pending.error
    view = calls["routes"]["/"]()
    assert "could not be read" in view.objects[1].object
    progress = app_module.IndexProgress(sessions.pending)
    assert progress.poll() is True and progress.app is None
    assert "could not be read" in progress.status.object


def test_a_cached_index_is_served_as_before(monkeypatch, sample_file, tmp_path):
    """Within INDEX_WAIT_S the checkpoint is there: no progress state, panel's warm-up
    session builds the whole app before the port opens."""
    app_module.ServedCheckpoint(sample_file, inspection_cache=app_module.InspectionCache(
        tmp_path / "cache"))  # stores the index
    calls = _serve(monkeypatch, sample_file, tmp_path)
    sessions = calls["routes"]["/"].__self__
    assert sessions.pending is None and sessions.served is not None
    assert sessions.served.from_cache
    view = calls["routes"]["/"]()
    assert "ckptlab-app" in view.css_classes


def test_column_widths_fit_the_headers_and_the_file_names():
    frame = pd.DataFrame({"file": pd.Categorical(["a.pt", "a.pt"])})
    widths = column_widths(frame)
    assert set(widths) == set(COLUMN_WIDTHS) | {"file"} and "name" not in widths
    lo, hi = FILE_WIDTH
    assert widths["file"] == lo  # a short name: the narrowest
    long = pd.DataFrame({"file": pd.Categorical(["model-00001-of-00002.safetensors"])})
    assert lo < column_widths(long)["file"] <= hi
    huge = pd.DataFrame({"file": pd.Categorical(["x" * 500])})
    assert column_widths(huge)["file"] == hi
    # every header's text, at about 8 px a character and 34 px of padding and sort arrow
    for name, px in COLUMN_WIDTHS.items():
        assert len(name) * 8 + 34 <= px, name


def test_the_table_uses_the_widths_and_cuts_values_with_an_ellipsis(sample_file):
    import ckptlab as cl
    from ckptlab.checkpoint._cache import CheckpointIndex
    from ckptlab.widgets._tensor_table import TensorTable

    frame = tensor_frame(CheckpointIndex.from_checkpoint(cl.open(sample_file)))
    table = TensorTable(frame).table
    assert table.widths == column_widths(frame)
    assert table._get_configuration([])["columnDefaults"] == {"tooltip": True}  # panel 1.x
    css = " ".join(map(str, table.stylesheets))
    assert "text-overflow:ellipsis" in css and "white-space:nowrap" in css


def test_the_tables_row_mapping_follows_the_filter_lazily():
    """LazyRowsTabulator maps a position in the shown rows to its frame label as panel's dict
    did (a click's row), without building a dict over every row."""
    from ckptlab.widgets._tensor_table import TensorTable

    frame = pd.DataFrame({c: [0] * 6 for c in ("dtype", "shape", "kind", "bytes",
                                                "parameters", "file", "offset")})
    frame.insert(0, "name", [f"layer.{i}.{'w' if i % 2 else 'b'}" for i in range(6)])
    frame["file"] = pd.Categorical(["m.pt"] * 6)
    table = TensorTable(frame)
    mapping = table.table._index_mapping
    assert not isinstance(mapping, dict) and len(mapping) == 6
    assert [mapping.get(i) for i in range(6)] == list(range(6))
    table.find(".w")  # rows 1, 3, 5
    mapping = table.table._index_mapping
    assert len(mapping) == 3 and [mapping[i] for i in range(3)] == [1, 3, 5]
    assert mapping.get(3, "none") == "none" and mapping.get(-1, "none") == "none"
    assert mapping.get("0", "none") == "none" and list(mapping) == [0, 1, 2]
