"""``ckptlab.scan``: is this checkpoint safe to load? Every pickle a loader would run, read inertly.

A file's pickles are the ones its loader runs, in its order:

- a **torch.save zip**: ``data.pkl`` (found as torch finds it: the record ``data.pkl`` under
  the first record's directory, names compared without ASCII case), loaded by ``torch.load``;
- a **TorchScript zip** (it has ``constants.pkl``): ``constants.pkl`` and ``data.pkl``, loaded by
  ``torch.jit.load`` (``torch.load(weights_only=True)`` refuses the archive);
- any other file ``torch.load`` reads as the **legacy format**: the pickles from byte 0 in
  sequence (magic number, protocol version, system info, the object, the storage keys), each
  run before the next is read, so a plain pickle (``.pkl``) is its first one;
- a **DCP directory**: ``.metadata`` (``pickle.load`` in ``dcp.load``, without any restriction)
  and each item of the data files it names, a nested torch.save (byte items are loaded with
  ``torch.load(weights_only=False)``, tensor items with ``weights_only=True``);
- **NumPy** ``.npy`` files with an object dtype (and such members of ``.npz`` archives):
  ``numpy.load(allow_pickle=True)`` unpickles the array;
- a byte string given to ``torch.storage._load_from_bytes`` (``pickle.dumps`` of a tensor or
  storage) is a torch.save file of its own: it is scanned too, as a nested file.

Each pickle goes through :func:`ckptlab.safety._pickle_scan.scan_pickle`. Nothing is imported,
called or built.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ckptlab.errors import CkptlabError, InvalidArgumentError
from ckptlab.safety._classes import classify, python3_name
from ckptlab.safety._pickle_scan import PickleFindings, scan_pickle
from ckptlab.safety._weights_only import Policy
from ckptlab.source import ByteSource

__all__ = ["VERDICTS", "Call", "FileSafety", "SafetyReport", "WeightsOnly", "scan"]

#: a file's verdicts, worst last but one ("unreadable" is reported apart)
VERDICTS = ("weights-only", "data", "code", "unreadable")
_RANK = {"weights-only": 0, "data": 1, "unreadable": 2, "code": 3}
_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
_PROTOCOL_VERSION = 1001
_LEGACY_PICKLES = ("magic number", "protocol version", "system info", "object", "storage keys")
_MAX_PICKLE = 1 << 30  # a pickle read whole for a scan is at most this long
_MAX_NESTED = 4  # torch.save files inside byte strings inside torch.save files...


@dataclass(frozen=True)
class Call:
    """One global a pickle imports, with how it is used, its first call's arguments (rendered
    inertly), where, and its class (:mod:`ckptlab.safety._classes`)."""

    global_: str
    klass: str  # "torch", "data" or "code"
    args: str | None  # the first call's arguments; None when never called
    file: str
    pickle: str
    offset: int  # the opcode, in the pickle, that named it (a call: that call's opcode)
    how: str  # "name", "new", "call" or "build"
    why: str
    count: int = 0  # how many times the pickle calls it
    # where in the loaded object the value this call makes sits (its keys, "." joined, as
    # tensor names are; "<root>": the loaded object itself); None where not known
    where: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"global", "class", "args", "file", "pickle", "offset", ...}``."""
        return {"global": self.global_, "class": self.klass, "args": self.args,
                "file": self.file, "pickle": self.pickle, "offset": self.offset,
                "how": self.how, "why": self.why, "count": self.count, "where": self.where}


@dataclass(frozen=True)
class WeightsOnly:
    """What ``torch.load(f, weights_only=True)`` of the installed torch does with the file."""

    accepted: bool
    refused: str | None  # the first global (or opcode...) it refuses, as torch names it
    reason: str | None
    torch: str | None  # the torch version whose rules decided; None without torch
    decided: bool = True  # False: ckptlab could not follow a pickle far enough to tell

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "refused": self.refused, "reason": self.reason,
                "torch": self.torch, "decided": self.decided}


@dataclass
class FileSafety:
    """The verdict on one file (or one DCP data file's items)."""

    path: str
    kind: str  # "torch.save", "legacy", "pickle", "torchscript", "dcp-metadata", ...
    loader: str  # the call that would run its pickles
    verdict: str  # one of VERDICTS
    weights_only: WeightsOnly
    calls: list[Call] = field(default_factory=list)
    pickles: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def code_calls(self) -> list[Call]:
        return [c for c in self.calls if c.klass == "code"]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "loader": self.loader,
                "verdict": self.verdict, "weights_only": self.weights_only.to_dict(),
                "calls": [c.to_dict() for c in self.calls], "pickles": list(self.pickles),
                "notes": list(self.notes)}


