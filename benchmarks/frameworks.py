"""Reading what DeepSpeed and tensorizer wrote: ckptlab against each library's own reader.

- DeepSpeed ZeRO 2 and 3 saves (two CPU ranks, four ``W`` x ``W`` linear layers, bf16 with
  fp32 master weights and Adam): every parameter's fp32 master weights through
  ``cl.open(run).read("fp32.<name>")`` against DeepSpeed's
  ``get_fp32_state_dict_from_zero_checkpoint`` (what ``zero_to_fp32.py`` runs), each in a
  fresh process: seconds and peak RSS. The results are checked equal.
- tensorizer: a state dict of ``N`` tensors (``--size-mib`` in all): ``cl.open`` alone,
  ``cl.open`` + ``read`` of every tensor (hashes checked), against ``TensorDeserializer``
  with ``verify_hash=True`` loading everything, and with ``lazy_load=True`` (open only).

    python benchmarks/frameworks.py [--size-mib 256] [--rounds 3] [--width 1024]
"""

from __future__ import annotations

import statistics
import sys

from _child import run_child, size_args  # (benchmarks/ is this script's directory)

RSS = "import resource; rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"

WARM = """
import sys, time, json, torch  # imported before the clock, as the libraries import it
import ckptlab as cl
t = time.perf_counter()
import ckptlab.checkpoint.open, ckptlab.checkpoint.deepspeed, ckptlab.checkpoint._tensors
import ckptlab.format.tensorizer  # ckptlab's own first-use imports, timed on their own
imports = time.perf_counter() - t
"""

DS_CKPTLAB = WARM + """
t = time.perf_counter()
ck = cl.open(sys.argv[1])
total = 0
for name in ck.tensors:
    if name.startswith("fp32."):
        total += ck.read(name).float().sum().item()
s = time.perf_counter() - t
""" + RSS + """print(json.dumps({"s": s, "imports_s": imports, "rss_mib": rss, "sum": total}))"""

DS_THEIRS = """
import sys, time, json, os, io, contextlib
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
t = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
total = sum(v.contiguous().float().sum().item() for k, v in sd.items())
s = time.perf_counter() - t
""" + RSS + """print(json.dumps({"s": s, "rss_mib": rss, "sum": total}))"""

TZ_WRITE = """
import sys, torch
from tensorizer import TensorSerializer
n, mib = int(sys.argv[2]), int(sys.argv[3])
each = mib * 2**20 // 4 // n
torch.manual_seed(0)
s = TensorSerializer(sys.argv[1])
s.write_state_dict({f"layer{i}.weight": torch.randn(each) for i in range(n)})
s.close()
print("{}")
"""

TZ_OPEN = WARM + """
t = time.perf_counter()
ck = cl.open(sys.argv[1])
opened = time.perf_counter() - t
total = 0.0
if sys.argv[2] == "read":
    for name in ck.tensors:
        total += ck.read(name).sum().item()
s = time.perf_counter() - t
""" + RSS + """print(json.dumps({"s": s, "open_s": opened, "imports_s": imports, "rss_mib": rss,
                  "sum": total}))"""

TZ_THEIRS = """
import sys, time, json
from tensorizer import TensorDeserializer
t = time.perf_counter()
total = 0.0
if sys.argv[2] == "read":
    with TensorDeserializer(sys.argv[1], device="cpu", verify_hash=True) as d:
        total = sum(v.sum().item() for v in d.values())
else:
    d = TensorDeserializer(sys.argv[1], device="cpu", lazy_load=True)
    d.close()
s = time.perf_counter() - t
""" + RSS + """print(json.dumps({"s": s, "rss_mib": rss, "sum": total}))"""


def _best(code: str, rounds: int, *argv: object) -> dict[str, float]:
    runs = [run_child(code, *argv) for _ in range(rounds)]
    best = min(runs, key=lambda r: r["s"])
    best["median_s"] = statistics.median(r["s"] for r in runs)
    return best


def main() -> None:
    sys.argv, width = _width(sys.argv)
    args, base = size_args(__doc__, "ckptlab-frameworks-")
    from ckptlab.testing.deepspeed_run import write_run

    print(f"DeepSpeed: 4 x {width}x{width} linear layers, bf16, two ranks; best of "
          f"{args.rounds} fresh processes (torch and each reader's modules imported before the "
          "clock; ckptlab's first-use imports shown apart)")
    for stage in (2, 3):
        run = base / f"zero{stage}"
        if not (run / "latest").exists():
            write_run(stage, run, port=29651 + stage, width=width)
        mine = _best(DS_CKPTLAB, args.rounds, run)
        theirs = _best(DS_THEIRS, args.rounds, run)
        assert abs(mine["sum"] - theirs["sum"]) <= 1e-6 * max(1.0, abs(theirs["sum"])), \
            (mine, theirs)
        size = sum(f.stat().st_size for f in (run / "global_step2").iterdir()) / 2**20
        print(f"  ZeRO {stage} ({size:.0f} MiB): ckptlab {mine['s']:.3f} s, "
              f"{mine['rss_mib']:.0f} MiB peak; zero_to_fp32 {theirs['s']:.3f} s, "
              f"{theirs['rss_mib']:.0f} MiB peak; ratio {theirs['s'] / mine['s']:.2f}x "
              f"(ckptlab's imports {mine['imports_s']:.3f} s)")
    for count in (16, 2000):
        path = base / f"model-{count}.tensors"
        if not path.exists():
            run_child(TZ_WRITE, path, count, args.size_mib)
        print(f"tensorizer: {count} tensors, {args.size_mib} MiB; best of {args.rounds}")
        opened = _best(TZ_OPEN, args.rounds, path, "open")
        lazy = _best(TZ_THEIRS, args.rounds, path, "open")
        print(f"  open: ckptlab {opened['s']:.3f} s; TensorDeserializer(lazy_load=True) "
              f"{lazy['s']:.3f} s; ratio {lazy['s'] / opened['s']:.2f}x (ckptlab's imports "
              f"{opened['imports_s']:.3f} s)")
        read = _best(TZ_OPEN, args.rounds, path, "read")
        full = _best(TZ_THEIRS, args.rounds, path, "read")
        assert abs(read["sum"] - full["sum"]) <= 1e-6 * max(1.0, abs(full["sum"]))
        print(f"  read all (hashes checked): ckptlab {read['s']:.3f} s, "
              f"{read['rss_mib']:.0f} MiB peak; TensorDeserializer(verify_hash=True) "
              f"{full['s']:.3f} s, {full['rss_mib']:.0f} MiB peak; ratio "
              f"{full['s'] / read['s']:.2f}x")


def _width(argv: list[str]) -> tuple[list[str], int]:
    if "--width" in argv:
        i = argv.index("--width")
        return argv[:i] + argv[i + 2:], int(argv[i + 1])
    return argv, 1024


if __name__ == "__main__":
    main()
