"""One save's run on this rank, between the DCP calls: stage (``dcp.async_save``), or place,
hand the files to the workers and copy the tensors in (``write_data``).

:class:`~ckptlab.write.writer.AsyncWriter` holds the resources (workers, copy threads,
staging memory, blob templates) and speaks the DCP protocol; the functions here do the work
of its ``stage`` and ``write_data`` on one :class:`~ckptlab.write._state.SaveState`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptlab.write._blob import BlobTemplates
from ckptlab.write._commit import report_buckets
from ckptlab.write._placement import Placement, place_plan, staging_nbytes
from ckptlab.write._staging import (
    StagingArena,
    copy_in,
    copy_pairs,
    in_lanes,
    pair_nbytes,
    stage_tree,
    tree_nbytes,
)
from ckptlab.write._state import SaveState
from ckptlab.write._worker import IoHook, WorkerPool, file_task

__all__ = ["SaveResources", "run_save", "stage_save"]


@dataclass(frozen=True, slots=True)
class SaveResources:
    """What a writer lends each of its saves; persistent from save to save."""

    pool: WorkerPool
    copiers: ThreadPoolExecutor | None  # threads copying beside the caller
    lanes: int  # copy threads in all, the caller's included
    arena: StagingArena
    templates: BlobTemplates


def _begin(save: SaveState, arena: StagingArena, need_nbytes: int, t: float) -> float:
    """Rewind ``arena`` for this save; memory it had to map (a writer's first save, or a
    larger one) is the timeline's ``reserve`` phase from ``t``. When the next phase starts."""
    if not arena.begin(need_nbytes):
        return t
    save.recorder.add(None, "reserve", t, arena.capacity_nbytes)
    return save.recorder.now()


def stage_save(save: SaveState, res: SaveResources, state_dict: dict[str, Any]) -> Any:
    """Copy ``state_dict``'s tensors into staging memory (:meth:`AsyncWriter.stage`), on
    ``res.lanes`` threads; the copy.

    On failure ``save`` is marked not staged, so nothing is in flight and the next save may
    start.
    """
    t = save.recorder.now()
    try:
        t = _begin(save, res.arena, tree_nbytes(state_dict), t)
        pairs: list[tuple[Any, Any]] = []
        staged, nbytes = stage_tree(res.arena, state_dict, pairs)
        in_lanes(copy_pairs, pairs, res.copiers, res.lanes, pair_nbytes)
    except BaseException:
        save.staged = False
        raise
    save.recorder.add(None, "stage", t, nbytes)
    return staged


def run_save(save: SaveState, plan: Any, planner: Any, res: SaveResources, *, directory: str,
             prefix: str, buckets: int, separation_hint: str | None, direct: bool,
             sync: bool, hook: IoHook | None) -> Placement:
    """``write_data``'s work: place the plan's items, start one worker per data file (it
    opens its file, then waits for the copy), copy the tensors in, return.

    Data files are ``{prefix}{bucket}.distcp`` in ``directory``. Returns the placement
    (its ``results`` are DCP's); raises what placement or a copy raised (a failed copy
    stops the workers: nothing of this save can commit).
    """
    t = save.recorder.now()
    try:
        if not save.staged:
            t = _begin(save, res.arena, staging_nbytes(plan), t)
        placed = place_plan(plan, planner, directory=directory, prefix=prefix,
                            buckets=buckets, separation_hint=separation_hint,
                            arena=res.arena, templates=res.templates, staged=save.staged)
    except BaseException:
        save.staged = False
        raise
    save.assignment = placed.assignment
    save.recorder.add(None, "plan", t)
    save.recorder.total_nbytes = placed.write_nbytes
    for job in placed.jobs:
        fut = res.pool.submit(file_task(job, save.recorder, save.created, direct=direct,
                                        sync=sync, hook=hook))
        save.futures.append((job.bucket, job.name, fut))
    save.submitted.set()
    threading.Thread(target=report_buckets, args=(save, hook), daemon=True,
                     name="ckptlab-writer-monitor").start()
    try:
        copy_in(save.recorder, placed.copies, res.copiers, res.lanes)
    except BaseException as exc:
        if placed.jobs and placed.jobs[0].staging is not None:
            placed.jobs[0].staging.abort(exc)  # the workers stop; nothing is committed
        raise
    save.recorder.returned_s = save.recorder.now()
    return placed
