"""Benchmark: torch.save / torch.load vs ckptlab.gds save / load per backend, vs raw O_DIRECT.

Run from the repository root::

    .venv/bin/python benchmarks/gds.py [--size-mb 1024] [--tensor-mb 32] [--repeat 3]
                                       [--dir bench-out/gds] [--json out.json]

One run builds a state dict of ``--size-mb`` MiB of float32 tensors (``--tensor-mb`` each,
seeded random values) and measures, all on the same disk (``--dir``), each row the median
of ``--repeat`` runs with the file deleted in between:

- raw disk: write the same number of bytes from a page-aligned buffer with O_DIRECT in 32 MiB
  requests, then fsync; read them back with O_DIRECT (the limit for everything else);
- ``torch.save`` + fsync at alignment 64 with CRC (torch's default) and at 4096 without CRC;
- ``ckptlab.gds.save`` with each host backend (``odirect``, ``posix``; fsync included), and
  ``odirect`` with ``fix_crc=True``;
- loads from a cold page cache (``posix_fadvise(DONTNEED)`` after the fsync drops the file's
  pages; O_DIRECT reads bypass the cache anyway): ``torch.load`` of the 64 and 4096 files,
  ``ckptlab.gds.load`` with each host backend;
- with CUDA and cuFile (``torch.cuda.gds``): the GPU rows — ``ckptlab.gds.save/load`` with the
  ``torch`` backend from/to CUDA tensors, registered (``gds_register_buffer``) and not, against
  ``torch.save``/``torch.load`` of the same CUDA state dict.

Every saved file is checked: it must load with plain ``torch.load`` and equal the state dict.
Targets (issue 6, CPU): ckptlab.gds save >= 2x torch.save (default config) and >= 80% of raw
O_DIRECT write.
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


def raw_write(path: Path, nbytes: int) -> float:
    buf = aligned_buffer(CHUNK)
    buf[:] = os.urandom(1024) * (CHUNK // 1024)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        done = 0
        while done < nbytes:
            n = min(CHUNK, nbytes - done)
            n -= n % 4096
            done += os.pwrite(fd, buf[: n or 4096], done)
        os.fsync(fd)
    finally:
        os.close(fd)
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


def median_of(repeat: int, setup: Callable[[], Any], run: Callable[[Any], float]) -> float:
    times = []
    for _ in range(repeat):
        state = setup()
        times.append(run(state))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--tensor-mb", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=REPO / "bench-out" / "gds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    sd = state_dict(args.size_mb, args.tensor_mb)
    nbytes = sum(t.nbytes for t in sd.values())
    free = shutil.disk_usage(args.dir).free
    if free < 3 * nbytes:
        print(f"need {3 * nbytes / 1e9:.1f} GB free in {args.dir}, have {free / 1e9:.1f} GB")
        return 1
    fs, mount = filesystem_of(args.dir)
    print(f"python {platform.python_version()} · torch {torch.__version__} · ckptlab "
          f"{ckptlab.__version__} · {os.cpu_count()} cpus · load {os.getloadavg()[0]:.2f} · "
          f"{fs} on {mount} · payload {nbytes / 2**20:.0f} MiB in {len(sd)} tensors")
    for status in gds.backend_status():
        print(f"  backend {status.name:8} {'yes' if status.available else 'no ':3} "
              f"{status.reason}")
    path = args.dir / "bench.pt"
    rows: dict[str, float] = {}

    def clean() -> None:
        if path.exists():
            path.unlink()

    rows["raw O_DIRECT write"] = median_of(args.repeat, clean, lambda _: raw_write(path, nbytes))
    rows["raw O_DIRECT read"] = median_of(args.repeat, lambda: drop_cache(path),
                                          lambda _: raw_read(path))
    for label, alignment, crc in (("torch.save (64, crc)", 64, True),
                                  ("torch.save (4096, no crc)", 4096, False)):
        rows[label] = median_of(args.repeat, clean, lambda _, a=alignment, c=crc:
                                torch_save(sd, path, a, c))
        assert equal(sd, torch.load(path, weights_only=True)), label
        drop_cache(path)
        tag = "64" if alignment == 64 else "4096"
        shutil.copyfile(path, args.dir / f"torch-{tag}.pt")
        drop_cache(args.dir / f"torch-{tag}.pt")
    backends = [s.name for s in gds.backend_status() if s.available and s.name in
                ("odirect", "posix")]
    paths_taken = {}
    for backend in backends:
        label = f"ckptlab.gds.save ({backend})"

        def run(_: Any, b: str = backend) -> float:
            report = gds.save(sd, path, backend=b)
            paths_taken[b] = report.io_path
            return report.seconds

        rows[label] = median_of(args.repeat, clean, run)
        assert equal(sd, torch.load(path, weights_only=True)), label
    rows["ckptlab.gds.save (odirect, fix_crc)"] = median_of(
        args.repeat, clean, lambda _: gds.save(sd, path, backend="odirect", fix_crc=True).seconds)
    gds_file = args.dir / "gds.pt"
    shutil.copyfile(path, gds_file)
    for tag in ("64", "4096"):
        f = args.dir / f"torch-{tag}.pt"

        def load_torch(_: Any, f: Path = f) -> float:
            t = time.perf_counter()
            out = torch.load(f, weights_only=True)
            elapsed = time.perf_counter() - t
            assert equal(sd, out)
            return elapsed

        rows[f"torch.load ({tag})"] = median_of(args.repeat, lambda f=f: drop_cache(f),
                                                load_torch)
    for backend in backends:
        def load_gds(_: Any, b: str = backend) -> float:
            obj, report = gds.load(gds_file, "cpu", backend=b)
            assert equal(sd, obj)
            return report.seconds

        rows[f"ckptlab.gds.load ({backend})"] = median_of(
            args.repeat, lambda: drop_cache(gds_file), load_gds)
    gpu_rows = gpu_benchmark(sd, args) if torch.cuda.is_available() else {}
    rows.update(gpu_rows)

    print(f"\n{'row':40} {'seconds':>8} {'GB/s':>7}")
    for label, seconds in rows.items():
        print(f"{label:40} {seconds:>8.3f} {nbytes / seconds / 1e9:>7.2f}")
    gbps = {k: nbytes / v / 1e9 for k, v in rows.items()}
    save_best = max(v for k, v in gbps.items() if k.startswith("ckptlab.gds.save (odirect)"))
    vs_torch = save_best / gbps["torch.save (64, crc)"]
    vs_raw = save_best / gbps["raw O_DIRECT write"]
    load_best = gbps.get("ckptlab.gds.load (odirect)", 0.0)
    print(f"\nckptlab.gds.save (odirect, {paths_taken.get('odirect')}): {vs_torch:.2f}x "
          f"torch.save default (target >= 2x: {'met' if vs_torch >= 2 else 'MISSED'}), "
          f"{100 * vs_raw:.0f}% of raw O_DIRECT write (target >= 80%: "
          f"{'met' if vs_raw >= 0.8 else 'MISSED'})")
    print(f"ckptlab.gds.load (odirect): {load_best / gbps['torch.load (64)']:.2f}x torch.load "
          f"default, {100 * load_best / gbps['raw O_DIRECT read']:.0f}% of raw O_DIRECT read")
    if not gpu_rows:
        print("no CUDA device: GPU rows not run")
    if args.json:
        args.json.write_text(json.dumps({"nbytes": nbytes, "seconds": rows, "gbps": gbps,
                                         "load": os.getloadavg(), "fs": fs}, indent=1))
    for f in args.dir.glob("*.pt"):
        f.unlink()
    return 0


def gpu_benchmark(sd: dict, args: argparse.Namespace) -> dict[str, float]:
    """GPU rows: torch backend (cuFile) vs torch.save/torch.load of CUDA tensors."""
    rows: dict[str, float] = {}
    ok = next(s for s in gds.backend_status() if s.name == "torch")
    cuda_sd = {k: v.cuda() for k, v in sd.items()}
    torch.cuda.synchronize()
    path = args.dir / "gpu.pt"

    def clean() -> None:
        if path.exists():
            path.unlink()

    rows["GPU torch.save (64, crc)"] = median_of(
        args.repeat, clean, lambda _: torch_save(cuda_sd, path, 64, True))
    drop_cache(path)

    def load_torch(_: Any) -> float:
        t = time.perf_counter()
        out = torch.load(path, map_location="cuda", weights_only=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        assert equal(sd, out)
        return elapsed

    rows["GPU torch.load (64)"] = median_of(args.repeat, lambda: drop_cache(path), load_torch)
    if not ok.available:
        print(f"GPU: torch backend unavailable ({ok.reason}); only the torch rows ran")
        return rows
    rows["GPU ckptlab.gds.save (torch)"] = median_of(
        args.repeat, clean, lambda _: gds.save(cuda_sd, path, backend="torch").seconds)
    assert equal(sd, torch.load(path, weights_only=True))

    def load_gds(_: Any) -> float:
        obj, report = gds.load(path, "cuda", backend="torch")
        assert equal(sd, obj)
        return report.seconds

    rows["GPU ckptlab.gds.load (torch)"] = median_of(args.repeat, lambda: drop_cache(path),
                                                     load_gds)
    from torch.cuda.gds import gds_deregister_buffer, gds_register_buffer

    storages = [t.untyped_storage() for t in cuda_sd.values()]
    for s in storages:
        gds_register_buffer(s)
    try:
        rows["GPU ckptlab.gds.save (torch, registered)"] = median_of(
            args.repeat, clean, lambda _: gds.save(cuda_sd, path, backend="torch").seconds)
    finally:
        for s in storages:
            gds_deregister_buffer(s)
    return rows


if __name__ == "__main__":
    sys.exit(main())
