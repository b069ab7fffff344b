"""Opening a DCP directory: ckptlab.open against torch's own reading of the same .metadata.

Issue 13, target 3: a DCP directory with 5,000 items opens in < 1 s; 1,000,000 items
(simulated 1024 ranks) in < 10 s, holding no more than 2x the metadata size in memory.

The directories are written by :func:`ckptlab.plan._synthetic_dcp.write_synthetic_dcp`: the
``Metadata`` torch's coordinator would build for tensors sharded row-wise over N ranks, built
from DCP's own classes and pickled as ``FileSystemWriter.finish`` pickles it, with the data
files ``dcp.save`` would write (real torch.save items up to 100,000 items, sparse files of
the right size for 1,000,000). Sizes: 268 items (67 tensors x 4 ranks), 5,000 (1,250 x 4),
100,000 (12,500 x 8) and 1,000,448 (977 x 1,024); each has one more item, a ``step`` object.

For each size, interleaved round by round (medians printed, wall and CPU seconds):

- ``ckptlab.open(dir)``: the checkpoint model (tensors built on first access);
- ``ckptlab.open(dir)`` then ``to_dict()`` (every tensor built, every item's header read:
  what ``ckptlab inspect DIR --json`` does), up to 100,000 items;
- ``torch.distributed.checkpoint.FileSystemReader(dir).read_metadata()``: torch's reading
  of the same ``.metadata`` (``pickle.load``: it executes the pickle, ckptlab never does);
- with ``--general``, ckptlab's general path (``open_dcp(dir, fast=False)``: every item read
  at open), one round, up to 5,000 items.

With ``--inspect``, for each size instead: ``ckptlab.inspect(dir)`` (``inspect_dcp``: the
``DcpLayout`` with every item's layout, through the columns and template items), the
commands ``ckptlab inspect DIR --json`` and ``ckptlab inspect DIR --records --json`` (each a
fresh process: wall time and the child's CPU time, interpreter start and imports included),
and with ``--general`` ``inspect_dcp(dir, fast=False)`` (the path all three took before: the
bounded interpreter and every item's zip scanned), one round, up to 100,000 items.

Peak memory is measured in fresh processes per size and reader: the Python heap's peak
(``tracemalloc``, which numpy's buffers report to) during the call, and, in another process
without tracemalloc, the peak resident set growth over the RSS after imports (``ru_maxrss``:
it also counts the pages of the mapped ``.metadata``; where the call stays under the peak
the imports reached, it shows that peak's excess instead). The load
average is printed: on a busy machine wall time exceeds CPU time; compare ratios of one run.

    .venv/bin/python benchmarks/dcp_open.py [--items 268 5000 100000 1000000] [--rounds 3]
        [--dir DIR] [--general] [--memory-only] [--inspect] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {268: (67, 4), 5000: (1250, 4), 100_000: (12_500, 8), 1_000_000: (977, 1024)}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _directory(base: Path, items: int) -> Path:
    from ckptlab.plan._synthetic_dcp import write_synthetic_dcp

    tensors, ranks = SHAPES.get(items, (max(1, items // 4), 4))
    data = "sparse" if items > 100_000 else "real"
    root = base / f"dcp-{items}-{data}"
    if not (root / ".metadata").exists():
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            write_synthetic_dcp(root, tensors=tensors, ranks=ranks, data=data)
        print(f"  wrote {root} in {time.perf_counter() - t0:.1f} s", flush=True)
    return root


def _ckptlab_open(root: Path) -> Any:
    import ckptlab

    return ckptlab.open(root)


def _ckptlab_all(root: Path) -> Any:
    import ckptlab

    return ckptlab.open(root).to_dict()


def _torch_metadata(root: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(root)).read_metadata()


def _general(root: Path) -> Any:
    from ckptlab.checkpoint._dcp import open_dcp

    return open_dcp(str(root), fast=False)


def _inspect(root: Path) -> Any:
    import ckptlab

    return ckptlab.inspect(root)


def _inspect_general(root: Path) -> Any:
    from ckptlab.dcp import inspect_dcp

    return inspect_dcp(root, fast=False)


READERS = {"ckptlab.open": _ckptlab_open, "ckptlab.open+to_dict": _ckptlab_all,
           "torch read_metadata": _torch_metadata, "ckptlab general path": _general,
           "cl.inspect": _inspect, "inspect_dcp general path": _inspect_general}


def _command(*argv: str) -> tuple[float, float]:
    """Wall and CPU seconds of ``python -m ckptlab ARGV`` (output discarded)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckptlab", *argv], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _inspect_rows(args: argparse.Namespace, base: Path) -> list[dict[str, Any]]:
    """``--inspect``: cl.inspect and the two inspect commands, per size."""
    results = []
    for items in args.items:
        root = _directory(base, items)
        jobs: dict[str, Any] = {
            "cl.inspect": lambda root=root: _time(_inspect, root),
            "ckptlab inspect DIR --json": lambda root=root: _command(
                "inspect", str(root), "--json"),
            "ckptlab inspect DIR --records --json": lambda root=root: _command(
                "inspect", str(root), "--records", "--json"),
        }
        _inspect(root)  # warm the page cache
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in jobs}
        names = list(jobs)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(jobs[name]())
        if args.general and items <= 100_000:
            times["inspect_dcp general path"] = [_time(_inspect_general, root)]
        row = {"items": items, "times": {n: {"wall_s": statistics.median(t[0] for t in ts),
                                              "cpu_s": statistics.median(t[1] for t in ts)}
                                          for n, ts in times.items()}}
        results.append(row)
        print(f"\n{items:,} items (inspect)", flush=True)
        for name, t in row["times"].items():
            print(f"  {name:<38} wall {t['wall_s']:8.3f} s   cpu {t['cpu_s']:8.3f} s")
    return results


