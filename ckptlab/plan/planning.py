"""The coordinator's global step: dedup, metadata and validation over all ranks' local plans.

DCP's coordinator receives every rank's :class:`~ckptlab.plan.items.LocalPlan` and must

1. **dedup** — an item held by several ranks (a replica: same name, same chunk offsets) is
   written by one of them;
2. **metadata** — collect, per tensor, the chunks that make up the checkpoint;
3. **validate** — the chunks of each tensor lie in bounds, do not overlap and fill it.

:func:`global_plan` does the three in one pass that touches each item a constant number of
times (validation sweeps the dimension with the most chunk boundaries, not the largest one:
see :mod:`ckptlab.plan.validate`). :class:`PlanBook` keeps the state between saves so that a
new set of local plans in which a few ranks changed is re-planned in time proportional to what
changed (:meth:`PlanBook.update`); :class:`ckptlab.plan.PlanCache` builds on it.

Dedup: unique items stay with their rank; each replicated item goes to the holder with the
fewest bytes so far, largest items first (torch gives each replica, in arrival order, to the
holder with the smallest plan so far, so rank 0 takes the first replicas before any load is
known). On an update a replica keeps its writer while that rank still holds it, so one rank's
change does not reshuffle everyone's plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import compress

from ckptlab.errors import InvalidArgumentError, PlanError
from ckptlab.plan.items import LocalPlan, WriteItem
from ckptlab.plan.reshard import Chunk, read_items
from ckptlab.plan.validate import ChunkProblem, validate_chunks

__all__ = ["GlobalPlan", "PlanBook", "PlanDiff", "PlannedTensor", "compare_plans", "global_plan",
           "merge_delta"]

Key = tuple[str, "tuple[int, ...] | None"]


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One tensor of the checkpoint: its shape, dtype and the chunks saved, each with the rank
    that writes it (in rank order, as the metadata lists them)."""

    fqn: str
    size: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]
    writers: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class GlobalPlan:
    """The coordinator's result: what each rank writes, and the checkpoint's contents.

    ``plans[r]`` is rank r's plan after dedup (the same object as its local plan when dedup
    removed nothing from it). ``problems`` is empty for a valid plan (:func:`global_plan`
    raises otherwise unless asked not to); there a problem's ``chunks`` are the ranks that
    write the chunks involved, and its text names their boxes.
    """

    world_size: int
    plans: tuple[LocalPlan, ...]
    problems: tuple[ChunkProblem, ...]
    _chunks: Mapping[str, Mapping[tuple[int, ...], tuple[WriteItem, int]]]
    _info: Mapping[str, tuple[tuple[int, ...], str]]
    _objects: Mapping[str, int]

    @cached_property
    def tensors(self) -> dict[str, PlannedTensor]:
        """fqn -> :class:`PlannedTensor`, in first-appearance order."""
        out = {}
        for fqn, chunks in self._chunks.items():
            pairs = sorted(chunks.values(), key=lambda p: p[1])
            size, dtype = self._info[fqn]
            out[fqn] = PlannedTensor(fqn, size, dtype, tuple(it.chunk for it, _ in pairs),
                                   tuple(r for _, r in pairs))
        return out

    @property
    def objects(self) -> Mapping[str, int]:
        """Pickled (bytes) entries: fqn -> the rank that writes it."""
        return self._objects

    @cached_property
    def rank_nbytes(self) -> tuple[int, ...]:
        """Payload bytes each rank writes after dedup."""
        return tuple(p.nbytes for p in self.plans)

    @property
    def nbytes(self) -> int:
        return sum(self.rank_nbytes)

    @property
    def imbalance(self) -> float:
        """max / mean of :attr:`rank_nbytes` (1.0 = perfectly balanced)."""
        total = self.nbytes
        return max(self.rank_nbytes) * self.world_size / total if total else 1.0


@dataclass(frozen=True, slots=True)
class PlanDiff:
    """How two sets of local plans differ, by rank."""

    changed: tuple[int, ...]
    added: tuple[int, ...]  # ranks only in the new set
    removed: tuple[int, ...]  # ranks only in the old set

    @property
    def same(self) -> bool:
        return not (self.changed or self.added or self.removed)


