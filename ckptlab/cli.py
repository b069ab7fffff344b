"""The ``ckptlab`` command.

Verbs (``ckptlab VERB --help`` tells each one's arguments):

- ``inspect [PATH] [--json] [--filter PATTERN] [--sort KEY] [--records]``: the tensors of
  any checkpoint file, directory or fsspec URL (PATH defaults to the embedded sample): a
  summary and the tensor table (``--filter`` and ``--sort`` are the one tensor query of
  :mod:`ckptlab.checkpoint.query`); ``--records`` shows its bytes instead.
- ``offsets PATH [--json] [--scan]``: where each tensor's bytes start: a torch.save file's
  storage data offsets, computed without random reads; for a safetensors file, a Hugging Face,
  DCP or plain directory, every tensor part's file, offset and bytes, from headers only; for a
  legacy, TorchScript or torch.export file, the same from its checkpoint model.
- ``sample PATH [--alignment N]``: write the embedded sample checkpoint (N: a power of two,
  1 to :data:`MAX_STORAGE_ALIGNMENT`).
- ``report [PATH] [-o OUT] [--compare OTHER] [--stats] [--steps]``: a self-contained
  offline HTML report with the figures, of any checkpoint file or directory (one section per
  file of a multi-file checkpoint); ``--compare`` opens it with what changed from PATH to
  OTHER, ``--stats`` adds every tensor's statistics, ``--steps`` (a training run's
  directory) how far each module moved between its consecutive saves.
- ``readiness PATH [--json]``: is a checkpoint ready for GPUDirect Storage / O_DIRECT reads?
  What is 4 KiB aligned and what would align the rest, in the format's own terms; exit 0
  when ready, 1 when not.
- ``serve [PATH] [--port N] [--address A] [--show] [--compare OTHER]``: the interactive
  workbench (panel), for any checkpoint file or directory on this machine; the port opens at
  once on a quick page with the tensor table (:mod:`ckptlab.widgets.quick`), which becomes
  the workbench. With ``--compare`` the page shows what changed from PATH to OTHER.

- ``diff A B [--json] [--filter PATTERN] [--atol X] [--rtol Y] [--step N]``: what changed
  between two checkpoints of any formats (:func:`ckptlab.compare.diff`); exit 0 when nothing
  differs beyond the tolerances, 1 when something does, 2 on an error.

- ``stats PATH [--json] [--filter PATTERN] [--check] [--step N]``: each tensor's statistics
  (:func:`ckptlab.compare.stats`) and the health lines (NaN/Inf, all-zero, constant tensors,
  ranges far from their layer peers'); ``--check``: exit 1 when a tensor holds NaN or Inf.

- ``scan PATH... [--json]``: is a checkpoint safe to load? (:func:`ckptlab.safety.scan`) A
  line per file holding a pickle, its verdict (``weights-only``, ``data``, ``code``,
  ``unreadable``) and the code it would run; exit 0 when every file is weights-only, 1 when
  any is not, 2 on an error.

- ``convert SRC DST [--to safetensors|torch] [--shard-size SIZE] [--alignment N] [--step N]
  [--json]``: any checkpoint rewritten without running its pickle
  (:func:`ckptlab.write.convert.convert`): safetensors (one file, or a Hugging Face sharded
  directory) or a torch.save archive at any storage alignment; written under a temporary
  name, renamed into place, then verified tensor by tensor.

A training run's directory (saves side by side) is read as the save its framework resumes
from; ``--step N`` (inspect, offsets, report, readiness, serve, diff, stats) picks another
(:mod:`ckptlab.checkpoint.runs`).

Every verb but ``sample`` and ``serve`` also takes an fsspec URL (``https://``, ``s3://``,
``hf://``; the ``remote`` extra), read with ranged requests only.

``ckptlab --version`` prints ``ckptlab <version>``; ``ckptlab`` alone lists the verbs.

Every argument is checked before any work starts: numbers against their ranges, input paths
for existence and kind (a FIFO or a device is refused up front, so nothing blocks on it),
output paths for a directory to write into, the port for being free. Every failure, argparse's
own included, prints one line on stderr, ``ckptlab: error: <what, where, what to do>``, and
exits with status 2; no traceback (``CKPTLAB_TRACEBACK=1`` shows one for an unexpected error).
``--json`` prints one JSON object: indented when stdout is a terminal, one compact line
otherwise (for scripts).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from ckptlab import __version__
from ckptlab._lazy import lazy_attributes
from ckptlab._words import plural
from ckptlab.errors import CkptlabError, InvalidArgumentError

if TYPE_CHECKING:  # imported where used: --version and argument errors need none of them
    from ckptlab.dcp import DcpLayout
    from ckptlab.format import ArchiveLayout


# names of this module imported on first use
__getattr__, __dir__ = lazy_attributes(__name__, globals(),
                                       {"storage_offsets": "ckptlab.format:storage_offsets"})

__all__ = ["MAX_STORAGE_ALIGNMENT", "VERBS", "main"]

# The largest storage alignment torch.load reads back, checked against torch itself (2.13;
# tests/test_cli_bad_args.py::test_max_alignment_is_torchs_limit). torch.save pads every
# record's data to the alignment inside a zip extra field ("FB") whose length is 16 bits:
# 4 bytes of field header + up to alignment - 1 bytes of padding (+ up to 28 bytes of zip64
# extra past 4 GiB) must stay <= 65535. At 32768 the worst padding, 32767 bytes, loads back;
# at 65536 a record padded by 65532..65535 bytes wraps the length field and torch.load
# silently returns wrong bytes for the next tensor; above 65536 it cannot parse the archive.
# Alignment 0 makes torch divide by zero (SIGFPE). So: a power of two from 1 to 32768.
MAX_STORAGE_ALIGNMENT = 32768

# verb -> what it does, in one line: the parser's help and the bare ``ckptlab`` usage
VERBS: dict[str, str] = {
    "inspect": "the tensors of any checkpoint (file or directory), with --records its bytes",
    "offsets": "where each tensor's bytes start, found from headers only",
    "sample": "write the embedded sample checkpoint",
    "report": "write a self-contained offline HTML report of any checkpoint",
    "readiness": "is a checkpoint ready for GPUDirect Storage / O_DIRECT reads?",
    "serve": "serve the interactive workbench (panel) for any checkpoint on 127.0.0.1",
    "diff": "what changed between two checkpoints of any formats (exit 1 when anything did)",
    "stats": "each tensor's statistics and the checkpoint's health (--check: exit 1 on NaN/Inf)",
    "scan": "is a checkpoint safe to load? every pickle read without running it (exit 1 "
            "unless torch's weights-only loader takes it)",
    "convert": "rewrite any checkpoint as safetensors or torch.save (any alignment) without "
               "running its pickle",
}


def _fmt_path(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path) or "<root>"


# the terminal's width that tables are fitted into (set by ``main`` at a terminal without
# ``--wide``); None: tables as wide as their cells (a pipe, a file, ``--wide``)
_FIT: int | None = None
MIN_NAME = 40  # a fitted table cuts its name column down to this many characters at most


def _cut(text: str, width: int) -> str:
    """``text`` in ``width`` characters, its middle replaced by "…" (both ends of a tensor's
    name say which it is: ``model.layers.0.mlp.c_fc.weight``)."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _table(rows: list[Sequence[Any]], header: Sequence[str], right: set[int]) -> str:
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    same = ""
    if _FIT and sum(widths) + 2 * (len(widths) - 1) > _FIT and len(rows) > 1:
        # too wide for the terminal: columns with one value in every row go to a line below
        keep = [i for i in range(len(header))
                if i == 0 or len({r[i] for r in cells[1:]}) > 1]
        same = ", ".join(f"{cells[0][i]} {cells[1][i]}" for i in range(len(header))
                         if i not in keep)
        cells = [[r[i] for i in keep] for r in cells]
        widths = [widths[i] for i in keep]
        right = {keep.index(i) for i in right if i in keep}
    over = sum(widths) + 2 * (len(widths) - 1) - _FIT if _FIT else 0
    if over > 0 and 0 not in right:  # then the first column (the names) gives up width
        widths[0] = max(widths[0] - over, min(MIN_NAME, widths[0]))
        for r in cells[1:]:
            r[0] = _cut(r[0], widths[0])
    lines = []
    for row in cells:
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    if same:
        lines.append(f"(every row: {same})")
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
        f"  {plural(len(layout.records), 'record')}, {plural(len(layout.storages), 'storage')}, "
        f"{plural(len(layout.tensors), 'tensor')}; overhead {layout.overhead_nbytes:,} bytes "
        f"({pct:.2f}%), "
        f"padding {layout.padding_nbytes:,} bytes",
        "",
    ]
    if layout.records:
        out.append(_table(
            [(r.short_name, *(f"{x:,}" for x in (r.header_offset, r.data_offset, r.data_nbytes,
                                                  r.padding_nbytes, r.zip64_extra_nbytes,
                                                  r.descriptor_nbytes)))
             for r in layout.records],
            ("record", "header", "data", "nbytes", "pad", "zip64", "desc"), {1, 2, 3, 4, 5, 6}))
        out.append("")
    out.append(_table(
        [(_fmt_path(t.path), t.dtype, "x".join(map(str, t.shape)) or "scalar", t.storage_key,
          f"{t.storage_offset:,}") for t in layout.tensors],
        ("tensor", "dtype", "shape", "storage", "offset"), {4}))
    return "\n".join(out)


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:,} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return str(nbytes)


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def select_tensors(ck: Any, pattern: str | None, sort: str | None) -> list[Any]:
    """The tensors ``inspect`` shows: the entries the one tensor query
    (:func:`ckptlab.checkpoint.query.select_tensors`) finds for ``pattern`` (a name part or a
    glob, case-insensitive; None: all), in ``sort`` order (None: the checkpoint's own)."""
    from ckptlab.checkpoint.query import TensorCatalog, TensorQuery

    entries = list(ck.tensors.values())
    catalog = TensorCatalog.of(ck)
    found = catalog.select(TensorQuery(pattern or "", sort or "order"))
    return [entries[i] for i in found.rows.tolist()]


