"""``ckptlab``: running the verb, progress bars, the one error line, ``main``."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ckptlab.cli import _text as _text_output
from ckptlab.cli._args import _Exit, _parse, _resolve_run, _usage
from ckptlab.cli._checks import _check, _input_path, _is_url, _write_file
from ckptlab.cli._offsets import (
    _STORAGE_OFFSETS_KINDS,
    _needs,
    _open,
    _other_zip,
    _print_json,
    _sniff_file,
    _url_records_layout,
    checkpoint_offsets,
    render_offsets,
    url_offsets,
)
from ckptlab.cli._text import (
    _render_readiness,
    _table,
    checkpoint_json,
    render_checkpoint,
    render_dcp,
    render_layout,
    select_tensors,
)
from ckptlab.cli._verbs import _convert, _diff, _report_extra, _scan, _stats
from ckptlab.errors import CkptlabError, InvalidArgumentError


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


# torch's notes on the API of the tensors ckptlab rebuilds from a file's bytes (sparse,
# quantized, nested): about torch itself, not the file, so not shown among a command's lines
TORCH_API_NOTES = ("Sparse CSR tensor support is in beta state",
                   "Sparse invariant checks are implicitly disabled",
                   "torch.quantize_per_tensor, torch.quantize_per_channel and other quantized",
                   "The PyTorch API of nested tensors is in prototype stage",
                   "TypedStorage is deprecated")


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
        for note in TORCH_API_NOTES:
            warnings.filterwarnings("ignore", message=re.escape(note), category=UserWarning)
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
        _text_output.FIT = shutil.get_terminal_size().columns if sys.stdout.isatty() and \
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
