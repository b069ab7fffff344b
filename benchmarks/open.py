"""Opening a checkpoint: ckptlab.open / ckptlab.inspect vs torch.load(map_location="meta").

Everything is measured in one run, interleaved round by round (each round times every method
once, in an order that rotates), and medians over the rounds are printed side by side, with
the ratios the targets of issue 13 are about:

(a) ``ckptlab.inspect(path)`` and ``ckptlab.open(path)`` against
    ``torch.load(path, map_location="meta")`` (torch's default, ``weights_only=True``) and, as
    a reference, the same with ``weights_only=False`` (torch's plain unpickler), on
    checkpoints of 10,000 and 100,000 tensors: ``plain`` (``{"layer.{i}.weight":
    torch.empty(2)}``, as in the issue) and ``mix`` (a quarter each Parameters of 4x4, two
    views of one storage, bfloat16 vectors, inside a nested dict with an optimizer-like part);
    ``--kinds moe`` adds a mixture-of-experts transformer's shapes (24 bf16 tensors a layer,
    5 shapes; not run by default: its 100,000-tensor file is 430 MB), ``--kinds optim`` a
    training checkpoint (a model's state dict and its Adam optimizer's state), ``--kinds
    norm`` a convolutional network with BatchNorm (fp32 and int64 storages in turn),
    ``--kinds module`` a whole ``nn.Module`` saved (``torch.save(model)``: blocks of a Linear
    and a LayerNorm; torch's default ``weights_only=True`` refuses it, so its reference is
    ``weights_only=False``).
    Targets: 10,000 tensors >= 5x faster than torch; 100,000 tensors in < 1 s.
(b) ``ckptlab.storage_offsets(path)`` against torch's C++ reader,
    ``torch._C.PyTorchFileReader(path)`` + ``get_record_offset`` of every ``data/*`` record,
    at 10,000 storages. Target: >= 2x faster, <= 3 reads.
(c) the command's wall time, each a fresh ``python -m ckptlab`` process: ``--version``, an
    error path (``inspect`` of a missing file) and ``inspect`` of the embedded sample.
    Targets: < 0.15 s, < 0.15 s, < 0.5 s.

Correctness is checked, not assumed: every tensor ckptlab finds must have the dtype, shape,
stride and storage offset torch's meta load gives it, and every storage offset must equal
torch's ``get_record_offset``; a disagreement raises before any figure is printed. The load
average is printed at the start and the end: other processes on the machine change the
timings, so compare the ratios of one run, not times across runs.

    .venv/bin/python benchmarks/open.py [--tensors 10000 100000] [--kinds plain mix]
        [--rounds 5] [--large-rounds 3] [--cli-rounds 7] [--json out.json] [--strict]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ckptlab  # noqa: E402

LARGE = 100_000  # from this many tensors on, --large-rounds rounds (torch takes ~10 s each)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


# ---------------------------------------------------------------------------- checkpoints


def plain_state(n: int) -> dict[str, torch.Tensor]:
    return {f"layer.{i}.weight": torch.empty(2) for i in range(n)}


def mix_state(n: int) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for i in range(n // 4):
        model[f"layers.{i}.w"] = torch.nn.Parameter(torch.zeros(4, 4))
        base = torch.zeros(8)
        model[f"layers.{i}.view_a"] = base[:4]
        model[f"layers.{i}.view_b"] = base[4:].view(2, 2)
        model[f"layers.{i}.bias"] = torch.zeros(3, dtype=torch.bfloat16)
    return {"model": model, "step": 3, "optimizer": {"lr": 0.1, "betas": (0.9, 0.99)}}


def moe_state(n: int) -> dict[str, torch.Tensor]:
    """A mixture-of-experts transformer's state dict in small: per layer two norms, four
    attention projections and 8 experts of three projections (24 tensors, 5 shapes), bf16."""
    out: dict[str, torch.Tensor] = {}
    layer = 0
    while len(out) < n:
        p = f"model.layers.{layer}."
        shapes = {"input_layernorm.weight": (64,), "self_attn.q_proj.weight": (64, 64),
                  "self_attn.k_proj.weight": (16, 64), "self_attn.v_proj.weight": (16, 64),
                  "self_attn.o_proj.weight": (64, 64), "post_attention_layernorm.weight": (64,)}
        for e in range(8):
            shapes |= {f"mlp.experts.{e}.gate_proj.weight": (32, 64),
                       f"mlp.experts.{e}.up_proj.weight": (32, 64),
                       f"mlp.experts.{e}.down_proj.weight": (64, 32)}
        for name, shape in shapes.items():
            if len(out) < n:
                out[p + name] = torch.empty(shape, dtype=torch.bfloat16)
        layer += 1
    return out


def optim_state(n: int) -> dict[str, Any]:
    """A training checkpoint: a model's state dict (8x8 fp32 weights) and the state dict of
    an Adam optimizer over it (a scalar ``step`` and two moments per parameter, under int
    keys, as ``torch.optim.Adam.state_dict()`` gives them); a quarter of the tensors are the
    model's."""
    params = n // 4
    model = {f"layers.{i}.weight": torch.empty(8, 8) for i in range(params)}
    state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.empty(8, 8),
                 "exp_avg_sq": torch.empty(8, 8)} for i in range(params)}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "params": list(range(params))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups},
            "step": 10}


