"""Real checkpoints from real ranks (issue 4, item 1): dcp.save / dcp.load on 1 to 4 gloo CPU
processes with DTensors on 1-D and 2-D meshes (uneven and empty shards, replicated dims),
plain tensors, a ShardedTensor and non-tensor objects; resharded loads onto other world sizes
and placements, compared bit for bit; and ckptlab's read items checked against the load."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptlab.plan import Chunk, inspect_dcp, read_items, run_ranks, validate_chunks
from ckptlab.testing import dcp_workers as W

# every test here uses module fixtures that spawn 2-4 ranks per save or load (each
# 14-30 s on 2 cores)
pytestmark = pytest.mark.slow

# placements per tensor: "S<d>" = Shard(d), "R" = Replicate(); tensors not named stay plain
SAVE_1D = ((2,), {"w": ("S0",), "e": ("S0",), "i": ("S0",), "v": ("S0",), "r": ("R",),
                  "z": ("S0",)})
SAVE_2D = ((2, 2), {"w": ("S0", "S1"), "e": ("R", "S0"), "i": ("S0", "S0"), "v": ("S0", "S0"),
                    "r": ("R", "R"), "z": ("S0", "S0")})
LOAD_1D_ON_3 = ((3,), {"w": ("S1",), "e": ("S1",), "i": ("S1",), "v": ("S0",), "r": ("S0",),
                       "z": ("S0",)})
LOAD_1D_ON_2X2 = ((2, 2), {"w": ("S1", "S1"), "e": ("S0", "S1"), "i": ("R", "S0"),
                           "v": ("S0", "R"), "r": ("S0", "S0"), "z": ("R", "S0")})
LOAD_2D_ON_2 = ((2,), {"w": ("S1",), "e": ("S0",), "i": ("S1",), "v": ("S0",), "r": ("R",),
                       "z": ("S0",)})
ST_OBJECTS = {"step": 5, "meta": {"kind": "st"}}
TIMEOUT = 180


def _flat_objects(objects: dict[str, Any]) -> dict[str, Any]:
    """DCP's flattened names of the non-tensor objects ("config.lr"); lists stay whole."""
    out = {}
    for k, v in objects.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _flat_objects(v).items()})
        else:
            out[k] = v
    return out


def _tensor(raw: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    dtype, shape, data = raw
    dt = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape)


def _slice(full: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            and a.view(-1).view(torch.uint8).numpy().tobytes()
            == b.view(-1).view(torch.uint8).numpy().tobytes())


@dataclass
class Saved:
    """A checkpoint real ranks wrote, with what each rank reported of its own chunks."""

    path: Path
    full: dict[str, torch.Tensor]
    objects: dict[str, Any]
    reported: list[dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]  # by rank
    plain: tuple[str, ...]  # plain tensors (every rank holds the whole tensor)


@dataclass
class Loaded:
    """One load of a checkpoint: per rank, each tensor's chunk and loaded values, the
    non-tensor objects it got back and the tensor read items torch's planner used."""

    saved: Saved
    tensors: list[dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]]
    objects: list[dict[str, Any]]
    torch_items: list[list[tuple[Any, ...]]]
    name: str = ""


def _loaded(saved: Saved, results: list[dict[str, Any]]) -> Loaded:
    return Loaded(saved, [{k: (o, s, _tensor(raw)) for k, (o, s, raw) in r["tensors"].items()}
                          for r in results],
                  [r["objects"] for r in results], [r["read_items"] for r in results])


# --- the runs: 4 spawns in all (2, 4, 3 and 2 processes), each checkpoint written once ---

