"""Benchmark: the coordinator's global plan step and finish step, torch vs ckptlab.

Run from the repository root::

    .venv/bin/python benchmarks/plan.py [--ranks 128 256 512 1024 2048] [--torch-max 1024]
                                        [--model llama3-8b] [--repeat 3]

For each world size N, every rank's local plan for a Llama-3-8B + Adam state dict sharded
FSDP-style (``Shard(0)`` over N ranks; 0-d ``step`` tensors and ``param_groups`` replicated)
is built in one process (:func:`ckptlab.plan.simulate_plans`, converted to torch ``SavePlan``
objects for torch). Then, on the same plans:

- **torch uncached**: ``DefaultSavePlanner(enable_plan_caching=True).create_global_plan`` on
  an empty cache (dedup, metadata, validation, and filling its cache);
- **torch hit**: the next call with every rank's plan unchanged (``SavePlan(usable=False)``);
- **torch 1 changed**: one rank sends a changed plan (one extra pickled entry); torch merges
  and recomputes the whole global plan;
- **ckptlab uncached**: :func:`ckptlab.plan.global_plan` (dedup, metadata, validation);
  **no-reuse**: the same with ``reuse_validation=False`` (each tensor validated on its own,
  not once per shape and sharding);
- **ckptlab hit** / **1 changed**: :class:`ckptlab.plan.PlanCache` with unchanged ranks sent
  as fingerprints, then the same one changed rank (an incremental re-plan);
- **finish**: torch's ``FileSystemWriter.finish`` (gathers every rank's write results into
  the metadata and pickles it to ``.metadata`` with fsync and rename) vs ckptlab's
  ``PlanCache.metadata`` hit + :func:`ckptlab.plan.write_metadata` (write results unchanged
  since the last save: the stored bytes, the very file torch wrote, are written with fsync,
  rename and a directory fsync).

Every result is checked: ckptlab's metadata has the same chunks as torch's for each tensor.
torch rows above ``--torch-max`` ranks are skipped (torch takes minutes there). Each ckptlab
cell is the median of ``--repeat`` runs; torch cells are single runs above 256 ranks.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from ckptlab.plan import PlanCache, WriteItem, global_plan, local_plan, simulate_plans
from ckptlab.plan.cache import structure_fingerprint, write_metadata
from ckptlab.plan.torch_plans import metadata_chunks, to_torch_metadata, to_torch_plan

TORCH_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
                "_cached_metadata", "_cached_final_save_plan")


def scratch() -> Path:
    """bench-out/plan in the repository (git ignores bench-out/)."""
    path = Path(__file__).resolve().parents[1] / "bench-out" / "plan"
    path.mkdir(parents=True, exist_ok=True)
    return path


def clear_torch_cache() -> None:
    for name in TORCH_CACHES:
        getattr(SavePlanner, name, {}).clear()


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def write_results(global_plans: list[SavePlan]) -> list[list[WriteResult]]:
    """Plausible write results: each rank's items back to back in its file."""
    out = []
    for r, plan in enumerate(global_plans):
        offset, results = 0, []
        for item in plan.items:
            n = (item.tensor_storage_size() or 64) + 1600
            results.append(WriteResult(item.index, n, _StorageInfo(f"__{r}_0.distcp", offset, n)))
            offset += n
        out.append(results)
    return out


def fmt(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.0f}" if seconds >= 0.01 else \
        f"{seconds * 1e3:.2f}"