def render_checkpoint(ck: Any, tensors: list[Any], pattern: str | None = None,
                      safety: Any = None) -> str:
    """``ckptlab inspect``: a summary, is it safe to load (``safety``: a
    :class:`~ckptlab.safety.SafetyReport`), totals by dtype, the tensor table, the other
    values."""
    total = ck.parameters
    out = [f"{ck.path}",
           f"  {ck.format} checkpoint: {plural(len(ck.tensors), 'tensor')}, {_count(total)} parameters, "
           f"{_human(ck.nbytes)} in {len(ck.files)} file{'s' * (len(ck.files) != 1)}"]
    by_dtype: dict[str, list[int]] = {}
    for t in ck.tensors.values():
        acc = by_dtype.setdefault(t.dtype, [0, 0, 0])
        acc[0] += 1
        acc[1] += t.parameters
        acc[2] += t.nbytes
    if safety is not None:
        out.append(f"  safe to load? {_text(safety.headline())}")
    out.append("  " + "; ".join(f"{d}: {plural(n, 'tensor')}, {_count(p)} params, {_human(b)}"
                                for d, (n, p, b) in sorted(by_dtype.items(),
                                                           key=lambda kv: -kv[1][2])))
    for note in ck.notes:
        out.append(f"  note: {note}")
    if ck.run is not None:
        out.append("")
        out.append(_render_run(ck.run))
    out.append("")
    shown = f" matching {pattern!r}" if pattern else ""
    out.append(f"tensors{shown} ({len(tensors):,}):")
    multi = len(ck.files) > 1
    rows = []
    for t in tensors:
        shape = "?" if t.shape is None else ("x".join("j" if d < 0 else str(d) for d in t.shape)
                                             or "scalar")
        row = [_text(t.name), t.dtype, shape, t.kind, f"{t.nbytes:,}", f"{t.parameters:,}"]
        if multi:
            row.append(_text(t.file))
        row.append("-" if t.offset is None else f"{t.offset:,}")
        rows.append(row)
    header = ["name", "dtype", "shape", "kind", "bytes", "params", *(["file"] if multi else []),
              "offset"]
    right = {4, 5, len(header) - 1}
    out.append(_table(rows, header, right) if rows else "  (none)")
    values = ck.objects
    if values and pattern is None:
        out.append("")
        out.append(f"other values ({len(values):,}):")
        out.append(_table([(_text(k), _text(_short_value(v))) for k, v in values.items()],
                          ("name", "value"), set()))
    return "\n".join(out)


def _render_run(run: Any) -> str:
    """The saves of a training run, the one shown marked (the run's resume rule or --step)."""
    import datetime

    rows = []
    for s in run.steps:
        when = datetime.datetime.fromtimestamp(s.mtime).strftime("%Y-%m-%d %H:%M")
        rows.append(["*" if s.name == run.opened else "", _text(s.name),
                     "-" if s.number is None else f"{s.number:,}", _human(s.nbytes), when,
                     "yes" if s.complete else "NO (incomplete)"])
    head = (f"{run.framework} run: {len(run.steps)} save{'s' * (len(run.steps) != 1)}; "
            f"resumes from {run.resume.name if run.resume else 'none'} ({_text(run.rule)}); "
            + (f"shown: {run.opened} (*)" if run.opened else
               "shown: the directory's own model (--step N shows a save)"))
    return head + "\n" + _table(rows, ("", "save", "step", "size", "modified", "complete"),
                                {2, 3})


def _text(value: Any) -> str:
    """Printable text for a terminal: names can hold anything (lone surrogates, controls)."""
    text = str(value)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _short_value(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def checkpoint_json(ck: Any, tensors: list[Any]) -> dict[str, Any]:
    """The ``inspect --json`` object: :func:`ckptlab.checkpoint.inspect_json`."""
    from ckptlab.checkpoint._json import inspect_json

    return inspect_json(ck, tensors)


def render_dcp(layout: DcpLayout) -> str:
    """Readable summary of a DCP directory: files, then one row per item."""
    out = [f"{layout.path}: DCP checkpoint, {layout.file_nbytes:,} bytes in "
           f"{plural(len(layout.files), 'data file')} + .metadata "
           f"({layout.metadata_nbytes:,} B), {plural(len(layout.items), 'item')}, "
           f"{plural(len(layout.tensors), 'tensor')}"]
    out.append(_table([(name, f"{n:,}") for name, n in layout.files], ("file", "bytes"), {1}))
    rows = [(i.fqn, i.kind, "x".join(map(str, i.chunk_sizes)) or "-",
             ",".join(map(str, i.chunk_offsets)) or "-", i.file, f"{i.offset:,}",
             f"{i.nbytes:,}", "-" if i.data_offset is None else f"{i.data_offset:,}",
             "-" if i.data_alignment is None else i.data_alignment) for i in layout.items]
    out.append(_table(rows, ("fqn", "kind", "chunk", "at", "file", "offset", "nbytes",
                             "data offset", "aligned"), {5, 6, 7, 8}))
    return "\n".join(out)


_FORMAT_WORDS = {"safetensors": "a safetensors file", "hf": "a Hugging Face directory",
                 "dcp": "a DCP directory", "dir": "a directory of checkpoint files",
                 "deepspeed": "a DeepSpeed save", "tensorizer": "a tensorizer file",
                 "torch-zip": "a torch.save file", "torch-legacy": "a legacy torch.save file",
                 "torchscript": "a TorchScript archive", "pt2": "a torch.export archive"}
_READINESS_ROWS = 20  # ranges listed by ``ckptlab readiness``; --json lists every one
_READINESS_FIXES = 8  # files whose fix is printed


def _render_readiness(r: Any) -> str:
    """``ckptlab readiness``: the verdict, what is aligned in the format's words, the machine,
    and what to do."""
    yes = {True: "yes", False: "no"}
    torch_file = r.file_nbytes_at_64 is not None and r.file_nbytes_at_4096 is not None
    lines = [f"{r.path}: {'READY' if r.ready else 'NOT READY'} for 4 KiB-aligned direct reads"
             + (" (GPU direct possible)" if r.gds else "")]
    if torch_file:
        lines += [
            f"  storages 4 KiB aligned  {r.storages_4k_aligned} of {r.storages}"
            + (f" (storage_alignment {r.storage_alignment})" if r.storage_alignment else ""),
            f"  size at alignment 64    {r.file_nbytes_at_64:,} B",
            f"  size at alignment 4096  {r.file_nbytes_at_4096:,} B "
            f"(+{r.padding_cost_nbytes:,} B of padding)"]
    else:
        units = {f.unit for f in r.files} or {"tensors"}
        unit = units.pop() if len(units) == 1 else "byte ranges"
        what = _FORMAT_WORDS.get(r.format, f"a {r.format} checkpoint")
        lines.append(f"  {(unit + ' 4 KiB aligned').ljust(22)}  {r.storages_4k_aligned} of "
                     f"{r.storages} ({what}, {len(r.files)} file"
                     f"{'s' * (len(r.files) != 1)} with tensor bytes)")
        multi = len(r.files) > 1
        if multi:
            starts = any(f.data_offset is not None for f in r.files)  # safetensors files
            rows = [[_text(f.path), f.format, f"{f.aligned} of {len(f.ranges)} {f.unit}"]
                    + (["-" if f.data_offset is None else f"{f.data_offset:,}"] * starts)
                    for f in r.files]
            lines.append(_indent(_table(rows, ("file", "format", "4 KiB aligned",
                                               *(["data starts at"] * starts)), {3})))
        every = [(f, x) for f in r.files for x in f.ranges]
        rows = []
        for f, x in every[:_READINESS_ROWS]:
            row = [_text(x.name)] + ([_text(f.path)] if multi else [])
            row += [f"{x.offset:,}", f"{x.nbytes:,}",
                     "compressed" if x.compression else
                     ("yes" if x.aligned else f"no (alignment {x.alignment})")]
            rows.append(row)
        if rows:
            header = [unit.rstrip("s"), *(["file"] * multi), "data offset", "bytes",
                      "4 KiB aligned"]
            lines.append(_indent(_table(rows, header, {header.index("data offset"),
                                                       header.index("bytes")})))
        if len(every) > _READINESS_ROWS:
            lines.append(f"  ... {len(every) - _READINESS_ROWS:,} more (--json lists every one)")
        for f in r.files:
            if f.data_offset is not None and not multi:
                lines.append(f"  data section starts     byte {f.data_offset:,} (after the "
                             "JSON header)")
    lines += [
        f"  filesystem              {r.filesystem} on {r.mount_point}",
        f"  O_DIRECT                {yes[r.o_direct]}: {r.o_direct_reason}",
        f"  nvidia-fs driver        {yes[r.nvidia_fs]}",
        f"  libcufile               {yes[r.cufile]}",
        f"  torch.cuda.gds          {yes[r.torch_gds]}: {r.torch_gds_reason}",
        f"  kvikio                  {yes[r.kvikio]}: {r.kvikio_reason}",
    ]
    fixes = r.fixes
    if len(fixes) == 1 or (fixes and len({fix for _, fix in fixes}) == 1):
        where = "" if len(r.files) <= 1 else (
            f" ({fixes[0][0]})" if len(fixes) == 1 else
            (" (both files)" if len(fixes) == 2 else f" (all {len(fixes)} files)"))
        lines.append(f"  fix{where}: {fixes[0][1]}")
    else:
        for path, fix in fixes[:_READINESS_FIXES]:
            lines.append(f"  fix {_text(path)}: {fix}")
        if len(fixes) > _READINESS_FIXES:
            lines.append(f"  ... {len(fixes) - _READINESS_FIXES} more files to fix (--json has "
                         "each file's fix)")
    return "\n".join(lines)


def _indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in text.splitlines())


