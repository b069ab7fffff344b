"""The plan views (shard map, reshard, bytes per rank, cache timeline), checked on their data:
every cell of a shard map against the chunks painted element by element, read amplification
on hand-checked cases, rank bytes against the GlobalPlan, one timeline mark per cache event."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptlab.errors import InvalidArgumentError
from ckptlab.plan import (
    Chunk,
    DcpItem,
    DcpLayout,
    PlanCache,
    PlannedTensor,
    WriteItem,
    global_plan,
    local_plan,
    read_items,
    shard_chunk,
    simulate_plans,
)
from ckptlab.viz import (
    cache_timeline_figure,
    rank_bytes_figure,
    rank_colors,
    reshard_figure,
    shard_map_figure,
)
from ckptlab.viz._style import plain_text
from ckptlab.viz.plan import STATUS_COLORS, chunk_boxes


@pytest.fixture(scope="module")
def tiny8():
    return global_plan(simulate_plans("tiny", 8))


@pytest.fixture(scope="module")
def tiny64_tp():
    return global_plan(simulate_plans("tiny", 64, sharding="fsdp+tp"))


def _cells(fig, trace: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row edges, column edges, z) of a heatmap trace; z NaN where no chunk is."""
    heat = fig.data[trace]
    z = np.array([[np.nan if v is None else v for v in row] for row in heat.z], dtype=float)
    return np.asarray(heat.y), np.asarray(heat.x), z


