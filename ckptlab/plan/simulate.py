"""N-rank planning in one process: local plans from realistic LLM shapes, no downloads.

A model is a row of a config table (:data:`CONFIGS`: vocabulary, width, layers, heads,
feed-forward width). :func:`state_shapes` lists its parameters (and, with an optimizer, Adam's
``exp_avg`` / ``exp_avg_sq`` of the same shape in float32 plus a replicated 0-d ``step`` and
the pickled ``param_groups``), and :func:`simulate_plans` builds every rank's
:class:`~ckptlab.plan.items.LocalPlan` for a sharding: ``"fsdp"`` (every tensor ``Shard(0)``
over a 1-D mesh of N) or ``"fsdp+tp"`` (a 2-D mesh ``(N / tp, tp)``; matrices also split
along their other dimension, as tensor parallelism does). The chunk arithmetic is
:func:`~ckptlab.plan.items.shard_chunk`, checked against torch's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptlab.errors import InvalidArgumentError
from ckptlab.plan.items import LocalPlan, WriteItem, local_plan, shard_chunk
from ckptlab.plan.reshard import Chunk

__all__ = ["CONFIGS", "ModelConfig", "TensorSpec", "simulate_plans", "state_shapes"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape-determining numbers of a decoder-only transformer (Llama layout)."""

    name: str
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (
    ModelConfig("tiny", 1000, 64, 2, 4, 2, 172),
    ModelConfig("llama3-1b", 128256, 2048, 16, 32, 8, 8192, tied_embeddings=True),
    ModelConfig("llama3-8b", 128256, 4096, 32, 32, 8, 14336),
    ModelConfig("llama3-70b", 128256, 8192, 80, 64, 8, 28672),
)}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One state-dict tensor: name, global shape, dtype, and whether tensor parallelism
    splits it (along ``tp_dim``)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    tp_dim: int | None = None


def state_shapes(config: ModelConfig | str, *, optimizer: bool = True,
                 dtype: str = "bfloat16") -> tuple[list[TensorSpec], list[str]]:
    """The tensors (and pickled entries) of a model's state dict, optionally with Adam's.

    Returns
    -------
    (tensors, objects)
        Tensor specs in state-dict order, and the names of the pickled (bytes) entries.
    """
    c = CONFIGS[config] if isinstance(config, str) else config
    kv = c.n_kv_heads * c.head_dim
    params: list[TensorSpec] = [TensorSpec("model.embed_tokens.weight", (c.vocab, c.d_model),
                                           dtype, 0)]
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        params += [
            TensorSpec(p + "self_attn.q_proj.weight", (c.d_model, c.d_model), dtype, 0),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, c.d_model), dtype, 0),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, c.d_model), dtype, 0),
            TensorSpec(p + "self_attn.o_proj.weight", (c.d_model, c.d_model), dtype, 1),
            TensorSpec(p + "mlp.gate_proj.weight", (c.d_ff, c.d_model), dtype, 0),
            TensorSpec(p + "mlp.up_proj.weight", (c.d_ff, c.d_model), dtype, 0),
            TensorSpec(p + "mlp.down_proj.weight", (c.d_model, c.d_ff), dtype, 1),
            TensorSpec(p + "input_layernorm.weight", (c.d_model,), dtype),
            TensorSpec(p + "post_attention_layernorm.weight", (c.d_model,), dtype),
        ]
    params.append(TensorSpec("model.norm.weight", (c.d_model,), dtype))
    if not c.tied_embeddings:
        params.append(TensorSpec("lm_head.weight", (c.vocab, c.d_model), dtype, 0))
    tensors = list(params)
    objects: list[str] = []
    if optimizer:
        for t in params:
            s = f"optim.state.{t.fqn}."
            tensors += [TensorSpec(s + "exp_avg", t.shape, "float32", t.tp_dim),
                        TensorSpec(s + "exp_avg_sq", t.shape, "float32", t.tp_dim),
                        TensorSpec(s + "step", (), "float32", None)]
        objects.append("optim.param_groups")
    return tensors, objects


def simulate_plans(config: ModelConfig | str, world_size: int, *, sharding: str = "fsdp",
                   tp: int = 8, optimizer: bool = True) -> list[LocalPlan]:
    """Every rank's local plan for saving ``config`` (with Adam) on ``world_size`` ranks.

    Parameters
    ----------
    sharding
        ``"fsdp"``: each tensor ``Shard(0)`` over all ranks (0-d ``step`` tensors are plain,
        replicated tensors). ``"fsdp+tp"``: a ``(world_size // tp, tp)`` mesh, ``Shard(0)``
        on the first dim and, for matrices, ``Shard(tp_dim)`` on the second (else
        ``Replicate()``, so those chunks are replicas across the tp ranks).
    """
    if type(world_size) is not int or world_size < 1:
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    if sharding == "fsdp":
        mesh: tuple[int, ...] = (world_size,)
    elif sharding == "fsdp+tp":
        if world_size % tp:
            raise InvalidArgumentError(f"world_size {world_size} is not a multiple of tp={tp}")
        mesh = (world_size // tp, tp)
    else:
        raise InvalidArgumentError(f"sharding must be 'fsdp' or 'fsdp+tp', got {sharding!r}")
    tensors, objects = state_shapes(config, optimizer=optimizer)
    # chunks depend only on the shape, the placements and the coordinate: compute each once
    memo: dict[tuple, Chunk] = {}
    plans = []
    for rank in range(world_size):
        coord = (rank,) if len(mesh) == 1 else divmod(rank, mesh[1])
        items = []
        for t in tensors:
            if not t.shape:
                items.append(WriteItem(t.fqn, "tensor", Chunk((), ()), (), t.dtype))
                continue
            if len(mesh) == 1:
                placements: tuple = (0,)
            else:
                placements = (0, t.tp_dim)
            k = (t.shape, placements, coord)
            chunk = memo.get(k)
            if chunk is None:
                chunk = memo[k] = shard_chunk(t.shape, mesh, coord, placements)
            items.append(WriteItem(t.fqn, "shard", chunk, t.shape, t.dtype))
        items += [WriteItem(name, "bytes") for name in objects]
        plans.append(local_plan(rank, items))
    return plans