# -- offsets of any checkpoint ----------------------------------------------------------------
def _sniff_file(path: str) -> str | None:
    """:func:`ckptlab.format.inspect.sniff` of a local file; None for a directory."""
    from ckptlab.format.inspect import sniff
    from ckptlab.source._bytes import ByteSource

    if os.path.isdir(path):
        return None
    with ByteSource(path) as src:
        return sniff(src)


# sniff's kinds that take the torch.save offsets path first: a zip, and files that are no
# checkpoint at all (its own errors for an empty or foreign file); safetensors, legacy files
# and directories go through the checkpoint model
_STORAGE_OFFSETS_KINDS = ("torch-zip", "empty", "unknown")


def _other_zip(refusal: Exception, open_model: Callable[[], Any]) -> Any:
    """The checkpoint model of a zip that :func:`ckptlab.format.storage_offsets` refused
    (``refusal``, an UnsupportedFormatError) as no torch.save archive: sniff says "torch-zip"
    of any zip, so what it is is told by its records, as :func:`ckptlab.open` tells it
    (``ckptlab.checkpoint._torchscript.model_zip``: TorchScript, torch.export). A zip the
    model does not read as one of those keeps the refusal."""
    from ckptlab.errors import UnsupportedFormatError

    try:
        ck = open_model()
    except UnsupportedFormatError:
        raise refusal from None
    if ck.format == "torch-zip":  # a torch.save archive after all: the refusal stands
        raise refusal
    return ck


class _Count:
    """Read calls and bytes of the header pass, per file and in words."""

    def __init__(self) -> None:
        self.reads = 0
        self.bytes_read = 0
        self.files: dict[str, dict[str, Any]] = {}

    def add(self, file: str, how: str, reads: int, nbytes: int) -> None:
        entry = self.files.setdefault(file, {"how": how, "reads": 0, "bytes_read": 0})
        entry["reads"] += reads
        entry["bytes_read"] += nbytes
        self.reads += reads
        self.bytes_read += nbytes


def _mismatch(ck: Any, key: str, part: Any, found: int | None) -> NoReturn:
    from ckptlab.errors import CorruptArchiveError

    raise CorruptArchiveError(
        "the file's headers and ckptlab's checkpoint model place this tensor differently "
        "(the file changed while it was read, or a bug in ckptlab: report it)",
        path=os.path.join(ck.path, part.file) if len(ck.files) > 1 else ck.path, record=key,
        offset=part.offset, expected=part.offset, actual=found)


def _check_parts(ck: Any, parts: list[tuple[str, Any]], found: Callable[[Any], int | None]
                 ) -> None:
    for key, part in parts:
        at = found(part)
        if at != part.offset:
            _mismatch(ck, key, part, at)


def _itemsize(dtype: str) -> int:
    from ckptlab.format._dtypes import DTYPE_ITEMSIZE

    return DTYPE_ITEMSIZE.get(dtype, 1)


def _dcp_header_pass(ck: Any, entry: Any, parts: list[tuple[str, Any]], count: _Count,
                     item_nbytes: dict[tuple[str, int], int]) -> None:
    """A DCP data file: each torch.save item's zip directory (the storage offsets way), each
    safetensors blob's header; a compressed chunk's place is in .metadata (no read)."""
    import bisect

    from ckptlab.cli import storage_offsets
    from ckptlab.format.layout import SegmentKind
    from ckptlab.format.safetensors import scan_safetensors
    from ckptlab.source._bytes import ByteSource
    from ckptlab.source._window import FileWindow

    starts = [s.offset for s in entry.segments]
    found: dict[int, Callable[[Any], int | None]] = {}
    with open(entry.full_path, "rb") as fh:
        for key, part in parts:
            item = part.item_offset if part.item_offset is not None else part.offset
            if part.compression is not None:
                if part.offset != item:
                    _mismatch(ck, key, part, item)
                continue
            if item not in found:
                i = bisect.bisect_right(starts, item) - 1
                kind = entry.segments[i].kind if i >= 0 and entry.segments[i].offset == item \
                    else None
                if kind is SegmentKind.LOCAL_HEADER:
                    nbytes = item_nbytes.get((entry.path, item), entry.nbytes - item)
                    window = FileWindow(fh, item, nbytes, f"{entry.full_path}@{item}")
                    so = storage_offsets(window)
                    count.add(entry.path, "item zip directories", so.reads, so.bytes_read)
                    first = next(iter(so.offsets.values()), None)
                    found[item] = (lambda p, first=first, item=item: None if first is None
                                   else item + first + p.storage_offset * _itemsize(p.dtype))
                elif kind is SegmentKind.HEADER_LENGTH:
                    window = FileWindow(fh, item, entry.nbytes - item,
                                        f"{entry.full_path}@{item}")
                    with ByteSource(window) as src:
                        blob = scan_safetensors(src)
                    count.add(entry.path, "safetensors header", src.reads, src.bytes_read)
                    where = {s.key: item + s.data_offset for s in blob.storages}
                    found[item] = lambda p, where=where: where.get(p.storage_key)
                else:
                    found[item] = lambda p: p.offset  # a layout ckptlab only models
                    count.files.setdefault(entry.path, {"how": "not counted", "reads": 0,
                                                        "bytes_read": 0})
            at = found[item](part)
            if at != part.offset:
                _mismatch(ck, key, part, at)


