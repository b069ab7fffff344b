"""PlanCache: hits, deltas and misses per namespace, without class-name thrash."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckptlab.errors import InvalidArgumentError, PlanError
from ckptlab.plan import PlanCache, WriteItem, global_plan, local_plan, simulate_plans
from ckptlab.plan.reshard import Chunk
from ckptlab.plan.torch_plans import torch_plans


def statuses(cache: PlanCache) -> list[str]:
    return [e.status for e in cache.events]


def test_hit_delta_miss():
    plans = simulate_plans("tiny", 8)
    cache = PlanCache()
    first = cache.plan("model", plans)
    assert cache.plan("model", plans) is first
    assert cache.plan("model", [p.fingerprint for p in plans]) is first  # ranks sent only fps
    changed = list(plans)
    changed[5] = local_plan(5, (*plans[5].items, WriteItem("rng.5", "bytes")))
    second = cache.plan("model", [p if r == 5 else p.fingerprint for r, p in enumerate(changed)])
    assert second.objects["rng.5"] == 5
    assert statuses(cache) == ["miss", "hit", "hit", "delta"]
    assert cache.events[-1].changed_ranks == (5,)
    # the delta's result is what planning from scratch gives (same chunks, same objects)
    fresh = global_plan(changed)
    assert {f: set(e.chunks) for f, e in second.tensors.items()} == \
        {f: set(e.chunks) for f, e in fresh.tensors.items()}
    assert set(second.objects) == set(fresh.objects)
    # going back to the first structure is a hit: both entries are kept
    assert cache.plan("model", plans) is first
    assert statuses(cache)[-1] == "hit"
    assert cache.plan("model", simulate_plans("tiny", 4)) is not None
    assert statuses(cache)[-1] == "miss"  # another world size


def test_namespaces_do_not_evict_each_other():
    model = simulate_plans("tiny", 4, optimizer=False)
    optim = simulate_plans("tiny", 4)
    cache = PlanCache()
    for _ in range(3):
        cache.plan("model", model)
        cache.plan("optim", optim)
    assert statuses(cache) == ["miss", "miss", "hit", "hit", "hit", "hit"]


@pytest.mark.skipif(not hasattr(SavePlanner, "_cached_metadata"),
                    reason="this torch caches no metadata (SavePlanner._cached_metadata came "
                    "in 2.8): the thrash below is that cache's")
def test_torch_cache_thrashes_between_two_planners_of_one_class():
    """The fact the cache's design answers: torch keys its cache by the planner's class
    name, so a model planner and an optimizer planner of the same class share one slot."""
    model = torch_plans(simulate_plans("tiny", 4, optimizer=False))
    optim = torch_plans(simulate_plans("tiny", 4))
    for cache in (SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                  SavePlanner._cached_metadata):
        cache.pop("DefaultSavePlanner", None)
    unchanged = [SavePlan([], usable=False)] * 4
    planner = DefaultSavePlanner(flatten_state_dict=False, enable_plan_caching=True)
    planner.create_global_plan(model)
    planner.create_global_plan(optim)  # a "delta" that replaces the model's cached plans
    _, md = planner.create_global_plan(unchanged)  # the model's next save: unchanged ranks
    assert any("optim" in fqn for fqn in md.state_dict_metadata)  # got the optimizer's plan
    for cache in (SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                  SavePlanner._cached_metadata):
        cache.pop("DefaultSavePlanner", None)


def test_errors_and_limits():
    plans = simulate_plans("tiny", 2)
    cache = PlanCache(max_entries=1)
    with pytest.raises(PlanError, match="only a fingerprint"):
        cache.plan("model", [plans[0], plans[1].fingerprint])
    cache.plan("a", plans)
    cache.plan("b", plans)
    assert len(cache) == 1
    bad = [local_plan(0, [WriteItem("w", "shard", Chunk((0,), (3,)), (4,), "float32")]),
           local_plan(1, [WriteItem("w", "shard", Chunk((2,), (2,)), (4,), "float32")])]
    with pytest.raises(PlanError, match="w: overlap"):
        cache.plan("bad", bad)
    assert cache.plan("bad", bad, validate=False).problems
    with pytest.raises(PlanError, match="says its plan is unchanged"):
        cache.plan("a", [plans[0], "f" * 32])
    with pytest.raises(InvalidArgumentError):
        PlanCache(max_entries=0)
    cache.clear()
    assert len(cache) == 0 and cache.events


def test_metadata_bytes_cached_and_written_atomically(tmp_path):
    from ckptlab.errors import StorageIOError
    from ckptlab.plan import write_metadata

    cache = PlanCache()
    built = []
    build = lambda: built.append(1) or b"payload"  # noqa: E731
    assert cache.metadata("m", ["a", "b"], build) == b"payload"
    assert cache.metadata("m", ["a", "b"], build) == b"payload"
    assert cache.metadata("m", ["a", "c"], build) == b"payload"
    assert len(built) == 2
    assert [e.status for e in cache.events] == ["miss", "hit", "miss"]
    path = write_metadata(tmp_path, b"xyz")
    assert path.read_bytes() == b"xyz" and not (tmp_path / ".metadata.tmp").exists()
    with pytest.raises(InvalidArgumentError, match="must return bytes"):
        cache.metadata("m", ["z"], lambda: "text")
    with pytest.raises(StorageIOError, match="could not write the metadata"):
        write_metadata(tmp_path / "missing", b"xyz")


def test_cache_event_seconds_are_named_in_seconds() -> None:
    """``CacheEvent.duration_s`` / ``started_s`` (``*_s``: seconds); the old names warn."""
    import warnings

    from ckptlab.plan.cache import CacheEvent

    e = CacheEvent("ns", "hit", (), 2, 0.25, 10.0)
    assert (e.duration_s, e.started_s) == (0.25, 10.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (e.seconds, e.started) == (0.25, 10.0)
    assert [w.category for w in caught] == [DeprecationWarning] * 2
