"""Rank functions for the write-item tests (module level: spawn imports them)."""

from __future__ import annotations


def write_items_vs_torch(rank: int, world_size: int) -> tuple[list, list]:
    """ckptlab's write items and torch's local save plan for DTensors on a 2-D mesh, a
    ShardedTensor, plain tensors and objects; both as plain tuples."""
    import torch

    from ckptlab._torch_compat import chunk_sharding_spec, shard_tensor
    from ckptlab._torch_compat import flatten_state_dict as _flatten
    flatten_state_dict = _flatten()
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptlab.plan.items import write_items
    from ckptlab.plan.torch_plans import from_torch_plan

    mesh = init_device_mesh("cpu", (2, world_size // 2))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(9, 7, generator=g)
    spec = chunk_sharding_spec()(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])
    state = {
        "a": distribute_tensor(full, mesh, [Shard(0), Shard(1)]),
        "b": distribute_tensor(full.to(torch.bfloat16), mesh, [Replicate(), Shard(0)]),
        "c": distribute_tensor(full[:3, 0].clone(), mesh, [Shard(0), Shard(0)]),
        "st": shard_tensor()(torch.arange(21, dtype=torch.int64).reshape(7, 3), spec),
        "plain": torch.ones(2, 2),
        "nested": {"lr": 0.1, "t": torch.zeros(3, dtype=torch.int32)},
        "step": 3,
    }
    mine = write_items(state)
    flat, _ = flatten_state_dict(state)
    theirs = from_torch_plan(create_default_local_save_plan(flat, rank == 0), rank).items
    as_rows = lambda items: [(i.fqn, i.kind, i.chunk and (i.chunk.offsets, i.chunk.sizes),  # noqa: E731
                              i.size, i.dtype) for i in items]
    return as_rows(mine), as_rows(theirs)


def cached_planner_saves(rank: int, world_size: int, root: str) -> list[tuple[str, str]]:
    """Four dcp.saves with one CachedSavePlanner cache per process: a first save (miss),
    the same state again (hit), rank 1 adds an entry (delta), and an optimizer namespace in
    between that must not evict the model's entry. Returns rank 0's cache events."""
    import os

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptlab.plan import PlanCache
    from ckptlab.plan.planner import CachedSavePlanner

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(7, 5, generator=g), torch.randn(9, generator=g)
    state = {"w": distribute_tensor(w, mesh, [Shard(0)]),
             "b": distribute_tensor(b, mesh, [Replicate()]),
             "plain": torch.arange(4), "cfg": {"lr": 0.5, "name": "t"}}
    optim = {"m": distribute_tensor(w * 2, mesh, [Shard(1)]), "step": 3}
    cache = PlanCache()
    dcp.save(state, checkpoint_id=os.path.join(root, "s1"),
             planner=CachedSavePlanner(cache, "model"))
    dcp.save(optim, checkpoint_id=os.path.join(root, "o1"),
             planner=CachedSavePlanner(cache, "optim"))
    dcp.save(state, checkpoint_id=os.path.join(root, "s2"),
             planner=CachedSavePlanner(cache, "model"))
    if rank == 1:
        state = {**state, "extra.rank1": torch.ones(2)}
    dcp.save(state, checkpoint_id=os.path.join(root, "s3"),
             planner=CachedSavePlanner(cache, "model"))
    return [(e.namespace, e.status) for e in cache.events] if rank == 0 else []