def checkpoint_offsets(ck: Any) -> dict[str, Any]:
    """``ckptlab offsets --json`` of a checkpoint that is not one torch.save file.

    ``offsets`` maps every tensor part (keys as :func:`ckptlab.gds.readiness.tensor_ranges`
    names them) to the absolute offset of its bytes in its file; ``files`` and ``nbytes``
    say which file and how many bytes. The offsets are the checkpoint model's; a second,
    counted pass re-derives each from its file's headers alone (safetensors: the header;
    torch.save: the zip directory, as ``storage_offsets`` does; DCP: ``.metadata`` and each
    item's zip directory or safetensors header) and must agree. ``reads`` and
    ``bytes_read`` count that pass: what a reader needs to find the bytes without loading
    anything. Files of a kind it does not cover are listed in ``uncounted_files``.
    """
    from ckptlab.cli import storage_offsets
    from ckptlab.format.safetensors import scan_safetensors
    from ckptlab.gds.readiness import tensor_ranges
    from ckptlab.source._bytes import ByteSource

    parts = [(r.name, p) for r, p in zip(
        tensor_ranges(ck), (p for t in ck.tensors.values() for p in t.parts), strict=True)]
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for key, part in parts:
        by_file.setdefault(part.file, []).append((key, part))
    count = _Count()
    item_nbytes: dict[tuple[str, int], int] = {}
    if ck.format == "dcp":
        from ckptlab.dcp import METADATA, inspect_dcp

        meta = inspect_dcp(ck.path, item_layouts=False)  # .metadata alone, in one read
        count.add(METADATA, ".metadata", 1, meta.metadata_nbytes)
        item_nbytes = {(i.file, i.offset): i.nbytes for i in meta.items}
    for entry in ck.files:
        if entry.format == "json" and entry.path.endswith(".json") and ".index" in entry.path:
            count.add(entry.path, "index", 1, entry.nbytes)  # names the shards
    uncounted = []
    for entry in ck.files:
        mine = by_file.get(entry.path)
        if not mine:
            continue
        if not entry.full_path:
            uncounted.append(entry.path)
        elif entry.format == "safetensors":
            with ByteSource(entry.full_path) as src:
                layout = scan_safetensors(src)
            count.add(entry.path, "safetensors header", src.reads, src.bytes_read)
            where = {s.key: s.data_offset for s in layout.storages}
            _check_parts(ck, mine, lambda p, where=where: where.get(p.storage_key))
        elif entry.format == "torch-zip":
            so = storage_offsets(entry.full_path)
            count.add(entry.path, "zip directory", so.reads, so.bytes_read)
            _check_parts(ck, mine, lambda p, so=so: None if p.storage_key not in so.offsets
                         else so.offsets[p.storage_key] + p.storage_offset * _itemsize(p.dtype))
        elif entry.format == "distcp":
            _dcp_header_pass(ck, entry, mine, count, item_nbytes)
        else:
            uncounted.append(entry.path)
    uncounted += [f for f, c in count.files.items() if c["how"] == "not counted"]
    doc: dict[str, Any] = {
        "offsets": {k: p.offset for k, p in parts},
        "files": {k: p.file for k, p in parts},
        "nbytes": {k: p.nbytes for k, p in parts},
        "reads": count.reads if count.files or not uncounted else None,
        "bytes_read": count.bytes_read if count.files or not uncounted else None,
        "method": "headers" if count.files else "model", "format": ck.format,
        "path": ck.path,
        "tensors": {k: name for (k, _), name in zip(parts, (
            t.name for t in ck.tensors.values() for _ in t.parts))},
        "read_per_file": {f: c for f, c in count.files.items() if c["how"] != "not counted"},
        "uncounted_files": sorted(set(uncounted))}
    compressed = {k: p.compression for k, p in parts if p.compression is not None}
    if compressed:
        doc["compression"] = compressed
    return doc


def render_offsets(doc: dict[str, Any]) -> str:
    """``ckptlab offsets`` of any checkpoint: one row per tensor part, then what was read."""
    multi = len(set(doc["files"].values())) > 1
    compressed = doc.get("compression", {})
    chunked = any("@" in k and doc["tensors"].get(k) != k for k in doc["offsets"])
    unit = "tensor (@chunk offsets)" if chunked else "tensor"
    rows = []
    for key, offset in sorted(doc["offsets"].items(),
                              key=lambda kv: (doc["files"][kv[0]], kv[1], kv[0])):
        row = [_text(key)]
        if multi:
            row.append(_text(doc["files"][key]))
        row += [f"{offset:,}", f"{doc['nbytes'][key]:,}"]
        if compressed:
            row.append(compressed.get(key, "-"))
        rows.append(row)
    header = [unit, *(["file"] * multi), "data offset", "bytes",
              *(["compressed"] * bool(compressed))]
    right = {header.index("data offset"), header.index("bytes")}
    out = [_table(rows, header, right) if rows else "(no tensors)"]
    if doc["reads"] is None:
        out.append(f"reads not counted: ckptlab has no header-only reader for "
                   f"{', '.join(doc['uncounted_files'])}; the offsets come from its model")
    else:
        hows: dict[str, list[int]] = {}
        for c in doc["read_per_file"].values():
            acc = hows.setdefault(c["how"], [0, 0])
            acc[0] += 1
            acc[1] += c["reads"]
        said = "; ".join((f"{how} of {files} files" if files > 1 else how)
                         + f" ({reads} read{'s' * (reads != 1)})"
                         for how, (files, reads) in hows.items())
        out.append(f"{doc['reads']} read{'s' * (doc['reads'] != 1)}, {doc['bytes_read']:,} "
                   f"bytes read: {said}")
        if doc["uncounted_files"]:
            out.append(f"not counted (no header-only reader): "
                       f"{', '.join(doc['uncounted_files'])}")
    if compressed:
        out.append("a compressed chunk's offset and bytes are those of its stored frame: it is "
                   "inflated on read, never read in place")
    return "\n".join(out)


# -- arguments ------------------------------------------------------------------------------
class _Exit(Exception):
    """argparse finished on its own (``--help``, ``--version``): the exit status to return."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse, but every error is one ``ckptlab: error:`` line, and nothing calls sys.exit
    (``main`` returns the status, so tests and callers can run it in-process)."""

    verbs: dict[str, argparse.ArgumentParser]  # the verbs' own parsers (top level only)

    def error(self, message: str) -> NoReturn:
        raise InvalidArgumentError(f"{message} (see '{self.prog} --help')")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


def _digits(text: str, what: str) -> int:
    if not re.fullmatch(r"[0-9]{1,12}", text.strip()):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return int(text)


def _alignment(text: str) -> int:
    what = f"a power of two from 1 to {MAX_STORAGE_ALIGNMENT}"
    n = _digits(text, what)
    if n < 1 or n & (n - 1) or n > MAX_STORAGE_ALIGNMENT:
        why = ("" if n <= MAX_STORAGE_ALIGNMENT else
               f" (torch.save keeps the padding in a 16-bit zip field: above "
               f"{MAX_STORAGE_ALIGNMENT}, torch.load misreads the file)")
        raise argparse.ArgumentTypeError(f"expected {what}, got {n}{why}")
    return n


def _port(text: str) -> int:
    n = _digits(text, "a TCP port from 1 to 65535")
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {n}")
    return n


def _sort_key(text: str) -> str:
    """``--sort``'s value, checked against the query's keys (imported only when the option is
    given: ``--version`` and the other verbs never import the checkpoint model)."""
    from ckptlab.checkpoint.query import SORT_KEYS

    if text not in SORT_KEYS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(SORT_KEYS)}, got {text!r}")
    return text


_STEP_HELP = ("for a training run's directory (checkpoint-N/, iter_N/, global_stepN/, "
              "step-N/, epoch_N/, *.ckpt): the save of step N (default: the one the "
              "framework resumes from)")


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step number (0 or more), not {text!r}")
    return value


def _resolve_run(args: argparse.Namespace) -> Any:
    """For a training run's directory: put the save to read in ``args.path`` (``--step N``,
    else the one the framework resumes from) and give the run; None for anything else."""
    from ckptlab.checkpoint.runs import RUN_LAYOUTS, resolve_run

    path, step = getattr(args, "path", None), getattr(args, "step", None)
    run = None
    if path is not None and not _is_url(path):
        args.path, run = resolve_run(path, step)
    if step is not None and run is None:
        raise InvalidArgumentError(f"{path}: --step is for a training run's directory (saves "
                                   f"side by side: {RUN_LAYOUTS}); this is not one")
    return run