@dataclass
class SafetyReport:
    """``ckptlab.scan``'s answer: a :class:`FileSafety` per file holding a pickle, and the
    files that hold none (``skipped``: path and what the file is)."""

    source: str
    files: list[FileSafety]
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """The worst verdict of the files (``"weights-only"`` when no file holds a pickle)."""
        return max((f.verdict for f in self.files), key=_RANK.__getitem__,
                   default="weights-only")

    @property
    def calls(self) -> list[Call]:
        """Every file's calls, in file order."""
        return [c for f in self.files for c in f.calls]

    @property
    def weights_only(self) -> WeightsOnly:
        """What ``torch.load(weights_only=True)`` does: the one file's answer, or for several,
        accepted when it accepts every file (else the first refusal)."""
        if len(self.files) == 1:
            return self.files[0].weights_only
        refusing = [f.weights_only for f in self.files if not f.weights_only.accepted]
        if not refusing:
            torch = next((f.weights_only.torch for f in self.files), None)
            return WeightsOnly(True, None, None, torch)
        first = refusing[0]
        return WeightsOnly(False, first.refused, first.reason, first.torch,
                           all(w.decided for w in refusing))

    @property
    def exit_status(self) -> int:
        """0 when every file is ``weights-only`` (or holds no pickle), else 1."""
        return 0 if all(f.verdict == "weights-only" for f in self.files) else 1

    def to_dict(self) -> dict[str, Any]:
        """``{"source", "verdict", "files": [...], "skipped": [{"path", "kind"}]}``."""
        return {"source": self.source, "verdict": self.verdict,
                "files": [f.to_dict() for f in self.files],
                "skipped": [{"path": p, "kind": k} for p, k in self.skipped]}

    def brief(self) -> dict[str, Any]:
        """What ``inspect --json`` shows: the verdict, each file's verdict and torch's answer,
        and the code calls."""
        return {"verdict": self.verdict,
                "files": [{"path": f.path, "verdict": f.verdict,
                           "weights_only": f.weights_only.to_dict()} for f in self.files],
                "code": [c.to_dict() for f in self.files for c in f.code_calls]}

    def headline(self) -> str:
        """One line: the verdict and what it means for loading the checkpoint."""
        v = self.verdict
        if not self.files:
            return "WEIGHTS-ONLY: no file holds a pickle; nothing in it runs when loaded"
        if v == "weights-only":
            return ("WEIGHTS-ONLY: torch.load(weights_only=True) accepts "
                    + ("it" if len(self.files) == 1 else f"all {len(self.files)} files")
                    + "; only torch's own functions are called")
        code = [c for f in self.files for c in f.code_calls]
        if v == "code":
            first = code[0]
            more = f" and {len(code) - 1} more" if len(code) > 1 else ""
            return (f"CODE: loading it with weights_only=False would run {first.global_}"
                    f"({first.args or ''}){more} ({first.pickle}, byte {first.offset:,}); "
                    f"do not load it")
        if v == "unreadable":
            why = next((n for f in self.files if f.verdict == "unreadable" for n in f.notes),
                       "")
            return f"UNREADABLE: torch would not load it either: {why}"
        first = next(f for f in self.files if f.verdict != "weights-only")
        if not first.loader.startswith("torch.load"):  # .metadata, .npy...: no weights_only
            why = f"{first.loader} runs {os.path.basename(first.path)} without weights_only"
        elif first.weights_only.refused:
            why = f"needs weights_only=False (torch refuses {first.weights_only.refused})"
        else:
            why = "needs weights_only=False"
        return f"DATA: {why}; calls only data classes, no code"

    def summary(self) -> str:
        """A line per file, the code calls spelled out."""
        lines = []
        for f in self.files:
            wo = f.weights_only
            if wo.accepted:
                torch_says = "torch.load(weights_only=True) accepts it"
            elif wo.refused:
                torch_says = f"weights_only=True refuses {wo.refused}"
            else:
                torch_says = f"torch.load(weights_only=True) fails: {wo.reason}"
            lines.append(f"{f.path}: {f.verdict.upper()} ({f.kind}; {torch_says})")
            for c in f.code_calls:
                args = f"({c.args})" if c.args is not None else ""
                under = ("" if c.where is None else ", the loaded object itself" if
                         c.where == "<root>" else f", under {c.where!r}")
                lines.append(f"  code: {c.global_}{args} at byte {c.offset:,} of {c.pickle}"
                             f"{under} ({c.why})")
            lines.extend(f"  note: {n}" for n in f.notes)
        for path, kind in self.skipped:
            lines.append(f"{path}: no pickle ({kind}): nothing in it runs when loaded")
        if not lines:
            lines.append(f"{self.source}: no files")
        return "\n".join(lines)