def _time(fn: Any, root: Path) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn(root)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del result
    return wall, cpu


def _memory_child(root: str, reader: str, what: str) -> None:
    """In a fresh process: the peak heap (``what == "heap"``, under tracemalloc) or the peak
    RSS growth (``"rss"``, without tracemalloc, whose own bookkeeping would count) of one
    reader's call."""
    import resource
    import tracemalloc

    import numpy  # noqa: F401  (imports are not the call's memory)
    import torch.distributed.checkpoint  # noqa: F401

    import ckptlab.checkpoint._dcp_fast
    import ckptlab.checkpoint.open
    import ckptlab.dcp.columns  # noqa: F401

    fn = READERS[reader]
    with open(f"/proc/{os.getpid()}/statm") as f:
        base_rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if what == "heap":
        tracemalloc.start()
    result = fn(Path(root))
    heap = tracemalloc.get_traced_memory()[1] if what == "heap" else 0
    tracemalloc.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del result
    print(json.dumps({"heap_peak": heap, "rss_growth": peak - base_rss,
                      "rss_peak_before": base_peak}))


def _memory(root: Path, reader: str) -> dict[str, int]:
    def child(what: str) -> dict[str, int]:
        out = subprocess.run([sys.executable, __file__, "--memory-child", str(root), reader,
                              what], capture_output=True, text=True, check=True, cwd=ROOT)
        return json.loads(out.stdout.strip().splitlines()[-1])

    heap, rss = child("heap"), child("rss")
    return {"heap_peak": heap["heap_peak"], "rss_growth": rss["rss_growth"],
            "rss_peak_before": rss["rss_peak_before"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write the directories (kept: reused next time)")
    parser.add_argument("--general", action="store_true",
                        help="also time ckptlab's general path, one round (slow)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--memory-only", action="store_true",
                        help="only the memory figures (no timings)")
    parser.add_argument("--inspect", action="store_true",
                        help="time cl.inspect and `ckptlab inspect DIR --json/--records` "
                             "instead of the open (with --general: the general inspect_dcp)")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        _memory_child(*args.memory_child)
        return
    import torch

    print(f"ckptlab DCP open benchmark; torch {torch.__version__}; load {_load()}", flush=True)
    base = args.dir or Path(tempfile.mkdtemp(prefix="ckptlab-dcp-open-"))
    if args.inspect:
        rows = _inspect_rows(args, base)
        print(f"\nload at the end {_load()}")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    results = []
    for items in args.items:
        root = _directory(base, items)
        meta_nbytes = (root / ".metadata").stat().st_size
        names = ["ckptlab.open", "torch read_metadata"]
        if items <= 100_000:
            names.insert(1, "ckptlab.open+to_dict")
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        _ckptlab_open(root)  # warm the page cache and imports
        for r in range(0 if args.memory_only else args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(_time(READERS[name], root))
        if args.general and items <= 5000 and not args.memory_only:
            times["ckptlab general path"] = [_time(_general, root)]
        row: dict[str, Any] = {"items": items, "metadata_nbytes": meta_nbytes, "times": {}}
        for name, ts in times.items():
            if not ts:
                continue
            row["times"][name] = {"wall_s": statistics.median(t[0] for t in ts),
                                  "cpu_s": statistics.median(t[1] for t in ts)}
        row["memory"] = {n: _memory(root, n) for n in ("ckptlab.open", "torch read_metadata")}
        results.append(row)
        print(f"\n{items:,} items, .metadata {meta_nbytes / 1e6:.1f} MB", flush=True)
        for name, t in row["times"].items():
            print(f"  {name:<24} wall {t['wall_s']:8.3f} s   cpu {t['cpu_s']:8.3f} s")
        if row["times"]:
            mine = row["times"]["ckptlab.open"]
            theirs = row["times"]["torch read_metadata"]
            print(f"  ckptlab.open / torch read_metadata: wall "
                  f"{mine['wall_s'] / theirs['wall_s']:.2f}x, cpu "
                  f"{mine['cpu_s'] / theirs['cpu_s']:.2f}x (below 1: ckptlab faster)")
        for name, m in row["memory"].items():
            print(f"  {name:<24} heap peak {m['heap_peak'] / 1e6:8.1f} MB "
                  f"({m['heap_peak'] / meta_nbytes:.2f}x .metadata), RSS growth "
                  f"{m['rss_growth'] / 1e6:8.1f} MB ({m['rss_growth'] / meta_nbytes:.2f}x)")
    print(f"\nload at the end {_load()}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
