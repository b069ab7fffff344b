"""The ``ckptlab`` command.

Verbs (``ckptlab VERB --help`` tells each one's arguments):

- ``inspect [PATH] [--json]``: layout of a torch.save archive, ``.safetensors`` file or DCP
  checkpoint directory (PATH defaults to the embedded sample).
- ``offsets PATH [--json] [--scan]``: storage data offsets, computed without random reads.
- ``sample PATH [--alignment N]``: write the embedded sample checkpoint (N: a power of two,
  1 to :data:`MAX_STORAGE_ALIGNMENT`).
- ``report [PATH] [-o OUT]``: a self-contained offline HTML report with the figures.
- ``readiness PATH [--json]``: is a checkpoint ready for GPUDirect Storage / O_DIRECT reads?
- ``serve [PATH] [--port N] [--address A] [--show]``: the interactive workbench (panel).

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
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ckptlab import __version__
from ckptlab._inspect import inspect
from ckptlab.errors import CkptlabError, InvalidArgumentError
from ckptlab.format import ArchiveLayout, storage_offsets
from ckptlab.plan.metadata import DcpLayout

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
    "offsets": "storage data offsets, computed without random reads",
    "sample": "write the embedded sample checkpoint",
    "report": "write a self-contained offline HTML report",
    "readiness": "is a checkpoint ready for GPUDirect Storage / O_DIRECT reads?",
    "serve": "serve the interactive workbench (panel) on 127.0.0.1",
}


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
    """The tensors ``inspect`` shows: those matching ``pattern`` (a glob), in ``sort`` order."""
    import fnmatch

    tensors = [t for t in ck.tensors.values()
               if pattern is None or fnmatch.fnmatchcase(t.name, pattern)]
    if sort == "name":
        tensors.sort(key=lambda t: t.name)
    elif sort == "size":
        tensors.sort(key=lambda t: (-t.nbytes, t.name))
    elif sort == "offset":
        tensors.sort(key=lambda t: (t.file, t.offset if t.offset is not None else -1))
    return tensors


def render_checkpoint(ck: Any, tensors: list[Any], pattern: str | None = None) -> str:
    """``ckptlab inspect``: a summary, totals by dtype, the tensor table, the other values."""
    total = ck.parameters
    out = [f"{ck.path}",
           f"  {ck.format} checkpoint: {len(ck.tensors):,} tensors, {_count(total)} parameters, "
           f"{_human(ck.nbytes)} in {len(ck.files)} file{'s' * (len(ck.files) != 1)}"]
    by_dtype: dict[str, list[int]] = {}
    for t in ck.tensors.values():
        acc = by_dtype.setdefault(t.dtype, [0, 0, 0])
        acc[0] += 1
        acc[1] += t.parameters
        acc[2] += t.nbytes
    out.append("  " + "; ".join(f"{d}: {n} tensors, {_count(p)} params, {_human(b)}"
                                for d, (n, p, b) in sorted(by_dtype.items(),
                                                           key=lambda kv: -kv[1][2])))
    for note in ck.notes:
        out.append(f"  note: {note}")
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


def _text(value: Any) -> str:
    """Printable text for a terminal: names can hold anything (lone surrogates, controls)."""
    text = str(value)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _short_value(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def checkpoint_json(ck: Any, tensors: list[Any]) -> dict[str, Any]:
    """DESIGN's ``inspect --json`` object for any checkpoint: the layout's byte-level keys
    where the format has them, and ``files``, ``tensors`` (name, kind, nbytes, parts, ...)
    and ``objects`` from the checkpoint model."""
    from ckptlab.format.archive import largest_alignment

    layout = next((f.layout for f in ck.files if f.layout is not None), None)
    base: dict[str, Any]
    if ck.format in ("torch-zip", "safetensors") and layout is not None:
        base = layout.to_dict()
    elif ck.format == "dcp":
        base = inspect(ck.path).to_dict()
    else:
        offsets = [p.offset for t in ck.tensors.values() for p in t.parts if p.nbytes]
        base = {"path": ck.path, "file_nbytes": ck.nbytes, "archive_name": "",
                "alignment": largest_alignment(offsets) if offsets else 4096,
                "zip64": any(getattr(f.layout, "zip64", False) for f in ck.files),
                "records": [], "storages": []}
    base.update(format=ck.format, path=ck.path, files=[f.to_dict() for f in ck.files],
                tensors=[t.to_dict() for t in tensors], objects=ck.objects,
                notes=list(ck.notes))
    return base


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


def _parser() -> _Parser:
    p = _Parser(prog="ckptlab", description="See inside PyTorch checkpoints.")
    p.add_argument("--version", action="version", version=f"ckptlab {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    default = " (default: the embedded sample)"
    ins = sub.add_parser("inspect", help=VERBS["inspect"], description=VERBS["inspect"])
    ins.add_argument("path", nargs="?", metavar="PATH",
                     help="checkpoint file or DCP directory" + default)
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.add_argument("--records", action="store_true",
                     help="the byte-level view: zip records / DCP items instead of tensors")
    ins.add_argument("--filter", metavar="GLOB", default=None,
                     help="only tensors whose name matches GLOB (e.g. '*.mlp.*')")
    ins.add_argument("--sort", choices=("name", "size", "offset"), default=None,
                     help="order the tensors by name, by bytes (largest first) or by offset")
    off = sub.add_parser("offsets", help=VERBS["offsets"], description=VERBS["offsets"])
    off.add_argument("path", metavar="PATH", help="checkpoint file")
    off.add_argument("--json", action="store_true", help="print one JSON object")
    off.add_argument("--scan", action="store_true",
                     help="take the storage order from data.pkl (torch's way) instead of the "
                          "central directory; slower, same offsets for torch-written files")
    smp = sub.add_parser("sample", help=VERBS["sample"], description=VERBS["sample"])
    smp.add_argument("path", metavar="PATH", help="file to write (its directory must exist)")
    smp.add_argument("--alignment", type=_alignment, default=64, metavar="N",
                     help=f"storage alignment: a power of two from 1 to "
                          f"{MAX_STORAGE_ALIGNMENT} (default 64)")
    rep = sub.add_parser("report", help=VERBS["report"], description=VERBS["report"])
    rep.add_argument("path", nargs="?", metavar="PATH", help="checkpoint file" + default)
    rep.add_argument("-o", "--output", default="report.html", metavar="OUT",
                     help="HTML file to write (default report.html)")
    rdy = sub.add_parser("readiness", help=VERBS["readiness"], description=VERBS["readiness"])
    rdy.add_argument("path", metavar="PATH", help="checkpoint file")
    rdy.add_argument("--json", action="store_true", help="print one JSON object")
    srv = sub.add_parser("serve", help=VERBS["serve"], description=VERBS["serve"])
    srv.add_argument("path", nargs="?", metavar="PATH", help="checkpoint file" + default)
    srv.add_argument("--port", type=_port, default=5006, metavar="N",
                     help="port, 1 to 65535 (default 5006)")
    srv.add_argument("--address", default="127.0.0.1", metavar="A",
                     help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--show", action="store_true", help="open a browser tab")
    p.verbs = sub.choices
    return p


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


def _input_path(path: str | None, verb: str, *, directory: bool = False) -> str:
    """A checkpoint to read: PATH, or the embedded sample when none is given.

    Refuses a missing path, a directory where a file is needed, and anything that is not a
    regular file (a FIFO would block the read forever, a device never ends).
    """
    if path is None:
        from ckptlab.samples import sample_path

        return str(sample_path())
    if not path:
        raise InvalidArgumentError(f"ckptlab {verb}: the checkpoint path is empty")
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


def _check(args: argparse.Namespace) -> None:
    """Check every argument that names something outside (paths, ports) before any work."""
    verb = args.verb
    if verb == "serve":
        _check_listen(args.address, args.port)
    if verb != "sample" and args.path is not None:
        _input_path(args.path, verb, directory=verb == "inspect")
    if verb == "sample":
        _output_path(args.path, "sample")
    if verb == "report":
        _output_path(args.output, "report")
        if args.path is not None and os.path.exists(args.output) and os.path.samefile(
                args.path, args.output):
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


def _run(args: argparse.Namespace) -> None:
    verb = args.verb
    if verb == "inspect":
        path = _input_path(args.path, verb, directory=True)
        if args.records:
            layout = inspect(path)
            if args.json:
                _print_json(layout.to_dict())
            else:
                print(render_dcp(layout) if isinstance(layout, DcpLayout)
                      else render_layout(layout))
            return
        from ckptlab.checkpoint import open_checkpoint

        ck = open_checkpoint(path)
        tensors = select_tensors(ck, args.filter, args.sort)
        if args.json:
            _print_json(checkpoint_json(ck, tensors))
        else:
            print(render_checkpoint(ck, tensors, args.filter))
    elif verb == "offsets":
        result = storage_offsets(args.path, scan=args.scan)
        if args.json:
            _print_json(result.to_dict())
        else:
            print(_table(sorted(result.offsets.items(), key=lambda kv: kv[1]),
                         ("storage", "data offset"), {1}))
            print(f"{result.reads} reads, {result.bytes_read:,} bytes read, method "
                  f"{result.method}" + (f" ({result.reason})" if result.reason else ""))
    elif verb == "sample":
        from ckptlab.samples import write_sample

        _write_file(args.path, "sample",
                    lambda tmp: write_sample(tmp, storage_alignment=args.alignment))
        print(args.path)
    elif verb == "report":
        from ckptlab.format import read_range

        try:
            from ckptlab.viz import report_html
        except ImportError as exc:
            _needs("widgets", exc)
        path = _input_path(args.path, verb)
        layout = inspect(path)
        head = read_range(path, 0, min(layout.file_nbytes, 1024))
        document = report_html(layout, hex_bytes=head)

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(document)

        _write_file(args.output, "report", write)
        print(args.output)
    elif verb == "readiness":
        from ckptlab.gds.readiness import readiness

        r = readiness(args.path)
        if args.json:
            _print_json(r.to_dict())
        else:
            print(_render_readiness(r))
    elif verb == "serve":
        try:
            from ckptlab.widgets.app import serve
        except ImportError as exc:
            _needs("widgets", exc)
        serve(_input_path(args.path, verb), port=args.port, address=args.address,
              show=args.show)


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
        _run(args)
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
