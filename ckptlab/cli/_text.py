"""The CLI's text output: tables fitted to the terminal, and each verb's summary."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptlab._words import plural

if TYPE_CHECKING:
    from ckptlab.format import ArchiveLayout

if TYPE_CHECKING:  # imported where used: --version and argument errors need none of them
    from ckptlab.dcp import DcpLayout


def _fmt_path(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path) or "<root>"


# the terminal's width that tables are fitted into (set by ``main`` at a terminal without
# ``--wide``); None: tables as wide as their cells (a pipe, a file, ``--wide``)
FIT: int | None = None
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
    if FIT and sum(widths) + 2 * (len(widths) - 1) > FIT and len(rows) > 1:
        # too wide for the terminal: columns with one value in every row go to a line below
        keep = [i for i in range(len(header))
                if i == 0 or len({r[i] for r in cells[1:]}) > 1]
        same = ", ".join(f"{cells[0][i]} {cells[1][i]}" for i in range(len(header))
                         if i not in keep)
        cells = [[r[i] for i in keep] for r in cells]
        widths = [widths[i] for i in keep]
        right = {keep.index(i) for i in right if i in keep}
    over = sum(widths) + 2 * (len(widths) - 1) - FIT if FIT else 0
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
    tied = ck.tied()
    for t in ck.tensors.values():
        acc = by_dtype.setdefault(t.dtype, [0, 0, 0])
        acc[0] += 1
        if t.name not in tied:  # a tied tensor's bytes and parameters are counted once
            acc[1] += t.parameters
            acc[2] += t.nbytes
    if safety is not None:
        out.append(f"  safe to load? {_text(safety.headline())}")
    out.append("  " + "; ".join(f"{d}: {plural(n, 'tensor')}, {_count(p)} params, {_human(b)}"
                                for d, (n, p, b) in sorted(by_dtype.items(),
                                                           key=lambda kv: -kv[1][2])))
    if tied:
        first = ", ".join(f"{_text(a)} = {_text(b)}" for a, b in list(tied.items())[:3])
        more = f", {len(tied) - 3:,} more" if len(tied) > 3 else ""
        out.append(f"  tied: {plural(len(tied), 'tensor')} stored as another's bytes "
                   f"({first}{more}): counted once")
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
