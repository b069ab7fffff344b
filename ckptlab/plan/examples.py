"""Ready-made rank functions and chunk helpers for the notebooks and the tests.

The rank functions are module-level so that :func:`~ckptlab.plan.run_ranks` (which starts each
rank with ``spawn``) can import them in a fresh process:

- :func:`save_sample_sharded` saves :func:`sample_state` with ``dcp.save``, every tensor a
  ``Shard(0)`` DTensor (uneven rows), one tensor replicated, plus non-tensor objects;
- :func:`load_resharded` loads that checkpoint on another world size and placement and checks
  every rank's part bit for bit against :func:`sample_state`.

:func:`simulated_chunks` gives the chunks that :func:`~ckptlab.plan.simulate_plans` would give
one tensor, without simulating the whole model (what a reshard view needs for a target world
size).

Nothing here imports a UI library; torch is imported inside the functions.
"""

from __future__ import annotations

import copy
from typing import Any

from ckptlab.errors import InvalidArgumentError
from ckptlab.plan.items import LocalPlan, local_plan, shard_chunk, write_items
from ckptlab.plan.reshard import Chunk
from ckptlab.plan.simulate import CONFIGS, ModelConfig, state_shapes

__all__ = ["REPLICATED", "SAMPLE_OBJECTS", "load_resharded", "sample_state",
           "save_sample_sharded", "simulated_chunks"]

# the tensor saved (and loaded) as Replicate(): every rank holds it whole
REPLICATED = "transformer.position_ids"
# the non-tensor entries of the saved state dict (DCP pickles them; nested dicts are flattened)
SAMPLE_OBJECTS: dict[str, Any] = {"step": 7, "config": {"lr": 0.25, "name": "tiny-gpt"},
                                  "tag": "sample"}
_SAMPLE_SHAPE = {"n_layer": 1, "d_model": 12, "vocab": 37, "context": 8}


def sample_state(seed: int = 0) -> dict[str, Any]:
    """The global tensors the sample checkpoint holds: ckptlab's tiny GPT, shaped for uneven
    shards.

    A vocabulary of 37 rows splits 19 + 18 over two ranks and 13 + 13 + 11 over three; the
    state has float32, bfloat16, int64 and bool tensors. The tied LM head is left out (it is
    the embedding again).

    Parameters
    ----------
    seed
        Seed of the weights (:func:`ckptlab.samples.tiny_gpt`).

    Returns
    -------
    dict
        Name -> CPU tensor, equal on every call with the same seed.
    """
    from ckptlab.samples import tiny_gpt

    sd = tiny_gpt(seed=seed, **_SAMPLE_SHAPE)
    del sd["lm_head.weight"]
    return {name: t.clone() for name, t in sd.items()}


def _placement(name: str, ndim: int, spec: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if name == REPLICATED or spec == "R":
        return Replicate()
    if spec == "S1" and ndim >= 2:
        return Shard(1)
    return Shard(0)


def _dtensor(full: Any, mesh: Any, rank: int, placement: Any) -> Any:
    """This rank's part of ``full`` as a DTensor on a 1-D mesh, cut locally (the box is
    :func:`~ckptlab.plan.shard_chunk`'s, which is torch's): no collective per tensor, as
    ``distribute_tensor`` would need."""
    from torch.distributed.tensor import DTensor

    box = shard_chunk(full.shape, (mesh.size(),), (rank,), [placement])
    local = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].clone()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=full.shape,
                              stride=full.stride())


def _check_placement(placement: str) -> None:
    if placement not in ("S0", "S1", "R"):
        raise InvalidArgumentError(f"placement must be 'S0', 'S1' or 'R', got {placement!r}")


