"""Converting a checkpoint: ``ckptlab.convert`` against the usual way, measured in the same run
(issue 29's figures).

A torch.save file of ``--size-mib`` MiB of float32 tensors (64 of them) is converted to
safetensors (and to torch.save at alignment 4096). Each measurement runs in a fresh process
(wall time, and the peak resident memory growth over the RSS after imports: ``VmHWM``
reset through ``/proc/self/clear_refs``), the source in the page cache:

- ``write``: the plain disk write speed: the file's size written with ``os.write`` in 16 MiB
  blocks and fsynced (what a converter cannot beat);
- ``ckptlab``: ``ckptlab.convert(src, dst)``, its verification included (every tensor read
  back and compared) and ``verify=False`` apart;
- ``torch``: ``torch.load(src, weights_only=False)`` + ``safetensors.torch.save_file``, then
  an fsync: the usual way, which runs the pickle and holds every tensor at once.

    .venv/bin/python benchmarks/convert.py [--size-mib 1024] [--dir DIR] [--rounds 3]
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from _child import run_child, size_args  # (benchmarks/ is this script's directory)

CHILD = r"""
import json, os, sys, time
job, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
from safetensors.torch import save_file
import ckptlab
import ckptlab.checkpoint, ckptlab.write.convert  # imported before the clock starts
import torch._subclasses.fake_tensor  # (the torch target's: 2.5 s of imports, once a process)
if os.path.exists(dst):
    os.remove(dst)
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))
with open("/proc/self/clear_refs", "w") as f:  # the peak from here on (VmHWM reset)
    f.write("5")
base = status("VmRSS:")
t = time.perf_counter()
if job == "write":
    n = os.path.getsize(src)
    block = b"\x01" * (16 << 20)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    done = 0
    while done < n:
        done += os.write(fd, block[: min(len(block), n - done)])
    os.fsync(fd)
    os.close(fd)
elif job == "ckptlab":
    ckptlab.convert(src, dst)
elif job == "ckptlab-noverify":
    ckptlab.convert(src, dst, verify=False)
elif job == "ckptlab-torch4096":
    ckptlab.convert(src, dst, to="torch", alignment=4096, verify=False)
elif job == "torch":
    save_file(torch.load(src, weights_only=False), dst)
    fd = os.open(dst, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
wall = time.perf_counter() - t
peak = status("VmHWM:")
os.remove(dst)
print(json.dumps({"wall": wall, "rss_mib": (peak - base) / 1024}))
"""

JOBS = ("write", "ckptlab", "ckptlab-noverify", "ckptlab-torch4096", "torch")


def _run(job: str, src: Path, dst: Path) -> dict[str, float]:
    return run_child(CHILD, job, src, dst)


def main() -> None:
    args, base = size_args(__doc__, "ckptlab-convert-")
    src = base / "src.pt"
    if not src.exists():
        import torch

        n = 64
        numel = args.size_mib * (1 << 20) // 4 // n
        torch.manual_seed(0)
        torch.save({f"layers.{i}.weight": torch.randn(numel) for i in range(n)}, src)
    dst = base / "dst.out"
    with open(src, "rb", buffering=0) as f:  # the source in the page cache
        while f.read(1 << 24):
            pass
    print(f"ckptlab convert benchmark: {args.size_mib} MiB torch.save -> safetensors, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows: dict[str, list[dict[str, float]]] = {job: [] for job in JOBS}
    for _ in range(args.rounds):
        for job in JOBS:
            rows[job].append(_run(job, src, dst))
    med = {job: (statistics.median(r["wall"] for r in rs), max(r["rss_mib"] for r in rs))
           for job, rs in rows.items()}
    for job, (wall, rss) in med.items():
        print(f"  {job:18} wall {wall:7.3f} s   peak RSS growth {rss:8.1f} MiB")
    write = med["write"][0]
    for job in ("ckptlab", "ckptlab-noverify", "ckptlab-torch4096"):
        print(f"  {job}: {write / med[job][0]:.0%} of the plain write speed; "
              f"{med['torch'][0] / med[job][0]:.2f}x the speed of torch.load + save_file, "
              f"RSS {med[job][1] / max(med['torch'][1], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