@pytest.fixture(scope="module")
def one_d(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    path = tmp_path_factory.mktemp("real1d") / "ckpt"
    reported = run_ranks(W.save_dtensors, 2, str(path), *SAVE_1D, timeout=TIMEOUT)
    return Saved(path, W.real_state(), W.OBJECTS, reported, ("plain",))


@pytest.fixture(scope="module")
def four_ranks(one_d: Saved, tmp_path_factory: pytest.TempPathFactory) -> tuple[Saved, Loaded]:
    """4 ranks, mesh (2, 2): save the 2-D checkpoint, then load the 1-D one onto 2-D
    placements."""
    path = tmp_path_factory.mktemp("real2d") / "ckpt"
    out = run_ranks(W.run_jobs, 4, [(W.save_dtensors, (str(path), *SAVE_2D)),
                                    (W.load_dtensors, (str(one_d.path), *LOAD_1D_ON_2X2))],
                    timeout=TIMEOUT)
    saved = Saved(path, W.real_state(), W.OBJECTS, [r[0] for r in out], ("plain",))
    return saved, _loaded(one_d, [r[1] for r in out])


@pytest.fixture(scope="module")
def two_d(four_ranks) -> Saved:
    return four_ranks[0]


@pytest.fixture(scope="module")
def two_ranks(two_d: Saved, tmp_path_factory: pytest.TempPathFactory) -> tuple[Loaded, Any]:
    """2 ranks: load the 2-D checkpoint on a 1-D mesh; the ShardedTensor save and loads."""
    st_path = tmp_path_factory.mktemp("realst") / "ckpt"
    out = run_ranks(W.run_jobs, 2, [(W.load_dtensors, (str(two_d.path), *LOAD_2D_ON_2)),
                                    (W.sharded_tensor_run, (str(st_path),))], timeout=TIMEOUT)
    st = [r[1] for r in out]
    reported = []
    for r in st:
        assert len(r["saved"]) == 1  # one local shard per rank
        (o, s, _), = r["saved"]
        reported.append({"st": (o, s)})
    return _loaded(two_d, [r[0] for r in out]), (
        Saved(st_path, {"st": W.sharded_tensor_full()}, ST_OBJECTS, reported, ()), st)


@pytest.fixture(scope="module")
def st_saved(two_ranks) -> Saved:
    return two_ranks[1][0]


def _st_loaded(two_ranks, name: str) -> Loaded:
    saved, results = two_ranks[1]
    tensors, objects, items = [], [], []
    for r in results:
        (o, s, raw), = r[name]["chunks"]
        tensors.append({"st": (o, s, _tensor(raw))})
        if "objects" in r[name]:  # the DTensor load asked for the tensor alone
            step, meta = r[name]["objects"]
            objects.append({"step": step, "meta": meta})
        items.append(r[name]["read_items"])
    return Loaded(saved, tensors, objects, items)


def _blank(v: Any) -> Any:
    """The same structure with zero values: what a load has to overwrite."""
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_blank(x) for x in v]
    return type(v)()


def _load_one_process(saved: Saved) -> Loaded:
    """dcp.load in this process, no process group, into plain full-size tensors."""
    state: dict[str, Any] = {k: torch.zeros_like(v) for k, v in saved.full.items()}
    state.update({k: _blank(v) for k, v in saved.objects.items()})
    planner = W._recording_planner()
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
        warnings.filterwarnings("ignore", message=".*load in a single process")
        dcp.load(state, checkpoint_id=str(saved.path), planner=planner)
    tensors = {k: ((0,) * v.ndim, tuple(v.shape), state[k]) for k, v in saved.full.items()}
    return Loaded(saved, [tensors], [{k: state[k] for k in saved.objects}],
                  [W._torch_read_items(planner.final)])


LOADS = {
    "1d_on_3_ranks_shard1": lambda r: _loaded(
        r.getfixturevalue("one_d"),
        run_ranks(W.load_dtensors, 3, str(r.getfixturevalue("one_d").path), *LOAD_1D_ON_3,
                  timeout=TIMEOUT)),
    "1d_on_4_ranks_2d_mesh": lambda r: r.getfixturevalue("four_ranks")[1],
    "2d_on_2_ranks": lambda r: r.getfixturevalue("two_ranks")[0],
    "2d_on_1_process": lambda r: _load_one_process(r.getfixturevalue("two_d")),
    "st_on_2_ranks_same_spec": lambda r: _st_loaded(r.getfixturevalue("two_ranks"), "same"),
    "st_on_2_ranks_dim1_spec": lambda r: _st_loaded(r.getfixturevalue("two_ranks"), "dim1"),
    "st_on_2_ranks_as_dtensor": lambda r: _st_loaded(r.getfixturevalue("two_ranks"), "dtensor"),
    "st_on_1_process": lambda r: _load_one_process(r.getfixturevalue("st_saved")),
}
_load_cache: dict[str, Loaded] = {}


