"""A DCP ``SavePlanner`` whose coordinator step is ckptlab's, with a :class:`PlanCache`.

``dcp.save(state, checkpoint_id=path, planner=CachedSavePlanner(cache, "model"))`` saves
exactly what torch's default planner saves (same items, same metadata), but:

- each rank sends its full local plan only when it changed since its last successful save
  under this namespace; otherwise it sends its plan's fingerprint, which covers everything
  the ``.metadata`` is made of (names, kinds, chunks, global shapes, dtypes and the other
  tensor properties, and the flattening mappings), so no change can reuse a stale entry;
- the coordinator plans with :meth:`PlanCache.plan` (hit / delta / miss; dedup to the
  least-loaded holder; validation by sweep), keyed by the namespace you give — a model
  planner and an optimizer planner keep separate entries;
- ranks whose final plan did not change get a one-word answer and reuse their last one.

Keep the :class:`PlanCache` object alive across saves (one per process; on the coordinator it
holds the plans, on every rank its last plan). Converting the result into torch's
``Metadata`` is proportional to the number of chunks and is done again only when the global
plan changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from ckptlab.errors import PlanError
from ckptlab.plan.cache import PlanCache
from ckptlab.plan.items import LocalPlan
from ckptlab.plan.planning import GlobalPlan
from ckptlab.plan.torch_plans import from_torch_plan, to_torch_metadata

__all__ = ["CachedSavePlanner"]

_UNCHANGED = "unchanged"


@dataclasses.dataclass
class _RankState:
    """What one process remembers for one namespace between saves."""

    sent: str | None = None  # fingerprint of the local plan of the last successful save
    final: SavePlan | None = None  # that save's final plan
    pending: str | None = None


@dataclasses.dataclass
class _CoordinatorState:
    mappings: dict[int, Any] = dataclasses.field(default_factory=dict)
    result: GlobalPlan | None = None
    metadata: Any = None
    answered: dict[int, LocalPlan] = dataclasses.field(default_factory=dict)


def _key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    return (index.fqn, None if index.offset is None else tuple(index.offset))


class CachedSavePlanner(DefaultSavePlanner):
    """torch's default save planner with ckptlab's global step and plan cache.

    Parameters
    ----------
    cache
        The :class:`PlanCache` to use; keep it across saves. A new one by default.
    namespace
        The cache entry's name: use one per kind of state dict ("model", "optim").
    flatten_state_dict, flatten_sharded_tensors
        As for ``DefaultSavePlanner``.
    """

    def __init__(self, cache: PlanCache | None = None, namespace: str = "default", *,
                 flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors)
        self.cache = cache if cache is not None else PlanCache()
        self.namespace = namespace

    # state lives in the cache object, which outlives planners
    def _rank_state(self) -> _RankState:
        return self.cache.rank_states.setdefault(self.namespace, _RankState())

    def _coordinator_state(self) -> _CoordinatorState:
        return self.cache.coordinator_states.setdefault(self.namespace, _CoordinatorState())

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        mine = from_torch_plan(plan, 0)
        mappings = plan.planner_data
        fp = hashlib.blake2b(f"{mine.fingerprint}\n{sorted((mappings or {}).items())!r}"
                             .encode(), digest_size=16).hexdigest()
        state = self._rank_state()
        state.pending = fp
        if state.sent == fp and state.final is not None:
            return SavePlan([], usable=False, planner_data=(fp, None))
        return dataclasses.replace(plan, planner_data=(fp, mappings))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        coord = self._coordinator_state()
        entries: list[LocalPlan | str] = []
        for r, p in enumerate(all_plans):
            fp, mappings = p.planner_data
            if p.usable:
                lp = from_torch_plan(p, r)
                entries.append(LocalPlan(r, lp.items, fp, lp.nbytes))
                coord.mappings[r] = mappings
            else:
                entries.append(fp)
        result = self.cache.plan(self.namespace, entries)
        if result is not coord.result:
            metadata = to_torch_metadata(result)
            if self.flatten_state_dict:
                merged: dict[str, Any] = {}
                for r in sorted(coord.mappings, reverse=True):
                    merged.update(coord.mappings[r] or {})
                metadata = dataclasses.replace(metadata, planner_data=merged)
            coord.result, coord.metadata = result, metadata
        answers = []
        for r, kept in enumerate(result.plans):
            if coord.answered.get(r) is kept and not all_plans[r].usable:
                answers.append(SavePlan([], usable=False, planner_data=_UNCHANGED))
                continue
            kept_keys = {it.key for it in kept.items}
            local = entries[r] if isinstance(entries[r], LocalPlan) else None
            if local is None:  # an unchanged rank whose dedup changed: list what it keeps
                answers.append(SavePlan([], planner_data=("keep", kept_keys)))
            else:
                drop = {it.key for it in local.items} - kept_keys
                answers.append(SavePlan([], planner_data=("drop", drop)))
            coord.answered[r] = kept
        # the storage writer's finish() sets storage_data, storage_meta and version on the
        # metadata it gets: each save gets its own (shallow) copy, so the Metadata an earlier
        # dcp.save returned is not rewritten by a later save
        self.global_plan, self.metadata = answers, dataclasses.replace(coord.metadata)
        return answers, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        state = self._rank_state()
        if new_plan.planner_data == _UNCHANGED:
            if state.final is None:
                raise PlanError(f"{self.namespace}: the coordinator says this rank's plan is "
                                "unchanged, but this process holds no earlier plan (keep one "
                                "PlanCache per process across saves)")
            final = dataclasses.replace(state.final, storage_data=new_plan.storage_data)
        else:
            how, keys = new_plan.planner_data
            if how == "drop":
                items = [it for it in self.plan.items if _key(it.index) not in keys]
            else:
                items = [it for it in self.plan.items if _key(it.index) in keys]
            final = SavePlan(items, storage_data=new_plan.storage_data,
                             planner_data=self.plan.planner_data)
        state.sent, state.final = state.pending, final
        self.plan = final
        return final