# -- one pickle to calls -------------------------------------------------------------------
class _FileScan:
    """The pickles of one file, as they are found, put together into a :class:`FileSafety`."""

    def __init__(self, path: str, kind: str, loader: str, policy: Policy | None,
                 depth: int = 0) -> None:
        self.path, self.kind, self.loader, self.policy = path, kind, loader, policy
        self.depth = depth
        self.calls: list[Call] = []
        self.pickles: list[str] = []
        self.notes: list[str] = []
        self.refusal: tuple[str, str] | None = None  # (refused, reason), the first
        self.undecided = False
        self.undecided_why: str | None = None
        self.torch_fails: str | None = None  # torch.load fails for another reason
        self.unreadable: str | None = None
        self.nested: list[FileSafety] = []
        self.allowed = policy.allowed_names() if policy is not None else frozenset()

    def pickle(self, data: Any, label: str, *, weights_only_loads: bool = True
               ) -> PickleFindings:
        """Scan one pickle; ``weights_only_loads``: torch.load(weights_only=True) runs it (so
        its refusal is the file's)."""
        found = scan_pickle(data, self.policy)
        self.pickles.append(label)
        first = len(self.calls)
        classes = found.classes(self.allowed)
        for qualname, use in found.uses.items():
            klass, why = classes[qualname]
            calls = use.calls or [(use.offset, None, None)]
            shown = calls if klass == "code" else calls[:1]
            how = ("build" if "build" in use.hows else "call" if "call" in use.hows else
                   "new" if "new" in use.hows else "name")
            shown_name = python3_name(qualname)
            for at, args, where in shown:
                self.calls.append(Call(shown_name, klass, args, self.path, label, at, how, why,
                                       use.ncalls, where))
        for at, what in found.code_after_error:
            # named past the point ckptlab followed the pickle to: what the standard
            # unpickler would still run
            if what.startswith("<"):
                klass, why = "code", "past the point ckptlab could follow: treated as code"
            else:
                module, _, name = what.rpartition(".")
                klass, why = classify(module, name, {"call"}, torch_allowed=self.allowed)
            self.calls.append(Call(what, klass, None, self.path, label, at, "call", why))
        self.calls[first:] = sorted(self.calls[first:], key=lambda c: c.offset)
        self._nested_bytes(found, label)
        if found.error is not None:
            self.notes.append(f"{label}: ckptlab's interpreter stops at byte "
                              f"{found.error_offset}: {found.error}")
        if weights_only_loads and self.refusal is None and not self.undecided:
            if found.refusal is not None:
                if found.decided:
                    self.refusal = (found.refusal.refused, found.refusal.reason)
                else:
                    self.undecided, self.undecided_why = True, found.refusal.reason
        return found

    def _nested_bytes(self, found: PickleFindings, label: str) -> None:
        """``torch.storage._load_from_bytes(b)`` runs torch.load on ``b``: scan it as a file."""
        for at, data in found.nested:
            where = f"{label}: the bytes given to _load_from_bytes at byte {at:,}"
            if self.depth >= _MAX_NESTED:
                self.calls.append(Call("torch.storage._load_from_bytes", "code", None,
                                       self.path, where, at, "call",
                                       f"torch.save files nested deeper than {_MAX_NESTED} "
                                       f"levels are not scanned: treated as code"))
                continue
            inner = _scan_bytes(data, f"{self.path} [{where}]", self.policy, self.depth + 1,
                                loader="torch.load(weights_only=False)")
            if inner is None:
                continue
            self.pickles.extend(f"{where}: {p}" for p in inner.pickles)
            self.calls.extend(replace(c, file=self.path, pickle=f"{where}: {c.pickle}")
                              for c in inner.calls)
            self.notes.extend(inner.notes)

    def result(self, *, torch_loads: bool = True) -> FileSafety:
        """The file's verdict (``torch_loads``: the file is one ``torch.load`` reads; else
        torch's answer is that it fails)."""
        version = self.policy.version if self.policy is not None else None
        if self.policy is None:
            wo = WeightsOnly(False, None, "torch is not installed: its rules are unknown",
                             None, decided=False)
        elif self.refusal is not None:
            wo = WeightsOnly(False, self.refusal[0], self.refusal[1], version)
        elif self.undecided:
            wo = WeightsOnly(False, None, self.undecided_why or "ckptlab could not follow a "
                             "pickle far enough to tell", version, decided=False)
        elif self.torch_fails is not None or not torch_loads:
            wo = WeightsOnly(False, None, self.torch_fails or "torch.load does not read this "
                             "file", version)
        else:
            wo = WeightsOnly(True, None, None, version)
        classes = {c.klass for c in self.calls}
        if "code" in classes:
            verdict = "code"
        elif self.unreadable is not None:
            verdict = "unreadable"
            self.notes.append(self.unreadable)
        elif wo.accepted and classes <= {"torch"}:
            verdict = "weights-only"
        else:
            verdict = "data"
        return FileSafety(self.path, self.kind, self.loader, verdict, wo, self.calls,
                          self.pickles, self.notes)


