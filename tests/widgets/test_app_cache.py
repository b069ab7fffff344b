"""What the served app's sessions share (``LayoutCache``) and what they give back (``close``).

The load itself (20 sessions through the real server, RSS before and after) is
tests/browser/test_app_load.py; these check the parts without a server.
"""

from __future__ import annotations

import gc
import weakref

import panel as pn
import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint._cache import InspectionCache
from ckptlab.errors import InvalidArgumentError
from ckptlab.widgets import _layout_app, _served
from ckptlab.widgets import app as app_module
from ckptlab.widgets.app import LayoutApp, LayoutCache, LayoutView

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Widget.name is deprecated:PendingDeprecationWarning"),
]


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """Counts of the app's calls to realign and alignment_costs."""
    calls = {"realign": 0, "alignment_costs": 0}
    for name in calls:
        real = getattr(_layout_app, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(_layout_app, name, wrapper)
    return calls


def test_sessions_share_one_view_per_file_and_alignment(sample_file, counted):
    cache = LayoutCache()
    a = LayoutApp(sample_file, cache=cache)  # each app inspects the file itself
    b = LayoutApp(str(sample_file), cache=cache)
    assert a.original is not b.original and a.original == b.original
    assert a.bytemap is b.bytemap and cache.misses == 1 and cache.hits == 1
    assert a.costs is b.costs and counted["alignment_costs"] == 1
    a.alignment.value = 4096
    b.alignment.value = 4096
    assert counted["realign"] == 1
    assert a.current is b.current and a.bytemap is b.bytemap
    assert a.current.segments == cl.format.realign(a.original, 4096).segments
    assert a.map_pane.object is not b.map_pane.object  # figures are each session's own
    assert a.map_pane.object.layout.title.text == b.map_pane.object.layout.title.text
    assert a.summary.object == b.summary.object
    # back at the file's own alignment each session shows its own layout object
    a.alignment.value = 64
    b.alignment.value = 64
    assert a.current is a.original and b.current is b.original
    assert a.bytemap is b.bytemap
    assert counted["realign"] == 1 and (cache.misses, len(cache)) == (2, 2)


def test_a_view_is_frozen_data(sample_layout):
    view = LayoutCache().view(sample_layout, 4096)
    assert isinstance(view, LayoutView) and view.alignment == 4096
    assert view.layout.storage_alignment == 4096 and view.bytemap.layout is view.layout
    assert view.title.startswith("what-if: sample.pt at alignment 4096 · ")
    own = LayoutCache().view(sample_layout, 64)
    assert own.layout is sample_layout and own.title is None
    with pytest.raises(AttributeError):
        view.title = "changed"


def test_the_cache_is_bounded(sample_layout, counted):
    cache = LayoutCache(max_views=2)
    for alignment in (128, 256, 512):
        cache.view(sample_layout, alignment)
    assert len(cache) == 2 and counted["realign"] == 3
    cache.view(sample_layout, 512)  # still held
    cache.view(sample_layout, 256)
    assert counted["realign"] == 3
    cache.view(sample_layout, 128)  # the least recently used went first
    assert counted["realign"] == 4 and len(cache) == 2
    cache.clear()
    assert len(cache) == 0
    for bad in (0, -1, 1.5, None):
        with pytest.raises(InvalidArgumentError, match="max_views"):
            LayoutCache(max_views=bad)
    with pytest.raises(InvalidArgumentError, match="max_costs"):
        LayoutCache(max_costs=0)


def test_the_cache_keeps_no_session(sample_file):
    cache = LayoutCache()
    app = LayoutApp(sample_file, cache=cache)
    app.alignment.value = 4096
    app.select(3)
    ref = weakref.ref(app)
    del app
    gc.collect()
    assert ref() is None and len(cache) == 2  # the views outlive the session


def test_a_rewritten_file_is_another_file(tmp_path, counted):
    path = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(4)}, path)
    first = cl.inspect(path)
    cache = LayoutCache()
    cache.view(first, 4096)
    torch.save({"w": torch.zeros(4), "b": torch.ones(8)}, path)
    second = cl.inspect(path)
    assert len(cache.view(second, 4096).layout.storages) == 2
    assert counted["realign"] == 2 and cache.misses == 2


