"""The claims of notebooks/05_distributed_planning.ipynb, checked through the same public API
the notebook uses (the notebook shows them; these tests keep them true).

A real save on 2 gloo ranks and a load on 3 (``ckptlab.plan.examples``, started with
``run_ranks``): local plans, the coordinator's dedup and validation, ``.metadata``'s three parts,
the resharded load and its read items; then, in this process: read amplification, Llama-3-8B
plans for 8 to 64 ranks, the plan cache's hit / delta / miss sequence, and the answers of the
notebook's "Try this" exercises.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import ckptlab as cl
from ckptlab.errors import PlanError
from ckptlab.plan import (
    Chunk,
    GlobalPlan,
    LocalPlan,
    PlanCache,
    WriteItem,
    examples,
    global_plan,
    local_plan,
    read_items,
    run_ranks,
    shard_chunk,
    simulate_plans,
    state_shapes,
)

FQN = "transformer.wte.weight"  # 37 rows: 19 + 18 on 2 ranks, 13 + 13 + 11 on 3
EMBEDDING_SIZE = (37, 12)
OBJECTS = ("step", "config.lr", "config.name", "tag")


# -- the real save (2 ranks) and the resharded load (3 ranks) ----------------------------------
@pytest.fixture(scope="module")
def saved(sample_sharded_save: tuple[Path, list[LocalPlan]]) -> tuple[Path, list[LocalPlan]]:
    return sample_sharded_save  # the 2-rank save (tests/plan/conftest.py)


@pytest.fixture(scope="module")
def loaded(saved) -> list[dict[str, Any]]:
    path, _ = saved
    return run_ranks(examples.load_resharded, 3, str(path), "S0", timeout=180)


def _item(plan: LocalPlan, fqn: str) -> WriteItem:
    return next(it for it in plan.items if it.fqn == fqn)


@pytest.mark.slow  # the saved fixture spawns 2 ranks
def test_local_plans_list_every_entry_with_each_ranks_box(saved) -> None:
    _, plans = saved
    assert [p.rank for p in plans] == [0, 1]
    assert [len(p.items) for p in plans] == [22, 22]
    wte = [_item(p, FQN) for p in plans]
    assert [(it.kind, it.chunk) for it in wte] == [("shard", Chunk((0, 0), (19, 12))),
                                                   ("shard", Chunk((19, 0), (18, 12)))]
    # the replica: both ranks claim the same whole box
    replica = [_item(p, examples.REPLICATED) for p in plans]
    assert replica[0].chunk == replica[1].chunk == Chunk((0,), (8,))
    assert [_item(p, "transformer.h.0.mlp.c_fc.bias").chunk for p in plans] == [
        Chunk((0,), (24,)), Chunk((24,), (24,))]
    for p in plans:
        assert {it.fqn for it in p.items if it.kind == "bytes"} == set(OBJECTS)


@pytest.mark.slow
def test_global_plan_writes_each_replica_once_and_validates(saved) -> None:
    _, plans = saved
    plan = global_plan(plans)
    assert plan.problems == ()
    assert plan.tensors[FQN].writers == (0, 1) and len(plan.tensors[FQN].chunks) == 2
    # the replica goes to rank 1, the lighter rank (one embedding row shorter; both ranks'
    # local plans count the replica)
    assert plans[1].nbytes < plans[0].nbytes
    assert plan.tensors[examples.REPLICATED].writers == (1,)
    # objects count as zero bytes here, and all go to rank 0
    assert dict(plan.objects) == dict.fromkeys(OBJECTS, 0)
    assert sum(plan.rank_nbytes) == plan.nbytes
    assert plan.imbalance == pytest.approx(max(plan.rank_nbytes) / (plan.nbytes / 2))
    assert 1.0 < plan.imbalance < 1.01


@pytest.mark.slow
def test_metadata_is_the_plan_on_disk(saved) -> None:
    path, plans = saved
    plan = global_plan(plans)
    layout = cl.inspect(path)
    assert [name for name, _ in layout.files] == ["__0_0.distcp", "__1_0.distcp"]
    md = layout.metadata
    assert type(md).__name__ == "Metadata" and len(md.state_dict_metadata) == 22
    wte = md.state_dict_metadata[FQN]
    assert tuple(wte.size) == EMBEDDING_SIZE and str(wte.properties.dtype) == "torch.float32"
    assert [Chunk(tuple(c.offsets), tuple(c.sizes)) for c in wte.chunks] == \
        list(plan.tensors[FQN].chunks)
    assert type(md.state_dict_metadata["step"]).__name__ == "BytesStorageMetadata"
    # storage_data: every item's file, offset and length, as cl.inspect lists the items
    where = {(index.fqn, None if index.offset is None else tuple(index.offset)):
             (info.relative_path, info.offset, info.length)
             for index, info in md.storage_data.items()}
    listed = {(i.fqn, i.chunk_offsets if i.kind == "tensor" else None): (i.file, i.offset, i.nbytes)
              for i in layout.items}
    assert where == listed
    # torch's planner (the real save) wrote the objects from rank 1's file
    assert {where[(fqn, None)][0] for fqn in OBJECTS} == {"__1_0.distcp"}
    assert md.planner_data["config.lr"] == ("config", "lr")


@pytest.mark.slow
def test_shard_map_on_disk_matches_the_plan(saved) -> None:
    pytest.importorskip("plotly", reason="the shard map is a figure: the 'widgets' extra")
    from ckptlab.viz import shard_map_figure

    path, plans = saved
    disk = shard_map_figure(cl.inspect(path), FQN).layout.meta["chunks"]
    planned = shard_map_figure(global_plan(plans), FQN).layout.meta["chunks"]
    assert [(c["offsets"], c["sizes"], c["rank"]) for c in disk] == \
        [(c["offsets"], c["sizes"], c["rank"]) for c in planned]


@pytest.mark.slow  # the loaded fixture spawns 3 ranks
def test_load_on_three_ranks_by_rows_is_bit_exact(loaded) -> None:
    assert [r["rank"] for r in loaded] == [0, 1, 2]
    assert [r["chunks"][FQN] for r in loaded] == [((0, 0), (13, 12)), ((13, 0), (13, 12)),
                                                   ((26, 0), (11, 12))]
    for result in loaded:
        assert all(result["exact"].values()) and len(result["exact"]) == 18
        assert result["objects"] == examples.SAMPLE_OBJECTS


@pytest.mark.slow
def test_read_items_are_torchs_and_rank_1_straddles(saved, loaded) -> None:
    pytest.importorskip("plotly", reason="the reshard view is a figure: the 'widgets' extra")
    from ckptlab.viz import reshard_figure

    _, plans = saved
    entry = global_plan(plans).tensors[FQN]
    saved_chunks = list(entry.chunks)
    wanted = [Chunk(*r["chunks"][FQN]) for r in loaded]
    items = read_items(FQN, saved_chunks, wanted)
    assert [(it.dest_index, it.storage_index) for it in items] == [(0, 0), (1, 0), (1, 1),
                                                                   (2, 1)]
    # global rows 13-18 into local row 0, rows 19-25 into local row 6
    assert [(saved_chunks[it.storage_index].offsets[0] + it.storage_offsets[0],
             it.lengths[0], it.dest_offsets[0]) for it in items if it.dest_index == 1] == \
        [(13, 6, 0), (19, 7, 6)]
    ours = sorted((FQN, saved_chunks[it.storage_index].offsets, it.storage_offsets,
                   it.dest_offsets, it.lengths) for it in items)
    assert ours == sorted(r for result in loaded for r in result["read_items"] if r[0] == FQN)
    meta = reshard_figure(FQN, entry.size, saved_chunks, wanted, items, dtype=entry.dtype,
                          saved_ranks=entry.writers).layout.meta
    assert (meta["read_items"], meta["read_nbytes"], meta["wanted_nbytes"]) == (4, 3552, 1776)
    assert meta["amplification"] == 2.0


@pytest.mark.slow
def test_a_rank_that_forgets_its_shard_is_refused(saved) -> None:
    """Try this, 3: rank 1 drops its embedding shard."""
    _, plans = saved
    forgot = local_plan(1, [it for it in plans[1].items if it.fqn != FQN])
    message = f"{FQN}: volume: chunks hold 228 elements, the tensor 444"
    with pytest.raises(PlanError, match=re.escape(message)):
        global_plan([plans[0], forgot])
    problems = global_plan([plans[0], forgot], validate=False).problems
    assert [(p.fqn, p.kind) for p in problems] == [(FQN, "volume")]


# -- read amplification without a load (the saved chunks are DTensor's boxes) -----------------
SAVED = [shard_chunk(EMBEDDING_SIZE, (2,), (r,), ["S0"]) for r in range(2)]


def _amplification(world_size: int, placement: str) -> dict[str, Any]:
    pytest.importorskip("plotly", reason="the reshard view is a figure: the 'widgets' extra")
    from ckptlab.viz import reshard_figure

    boxes = [shard_chunk(EMBEDDING_SIZE, (world_size,), (r,), [placement])
             for r in range(world_size)]
    return reshard_figure(FQN, EMBEDDING_SIZE, SAVED, boxes, dtype="float32").layout.meta


def test_saved_chunks_are_the_real_saves() -> None:
    assert SAVED == [Chunk((0, 0), (19, 12)), Chunk((19, 0), (18, 12))]


def test_columns_cost_more_than_rows_on_three_ranks() -> None:
    rows, columns = _amplification(3, "S0"), _amplification(3, "S1")
    assert (rows["read_items"], rows["amplification"]) == (4, 2.0)
    assert (columns["read_items"], columns["amplification"]) == (6, 3.0)


def test_try_this_four_ranks_by_rows() -> None:
    meta = _amplification(4, "S0")
    assert [it.dest_index for it in read_items(FQN, SAVED, [
        shard_chunk(EMBEDDING_SIZE, (4,), (r,), ["S0"]) for r in range(4)])] == [0, 1, 1, 2, 3]
    assert (meta["read_items"], meta["read_nbytes"], meta["wanted_nbytes"]) == (5, 4416, 1776)
    assert round(meta["amplification"], 2) == 2.49
    assert meta["read_nbytes_by_wanted"] == [912, 1776, 864, 864]


def test_try_this_replicated_on_three_ranks() -> None:
    meta = _amplification(3, "R")
    assert (meta["read_items"], meta["read_nbytes"], meta["wanted_nbytes"]) == (6, 5328, 5328)
    assert meta["amplification"] == 1.0


# -- Llama-3-8B, simulated ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_plans() -> dict[int, tuple[list[LocalPlan], GlobalPlan]]:
    out = {}
    for n in (8, 32, 64):
        local = simulate_plans("llama3-8b", n)
        out[n] = local, global_plan(local)
    return out


def test_llama3_8b_with_adam_is_1164_tensors_of_about_75_gib(llama_plans) -> None:
    tensors, objects = state_shapes("llama3-8b")
    assert len(tensors) == 1164 and objects == ["optim.param_groups"]
    _, plan = llama_plans[8]
    assert len(plan.tensors) == 1164 and round(plan.nbytes / 2**30) == 75


@pytest.mark.parametrize("n", [8, 32, 64])
def test_fsdp_plans_are_even_within_a_millionth(llama_plans, n: int) -> None:
    local, plan = llama_plans[n]
    assert sum(len(p.items) for p in local) == 1165 * n  # every tensor's shard, the object
    assert plan.world_size == n and plan.problems == ()
    assert 1.0 <= plan.imbalance < 1.000001


def test_rank_bytes_figure_of_64_ranks(llama_plans) -> None:
    pytest.importorskip("plotly", reason="a figure: the 'widgets' extra")
    from ckptlab.viz import rank_bytes_figure

    _, plan = llama_plans[64]
    meta = rank_bytes_figure(plan).layout.meta
    assert meta["world_size"] == 64 and meta["rank_nbytes"] == list(plan.rank_nbytes)
    assert meta["imbalance"] == plan.imbalance


def test_tensor_parallel_blocks_have_one_colour_per_rank() -> None:
    pytest.importorskip("plotly", reason="the shard map is a figure: the 'widgets' extra")
    from ckptlab.viz import shard_map_figure

    plan = global_plan(simulate_plans("llama3-8b", 64, sharding="fsdp+tp"))
    meta = shard_map_figure(plan, "model.layers.0.self_attn.o_proj.weight").layout.meta
    assert meta["cells"] == [8, 8] and len(meta["chunks"]) == 64
    assert sorted(c["rank"] for c in meta["chunks"]) == list(range(64))
    # a categorical scale: 64 ranks, 64 distinct colours
    assert len({c["color"] for c in meta["chunks"]}) == 64
    assert plan.imbalance < 1.0001


# -- the plan cache -----------------------------------------------------------------------------
def test_plan_cache_hits_deltas_and_misses(llama_plans) -> None:
    full, _ = llama_plans[64]
    model_plans = [local_plan(p.rank, [it for it in p.items if not it.fqn.startswith("optim.")])
                   for p in full]
    optim_plans = [local_plan(p.rank, [it for it in p.items if it.fqn.startswith("optim.")])
                   for p in full]
    cache = PlanCache()
    for _ in range(2):
        cache.plan("model", model_plans)
        cache.plan("optim", optim_plans)
    changed = list(model_plans)
    changed[3] = local_plan(3, [*model_plans[3].items, WriteItem("metrics.rank3", "bytes")])
    after = cache.plan("model", changed)
    cache.plan("optim", optim_plans)
    cache.plan("model", changed)
    assert [(e.namespace, e.status) for e in cache.events] == [
        ("model", "miss"), ("optim", "miss"), ("model", "hit"), ("optim", "hit"),
        ("model", "delta"), ("optim", "hit"), ("model", "hit")]
    assert [len(e.changed_ranks) for e in cache.events] == [64, 64, 0, 0, 1, 0, 0]
    assert cache.events[4].changed_ranks == (3,)
    assert after.objects["metrics.rank3"] == 3
    # Try this, 4: the first structure is still cached; a new world size is planned afresh
    first = cache.plan("model", model_plans)
    cache.plan("model", simulate_plans("llama3-8b", 32, optimizer=False))
    assert [(e.status, len(e.changed_ranks)) for e in cache.events[-2:]] == [("hit", 0),
                                                                             ("miss", 32)]
    assert "metrics.rank3" not in first.objects
