"""TorchScript archives (``torch.jit.save``) through ``ckptlab.open``.

Names and order are those of ``torch.jit.load(f).state_dict()`` for scripted and traced modules
(Sequential, ModuleList/ModuleDict, nested submodules, a submodule shared by two attributes,
parameters, frozen parameters, persistent and non-persistent buffers, a Linear without bias);
``ck.read`` gives the same values, dtype, shape and stride, and the ``requires_grad`` of the
loaded module's attribute. Plain tensor attributes follow by attribute path, and the traced
constants as ``CONSTANTS.c<i>``, equal to the constants of the loaded graph. Segments tile the
file, parts hold the tensors' bytes, and damage gives ckptlab errors only.
"""

from __future__ import annotations

import io
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.checkpoint.model import Checkpoint
from ckptlab.errors import ArchiveError, UnsupportedFormatError
from ckptlab.testing import strategies as cst
from ckptlab.testing.damage import assert_tiles, bit_flips, open_and_read, truncations

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")


class Sub(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("buf", torch.arange(4.0))
        self.c = torch.tensor([1.0, 2.0])  # a plain tensor attribute: not in the state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.buf.sum() + self.c.sum()


class Zoo(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(),
                                       torch.nn.Linear(3, 3, bias=False))
        self.sub = Sub()
        shared = torch.nn.Linear(2, 2)
        self.a = shared
        self.b = shared
        self.ml = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        self.md = torch.nn.ModuleDict({"x": torch.nn.Linear(2, 2)})
        self.bn = torch.nn.BatchNorm1d(3)
        self.p = torch.nn.Parameter(torch.randn(2, 2))
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.t = torch.nn.Parameter(torch.randn(4, 3).t())  # non-contiguous
        self.h = torch.nn.Parameter(torch.randn(3).bfloat16())
        self.register_buffer("nonpersistent", torch.zeros(3), persistent=False)
        self.d = {"k": torch.ones(2)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.sub(self.bn(self.seq(x)))
        z = torch.zeros(2)
        for m in self.ml:
            z = m(z)
        z = self.a(z) + self.b(z) + self.md["x"](z) + self.d["k"]
        return y.sum() + z.sum() + self.p.sum() + self.frozen.sum() + self.t.sum() + \
            self.h.float().sum() + self.nonpersistent.sum()


class Traced(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.k = torch.tensor([[5.0, 6.0]])  # read under tracing: becomes a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.k + torch.arange(2.0)


def script_save(module: torch.nn.Module, path: Path, **kwargs: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(module), str(path), **kwargs)
    return path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return script_save(Zoo(), tmp_path_factory.mktemp("ts") / "zoo.pt")


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ts") / "traced.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.trace(Traced(), torch.randn(1, 3)), str(path))
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = script_save(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)),
                       tmp_path_factory.mktemp("ts") / "small.pt")
    return path.read_bytes()


def raw_bytes(t: torch.Tensor) -> bytes:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return bytes(dense.reshape(-1).view(torch.uint8).numpy())


def attribute(module: Any, name: str) -> Any:
    for key in name.split("."):
        module = getattr(module, key) if not isinstance(module, dict) else module[key]
    return module


def check_tiling(ck: Checkpoint) -> None:
    for f in ck.files:
        assert_tiles(f.segments, f.nbytes, f.path)


def check_state_dict(ck: Checkpoint, path: Path) -> torch.jit.ScriptModule:
    loaded = torch.jit.load(str(path))
    sd = loaded.state_dict()
    slots = {n: dict(e.extra)["slot"] for n, e in ck.tensors.items()}
    in_sd = [n for n in ck.tensors if slots[n] in ("parameter", "buffer")]
    assert in_sd == list(sd)  # the same names in the same order
    data = path.read_bytes()
    for name, want in sd.items():
        got = ck.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride() and torch.equal(got, want), name
        assert got.requires_grad == attribute(loaded, name).requires_grad, name
        (part,) = ck.tensors[name].parts
        if part.contiguous:
            assert data[part.offset:part.offset + part.nbytes] == raw_bytes(want)
    check_tiling(ck)
    return loaded


def test_scripted_module_names_and_values(zoo: Path) -> None:
    ck = cl.open(zoo)
    assert ck.format == "torchscript" and ck.files[0].format == "torchscript"
    loaded = check_state_dict(ck, zoo)
    slots = {n: dict(e.extra)["slot"] for n, e in ck.tensors.items()}
    assert slots["p"] == slots["seq.0.weight"] == slots["frozen"] == "parameter"
    assert slots["nonpersistent"] == slots["bn.num_batches_tracked"] == "buffer"
    assert "seq.2.bias" not in ck.tensors  # Linear(bias=False): a None attribute
    assert "a.weight" in ck.tensors and "b.weight" in ck.tensors  # one module, two names
    assert ck.tensors["a.weight"].parts == ck.tensors["b.weight"].parts
    # tensors outside the state dict, by attribute path
    assert {n for n, s in slots.items() if s == "attribute"} == {"sub.c", "d.k"}
    assert torch.equal(ck.read("sub.c"), loaded.sub.c)
    assert torch.equal(ck.read("d.k"), loaded.d["k"])
    assert ck.read("frozen").requires_grad is False and ck.read("p").requires_grad is True
    assert ck.objects == {"seq.2.bias": None}
    layout = ck.files[0].layout
    assert layout.format == "torchscript" and layout.archive_name == "zoo"
    assert any(r.short_name == "constants.pkl" for r in layout.records)


