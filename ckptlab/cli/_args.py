"""The verbs, their arguments, and the checks of form argparse makes."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ckptlab import __version__
from ckptlab.cli._checks import _is_url
from ckptlab.errors import InvalidArgumentError

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


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a tolerance (a finite number >= 0), not {text!r}")
    return value


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
