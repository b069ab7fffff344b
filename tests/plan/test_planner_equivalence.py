"""CachedSavePlanner writes the same ``.metadata`` as torch's DefaultSavePlanner, save after
save, however the state dict changes between saves (issue 11: a dtype-only change kept the old
dtype in the metadata, and ``dcp_to_torch_save`` gave wrong values).

One :class:`PlanCache` is reused over a random sequence of state dicts in one process, so the
sequence goes through the cache's miss, hit (same structure, or back to an earlier one) and
delta (some items changed) paths; after every save the unpickled metadata is compared field
by field with the default planner's, and the checkpoint is read back bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cache import statuses
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckptlab.plan import PlanBook, PlanCache, WriteItem, local_plan
from ckptlab.plan.planner import CachedSavePlanner
from ckptlab.plan.reshard import Chunk
from ckptlab.testing.strategies import GRAD_DTYPES, chunk_grids, make_tensor, shapes

# dcp.load/save without a process group says it assumes a single process: that is the point
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# gloo broadcasts complex tensors (DTensor's distribute_tensor) on torch 2.13; 2.7 refuses
# with "Invalid scalar type"
GLOO_COMPLEX = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) > (2, 7)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int8,
          torch.uint8, torch.bool, torch.complex64)
# the state-dict keys a sequence draws from: top-level ones and nested ones, which DCP
# flattens ("opt.m") and records in the metadata's planner_data
KEYS = (("w",), ("b",), ("emb.weight",), ("opt", "m"), ("opt", "step"), ("cfg", "name"),
        ("cfg", "lrs"))


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor to build afresh for each save (its bytes fixed by dtype, shape and seed): a
    plain tensor or, on a 1-rank process group, a ShardedTensor whose local shards are
    ``boxes`` (in that order) or a DTensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    seed: int
    requires_grad: bool = False
    layout: str = "plain"  # "plain", "sharded" or "dtensor"
    boxes: tuple[Chunk, ...] = ()  # a ShardedTensor's local shards

    def full(self) -> torch.Tensor:
        t = make_tensor(self.dtype, self.shape, self.seed)
        return t.requires_grad_(True) if self.requires_grad else t

    def build(self) -> Any:
        full = self.full()
        if self.layout == "dtensor":
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            return distribute_tensor(full, _mesh(), [Shard(0) if full.dim() else Replicate()])
        if self.layout == "sharded":
            from torch.distributed._shard.sharded_tensor import Shard as LocalShard
            from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardMetadata

            shards = [LocalShard(full.detach()[tuple(slice(o, o + n) for o, n in
                                                      zip(c.offsets, c.sizes))].clone()
                                 .requires_grad_(self.requires_grad),
                                 ShardMetadata(list(c.offsets), list(c.sizes), "rank:0/cpu"))
                      for c in self.boxes]
            return ShardedTensor._init_from_local_shards(shards, *self.shape)
        return full


@functools.cache
def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


Spec = dict[tuple[str, ...], Any]  # key path -> TensorSpec or a plain object


def objects() -> st.SearchStrategy[Any]:
    """Non-tensor values: DCP pickles them as bytes items."""
    return st.one_of(st.integers(-5, 10**6), st.text(max_size=6),
                     st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3)), max_size=4),
                     st.floats(allow_nan=False, allow_infinity=False))


@st.composite
def boxes(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[Chunk, ...]:
    """A random grid chunking of ``shape``, its chunks in a random order."""
    return tuple(draw(st.permutations(draw(chunk_grids(shape, max_cuts=2)))))


def dtypes_for(layout: str) -> list[torch.dtype]:
    return [d for d in DTYPES if layout != "dtensor" or GLOO_COMPLEX or not d.is_complex]


@st.composite
def tensor_specs(draw: st.DrawFn, dtype: torch.dtype | None = None,
                 layouts: tuple[str, ...] = ("plain",)) -> TensorSpec:
    layout = draw(st.sampled_from(layouts))
    dtype = draw(st.sampled_from(dtypes_for(layout))) if dtype is None else dtype
    shape = draw(shapes(max_rank=3, max_numel=48, max_side=6)  # ShardedTensors: no empty side
                 .filter(lambda s: layout != "sharded" or (s and 0 not in s)))
    grad = dtype in GRAD_DTYPES and draw(st.booleans())
    chunks = draw(boxes(shape)) if layout == "sharded" else ()
    return TensorSpec(dtype, shape, draw(st.integers(0, 250)), grad, layout, chunks)


def entries(layouts: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """A state-dict value: mostly tensors, sometimes an object."""
    return st.sampled_from(["tensor", "tensor", "tensor", "object"]).flatmap(
        lambda kind: tensor_specs(layouts=layouts) if kind == "tensor" else objects())


def build(spec: Spec, full: bool = False) -> dict[str, Any]:
    """A fresh nested state dict for ``spec`` (with ``full``, every tensor plain)."""
    out: dict[str, Any] = {}
    for path, value in spec.items():
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        if isinstance(value, TensorSpec):
            value = value.full() if full else value.build()
        d[path[-1]] = value
    return out


@st.composite
def edit(draw: st.DrawFn, spec: Spec, history: list[Spec], layouts: tuple[str, ...]) -> Spec:
    """``spec`` after 1-3 edits: a tensor's dtype, shape, requires_grad or chunking; a key
    added, replaced (maybe by another kind) or removed; an object's value; or no change, or
    back to an earlier state dict of the sequence (cache hits)."""
    how = draw(st.sampled_from(["edit", "edit", "edit", "edit", "same", "back"]))
    if how == "same":
        return dict(spec)
    if how == "back":
        return dict(draw(st.sampled_from(history)))
    new = dict(spec)
    for _ in range(draw(st.integers(1, 3))):
        tensors = [k for k, v in new.items() if isinstance(v, TensorSpec)]
        objs = [k for k, v in new.items() if not isinstance(v, TensorSpec)]
        sharded = [k for k in tensors if new[k].layout == "sharded"]
        ops = ["put", "put"] + (["drop"] if new else []) + (["obj"] if objs else []) + \
            (["dtype", "dtype", "shape", "grad"] if tensors else []) + \
            (["chunks", "chunks"] if sharded else [])
        op = draw(st.sampled_from(ops))
        if op == "put":  # add a key, or replace one (maybe tensor <-> bytes)
            new[draw(st.sampled_from(KEYS))] = draw(entries(layouts))
        elif op == "drop":
            del new[draw(st.sampled_from(sorted(new)))]
        elif op == "obj":
            new[draw(st.sampled_from(objs))] = draw(objects())
        elif op == "chunks":  # same tensor, other local shards (or the same in another order)
            key = draw(st.sampled_from(sharded))
            new[key] = dataclasses.replace(new[key], boxes=draw(boxes(new[key].shape)))
        else:
            key = draw(st.sampled_from(tensors))
            t = new[key]
            if op == "dtype":  # same shape, same chunks: only the dtype changes
                dtype = draw(st.sampled_from([d for d in dtypes_for(t.layout) if d != t.dtype]))
                new[key] = dataclasses.replace(t, dtype=dtype, requires_grad=t.requires_grad
                                               and dtype in GRAD_DTYPES)
            elif op == "shape":
                new[key] = draw(tensor_specs(dtype=t.dtype, layouts=(t.layout,)))
            elif t.dtype in GRAD_DTYPES:  # requires_grad goes into TensorProperties
                new[key] = dataclasses.replace(t, requires_grad=not t.requires_grad)
    return new


def read_metadata(path: Path) -> Any:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def normalised(md: Any) -> Any:
    """``md`` without what legitimately differs between two saves of one state dict:
    ``storage_meta.checkpoint_id`` (each save has its own directory) and
    ``storage_meta.save_id`` (a fresh uuid per save). Everything else is compared:
    state_dict_metadata (entries in order, each tensor's properties, size and chunks in
    order), planner_data, storage_data and version. (storage_data's MetadataIndex keys carry
    an index hint that torch's planner rewrites and ckptlab's does not; MetadataIndex
    equality ignores it, as every lookup does.)"""
    meta = md.storage_meta and dataclasses.replace(md.storage_meta, checkpoint_id=None,
                                                   save_id=None)
    return dataclasses.replace(md, storage_meta=meta)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), where
    assert torch.equal(raw(got), raw(want)), where


def assert_same_metadata(cached: Any, default: Any) -> None:
    a, b = normalised(cached), normalised(default)
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    for fqn, want in b.state_dict_metadata.items():
        assert a.state_dict_metadata[fqn] == want, fqn  # properties, size, chunks in order
    assert a.planner_data == b.planner_data
    assert a.storage_data == b.storage_data
    # torch 2.7's Metadata has no version field
    assert (a.storage_meta, getattr(a, "version", None)) == \
        (b.storage_meta, getattr(b, "version", None))
    assert a == b


def assert_reads_back(spec: Spec, directory: Path) -> None:
    """dcp.load into a fresh state dict of plain tensors, and dcp_to_torch_save (which builds
    every tensor from the metadata's dtype and size), both give the saved bytes in the saved
    dtypes."""
    want = build(spec, full=True)
    fresh: dict[str, Any] = {}
    for path, value in spec.items():
        d = fresh
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = (torch.zeros(value.shape, dtype=value.dtype)
                       if isinstance(value, TensorSpec) else None)
    dcp.load(fresh, checkpoint_id=directory)
    pt = directory.with_suffix(".pt")
    dcp_to_torch_save(directory, pt)
    converted = torch.load(pt, weights_only=False)
    for path, value in spec.items():
        name = ".".join(path)
        got_load, got_pt, w = fresh, converted, want
        for k in path:
            got_load, got_pt, w = got_load[k], got_pt[k], w[k]
        if isinstance(value, TensorSpec):
            assert_same_tensor(got_load, w, f"dcp.load {name}")
            assert_same_tensor(got_pt, w, f"dcp_to_torch_save {name}")
        else:
            assert got_load == w and got_pt == w, name


def save_and_compare(spec: Spec, cache: PlanCache, root: Path, i: int) -> None:
    """Save ``spec`` with the cached planner and the default one; compare; read back."""
    cached, default = root / f"cached{i}", root / f"default{i}"
    returned = dcp.save(build(spec), checkpoint_id=cached,
                        planner=CachedSavePlanner(cache, "model"))
    dcp.save(build(spec), checkpoint_id=default, planner=DefaultSavePlanner())
    on_disk = read_metadata(cached)
    assert_same_metadata(on_disk, read_metadata(default))
    assert normalised(returned) == normalised(on_disk)
    assert_reads_back(spec, cached)


def run_sequence(data: st.DataObject, root: Path, layouts: tuple[str, ...]) -> None:
    """Draw 2-6 state dicts, each an edit of the one before; save and compare each."""
    spec: Spec = data.draw(st.dictionaries(st.sampled_from(KEYS), entries(layouts),
                                           max_size=5), label="first")
    history = [spec]
    for _ in range(data.draw(st.integers(1, 5), label="more saves")):
        history.append(data.draw(edit(history[-1], history, layouts), label="next"))
    cache = PlanCache()
    with tempfile.TemporaryDirectory(dir=root) as d:
        for i, s in enumerate(history):
            save_and_compare(s, cache, Path(d), i)
    assert statuses(cache)[0] == "miss" and len(cache.events) == len(history)


@given(st.data())
def test_cached_planner_metadata_equals_default_planner(tmp_path_factory, data):
    """Plain tensors and objects, no process group."""
    run_sequence(data, tmp_path_factory.getbasetemp(), ("plain",))


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group for ShardedTensors and DTensors, torn down after the test
    (the other tests here save with no process group at all)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    _mesh.cache_clear()
    dist.destroy_process_group()


@settings(max_examples=max(5, settings().max_examples // 2))
@given(st.data())
def test_cached_planner_metadata_equals_default_planner_sharded(one_rank_group,
                                                                tmp_path_factory, data):
    """The same on a 1-rank gloo group, with ShardedTensors of several local shards (their
    chunking and chunk order change between saves) and DTensors beside plain tensors."""
    run_sequence(data, tmp_path_factory.getbasetemp(), ("plain", "sharded", "dtensor"))


@pytest.mark.parametrize("new_dtype", [torch.float64, torch.bfloat16])
def test_dtype_only_change_reaches_metadata(tmp_path, new_dtype):
    """The reported case: float32, then the same tensor in float64 or bfloat16."""
    cache = PlanCache()
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 3
    first = dcp.save({"x": x, "n": 1}, checkpoint_id=tmp_path / "a",
                     planner=CachedSavePlanner(cache, "m"))
    dcp.save({"x": x.to(new_dtype), "n": 1}, checkpoint_id=tmp_path / "b",
             planner=CachedSavePlanner(cache, "m"))
    assert statuses(cache) == ["miss", "delta"]
    md = read_metadata(tmp_path / "b")
    assert md.state_dict_metadata["x"].properties.dtype == new_dtype
    dcp_to_torch_save(tmp_path / "b", tmp_path / "b.pt")
    out = torch.load(tmp_path / "b.pt", weights_only=False)
    assert out["x"].dtype == new_dtype and out["n"] == 1
    assert_same_tensor(out["x"], x.to(new_dtype), "x")
    # the first save's Metadata is its own: the second save did not rewrite it
    assert first.state_dict_metadata["x"].properties.dtype == torch.float32
    assert normalised(first) == normalised(read_metadata(tmp_path / "a"))
    # and back to float32: a hit on the first entry, with the first metadata
    dcp.save({"x": x, "n": 1}, checkpoint_id=tmp_path / "c", planner=CachedSavePlanner(cache, "m"))
    assert statuses(cache)[-1] == "hit"
    assert read_metadata(tmp_path / "c").state_dict_metadata["x"].properties.dtype == \
        torch.float32


def test_requires_grad_only_change_reaches_metadata(tmp_path):
    """requires_grad is pickled in the metadata's TensorProperties: a change is a new plan."""
    cache = PlanCache()
    w = torch.ones(2, 3)
    for i, grad in enumerate([False, True, False]):
        state = {"w": torch.nn.Parameter(w.clone(), requires_grad=grad)}
        dcp.save(state, checkpoint_id=tmp_path / f"c{i}", planner=CachedSavePlanner(cache, "m"))
        dcp.save(state, checkpoint_id=tmp_path / f"d{i}", planner=DefaultSavePlanner())
        assert read_metadata(tmp_path / f"c{i}").state_dict_metadata["w"].properties \
            .requires_grad is grad
        assert_same_metadata(read_metadata(tmp_path / f"c{i}"),
                             read_metadata(tmp_path / f"d{i}"))
    assert statuses(cache) == ["miss", "delta", "hit"]


def _tensor_info(result: Any) -> Mapping[str, tuple]:
    return {f: (e.size, e.dtype, e.chunks, e.writers) for f, e in result.tensors.items()}


@pytest.mark.parametrize("steps", [
    # two ranks; rank 1's shard [2, 4) stays put while the dtype changes, then while the
    # tensor grows to 6 (a gap: invalid) and shrinks back
    [("float32", 4, 2), ("float64", 4, 2), ("bfloat16", 4, 2), ("bfloat16", 6, 2),
     ("float32", 4, 2)],
    # one rank: a scalar becomes a vector, then a longer one, then a scalar again
    [("float32", 0, 1), ("float32", 3, 1), ("int64", 5, 1), ("float32", 0, 1)],
])
def test_plan_book_update_rereads_shape_and_dtype(steps):
    """PlanBook.update gives what planning from scratch gives when a tensor's dtype or global
    shape changes while its chunks stay put (the root cause of issue 11: the tensor's size and
    dtype were re-read only when a chunk moved) or change their number of dimensions."""
    def plans(dtype: str, n: int, world: int) -> list:
        if world == 1:
            size = (n,) if n else ()
            return [local_plan(0, [WriteItem("t", "tensor", Chunk((0,) * len(size), size),
                                             size, dtype)])]
        return [local_plan(r, [WriteItem("t", "shard", Chunk((2 * r,), (2,)), (n,), dtype)])
                for r in range(world)]

    book = PlanBook(plans(*steps[0]))
    for step in steps[1:]:
        new = plans(*step)
        book.update(new)
        fresh = PlanBook(new).result
        assert _tensor_info(book.result) == _tensor_info(fresh)
        assert book.result.tensors["t"].dtype == step[0]
        assert [(p.fqn, p.kind) for p in book.result.problems] == \
            [(p.fqn, p.kind) for p in fresh.problems]
        assert bool(fresh.problems) == (step[1] == 6)