def test_layouts_without_a_file_are_keyed_by_object(small_obj):
    cache = LayoutCache()
    one = cl.predict_layout(small_obj, alignment=64)
    two = cl.predict_layout(small_obj, alignment=64)
    assert cache.view(one, 128) is cache.view(one, 128)
    assert cache.view(two, 128) is not cache.view(one, 128)
    assert cache.misses == 2


def test_close_stops_the_session(sample_file):
    app = LayoutApp(sample_file)
    figure = app.map_pane.object
    app.close()
    app.alignment.value = 4096  # nobody listens any more
    app.items.value = 2
    assert app.map_pane.object is figure and app.current is None and app.view is None
    app.close()  # twice is harmless


def test_serve_shares_one_cache_and_ends_sessions(monkeypatch, sample_file, tmp_path):
    calls = {}
    monkeypatch.setattr(pn, "extension", lambda *args, **kwargs: None)
    monkeypatch.setattr(pn, "serve", lambda routes, **kwargs: calls.update(routes=routes,
                                                                           **kwargs))
    cache = LayoutCache()
    served = app_module.ServedCheckpoint(
        sample_file, layout_cache=cache,
        inspection_cache=InspectionCache(tmp_path / "cache"))
    app_module.serve(served, port=5124)
    assert calls["warm"] is True  # panel builds one session before it serves
    assert calls["check_unused_sessions_milliseconds"] == app_module.SESSION_CHECK_MS
    assert calls["unused_session_lifetime_milliseconds"] == app_module.SESSION_LIFETIME_MS
    assert calls["threaded"] is False
    assert served.ready.is_set()  # a small checkpoint is opened in full before serving
    assert cache.misses == 1 and len(cache) == 1  # the file's own view, before any session
    first, second = calls["routes"]["/"](), calls["routes"]["/"]()
    assert first is not second and (cache.misses, cache.hits) == (1, 2)  # shared, not redone
    assert first.objects[1].object == second.objects[1].object  # the shared summary


def test_a_large_checkpoint_paints_its_table_before_it_is_opened(monkeypatch, sample_file,
                                                                 tmp_path):
    """Past EAGER_TENSORS the server serves from the cached index at once; the full open
    follows on a thread (here: the fallback timer, as no page loads)."""
    calls = {}
    monkeypatch.setattr(pn, "extension", lambda *args, **kwargs: None)
    monkeypatch.setattr(pn, "serve", lambda routes, **kwargs: calls.update(routes=routes))
    monkeypatch.setattr(_served, "EAGER_TENSORS", 10)
    monkeypatch.setattr(_served, "LOAD_FALLBACK_S", 0.2)
    cache = InspectionCache(tmp_path / "cache")
    app_module.ServedCheckpoint(sample_file, inspection_cache=cache)  # stores the index
    served = app_module.ServedCheckpoint(sample_file, inspection_cache=cache)
    assert served.from_cache and served.checkpoint is None
    app_module.serve(served, port=5125)
    view = calls["routes"]["/"]()  # a session before the open: table and summary only
    section = next(o for o in view.objects if "ckptlab-map-section" in o.css_classes)
    assert "Reading the byte layout" in section.objects[0].object
    assert served.ready.wait(60) and served.error is None
    assert served.checkpoint is not None and len(served.layout_cache) == 1


def test_a_checkpoint_rewritten_after_its_cached_index_is_not_mapped(tmp_path) -> None:
    """The table comes from the cached index; the byte maps from the file opened later. If the
    file was rewritten in between, the maps would show other bytes than the table: the load
    says so instead (review finding)."""
    import torch

    from ckptlab.checkpoint._cache import InspectionCache

    path = tmp_path / "latest.pt"
    torch.save({"a": torch.zeros(4), "b": torch.ones(2)}, path)
    cache = InspectionCache(tmp_path / "cache")
    app_module.ServedCheckpoint(path, inspection_cache=cache)  # stores the index
    served = app_module.ServedCheckpoint(path, inspection_cache=cache)
    assert served.from_cache and served.checkpoint is None
    torch.save({"a": torch.zeros(40), "c": torch.ones(2)}, path)  # the next save lands
    served.load()
    assert served.ready.is_set() and served.checkpoint is None
    assert "changed since its index was read" in served.error and "names differ" in served.error
    fresh = app_module.ServedCheckpoint(path, inspection_cache=cache)  # a new server: fine
    fresh.load()
    assert fresh.error is None and list(fresh.index.names) == ["a", "c"]