def _parser() -> _Parser:
    p = _Parser(prog="ckptlab", description="See inside PyTorch checkpoints.")
    p.add_argument("--version", action="version", version=f"ckptlab {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    default = " (default: the embedded sample)"
    ins = sub.add_parser("inspect", help=VERBS["inspect"], description=VERBS["inspect"])
    ins.add_argument("path", nargs="?", metavar="PATH",
                     help="checkpoint file or DCP directory" + default)
    ins.add_argument("--step", type=_step, default=None, metavar="N", help=_STEP_HELP)
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.add_argument("--wide", action="store_true",
                     help="tables as wide as their longest names (at a terminal they are "
                          "fitted to its width, names cut in the middle)")
    ins.add_argument("--records", action="store_true",
                     help="the byte-level view: zip records / DCP items instead of tensors")
    ins.add_argument("--filter", metavar="PATTERN", default=None,
                     help="only tensors whose name contains PATTERN, or matches it whole when "
                          "it is a glob with * ? or [ (e.g. mlp, '*.mlp.*'); case-insensitive")
    ins.add_argument("--sort", type=_sort_key, default=None, metavar="KEY",
                     help="order the tensors by name (natural: h.2 before h.10), size (bytes, "
                          "largest first), parameters (largest first), offset (file order), "
                          "dtype, kind or file; default: the checkpoint's own order")
    off = sub.add_parser("offsets", help=VERBS["offsets"], description=VERBS["offsets"])
    off.add_argument("path", metavar="PATH",
                     help="checkpoint file or directory (safetensors, Hugging Face, DCP)")
    off.add_argument("--step", type=_step, default=None, metavar="N", help=_STEP_HELP)
    off.add_argument("--json", action="store_true", help="print one JSON object")
    off.add_argument("--scan", action="store_true",
                     help="torch.save files only: take the storage order from data.pkl "
                          "(torch's way) instead of the central directory; slower, same "
                          "offsets for torch-written files")
    smp = sub.add_parser("sample", help=VERBS["sample"], description=VERBS["sample"])
    smp.add_argument("path", metavar="PATH", help="file to write (its directory must exist)")
    smp.add_argument("--alignment", type=_alignment, default=64, metavar="N",
                     help=f"storage alignment: a power of two from 1 to "
                          f"{MAX_STORAGE_ALIGNMENT} (default 64)")
    rep = sub.add_parser("report", help=VERBS["report"], description=VERBS["report"])
    rep.add_argument("path", nargs="?", metavar="PATH",
                     help="checkpoint file or directory" + default)
    rep.add_argument("--step", type=_step, default=None, metavar="N", help=_STEP_HELP)
    rep.add_argument("-o", "--output", default="report.html", metavar="OUT",
                     help="HTML file to write (default report.html)")
    rep.add_argument("--compare", default=None, metavar="OTHER",
                     help="open with what changed from PATH to OTHER (any format; see "
                          "'ckptlab diff'), with histograms of the most changed tensors")
    rep.add_argument("--stats", action="store_true",
                     help="add every tensor's statistics and the health line "
                          "(see 'ckptlab stats'; reads every tensor once)")
    rep.add_argument("--steps", action="store_true",
                     help="for a training run's directory: how far each module moved between "
                          "its consecutive saves (reads every save once)")
    rdy = sub.add_parser("readiness", help=VERBS["readiness"], description=VERBS["readiness"])
    rdy.add_argument("path", metavar="PATH", help="checkpoint file or directory")
    rdy.add_argument("--step", type=_step, default=None, metavar="N", help=_STEP_HELP)
    rdy.add_argument("--json", action="store_true", help="print one JSON object")
    rdy.add_argument("--wide", action="store_true",
                     help="tables as wide as their longest names (at a terminal they are "
                          "fitted to its width, names cut in the middle)")
    srv = sub.add_parser("serve", help=VERBS["serve"], description=VERBS["serve"])
    srv.add_argument("path", nargs="?", metavar="PATH",
                     help="checkpoint file or directory (any format ckptlab.open reads)"
                     + default)
    srv.add_argument("--step", type=_step, default=None, metavar="N", help=_STEP_HELP)
    srv.add_argument("--port", type=_port, default=5006, metavar="N",
                     help="port, 1 to 65535 (default 5006)")
    srv.add_argument("--address", default="127.0.0.1", metavar="A",
                     help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--show", action="store_true", help="open a browser tab")
    srv.add_argument("--compare", default=None, metavar="OTHER",
                     help="serve what changed from PATH to OTHER instead (any format; see "
                          "'ckptlab diff'): module bars, histograms, the table")
    dif = sub.add_parser("diff", help=VERBS["diff"], description=VERBS["diff"])
    dif.add_argument("path", metavar="A", help="checkpoint file, directory or URL")
    dif.add_argument("other", metavar="B", help="checkpoint file, directory or URL")
    dif.add_argument("--json", action="store_true", help="print one JSON object")
    dif.add_argument("--filter", metavar="PATTERN", default=None,
                     help="only tensors whose name contains PATTERN, or matches it whole when "
                          "it is a glob with * ? or [; case-insensitive")
    dif.add_argument("--atol", type=_tolerance, default=0.0, metavar="X",
                     help="absolute tolerance (default 0: any difference counts)")
    dif.add_argument("--rtol", type=_tolerance, default=0.0, metavar="Y",
                     help="relative tolerance, of |B| (default 0)")
    dif.add_argument("--step", type=_step, default=None, metavar="N", help=_STEP_HELP
                     + "; for each side that is a run")
    sts = sub.add_parser("stats", help=VERBS["stats"], description=VERBS["stats"])
    sts.add_argument("path", metavar="PATH", help="checkpoint file, directory or URL")
    sts.add_argument("--json", action="store_true", help="print one JSON object")
    sts.add_argument("--wide", action="store_true",
                     help="tables as wide as their longest names (at a terminal they are "
                          "fitted to its width, names cut in the middle)")
    sts.add_argument("--filter", metavar="PATTERN", default=None,
                     help="only tensors whose name contains PATTERN, or matches it whole when "
                          "it is a glob with * ? or [; case-insensitive")
    sts.add_argument("--check", action="store_true",
                     help="exit 1 when any tensor holds a NaN or an Inf (naming them)")
    sts.add_argument("--step", type=_step, default=None, metavar="N", help=_STEP_HELP)
    scn = sub.add_parser("scan", help=VERBS["scan"], description=VERBS["scan"])
    scn.add_argument("paths", metavar="PATH", nargs="+",
                     help="checkpoint files, directories or URLs of files")
    scn.add_argument("--json", action="store_true", help="print one JSON object")
    scn.set_defaults(path=None)
    cnv = sub.add_parser("convert", help=VERBS["convert"], description=VERBS["convert"])
    cnv.add_argument("path", metavar="SRC", help="checkpoint file, directory or URL")
    cnv.add_argument("output", metavar="DST", help="the file to write (a directory with "
                     "--shard-size)")
    cnv.add_argument("--to", choices=("safetensors", "torch"), default="safetensors",
                     help="the format to write (default safetensors)")
    cnv.add_argument("--shard-size", type=_size, default=None, metavar="SIZE",
                     help="safetensors: a Hugging Face sharded directory of shards of at most "
                          "SIZE (5GB, 500MB, 2GiB, or bytes)")
    cnv.add_argument("--alignment", type=_alignment, default=None, metavar="N",
                     help="torch: the storage alignment (a power of two, 1 to "
                          f"{MAX_STORAGE_ALIGNMENT}; 4096 for GDS); safetensors: where the "
                          "data section starts")
    cnv.add_argument("--step", type=_step, default=None, metavar="N", help=_STEP_HELP)
    cnv.add_argument("--json", action="store_true", help="print one JSON object")
    p.verbs = sub.choices
    return p


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _size(text: str) -> int:
    """A size as transformers writes ``max_shard_size``: ``5GB``, ``500MB``, ``2GiB`` or
    bytes."""
    import re

    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = _SIZE_UNITS.get(found.group(2).lower()) if found else None
    if found is None or unit is None or float(found.group(1)) * unit < 1:
        raise argparse.ArgumentTypeError(f"a size such as 5GB, 500MB, 2GiB or a number of "
                                         f"bytes, not {text!r}")
    return int(float(found.group(1)) * unit)


def _convert(args: argparse.Namespace) -> int:
    """``ckptlab convert SRC DST``: the summary (or the JSON) of what was written."""
    from ckptlab.write.convert import convert

    result = convert(args.path, args.output, to=args.to, shard_size=args.shard_size,
                     alignment=args.alignment, step=args.step)
    if args.json:
        _print_json(result.to_dict())
    else:
        print("\n".join(_text(line) for line in result.summary().splitlines()))
    return 0


def _scan(args: argparse.Namespace) -> int:
    """``ckptlab scan PATH...``: a line per file (the code calls spelled out) or the JSON;
    0 when every file is weights-only, 1 when any is not."""
    from ckptlab.safety import SafetyReport, scan

    reports = [scan(path) for path in args.paths]
    every = SafetyReport(" ".join(args.paths), [f for r in reports for f in r.files],
                         [s for r in reports for s in r.skipped])
    if args.json:
        _print_json(every.to_dict())
    else:
        print("\n".join(_text(line) for r in reports for line in r.summary().splitlines()))
    return every.exit_status


def _stats(args: argparse.Namespace) -> int:
    """``ckptlab stats PATH``: a row per tensor and the health lines, or the JSON; with
    ``--check`` 1 when a tensor holds a NaN or an Inf."""
    from ckptlab.checkpoint.query import TensorQuery
    from ckptlab.compare import health, stats

    ck, _ = _open(args.path)
    found = stats(ck, TensorQuery(args.filter).matches if args.filter else None)
    bad = [n for n, s in found.items() if s.nan or s.inf]
    if args.json:
        _print_json({"path": ck.path, "tensors": {n: s.to_dict() for n, s in found.items()},
                     "health": health(found)})
    else:
        def num(x: float | None) -> str:
            return "-" if x is None else f"{x:.4g}"

        rows = [[_text(n), s.dtype, f"{s.numel:,}", num(s.min), num(s.max), num(s.mean),
                 num(s.std), f"{s.nan:,}", f"{s.inf:,}", f"{s.zeros:,}"]
                if s.error is None else [_text(n), s.dtype, "-", _text(s.error), "", "", "",
                                         "", "", ""]
                for n, s in found.items()]
        print(f"{ck.path}: {len(found):,} tensor{'s' * (len(found) != 1)}")
        print(_table(rows, ("name", "dtype", "numel", "min", "max", "mean", "std", "nan",
                            "inf", "zeros"), {2, 3, 4, 5, 6, 7, 8, 9}) if rows else "  (none)")
        lines = health(found)
        print("health: " + ("; ".join(lines) if lines else "nothing looks wrong"))
    if args.check and bad:
        if not args.json:
            print(f"check failed: NaN or Inf in {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


REPORT_HISTOGRAMS = 4  # the most changed tensors a compare report draws histograms of


def _report_extra(args: argparse.Namespace, ck: Any, run: Any) -> dict[str, Any]:
    """``report --compare OTHER``, ``--stats`` and ``--steps``: the diff, the histograms of
    the most changed tensors (both sides and the changes), the statistics and a run's
    consecutive diffs, for :func:`report_html`."""
    from ckptlab._progress import task
    from ckptlab.compare import diff, stats, step_diffs
    from ckptlab.compare._stats import side_by_side

    extra: dict[str, Any] = {}
    if args.steps:
        if run is None:
            from ckptlab.checkpoint.runs import RUN_LAYOUTS

            raise InvalidArgumentError(f"{args.path}: --steps is for a training run's "
                                       f"directory (saves side by side: {RUN_LAYOUTS})")
        with task("comparing the run's saves"):
            extra["steps"] = step_diffs(run)
    if args.compare is not None:
        other = args.compare if _is_url(args.compare) else _input_path(
            args.compare, "report", directory=True)
        ck_b, _ = _open(other)
        with task("comparing"):
            d = diff(ck, ck_b)
        hists = {}
        for name, t in d.largest(REPORT_HISTOGRAMS):
            if t.error is None and t.shape[0] == t.shape[1]:
                try:
                    hists[name] = side_by_side(d, ck, ck_b, name)
                except CkptlabError:  # (the table says why it differs)
                    continue
        extra.update(diff=d, histograms=hists)
    if args.stats:
        with task("measuring tensors"):
            extra["stats"] = stats(ck)
    return extra


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a tolerance (a finite number >= 0), not {text!r}")
    return value


def _diff(args: argparse.Namespace) -> int:
    """``ckptlab diff A B``: the summary or the JSON; 0 when nothing differs beyond the
    tolerances, 1 when something does (as ``cmp``)."""
    from ckptlab.checkpoint.query import TensorQuery
    from ckptlab.checkpoint.runs import RUN_LAYOUTS, resolve_run
    from ckptlab.compare import diff

    sides = []
    for path in (args.path, args.other):
        path, run = resolve_run(path, args.step) if not _is_url(path) else (path, None)
        ck, _ = _open(path)
        ck.run = run
        sides.append(ck)
    if args.step is not None and all(ck.run is None for ck in sides):
        raise InvalidArgumentError(
            f"{args.path}, {args.other}: --step is for a training run's directory (saves side "
            f"by side: {RUN_LAYOUTS}); neither is one")
    query = TensorQuery(args.filter or "")
    result = diff(sides[0], sides[1], names=query.matches if args.filter else None,
                  atol=args.atol, rtol=args.rtol)
    if args.json:
        _print_json(result.to_dict())
    else:
        print("\n".join(_text(line) for line in result.summary().splitlines()))
    return 1 if result.differs else 0


def _usage() -> str:
    """What a bare ``ckptlab`` prints: the verbs in plain words."""
    width = max(map(len, VERBS))
    lines = [f"ckptlab {__version__}: see inside PyTorch checkpoints.", "",
             "usage: ckptlab VERB [ARGUMENTS]   ('ckptlab VERB --help' tells a verb's arguments)",
             "", "verbs:"]
    lines += [f"  {verb.ljust(width)}  {what}" for verb, what in VERBS.items()]
    lines += ["", "'ckptlab --version' prints the version.",
              "ckptlab: error: no verb given: pick one of the verbs above"]
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | None:
    """The arguments, checked for form; None when no verb was given."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # point at the verb's own --help, not the top-level one
        (parser.verbs[args.verb] if args.verb else parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    return args if args.verb is not None else None


# -- paths, ports: checked before any work -------------------------------------------------
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _stat(path: str, doing: str = "cannot open") -> os.stat_result | None:
    """``os.stat(path)``, None when nothing is there; other failures as one-line errors."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ENOTDIR, EACCES, ELOOP, a NUL in the name
        raise InvalidArgumentError(
            f"{path}: {doing}: {getattr(exc, 'strerror', None) or exc}") from None


# a URL: a scheme of two or more letters then "://" (ckptlab.format._source.is_url's rule,
# repeated here so that a plain path imports nothing)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")


def _is_url(path: str | None) -> bool:
    return path is not None and _URL.match(path) is not None


def _local_url(path: str) -> str | None:
    """The local path of a ``file://`` URL, else None."""
    from ckptlab.source._bytes import file_url_path

    return file_url_path(path)


def _input_path(path: str | None, verb: str, *, directory: bool = False) -> str:
    """A checkpoint to read: PATH, or the embedded sample when none is given.

    Refuses a missing path, a directory where a file is needed, and anything that is not a
    regular file (a FIFO would block the read forever, a device never ends). A URL is
    returned as it is (``file://`` URLs as their local path, checked like a path): it is
    checked by the requests that open it.
    """
    if path is None:
        from ckptlab.samples import sample_path

        return str(sample_path())
    if not path:
        raise InvalidArgumentError(f"ckptlab {verb}: the checkpoint path is empty")
    if _is_url(path):
        local = _local_url(path)
        if local is None:
            return path
        path = local
    st = _stat(path)
    if st is None:
        raise InvalidArgumentError(f"{path}: cannot open: No such file or directory")
    if stat.S_ISDIR(st.st_mode):
        if not directory:
            raise InvalidArgumentError(
                f"{path}: is a directory; ckptlab {verb} reads a checkpoint file "
                "(.pt, .bin, .safetensors)")
        try:
            entries = list(os.scandir(path))
        except OSError as exc:
            raise InvalidArgumentError(f"{path}: cannot list: {exc.strerror}") from None
        for entry in entries:  # a DCP directory's files are read too: none may block
            try:
                mode = entry.stat().st_mode
            except OSError:
                continue  # a dangling link: the reader says so if it needs it
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise InvalidArgumentError(
                    f"{entry.path}: is {_kind(mode)}, not a regular file: ckptlab reads only "
                    "regular files")
    elif not stat.S_ISREG(st.st_mode):
        raise InvalidArgumentError(
            f"{path}: is {_kind(st.st_mode)}, not a regular file: ckptlab {verb} reads "
            "checkpoint files")
    return path


def _output_path(path: str, what: str) -> str:
    """A file to write: its directory must exist and the path must not be anything but a
    regular file (a directory cannot be overwritten, a FIFO would block)."""
    if not path:
        raise InvalidArgumentError(f"the {what} path is empty")
    if path.endswith(("/", os.sep)):
        raise InvalidArgumentError(f"{path}: names a directory; give the {what} a file name")
    st = _stat(path, f"cannot write the {what}")
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"{path}: is a directory; give the {what} a file name")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InvalidArgumentError(
            f"{path}: is {_kind(st.st_mode)}, not a regular file: refusing to write the "
            f"{what} into it")
    parent = os.path.dirname(path) or "."
    pst = _stat(parent, f"cannot write the {what} into it")
    if pst is None:
        raise InvalidArgumentError(
            f"{path}: cannot write the {what}: directory {parent} does not exist (create it "
            "first)")
    if not stat.S_ISDIR(pst.st_mode):
        raise InvalidArgumentError(f"{path}: cannot write the {what}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(
            f"{path}: cannot write the {what}: no permission to write into {parent}")
    return path


def _write_file(path: str, what: str, write: Callable[[str], object]) -> None:
    """Call ``write(tmp)`` on a same-named path in a fresh directory beside ``path``, then move
    the result onto ``path``: a failed write leaves no half file, and torch.save, which names
    the archive after the file, sees the same name."""
    import shutil
    import tempfile

    parent = os.path.dirname(path) or "."
    try:
        tmp = tempfile.mkdtemp(dir=parent, prefix=".ckptlab-")
    except OSError as exc:
        raise InvalidArgumentError(f"{path}: cannot write the {what}: cannot create a file in "
                                   f"{parent} ({exc.strerror or exc})") from None
    try:
        tmp_path = os.path.join(tmp, os.path.basename(path))
        try:
            write(tmp_path)
        except RuntimeError as exc:  # torch.save reports I/O failures as RuntimeError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InvalidArgumentError(f"{path}: cannot write the {what}: {first}") from None
        os.replace(tmp_path, path)
    except OSError as exc:
        raise InvalidArgumentError(
            f"{path}: cannot write the {what}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_listen(address: str, port: int) -> None:
    """Refuse an address that does not resolve or a port something else listens on, before
    the (slow) layout is loaded; bound as tornado binds (SO_REUSEADDR, IPv6 only on IPv6
    sockets, a missing ::1 skipped for localhost). The server's own bind can still fail (a
    race): main reports that too."""
    import socket

    if not address.strip():
        raise InvalidArgumentError("--address is empty (127.0.0.1: this machine only; 0.0.0.0: "
                                   "every interface)")
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidArgumentError(
            f"--address {address!r}: not an address of this machine "
            f"({getattr(exc, 'strerror', None) or exc})") from None
    for family, sockaddr in dict.fromkeys((info[0], info[4]) for info in infos):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL and address == "localhost" and (
                        sockaddr[0] == "::1"):
                    continue  # IPv6 half disabled (containers): tornado skips it too
                if exc.errno == errno.EADDRINUSE:
                    raise InvalidArgumentError(
                        f"{address}:{port} is already in use (another server listens there): "
                        "pick another --port") from None
                raise InvalidArgumentError(
                    f"cannot listen on {address}:{port}: {exc.strerror or exc}") from None


def _check_servable(path: str) -> None:
    """``serve`` shows any checkpoint ``ckptlab.open`` reads: refuse, up front and in one line,
    a file that is no checkpoint at all and an empty directory (the server opens the rest)."""
    from ckptlab.format.inspect import not_a_checkpoint, sniff
    from ckptlab.source._bytes import ByteSource

    _input_path(path, "serve", directory=True)
    st = _stat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        from ckptlab.checkpoint.runs import find_run

        with os.scandir(path) as entries:
            if not any(e.is_file() for e in entries) and find_run(path) is None:
                raise InvalidArgumentError(
                    f"{path}: a directory without files: give a checkpoint file or a "
                    "directory of one (Hugging Face, DCP, shards)")
        return
    with ByteSource(path) as src:
        kind = sniff(src)
        if kind in ("empty", "unknown"):
            raise not_a_checkpoint(src, kind)


def _check(args: argparse.Namespace) -> None:
    """Check every argument that names something outside (paths, ports) before any work."""
    verb = args.verb
    if _is_url(args.path) and _local_url(args.path) is not None:  # file://: a local path
        args.path = _local_url(args.path)
    if verb == "serve" and _is_url(args.path):
        raise InvalidArgumentError(
            f"{args.path}: ckptlab serve shows a checkpoint on this machine; for a URL, "
            f"'ckptlab inspect {args.path}' lists its tensors and 'ckptlab report "
            f"{args.path}' draws its bytes (or download the file and serve it)")
    if verb == "serve":
        _check_listen(args.address, args.port)
    if verb == "serve" and getattr(args, "compare", None) is not None:
        if _is_url(args.compare) or args.path is None:
            raise InvalidArgumentError(
                f"{args.compare if args.path else '--compare'}: ckptlab serve --compare shows "
                "two checkpoints on this machine (PATH and OTHER); for URLs, 'ckptlab report "
                "A --compare B' draws the same")
        _input_path(args.path, verb, directory=True)
        _input_path(args.compare, verb, directory=True)
    elif verb == "serve" and args.path is not None:
        _check_servable(args.path)
    elif verb != "sample" and args.path is not None:
        _input_path(args.path, verb, directory=True)
    if verb == "scan":
        args.paths = [_local_url(p) if _is_url(p) and _local_url(p) is not None else p
                      for p in args.paths]
        for path in args.paths:
            _input_path(path, verb, directory=True)
    if verb == "diff":
        if _is_url(args.other) and _local_url(args.other) is not None:
            args.other = _local_url(args.other)
        _input_path(args.other, verb, directory=True)
    if verb == "sample":
        _output_path(args.path, "sample")
    if verb == "convert":
        if args.shard_size is None:
            _output_path(args.output, "converted checkpoint")
        else:  # a sharded directory, new or replacing one: its parent must take it
            out = args.output.rstrip("/") or "/"
            st = _stat(out, "cannot write the converted checkpoint")
            if st is not None and not stat.S_ISDIR(st.st_mode):
                raise InvalidArgumentError(f"{out}: exists and is not a directory; a sharded "
                                           "checkpoint is a directory: give another name")
            parent = os.path.dirname(os.path.abspath(out))
            if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
                raise InvalidArgumentError(f"{out}: cannot write the converted checkpoint: "
                                           f"{parent} is not a directory this user can write "
                                           "into")
    if verb == "report":
        _output_path(args.output, "report")
        if args.path is not None and not _is_url(args.path) and os.path.exists(
                args.output) and os.path.samefile(args.path, args.output):
            raise InvalidArgumentError(
                f"{args.output}: is the checkpoint being reported on; give the report another "
                "name (-o)")


# -- output ---------------------------------------------------------------------------------
def _print_json(obj: Any) -> None:
    """One JSON object: indented for a person at a terminal, one compact line for a pipe."""
    if sys.stdout.isatty():
        print(json.dumps(obj, indent=2, default=str))
    else:
        print(json.dumps(obj, separators=(",", ":"), default=str))


def _needs(extra: str, exc: ImportError) -> NoReturn:
    raise InvalidArgumentError(
        f"this verb needs {exc.name or 'a missing module'}: install ckptlab's '{extra}' extra "
        f"(pip install 'ckptlab[{extra}]')") from None


def _open(path: str) -> tuple[Any, Any]:
    """The checkpoint at ``path``, and for a URL the store counting its requests (else None)."""
    if _is_url(path):
        from ckptlab.checkpoint.open import open_url

        return open_url(path)
    from ckptlab.checkpoint import open_checkpoint

    return open_checkpoint(path), None


def _dcp_layout(ck: Any) -> Any:
    from ckptlab.checkpoint._json import dcp_layout_of

    return dcp_layout_of(ck)


def _url_records_layout(ck: Any) -> Any:
    """``inspect --records`` of a checkpoint behind a URL: its byte-level layout."""
    if ck.format == "dcp":
        return _dcp_layout(ck)
    if len(ck.files) == 1 and ck.files[0].layout is not None:
        return ck.files[0].layout
    raise InvalidArgumentError(
        f"{ck.path}: --records shows one torch.save or safetensors file, or a DCP directory; "
        f"this is a {ck.format} checkpoint of {len(ck.files)} files: run without --records")


def url_offsets(path: str, scan: bool = False) -> dict[str, Any]:
    """``ckptlab offsets --json`` of a URL: ``reads`` and ``bytes_read`` count HTTP requests
    (or store requests) and the bytes they moved, the opening's included.

    A torch.save file: :func:`ckptlab.format.storage_offsets` through the remote file (the
    tail request, the directory if longer, the head records: at most 3 requests). Other
    checkpoints: the offsets of the opened model (each format's headers, see
    :func:`ckptlab.open`), read through the same store from the bytes already moved: a
    TorchScript or torch.export zip (told by its records), a directory URL written without
    its ``/`` (the redirect that says it is one is counted).
    """
    import dataclasses

    from ckptlab.checkpoint.open import directory_location, open_location
    from ckptlab.cli import storage_offsets
    from ckptlab.errors import UnsupportedFormatError
    from ckptlab.format._placed import looks_like_zip
    from ckptlab.source import IsDirectoryError, locate
    from ckptlab.source._remote import RemoteFileObject, RemoteSource

    where = locate(path)
    assert where.tree is not None and where.tree.store is not None  # a URL, not file://
    store = where.tree.store
    src = ck = None
    if where.file is not None and not (where.rel or "").endswith((".json", ".metadata",
                                                                  ".safetensors")):
        try:
            src = RemoteSource(store, where.file, first="tail")
        except IsDirectoryError as exc:  # "dir": the server says it is "dir/"
            where = directory_location(where, exc)
        else:
            if looks_like_zip(src):
                try:
                    result = storage_offsets(RemoteFileObject(src), scan=scan)
                except UnsupportedFormatError as refusal:
                    opened = src
                    ck = _other_zip(refusal, lambda: open_location(where, opened)[0])
                else:
                    result = dataclasses.replace(result, reads=store.stats.requests,
                                                 bytes_read=store.stats.bytes_moved)
                    return {**result.to_dict(), "format": "torch-zip", "path": path}
    if scan:
        raise InvalidArgumentError(
            f"{path}: --scan takes the storage order from a torch.save file's data.pkl; "
            "this is not a torch.save file: run without --scan")
    if ck is None:
        ck, _ = open_location(where, src)
    from ckptlab.gds.readiness import tensor_ranges

    parts = [(r.name, p) for r, p in zip(
        tensor_ranges(ck), (p for t in ck.tensors.values() for p in t.parts), strict=True)]
    return {"offsets": {k: p.offset for k, p in parts}, "files": {k: p.file for k, p in parts},
            "nbytes": {k: p.nbytes for k, p in parts}, "reads": store.stats.requests,
            "bytes_read": store.stats.bytes_moved, "method": "headers", "format": ck.format,
            "path": ck.path,
            "tensors": {k: name for (k, _), name in zip(parts, (
                t.name for t in ck.tensors.values() for _ in t.parts))},
            "read_per_file": {}, "uncounted_files": []}


def _run(args: argparse.Namespace) -> int | None:
    """The verb; its exit status where it has one of its own (diff: 1 when something
    differs)."""
    verb = args.verb
    if verb == "diff":
        return _diff(args)
    if verb == "scan":
        return _scan(args)
    if verb == "convert":
        return _convert(args)
    run = _resolve_run(args)
    if verb == "stats":
        return _stats(args)
    if verb == "inspect":
        path = _input_path(args.path, verb, directory=True)
        if args.records:
            from ckptlab._inspect import inspect
            from ckptlab.dcp import DcpLayout

            layout = _url_records_layout(_open(path)[0]) if _is_url(path) else inspect(path)
            if args.json:
                _print_json(layout.to_dict())
            else:
                print(render_dcp(layout) if isinstance(layout, DcpLayout)
                      else render_layout(layout))
            return
        ck, _ = _open(path)
        ck.run = run
        tensors = select_tensors(ck, args.filter, args.sort)
        from ckptlab.safety import scan

        safety = scan(ck)
        if args.json:
            _print_json({**checkpoint_json(ck, tensors), "safety": safety.brief()})
        else:
            print(render_checkpoint(ck, tensors, args.filter, safety))
    elif verb == "offsets":
        path = _input_path(args.path, verb, directory=True)
        if _is_url(path):
            doc = url_offsets(path, args.scan)
            if args.json:
                _print_json(doc)
            elif doc["format"] == "torch-zip":
                print(_table(sorted(doc["offsets"].items(), key=lambda kv: kv[1]),
                             ("storage", "data offset"), {1}))
                print(f"{doc['reads']} request{'s' * (doc['reads'] != 1)}, "
                      f"{doc['bytes_read']:,} bytes moved, method {doc['method']}")
            else:
                print(render_offsets(doc))
            return
        from ckptlab.checkpoint import open_checkpoint

        ck = None
        kind = _sniff_file(path)
        if kind in _STORAGE_OFFSETS_KINDS:  # torch.save: storage keys, in at most 3 reads
            from ckptlab.cli import storage_offsets  # this module's name (tests replace it)
            from ckptlab.errors import UnsupportedFormatError

            try:
                result = storage_offsets(path, scan=args.scan)
            except UnsupportedFormatError as refusal:
                if kind != "torch-zip":
                    raise
                ck = _other_zip(refusal, lambda: open_checkpoint(path))  # TorchScript, pt2
            else:
                if args.json:
                    _print_json({**result.to_dict(), "format": "torch-zip"})
                else:
                    print(_table(sorted(result.offsets.items(), key=lambda kv: kv[1]),
                                 ("storage", "data offset"), {1}))
                    print(f"{result.reads} read{'s' * (result.reads != 1)}, "
                          f"{result.bytes_read:,} bytes read, method {result.method}"
                          + (f" ({result.reason})" if result.reason else ""))
                return
        if ck is None:
            ck = open_checkpoint(path)
        if args.scan:
            raise InvalidArgumentError(
                f"{path}: --scan takes the storage order from a torch.save file's data.pkl; "
                f"this is a {ck.format} checkpoint: run without --scan")
        doc = checkpoint_offsets(ck)
        if args.json:
            _print_json(doc)
        else:
            print(render_offsets(doc))
    elif verb == "sample":
        from ckptlab.samples import write_sample

        _write_file(args.path, "sample",
                    lambda tmp: write_sample(tmp, storage_alignment=args.alignment))
        print(args.path)
    elif verb == "report":
        from ckptlab.format import ArchiveLayout, read_range

        path = _input_path(args.path, verb, directory=True)
        ck, store = _open(path)  # the input first: a bad one fails before any plotting
        try:
            from ckptlab.viz import report_html
        except ImportError as exc:
            _needs("widgets", exc)
        first = next((f for f in ck.files if f.full_path and any(
            p.file == f.path for t in ck.tensors.values() for p in t.parts)),
            next((f for f in ck.files if f.full_path), None))
        if first is None:
            head = None
        elif store is not None:  # one more ranged request
            head = store.range(first.full_path, 0, min(first.nbytes, 1024))
        else:
            head = read_range(first.full_path, 0, min(first.nbytes, 1024))
        layout = ck.files[0].layout if len(ck.files) == 1 else None
        from ckptlab._progress import task

        extra = _report_extra(args, ck, run)
        with task("drawing the report"):
            if ck.format == "torch-zip" and isinstance(layout, ArchiveLayout):
                # records, alignment what-if
                document = report_html(layout, hex_bytes=head, **extra)
            else:
                document = report_html(ck, hex_bytes=head,
                                       hex_file=first.path if first else None, **extra)

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(document)

        _write_file(args.output, "report", write)
        print(args.output)
    elif verb == "readiness":
        from ckptlab.gds.readiness import readiness

        path = _input_path(args.path, verb, directory=True)
        r = readiness(path)
        if _is_url(path):  # the probes of this machine's file system do not apply
            import dataclasses

            r = dataclasses.replace(r, filesystem="remote", mount_point="", o_direct=False,
                                    o_direct_reason="a URL: GDS and O_DIRECT read local files; "
                                    "download the checkpoint to check them")
        if args.json:
            _print_json(r.to_dict())
        else:
            print(_render_readiness(r))
        return 0 if r.ready else 1  # (as scan and diff: a script can test it)
    elif verb == "serve":
        import importlib.util

        try:  # the quick page first (tornado only); the workbench (panel) comes after it
            from ckptlab.widgets.quick import serve
            for module in ("panel", "pandas"):
                if importlib.util.find_spec(module) is None:
                    raise ModuleNotFoundError(f"No module named {module!r}", name=module)
        except ImportError as exc:
            _needs("widgets", exc)
        if args.compare is not None:
            from ckptlab.widgets.compare_app import serve_compare

            serve_compare(args.path, args.compare, port=args.port, address=args.address,
                          show=args.show)
            return
        serve(_input_path(args.path, verb, directory=True), port=args.port,
              address=args.address, show=args.show)


class _Bar:
    """One task drawn as a tqdm bar on stderr, shown only once it has run for ``delay`` s."""

    def __init__(self, delay: float) -> None:
        self._delay = delay
        self._bar: Any = None

    def start(self, label: str, total: int | None) -> None:
        from tqdm import tqdm

        self._bar = tqdm(desc=label, total=total, delay=self._delay, file=sys.stderr,
                         leave=False, unit=" files" if total else "it",
                         bar_format=None if total else "{desc}: {elapsed}")

    def advance(self, done: int) -> None:
        self._bar.update(done)

    def end(self) -> None:
        self._bar.close()


def _progress_bars() -> Any:
    """Progress bars on stderr while a verb runs, for work over a second: on a terminal, or
    always with CKPTLAB_PROGRESS=1 (=0 never); none without tqdm (the widgets extra)."""
    import contextlib

    wanted = os.environ.get("CKPTLAB_PROGRESS")
    if wanted == "0" or (wanted != "1" and not sys.stderr.isatty()):
        return contextlib.nullcontext()
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return contextlib.nullcontext()
    from ckptlab._progress import listening

    delay = float(os.environ.get("CKPTLAB_PROGRESS_DELAY", "1.0"))
    return listening(lambda: _Bar(delay))


def _fail(message: str) -> int:
    print(f"ckptlab: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptlab`` command; returns the exit status.

    Parameters
    ----------
    argv
        The arguments after ``ckptlab`` (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success; 2 on any failure, after one ``ckptlab: error:`` line on stderr; 130
        when interrupted.
    """
    if argv is None:  # the real command: a name that is not UTF-8 must not crash a print
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(errors="backslashreplace")
    try:
        args = _parse(argv)
        if args is None:
            print(_usage(), file=sys.stderr)
            return 2
        _check(args)
        global _FIT
        _FIT = shutil.get_terminal_size().columns if sys.stdout.isatty() and \
            not getattr(args, "wide", False) else None
        with _progress_bars():
            status = _run(args)
        return status or 0
    except _Exit as done:  # --help, --version
        return done.status
    except CkptlabError as exc:
        return _fail(str(exc) or type(exc).__name__)
    except BrokenPipeError:  # `ckptlab inspect | head`: the reader has gone; so do we
        try:  # and keep Python's final flush of stdout from complaining
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except OSError as exc:  # the server's bind, a cache directory, a read that failed
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}")
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("CKPTLAB_TRACEBACK"):
            raise
        return _fail(f"unexpected {type(exc).__name__}: {exc} (a bug in ckptlab: run again with "
                     "CKPTLAB_TRACEBACK=1 to see where, and report it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