def _painted(size, chunks, ranks) -> np.ndarray:
    """The rank of every element, painted chunk by chunk, viewed as the 2-D grid."""
    grid = np.full(tuple(size) or (1,), np.nan)
    for c, r in zip(chunks, ranks):
        grid[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = r
    rows = 1 if len(size) <= 1 else size[0]
    return grid.reshape(rows, -1)


def _expanded(ys, xs, z) -> np.ndarray:
    """The heatmap's cells repeated to element resolution."""
    return np.repeat(np.repeat(z, np.diff(ys), axis=0), np.diff(xs), axis=1)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


# ---------------------------------------------------------------------------------------------
# shard map


def test_shard_map_cells_are_the_chunks_and_colours_follow_writers(tiny8) -> None:
    fqn = "model.embed_tokens.weight"
    entry = tiny8.tensors[fqn]
    fig = shard_map_figure(tiny8, fqn)
    meta = fig.layout.meta
    assert meta["kind"] == "shard_map" and meta["fqn"] == fqn
    assert meta["size"] == [1000, 64] and meta["dtype"] == "bfloat16"
    assert meta["grid"] == [1000, 64] and meta["exact"] and meta["overlap_cells"] == 0
    assert [(tuple(c["offsets"]), tuple(c["sizes"]), c["rank"]) for c in meta["chunks"]] == \
        [(c.offsets, c.sizes, r) for c, r in zip(entry.chunks, entry.writers)]
    assert [c["nbytes"] for c in meta["chunks"]] == [c.numel * 2 for c in entry.chunks]
    colors = rank_colors(8)
    assert [c["color"] for c in meta["chunks"]] == [colors[r] for r in entry.writers]
    assert len(set(colors)) == 8
    ys, xs, z = _cells(fig)
    assert z.shape == (8, 1)  # one cell per chunk: cut at chunk boundaries only
    assert _same(_expanded(ys, xs, z), _painted(entry.size, entry.chunks, entry.writers))
    # the colour scale gives each rank its colour: the step of rank r spans (r, r+1) / 8
    heat = fig.data[0]
    stops = {round(float(p), 6): c for p, c in heat.colorscale}
    for r in range(8):
        assert stops[round((r + 0.5) / 8 - 0.5 / 8, 6)] == colors[r]
    assert (heat.zmin, heat.zmax) == (-0.5, 7.5)
    # one outline per chunk (5 corners and a break)
    assert len(fig.data[1].x) == 6 * len(entry.chunks)
    for c, text in zip(entry.chunks, (t[0] for t in heat.text)):
        assert f"offsets {list(c.offsets)}" in text and f"sizes {list(c.sizes)}" in text


def test_shard_map_on_a_2d_mesh_is_a_grid_of_rank_boxes(tiny64_tp) -> None:
    fqn = "model.layers.0.self_attn.o_proj.weight"  # Shard(0) x Shard(1) over (8, 8)
    entry = tiny64_tp.tensors[fqn]
    fig = shard_map_figure(tiny64_tp, fqn)
    ys, xs, z = _cells(fig)
    assert z.shape == (8, 8) and fig.layout.meta["cells"] == [8, 8]
    assert _same(_expanded(ys, xs, z), _painted(entry.size, entry.chunks, entry.writers))
    assert sorted(fig.layout.meta["ranks"]) == list(range(64))
    # more ranks than the palette: a sampled scale, still one colour per rank
    assert len(set(rank_colors(64))) == 64
    assert fig.data[0].zmin == -0.5 and fig.data[0].zmax == 63.5
    # the stepped bar is labelled in ranks (every 4th of 64), not left as a bare gradient
    bar = fig.data[0].colorbar
    assert list(bar.tickvals) == list(range(0, 64, 4)) and bar.ticktext[1] == "4"


def test_shard_map_of_a_vector_is_a_strip(tiny8) -> None:
    entry = tiny8.tensors["model.norm.weight"]
    fig = shard_map_figure(tiny8, "model.norm.weight")
    ys, xs, z = _cells(fig)
    assert fig.layout.meta["grid"] == [1, 64] and list(ys) == [0, 1]
    assert _same(_expanded(ys, xs, z), _painted(entry.size, entry.chunks, entry.writers))
    assert [c["boxes"] for c in fig.layout.meta["chunks"]] == \
        [[[0, 1, c.offsets[0], c.offsets[0] + c.sizes[0]]] for c in entry.chunks]


def test_shard_map_of_a_scalar_and_of_replicas_after_dedup() -> None:
    # two ranks hold the same replicated vector and scalar: the plan keeps one writer each
    items = {r: [WriteItem("w", "shard", shard_chunk((7, 5), (2,), (r,), ["S0"]), (7, 5),
                           "float32"),
                 WriteItem("rep", "tensor", Chunk((0,), (6,)), (6,), "int64"),
                 WriteItem("step", "tensor", Chunk((), ()), (), "float32")]
             for r in range(2)}
    plan = global_plan([local_plan(r, items[r]) for r in range(2)])
    for fqn in ("rep", "step"):
        meta = shard_map_figure(plan, fqn).layout.meta
        (chunk,) = meta["chunks"]
        assert chunk["rank"] == plan.tensors[fqn].writers[0]
        assert chunk["color"] == rank_colors(2)[chunk["rank"]]
    assert shard_map_figure(plan, "step").layout.meta["grid"] == [1, 1]
    w = shard_map_figure(plan, "w").layout.meta
    assert [(c["offsets"], c["sizes"], c["rank"]) for c in w["chunks"]] == \
        [([0, 0], [4, 5], 0), ([4, 0], [3, 5], 1)]


def _layout(size, chunk_files) -> DcpLayout:
    """A DcpLayout built by hand: one tensor 'w' whose chunks live in the named files."""
    md = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                for c, _ in chunk_files])
    items = tuple(DcpItem("w", "tensor", c.offsets, c.sizes, i, f, 100 * i, c.numel * 4 + 900,
                          "float32", None, None) for i, (c, f) in enumerate(chunk_files))
    meta = Metadata(state_dict_metadata={"w": md})
    files = tuple(sorted({(f, 4096) for _, f in chunk_files}))
    return DcpLayout("/nowhere", meta, 123, files, items)