def compare_plans(old: Sequence[LocalPlan], new: Sequence[LocalPlan | str]) -> PlanDiff:
    """Which ranks' plans differ (by fingerprint; a ``str`` stands for a fingerprint)."""
    n = min(len(old), len(new))
    changed = tuple(r for r in range(n) if _fp(new[r]) != old[r].fingerprint)
    return PlanDiff(changed, tuple(range(n, len(new))), tuple(range(n, len(old))))


def merge_delta(cached: Sequence[LocalPlan],
                delta: Mapping[int, LocalPlan] | Sequence[LocalPlan | str | None]
                ) -> tuple[LocalPlan, ...]:
    """The full set of local plans: ``cached`` with the ranks in ``delta`` replaced.

    ``delta`` maps rank -> new plan, or is a per-rank sequence where ``None`` or the cached
    plan's fingerprint means "unchanged".
    """
    out = list(cached)
    entries = delta.items() if isinstance(delta, Mapping) else enumerate(delta)
    for r, plan in entries:
        if plan is None:
            continue
        if not 0 <= r < len(out):
            raise InvalidArgumentError(f"rank {r} outside a world of {len(out)}")
        if isinstance(plan, str):
            if plan != out[r].fingerprint:
                raise PlanError(f"rank {r} says its plan is unchanged (fingerprint {plan}) but "
                                f"the cached plan has fingerprint {out[r].fingerprint}")
            continue
        out[r] = plan
    return tuple(out)


def _conflict(a: WriteItem, b: WriteItem) -> bool:
    """Whether two replicas of one key disagree on their bytes: kind, dtype, global shape or
    chunk sizes. (Tensor properties such as ``requires_grad`` may differ, as torch allows:
    the metadata takes them from the item written.)"""
    return (a.kind != b.kind or a.dtype != b.dtype or a.size != b.size or
            (a.chunk is not None and b.chunk is not None and a.chunk.sizes != b.chunk.sizes))


def _fp(plan: LocalPlan | str) -> str:
    return plan if isinstance(plan, str) else plan.fingerprint


def _first_items(plan: LocalPlan) -> dict[Key, WriteItem]:
    """key -> item of a plan (a key listed twice: its first item)."""
    out: dict[Key, WriteItem] = {}
    for it in plan.items:
        out.setdefault(it.key, it)
    return out


def _by_rank(problem: ChunkProblem, entries: list[tuple[WriteItem, int]]) -> ChunkProblem:
    """A chunk problem told by the boxes and the ranks writing them (not list positions)."""
    if not problem.chunks:
        return problem
    boxes = sorted((entries[i][0].chunk.offsets, entries[i][0].chunk.sizes, entries[i][1])
                   for i in problem.chunks)
    told = " and ".join(f"{o}+{s} (rank {r})" for o, s, r in boxes)
    return ChunkProblem(problem.fqn, problem.kind, tuple(r for _, _, r in boxes), told)


