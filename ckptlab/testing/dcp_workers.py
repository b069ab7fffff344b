"""Rank functions for the DCP tests (module level: torch.multiprocessing spawn imports them
by module path, so they live in the package, not beside the tests)."""

from __future__ import annotations

from typing import Any


def full_state(seed: int = 0) -> dict[str, Any]:
    """The global tensors every rank shards: uneven row counts on purpose."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g),  # 7 rows over 2 ranks: 4 + 3
        "b": torch.randn(9, generator=g).to(torch.bfloat16),
        "replicated": torch.arange(6, dtype=torch.int64),
    }


def save_sharded(rank: int, world_size: int, path: str) -> list[tuple[str, list[int]]]:
    """dcp.save of DTensors sharded on dim 0 over a 1-D CPU mesh, plus non-tensor objects."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = full_state()
    state = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
        "replicated": distribute_tensor(full["replicated"], mesh, [Replicate()]),
        "step": 11,
        "config": {"lr": 0.5, "name": "tiny"},
    }
    dcp.save(state, checkpoint_id=path)
    return [(k, list(v.to_local().shape)) for k, v in state.items() if hasattr(v, "to_local")]


# --- real runs: DTensor on 1-D and 2-D meshes, ShardedTensor, resharded loads (test_real_runs) ---

# non-tensor objects every save holds and every load must get back
OBJECTS: dict[str, Any] = {"step": 11, "config": {"lr": 0.5, "name": "tiny", "betas": [0.9, 0.95]},
                           "tag": "run-7"}


def real_state() -> dict[str, Any]:
    """Deterministic global tensors: uneven shapes, float32, bfloat16 and large int64 values."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(7, 5, generator=g),
        "e": torch.randn(9, 6, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(2**62), 2**62, (9, 6), generator=g, dtype=torch.int64),
        "v": torch.randn(9, generator=g).to(torch.bfloat16),
        "r": torch.arange(6, dtype=torch.int64) * (2**40 + 3),
        "plain": torch.randn(3, 4, generator=g),  # a plain tensor on every rank
        "z": torch.arange(3, dtype=torch.float64) + 0.1,  # 3 rows over 4 ranks: one empty
    }


def _placements(spec: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


def _chunk_of(fqn: str, t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local sizes) of this rank's part of a DTensor, as torch computes them."""
    from ckptlab._torch_compat import local_shape_and_global_offset

    shape, offset = local_shape_and_global_offset()(t.shape, t.device_mesh, t.placements)
    assert tuple(t.to_local().shape) == tuple(shape), fqn
    return tuple(offset), tuple(shape)