def norm_state(n: int) -> dict[str, torch.Tensor]:
    """A convolutional network with BatchNorm: per block a conv weight, the norm's weight,
    bias and running statistics (fp32) and its int64 ``num_batches_tracked`` (a scalar)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(n // 6 + 1):
        p = f"layer{i // 50}.{i % 50}."
        for name, t in (("conv.weight", torch.empty(8, 4, 3, 3)), ("bn.weight", torch.empty(8)),
                        ("bn.bias", torch.empty(8)), ("bn.running_mean", torch.empty(8)),
                        ("bn.running_var", torch.empty(8)),
                        ("bn.num_batches_tracked", torch.tensor(0))):
            if len(out) < n:
                out[p + name] = t
    return out


def module_state(n: int) -> torch.nn.Module:
    """A whole model pickled, as a new user saves it: ``n / 4`` blocks of a Linear and a
    LayerNorm (each module a pickled object with a dozen hook dicts and flags)."""
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
                                 for _ in range(n // 4)])


KINDS: dict[str, Callable[[int], Any]] = {"plain": plain_state, "mix": mix_state,
                                          "moe": moe_state, "optim": optim_state,
                                          "norm": norm_state, "module": module_state}
WHOLE_MODULES = {"module"}  # torch.load's weights_only=True refuses them


def flat_tensors(obj: Any, prefix: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    """Tensors of a loaded object by path (dicts, and modules by their attributes, as the
    pickle holds them)."""
    out: dict[tuple[Any, ...], Any] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, torch.nn.Module):
        for k, v in vars(obj).items():
            out.update(flat_tensors(v, (*prefix, k)))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, (*prefix, k)))
    return out


# ------------------------------------------------------------------------------- checks


def check_against_torch(path: str) -> int:
    """ckptlab's tensors and storage offsets against torch's; returns the tensor count."""
    meta = flat_tensors(torch.load(path, map_location="meta", weights_only=False))
    layout = ckptlab.inspect(path)
    found = {t.path: t for t in layout.tensors}
    if set(found) != set(meta):
        raise AssertionError(f"TENSORS DISAGREE: {len(found)} found, torch has {len(meta)}")
    for key, t in meta.items():
        info = found[key]
        got = (info.dtype, info.shape, info.stride, info.storage_offset)
        want = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(),
                t.storage_offset())
        if got != want:
            raise AssertionError(f"TENSOR DISAGREES at {key}: ckptlab {got}, torch {want}")
    ck = ckptlab.open(path)
    if len(ck.tensors) != len(meta):
        raise AssertionError(f"ckptlab.open found {len(ck.tensors)} tensors, torch {len(meta)}")
    reader = torch._C.PyTorchFileReader(path)
    want_offsets = {n[5:]: reader.get_record_offset(n) for n in reader.get_all_records()
                    if n.startswith("data/")}
    got = ckptlab.storage_offsets(path)
    if got.offsets != want_offsets or {s.key: s.data_offset for s in layout.storages} != \
            want_offsets:
        raise AssertionError("OFFSETS DISAGREE with torch's get_record_offset")
    return len(meta)


# ------------------------------------------------------------------------------- timing


def interleaved(methods: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of every method; each round runs them all, in a rotating order."""
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            start = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - start)
    return times


