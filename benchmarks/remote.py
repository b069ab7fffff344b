"""Remote checkpoints: ``ckptlab.open(url)`` against downloading the file, through a throttled
real nginx (issue 13, target 5).

What users do today with a checkpoint on an HTTP server is download it, then load it (here
``torch.load(map_location="meta")``, the cheapest load: no tensor bytes are allocated). ckptlab
opens the URL with exact ranged requests instead. Both run against Debian's nginx started on
127.0.0.1 by :class:`ckptlab.testing.nginx.NginxServer` with ``limit_rate`` (default 50 MB/s
per response), and the requests and bytes are read from nginx's own access log.

(a) a torch.save file of ``--tensors`` tensors of ``--elements`` float32 each;
(b) a Hugging Face sharded directory (``--shards`` safetensors shards and their index), against
    downloading the index and every shard, then reading each shard's header with safetensors;
(c) a DCP directory written by ``dcp.save`` (``--dcp-tensors`` tensors of ``--elements``
    float32 and ``--dcp-large`` of ``--dcp-large-elements``, in ``--dcp-files`` data files,
    and two object items), against downloading
    ``.metadata`` and every data file, then torch's ``FileSystemReader.read_metadata``; ckptlab
    twice: the open (names, dtypes, shapes, object values) and the open plus every tensor's
    entry (each chunk's file offset, read from the items' heads).

nginx-light has no way to add latency per request, so the seconds measured are those of a
link with ~0 ms round trips; ``--rtt-ms`` adds a modelled figure: the measured time plus one
round trip per request (what the same requests cost on a link with that round trip, requests
being sequential in both methods).

Correctness is checked: the remote opening must list the same tensors, dtypes, shapes and
offsets as the local one, and a few remote reads must equal torch's tensors.

    .venv/bin/python benchmarks/remote.py [--tensors 10000] [--elements 4096]
        [--shards 4] [--shard-nbytes 16777216] [--dcp-tensors 2000] [--dcp-large 48]
        [--dcp-large-elements 1048576] [--dcp-files 4]
        [--rate-mbps 50] [--rtt-ms 20] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.testing.nginx import NGINX_MISSING, NginxServer, nginx_executable  # noqa: E402


def _download(url: str, target: str) -> int:
    """The whole file in one plain GET (what a browser or ``wget`` does)."""
    with urllib.request.urlopen(url) as r, open(target, "wb") as f:
        n = 0
        while chunk := r.read(1 << 20):
            f.write(chunk)
            n += len(chunk)
    return n


def _dcp_save(sd: dict[str, Any], root: str, files: int) -> None:
    import logging
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, no_dist=True, storage_writer=FileSystemWriter(root, thread_count=files))


def _measure(server: NginxServer, run: Any) -> dict[str, Any]:
    server.mark()
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    seen = server.requests()
    return {"s": seconds, "requests": len(seen), "bytes": sum(r.body_nbytes for r in seen)}


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"s": statistics.median(r["s"] for r in rows), "requests": rows[0]["requests"],
            "bytes": rows[0]["bytes"], "all_s": [r["s"] for r in rows]}


def _case(name: str, server: NginxServer, ours: Any, theirs: Any, rounds: int,
          rtt_s: float) -> dict[str, Any]:
    a, b = [], []
    for i in range(rounds):  # interleaved, the order alternating
        for which in ((ours, a), (theirs, b)) if i % 2 == 0 else ((theirs, b), (ours, a)):
            which[1].append(_measure(server, which[0]))
    a_m, b_m = _median(a), _median(b)
    for m in (a_m, b_m):
        m["modelled_s"] = m["s"] + m["requests"] * rtt_s
    print(f"\n({name})")
    print(f"  {'method':<44} {'requests':>8} {'bytes moved':>14} {'seconds':>9} "
          f"{'+RTT model':>11}")
    for label, m in (("ckptlab.open(url)", a_m), ("download + load (today)", b_m)):
        print(f"  {label:<44} {m['requests']:>8} {m['bytes']:>14,} {m['s']:>9.3f} "
              f"{m['modelled_s']:>11.3f}")
    ratios = {"bytes": b_m["bytes"] / max(1, a_m["bytes"]), "seconds": b_m["s"] / a_m["s"],
              "modelled_seconds": b_m["modelled_s"] / a_m["modelled_s"]}
    print(f"  ratio (today / ckptlab): bytes {ratios['bytes']:.1f}x, seconds "
          f"{ratios['seconds']:.1f}x, with {rtt_s * 1e3:.0f} ms RTT modelled "
          f"{ratios['modelled_seconds']:.1f}x")
    return {"ckptlab": a_m, "download": b_m, "ratios": ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--elements", type=int, default=4096, help="float32 elements per tensor")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--shard-nbytes", type=int, default=16 << 20)
    ap.add_argument("--dcp-tensors", type=int, default=2000)
    ap.add_argument("--dcp-large", type=int, default=48)
    ap.add_argument("--dcp-large-elements", type=int, default=1 << 20)
    ap.add_argument("--dcp-files", type=int, default=4, help="FileSystemWriter thread_count")
    ap.add_argument("--rate-mbps", type=float, default=50.0, help="nginx limit_rate, MB/s")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="round trip for the model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if nginx_executable() is None:
        print(f"benchmarks/remote.py: {NGINX_MISSING}", file=sys.stderr)
        return 1
    from safetensors import safe_open
    from safetensors.torch import save_file

    print(f"python {platform.python_version()}, torch {torch.__version__}, ckptlab "
          f"{ckptlab.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print(f"nginx limit_rate {args.rate_mbps:g} MB/s per response; RTT model "
          f"{args.rtt_ms:g} ms per request")
    results: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="ckptlab-bench-remote-") as tmp:
        served = os.path.join(tmp, "served")
        os.makedirs(os.path.join(served, "hf"))
        sd = {f"model.layers.{i}.weight": torch.randn(args.elements)
              for i in range(args.tensors)}
        pt = os.path.join(served, "model.pt")
        torch.save(sd, pt)
        per_shard = max(1, args.shard_nbytes // (4 * 4096))
        weight_map = {}
        for k in range(args.shards):
            name = f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors"
            shard = {f"layers.{k}.{j}": torch.randn(4096) for j in range(per_shard)}
            save_file(shard, os.path.join(served, "hf", name))
            weight_map.update(dict.fromkeys(shard, name))
        with open(os.path.join(served, "hf", "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        print(f"torch.save file: {args.tensors:,} tensors, {os.path.getsize(pt):,} bytes; "
              f"HF dir: {args.shards} shards, "
              f"{sum(os.path.getsize(os.path.join(served, 'hf', n)) for n in os.listdir(os.path.join(served, 'hf'))):,} bytes")

        dcp_sd: dict[str, Any] = {f"layers.{i}.w": torch.randn(args.elements)
                                  for i in range(args.dcp_tensors)}
        dcp_sd.update({f"blocks.{i}.w": torch.randn(args.dcp_large_elements)
                       for i in range(args.dcp_large)})
        dcp_sd.update(step=1000, lr=3e-4)
        dcp_root = os.path.join(served, "dcp")
        _dcp_save(dcp_sd, dcp_root, args.dcp_files)
        dcp_names = sorted(os.listdir(dcp_root))
        print(f"DCP dir: {args.dcp_tensors:,} + {args.dcp_large} tensors, "
              f"{len(dcp_names) - 1} data files, "
              f"{sum(os.path.getsize(os.path.join(dcp_root, n)) for n in dcp_names):,} bytes")

        with NginxServer(served, limit_rate_nbytes=int(args.rate_mbps * 1e6)) as server:
            # correctness first
            ck = ckptlab.open(server.url("model.pt"))
            local = ckptlab.open(pt)
            assert [(t.name, t.dtype, t.shape, t.parts) for t in ck.tensors.values()] == \
                [(t.name, t.dtype, t.shape, t.parts) for t in local.tensors.values()], \
                "REMOTE LAYOUT DIFFERS"
            for name in list(sd)[:: max(1, len(sd) // 5)]:
                assert torch.equal(ck.read(name), sd[name]), f"REMOTE READ WRONG: {name}"
            hf = ckptlab.open(server.url("hf/"))
            assert set(hf.tensors) == set(weight_map), "REMOTE HF TENSORS DIFFER"
            down = os.path.join(tmp, "down")
            os.makedirs(down)

            def ours_pt() -> None:
                ckptlab.open(server.url("model.pt")).tensors  # noqa: B018

            def theirs_pt() -> None:
                target = os.path.join(down, "model.pt")
                _download(server.url("model.pt"), target)
                torch.load(target, map_location="meta")
                os.remove(target)

            def ours_hf() -> None:
                ckptlab.open(server.url("hf/")).tensors  # noqa: B018

            def theirs_hf() -> None:
                index = os.path.join(down, "index.json")
                _download(server.url("hf/model.safetensors.index.json"), index)
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
                for name in shards:
                    target = os.path.join(down, name)
                    _download(server.url(f"hf/{name}"), target)
                    with safe_open(target, "pt") as f:
                        [f.get_slice(k).get_shape() for k in f.keys()]
                    os.remove(target)

            ck = ckptlab.open(server.url("dcp/"))
            local = ckptlab.open(dcp_root)
            assert ck.objects == local.objects, "REMOTE DCP OBJECTS DIFFER"
            assert all(ck.tensors[n] == local.tensors[n] for n in local.tensors), \
                "REMOTE DCP ENTRIES DIFFER"
            for name in list(local.tensors)[:: max(1, len(local.tensors) // 5)]:
                assert torch.equal(ck.read(name), dcp_sd[name]), f"REMOTE READ WRONG: {name}"

            def ours_dcp() -> None:
                ck = ckptlab.open(server.url("dcp/"))
                [t[:3] for t in ck._dcp.cols.tensors.values()]  # dtype, grad, shape

            def ours_dcp_entries() -> None:
                ck = ckptlab.open(server.url("dcp/"))
                [t.parts for t in ck.tensors.values()]

            def theirs_dcp() -> None:
                from torch.distributed.checkpoint import FileSystemReader

                target = os.path.join(down, "dcp")
                os.makedirs(target)
                for name in dcp_names:
                    _download(server.url(f"dcp/{name}"), os.path.join(target, name))
                FileSystemReader(target).read_metadata()
                for name in dcp_names:
                    os.remove(os.path.join(target, name))
                os.rmdir(target)

            rtt = args.rtt_ms / 1e3
            results["torch_save"] = _case(
                f"a: torch.save file, {args.tensors:,} tensors: open+inspect vs download + "
                "torch.load(map_location='meta')", server, ours_pt, theirs_pt, args.rounds, rtt)
            results["hf"] = _case(
                f"b: Hugging Face dir, {args.shards} shards: open vs download + read headers",
                server, ours_hf, theirs_hf, args.rounds, rtt)
            results["dcp"] = _case(
                f"c: DCP dir, {args.dcp_tensors + args.dcp_large:,} tensors in "
                f"{len(dcp_names) - 1} files: open "
                "vs download + read_metadata", server, ours_dcp, theirs_dcp, args.rounds, rtt)
            results["dcp_entries"] = _case(
                "c': the same, ckptlab also building every tensor's entry (chunk offsets)",
                server, ours_dcp_entries, theirs_dcp, args.rounds, rtt)
    a = results["torch_save"]["ckptlab"]
    print(f"\nbudgets: torch.save {a['requests']} requests (<= 3), HF "
          f"{results['hf']['ckptlab']['requests']} (1 + {args.shards} shards = "
          f"{1 + args.shards}), DCP {results['dcp']['ckptlab']['requests']} (2 + "
          f"{len(dcp_names) - 1} files = {len(dcp_names) + 1})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
