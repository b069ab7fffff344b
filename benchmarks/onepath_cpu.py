"""CPU time of opening a checkpoint with one interpreter (issue 27), the collector on.

End to end ``ckptlab.inspect(path)`` / ``ckptlab.open(path)`` against
``torch.load(path, map_location="meta")`` (``weights_only=False`` for a whole module), on
the checkpoints of benchmarks/open.py (``plain``: ``{"layer.{i}.weight": torch.empty(2)}``;
``module``: ``n / 4`` blocks of [Linear(2, 2), LayerNorm(2)] pickled whole). CPU time
(``time.process_time``), best of N, the garbage collector ON (as users get it), one untimed
warm-up call each. Files are written once into --dir and reused. ``--impl python`` runs
the pickle interpreter, torch's handlers and the walk in Python (the reference without the
compiled seam; ``c``, the default where it is built, is what users get).

    python benchmarks/onepath_cpu.py [--sizes 10000 100000] [--kinds plain module]
        [--repeat 5] [--torch-repeat 2] [--no-torch-large] [--impl c|python] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from open import KINDS  # noqa: E402

import ckptlab  # noqa: E402


def cpu(fn, n, *args, **kwargs):
    best = float("inf")
    for _ in range(n):
        gc.collect()
        t = time.process_time()
        fn(*args, **kwargs)
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--kinds", nargs="+", default=["plain", "module"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--torch-repeat", type=int, default=2)
    ap.add_argument("--no-torch-large", action="store_true")
    ap.add_argument("--dir", default="/tmp/onepath-bench")
    ap.add_argument("--json")
    ap.add_argument("--impl", choices=["c", "python"], default=None)
    a = ap.parse_args()
    from ckptlab.format import _pickle

    _pickle._IMPL = a.impl
    print(f"ckptlab {ckptlab.__file__}  impl {a.impl or 'default'}  gc {gc.isenabled()}  "
          f"load {os.getloadavg()[0]:.2f}")
    out = []
    for kind in a.kinds:
        for n in a.sizes:
            path = os.path.join(a.dir, f"{kind}{n}.pt")
            if not os.path.exists(path):
                torch.save(KINDS[kind](n), path)
            ckptlab.inspect(path), ckptlab.open(path)
            rep = a.repeat if n < 100_000 else max(2, a.repeat // 2)
            ins = cpu(ckptlab.inspect, rep, path)
            opn = cpu(ckptlab.open, rep, path)
            tl = None
            if not (a.no_torch_large and n >= 100_000):
                extra = {"weights_only": False} if kind == "module" else {}
                tl = cpu(torch.load, a.torch_repeat, path, map_location="meta", **extra)
            r = {"kind": kind, "n": n, "inspect_ms": ins * 1e3, "open_ms": opn * 1e3,
                 "torch_ms": None if tl is None else tl * 1e3}
            out.append(r)
            x = "" if tl is None else f"  torch {tl*1e3:8.1f}  x inspect {tl/ins:5.2f}  x open {tl/opn:5.2f}"
            print(f"{kind:6} {n:>7}  inspect {ins*1e3:8.1f}  open {opn*1e3:8.1f}{x}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