def test_shard_map_of_a_checkpoint_reads_ranks_from_file_names() -> None:
    chunks = [Chunk((0, 0), (3, 4)), Chunk((3, 0), (3, 4)), Chunk((6, 0), (2, 4))]
    layout = _layout((8, 4), list(zip(chunks, ("__2_0.distcp", "__0_0.distcp",
                                              "__1_0.distcp"))))
    meta = shard_map_figure(layout, "w").layout.meta
    assert meta["source"] == "DcpLayout"
    assert [(c["offsets"], c["rank"]) for c in meta["chunks"]] == \
        [([3, 0], 0), ([6, 0], 1), ([0, 0], 2)]  # in rank order
    assert meta["chunks"][2]["where"] == "rank 2 · __2_0.distcp @ 0"
    assert meta["chunks"][0]["nbytes"] == 48
    # files not named like DCP's: ranks by file order
    odd = _layout((8, 4), list(zip(chunks, ("b.bin", "a.bin", "c.bin"))))
    assert [c["rank"] for c in shard_map_figure(odd, "w").layout.meta["chunks"]] == [0, 1, 2]


@pytest.mark.parametrize("size,placements,mesh", [
    ((4, 6, 5), ["S1"], (2,)), ((4, 6, 5), ["S2"], (3,)), ((4, 6, 5), ["S0", "S2"], (2, 2)),
    ((3, 4, 5, 2), ["S2", "S1"], (2, 3)), ((5, 3, 2), ["S0"], (4,)),
])
def test_chunk_boxes_of_higher_dims_cover_exactly_the_chunk(size, placements, mesh) -> None:
    coords = list(np.ndindex(*mesh))
    chunks = [shard_chunk(size, mesh, c, placements) for c in coords]
    ranks = list(range(len(chunks)))
    painted = _painted(size, chunks, ranks)
    drawn = np.full(painted.shape, np.nan)
    for c, r in zip(chunks, ranks):
        boxes, exact = chunk_boxes(size, c)
        assert exact
        assert sum((b[1] - b[0]) * (b[3] - b[2]) for b in boxes) == c.numel
        for r0, r1, c0, c1 in boxes:
            drawn[r0:r1, c0:c1] = r
    assert _same(drawn, painted)
    entry = PlannedTensor("t", size, "float32", tuple(chunks), tuple(ranks))
    ys, xs, z = _cells(shard_map_figure(entry))
    assert _same(_expanded(ys, xs, z), painted)


def test_chunk_boxes_fall_back_to_the_bounding_box_beyond_the_run_limit() -> None:
    size = (2, 600, 4)
    chunk = shard_chunk(size, (2,), (0,), ["S2"])  # 600 runs of 2 columns
    boxes, exact = chunk_boxes(size, chunk)
    assert not exact and boxes == [(0, 2, 0, 599 * 4 + 2)]
    fig = shard_map_figure(PlannedTensor("t", size, "float32", (chunk,), (0,)))
    assert fig.layout.meta["exact"] is False
    assert chunk_boxes(size, Chunk((0, 0, 0), (2, 0, 4))) == ([], True)


def test_shard_map_refuses_unknown_tensors_and_sources(tiny8) -> None:
    with pytest.raises(InvalidArgumentError, match="no tensor 'nope'"):
        shard_map_figure(tiny8, "nope")
    with pytest.raises(InvalidArgumentError, match="GlobalPlan"):
        shard_map_figure({"w": 1}, "w")
    with pytest.raises(InvalidArgumentError):
        shard_map_figure(tiny8, None)


def test_names_are_escaped(hostile_name) -> None:
    plan = global_plan([local_plan(0, [WriteItem(hostile_name, "tensor", Chunk((0,), (3,)),
                                                 (3,), "float32")])])
    fig = shard_map_figure(plan, hostile_name)
    assert plain_text(hostile_name) in fig.layout.title.text
    assert "<script>" not in fig.layout.title.text and "<script>" not in fig.data[0].text[0][0]
    fig = reshard_figure(hostile_name, (3,), [Chunk((0,), (3,))], [Chunk((0,), (3,))])
    assert "<script>" not in fig.layout.title.text