@pytest.fixture(scope="module", params=sorted(LOADS))
def loaded(request: pytest.FixtureRequest) -> Loaded:
    if request.param not in _load_cache:
        _load_cache[request.param] = LOADS[request.param](request)
        _load_cache[request.param].name = request.param
    return _load_cache[request.param]


# --- what was saved ---

def _saved_chunks(saved: Saved) -> dict[str, list[tuple[Chunk, torch.Tensor]]]:
    """fqn -> its saved chunks in inspect_dcp's item order, each with the tensor read from the
    item's own bytes (file, offset, nbytes) by torch.load(weights_only=True)."""
    layout = inspect_dcp(saved.path)
    out: dict[str, list[tuple[Chunk, torch.Tensor]]] = {}
    for item in layout.items:
        if item.kind == "tensor":
            with open(saved.path / item.file, "rb") as f:
                f.seek(item.offset)
                blob = f.read(item.nbytes)
            t = torch.load(io.BytesIO(blob), weights_only=True)
            out.setdefault(item.fqn, []).append(
                (Chunk(item.chunk_offsets, item.chunk_sizes), t))
    return out


@pytest.fixture(scope="module", params=["one_d", "two_d", "st_saved"])
def saved(request: pytest.FixtureRequest) -> Saved:
    return request.getfixturevalue(request.param)


def test_saved_chunks_tile_and_are_the_ranks_chunks(saved: Saved) -> None:
    layout = inspect_dcp(saved.path)
    md = layout.metadata.state_dict_metadata
    chunks = _saved_chunks(saved)
    assert set(chunks) == set(saved.full)
    for fqn, full in saved.full.items():
        stored = [c for c, _ in chunks[fqn]]
        assert validate_chunks(fqn, full.shape, stored) == [], fqn
        assert tuple(md[fqn].size) == tuple(full.shape) and md[fqn].properties.dtype == full.dtype
        assert sorted((c.offsets, c.sizes) for c in stored) == sorted(
            (tuple(c.offsets), tuple(c.sizes)) for c in md[fqn].chunks)
        if fqn in saved.plain:  # every rank held it, one copy was written
            assert [(c.offsets, c.sizes) for c in stored] == [((0,) * full.ndim, full.shape)]
            continue
        reported = [r[fqn] for r in saved.reported]
        # each chunk the ranks hold is stored exactly once: replicated copies are deduped
        assert len(stored) == len(set(reported))
        assert {(c.offsets, c.sizes) for c in stored} == set(reported), fqn


def test_replicated_dims_are_stored_once(one_d: Saved, two_d: Saved) -> None:
    counts = {fqn: n for fqn, (_, _, n) in inspect_dcp(two_d.path).tensors.items()}
    # 4 ranks each; [R, S0]: 2 chunks, [R, R]: 1, the plain tensor: 1; [S0, S0] of 3 rows:
    # 2 + 1 rows, then 1 + 1 and 1 + 0 - four chunks, one of them empty
    assert counts == {"w": 4, "e": 2, "i": 4, "v": 4, "r": 1, "plain": 1, "z": 4}
    z = sorted(r["z"] for r in two_d.reported)
    assert z == [((0,), (1,)), ((1,), (1,)), ((2,), (1,)), ((3,), (0,))]
    assert sorted(r["i"] for r in two_d.reported) == [  # 9 rows: 5 + 4, then 3 + 2 and 2 + 2
        ((0, 0), (3, 6)), ((3, 0), (2, 6)), ((5, 0), (2, 6)), ((7, 0), (2, 6))]
    assert sorted(r["w"] for r in two_d.reported) == [  # 7 x 5: rows 4 + 3, columns 3 + 2
        ((0, 0), (4, 3)), ((0, 3), (4, 2)), ((4, 0), (3, 3)), ((4, 3), (3, 2))]
    counts = {fqn: n for fqn, (_, _, n) in inspect_dcp(one_d.path).tensors.items()}
    assert counts == {"w": 2, "e": 2, "i": 2, "v": 2, "r": 1, "plain": 1, "z": 2}


