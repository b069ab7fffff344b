"""Benchmark: torch.save / torch.load vs ckptlab.gds save / load per backend, vs raw O_DIRECT.

Run from the repository root::

    .venv/bin/python benchmarks/gds.py [--size-mb 1024] [--tensor-mb 32] [--repeat 3]
                                       [--dir bench-out/gds] [--json out.json]

One run builds a state dict of ``--size-mb`` MiB of float32 tensors (``--tensor-mb`` each,
seeded random values) and measures, all on the same disk (``--dir``), in ``--repeat``
interleaved rounds (every row once per round; files deleted in between); the table shows the
median, best and worst:

- raw disk: the same bytes (staged untimed in one page-aligned buffer: incompressible, as the
  checkpoint's) written with O_DIRECT in 32 MiB requests, then fsync, and read back with
  O_DIRECT (the limit for everything else);
- ``torch.save`` + fsync at alignment 64 with CRC (torch's default) and at 4096 without CRC;
- ``ckptlab.gds.save`` with each host backend (``odirect``, ``posix``; fsync included), and
  ``odirect`` with ``fix_crc=True``;
- loads from a cold page cache (``posix_fadvise(DONTNEED)`` after the fsync drops the file's
  pages; O_DIRECT reads bypass the cache anyway): ``torch.load`` of the 64 and 4096 files,
  ``ckptlab.gds.load`` with each host backend;
- with CUDA: the GPU rows, interleaved likewise — ``ckptlab.gds.save/load`` from/to CUDA
  tensors with each cuFile backend that runs (``torch``, ``kvikio``) and with ``odirect``
  (staged through host memory), against ``torch.save`` / ``torch.load(map_location="cuda")``
  of the same CUDA state dict (wall time, device synchronized); the ``torch`` backend also
  with its buffers registered (``gds_register_buffer``).

Every saved file is checked: it must load with plain ``torch.load`` and equal the state dict.
Targets (issue 14, CPU; each ratio is the median over rounds of the ratio within a round):
``gds.save`` (odirect) >= 85% of raw O_DIRECT write; ``gds.load`` (odirect, to CPU) >= 1.5x
``torch.load`` of the same file (the ``gds.save`` output, row ``torch.load (gds file)``) and
>= 70% of raw O_DIRECT read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _rawdisk import odirect_write  # benchmarks/ is the script's directory
from torch.utils.serialization import config as ser_config

import ckptlab
import ckptlab.gds as gds
from ckptlab.gds._buffers import aligned_buffer
from ckptlab.gds.readiness import filesystem_of

CHUNK = 32 << 20
REPO = Path(__file__).resolve().parents[1]


def state_dict(size_mb: int, tensor_mb: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = max(1, size_mb // tensor_mb)
    numel = tensor_mb * (1 << 20) // 4
    return {f"layers.{i}.weight": torch.randn(numel, generator=gen) for i in range(n)}


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def staged_payload(sd: dict[str, torch.Tensor]) -> memoryview:
    """The state dict's bytes, back to back in one page-aligned buffer (staged untimed), so
    the raw disk row writes the same incompressible data as the checkpoint writers."""
    nbytes = sum(t.nbytes for t in sd.values())
    buf = aligned_buffer(-(-nbytes // 4096) * 4096)
    at = 0
    for t in sd.values():
        buf[at : at + t.nbytes] = memoryview(t.numpy()).cast("B")
        at += t.nbytes
    return buf


def raw_write(path: Path, payload: memoryview) -> float:
    """O_DIRECT writes of ``payload`` in 32 MiB requests, then fsync."""
    t = time.perf_counter()
    odirect_write(path, payload, CHUNK)
    return time.perf_counter() - t


def raw_read(path: Path) -> float:
    buf = aligned_buffer(CHUNK)
    size = path.stat().st_size
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        done = 0
        while done < size:
            got = os.preadv(fd, [buf], done)
            if got == 0:
                break
            done += got
    finally:
        os.close(fd)
    return time.perf_counter() - t


def torch_save(sd: dict, path: Path, alignment: int, crc: bool) -> float:
    with ser_config.patch({"save.storage_alignment": alignment, "save.compute_crc32": crc}):
        t = time.perf_counter()
        torch.save(sd, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter() - t


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


Row = tuple[str, Callable[[], Any], Callable[[Any], float]]  # label, setup, timed run


def run_rounds(rows: list[Row], repeat: int) -> dict[str, list[float]]:
    """Every row once per round, ``repeat`` rounds: a noisy disk hits all rows alike."""
    times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    for _ in range(repeat):
        for label, setup, run in rows:
            times[label].append(run(setup()))
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--tensor-mb", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=REPO / "bench-out" / "gds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    sd = state_dict(args.size_mb, args.tensor_mb)
    nbytes = sum(t.nbytes for t in sd.values())
    free = shutil.disk_usage(args.dir).free
    if free < 5 * nbytes:
        print(f"need {5 * nbytes / 1e9:.1f} GB free in {args.dir}, have {free / 1e9:.1f} GB")
        return 1
    fs, mount = filesystem_of(args.dir)
    print(f"python {platform.python_version()} · torch {torch.__version__} · ckptlab "
          f"{ckptlab.__version__} · {os.cpu_count()} cpus · load {os.getloadavg()[0]:.2f} · "
          f"{fs} on {mount} · payload {nbytes / 2**20:.0f} MiB in {len(sd)} tensors · "
          f"{args.repeat} interleaved rounds")
    for status in gds.backend_status():
        print(f"  backend {status.name:8} {'yes' if status.available else 'no ':3} "
              f"{status.reason}")
    out = args.dir / "bench.pt"
    raw = args.dir / "raw.bin"
    payload = staged_payload(sd)

    def clean() -> None:
        for f in (out, raw):
            if f.exists():
                f.unlink()

    backends = [s.name for s in gds.backend_status() if s.available and s.name in
                ("odirect", "posix")]
    paths_taken: dict[str, str] = {}

    def gds_save(backend: str, fix_crc: bool = False) -> Callable[[Any], float]:
        def run(_: Any) -> float:
            report = gds.save(sd, out, backend=backend, fix_crc=fix_crc)
            paths_taken[backend] = report.io_path
            return report.duration_s
        return run

    saves: list[Row] = [
        ("raw O_DIRECT write", clean, lambda _: raw_write(raw, payload)),
        ("torch.save (64, crc)", clean, lambda _: torch_save(sd, out, 64, True)),
        ("torch.save (4096, no crc)", clean, lambda _: torch_save(sd, out, 4096, False)),
        *[(f"ckptlab.gds.save ({b})", clean, gds_save(b)) for b in backends],
        ("ckptlab.gds.save (odirect, fix_crc)", clean, gds_save("odirect", True)),
    ]
    times = run_rounds(saves, args.repeat)
    # every writer's output loads with plain torch.load and equals the state dict
    for label, setup, run in saves[1:]:
        setup()
        run(None)
        assert equal(sd, torch.load(out, weights_only=True)), label
    clean()
    files = {}
    for tag, alignment, crc in (("64", 64, True), ("4096", 4096, False)):
        files[tag] = args.dir / f"torch-{tag}.pt"
        torch_save(sd, files[tag], alignment, crc)
    files["gds"] = args.dir / "gds.pt"
    gds.save(sd, files["gds"], fix_crc=True)
    raw_write(raw, payload)

    def load_torch(f: Path) -> Callable[[Any], float]:
        def run(_: Any) -> float:
            t = time.perf_counter()
            obj = torch.load(f, weights_only=True)
            elapsed = time.perf_counter() - t
            assert equal(sd, obj)
            return elapsed
        return run

    def load_gds(backend: str) -> Callable[[Any], float]:
        def run(_: Any) -> float:
            obj, report = gds.load(files["gds"], "cpu", backend=backend)
            assert equal(sd, obj)
            return report.duration_s
        return run

    loads: list[Row] = [
        ("raw O_DIRECT read", lambda: drop_cache(raw), lambda _: raw_read(raw)),
        ("torch.load (64)", lambda: drop_cache(files["64"]), load_torch(files["64"])),
        ("torch.load (4096)", lambda: drop_cache(files["4096"]), load_torch(files["4096"])),
        ("torch.load (gds file)", lambda: drop_cache(files["gds"]), load_torch(files["gds"])),
        *[(f"ckptlab.gds.load ({b})", lambda: drop_cache(files["gds"]), load_gds(b))
          for b in backends],
    ]
    times.update(run_rounds(loads, args.repeat))
    if torch.cuda.is_available():
        times.update(gpu_benchmark(sd, args))
    rows = {k: statistics.median(v) for k, v in times.items()}

    print(f"\n{'row':40} {'median s':>9} {'GB/s':>6} {'best GB/s':>9} {'worst GB/s':>10}")
    for label, seconds in rows.items():
        ts = times[label]
        print(f"{label:40} {seconds:>9.3f} {nbytes / seconds / 1e9:>6.2f} "
              f"{nbytes / min(ts) / 1e9:>9.2f} {nbytes / max(ts) / 1e9:>10.2f}")
    gbps = {k: nbytes / v / 1e9 for k, v in rows.items()}

    def paired(fast: str, slow: str) -> float:
        """Median over rounds of slow/fast seconds in the same round (drift cancels)."""
        return statistics.median(b / a for a, b in zip(times[fast], times[slow]))

    vs_torch = paired("ckptlab.gds.save (odirect)", "torch.save (64, crc)")
    vs_raw = paired("raw O_DIRECT write", "ckptlab.gds.save (odirect)") ** -1
    load_vs_torch = paired("ckptlab.gds.load (odirect)", "torch.load (gds file)")
    load_vs_raw = paired("raw O_DIRECT read", "ckptlab.gds.load (odirect)") ** -1

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    print("\nratios: median over rounds of the ratio within each round")
    print(f"ckptlab.gds.save (odirect, {paths_taken.get('odirect')}): {vs_torch:.2f}x "
          f"torch.save default, {100 * vs_raw:.0f}% of raw O_DIRECT write (target >= 85%: "
          f"{verdict(vs_raw >= 0.85)})")
    print(f"ckptlab.gds.load (odirect): {load_vs_torch:.2f}x torch.load of the same file "
          f"(target >= 1.5x: {verdict(load_vs_torch >= 1.5)}), {100 * load_vs_raw:.0f}% of raw "
          f"O_DIRECT read (target >= 70%: {verdict(load_vs_raw >= 0.7)})")
    if not torch.cuda.is_available():
        print("no CUDA device: GPU rows not run")
    for b in gpu_backends() if torch.cuda.is_available() else []:
        print(f"GPU ckptlab.gds.save ({b}): "
              f"{paired(f'GPU ckptlab.gds.save ({b})', GPU_SAVE_BASE):.2f}x torch.save of the "
              f"CUDA tensors; gds.load ({b}): "
              f"{paired(f'GPU ckptlab.gds.load ({b})', GPU_LOAD_BASE):.2f}x "
              "torch.load(map_location='cuda')")
    if args.json:
        args.json.write_text(json.dumps({"nbytes": nbytes, "seconds": times, "gbps": gbps,
                                         "load": os.getloadavg(), "fs": fs}, indent=1))
    for f in args.dir.glob("*"):
        f.unlink()
    return 0


GPU_SAVE_BASE, GPU_LOAD_BASE = "GPU torch.save (64, crc)", "GPU torch.load (64)"


def gpu_backends() -> list[str]:
    """The backends the GPU rows run: the cuFile ones that run here, and odirect (CUDA
    storages staged through host memory)."""
    return [s.name for s in gds.backend_status()
            if s.available and s.name in ("torch", "kvikio")] + ["odirect"]


def gpu_benchmark(sd: dict, args: argparse.Namespace) -> dict[str, list[float]]:
    """GPU rows, interleaved like the host rows: each backend's ``gds.save`` of CUDA tensors
    and ``gds.load`` into CUDA memory (wall time, the device synchronized) against
    ``torch.save`` / ``torch.load(map_location="cuda")`` of the same state dict."""
    cuda_sd = {k: v.cuda() for k, v in sd.items()}
    torch.cuda.synchronize()
    backends = gpu_backends()
    for name in ("torch", "kvikio"):
        if name not in backends:
            why = next(s.reason for s in gds.backend_status() if s.name == name)
            print(f"GPU: backend {name} not run ({why})")
    path = {b: args.dir / f"gpu-{b}.pt" for b in ["torch.save", *backends]}

    def clean(b: str) -> Callable[[], None]:
        return lambda: path[b].unlink(missing_ok=True)

    def timed(fn: Callable[[], Any]) -> float:
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        assert equal(sd, getattr(out, "obj", out))  # a LoadResult, or torch.load's dict
        return elapsed

    def save(b: str) -> Callable[[Any], float]:
        def run(_: Any) -> float:
            t = time.perf_counter()
            gds.save(cuda_sd, path[b], backend=b)
            return time.perf_counter() - t
        return run

    saves: list[Row] = [
        (GPU_SAVE_BASE, clean("torch.save"),
         lambda _: torch_save(cuda_sd, path["torch.save"], 64, True)),
        *[(f"GPU ckptlab.gds.save ({b})", clean(b), save(b)) for b in backends]]
    rows = run_rounds(saves, args.repeat)
    for b in backends:
        assert equal(sd, torch.load(path[b], weights_only=True)), b
    loads: list[Row] = [
        (GPU_LOAD_BASE, lambda: drop_cache(path["torch.save"]),
         lambda _: timed(lambda: torch.load(path["torch.save"], map_location="cuda",
                                            weights_only=True))),
        *[(f"GPU ckptlab.gds.load ({b})", lambda b=b: drop_cache(path[b]),
           lambda _, b=b: timed(lambda: gds.load(path[b], "cuda", backend=b)))
          for b in backends]]
    rows.update(run_rounds(loads, args.repeat))
    if "torch" in backends:
        from torch.cuda.gds import gds_deregister_buffer, gds_register_buffer

        storages = [t.untyped_storage() for t in cuda_sd.values()]
        for s in storages:
            gds_register_buffer(s)
        try:
            rows.update(run_rounds([("GPU ckptlab.gds.save (torch, registered)",
                                     clean("torch"), save("torch"))], args.repeat))
        finally:
            for s in storages:
                gds_deregister_buffer(s)
    return rows


if __name__ == "__main__":
    sys.exit(main())