# ---------------------------------------------------------------------------------------------
# reshard


def test_read_amplification_hand_checked_1d() -> None:
    saved = [Chunk((0,), (4,)), Chunk((4,), (4,))]
    wanted = [Chunk((0,), (3,)), Chunk((3,), (3,)), Chunk((6,), (2,))]
    fig = reshard_figure("v", (8,), saved, wanted, dtype="float32")
    meta = fig.layout.meta
    # w0 <- s0; w1 <- s0, s1; w2 <- s1: four read items, each loads a whole 16-byte item
    assert meta["read_items"] == 4
    assert meta["read_nbytes"] == 4 * 16 and meta["wanted_nbytes"] == 32
    assert meta["moved_nbytes"] == 32
    assert meta["amplification"] == 2.0
    assert meta["read_nbytes_by_wanted"] == [16, 32, 16]
    assert "read amplification 2.00x" in fig.layout.title.text
    assert "4 read items" in fig.layout.title.text
    # panels: saved, wanted, read items, each a heatmap + outline on its own axes
    heats = [t for t in fig.data if t.type == "heatmap"]
    assert [t.yaxis for t in heats] == ["y", "y2", "y3"]
    items_grid = _expanded(*_cells(fig, fig.data.index(heats[2])))
    assert items_grid.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]]  # coloured by the loading rank


def test_read_amplification_hand_checked_2d_and_identity() -> None:
    saved = [Chunk((0, 0), (2, 6)), Chunk((2, 0), (2, 6))]  # Shard(0) on 2 ranks
    wanted = [Chunk((0, 2 * k), (4, 2)) for k in range(3)]  # Shard(1) on 3 ranks
    meta = reshard_figure("m", (4, 6), saved, wanted, dtype="bfloat16").layout.meta
    # every wanted chunk touches both saved ones: 6 items x 12 elements x 2 bytes
    assert meta["read_items"] == 6
    assert (meta["read_nbytes"], meta["wanted_nbytes"]) == (6 * 12 * 2, 24 * 2)
    assert meta["amplification"] == 3.0
    same = reshard_figure("m", (4, 6), saved, saved).layout.meta
    assert same["amplification"] == 1.0 and same["read_items"] == 2


def test_reshard_figure_uses_the_given_items_and_ranks() -> None:
    saved = [Chunk((0,), (4,)), Chunk((4,), (4,))]
    wanted = [Chunk((0,), (8,))]
    items = read_items("v", saved, wanted)
    fig = reshard_figure("v", (8,), saved, wanted, items[:1], saved_ranks=[5, 3],
                         wanted_ranks=[7])
    meta = fig.layout.meta
    assert meta["read_items"] == 1 and meta["amplification"] == 0.5
    assert [c["rank"] for c in meta["saved"]] == [5, 3] and meta["wanted"][0]["rank"] == 7
    ys, xs, z = _cells(fig, 0)
    assert _expanded(ys, xs, z).tolist() == [[5] * 4 + [3] * 4]
    with pytest.raises(InvalidArgumentError):
        reshard_figure("v", (8,), saved, wanted, saved_ranks=[0])
    with pytest.raises(InvalidArgumentError):
        reshard_figure("v", (8,), saved, wanted, [items[0].__class__("v", 3, (0,), 0, (0,),
                                                                     (1,))])


def test_reshard_of_a_simulated_weight_matches_read_items(tiny8) -> None:
    fqn = "model.layers.0.mlp.up_proj.weight"
    entry = tiny8.tensors[fqn]
    wanted = [shard_chunk(entry.size, (3,), (r,), ["S1"]) for r in range(3)]
    items = read_items(fqn, entry.chunks, wanted)
    meta = reshard_figure(fqn, entry.size, entry.chunks, wanted, dtype=entry.dtype,
                          saved_ranks=entry.writers).layout.meta
    assert meta["read_items"] == len(items) == 8 * 3
    assert meta["amplification"] == pytest.approx(
        sum(entry.chunks[i.storage_index].numel for i in items) / math.prod(entry.size))
    assert meta["amplification"] == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------------