def test_traced_module_constants(traced: Path) -> None:
    ck = cl.open(traced)
    loaded = check_state_dict(ck, traced)
    constants = [n.t("value") for n in loaded.inlined_graph.nodes()
                 if n.kind() == "prim::Constant" and n.hasAttribute("value")
                 and n.kindOf("value") == "t"]
    names = [n for n, e in ck.tensors.items() if dict(e.extra)["slot"] == "constant"]
    assert names == [f"CONSTANTS.c{i}" for i in range(len(constants))] and names
    for name, want in zip(names, constants, strict=True):
        got = ck.read(name)
        assert got.dtype == want.dtype and got.stride() == want.stride()
        assert torch.equal(got, want)
        assert ck.tensors[name].parts[0].storage_key.startswith("constants/")
    assert torch.equal(ck.read("CONSTANTS.c0"), Traced().k)


def test_lite_interpreter_and_extra_files(tmp_path: Path) -> None:
    module = torch.jit.script(Sub())
    module._save_for_lite_interpreter(str(tmp_path / "sub.ptl"))
    extra = script_save(Sub(), tmp_path / "extra.pt", _extra_files={"meta.txt": "hello"})
    for path in (tmp_path / "sub.ptl", extra):
        ck = cl.open(path)
        assert ck.format == "torchscript"
        check_state_dict(ck, path)


def test_file_objects_and_bytes(small: bytes) -> None:
    names = list(cl.open(small).tensors)
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                     "1.running_var", "1.num_batches_tracked"]
    buf = io.BytesIO(b"X" * 7 + small)
    buf.seek(7)
    assert list(cl.open(buf).tensors) == names
    with pytest.raises(UnsupportedFormatError):  # inspect stays for torch.save archives
        cl.inspect(small)


def test_without_code_tensors_are_attributes(small: bytes) -> None:
    """A foreign copy without ``code/``: tensors still found, named by attribute, said so."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(small)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            if "/code/" not in info.filename:
                zout.writestr(info.filename, zin.read(info.filename))
    ck = cl.open(out.getvalue())
    assert ck.format == "torchscript" and len(ck.tensors) == 7
    assert {dict(e.extra)["slot"] for e in ck.tensors.values()} == {"attribute"}
    assert "no code/ declaration" in ck.notes[0]
    check_tiling(ck)


def test_hostile_data_pkl_never_runs(tmp_path: Path) -> None:
    import os
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> Any:
            return os.system, (f"touch {marker}",)

    evil = pickle.dumps(Payload(), protocol=2)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("evil/data.pkl", evil)
        z.writestr("evil/constants.pkl", pickle.dumps((), protocol=2))
        z.writestr("evil/code/__torch__.py", "")
        z.writestr("evil/version", "3\n")
    pickle.loads(evil)  # positive control: Python's pickle runs it
    assert marker.exists()
    marker.unlink()
    ck = cl.open(buf.getvalue())
    assert not marker.exists() and ck.format == "torchscript" and not ck.tensors
    assert ck.objects == {"<root>": {"type": f"{os.system.__module__}.system",
                                     "args": [f"touch {marker}"]}}


# -- damage ------------------------------------------------------------------------------------
def test_truncations_are_archive_errors(small: bytes) -> None:
    for prefix in truncations(small, step=7):
        with pytest.raises(ArchiveError):
            cl.open(prefix)


def _pickle_ranges(data: bytes) -> list[tuple[int, int]]:
    ck = cl.open(data)
    return [(r.data_offset, r.data_offset + r.data_nbytes) for r in ck.files[0].layout.records
            if r.short_name in ("data.pkl", "constants.pkl") or r.short_name.endswith(".py")]


def test_every_byte_of_data_pkl_flipped(small: bytes, tmp_path: Path) -> None:
    ck = cl.open(small)
    pkl = ck.files[0].layout.record("data.pkl")
    target = tmp_path / "flipped.pt"
    for _, mutated in bit_flips(small, [(pkl.data_offset, pkl.data_offset + pkl.data_nbytes)]):
        open_and_read(mutated, target)


@given(data=st.data())
def test_random_mutations_of_pickles_and_code(small: bytes, tmp_path_factory, data) -> None:
    mutated = data.draw(cst.overwritten_bytes(small, _pickle_ranges(small)))
    open_and_read(mutated, tmp_path_factory.mktemp("mut") / "m.pt")