def row(name: str, seconds: list[float], reference: float | None) -> dict[str, Any]:
    med = statistics.median(seconds)
    return {"name": name, "median_s": med, "best_s": min(seconds), "worst_s": max(seconds),
            "rounds": seconds, "speedup": None if reference is None else reference / med}


def print_rows(rows: list[dict[str, Any]], ratio_label: str) -> None:
    width = max(len(r["name"]) for r in rows)
    print(f"  {'method':<{width}}  {'median ms':>10}  {'best':>8}  {'worst':>8}  "
          f"{ratio_label:>14}")
    for r in rows:
        ratio = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"  {r['name']:<{width}}  {r['median_s'] * 1e3:>10.1f}  "
              f"{r['best_s'] * 1e3:>8.1f}  {r['worst_s'] * 1e3:>8.1f}  {ratio:>14}")


def bench_open(path: str, rounds: int, whole_module: bool = False) -> list[dict[str, Any]]:
    """ckptlab against ``torch.load(meta)`` (the first row, which the speedups divide), with
    ``weights_only=False`` as a reference row, or as the first one for a whole module."""
    ckptlab.inspect(path), ckptlab.open(path)  # imports (numpy) and page cache, untimed
    loads = {
        "torch.load(meta)": lambda: torch.load(path, map_location="meta"),
        "torch.load(meta, weights_only=False) [ref]":
            lambda: torch.load(path, map_location="meta", weights_only=False),
    }
    if whole_module:
        loads = {"torch.load(meta, weights_only=False)":
                 lambda: torch.load(path, map_location="meta", weights_only=False)}
    times = interleaved({
        **loads,
        "ckptlab.inspect": lambda: ckptlab.inspect(path),
        "ckptlab.open": lambda: ckptlab.open(path),
    }, rounds)
    first = next(iter(loads))
    torch_s = statistics.median(times[first])
    return [row(name, secs, None if name == first else torch_s)
            for name, secs in times.items()]


def torch_offsets(path: str) -> dict[str, int]:
    reader = torch._C.PyTorchFileReader(path)
    return {n[5:]: reader.get_record_offset(n) for n in reader.get_all_records()
            if n.startswith("data/")}


def bench_offsets(path: str, rounds: int) -> tuple[list[dict[str, Any]], int]:
    torch_offsets(path), ckptlab.storage_offsets(path)  # warm-up
    times = interleaved({
        "torch PyTorchFileReader + get_record_offset": lambda: torch_offsets(path),
        "ckptlab.storage_offsets": lambda: ckptlab.storage_offsets(path),
        "ckptlab.storage_offsets(scan=True) [ref]":
            lambda: ckptlab.storage_offsets(path, scan=True),
    }, rounds)
    torch_s = statistics.median(times["torch PyTorchFileReader + get_record_offset"])
    rows = [row(name, secs, None if name.startswith("torch") else torch_s)
            for name, secs in times.items()]
    return rows, ckptlab.storage_offsets(path).reads


def bench_cli(rounds: int, missing: str) -> list[dict[str, Any]]:
    commands = {
        "ckptlab --version": ["--version"],
        "ckptlab inspect <missing file> (error)": ["inspect", missing],
        "ckptlab inspect (embedded sample)": ["inspect"],
    }

    def runner(args: list[str], ok: tuple[int, ...]) -> Callable[[], None]:
        def run() -> None:
            proc = subprocess.run([sys.executable, "-m", "ckptlab", *args], cwd=ROOT,
                                  capture_output=True, text=True)
            if proc.returncode not in ok:
                raise AssertionError(f"ckptlab {' '.join(args)}: exit {proc.returncode}: "
                                     f"{proc.stderr.strip()}")
        return run

    runner(["inspect"], (0,))()  # writes the sample into the cache directory once
    times = interleaved({name: runner(args, (2,) if "error" in name else (0,))
                         for name, args in commands.items()}, rounds)
    return [row(name, secs, None) for name, secs in times.items()]


