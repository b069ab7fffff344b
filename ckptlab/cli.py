"""The ``ckptlab`` command.

Verbs: ``inspect [PATH] [--json]``, ``offsets PATH [--json]``, ``sample PATH``.
Errors: exit status 2 and one line on stderr starting ``ckptlab: error:``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ckptlab._inspect import inspect
from ckptlab.errors import CkptlabError
from ckptlab.format import ArchiveLayout, storage_offsets
from ckptlab.plan.metadata import DcpLayout

__all__ = ["main"]


def _fmt_path(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _table(rows: list[Sequence[Any]], header: Sequence[str], right: set[int]) -> str:
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def render_layout(layout: ArchiveLayout) -> str:
    """The human-readable report printed by ``ckptlab inspect``."""
    pct = 100.0 * layout.overhead_nbytes / layout.file_nbytes if layout.file_nbytes else 0.0
    out = [
        f"{layout.path}",
        f"  format {layout.format}, {layout.file_nbytes:,} bytes"
        + (f", archive '{layout.archive_name}'" if layout.archive_name else "")
        + f", alignment {layout.alignment}"
        + (f" (.storage_alignment {layout.storage_alignment})"
           if layout.storage_alignment is not None else "")
        + f", zip64 {'yes' if layout.zip64 else 'no'}",
        f"  {len(layout.records)} records, {len(layout.storages)} storages, "
        f"{len(layout.tensors)} tensors; overhead {layout.overhead_nbytes:,} bytes ({pct:.2f}%), "
        f"padding {layout.padding_nbytes:,} bytes",
        "",
    ]
    if layout.records:
        out.append(_table(
            [(r.short_name, r.header_offset, r.data_offset, r.data_nbytes, r.padding_nbytes,
              r.zip64_extra_nbytes, r.descriptor_nbytes) for r in layout.records],
            ("record", "header", "data", "nbytes", "pad", "zip64", "desc"), {1, 2, 3, 4, 5, 6}))
        out.append("")
    out.append(_table(
        [(_fmt_path(t.path), t.dtype, "x".join(map(str, t.shape)) or "scalar", t.storage_key,
          t.storage_offset) for t in layout.tensors],
        ("tensor", "dtype", "shape", "storage", "offset"), {4}))
    return "\n".join(out)


def render_dcp(layout: DcpLayout) -> str:
    """Readable summary of a DCP directory: files, then one row per item."""
    out = [f"{layout.path}: DCP checkpoint, {layout.file_nbytes:,} bytes in "
           f"{len(layout.files)} data files + .metadata ({layout.metadata_nbytes:,} B), "
           f"{len(layout.items)} items, {len(layout.tensors)} tensors"]
    out.append(_table([(name, n) for name, n in layout.files], ("file", "bytes"), {1}))
    rows = [(i.fqn, i.kind, "x".join(map(str, i.chunk_sizes)) or "-",
             ",".join(map(str, i.chunk_offsets)) or "-", i.file, i.offset, i.nbytes,
             "-" if i.data_offset is None else i.data_offset,
             "-" if i.data_alignment is None else i.data_alignment) for i in layout.items]
    out.append(_table(rows, ("fqn", "kind", "chunk", "at", "file", "offset", "nbytes",
                             "data offset", "aligned"), {5, 6, 7, 8}))
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptlab", description="See inside PyTorch checkpoints.")
    sub = p.add_subparsers(dest="verb", required=True)
    ins = sub.add_parser("inspect", help="layout of a torch.save archive, .safetensors file or "
                                         "DCP checkpoint directory")
    ins.add_argument("path", nargs="?", help="checkpoint file (default: the embedded sample)")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    off = sub.add_parser("offsets", help="storage data offsets, computed without random reads")
    off.add_argument("path")
    off.add_argument("--json", action="store_true", help="print one JSON object")
    off.add_argument("--scan", action="store_true",
                     help="take the storage order from data.pkl (torch's way) instead of the "
                          "central directory; slower, same offsets for torch-written files")
    smp = sub.add_parser("sample", help="write the embedded sample checkpoint")
    smp.add_argument("path")
    smp.add_argument("--alignment", type=int, default=64, help="storage alignment (default 64)")
    rep = sub.add_parser("report", help="write a self-contained offline HTML report")
    rep.add_argument("path", nargs="?", help="checkpoint file (default: the embedded sample)")
    rep.add_argument("-o", "--output", default="report.html",
                     help="HTML file to write (default report.html)")
    rdy = sub.add_parser("readiness",
                         help="is a checkpoint ready for GPUDirect Storage / O_DIRECT reads?")
    rdy.add_argument("path")
    rdy.add_argument("--json", action="store_true", help="print one JSON object")
    srv = sub.add_parser("serve", help="serve the interactive workbench (panel) on 127.0.0.1")
    srv.add_argument("path", nargs="?", help="checkpoint file (default: the embedded sample)")
    srv.add_argument("--port", type=int, default=5006, help="port (default 5006)")
    srv.add_argument("--address", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--show", action="store_true", help="open a browser tab")
    return p


def _render_readiness(r: Any) -> str:
    yes = {True: "yes", False: "no"}
    lines = [
        f"{r.path}: {'READY' if r.ready else 'NOT READY'} for 4 KiB-aligned direct reads"
        + (" (GPU direct possible)" if r.gds else ""),
        f"  storages 4 KiB aligned  {r.storages_4k_aligned} of {r.storages}"
        + (f" (storage_alignment {r.storage_alignment})" if r.storage_alignment else ""),
        f"  size at alignment 64    {r.file_nbytes_at_64:,} B",
        f"  size at alignment 4096  {r.file_nbytes_at_4096:,} B "
        f"(+{r.padding_cost_nbytes:,} B of padding)",
        f"  filesystem              {r.filesystem} on {r.mount_point}",
        f"  O_DIRECT                {yes[r.o_direct]}: {r.o_direct_reason}",
        f"  nvidia-fs driver        {yes[r.nvidia_fs]}",
        f"  libcufile               {yes[r.cufile]}",
        f"  torch.cuda.gds          {yes[r.torch_gds]}: {r.torch_gds_reason}",
        f"  kvikio                  {yes[r.kvikio]}: {r.kvikio_reason}",
    ]
    if r.unaligned_keys and r.storages_4k_aligned < r.storages:
        lines.append("  fix: save with torch.utils.serialization.config.save.storage_alignment "
                     "= 4096 (or ckptlab.gds.save)")
    return "\n".join(lines)


def _path_or_sample(path: str | None) -> str:
    if path is not None:
        return path
    from ckptlab.samples import sample_path

    return str(sample_path())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptlab`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.verb == "inspect":
            layout = inspect(_path_or_sample(args.path))
            if args.json:
                print(json.dumps(layout.to_dict(), default=str))
            else:
                print(render_dcp(layout) if isinstance(layout, DcpLayout)
                      else render_layout(layout))
        elif args.verb == "offsets":
            result = storage_offsets(args.path, scan=args.scan)
            if args.json:
                print(json.dumps(result.to_dict()))
            else:
                print(_table(sorted(result.offsets.items(), key=lambda kv: kv[1]),
                             ("storage", "data offset"), {1}))
                print(f"{result.reads} reads, {result.bytes_read:,} bytes read, method "
                      f"{result.method}" + (f" ({result.reason})" if result.reason else ""))
        elif args.verb == "sample":
            from ckptlab.samples import write_sample

            print(write_sample(args.path, storage_alignment=args.alignment))
        elif args.verb == "report":
            from ckptlab.format import read_range
            from ckptlab.viz import report_html

            path = _path_or_sample(args.path)
            layout = inspect(path)
            head = read_range(path, 0, min(layout.file_nbytes, 1024))
            document = report_html(layout, hex_bytes=head)
            try:
                with open(args.output, "w", encoding="utf-8") as f:
                    f.write(document)
            except OSError as exc:
                raise CkptlabError(f"{args.output}: cannot write the report: "
                                   f"{exc.strerror or exc}") from None
            print(args.output)
        elif args.verb == "readiness":
            from ckptlab.gds.readiness import readiness

            r = readiness(args.path)
            if args.json:
                print(json.dumps(r.to_dict()))
            else:
                print(_render_readiness(r))
        elif args.verb == "serve":
            from ckptlab.widgets.app import serve

            serve(_path_or_sample(args.path), port=args.port, address=args.address,
                  show=args.show)
    except CkptlabError as exc:
        print(f"ckptlab: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ckptlab inspect | head`
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