def test_saved_items_hold_the_exact_slices_and_objects(saved: Saved) -> None:
    for fqn, pairs in _saved_chunks(saved).items():
        for chunk, t in pairs:
            assert _bit_equal(t, _slice(saved.full[fqn], chunk.offsets, chunk.sizes)), fqn
    layout = inspect_dcp(saved.path)
    for item in layout.items:  # and the raw bytes at the item's data_offset are the slice's
        if item.kind == "tensor":
            want = _slice(saved.full[item.fqn], item.chunk_offsets, item.chunk_sizes)
            want = want.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            with open(saved.path / item.file, "rb") as f:
                f.seek(item.data_offset)
                assert f.read(len(want)) == want, item
    objects = {}
    for item in layout.items:
        if item.kind == "bytes":
            with open(saved.path / item.file, "rb") as f:
                f.seek(item.offset)
                assert item.fqn not in objects  # written once, not once per rank
                objects[item.fqn] = torch.load(io.BytesIO(f.read(item.nbytes)),
                                               weights_only=True)
    assert objects == _flat_objects(saved.objects)


# --- resharded loads ---

def test_load_is_bit_exact(loaded: Loaded) -> None:
    full = loaded.saved.full
    for rank, tensors in enumerate(loaded.tensors):
        assert set(tensors) == set(full)
        for fqn, (offsets, sizes, t) in tensors.items():
            assert tuple(t.shape) == tuple(sizes)
            assert _bit_equal(t, _slice(full[fqn], offsets, sizes)), (rank, fqn)
    for objects in loaded.objects:
        assert objects == loaded.saved.objects


def test_the_load_really_reshards(loaded: Loaded) -> None:
    """The wanted chunks, deduplicated, tile every tensor, and differ from the saved ones."""
    saved = _saved_chunks(loaded.saved)
    resharded = 0
    for fqn, full in loaded.saved.full.items():
        wanted = {(o, s) for t in loaded.tensors for o, s, _ in [t[fqn]]}
        assert validate_chunks(fqn, full.shape, [Chunk(o, s) for o, s in wanted]) == [], fqn
        resharded += wanted != {(c.offsets, c.sizes) for c, _ in saved[fqn]}
    assert resharded == 0 if loaded.name == "st_on_2_ranks_same_spec" else resharded > 0


def _our_items(loaded: Loaded, saved: dict[str, list[tuple[Chunk, torch.Tensor]]],
               rank: int, fqn: str):
    offsets, sizes, _ = loaded.tensors[rank][fqn]
    chunks = [c for c, _ in saved[fqn]]
    return Chunk(tuple(offsets), tuple(sizes)), chunks, read_items(
        fqn, chunks, [Chunk(tuple(offsets), tuple(sizes))])


def test_read_items_cover_and_rebuild_every_wanted_chunk(loaded: Loaded) -> None:
    saved = _saved_chunks(loaded.saved)
    for rank, tensors in enumerate(loaded.tensors):
        for fqn, (_, _, got) in tensors.items():
            want, _, items = _our_items(loaded, saved, rank, fqn)
            # (a) the items' destination boxes tile the wanted chunk: in bounds, no overlap,
            # volumes adding up to the chunk's
            assert all(r.dest_index == 0 for r in items)
            assert sum(r.numel for r in items) == want.numel
            assert validate_chunks(fqn, want.sizes, [Chunk(r.dest_offsets, r.lengths)
                                                     for r in items]) == [], (rank, fqn)
            # (b) copying by them from the saved chunks' bytes rebuilds it bit for bit
            src = saved[fqn]
            out = torch.full(want.sizes, 0x5A, dtype=got.dtype) if want.numel else \
                torch.empty(want.sizes, dtype=got.dtype)
            for r in items:
                piece = _slice(src[r.storage_index][1], r.storage_offsets, r.lengths)
                out[tuple(slice(o, o + n) for o, n in zip(r.dest_offsets, r.lengths))] = piece
            assert _bit_equal(out, got), (rank, fqn)
            assert _bit_equal(out, _slice(loaded.saved.full[fqn], want.offsets, want.sizes))


def test_read_items_are_the_ones_torch_used(loaded: Loaded) -> None:
    saved = _saved_chunks(loaded.saved)
    for rank, tensors in enumerate(loaded.tensors):
        ours = []
        for fqn in tensors:
            want, chunks, items = _our_items(loaded, saved, rank, fqn)
            ours += [(fqn, want.offsets, r.dest_offsets, chunks[r.storage_index].offsets,
                      r.storage_offsets, r.lengths) for r in items]
        assert loaded.torch_items[rank] and sorted(ours) == loaded.torch_items[rank], rank