# --------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=["plain", "mix"])
    ap.add_argument("--rounds", type=int, default=5, help="rounds below 100,000 tensors")
    ap.add_argument("--large-rounds", type=int, default=3, help="rounds at 100,000 and up")
    ap.add_argument("--offsets-storages", type=int, default=10_000)
    ap.add_argument("--cli-rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write every figure to this file")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    if min(args.rounds, args.large_rounds, args.cli_rounds) < 1:
        ap.error("rounds must be >= 1")
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "ckptlab": ckptlab.__version__, "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "loadavg_start": _load(),
    }
    print(f"python {env['python']}  torch {env['torch']}  ckptlab {env['ckptlab']}  "
          f"cpu_count {env['cpu_count']}  torch threads {env['torch_threads']}")
    print(f"platform {env['platform']}  load average {env['loadavg_start']}")
    report: dict[str, Any] = {"env": env, "open": [], "offsets": None, "cli": None}
    targets: list[tuple[str, bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-open-") as tmp:
        print("\n(a) opening a checkpoint (ms; speedup = torch.load(meta) median / this one)")
        for n in args.tensors:
            for kind in args.kinds:
                path = os.path.join(tmp, f"{kind}{n}.pt")
                torch.save(KINDS[kind](n), path)
                count = check_against_torch(path)
                rounds = args.large_rounds if n >= LARGE else args.rounds
                print(f"\n  {kind}, {count:,} tensors, {os.path.getsize(path):,} bytes, "
                      f"{rounds} rounds, load average {_load()}")
                rows = bench_open(path, rounds, kind in WHOLE_MODULES)
                print_rows(rows, "speedup")
                report["open"].append({"kind": kind, "tensors": count, "rows": rows,
                                       "loadavg": _load()})
                by = {r["name"]: r for r in rows}
                for name in ("ckptlab.inspect", "ckptlab.open"):
                    if n == 10_000:
                        targets.append((f"{name} {kind} 10k >= 5x torch.load(meta)",
                                        by[name]["speedup"] >= 5,
                                        f"{by[name]['speedup']:.2f}x"))
                    if n == 100_000:
                        targets.append((f"{name} {kind} 100k < 1 s",
                                        by[name]["median_s"] < 1,
                                        f"{by[name]['median_s']:.2f} s"))
                os.remove(path)

        n = args.offsets_storages
        path = os.path.join(tmp, f"offsets{n}.pt")
        torch.save(plain_state(n), path)
        check_against_torch(path)
        print(f"\n(b) storage offsets, {n:,} storages, {args.rounds} rounds, "
              f"load average {_load()} (ms; speedup = torch's reader median / this one)")
        rows, reads = bench_offsets(path, args.rounds)
        print_rows(rows, "speedup")
        print(f"  ckptlab reads: {reads}")
        report["offsets"] = {"storages": n, "rows": rows, "reads": reads}
        speedup = rows[1]["speedup"]
        targets.append(("storage_offsets >= 2x torch get_record_offset loop, <= 3 reads",
                        speedup >= 2 and reads <= 3, f"{speedup:.2f}x, {reads} reads"))

        print(f"\n(c) the command, wall time of a fresh process, {args.cli_rounds} rounds, "
              f"load average {_load()} (ms)")
        rows = bench_cli(args.cli_rounds, os.path.join(tmp, "missing.pt"))
        print_rows(rows, "")
        report["cli"] = rows
        for r, limit in zip(rows, (0.15, 0.15, 0.5)):
            targets.append((f"{r['name']} < {limit} s", r["median_s"] < limit,
                            f"{r['median_s']:.3f} s"))

    env["loadavg_end"] = _load()
    print(f"\ntargets (load average at the end {env['loadavg_end']}):")
    for name, met, figure in targets:
        print(f"  {'met   ' if met else 'MISSED'}  {name}: {figure}")
    report["targets"] = [{"target": t, "met": m, "figure": f} for t, m, f in targets]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if args.strict and not all(m for _, m, _ in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