def save_sample_sharded(rank: int, world_size: int, path: str) -> LocalPlan:
    """Save :func:`sample_state` from ``world_size`` ranks with ``dcp.save`` (run it with
    :func:`~ckptlab.plan.run_ranks`).

    Every tensor is a DTensor with ``Shard(0)`` on a 1-D CPU mesh of ``world_size`` (uneven
    rows), except :data:`REPLICATED` (``Replicate()``); :data:`SAMPLE_OBJECTS` are saved
    alongside.

    Parameters
    ----------
    rank, world_size
        Given by :func:`~ckptlab.plan.run_ranks`; the process group is initialized.
    path
        The checkpoint directory (the same on every rank).

    Returns
    -------
    LocalPlan
        This rank's write items, as :func:`~ckptlab.plan.write_items` reads them from the
        state dict that was saved.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    state: dict[str, Any] = {name: _dtensor(t, mesh, rank, _placement(name, t.ndim, "S0"))
                             for name, t in sample_state().items()}
    state.update(copy.deepcopy(SAMPLE_OBJECTS))
    dcp.save(state, checkpoint_id=path)
    return local_plan(rank, write_items(state))


def load_resharded(rank: int, world_size: int, path: str,
                   placement: str = "S0") -> dict[str, Any]:
    """Load the sample checkpoint onto ``world_size`` ranks and check it bit for bit.

    Every tensor is loaded into a zeroed DTensor on a 1-D CPU mesh of ``world_size`` with
    ``placement`` (``"S0"``: ``Shard(0)``; ``"S1"``: ``Shard(1)`` for matrices, ``Shard(0)``
    for vectors; ``"R"``: ``Replicate()``); :data:`REPLICATED` stays replicated. Each rank
    compares its local part with the same box of :func:`sample_state`.

    Parameters
    ----------
    rank, world_size
        Given by :func:`~ckptlab.plan.run_ranks`.
    path
        A directory written by :func:`save_sample_sharded` (any world size).
    placement
        ``"S0"``, ``"S1"`` or ``"R"``.

    Returns
    -------
    dict
        ``"rank"``; ``"chunks"``: fqn -> (offsets, sizes) of this rank's box;
        ``"exact"``: fqn -> whether the loaded bytes equal the expected ones (dtype, shape and
        every byte); ``"objects"``: the loaded non-tensor entries; ``"read_items"``: the
        tensor read items torch planned for this rank, as tuples (fqn, saved chunk offsets,
        storage offsets, dest offsets, lengths).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.device_mesh import init_device_mesh

    _check_placement(placement)
    mesh = init_device_mesh("cpu", (world_size,))
    full = sample_state()
    state: dict[str, Any] = {}
    placements = {}
    for name, t in full.items():
        placements[name] = _placement(name, t.ndim, placement)
        state[name] = _dtensor(torch.zeros_like(t), mesh, rank, placements[name])
    state.update(step=0, config={"lr": 0.0, "name": ""}, tag="")

    class _Recording(DefaultLoadPlanner):
        final: Any = None

        def finish_plan(self, new_plan: Any) -> Any:
            self.final = new_plan
            return super().finish_plan(new_plan)

    planner = _Recording()
    dcp.load(state, checkpoint_id=path, planner=planner)
    chunks: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    exact: dict[str, bool] = {}
    for name, expected_full in full.items():
        local = state[name].to_local()
        box = shard_chunk(expected_full.shape, (world_size,), (rank,), [placements[name]])
        chunks[name] = (box.offsets, box.sizes)
        expected = expected_full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        exact[name] = _same_bits(local, expected)
    reads = sorted((r.dest_index.fqn, tuple(r.storage_index.offset), tuple(r.storage_offsets),
                    tuple(r.dest_offsets), tuple(r.lengths))
                   for r in planner.final.items if r.type == LoadItemType.TENSOR)
    objects = {k: state[k] for k in SAMPLE_OBJECTS}
    return {"rank": rank, "chunks": chunks, "exact": exact, "objects": objects,
            "read_items": reads}


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    a, b = a.detach().contiguous(), b.detach().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def simulated_chunks(config: ModelConfig | str, fqn: str, world_size: int, *,
                     sharding: str = "fsdp", tp: int = 8) -> tuple[Chunk, ...]:
    """The chunk of one tensor that each rank holds, by rank, as :func:`simulate_plans` lays
    it out (the same placements; replicas are listed once per rank that holds them).

    Parameters
    ----------
    config
        A :data:`~ckptlab.plan.CONFIGS` name or a :class:`~ckptlab.plan.ModelConfig`.
    fqn
        A tensor of :func:`~ckptlab.plan.state_shapes` (with the optimizer's state).
    world_size, sharding, tp
        As for :func:`~ckptlab.plan.simulate_plans`.

    Returns
    -------
    tuple of Chunk
        ``world_size`` chunks, rank 0 first (what each rank would load in a resharded load).
    """
    if isinstance(config, str) and config not in CONFIGS:
        raise InvalidArgumentError(f"unknown config {config!r}; expected one of {list(CONFIGS)}")
    if type(world_size) is not int or world_size < 1:
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    tensors, _ = state_shapes(config)
    spec = next((t for t in tensors if t.fqn == fqn), None)
    if spec is None:
        raise InvalidArgumentError(f"{fqn!r} is not a tensor of this config's state dict")
    if not spec.shape:
        return (Chunk((), ()),) * world_size
    if sharding == "fsdp":
        mesh: tuple[int, ...] = (world_size,)
        placements: tuple[int | None, ...] = (0,)
    elif sharding == "fsdp+tp":
        if world_size % tp:
            raise InvalidArgumentError(f"world_size {world_size} is not a multiple of tp={tp}")
        mesh, placements = (world_size // tp, tp), (0, spec.tp_dim)
    else:
        raise InvalidArgumentError(f"sharding must be 'fsdp' or 'fsdp+tp', got {sharding!r}")
    memo: dict[tuple[int, ...], Chunk] = {}
    out = []
    for rank in range(world_size):
        coord = (rank,) if len(mesh) == 1 else divmod(rank, mesh[1])
        if coord not in memo:
            memo[coord] = shard_chunk(spec.shape, mesh, coord, placements)
        out.append(memo[coord])
    return tuple(out)