# rank bytes


@pytest.mark.parametrize("world_size,sharding", [(8, "fsdp"), (64, "fsdp+tp"), (2048, "fsdp")])
def test_rank_bytes_sum_to_the_plan(world_size, sharding) -> None:
    plan = global_plan(simulate_plans("tiny", world_size, sharding=sharding))
    fig = rank_bytes_figure(plan)
    meta = fig.layout.meta
    bars = fig.data[0]
    assert list(bars.y) == list(plan.rank_nbytes) == meta["rank_nbytes"]
    assert list(bars.x) == list(range(world_size))
    assert sum(bars.y) == meta["nbytes"] == plan.nbytes
    assert meta["mean_nbytes"] == pytest.approx(plan.nbytes / world_size)
    assert meta["imbalance"] == plan.imbalance
    assert meta["imbalance"] == pytest.approx(max(plan.rank_nbytes) / meta["mean_nbytes"])
    assert f"imbalance {plan.imbalance:.3f}" in fig.layout.title.text
    top = meta["max_rank"]
    assert plan.rank_nbytes[top] == max(plan.rank_nbytes) == meta["max_nbytes"]
    assert bars.marker.color[top] == "#e45756"
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == pytest.approx(meta["mean_nbytes"])
    assert meta["objects"] == 1


def test_rank_bytes_refuses_other_objects() -> None:
    with pytest.raises(InvalidArgumentError):
        rank_bytes_figure([1, 2, 3])


# ---------------------------------------------------------------------------------------------
# cache timeline


def test_cache_timeline_has_one_mark_per_event() -> None:
    cache = PlanCache()
    model, optim = simulate_plans("tiny", 8, optimizer=False), simulate_plans("tiny", 8)
    cache.plan("model", model)  # miss
    cache.plan("optim", optim)  # miss
    cache.plan("model", model)  # hit
    changed = list(model)
    changed[3] = local_plan(3, [*model[3].items, WriteItem("extra", "bytes")])
    cache.plan("model", changed)  # delta: rank 3
    cache.plan("optim", optim)  # hit: the other namespace was not evicted
    events = cache.events
    assert [e.status for e in events] == ["miss", "miss", "hit", "delta", "hit"]
    fig = cache_timeline_figure(events)
    meta = fig.layout.meta
    bars = [t for t in fig.data if t.type == "bar"]
    marks = [t for t in fig.data if t.type == "scatter"]
    assert sum(len(t.x) for t in bars) == sum(len(t.x) for t in marks) == len(events)
    assert meta["counts"] == {"miss": 2, "delta": 1, "hit": 2}
    assert meta["namespaces"] == ["model", "optim"]
    assert [(r["namespace"], r["status"], r["changed_ranks"]) for r in meta["events"]] == \
        [("model", "miss", 8), ("optim", "miss", 8), ("model", "hit", 0), ("model", "delta", 1),
         ("optim", "hit", 0)]
    t0 = events[0].started_s
    for bar in bars:
        status = bar.name
        assert bar.marker.color == STATUS_COLORS[status]
        mine = [e for e in events if e.status == status]
        assert list(bar.y) == [e.namespace for e in mine]
        assert list(bar.base) == pytest.approx([1e3 * (e.started_s - t0) for e in mine])
        assert list(bar.x) == pytest.approx([1e3 * e.duration_s for e in mine])
    assert "5 lookups" in fig.layout.title.text


def test_cache_timeline_of_no_events() -> None:
    fig = cache_timeline_figure([])
    assert len(fig.data) == 0 and fig.layout.meta["events"] == []
    with pytest.raises(InvalidArgumentError):
        cache_timeline_figure(["hit"])