def measure(n: int, args: argparse.Namespace) -> tuple:
    """One table row for ``n`` ranks."""
    plans = simulate_plans(args.model, n)
    n_items = sum(len(p.items) for p in plans)
    extra = WriteItem("rng_state.rank7", "bytes")
    r_changed = min(7, n - 1)
    changed = local_plan(r_changed, (*plans[r_changed].items, extra))

    # ckptlab
    t_ck, mine = timed(lambda: global_plan(plans), args.repeat)
    t_ck_nomemo, _ = timed(lambda: global_plan(plans, reuse_validation=False), args.repeat)
    cache = PlanCache()
    cache.plan("model", plans)
    fps = [p.fingerprint for p in plans]
    t_ck_hit, _ = timed(lambda: cache.plan("model", fps), args.repeat)
    sent = [changed if r == r_changed else fp for r, fp in enumerate(fps)]
    back = [p if r == r_changed else fp for r, (p, fp) in enumerate(zip(plans, fps))]

    def one_changed():  # alternate: the changed plan, then back, each a delta
        t0 = time.perf_counter()
        cache.plan("model", sent)
        t = time.perf_counter() - t0
        cache._results.clear()  # force the next call to be a delta, not a hit
        cache.plan("model", back)
        cache._results.clear()
        return t
    t_ck_delta = statistics.median(one_changed() for _ in range(args.repeat))
    assert cache.events[-1].status == "delta"

    t_torch = t_torch_hit = t_torch_delta = t_fin_torch = None
    if n <= args.torch_max:
        tplans = [to_torch_plan(p) for p in plans]
        t_changed = to_torch_plan(changed)
        clear_torch_cache()
        planner = DefaultSavePlanner(flatten_state_dict=False, enable_plan_caching=True)
        t_torch, (gplans, md) = timed(lambda: planner.create_global_plan(tplans))
        theirs = metadata_chunks(md)
        assert {f: sorted(c, key=lambda c: c.offsets) for f, (_, _, c) in theirs.items()} \
            == {f: sorted(e.chunks, key=lambda c: c.offsets)
                for f, e in mine.tensors.items()}, "ckptlab and torch disagree"
        unusable = [SavePlan([], usable=False)] * n
        reps = args.repeat if n <= 256 else 1
        t_torch_hit, _ = timed(lambda: planner.create_global_plan(unusable), reps)
        delta = [t_changed if r == r_changed else SavePlan([], usable=False)
                 for r in range(n)]
        t_torch_delta, _ = timed(lambda: planner.create_global_plan(delta))
        clear_torch_cache()
        results = write_results(gplans)
        with tempfile.TemporaryDirectory(dir=scratch()) as d:
            writer = FileSystemWriter(d)
            writer.set_up_storage_writer(True, rank=0, use_collectives=True)
            t_fin_torch, _ = timed(lambda: writer.finish(md, results))
            payload = (Path(d) / ".metadata").read_bytes()
        del tplans, gplans, results, md, planner
    # ckptlab finish: every rank's write results unchanged -> stored bytes
    res_fps = [structure_fingerprint([p.fingerprint]) for p in mine.plans]
    if t_fin_torch is None:
        payload = pickle.dumps(to_torch_metadata(mine))
    cache.metadata("model", res_fps, lambda: payload)
    with tempfile.TemporaryDirectory(dir=scratch()) as d:
        t_fin_ck, _ = timed(lambda: write_metadata(
            d, cache.metadata("model", res_fps, lambda: payload)), args.repeat)
    ratio = lambda a, b: "—" if a is None or b is None else f"{a / b:,.1f}"  # noqa: E731
    return (n, n_items, fmt(t_torch), fmt(t_torch_hit), fmt(t_torch_delta), fmt(t_ck),
            fmt(t_ck_nomemo), fmt(t_ck_hit), fmt(t_ck_delta), ratio(t_torch, t_ck),
            ratio(t_torch, t_torch_hit), ratio(t_torch_delta, t_ck_delta),
            fmt(t_fin_torch), fmt(t_fin_ck))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--torch-max", type=int, default=1024)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    header = ("ranks", "items", "torch ms", "torch hit", "torch 1chg", "ckptlab ms",
              "ckpt no-reuse", "ckpt hit", "ckpt 1chg", "uncached x", "hit/unc x", "1chg x", "fin torch",
              "fin ckpt")
    print(" | ".join(header), flush=True)
    for n in args.ranks:
        row = measure(n, args)
        print(" | ".join(map(str, row)), flush=True)
        gc.collect()
    print()
    print("ms = milliseconds; 'uncached x' = torch uncached / ckptlab uncached; 'hit/unc x' ="
          " torch uncached / torch hit; '1chg x' = torch one-changed / ckptlab one-changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
