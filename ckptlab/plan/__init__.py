"""torch.distributed.checkpoint (DCP) planning: items, plan cache, resharding, simulation.

- :mod:`~ckptlab.plan.items`: write items (Tensor / DTensor / ShardedTensor / bytes) and
  per-rank :class:`LocalPlan` values; :func:`shard_chunk`, DTensor's box arithmetic.
- :mod:`~ckptlab.plan.planning`: the coordinator's global step (dedup, metadata, validation),
  incremental re-planning (:class:`PlanBook`), plan comparison and delta merge.
- :mod:`~ckptlab.plan.cache`: :class:`PlanCache`, keyed by namespace + structure fingerprint.
- :mod:`~ckptlab.plan.reshard` / :mod:`~ckptlab.plan.validate`: read items and chunk checks.
- :mod:`~ckptlab.plan.simulate`: N-rank local plans from LLM config tables.
- :mod:`~ckptlab.plan.ranks`: run a function on real gloo ranks.

Reading real DCP directories (``.metadata``, items, variants) is :mod:`ckptlab.dcp`'s; its
:func:`~ckptlab.dcp.inspect_dcp`, :func:`~ckptlab.dcp.load_metadata`,
:func:`~ckptlab.dcp.is_dcp_dir`, :class:`~ckptlab.dcp.DcpLayout` and
:class:`~ckptlab.dcp.DcpItem` stay importable from here.
"""

from ckptlab._lazy import lazy_attributes

# moved to ckptlab.dcp (reading DCP directories): the same objects, re-exported here because
# they were public in ckptlab.plan
from ckptlab.dcp import DcpItem, DcpLayout, inspect_dcp, is_dcp_dir, load_metadata
from ckptlab.plan.cache import (
    CacheEvent,
    PlanCache,
    structure_fingerprint,
    write_metadata,
)
from ckptlab.plan.items import (
    LocalPlan,
    WriteItem,
    local_plan,
    parse_placements,
    shard_chunk,
    write_items,
)
from ckptlab.plan.planning import (
    GlobalPlan,
    PlanBook,
    PlanDiff,
    PlannedTensor,
    compare_plans,
    global_plan,
    merge_delta,
)
from ckptlab.plan.ranks import RankError, run_ranks
from ckptlab.plan.reshard import Chunk, ReadItem, read_items, sweep_dimension
from ckptlab.plan.simulate import CONFIGS, ModelConfig, TensorSpec, simulate_plans, state_shapes
from ckptlab.plan.validate import ChunkProblem, require_valid, validate_chunks

# The name a global plan's tensor had until it was renamed: ckptlab.TensorEntry (checkpoint/)
# is a different class, a tensor of an opened checkpoint.
TensorEntry = PlannedTensor

__all__ = ["CONFIGS", "CacheEvent", "CachedSavePlanner", "Chunk", "ChunkProblem", "DcpItem", "DcpLayout",
           "GlobalPlan", "LocalPlan", "ModelConfig", "PlanBook", "PlanCache", "PlanDiff",
           "PlannedTensor", "RankError", "ReadItem", "TensorEntry", "TensorSpec", "WriteItem", "compare_plans",
           "global_plan", "inspect_dcp", "is_dcp_dir", "load_metadata", "local_plan",
           "merge_delta", "parse_placements", "read_items", "require_valid", "run_ranks",
           "shard_chunk", "simulate_plans", "state_shapes", "structure_fingerprint",
           "sweep_dimension", "validate_chunks", "write_items", "write_metadata"]


# CachedSavePlanner subclasses torch's planner: imported (with torch) on first use
__getattr__, __dir__ = lazy_attributes(__name__, globals(), {
    "CachedSavePlanner": "ckptlab.plan.planner:CachedSavePlanner"})
