"""CachedSavePlanner in real dcp.save runs: stock dcp.load reads what it saved, bit-exact,
and its cache goes miss -> hit -> delta per namespace."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptlab.errors import PlanError
from ckptlab.plan import PlanCache, inspect_dcp, run_ranks
from ckptlab.plan.planner import CachedSavePlanner
from ckptlab.testing import plan_workers

# dcp.load/save without a process group says it assumes a single process: that is the point
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("planner")
    events = run_ranks(plan_workers.cached_planner_saves, 2, str(root), timeout=180)[0]
    return root, events


def test_cache_events_per_namespace(saves):
    _, events = saves
    assert events == [("model", "miss"), ("optim", "miss"), ("model", "hit"),
                      ("model", "delta")]


def full():
    g = torch.Generator().manual_seed(1)
    return torch.randn(7, 5, generator=g), torch.randn(9, generator=g)


@pytest.mark.parametrize("name", ["s1", "s2", "s3"])
def test_stock_load_is_bit_exact(saves, name):
    root, _ = saves
    w, b = full()
    state = {"w": torch.zeros(7, 5), "b": torch.zeros(9), "plain": torch.zeros(4,
             dtype=torch.int64), "cfg": {"lr": 0.0, "name": ""}}
    if name == "s3":
        state["extra.rank1"] = torch.zeros(2)
    dcp.load(state, checkpoint_id=root / name)
    assert torch.equal(state["w"], w) and torch.equal(state["b"], b)
    assert torch.equal(state["plain"], torch.arange(4))
    assert state["cfg"] == {"lr": 0.5, "name": "t"}
    if name == "s3":
        assert torch.equal(state["extra.rank1"], torch.ones(2))


def test_same_metadata_as_default_planner(saves, tmp_path):
    root, _ = saves
    layout = inspect_dcp(root / "s2")
    chunks = sorted((i.fqn, i.chunk_offsets, i.chunk_sizes) for i in layout.items)
    assert chunks == sorted((i.fqn, i.chunk_offsets, i.chunk_sizes)
                            for i in inspect_dcp(root / "s1").items)
    assert {i.fqn for i in layout.items} >= {"w", "b", "plain", "cfg.lr", "cfg.name"}
    assert sum(1 for i in layout.items if i.fqn == "b") == 1  # the replica is written once


def test_single_process_and_unknown_state(tmp_path):
    cache = PlanCache()
    state = {"x": torch.arange(6.0).reshape(2, 3), "n": 1}
    for i in range(2):
        dcp.save(state, checkpoint_id=tmp_path / f"c{i}", planner=CachedSavePlanner(cache, "m"))
    assert [e.status for e in cache.events] == ["miss", "hit"]
    out = {"x": torch.zeros(2, 3), "n": 0}
    dcp.load(out, checkpoint_id=tmp_path / "c1")
    assert torch.equal(out["x"], state["x"]) and out["n"] == 1
    planner = CachedSavePlanner(PlanCache(), "m")
    with pytest.raises(PlanError, match="holds no earlier plan"):
        from torch.distributed.checkpoint.planner import SavePlan

        planner.finish_plan(SavePlan([], usable=False, planner_data="unchanged"))