# -- files --------------------------------------------------------------------------------
def _is_tar(head: bytes) -> bool:
    return len(head) >= 262 and head[257:262] == b"ustar"


def _npy_pickle_start(data_head: bytes) -> int | None:
    """Where an ``.npy`` file's pickle starts (an object dtype), or None: no pickle."""
    if not data_head.startswith(b"\x93NUMPY") or len(data_head) < 10:
        return None
    major = data_head[6]
    if major == 1:
        hlen, start = int.from_bytes(data_head[8:10], "little"), 10
    else:
        hlen, start = int.from_bytes(data_head[8:12], "little"), 12
    header = data_head[start:start + hlen]
    import ast

    try:
        meta = ast.literal_eval(header.decode("latin-1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    descr = meta.get("descr") if isinstance(meta, dict) else None
    return start + hlen if "O" in repr(descr) else None


def _scan_bytes(data: bytes, name: str, policy: Policy | None, depth: int, *,
                loader: str) -> FileSafety | None:
    """A file held in memory (a nested torch.save, a DCP item, a zip member)."""
    return _scan_source(ByteSource(data, name=name), name, policy, depth, loader=loader)


def _scan_source(src: ByteSource, name: str, policy: Policy | None, depth: int = 0, *,
                 loader: str = "torch.load", opened: frozenset[str] = frozenset()
                 ) -> FileSafety | None:
    """One file: its pickles scanned, or None when it holds none."""
    head = src.read(0, min(src.nbytes, 512), what="file head") if src.nbytes else b""
    if head.startswith(b"PK\x03\x04"):
        return _scan_zip(src, name, policy, depth, loader, opened)
    if head.startswith(b"\x93NUMPY"):
        start = _npy_pickle_start(src.read(0, min(src.nbytes, 65536), what="npy header"))
        if start is None:
            return None
        scan = _FileScan(name, "npy (object array)", "numpy.load(allow_pickle=True)", policy,
                         depth)
        scan.pickle(src.read(start, min(src.nbytes - start, _MAX_PICKLE), what="pickle"),
                    "array pickle")
        return scan.result(torch_loads=False)
    if _is_tar(head):
        return _scan_tar(src, name, policy, depth)
    if not head or not _may_be_pickle(head, src.nbytes, name, src):
        return None
    return _scan_legacy(src, name, policy, depth, loader, opened)


def _may_be_pickle(head: bytes, nbytes: int, name: str, src: ByteSource) -> bool:
    """Whether ``torch.load`` would read the file as pickles: not another format its first
    bytes name (safetensors, GGUF, gzip, HDF5, ...). A file that is none of those is tried:
    one whose first byte is not an opcode holds no pickle."""
    from ckptlab.format._kinds import describe
    from ckptlab.format.inspect import detect_format

    kind = detect_format(head, nbytes)
    if kind in ("pickle", "legacy-pickle"):
        return True
    if kind != "unknown":
        return False
    described = describe(head, nbytes, name, lambda n: src.read(0, n, what="file head"))
    return described is None or described.id in _PICKLE_KINDS


_PICKLE_KINDS = frozenset({"pickle", "legacy-pickle", "legacy-pickle-0-1"})


def _pickle_bytes(src: ByteSource, start: int, what: str) -> bytes:
    from ckptlab.checkpoint._legacy import pickle_end

    try:
        end = pickle_end(src, start, what=what)
    except CkptlabError:  # truncated or malformed: the interpreter says where
        end = min(src.nbytes, start + _MAX_PICKLE)
    return src.read(start, end - start, what=what)


def _scan_legacy(src: ByteSource, name: str, policy: Policy | None, depth: int,
                 loader: str, opened: frozenset[str]) -> FileSafety | None:
    scan = _FileScan(name, "pickle", loader, policy, depth)
    start = 0
    for i, label in enumerate(_LEGACY_PICKLES):
        data = _pickle_bytes(src, start, label)
        found = scan.pickle(data, f"pickle {i + 1} ({label}) at byte {start:,}"
                            if i else "the pickle at byte 0")
        if found.end is None:
            if i == 0 and found.error_offset == 0 and not found.uses and \
                    (found.error or "").startswith("unknown opcode"):
                return None  # its first byte is no opcode: not a pickle at all
            if i == 0:
                scan.unreadable = f"the file's first pickle is malformed: {found.error}"
            else:
                scan.unreadable = f"the {label} pickle is malformed: {found.error}"
            break
        if found.lenient_stop:
            scan.notes.append(f"{scan.pickles[-1]} stops with objects left on the stack: the "
                              f"loaders return the top one, which ckptlab does not follow")
            if i < 2:  # the magic number or the protocol version: what torch does is not known
                scan.undecided, scan.undecided_why = True, scan.notes[-1]
                break
        if i == 0:
            if not (type(found.root) is int and found.root == _MAGIC_NUMBER):
                scan.torch_fails = ("not a torch.save file: torch.load reads a magic number "
                                    "first (RuntimeError: Invalid magic number)")
                break
            scan.kind = "legacy torch.save"
        elif i == 1 and found.root != _PROTOCOL_VERSION:
            scan.torch_fails = f"protocol version {found.root!r}, not {_PROTOCOL_VERSION}"
            break
        start += found.end
    if scan.kind == "legacy torch.save" and scan.torch_fails is None and scan.unreadable is None:
        _check_opens(scan, src, opened)
    return scan.result()


def _check_opens(scan: _FileScan, src: ByteSource, opened: frozenset[str]) -> None:
    """torch.load also reads the storages: where ckptlab cannot open the file, neither can
    torch (the reasons are the same: records missing, sizes wrong). ``opened``: the real
    paths of files ckptlab has opened already (a ``Checkpoint`` scanned: not again)."""
    if scan.refusal is not None or scan.undecided or os.path.realpath(src.name) in opened:
        return
    from ckptlab.checkpoint import open_checkpoint
    from ckptlab.source._window import PositionalFile

    try:  # (a local file by its path; else through the same source, read where needed)
        open_checkpoint(src.name if os.path.isfile(src.name) else PositionalFile(src))
    except CkptlabError as exc:
        text = str(exc).splitlines()[0]
        if any(part in text for part in _ZIP_STRICTNESS):
            # ckptlab's zip reader checks what torch's (miniz) does not read: whether torch
            # loads the file is not decided here
            scan.undecided, scan.undecided_why = True, f"ckptlab refuses the archive: {text}"
            scan.unreadable = scan.undecided_why
            return
        scan.torch_fails = f"the file does not load: {text}"
        scan.unreadable = scan.torch_fails


# ckptlab's zip checks that torch's reader does not make (local header names, descriptors,
# extra fields, records overlapping...): a refusal for one of them leaves torch's answer open
_ZIP_STRICTNESS = ("local header", "data descriptor", "extra field", "central directory",
                   "end record", "zip64", "overlap", "gap", "CRC")


def _record(src: ByteSource, entry: Any, cd_offset: int) -> Any:
    """One record, its local header read alone (a scan reads the few records holding
    pickles, not every header of a 10,000-record archive)."""
    from ckptlab.format.archive import local_record

    return local_record(src, entry, cd_offset)[0]


def _scan_zip(src: ByteSource, name: str, policy: Policy | None, depth: int,
              loader: str, opened: frozenset[str] = frozenset()) -> FileSafety | None:
    from ckptlab.errors import UnsupportedFormatError
    from ckptlab.format.archive import archive_prefix, fold_name, read_central_directory
    from ckptlab.format.archive import read_record_data as read

    def unreadable(exc: CkptlabError) -> FileSafety:
        # (ckptlab's zip reader is stricter than torch's in places: whether torch reads the
        # archive is not decided here)
        scan = _FileScan(name, "zip", loader, policy, depth)
        scan.unreadable = f"ckptlab cannot read this zip: {str(exc).splitlines()[0]}"
        scan.undecided, scan.undecided_why = True, scan.unreadable
        return scan.result()

    try:
        trailer, entries = read_central_directory(src)
    except CkptlabError as exc:
        return unreadable(exc)
    by_short: dict[str, Any] = {}
    for e in entries:
        by_short.setdefault(fold_name(e.name.split("/", 1)[1] if "/" in e.name else e.name), e)
    try:
        if "constants.pkl" in by_short:
            scan = _FileScan(name, "torchscript", "torch.jit.load", policy, depth)
            for short in ("constants.pkl", "data.pkl"):
                if short in by_short:
                    record = _record(src, by_short[short], trailer.cd_offset)
                    scan.pickle(read(src, record, _MAX_PICKLE), short, weights_only_loads=False)
            scan.torch_fails = ("a TorchScript archive: torch.load(weights_only=True) refuses "
                                "it; torch.load(weights_only=False) hands it to "
                                "torch.jit.load, which also runs the TorchScript under code/")
            return scan.result(torch_loads=False)
        try:
            prefix = archive_prefix(entries, name)
        except UnsupportedFormatError:
            return _scan_other_zip(src, name, policy, depth, trailer, entries)
        scan = _FileScan(name, "torch.save", loader, policy, depth)
        want = fold_name(f"{prefix}/data.pkl" if prefix else "data.pkl")
        entry = next(e for e in entries if fold_name(e.name) == want)
        data = read(src, _record(src, entry, trailer.cd_offset), _MAX_PICKLE)
    except CkptlabError as exc:
        return unreadable(exc)
    found = scan.pickle(data, "data.pkl")
    if found.end is None:
        scan.unreadable = f"data.pkl is malformed: {found.error}"
    elif found.end != len(data):
        # (ckptlab.open refuses such a file, so the storages are not checked through it)
        scan.notes.append(f"data.pkl has {len(data) - found.end:,} bytes after its STOP: "
                          f"torch never runs them (a scanner that reads them would disagree)")
    else:
        _check_opens(scan, src, opened)
    return scan.result()


def _scan_other_zip(src: ByteSource, name: str, policy: Policy | None, depth: int,
                    trailer: Any, entries: list[Any]) -> FileSafety | None:
    """A zip that is not a torch.save archive: its ``.npy`` members with object arrays (an
    ``.npz``) and its ``.pkl``/``.pickle`` members."""
    from ckptlab.format.archive import read_record_data as read

    scan = _FileScan(name, "zip", "numpy.load / pickle.load of its members", policy, depth)
    for e in entries:
        lower = e.name.lower()
        if lower.endswith(".npy"):
            head = read(src, _record(src, e, trailer.cd_offset), _MAX_PICKLE)
            start = _npy_pickle_start(head[:65536])
            if start is not None:
                scan.kind = "npz"
                scan.pickle(memoryview(head)[start:], f"{e.name} (array pickle)")
        elif lower.endswith((".pkl", ".pickle")):
            scan.pickle(read(src, _record(src, e, trailer.cd_offset), _MAX_PICKLE), e.name)
    if not scan.pickles:
        return None
    return scan.result(torch_loads=False)


def _scan_tar(src: ByteSource, name: str, policy: Policy | None, depth: int) -> FileSafety:
    """The legacy ``.tar`` format torch.save wrote before 0.4 (``torch.load`` still reads it
    with ``weights_only=False``): its ``sys_info`` and ``pickle`` members, and the first
    pickle of ``storages`` and ``tensors``."""
    scan = _FileScan(name, "legacy tar", "torch.load", policy, depth)
    scan.torch_fails = "the legacy .tar format: torch.load(weights_only=True) refuses it"
    try:
        with tarfile.open(fileobj=io.BytesIO(src.read(0, src.nbytes, what="tar")),
                          mode="r:") as tar:
            for member in ("sys_info", "pickle", "storages", "tensors"):
                try:
                    info = tar.getmember(member)
                except KeyError:
                    continue
                f = tar.extractfile(info)
                if f is not None:
                    scan.pickle(f.read(), member, weights_only_loads=False)
    except (tarfile.TarError, OSError) as exc:
        scan.unreadable = f"a tar archive torch cannot read: {exc}"
    return scan.result(torch_loads=False)


# -- directories --------------------------------------------------------------------------
def _scan_dcp(root: str, policy: Policy | None) -> list[FileSafety]:
    """A DCP directory: ``.metadata`` and each item of the data files it names."""
    meta_path = os.path.join(root, ".metadata")
    scan = _FileScan(meta_path, "dcp-metadata", "pickle.load (dcp.load)", policy)
    with ByteSource(meta_path) as src:
        data = src.read(0, min(src.nbytes, _MAX_PICKLE), what=".metadata")
    found = scan.pickle(data, ".metadata")
    scan.torch_fails = ("dcp.load reads .metadata with pickle.load, without weights_only "
                        "(torch.load(weights_only=True) refuses the file)")
    if found.end is None:
        scan.unreadable = f".metadata is malformed: {found.error}"
    out = [scan.result(torch_loads=False)]
    if out[0].verdict in ("code", "unreadable"):
        out[0].notes.append("the data files' items were not scanned: .metadata cannot be "
                            "read safely")
        return out
    from ckptlab.dcp import inspect_dcp

    try:
        layout = inspect_dcp(root)
    except CkptlabError as exc:
        out[0].notes.append(f"the data files' items were not scanned: {exc}")
        return out
    by_file: dict[str, list[Any]] = {}
    for item in layout.items:
        by_file.setdefault(item.file, []).append(item)
    for file, items in sorted(by_file.items()):
        path = os.path.join(root, file)
        fscan = _FileScan(path, "dcp data file", "dcp.load", policy)
        with ByteSource(path) as src:
            for item in items:
                try:
                    _scan_item(fscan, src, item)
                except CkptlabError as exc:
                    fscan.unreadable = f"item {item.fqn}: {str(exc).splitlines()[0]}"
        out.append(fscan.result(torch_loads=False))
    return out


def _scan_item(fscan: _FileScan, src: ByteSource, item: Any) -> None:
    from ckptlab.source._window import FileWindow, PositionalFile

    label = f"item {item.fqn}" + (f" chunk {item.index}" if item.index is not None else "")
    if item.serialization != "torch-save" or (item.kind == "tensor" and item.compression):
        return  # a safetensors blob or a raw compressed chunk: no pickle
    if item.compression:
        from ckptlab.dcp.items import inflate_item

        stored = src.read(item.offset, item.nbytes, what=label)
        blob: Any = inflate_item(stored, item.compression, _MAX_PICKLE, path=src.name,
                                 record=item.fqn, offset=item.offset)
        inner = ByteSource(blob, name=f"{src.name} [{label}]")
    else:
        window = FileWindow(PositionalFile(src), item.offset, item.nbytes,
                            name=f"{src.name} [{label}]")
        inner = ByteSource(window, name=f"{src.name} [{label}]")
    byte_item = item.kind == "bytes"
    result = _scan_source(inner, f"{src.name} [{label}]", fscan.policy, 1,
                          loader="torch.load(weights_only=False)" if byte_item else
                          "torch.load(weights_only=True)")
    if result is None:
        return
    fscan.pickles.extend(f"{label}: {p}" for p in result.pickles)
    fscan.calls.extend(result.calls)
    fscan.notes.extend(result.notes)
    if not byte_item and not result.weights_only.accepted and fscan.torch_fails is None:
        fscan.torch_fails = (f"{label} is a tensor item dcp.load reads with weights_only=True, "
                             f"which fails: {result.weights_only.reason}")


def _files_of(root: str) -> Iterable[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            yield os.path.join(dirpath, f)


def _what_it_is(path: str) -> str:
    lower = path.lower()
    for ext, kind in ((".safetensors", "safetensors"), (".json", "JSON"), (".gguf", "GGUF"),
                      (".txt", "text"), (".md", "text"), (".py", "Python source")):
        if lower.endswith(ext):
            return kind
    return "not a pickle-bearing format"


# -- the API ------------------------------------------------------------------------------
def _scan_checkpoint(ck: Any, policy: Policy | None,
                     storage_options: dict[str, Any] | None) -> SafetyReport:
    """A checkpoint ckptlab opened: its directory or file where it is local, else each of its
    files by URL."""
    from ckptlab.source import is_url

    if not is_url(ck.path) and os.path.exists(ck.path):
        # (its files opened: the scan does not open them again to see that they do)
        return _scan_path(ck.path, policy, frozenset(
            os.path.realpath(f.full_path) for f in ck.files if f.full_path))
    if is_url(ck.path) and len(ck.files) == 1 and ck.files[0].full_path == ck.path:
        return scan(ck.path, storage_options=storage_options)
    files: list[FileSafety] = []
    skipped: list[tuple[str, str]] = []
    for entry in ck.files:
        if not entry.full_path or entry.format in ("safetensors", "json"):
            skipped.append((entry.full_path or entry.path, entry.format))
            continue
        one = scan(entry.full_path, storage_options=storage_options)
        files.extend(one.files)
        skipped.extend(one.skipped)
    return SafetyReport(ck.path, files, skipped)


def scan(source: Any, *, storage_options: dict[str, Any] | None = None) -> SafetyReport:
    """Is this checkpoint safe to load? Every pickle its loader would run, read without
    running it.

    Parameters
    ----------
    source
        A file, a directory (every file in it and below; a DCP directory's ``.metadata`` and
        items), a URL of a file, the bytes of a file, a binary file object (read where it
        is, by seek and read), or a ``Checkpoint`` ckptlab opened (its files).
    storage_options
        For a URL: passed to fsspec.

    Returns
    -------
    SafetyReport
        A :class:`FileSafety` per file holding a pickle: its ``calls`` (every global with its
        class, ``torch``/``data``/``code``), what ``torch.load(weights_only=True)`` of the
        installed torch does with it (``weights_only``), and its ``verdict``:
        ``"weights-only"`` (torch's safe loader accepts it and only torch's functions are
        called), ``"data"`` (it needs ``weights_only=False`` and calls only data classes),
        ``"code"`` (it would run code under ``weights_only=False``), ``"unreadable"`` (torch
        would not load it either: the notes say why).

    Raises
    ------
    ArchiveError
        Nothing at ``source``, or a URL that cannot be read.
    """
    from ckptlab.source import is_url

    policy = Policy.installed()
    if isinstance(source, (bytes, bytearray, memoryview)) or (
            hasattr(source, "read") and hasattr(source, "seek")):  # bytes, a file object
        src = ByteSource(source)
        result = _scan_source(src, src.name, policy)
        return SafetyReport(src.name, [result] if result else [],
                            [] if result else [(src.name, "no pickle")])
    if hasattr(source, "files") and hasattr(source, "tensors"):  # a Checkpoint
        return _scan_checkpoint(source, policy, storage_options)
    if is_url(source):
        from ckptlab.source._tree import locate

        where = locate(source, storage_options)
        if where.tree is None or where.file is None:
            raise InvalidArgumentError(f"{source}: scan takes the URL of a file")
        with where.tree.open(where.file) as src:
            result = _scan_source(src, str(source), policy)
        return SafetyReport(str(source), [result] if result else [],
                            [] if result else [(str(source), "no pickle")])
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"scan takes a path, a URL, bytes, a binary file object or a Checkpoint, got "
            f"{type(source).__name__}")
    return _scan_path(os.fspath(source), policy, frozenset())


def _scan_path(path: str, policy: Policy | None, opened: frozenset[str]) -> SafetyReport:
    """:func:`scan` of a local file or directory (``opened``: see :func:`_check_opens`)."""
    if not os.path.exists(path):
        from ckptlab.errors import ArchiveError

        raise ArchiveError("no such file or directory", path=path)
    parent = os.path.dirname(os.path.abspath(path))
    if path.endswith(".distcp") and os.path.isfile(os.path.join(parent, ".metadata")):
        # a DCP data file is items, not a file of its own: read as .metadata places them
        found = [f for f in _scan_dcp(parent, policy)
                 if os.path.samefile(f.path, path) or f.kind == "dcp-metadata"]
        return SafetyReport(path, found)
    if not os.path.isdir(path):
        with ByteSource(path) as src:
            result = _scan_source(src, path, policy, opened=opened)
        return SafetyReport(path, [result] if result else [],
                            [] if result else [(path, _what_it_is(path))])
    files: list[FileSafety] = []
    skipped: list[tuple[str, str]] = []
    dcp_roots = set()
    for dirpath, _, filenames in os.walk(path):
        if ".metadata" in filenames:
            dcp_roots.add(dirpath)
            files.extend(_scan_dcp(dirpath, policy))
    for file in _files_of(path):
        if os.path.dirname(file) in dcp_roots and (file.endswith((".distcp", ".metadata"))):
            continue
        if not os.path.isfile(file) or os.path.islink(file):
            continue
        try:
            with ByteSource(file) as src:
                result = _scan_source(src, file, policy, opened=opened)
        except CkptlabError as exc:
            skipped.append((file, f"cannot be read: {exc}"))
            continue
        if result is None:
            skipped.append((file, _what_it_is(file)))
        else:
            files.append(result)
    return SafetyReport(path, files, skipped)
