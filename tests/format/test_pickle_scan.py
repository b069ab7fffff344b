"""The safe data.pkl scanner: it interprets torch.save pickles and never runs them.

Part 1, hostile pickles: ``__reduce__`` payloads calling ``os.system``, ``builtins.exec`` /
``eval``, ``subprocess.Popen`` and ``importlib.import_module``, and a GLOBAL of a module that is
not imported (whose import would leave a marker file), in pickle protocols 0-5, scanned
directly and as the data.pkl of a torch archive. Nothing may run: no marker file, no new
module in ``sys.modules``; the scan either returns or raises an ArchiveError. A positive
control then runs each payload with the real ``pickle.loads`` to prove it is live.

Part 2, coverage: every TensorInfo the scanner finds is compared with the tensor ``torch.load``
rebuilds from the same file (dtype, shape, stride, storage offset, requires_grad, Parameter,
storage sharing, storage bytes at the storage's data offset), for pickle protocols 1-5, the
``_rebuild_tensor_v3`` dtypes, Parameters, nested containers, views, raw storages, and tensors
held by instances of classes the scanner must not import.
"""

from __future__ import annotations

import builtins
import importlib
import io
import os
import pickle
import shlex
import subprocess
import sys
import time
import types
import uuid
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab
from ckptlab import _torch_compat as tc
from ckptlab.errors import ArchiveError, CorruptArchiveError
from ckptlab.format import _pickle
from ckptlab.format._pickle import PickleScan, scan_pickle
from ckptlab.testing.work import Work, WorkLimitExceeded, work_of

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def save(obj: Any, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage deprecation
        torch.save(obj, buf, pickle_protocol=protocol)
    return buf.getvalue()


def load(data: bytes) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(io.BytesIO(data), weights_only=False)  # our own trusted bytes


def data_pkl(data: bytes) -> bytes:
    zf = zipfile.ZipFile(io.BytesIO(data))
    (name,) = [n for n in zf.namelist() if n.endswith("/data.pkl")]
    return zf.read(name)


def with_data_pkl(pkl: bytes, *, torch_writer: bool = True) -> bytes:
    """A torch.save archive of a small dict whose data.pkl is replaced by ``pkl``.

    ``torch_writer``: re-write with torch's own zip writer (same geometry as torch.save);
    otherwise with Python's zipfile (ZIP_STORED, same record names).
    """
    base = save({"w": torch.arange(4, dtype=torch.float32)})
    src = zipfile.ZipFile(io.BytesIO(base))
    out = io.BytesIO()
    if torch_writer:
        writer = tc.pytorch_file_writer()(out)
        for name in src.namelist():
            short = name.split("/", 1)[1]
            if short in ("version", ".data/serialization_id"):
                continue  # write_end_of_file adds them
            payload = pkl if short == "data.pkl" else src.read(name)
            writer.write_record(short, payload, len(payload))
        writer.write_end_of_file()
        del writer
    else:
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
            for name in src.namelist():
                dst.writestr(name, pkl if name.endswith("/data.pkl") else src.read(name))
    return out.getvalue()


def storage_bytes(t: torch.Tensor) -> bytes:
    us = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(us).numpy().tobytes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def follow(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        if isinstance(obj, (dict, list, tuple)):
            obj = obj[key]
        else:
            obj = getattr(obj, key)
    return obj


def tensor_paths(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a tensor in a torch.load result (dicts, lists, tuples, object attributes)."""
    if isinstance(obj, torch.Tensor):
        yield path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensor_paths(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensor_paths(v, (*path, i))
    elif not isinstance(obj, (type, str, bytes, int, float, complex, bool, type(None))):
        attrs = dict(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if hasattr(obj, slot):
                    attrs[slot] = getattr(obj, slot)
        for k, v in attrs.items():
            yield from tensor_paths(v, (*path, k))


def check_against_torch(data: bytes, *, expect_tensors: int | None = None) -> ckptlab.format.ArchiveLayout:
    """inspect(data) agrees with what torch.load rebuilds from the same bytes."""
    layout = ckptlab.inspect(data)
    loaded = load(data)
    storages = {s.key: s for s in layout.storages}
    assert len(storages) == len(layout.storages)
    ptr_of_key: dict[str, int] = {}
    for t in layout.tensors:
        real = follow(loaded, t.path)
        assert isinstance(real, torch.Tensor), t.path
        assert t.dtype == dtype_name(real.dtype), t
        assert t.shape == tuple(real.shape), t
        assert t.stride == tuple(real.stride()), t
        assert t.storage_offset == real.storage_offset(), t
        assert t.requires_grad == real.requires_grad, t
        assert t.is_parameter == isinstance(real, torch.nn.Parameter), t
        s = storages[t.storage_key]
        assert s.nbytes == real.untyped_storage().nbytes(), (t, s)
        assert data[s.data_offset:s.data_offset + s.nbytes] == storage_bytes(real), (t, s)
        ptr = real.untyped_storage().data_ptr()
        assert ptr_of_key.setdefault(t.storage_key, ptr) == ptr, f"{t.storage_key} is two storages"
    # distinct keys are distinct storages, and every tensor torch rebuilt was found
    assert len(set(ptr_of_key.values())) == len(ptr_of_key)
    assert sorted(map(repr, (t.path for t in layout.tensors))) == sorted(
        map(repr, tensor_paths(loaded)))
    if expect_tensors is not None:
        assert len(layout.tensors) == expect_tensors
    # storage_offsets agrees (pickle order and central directory order)
    for scan in (False, True):
        offsets = ckptlab.storage_offsets(data, scan=scan)
        assert offsets.offsets == {k: s.data_offset for k, s in storages.items()}
    return layout


# --------------------------------------------------------------------------------------------
# part 1: hostile pickles
# --------------------------------------------------------------------------------------------
class EvilSystem:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


class EvilExec(EvilSystem):
    def __reduce__(self) -> Any:
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


class EvilEval(EvilSystem):
    def __reduce__(self) -> Any:
        return (builtins.eval, (f"__import__('pathlib').Path({self.marker!r}).touch()",))


class EvilPopen(EvilSystem):
    def __reduce__(self) -> Any:
        return (subprocess.Popen, (["touch", self.marker],))


class EvilImport(EvilSystem):
    """Calls importlib.import_module on a module whose import touches the marker."""

    module = ""

    def __reduce__(self) -> Any:
        return (importlib.import_module, (self.module,))


class EvilGlobal(EvilSystem):
    """A GLOBAL naming a function of a module that is not imported (set by the fixture)."""

    function: Any = None

    def __reduce__(self) -> Any:
        return (type(self).function, (self.marker,))


@pytest.fixture
def trap_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A module that is importable (on sys.path) and whose import touches a marker file."""
    name = f"ckptlab_trap_{uuid.uuid4().hex}"
    marker = tmp_path / f"{name}.imported"
    (tmp_path / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nprint('TRAP MODULE IMPORTED')\n"
        "def boom(path):\n    pathlib.Path(path).touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert name not in sys.modules
    yield name, marker
    sys.modules.pop(name, None)


def payloads(kind: str, marker: Path, trap: str, protocol: int) -> bytes:
    """A pickle (protocol ``protocol``) that runs code when loaded with pickle.loads."""
    if kind == "global":
        # pickle needs the module to look the function up while dumping: a stand-in module
        # object, removed again, so the only way the real one gets imported is by the loader
        fake = types.ModuleType(trap)

        def boom(path: str) -> None:  # pragma: no cover - never called
            raise AssertionError("called while dumping")

        boom.__module__, boom.__qualname__ = trap, "boom"
        fake.boom = boom  # type: ignore[attr-defined]
        sys.modules[trap] = fake
        try:
            EvilGlobal.function = staticmethod(boom)
            return pickle.dumps(EvilGlobal(marker), protocol=protocol)
        finally:
            del sys.modules[trap]
    if kind == "import_module":
        EvilImport.module = trap
        return pickle.dumps(EvilImport(marker), protocol=protocol)
    cls = {"os.system": EvilSystem, "exec": EvilExec, "eval": EvilEval,
           "Popen": EvilPopen}[kind]
    return pickle.dumps(cls(marker), protocol=protocol)


KINDS = ["os.system", "exec", "eval", "Popen", "import_module", "global"]


def assert_nothing_ran(marker: Path, trap: str, trap_marker: Path,
                       modules_before: set[str], wait: float = 0.01) -> None:
    time.sleep(wait)  # a spawned `touch` would have had time to run
    assert not marker.exists(), "the pickle's payload ran"
    assert not trap_marker.exists(), "the trap module was imported"
    assert trap not in sys.modules
    assert new_modules(modules_before) == set(), "the scan imported modules"


def new_modules(before: set[str]) -> set[str]:
    """Modules imported since ``before``, less stdlib codecs (zip names are cp437, protocol 0
    strings raw-unicode-escape: the codec machinery imports those, not the pickle)."""
    return {m for m in set(sys.modules) - before if not m.startswith("encodings.")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_hostile_pickle_never_runs(kind: str, protocol: int, tmp_path: Path,
                                   trap_module: tuple[str, Path], capfd: pytest.CaptureFixture
                                   ) -> None:
    trap, trap_marker = trap_module
    marker = tmp_path / "payload_ran"
    pkl = payloads(kind, marker, trap, protocol)
    archives = {w: with_data_pkl(pkl, torch_writer=w) for w in (True, False)}
    ckptlab.inspect(archives[True])  # warm-up: ckptlab's own lazy imports
    before = set(sys.modules)

    scan = scan_pickle(pkl)  # interpreted: a stand-in object, nothing called
    assert isinstance(scan, PickleScan) and scan.tensors == () and scan.storages == ()
    assert scan.globals, "the scanner saw no global"
    # the root is the scanner's inert record of the call, not what the call would return
    assert type(scan.root).__module__.startswith("ckptlab.format._"), type(scan.root)
    for torch_writer, archive in archives.items():
        for fn in (ckptlab.inspect, lambda s: ckptlab.storage_offsets(s, scan=True),
                   ckptlab.storage_offsets):
            try:
                fn(archive)
            except ArchiveError:
                pass
        path = tmp_path / f"hostile_{torch_writer}.pt"
        path.write_bytes(archive)
        layout = ckptlab.inspect(path)
        assert layout.tensors == () and layout.storages == ()
    assert_nothing_ran(marker, trap, trap_marker, before, 0.3 if kind == "Popen" else 0.01)
    assert "TRAP MODULE IMPORTED" not in capfd.readouterr().out

    # positive control: the same bytes do run under the real unpickler
    result = pickle.loads(pkl)
    if isinstance(result, subprocess.Popen):
        result.wait(timeout=30)
    assert marker.exists() or trap_marker.exists(), f"the {kind} payload is not live"


EXPECTED_GLOBAL = {"os.system": ("posix.system", "nt.system", "os.system"),
                   "exec": ("builtins.exec", "__builtin__.exec"),  # protocol < 3: __builtin__
                   "eval": ("builtins.eval", "__builtin__.eval"),
                   "Popen": ("subprocess.Popen", "commands.Popen"),
                   "import_module": ("importlib.import_module",)}


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("kind", ["os.system", "exec", "eval", "Popen", "import_module"])
def test_hostile_pickle_beside_tensors(kind: str, protocol: int, tmp_path: Path,
                                       trap_module: tuple[str, Path]) -> None:
    """torch.save of a dict holding tensors *and* a payload: the tensors are still found."""
    trap, trap_marker = trap_module
    marker = tmp_path / "payload_ran"
    if kind == "import_module":
        EvilImport.module = trap
    evil = {"os.system": EvilSystem, "exec": EvilExec, "eval": EvilEval, "Popen": EvilPopen,
            "import_module": EvilImport}[kind](marker)
    weight = torch.arange(6, dtype=torch.float32).view(2, 3)
    data = save({"w": weight, "evil": evil, "after": [weight[1]]}, protocol)
    ckptlab.inspect(save({"w": weight}))  # warm-up: ckptlab's own lazy imports
    before = set(sys.modules)
    layout = ckptlab.inspect(data)
    scan = scan_pickle(data_pkl(data))
    assert_nothing_ran(marker, trap, trap_marker, before)
    assert set(scan.globals) & set(EXPECTED_GLOBAL[kind]), scan.globals
    paths = {t.path: t for t in layout.tensors}
    assert set(paths) == {("w",), ("after", 0)}
    assert paths[("after", 0)].storage_offset == 3 and paths[("after", 0)].shape == (3,)
    assert paths[("w",)].storage_key == paths[("after", 0)].storage_key


# --------------------------------------------------------------------------------------------
# hostile pickles aimed at the scanner itself
# --------------------------------------------------------------------------------------------
def _tensor_pickle(tail: bytes) -> bytes:
    """Protocol 2: a _rebuild_tensor_v2 of a FloatStorage '0' of 4 elements, then ``tail``."""
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n("
            b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000"
            b"X\x03\x00\x00\x00cpuK\x04tQ"
            b"K\x00K\x04\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR" + tail)


def test_crafted_tensor_pickle_baseline() -> None:
    scan = scan_pickle(_tensor_pickle(b"."))
    (t,) = scan.tensors
    assert (t.shape, t.stride, t.storage_offset, t.dtype) == ((4,), (1,), 0, "float32")
    layout = ckptlab.inspect(with_data_pkl(_tensor_pickle(b".")))
    assert layout.tensors[0].storage_key == "0" and layout.storages[0].nbytes == 16


@pytest.mark.parametrize("field,value", [
    ("storage", b"K\x01"),  # an int where the StorageRef was
    ("shape", b"X\x03\x00\x00\x00abc"),  # a str shape
    ("storage_offset", b"J\xff\xff\xff\xff"),  # -1
])
def test_build_on_tensor_stand_in_is_rejected(field: str, value: bytes) -> None:
    name = field.encode()
    tail = b"N}" + b"X" + len(name).to_bytes(4, "little") + name + value + b"s\x86b."
    for fn in (scan_pickle, lambda p: ckptlab.inspect(with_data_pkl(p))):
        try:
            result = fn(_tensor_pickle(tail))
        except ArchiveError:
            continue
        tensors = result.tensors
        for t in tensors:
            assert isinstance(t.shape, tuple) and all(type(d) is int for d in t.shape), t
            assert type(t.storage_offset) is int and t.storage_offset >= 0, t


def _all_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled interpreter and torch handlers off (``_pickle._IMPL``, the one switch for
    both): every opcode and handler then goes through Python, where
    :mod:`ckptlab.testing.work` counts it (tests/format/test_interp.py holds both
    implementations to the same results)."""
    monkeypatch.setattr(_pickle, "_IMPL", "python")


def _scan_work(pkl: bytes, limit: int | None = None) -> tuple[Any, Work]:
    """scan_pickle's result (or ArchiveError) and its work: calls + lines run."""
    return work_of(scan_pickle, pkl, lines=True, limit=limit, catch=ArchiveError)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body", [
    b"N" + b"\x85" * 10_000,  # NONE, then TUPLE1 10000 times: 10 KB of nested 1-tuples
    b"(" * 10_000 + b"l" * 10_000,  # MARK ... LIST: 20 KB of nested lists
], ids=["tuple1", "mark-list"])
def test_deeply_nested_pickle_is_not_quadratic(body: bytes,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured as work, not time: the Python calls and lines the scan runs
    (:mod:`ckptlab.testing.work`, the same count on every host and every run), for the nested
    pickle and for a flat one of the same size (one list of NONEs), with the compiled parts
    off (:func:`_all_python`) so that all the work is counted. Both are linear: the nested one
    does less than the flat one (x0.3 and x0.9 now). A Python step repeated per level of
    nesting (a walk down the stack or the metastack at each MARK or LIST, a path built key by
    key for every object) makes it about depth / 2 = 5,000 times more, stopped at the limit.
    Not counted: work inside one C call (a slice or copy of a long list), and the compiled
    runner's own loop. The nested pickle is refused (deeper than the walk's limit); so is it
    as ckptlab runs it, compiled parts on."""
    deep = b"\x80\x02" + body + b"."
    with pytest.raises(ArchiveError):
        scan_pickle(deep)
    _all_python(monkeypatch)
    flat_result, flat = _scan_work(b"\x80\x02(" + b"N" * (len(body) - 2) + b"l.")
    assert isinstance(flat_result, PickleScan), flat_result
    limit = 2 * flat.total
    try:
        result, nested = _scan_work(deep, limit)
    except WorkLimitExceeded:
        pytest.fail(f"the nested pickle took more than 2x the work of the flat one "
                    f"({flat.total:,} calls + lines)")
    assert isinstance(result, ArchiveError), result
    assert not nested.exceeded, (nested, flat)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body", [
    lambda n: b"](" + b"N" * n + b"e",  # a wide list via APPENDS
    lambda n: b"}(" + b"K\x01N" * (n // 2) + b"u",  # a dict via SETITEMS (one key, overwritten)
    lambda n: b"(" + b"J\x00\x00\x00\x00" * n + b"t",  # a wide tuple of ints
], ids=["appends", "setitems", "tuple"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_large_pickles_scan_in_linear_work(body: Callable[[int], bytes], compiled: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide containers (2,500 to 5,000 items) and twice as wide: twice the items must cost at
    most 2.1x the work (calls + lines run, :mod:`ckptlab.testing.work`; exactly 2x less a
    constant now), where a Python step per item that runs over the items already there (a
    loop over the stack, a rescan of the keys) makes it 4x, stopped at the limit. As ckptlab
    runs it (compiled: what is left to Python is counted, for SETITEMS a key lookup per
    item) and all in Python (every opcode counted). Work inside one C call (a copy of a long
    list) is not counted."""
    if not compiled:
        _all_python(monkeypatch)
    result, small = _scan_work(b"\x80\x02" + body(5_000) + b".")
    assert isinstance(result, PickleScan), result
    limit = int(2.1 * small.total)
    try:
        result, large = _scan_work(b"\x80\x02" + body(10_000) + b".", limit)
    except WorkLimitExceeded:
        pytest.fail(f"twice the items took more than 2.1x the work ({small.total:,} calls + "
                    f"lines for the first)")
    assert isinstance(result, PickleScan), result
    assert not large.exceeded, (small, large)


@pytest.mark.parametrize("pkl", [
    b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.",
    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x04true\x85R.",
    b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\nX\x02\x00\x00\x00os\x85R"
    b"X\x06\x00\x00\x00system\x86R.",
    b"\x80\x02(ccopyreg\n_reconstructor\nX\x01\x00\x00\x00xo.",  # OBJ opcode
    b"(ios\nsystem\nX\x04\x00\x00\x00truek.",  # INST opcode, protocol 0
    b"\x80\x02cos\nsystem\n}b.",  # BUILD on a global
    b"\x80\x02\x82\x01.",  # EXT1 (copyreg extension registry)
])
def test_handcrafted_hostile_opcodes(pkl: bytes) -> None:
    archive = with_data_pkl(pkl)
    ckptlab.inspect(with_data_pkl(data_pkl(save({}))))  # warm-up: ckptlab's lazy imports
    before = set(sys.modules)
    try:
        scan_pickle(pkl)
    except CorruptArchiveError:
        pass
    try:
        ckptlab.inspect(archive)
    except ArchiveError:
        pass
    assert new_modules(before) == set()


# --------------------------------------------------------------------------------------------
# part 2: coverage against torch.load
# --------------------------------------------------------------------------------------------
class Holder:
    """A user class at module level: its instances pickle as GLOBAL + NEWOBJ + BUILD."""

    def __init__(self) -> None:
        self.weight = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
        self.inner = {"bias": torch.zeros(2), "steps": [torch.tensor([1, 2, 3])]}
        self.name = "holder"


class SlotHolder:
    __slots__ = ("extra", "table")

    def __init__(self) -> None:
        self.table = torch.arange(8, dtype=torch.int32).view(2, 4)
        self.extra = (torch.ones(1, dtype=torch.float64),)


def rich_state() -> dict[str, Any]:
    base = torch.arange(30, dtype=torch.float32)
    lin = torch.nn.Linear(3, 2)
    return {
        "model": OrderedDict(
            weight=lin.weight,  # Parameter, requires_grad=True
            bias=torch.nn.Parameter(torch.zeros(2), requires_grad=False),
            buf=torch.ones(2, 2, dtype=torch.bfloat16),
        ),
        "base": base,
        "view": base[5:17].view(3, 4),  # shared storage, offset 5
        "transposed": base[:12].view(3, 4).t(),  # stride (1, 4)
        "every_other": base[1::2],  # stride 2, offset 1
        "grad": torch.ones(3, requires_grad=True),
        "list": [torch.tensor([True, False]), (torch.arange(3, dtype=torch.int8), base[29:])],
        "tuple": (torch.zeros(0), torch.tensor(3.5, dtype=torch.float64)),  # empty, 0-d
        "complex": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "half": torch.full((2, 3), 0.25, dtype=torch.float16),
        "step": 12,
        "meta": {"lr": 0.1, "name": "x", "nested": {"deep": [torch.arange(2, dtype=torch.int16)]}},
    }


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_rich_state_matches_torch_load(protocol: int) -> None:
    data = save(rich_state(), protocol)
    layout = check_against_torch(data)
    if protocol >= 2:
        assert layout.pickle_protocol == protocol
    paths = {t.path: t for t in layout.tensors}
    assert paths[("model", "weight")].is_parameter and paths[("model", "weight")].requires_grad
    assert paths[("model", "bias")].is_parameter and not paths[("model", "bias")].requires_grad
    assert paths[("grad",)].requires_grad and not paths[("grad",)].is_parameter
    assert paths[("view",)].storage_key == paths[("base",)].storage_key
    assert paths[("view",)].storage_offset == 5
    assert paths[("transposed",)].stride == (1, 4)
    assert paths[("every_other",)].stride == (2,) and paths[("every_other",)].storage_offset == 1
    assert paths[("list", 1, 1)].storage_offset == 29
    assert paths[("tuple", 1)].shape == ()
    assert paths[("meta", "nested", "deep", 0)].dtype == "int16"
    base_key = paths[("base",)].storage_key
    assert sum(s.key == base_key for s in layout.storages) == 1


V3_DTYPES = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
             "float8_e8m0fnu", "uint16", "uint32", "uint64", "complex32", "bits8", "bits16"]


@pytest.mark.parametrize("name", V3_DTYPES)
def test_rebuild_tensor_v3_dtypes(name: str) -> None:
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch has no {name}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
            t = torch.zeros(6, dtype=torch.uint8).view(dtype) if torch.empty(
                0, dtype=dtype).element_size() == 1 else torch.zeros(6, dtype=dtype)
        t = t.view(2, -1) if t.numel() % 2 == 0 else t
        data = save({"t": t, "view": t[1:], "plain": torch.ones(2)})
    except (RuntimeError, TypeError, KeyError) as exc:
        pytest.skip(f"torch cannot make or save {name}: {exc}")
    layout = ckptlab.inspect(data)
    pkl_globals = scan_pickle(data_pkl(data)).globals
    assert "torch._utils._rebuild_tensor_v3" in pkl_globals
    paths = {t.path: t for t in layout.tensors}
    assert paths[("t",)].dtype == name and paths[("view",)].dtype == name
    storage = layout.storage(paths[("t",)].storage_key)
    assert storage.storage_type == "UntypedStorage"
    loaded = load(data)
    assert storage.nbytes == loaded["t"].untyped_storage().nbytes()
    assert paths[("view",)].storage_offset == loaded["view"].storage_offset()
    assert paths[("view",)].stride == tuple(loaded["view"].stride())
    assert data[storage.data_offset:storage.data_offset + storage.nbytes] == storage_bytes(
        loaded["t"])
    assert paths[("plain",)].dtype == "float32"


def test_tensor_with_python_attributes() -> None:
    t = torch.arange(4.0)
    t.note = "tagged"  # pickles through torch._tensor._rebuild_from_type_v2
    check_against_torch(save({"t": t, "u": torch.ones(1)}), expect_tensors=2)


@pytest.mark.parametrize("make", ["untyped", "untyped_view", "typed"])
def test_raw_storages(make: str) -> None:
    t = torch.arange(10, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj = {"untyped": t.untyped_storage(), "untyped_view": t[3:].untyped_storage(),
               "typed": t.storage()}[make]
    data = save(obj)
    layout = ckptlab.inspect(data)
    assert layout.tensors == ()
    (storage,) = layout.storages
    assert storage.nbytes == 80
    if make == "typed":
        assert storage.storage_type == "LongStorage" and storage.dtype == "int64"
    else:
        assert storage.storage_type == "UntypedStorage"
    raw = t.numpy().tobytes()
    assert data[storage.data_offset:storage.data_offset + 80] == raw
    assert ckptlab.storage_offsets(data, scan=True).offsets == {storage.key: storage.data_offset}
    loaded = load(data)
    assert loaded.nbytes() == 80


def test_raw_storages_in_containers() -> None:
    t = torch.arange(6, dtype=torch.float32)
    data = save({"s": torch.arange(3, dtype=torch.uint8).untyped_storage(), "t": t,
                 "other": [torch.zeros(2).untyped_storage()]})
    layout = ckptlab.inspect(data)
    assert [t.path for t in layout.tensors] == [("t",)]
    assert sorted(s.nbytes for s in layout.storages) == [3, 8, 24]
    raw = {s.nbytes: data[s.data_offset:s.data_offset + s.nbytes] for s in layout.storages}
    assert raw[3] == bytes([0, 1, 2]) and raw[24] == t.numpy().tobytes()
    assert raw[8] == bytes(8)


def _u8_tensor_and_its_storage() -> dict[str, Any]:
    t = torch.arange(6, dtype=torch.uint8)
    return {"t": t, "s": t.untyped_storage()}


def _float8_and_uint8_view() -> dict[str, Any]:
    w = torch.full((4,), 0.5).to(torch.float8_e4m3fn)
    return {"w": w, "bits": w.view(torch.uint8)}  # common in quantization code


def _uint16_and_uint8_view() -> dict[str, Any]:
    x = torch.zeros(4, dtype=torch.uint16)
    return {"x": x, "bytes": x.view(torch.uint8)}


@pytest.mark.parametrize("make", [_u8_tensor_and_its_storage, _float8_and_uint8_view,
                                  _uint16_and_uint8_view],
                         ids=["uint8+untyped_storage", "float8+uint8_view", "uint16+uint8_view"])
def test_storage_pickled_as_untyped_and_byte_storage(make: Any) -> None:
    data = save(make())
    torch.load(io.BytesIO(data))  # torch itself accepts the file (weights_only=True)
    layout = ckptlab.inspect(data)
    assert len(layout.storages) == 1
    check_against_torch(data)


def test_custom_class_instances_are_walked_by_attribute() -> None:
    data = save({"holder": Holder(), "slots": SlotHolder(), "plain": torch.ones(1)})
    check_against_torch(save({"plain": torch.ones(1)}))  # warm-up: lazy imports
    before = set(sys.modules)
    layout = check_against_torch(data, expect_tensors=6)
    assert new_modules(before) == set()
    paths = {t.path for t in layout.tensors}
    assert ("holder", "weight") in paths and ("holder", "inner", "steps", 0) in paths
    assert ("slots", "table") in paths and ("slots", "extra", 0) in paths
    scan = scan_pickle(data_pkl(data))
    assert f"{Holder.__module__}.Holder" in scan.globals


def test_class_from_unimported_module(tmp_path: Path, trap_module: tuple[str, Path]) -> None:
    """A class whose module is not imported: found by attribute, the module never imported."""
    trap, trap_marker = trap_module
    fake = types.ModuleType(trap)

    class Model:
        def __init__(self) -> None:
            self.weight = torch.arange(6, dtype=torch.float32).view(2, 3)
            self.layers = [torch.ones(2), {"bias": torch.zeros(3, dtype=torch.float16)}]

    Model.__module__, Model.__qualname__ = trap, "Model"
    fake.Model = Model  # type: ignore[attr-defined]
    sys.modules[trap] = fake
    try:
        data = save({"model": Model(), "epoch": 3}, protocol=2)
        loaded = load(data)
    finally:
        del sys.modules[trap]
    ckptlab.storage_offsets(save({"w": torch.ones(1)}), scan=True)  # warm-up: lazy imports
    before = set(sys.modules)
    layout = ckptlab.inspect(data)
    offsets = ckptlab.storage_offsets(data, scan=True)
    assert trap not in sys.modules and not trap_marker.exists()
    assert new_modules(before) == set()
    paths = {t.path: t for t in layout.tensors}
    assert set(paths) == {("model", "weight"), ("model", "layers", 0),
                          ("model", "layers", 1, "bias")}
    for path, info in paths.items():
        real = follow(loaded, path)
        assert info.shape == tuple(real.shape) and info.dtype == dtype_name(real.dtype)
        s = layout.storage(info.storage_key)
        assert offsets.offsets[s.key] == s.data_offset
        assert data[s.data_offset:s.data_offset + s.nbytes] == storage_bytes(real)
    assert f"{trap}.Model" in scan_pickle(data_pkl(data)).globals


def test_shared_storage_saved_once_and_views() -> None:
    big = torch.arange(64, dtype=torch.float32)
    state = {f"v{i}": big[i * 8:(i + 1) * 8].view(2, 4) for i in range(8)}
    state["whole"] = big
    data = save(state)
    layout = check_against_torch(data, expect_tensors=9)
    assert len(layout.storages) == 1 and layout.storages[0].nbytes == 256
    assert sorted(t.storage_offset for t in layout.tensors) == [0, 0, 8, 16, 24, 32, 40, 48, 56]


def test_scan_reports_protocol_and_globals() -> None:
    for protocol in (2, 3, 4, 5):
        scan = scan_pickle(data_pkl(save({"a": torch.ones(2)}, protocol)))
        assert scan.protocol == protocol
        assert "torch._utils._rebuild_tensor_v2" in scan.globals
        assert [s.key for s in scan.storages] == ["0"]
