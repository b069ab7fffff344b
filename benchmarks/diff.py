"""Comparing and measuring checkpoints: ``ckptlab.diff`` and ``ckptlab.stats`` against the
obvious alternative, measured in the same run (issue 30's figures).

Two checkpoints of ``--size-mib`` MiB of float32 tensors (64 of them): A a safetensors file,
B a torch.save file of the same tensors (``identical``) or with 10% of them changed
(``changed``). Each measurement runs in a fresh process (wall time, and the peak RSS growth
over the RSS after imports):

- ``read``: both files read once, sequentially, from the page cache (the floor);
- ``ckptlab.diff(A, B)``;
- the alternative: ``torch.load(B, mmap=True, weights_only=True)`` and
  ``safetensors.torch.load_file(A)``, then a Python loop of ``torch.equal`` and
  ``(a - b).abs().max()`` per tensor;
- ``ckptlab.stats(A)`` against reading A once and against ``load_file(A)`` with torch's
  reductions (``min``, ``max``, ``mean``, ``std``, ``histc``, NaN/Inf/zero counts in
  float64) per tensor; A in float32, and a bfloat16 copy of it.

    .venv/bin/python benchmarks/diff.py [--size-mib 1024] [--dir DIR] [--rounds 3]
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from _child import run_child, size_args  # (benchmarks/ is this script's directory)

CHILD = r"""
import json, os, resource, sys, time
job, a, b = sys.argv[1], sys.argv[2], sys.argv[3]
import torch, numpy
from safetensors.torch import load_file
import ckptlab as cl
import ckptlab.checkpoint, ckptlab.compare  # imported before the clock starts, as torch is
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
if job == "read":
    for p in (a, b):
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass
elif job == "read_a":
    with open(a, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass
elif job == "ckptlab":
    d = cl.diff(a, b)
    out = d.counts()
elif job == "torch":
    ta = load_file(a)
    tb = torch.load(b, mmap=True, weights_only=True)
    out = {"identical": 0, "changed": 0}
    for k, x in ta.items():
        y = tb[k]
        if torch.equal(x, y):
            out["identical"] += 1
        else:
            (x.double() - y.double()).abs().max().item()
            out["changed"] += 1
elif job == "stats":
    cl.stats(a)
elif job == "load_stats":  # the obvious alternative: load, then torch's reductions per tensor
    for tensor in load_file(a).values():
        x = tensor.double()
        f = x[torch.isfinite(x)]
        f.min(), f.max(), f.mean(), f.std(correction=0), torch.histc(f, 64)
        torch.isnan(x).sum(), torch.isinf(x).sum(), (x == 0).sum()
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"wall": wall, "rss_mib": (peak - base) / 1024}))
"""


def _run(job: str, a: Path, b: Path) -> dict[str, float]:
    return run_child(CHILD, job, a, b)


def _write(base: Path, size_mib: int) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    paths = {"a": base / "a.safetensors", "identical": base / "b_identical.pt",
             "changed": base / "b_changed.pt", "bf16": base / "a_bf16.safetensors"}
    if all(p.exists() for p in paths.values()):
        return paths
    n = 64
    numel = size_mib * (1 << 20) // 4 // n
    torch.manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(numel) for i in range(n)}
    save_file(state, str(paths["a"]))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(paths["bf16"]))
    torch.save(state, paths["identical"])
    for i in range(0, n, 10):  # 10% of the tensors (7 of 64) changed
        state[f"layers.{i}.weight"] += 1e-3
    torch.save(state, paths["changed"])
    return paths


def main() -> None:
    args, base = size_args(__doc__, "ckptlab-diff-")
    paths = _write(base, args.size_mib)
    print(f"ckptlab diff/stats benchmark: 2 x {args.size_mib} MiB, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    for case in ("identical", "changed"):
        b = paths[case]
        _run("read", paths["a"], b)  # warm the page cache
        rows: dict[str, list[dict[str, float]]] = {"read": [], "ckptlab": [], "torch": []}
        for _ in range(args.rounds):
            for job in rows:
                rows[job].append(_run(job, paths["a"], b))
        med = {job: (statistics.median(r["wall"] for r in rs),
                     max(r["rss_mib"] for r in rs)) for job, rs in rows.items()}
        print(f"\n{case}:")
        for job, (wall, rss) in med.items():
            print(f"  {job:8} wall {wall:7.3f} s   peak RSS growth {rss:8.1f} MiB")
        print(f"  ckptlab / torch: time {med['ckptlab'][0] / med['torch'][0]:.2f}x, "
              f"RSS {med['ckptlab'][1] / max(med['torch'][1], 1e-9):.2f}x; "
              f"ckptlab / read both files once: {med['ckptlab'][0] / med['read'][0]:.2f}x",
              flush=True)
    for label, path in (("float32", paths["a"]), ("bfloat16", paths["bf16"])):
        _run("read_a", path, path)  # warm the page cache
        reads = [_run("read_a", path, path)["wall"] for _ in range(args.rounds)]
        st = [_run("stats", path, path) for _ in range(args.rounds)]
        alt = [_run("load_stats", path, path) for _ in range(args.rounds)]
        read_s = statistics.median(reads)
        stats_s = statistics.median(r["wall"] for r in st)
        alt_s = statistics.median(r["wall"] for r in alt)
        print(f"\nstats of A ({label}, {path.stat().st_size / 2**20:,.0f} MiB): {stats_s:.3f} s "
              f"(peak RSS growth {max(r['rss_mib'] for r in st):.1f} MiB), reading it once "
              f"{read_s:.3f} s: {read_s / stats_s:.0%} of the plain read speed; load_file + "
              f"torch's reductions {alt_s:.3f} s ({max(r['rss_mib'] for r in alt):.0f} MiB): "
              f"ckptlab {alt_s / stats_s:.1f}x faster", flush=True)


if __name__ == "__main__":
    main()