def _raw(t: Any) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as (dtype, shape, bytes): sent back as bytes, never as a shared-memory tensor."""
    import torch

    t = t.detach().contiguous()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), \
        t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _dtensor_state(mesh_shape: tuple[int, ...], spec: dict[str, tuple[str, ...]],
                   fill: str) -> dict[str, Any]:
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    full = real_state()
    state: dict[str, Any] = {}
    for fqn, tensor in full.items():
        src = tensor if fill == "data" else torch.zeros_like(tensor)
        state[fqn] = src if fqn not in spec else \
            distribute_tensor(src, mesh, _placements(spec[fqn]))
    if fill == "data":
        state.update(copy.deepcopy(OBJECTS))
    else:
        state.update(step=0, config={"lr": 0.0, "name": "", "betas": [0.0, 0.0]}, tag="")
    return state


def save_dtensors(rank: int, world_size: int, path: str, mesh_shape: tuple[int, ...],
                  spec: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """dcp.save of ``real_state`` with the tensors in ``spec`` as DTensors on a CPU mesh
    (placements like ("S0", "R")); the rest stay plain tensors. Returns each DTensor's chunk
    on this rank (global offsets, local sizes) from compute_local_shape_and_global_offset."""
    import torch.distributed.checkpoint as dcp

    state = _dtensor_state(mesh_shape, spec, "data")
    dcp.save(state, checkpoint_id=path)
    return {fqn: _chunk_of(fqn, state[fqn]) for fqn in spec}


def _recording_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Recording(DefaultLoadPlanner):
        final: Any = None

        def finish_plan(self, new_plan: Any) -> Any:
            self.final = new_plan
            return super().finish_plan(new_plan)

    return Recording()


def _torch_read_items(plan: Any) -> list[tuple[Any, ...]]:
    """The tensor read items torch's planner used on this rank:
    (fqn, wanted chunk offsets, dest offsets, saved chunk offsets, storage offsets, lengths)."""
    from torch.distributed.checkpoint.planner import LoadItemType

    return sorted((r.dest_index.fqn, tuple(r.dest_index.offset), tuple(r.dest_offsets),
                   tuple(r.storage_index.offset), tuple(r.storage_offsets), tuple(r.lengths))
                  for r in plan.items if r.type == LoadItemType.TENSOR)


def load_dtensors(rank: int, world_size: int, path: str, mesh_shape: tuple[int, ...],
                  spec: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """dcp.load of the checkpoint at ``path`` into zeroed DTensors placed by ``spec`` on a new
    mesh (plain tensors for the rest). Returns, per tensor, its chunk on this rank and its
    loaded bytes; the loaded non-tensor objects; and the read items torch planned."""
    import torch.distributed.checkpoint as dcp

    state = _dtensor_state(mesh_shape, spec, "zeros")
    planner = _recording_planner()
    dcp.load(state, checkpoint_id=path, planner=planner)
    tensors = {}
    for fqn in real_state():
        t = state[fqn]
        if fqn in spec:
            tensors[fqn] = (*_chunk_of(fqn, t), _raw(t.to_local()))
        else:
            tensors[fqn] = ((0,) * t.ndim, tuple(t.shape), _raw(t))
    return {"tensors": tensors, "objects": {k: state[k] for k in OBJECTS},
            "read_items": _torch_read_items(planner.final)}


def sharded_tensor_full() -> Any:
    """The global tensor of the ShardedTensor runs: 7 rows over 2 ranks (4 + 3)."""
    import torch

    return torch.randn(7, 3, generator=torch.Generator().manual_seed(99))


def _st_spec(dim: int, world_size: int) -> Any:
    from ckptlab._torch_compat import chunk_sharding_spec

    return chunk_sharding_spec()(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world_size)])


def _st_chunk(st: Any) -> list[tuple[tuple[int, ...], tuple[int, ...], Any]]:
    return [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), _raw(s.tensor))
            for s in st.local_shards()]


def sharded_tensor_run(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """dcp.save of a ShardedTensor (ChunkShardingSpec on dim 0, uneven) plus objects; then, in
    the same group, dcp.load into a ShardedTensor sharded the same way, into one sharded on
    dim 1, and into a DTensor with Shard(1)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptlab._torch_compat import shard_tensor, sharded_zeros

    full = sharded_tensor_full()
    st = shard_tensor()(full.clone(), _st_spec(0, world_size))
    dcp.save({"st": st, "step": 5, "meta": {"kind": "st"}}, checkpoint_id=path)
    saved = _st_chunk(st)
    dist.barrier()
    out: dict[str, Any] = {"saved": saved}
    for name, dim in (("same", 0), ("dim1", 1)):
        target = sharded_zeros()(_st_spec(dim, world_size), *full.shape)
        objs = {"st": target, "step": 0, "meta": {"kind": ""}}
        planner = _recording_planner()
        dcp.load(objs, checkpoint_id=path, planner=planner)
        out[name] = {"chunks": _st_chunk(target), "objects": (objs["step"], objs["meta"]),
                     "read_items": _torch_read_items(planner.final)}
    mesh = init_device_mesh("cpu", (world_size,))
    dt = distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])
    planner = _recording_planner()
    dcp.load({"st": dt}, checkpoint_id=path, planner=planner)
    out["dtensor"] = {"chunks": [(*_chunk_of("st", dt), _raw(dt.to_local()))],
                      "read_items": _torch_read_items(planner.final)}
    return out


def run_jobs(rank: int, world_size: int, jobs: list[tuple[Any, tuple[Any, ...]]]) -> list[Any]:
    """Several rank functions, one after the other, in one process group (one spawn)."""
    import torch.distributed as dist

    out = []
    for fn, args in jobs:
        out.append(fn(rank, world_size, *args))
        dist.barrier()
    return out