class PlanBook:
    """The coordinator's planning state: the last local plans and everything derived.

    ``PlanBook(local_plans)`` plans from scratch; :meth:`update` re-plans after some ranks
    changed, touching only their items, the tensors they hold and the replicas they share.
    :attr:`result` is the current :class:`GlobalPlan` (an immutable snapshot: later updates do
    not change it).

    Every item lives once, under its tensor and chunk offsets (or its name, for pickled
    objects), with the rank that writes it; only replicated items also keep the list of ranks
    holding them, so planning from scratch is one dictionary lookup per item.
    """

    def __init__(self, local_plans: Sequence[LocalPlan], *, reuse_validation: bool = True
                 ) -> None:
        n = len(local_plans)
        if n == 0:
            raise InvalidArgumentError("no local plans")
        for r, plan in enumerate(local_plans):
            if not isinstance(plan, LocalPlan):
                raise InvalidArgumentError(f"rank {r}: expected LocalPlan, got "
                                           f"{type(plan).__name__}")
        self._plans: list[LocalPlan] = list(local_plans)
        # fqn -> chunk offsets -> (item as its first holder has it, the rank writing it)
        self._chunks: dict[str, dict[tuple[int, ...], tuple[WriteItem, int]]] = {}
        self._info: dict[str, tuple[tuple[int, ...], str]] = {}
        self._objects: dict[str, tuple[WriteItem, int]] = {}
        self._replicas: dict[Key, list[int]] = {}  # key -> ranks holding it, when several do
        self._mismatch: dict[Key, list[int]] = {}  # replicas that differ: key -> ranks
        # chunks a rank lists twice: fqn -> rank -> offsets (torch sees two chunks overlap)
        self._repeated: dict[str, dict[int, list[tuple[int, ...]]]] = {}
        self._problems: dict[str, list[ChunkProblem]] = {}
        self._valid: set[tuple] = set()  # (size, chunks) already found valid
        self._reuse_validation = reuse_validation
        self._copied: set[str] = set()
        chunks, objects, replicas, info = self._chunks, self._objects, self._replicas, self._info
        mismatch = self._mismatch
        seconds: list[tuple[Key, int, int]] = []  # replicas after the first: (key, rank, index)
        repeats: list[tuple[int, int]] = []  # (rank, index) of keys a rank lists again
        for r, plan in enumerate(local_plans):
            for i, it in enumerate(plan.items):
                c = it.chunk
                fqn = it.fqn
                if c is None:
                    prev = objects.get(fqn)
                    if prev is None:
                        objects[fqn] = (it, r)
                        continue
                    key: Key = (fqn, None)
                else:
                    per = chunks.get(fqn)
                    if per is None:
                        per = chunks[fqn] = {}
                        info[fqn] = (it.size, it.dtype)
                    prev = per.get(c.offsets)
                    if prev is None:
                        per[c.offsets] = (it, r)
                        continue
                    key = (fqn, c.offsets)
                if prev[1] == r and key not in replicas:
                    repeats.append((r, i))
                    self._note_repeat(it, r)
                    continue
                hs = replicas.get(key)
                if hs is None:
                    replicas[key] = [prev[1], r]
                elif hs[-1] != r:
                    hs.append(r)
                else:  # a rank listing one key twice: its first item counts
                    repeats.append((r, i))
                    self._note_repeat(it, r)
                    continue
                seconds.append((key, r, i))
                if it is not prev[0] and _conflict(it, prev[0]):
                    mismatch.setdefault(key, []).append(r)
        # each rank's load: its payload minus the replicas it holds, which are then placed
        load = self._load = [p.nbytes for p in local_plans]
        for key, hs in replicas.items():
            w = self._item(key).nbytes
            for h in hs:
                load[h] -= w
        self._assign(list(replicas))
        for fqn in chunks:
            self._validate_full(fqn)
        # dedup: each rank drops the replicas another rank writes (positions known from above)
        lost: dict[int, list[int]] = {}
        for r, i in repeats:
            lost.setdefault(r, []).append(i)
        firsts: dict[int, dict[Key, int]] = {}
        for key, r, i in seconds:
            if self._writer(key) != r:
                lost.setdefault(r, []).append(i)
        for key, hs in replicas.items():
            r0 = hs[0]
            if self._writer(key) != r0:
                where = firsts.get(r0)
                if where is None:
                    where = firsts[r0] = {}
                    for k, it in enumerate(local_plans[r0].items):
                        where.setdefault(it.key, k)
                lost.setdefault(r0, []).append(where[key])
        self._dedup_plans = list(local_plans)
        for r, gone in lost.items():
            keep = bytearray(b"\x01") * len(local_plans[r].items)
            for i in gone:
                keep[i] = 0
            kept = tuple(compress(local_plans[r].items, keep))
            self._dedup_plans[r] = LocalPlan(r, kept,
                                             f"{local_plans[r].fingerprint}/dedup{len(kept)}")

    # -- pieces ---------------------------------------------------------------------------
    def _note_repeat(self, item: WriteItem, rank: int) -> None:
        if item.chunk is not None and item.chunk.numel:  # empty boxes overlap nothing
            per = self._repeated.setdefault(item.fqn, {})
            per.setdefault(rank, []).append(item.chunk.offsets)

    def _repeat_problems(self, fqn: str) -> list[ChunkProblem]:
        return [ChunkProblem(fqn, "overlap", (r,), f"rank {r} lists the chunk at {offsets} "
                             "twice (torch writes both, and they overlap)")
                for r, offs in sorted(self._repeated.get(fqn, {}).items()) for offsets in offs]

    def _entry(self, key: Key) -> tuple[WriteItem, int] | None:
        fqn, offsets = key
        if offsets is None:
            return self._objects.get(fqn)
        per = self._chunks.get(fqn)
        return None if per is None else per.get(offsets)

    def _item(self, key: Key) -> WriteItem:
        return self._entry(key)[0]  # type: ignore[index]

    def _writer(self, key: Key) -> int | None:
        e = self._entry(key)
        return None if e is None else e[1]

    def _holders(self, key: Key) -> list[int]:
        hs = self._replicas.get(key)
        if hs is not None:
            return hs
        e = self._entry(key)
        return [] if e is None else [e[1]]

    def _own(self, fqn: str) -> dict[tuple[int, ...], tuple[WriteItem, int]]:
        """The tensor's chunk dict, copied once per update (old GlobalPlans keep theirs)."""
        if fqn not in self._copied:
            self._chunks[fqn] = dict(self._chunks[fqn])
            self._copied.add(fqn)
        return self._chunks[fqn]

    def _set(self, key: Key, item: WriteItem, r: int) -> None:
        fqn, offsets = key
        if offsets is None:
            self._objects[fqn] = (item, r)
            return
        if fqn not in self._chunks:
            self._chunks[fqn] = {}
            self._copied.add(fqn)
            self._info[fqn] = (item.size, item.dtype)
        self._own(fqn)[offsets] = (item, r)

    def _delete(self, key: Key) -> None:
        fqn, offsets = key
        if offsets is None:
            del self._objects[fqn]
        else:
            del self._own(fqn)[offsets]

    def _assign(self, keys: Sequence[Key]) -> None:
        """Give each replicated key to its least-loaded holder, largest items first."""
        load = self._load
        weighted = sorted(((self._item(k).nbytes, k) for k in keys), key=lambda p: -p[0])
        for w, key in weighted:
            r = min(self._replicas[key], key=lambda q: (load[q], q))
            load[r] += w
            self._set(key, self._item(key), r)

    def _dedup(self, r: int) -> LocalPlan:
        plan = self._plans[r]
        keep = [True] * len(plan.items)
        seen: set[Key] = set()
        for i, it in enumerate(plan.items):
            c = it.chunk
            key = (it.fqn, None if c is None else c.offsets)
            if key in seen or (key in self._replicas and self._writer(key) != r):
                keep[i] = False
            seen.add(key)
        if all(keep):
            return plan
        kept = tuple(compress(plan.items, keep))
        return LocalPlan(r, kept, f"{plan.fingerprint}/dedup{len(kept)}")

    def _validate_full(self, fqn: str) -> None:
        size, _ = self._info[fqn]
        problems = []
        if size:  # scalars: torch does not validate them either
            entries = list(self._chunks[fqn].values())
            chunks = tuple([it.chunk for it, _ in entries])
            memo = (size, chunks)  # tensors of one shape often share a sharding: check once
            if memo not in self._valid:
                found = validate_chunks(fqn, size, chunks, check_volume=len(self._plans) > 1)
                if not found and self._reuse_validation:
                    self._valid.add(memo)
                problems = [_by_rank(p, entries) for p in found]
        problems += self._mismatch_problems(fqn)
        if size:
            problems += self._repeat_problems(fqn)
        if problems:
            self._problems[fqn] = problems
        else:
            self._problems.pop(fqn, None)

    def _mismatch_problems(self, fqn: str) -> list[ChunkProblem]:
        return [ChunkProblem(fqn, "mismatch", tuple(sorted(ranks)),
                             f"ranks {self._holders(key)[0]} and {sorted(ranks)} hold the chunk at "
                             f"{key[1]} with different sizes or dtypes")
                for key, ranks in self._mismatch.items() if key[0] == fqn]

    # -- incremental ----------------------------------------------------------------------
    def update(self, local_plans: Sequence[LocalPlan | str | None]) -> PlanDiff:
        """Re-plan for a new set of local plans of the same world size.

        Entries that are ``None`` or the cached plan's fingerprint are unchanged ranks. The
        work is proportional to the changed ranks' items (plus, per tensor they touch, one
        dictionary copy so that earlier results stay immutable). A replica keeps its writer
        while that rank still holds it.
        """
        if len(local_plans) != len(self._plans):
            raise InvalidArgumentError(f"update with {len(local_plans)} plans for a world of "
                                       f"{len(self._plans)}: re-plan from scratch instead")
        new = merge_delta(self._plans, local_plans)
        changed = [r for r in range(len(new))
                   if new[r] is not self._plans[r] and new[r] != self._plans[r]]
        self._copied = set()
        old_maps = {r: _first_items(self._plans[r]) for r in changed}
        new_maps = {r: _first_items(new[r]) for r in changed}
        affected: dict[Key, None] = {}  # keys whose holders or items changed, in order
        for r in changed:
            o, n = old_maps[r], new_maps[r]
            affected.update((k, None) for k, it in o.items() if n.get(k) != it)
            affected.update((k, None) for k, it in n.items() if o.get(k) != it)
        lookups: dict[int, dict[Key, WriteItem]] = dict(new_maps)

        def item_at(q: int, key: Key) -> WriteItem:  # rank q's item for key, new plans
            m = lookups.get(q)
            if m is None:
                m = lookups[q] = _first_items(new[q])
            return m[key]

        changed_set = set(changed)
        repeat_fqns: dict[str, None] = {}  # tensors whose repeated chunks may have changed
        for fqn, per in list(self._repeated.items()):
            if changed_set & per.keys():
                repeat_fqns[fqn] = None
                for r in changed_set & per.keys():
                    del per[r]
                if not per:
                    del self._repeated[fqn]
        for r in changed:
            seen: set[Key] = set()
            for it in new[r].items:
                if it.key in seen:
                    self._note_repeat(it, r)
                    repeat_fqns[it.fqn] = None
                seen.add(it.key)
        load, replicas = self._load, self._replicas
        removed: dict[str, list[Chunk]] = {}
        added: dict[str, list[Chunk]] = {}
        touched: dict[str, None] = {}  # tensors with an item that changed in any way
        to_assign: list[Key] = []
        dedup_ranks = set(changed)
        self._plans = list(new)
        for key in affected:
            prev = self._entry(key)
            prev_holders = self._holders(key)
            holders = sorted({q for q in prev_holders if q not in changed_set} |
                             {r for r in changed if key in new_maps[r]})
            was_mismatched = self._mismatch.pop(key, None) is not None
            if prev is not None:
                load[prev[1]] -= prev[0].nbytes
                dedup_ranks.add(prev[1])
            if not holders:
                replicas.pop(key, None)
                if prev is not None:
                    self._delete(key)
                    if key[1] is not None:
                        removed.setdefault(key[0], []).append(prev[0].chunk)
                continue
            # every holder's item: unchanged holders hold what they held before, which is the
            # old reference unless the replicas already differed
            items = [item_at(q, key) if q in changed_set or was_mismatched or prev is None
                     else prev[0] for q in holders]
            ref = items[0]
            if key[1] is not None:
                touched[key[0]] = None
            bad = [q for q, it in zip(holders[1:], items[1:]) if _conflict(it, ref)]
            if bad:
                self._mismatch[key] = bad
            if prev is not None and prev[0].chunk != ref.chunk and key[1] is not None:
                removed.setdefault(key[0], []).append(prev[0].chunk)
                added.setdefault(key[0], []).append(ref.chunk)
            elif prev is None and key[1] is not None:
                added.setdefault(key[0], []).append(ref.chunk)
            elif key[1] is not None and (bad or was_mismatched):
                removed.setdefault(key[0], [])  # re-validate: the replicas' verdict changed
            if len(holders) > 1:
                replicas[key] = holders
            else:
                replicas.pop(key, None)
            if prev is not None and prev[1] in holders:
                writer = prev[1]  # a replica keeps its writer while it still holds it
            elif len(holders) == 1:
                writer = holders[0]
            else:
                self._set(key, ref, -1)
                to_assign.append(key)
                continue
            self._set(key, ref, writer)
            load[writer] += ref.nbytes
            dedup_ranks.add(writer)
        self._assign(to_assign)
        dedup_ranks.update(self._writer(k) for k in to_assign)  # type: ignore[misc]
        for fqn in {**removed, **added, **touched, **repeat_fqns}:
            if not self._chunks.get(fqn):
                self._chunks.pop(fqn, None)
                self._info.pop(fqn, None)
                self._problems.pop(fqn, None)
                continue
            # an item may change dtype or global shape with its chunk unchanged (a dtype cast,
            # or a DTensor whose shard stays put while the tensor grows): the tensor's shape
            # and dtype are read again from its items, never kept from the last plan
            size = self._info[fqn][0]
            self._info[fqn] = self._ref_info(fqn)
            if self._info[fqn][0] != size or fqn in repeat_fqns:
                self._validate_full(fqn)  # every chunk is checked against the new bounds
            elif fqn in removed or fqn in added:
                self._validate_delta(fqn, removed.get(fqn, []), added.get(fqn, []))
        for r in dedup_ranks:
            self._dedup_plans[r] = self._dedup(r)
        self.__dict__.pop("result", None)
        return PlanDiff(tuple(changed), (), ())

    def _ref_info(self, fqn: str) -> tuple[tuple[int, ...], str]:
        """The tensor's shape and dtype as its first chunk in rank order tells them."""
        it = min(self._chunks[fqn].values(), key=lambda e: e[1])[0]
        return (it.size, it.dtype)

    def _validate_delta(self, fqn: str, removed: list[Chunk], added: list[Chunk]) -> None:
        """Re-validate one tensor after ``removed`` chunks were replaced by ``added`` ones.

        If the tensor was valid and the added chunks are in bounds, disjoint, and lie inside
        the region the removed ones covered, no other chunk can overlap them, and the volume
        is unchanged when theirs is. Anything else re-validates the tensor in full.
        """
        size, _ = self._info[fqn]
        if fqn in self._problems or not size or not removed or \
                any(k[0] == fqn for k in self._mismatch):
            self._validate_full(fqn)
            return
        covered = [0] * len(added)
        for ri in read_items(fqn, removed, added):
            covered[ri.dest_index] += ri.numel
        inside = all(cov == c.numel for cov, c in zip(covered, added))
        same_volume = sum(c.numel for c in added) == sum(c.numel for c in removed)
        if not (inside and same_volume) or validate_chunks(fqn, size, added, check_volume=False):
            self._validate_full(fqn)

    # -- result ---------------------------------------------------------------------------
    @cached_property
    def result(self) -> GlobalPlan:
        """The current global plan (a snapshot)."""
        problems = tuple(p for ps in self._problems.values() for p in ps)
        return GlobalPlan(len(self._plans), tuple(self._dedup_plans), problems,
                          dict(self._chunks), dict(self._info),
                          {fqn: r for fqn, (_, r) in self._objects.items()})

    @property
    def plans(self) -> tuple[LocalPlan, ...]:
        """The local plans the book was last planned for."""
        return tuple(self._plans)


def global_plan(local_plans: Sequence[LocalPlan], *, validate: bool = True,
                reuse_validation: bool = True) -> GlobalPlan:
    """Dedup, metadata and validation for one set of local plans (no cache).

    With ``reuse_validation`` (the default) tensors with the same shape and the same chunks
    (the layers of a model) are validated once; without it each tensor is swept on its own.

    Raises
    ------
    PlanError
        With ``validate`` (the default), when any tensor's chunks overlap, leave a gap or lie
        out of bounds; the message names the first problems. Without it, the problems are in
        :attr:`GlobalPlan.problems`.
    """
    result = PlanBook(local_plans, reuse_validation=reuse_validation).result
    if validate:
        raise_problems(result)
    return result


def raise_problems(result: GlobalPlan) -> None:
    """Raise :class:`~ckptlab.errors.PlanError` if ``result`` has problems."""
    if result.problems:
        shown = "; ".join(map(str, result.problems[:5]))
        more = f" (+{len(result.problems) - 5} more)" if len(result.problems) > 5 else ""
        raise PlanError(f"invalid global plan: {shown}{more}")

