"""Benchmark: storage data offsets of a torch.save checkpoint, ckptlab vs torch vs zipfile.

Run from the repository root::

    python benchmarks/offsets.py [--storages 10000] [--latency-ms 0.5] [--repeat 5]
                                 [--json out.json] [--strict]

One run writes a checkpoint of ``--storages`` float32 tensors of 16 elements each
(``{'layers.{i}.weight': ...}``) with ``torch.save`` into a temporary directory, then measures:

(a) slow file object: every ``read``/``readinto``/``readall`` call on the file object sleeps
    ``--latency-ms`` (object-storage-like latency; ``seek``/``tell`` are free) and is counted.
    ``ckptlab.storage_offsets(fileobj)`` (default and scan=True) vs
    ``torch._C.PyTorchFileReader(fileobj)`` + ``get_record_offset`` for every ``data/*`` record
    (reader construction included), plus ``torch.load(fileobj, map_location="meta")`` and
    Python's ``zipfile`` (one local-header read per storage) for reference.
(b) local file, page cache hot: ``ckptlab.storage_offsets(path)`` vs
    ``torch.load(path, map_location="meta", weights_only=False)`` + ``_checkpoint_offset`` of
    every tensor's storage, vs the same load under ``FakeTensorMode`` (timed once: it is slow),
    and ``zipfile`` on the local file.
(c) ``zipfile`` rows appear in both tables.

Every method's offsets are checked against each other and against the tensor bytes in the
file; any disagreement raises (exit status 1). Target misses are reported; with ``--strict``
they also make the exit status 1.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import json
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ckptlab

ELEMENTS = 16  # float32 elements per tensor (64 bytes)
SWEEP = (1, 10, 100, 1000)  # extra storage counts for the "reads whatever the count" check
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes


# ----------------------------------------------------------------------------- file objects


class SlowFile(io.RawIOBase):
    """A binary file object that counts read calls and sleeps ``latency_s`` in each one.

    ``read``, ``readinto`` and ``readall`` each count as one call (torch's PyTorchFileReader
    uses ``readinto``; ckptlab and zipfile use ``read``). ``seek`` and ``tell`` are free.
    The underlying file is unbuffered, so one call here is one read of the file.
    """

    def __init__(self, path: str | os.PathLike[str], latency_s: float = 0.0) -> None:
        super().__init__()
        self._f = open(path, "rb", buffering=0)
        self.latency_s = latency_s
        self.reads = 0
        self.bytes_read = 0

    def _charge(self) -> None:
        self.reads += 1
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, size: int | None = -1) -> bytes:
        self._charge()
        data = self._f.read(-1 if size is None else size)
        self.bytes_read += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        self._charge()
        n = self._f.readinto(buffer) or 0
        self.bytes_read += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


# ----------------------------------------------------------------------------- methods
# Each method takes a source and returns offsets plus, where the method itself reports them,
# its own (reads, bytes_read). Offsets are {storage_key: offset} (keyed) or a list in the
# state dict's order (torch.load; storage keys are not visible on loaded tensors).


@dataclass
class Result:
    keyed: dict[str, int] | None = None
    ordered: list[int] | None = None
    own_reads: int | None = None
    own_bytes: int | None = None
    method: str | None = None


def m_ckptlab(scan: bool) -> Callable[[Any], Result]:
    def run(src: Any) -> Result:
        r = ckptlab.storage_offsets(src, scan=scan)
        return Result(keyed=dict(r.offsets), own_reads=r.reads, own_bytes=r.bytes_read,
                      method=r.method)
    return run


def m_torch_reader(src: Any) -> Result:
    reader = torch._C.PyTorchFileReader(src)
    offsets = {n[5:]: reader.get_record_offset(n)
               for n in reader.get_all_records() if n.startswith("data/")}
    return Result(keyed=offsets)


def _meta_offsets(state: dict[str, torch.Tensor]) -> list[int]:
    out = []
    for t in state.values():
        off = t.untyped_storage()._checkpoint_offset
        if off is None:
            raise AssertionError("torch.load left _checkpoint_offset unset")
        out.append(int(off))
    return out


def m_torch_meta(src: Any) -> Result:
    state = torch.load(src, map_location="meta", weights_only=False)
    return Result(ordered=_meta_offsets(state))


def m_torch_fake(src: Any) -> Result:
    with FakeTensorMode():
        state = torch.load(src, weights_only=False)
        offsets = _meta_offsets(state)
    return Result(ordered=offsets)


def _zip_offsets(f: Any) -> dict[str, int]:
    offsets = {}
    with zipfile.ZipFile(f) as zf:
        for info in zf.infolist():
            _, _, short = info.filename.partition("/")
            if not short.startswith("data/"):
                continue
            f.seek(info.header_offset)
            sig, *_, name_len, extra_len = LOCAL_HEADER.unpack(f.read(LOCAL_HEADER.size))
            if sig != b"PK\x03\x04":
                raise AssertionError(f"bad local header signature for {info.filename}")
            offsets[short[5:]] = info.header_offset + LOCAL_HEADER.size + name_len + extra_len
    return offsets


def m_zipfile(src: Any) -> Result:
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:  # buffered, as ZipFile(path) would open it
            return Result(keyed=_zip_offsets(f))
    return Result(keyed=_zip_offsets(src))


# ----------------------------------------------------------------------------- measurement


@dataclass
class Row:
    section: str
    name: str
    times_s: list[float] = field(default_factory=list)
    reads: int | None = None
    bytes_read: int | None = None
    reads_note: str = ""
    method: str | None = None
    ratio: float | None = None
    result: Result | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_s) * 1e3


def timed(fn: Callable[[], Result]) -> tuple[float, Result]:
    gc.collect()
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def bench_slow(section: str, name: str, method: Callable[[Any], Result], path: str,
               latency_s: float, repeat: int) -> Row:
    """Time ``method`` on a fresh SlowFile each repeat; reads are counted by the wrapper."""
    row = Row(section, name)
    counts = set()
    for _ in range(repeat):
        with SlowFile(path, latency_s) as f:
            dt, res = timed(lambda f=f: method(f))
            counts.add((f.reads, f.bytes_read))
        row.times_s.append(dt)
        row.result = res
    if len(counts) != 1:
        raise AssertionError(f"{name}: read counts differ between repeats: {sorted(counts)}")
    row.reads, row.bytes_read = counts.pop()
    row.method = row.result.method
    if row.result.own_reads is not None and (row.result.own_reads, row.result.own_bytes) != (
            row.reads, row.bytes_read):
        row.reads_note = (f"ckptlab reported {row.result.own_reads} reads / "
                          f"{row.result.own_bytes} B, the file object saw {row.reads} / "
                          f"{row.bytes_read} B")
    return row


def bench_local(section: str, name: str, method: Callable[[Any], Result], path: str,
                repeat: int, warmup: bool) -> Row:
    """Time ``method(path)``; reads come from the method itself or an untimed counting pass."""
    row = Row(section, name)
    if warmup:
        method(path)
    for _ in range(repeat):
        dt, res = timed(lambda: method(path))
        row.times_s.append(dt)
        row.result = res
    row.method = row.result.method
    if row.result.own_reads is not None:
        row.reads, row.bytes_read = row.result.own_reads, row.result.own_bytes
        row.reads_note = "pread calls, as reported by ckptlab"
    else:
        with SlowFile(path, 0.0) as f:
            method(f)
            row.reads, row.bytes_read = f.reads, f.bytes_read
        row.reads_note = "counted in a separate untimed pass over a counting file object"
    return row


# ----------------------------------------------------------------------------- checks


def check_offsets(rows: list[Row], reference: dict[str, int], path: str,
                  tensors: list[torch.Tensor]) -> None:
    """Raise unless every row gives exactly the reference offsets and they point at the data."""
    ref_order = list(reference.values())
    for row in rows:
        res = row.result
        assert res is not None
        if res.keyed is not None and res.keyed != reference:
            diff = [k for k in reference.keys() | res.keyed.keys()
                    if reference.get(k) != res.keyed.get(k)]
            raise AssertionError(f"OFFSETS DISAGREE: {row.section}/{row.name} differs from "
                                 f"ckptlab on {len(diff)} storages, e.g. {sorted(diff)[:5]}")
        if res.ordered is not None and res.ordered != ref_order:
            bad = sum(a != b for a, b in zip(res.ordered, ref_order, strict=False)) + abs(
                len(res.ordered) - len(ref_order))
            raise AssertionError(f"OFFSETS DISAGREE: {row.section}/{row.name} differs from "
                                 f"ckptlab on {bad} tensors (in state dict order)")
    # ground truth: the bytes at each offset are the tensor saved under that storage key.
    # torch.save numbers storages in pickle order, which is the dict order here.
    data = Path(path).read_bytes()
    if len(ref_order) != len(tensors):
        raise AssertionError(f"{len(ref_order)} offsets for {len(tensors)} tensors")
    for (key, off), t in zip(reference.items(), tensors, strict=True):
        raw = t.numpy().tobytes()
        if data[off:off + len(raw)] != raw:
            raise AssertionError(f"OFFSETS WRONG: storage {key} at {off} does not hold its "
                                 "tensor's bytes")


# ----------------------------------------------------------------------------- main


def write_checkpoint(path: str, n: int) -> list[torch.Tensor]:
    base = torch.arange(ELEMENTS, dtype=torch.float32)
    tensors = [base + ELEMENTS * i for i in range(n)]
    torch.save({f"layers.{i}.weight": t for i, t in enumerate(tensors)}, path)
    return tensors


def measured_sleep(latency_s: float, calls: int = 200) -> float:
    if latency_s <= 0:
        return 0.0
    t0 = time.perf_counter()
    for _ in range(calls):
        time.sleep(latency_s)
    return (time.perf_counter() - t0) / calls


def _load() -> str:
    if not hasattr(os, "getloadavg"):
        return "n/a"
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def fmt_table(rows: list[Row], baseline: Row) -> list[str]:
    head = f"{'method':<52} {'median ms':>11} {'reads':>7} {'bytes read':>11} {'x ckptlab':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        r.ratio = r.median_ms / baseline.median_ms
        name = r.name + (f" [{r.method}]" if r.method else "")
        n = len(r.times_s)
        ms = f"{r.median_ms:,.1f}" + ("" if n > 1 else "*")
        lines.append(f"{name:<52} {ms:>11} {r.reads:>7,} {r.bytes_read:>11,} "
                     f"{r.ratio:>9.1f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storages", type=int, default=10_000)
    ap.add_argument("--latency-ms", type=float, default=0.5,
                    help="sleep per read call on the slow file object (default 0.5)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="repeats per method, median reported (FakeTensorMode: always 1)")
    ap.add_argument("--json", type=Path, help="write the figures to this file")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    if args.storages < 1 or args.repeat < 1:
        ap.error("--storages and --repeat must be >= 1")
    latency_s = args.latency_ms / 1e3
    t_start = time.perf_counter()

    cpus = os.cpu_count()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ckptlab": ckptlab.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": cpus,
        "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    print(f"python {env['python']}  torch {env['torch']}  ckptlab {env['ckptlab']}  "
          f"cpu_count {cpus} (usable {affinity})  torch threads {env['torch_threads']}  "
          f"cuda {env['cuda_available']}")
    print(f"platform {env['platform']}  load average {_load()}")

    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-") as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        tensors = write_checkpoint(path, args.storages)
        size = os.path.getsize(path)
        slept = measured_sleep(latency_s)
        print(f"checkpoint: {args.storages:,} storages of {ELEMENTS} float32, "
              f"{size:,} bytes; repeats {args.repeat} (median); "
              f"latency {args.latency_ms} ms per read call (time.sleep measured "
              f"{slept * 1e3:.3f} ms)")

        # ---- (a) slow file object
        print(f"\n(a) through a file object that sleeps {args.latency_ms} ms per read call")
        a_rows = [
            bench_slow("a", "ckptlab.storage_offsets(f) [default]", m_ckptlab(False), path,
                       latency_s, args.repeat),
            bench_slow("a", "ckptlab.storage_offsets(f, scan=True)", m_ckptlab(True), path,
                       latency_s, args.repeat),
            bench_slow("a", "torch PyTorchFileReader(f) + get_record_offset", m_torch_reader,
                       path, latency_s, args.repeat),
            bench_slow("a", "torch.load(f, map_location='meta') [ref]", m_torch_meta, path,
                       latency_s, args.repeat),
            bench_slow("a", "zipfile.ZipFile(f) + local headers [ref]", m_zipfile, path,
                       latency_s, args.repeat),
        ]
        reference = a_rows[0].result.keyed
        check_offsets(a_rows, reference, path, tensors)
        a_lines = fmt_table(a_rows, a_rows[0])
        print("\n".join(a_lines))

        # ---- reads vs storage count (ckptlab only, both scan modes)
        sweep: dict[int, dict[str, int]] = {}
        for n in SWEEP:
            if n >= args.storages:
                continue
            p = os.path.join(tmp, f"sweep-{n}.pt")
            small = write_checkpoint(p, n)
            sweep[n] = {}
            for scan in (True, False):
                with SlowFile(p) as f:
                    r = ckptlab.storage_offsets(f, scan=scan)
                    sweep[n][f"scan={scan}"] = f.reads
                check_offsets([Row("sweep", f"n={n}", result=Result(keyed=dict(r.offsets)))],
                              dict(ckptlab.storage_offsets(p).offsets), p, small)
            os.remove(p)
        sweep[args.storages] = {"scan=True": a_rows[1].reads, "scan=False": a_rows[0].reads}
        print("ckptlab read calls by storage count: " + ", ".join(
            f"{n:,}: {v['scan=True']}/{v['scan=False']}" for n, v in sweep.items())
            + "  (scan=True/scan=False)")

        # ---- (b) local file, page cache hot
        print("\n(b) local file, page cache hot")
        b_rows = [
            bench_local("b", "ckptlab.storage_offsets(path) [default]", m_ckptlab(False),
                        path, args.repeat, warmup=True),
            bench_local("b", "ckptlab.storage_offsets(path, scan=True)", m_ckptlab(True), path,
                        args.repeat, warmup=True),
            bench_local("b", "torch.load(path, map_location='meta')", m_torch_meta, path,
                        args.repeat, warmup=True),
            bench_local("b", "torch.load(path) under FakeTensorMode", m_torch_fake, path,
                        1, warmup=False),
            bench_local("b", "torch PyTorchFileReader(path) + get_record_offset",
                        m_torch_reader, path, args.repeat, warmup=True),
            bench_local("b", "zipfile.ZipFile(path) + local headers [ref]", m_zipfile, path,
                        args.repeat, warmup=True),
        ]
        check_offsets(b_rows, reference, path, tensors)
        b_lines = fmt_table(b_rows, b_rows[0])
        print("\n".join(b_lines))

    print("\n* timed once. reads/bytes: (a) counted by the slow file object (read/readinto/"
          "readall calls);\n  (b) ckptlab rows: its own pread count; other rows: a separate "
          "untimed pass over a counting file object.")
    print(f"offsets: identical across all {len(a_rows) + len(b_rows)} rows and "
          f"{args.storages:,} storages, and each points at its tensor's bytes "
          f"(ckptlab method: {a_rows[0].method})")
    notes = [f"{r.section}/{r.name}: {r.reads_note}" for r in a_rows if r.reads_note]
    for note in notes:
        print(f"NOTE read accounting differs: {note}")

    # ---- targets
    ck_a_scan, reader_a = a_rows[1], a_rows[2]
    ck_b_scan, meta_b, fake_b = b_rows[1], b_rows[2], b_rows[3]
    max_reads = max(max(v.values()) for v in sweep.values())
    targets = [
        ("(a) PyTorchFileReader / ckptlab >= 50x", reader_a.ratio, 50),
        ("(a) ckptlab read calls <= 3 at every storage count", max_reads, 3),
        ("(b) torch.load meta / ckptlab >= 5x", meta_b.ratio, 5),
        ("(b) torch.load FakeTensorMode / ckptlab >= 50x", fake_b.ratio, 50),
    ]
    info = [  # the scan=True mode (torch's pickle order) against the same goals, for reference
        ("(a) PyTorchFileReader / ckptlab(scan=True)", reader_a.median_ms / ck_a_scan.median_ms),
        ("(b) torch.load meta / ckptlab(scan=True)", meta_b.median_ms / ck_b_scan.median_ms),
        ("(b) torch.load FakeTensorMode / ckptlab(scan=True)",
         fake_b.median_ms / ck_b_scan.median_ms),
    ]
    print("\ntargets:")
    results = []
    for label, value, goal in targets:
        ok = value <= goal if "read calls" in label else value >= goal
        shown = f"{value}" if isinstance(value, int) else f"{value:.1f}x"
        print(f"  {'met   ' if ok else 'MISSED'} {label}: {shown}")
        results.append({"target": label, "value": value, "goal": goal, "met": ok})
    for label, value in info:
        print(f"  info   {label}: {value:.1f}x")
    missed = [t for t in results if not t["met"]]
    elapsed = time.perf_counter() - t_start
    env["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\ntotal {elapsed:.0f} s  load average {_load()} (other processes share the CPUs: "
          "compare with it)")

    if args.json:
        def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
            return [{"section": r.section, "name": r.name, "method": r.method,
                     "median_ms": r.median_ms, "times_ms": [t * 1e3 for t in r.times_s],
                     "reads": r.reads, "bytes_read": r.bytes_read, "reads_note": r.reads_note,
                     "ratio_vs_ckptlab": r.ratio} for r in rows]
        out = {"env": env,
               "args": {"storages": args.storages, "latency_ms": args.latency_ms,
                        "repeat": args.repeat},
               "checkpoint_bytes": size, "sleep_measured_ms": slept * 1e3,
               "slow_file": rows_json(a_rows), "local_file": rows_json(b_rows),
               "ckptlab_reads_by_storage_count": {str(k): v for k, v in sweep.items()},
               "offsets_identical": True, "targets": results, "total_s": elapsed}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if (missed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
