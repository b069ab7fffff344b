"""torch.export archives (``torch.export.save``, ``.pt2``) through ``ckptlab.open``.

Names are the FQNs of ``torch.export.load(f).state_dict`` and ``.constants`` (order included);
``ck.read`` gives the same type (Parameter or Tensor), dtype, shape, stride, requires_grad and
values, for tied weights, views of one buffer at an offset, float8 and bfloat16 weights, frozen
parameters, non-persistent buffers and tensor constants. Every part points at the raw bytes of
its ``data/weights/weight_<i>`` record. A tensor-subclass weight (pickled inside the archive) is
found without running its pickle. Several models in one archive are prefixed by model name.
Truncation and damaged JSON give ckptlab errors only.
"""

from __future__ import annotations

import dataclasses
import io
import json
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
from ckptlab.errors import (
    ArchiveError,
    CorruptArchiveError,
    UnsupportedFormatError,
)
from ckptlab.testing import strategies as cst
from ckptlab.testing.damage import assert_tiles, bit_flips, open_and_read, truncations

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied: one record, two names
        self.bn = torch.nn.BatchNorm1d(4)
        base = torch.arange(24.0).reshape(4, 6)
        self.register_buffer("base", base)
        self.register_buffer("view", base[:, 1::2])  # a strided view at an offset
        self.register_buffer("f8", torch.randn(4).to(torch.float8_e4m3fn))
        self.register_buffer("scratch", torch.arange(3.0), persistent=False)  # a constant
        self.hp = torch.nn.Parameter(torch.randn(4).bfloat16(), requires_grad=False)
        self.c = torch.tensor([1.0, 2.0])  # a tensor attribute: a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.b(self.a(x)))
        return y + self.view.sum() + self.base.sum() + self.f8.float().sum() + \
            self.scratch.sum() + self.hp.float().sum() + self.c.sum()


def export_save(module: torch.nn.Module, path: Path, *args: torch.Tensor) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(module, args), path)
    with zipfile.ZipFile(path) as z:
        if not any(n.endswith("archive_format") for n in z.namelist()):
            pytest.skip(f"torch {torch.__version__} writes the earlier .pt2 layout (inner "
                        "torch.save archives): that layout is tested on torch 2.7.0's own "
                        "files (test_torch27_*)")
    return path


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_save(Net(), tmp_path_factory.mktemp("pt2") / "net.pt2", torch.randn(2, 4))


def raw_bytes(t: torch.Tensor) -> bytes:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return bytes(dense.reshape(-1).view(torch.uint8).numpy())


def check_tiling(ck: Checkpoint) -> None:
    for f in ck.files:
        assert_tiles(f.segments, f.nbytes, f.path)


def same(want: torch.Tensor, got: torch.Tensor) -> None:
    assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride() and got.requires_grad == want.requires_grad
    assert raw_bytes(got) == raw_bytes(want)


def test_weights_and_constants_by_fqn(net: Path) -> None:
    ck = cl.open(net)
    ep = torch.export.load(net)
    assert ck.format == "pt2" and ck.files[0].format == "pt2"
    assert list(ck.tensors) == [*ep.state_dict, *ep.constants]
    assert set(ep.constants) == {"c", "scratch"}
    data = net.read_bytes()
    for source in (ep.state_dict, ep.constants):
        for name, want in source.items():
            same(want, ck.read(name))
            (part,) = ck.tensors[name].parts
            if part.contiguous:
                assert data[part.offset:part.offset + part.nbytes] == raw_bytes(want)
    slots = {n: dict(e.extra)["slot"] for n, e in ck.tensors.items()}
    assert slots["a.weight"] == slots["hp"] == "parameter"
    assert slots["bn.running_mean"] == "buffer" and slots["c"] == "constant"
    assert ck.tensors["a.weight"].parts == ck.tensors["b.weight"].parts  # tied
    base, view = ck.tensors["base"].parts[0], ck.tensors["view"].parts[0]
    assert view.storage_key == base.storage_key  # one record, two views
    assert view.offset == base.offset + 4 and view.stride == (6, 2)
    check_tiling(ck)
    # parts point at the weight records the JSON config names
    with zipfile.ZipFile(net) as z:
        config = json.loads(z.read("net/data/weights/model_weights_config.json"))["config"]
        infos = {i.filename: i for i in z.infolist()}
    layout = ck.files[0].layout
    for fqn, meta in config.items():
        record = layout.record(f"data/weights/{meta['path_name']}")
        assert infos[record.name].file_size == record.data_nbytes
        part = ck.tensors[fqn].parts[0]
        assert record.data_offset <= part.offset <= record.data_offset + record.data_nbytes


def test_file_objects_and_bytes(net: Path) -> None:
    data = net.read_bytes()
    names = list(cl.open(net).tensors)
    for source in (data, io.BytesIO(data)):
        assert list(cl.open(source).tensors) == names
    with pytest.raises(UnsupportedFormatError):
        cl.inspect(net)  # inspect stays for torch.save archives


def test_subclass_weight_pickled_inside(tmp_path: Path) -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    class Sub(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(TwoTensor(torch.randn(3), torch.randn(3)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.p

    path = export_save(Sub(), tmp_path / "sub.pt2", torch.randn(3))
    ck = cl.open(path)
    want = torch.export.load(path).state_dict["p"]
    entry = ck.tensors["p"]
    assert entry.kind == "subclass" and [p.role for p in entry.parts] == ["a", "b"]
    assert torch.equal(ck.read_part("p", "a"), want.a)
    assert torch.equal(ck.read_part("p", "b"), want.b)
    with pytest.raises(UnsupportedFormatError, match="never imports a class"):
        ck.read("p")
    check_tiling(ck)


def test_several_models_are_prefixed(tmp_path: Path) -> None:
    package = pytest.importorskip("torch.export.pt2_archive._package",
                                  reason=f"torch {torch.__version__} cannot package several "
                                  "programs in one .pt2")
    load_pt2, package_pt2 = package.load_pt2, package.package_pt2

    class Scale(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(float(n)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        programs = {"enc": torch.export.export(Scale(2), (torch.randn(2),)),
                    "dec": torch.export.export(Scale(3), (torch.randn(3),))}
        package_pt2(tmp_path / "multi.pt2", exported_programs=programs)
    ck = cl.open(tmp_path / "multi.pt2")
    assert list(ck.tensors) == ["enc.w", "dec.w"]
    for model, ep in load_pt2(tmp_path / "multi.pt2").exported_programs.items():
        same(ep.state_dict["w"], ck.read(f"{model}.w"))


def test_early_archives_with_a_pickled_state_dict(net: Path, tmp_path: Path) -> None:
    """Before per-weight records, data/weights/<model>.pt held a torch.save of the state dict
    (torch.export.load still reads it): each tensor is found inside it, nothing unpickled."""
    ep = torch.export.load(net)
    blobs = {}
    for what, values in (("weights", ep.state_dict), ("constants", ep.constants)):
        buf = io.BytesIO()
        torch.save(dict(values), buf)
        blobs[f"net/data/{what}/model.pt"] = buf.getvalue()
    path = tmp_path / "early.pt2"
    with zipfile.ZipFile(net) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            if "/data/weights/" not in info.filename and "/data/constants/" not in info.filename:
                zout.writestr(info.filename, zin.read(info.filename))
        for name, blob in blobs.items():
            zout.writestr(name, blob)
    ck = cl.open(path)
    loaded = torch.export.load(path)
    assert list(ck.tensors) == [*loaded.state_dict, *loaded.constants]
    for source in (loaded.state_dict, loaded.constants):
        for name, want in source.items():
            same(want, ck.read(name))
    check_tiling(ck)


# -- damage ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.c = torch.ones(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.c

    path = export_save(Small(), tmp_path_factory.mktemp("pt2") / "small.pt2", torch.randn(2))
    return path.read_bytes()


def rewrite(data: bytes, short: str, edit: Any) -> bytes:
    """The archive with one JSON config edited (rewritten by Python's zipfile)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            raw = zin.read(info.filename)
            if info.filename.endswith("/" + short):
                value = json.loads(raw)
                raw = edit(value) if callable(edit) else edit
                raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
            zout.writestr(info.filename, raw)
    return out.getvalue()


def _meta(value: dict[str, Any], fqn: str = "lin.weight") -> dict[str, Any]:
    return value["config"][fqn]["tensor_meta"]


def _set(fn: Any) -> Any:
    def edit(value: dict[str, Any]) -> dict[str, Any]:
        fn(value)
        return value
    return edit


CONFIG = "data/weights/model_weights_config.json"
BAD_CONFIGS = {
    "not json": b"{not json",
    "no config": {"weights": {}},
    "unknown dtype": _set(lambda v: _meta(v).update(dtype=99)),
    "symbolic size": _set(lambda v: _meta(v).update(sizes=[{"as_expr": {"expr_str": "s0"}},
                                                           {"as_int": 2}])),
    "negative stride": _set(lambda v: _meta(v).update(strides=[{"as_int": -1},
                                                               {"as_int": 1}])),
    "past the record": _set(lambda v: _meta(v).update(storage_offset={"as_int": 3})),
    "sparse layout": _set(lambda v: _meta(v).update(layout=1)),
    "missing record": _set(lambda v: v["config"]["lin.weight"].update(path_name="weight_99")),
    "sizes not a list": _set(lambda v: _meta(v).update(sizes="2x2")),
    "grad on ints": _set(lambda v: _meta(v).update(dtype=4)),  # int32, requires_grad
}


@pytest.mark.parametrize("edit", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS))
def test_bad_configs_are_named_errors(small: bytes, edit: Any) -> None:
    bad = rewrite(small, CONFIG, edit)
    with pytest.raises(ArchiveError) as info:
        cl.open(bad)
    assert isinstance(info.value, (CorruptArchiveError, UnsupportedFormatError))
    assert "weights_config.json" in str(info.value) or "weight" in str(info.value)


def test_rewritten_by_python_zipfile_still_reads(small: bytes) -> None:
    copy = rewrite(small, CONFIG, lambda v: v)
    a, b = cl.open(small), cl.open(copy)
    assert list(a.tensors) == list(b.tensors)
    assert [e.parts[0].nbytes for e in a.tensors.values()] == \
        [e.parts[0].nbytes for e in b.tensors.values()]


def test_truncations_are_archive_errors(small: bytes) -> None:
    for prefix in truncations(small, step=11):
        with pytest.raises(ArchiveError):
            cl.open(prefix)


def test_every_byte_of_the_configs_flipped(small: bytes, tmp_path: Path) -> None:
    layout = cl.open(small).files[0].layout
    target = tmp_path / "flipped.pt2"
    configs = [(r.data_offset, r.data_offset + r.data_nbytes) for r in layout.records
               if r.short_name.endswith("_config.json")]
    assert configs
    for _, mutated in bit_flips(small, configs):
        open_and_read(mutated, target)


@given(data=st.data())
def test_random_mutations(small: bytes, tmp_path_factory, data) -> None:
    mutated = data.draw(cst.overwritten_bytes(small))
    open_and_read(mutated, tmp_path_factory.mktemp("mut") / "m.pt2")


# -- torch 2.7's layout: serialized_*.pt records, each a whole torch.save archive -------------
DATA = Path(__file__).parent / "data"  # written by make_pt2_27.py with torch 2.7.0
LEGACY = ("linear", "const", "tied")
INNER = ("serialized_state_dict.pt", "serialized_constants.pt")


def legacy(name: str) -> Path:
    return DATA / f"pt2_27_{name}.pt2"


def expected(name: str) -> dict[str, Any]:
    """What torch 2.7's torch.export.load gave (our own fixture: weights only)."""
    return torch.load(DATA / f"pt2_27_{name}.expected.pt", weights_only=True)


def rezip(data: bytes, replace: dict[str, bytes | None] | None = None,
          deflate: tuple[str, ...] = ()) -> bytes:
    """The archive rewritten by Python's zipfile (as torch 2.7 writes it): records replaced
    (None drops one), some deflated."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            raw = (replace or {}).get(info.filename, zin.read(info.filename))
            if raw is not None:
                zout.writestr(info.filename, raw, zipfile.ZIP_DEFLATED
                              if info.filename in deflate else zipfile.ZIP_STORED)
    return out.getvalue()


@pytest.mark.parametrize("name", LEGACY)
def test_torch27_archives_by_fqn(name: str) -> None:
    path, want = legacy(name), expected(name)
    ck = cl.open(path)
    assert ck.format == "pt2" and ck.files[0].format == "pt2"
    assert list(ck.tensors) == [*want["state_dict"], *want["constants"]]
    data = path.read_bytes()
    layout = ck.files[0].layout
    with zipfile.ZipFile(path) as z:  # torch 2.13 reading the inner archives whole
        inner = {short: torch.load(io.BytesIO(z.read(short)), weights_only=True)
                 for short in INNER}
    for source, short, slot in ((want["state_dict"], INNER[0], "buffer"),
                                (want["constants"], INNER[1], "constant")):
        record = layout.record(short)
        assert record.method == 0 and set(inner[short]) == set(source)
        for fqn, value in source.items():
            got = ck.read(fqn)
            same(value, got)
            same(inner[short][fqn], got)
            entry = ck.tensors[fqn]
            assert dict(entry.extra)["slot"] == (
                "parameter" if isinstance(value, torch.nn.Parameter) else slot)
            (part,) = entry.parts
            # inside the outer file, inside the record that holds its archive
            assert record.data_offset <= part.offset
            assert part.offset + part.nbytes <= record.data_offset + record.data_nbytes
            assert part.storage_key.startswith(f"{short}:")
            if part.contiguous:
                assert data[part.offset:part.offset + part.nbytes] == raw_bytes(value)
    objects = ck.objects
    assert objects["exported_program.schema_version"] == want["schema_version"]
    assert objects["exported_program.torch_version"] == want["torch_version"]
    assert objects["example_inputs"]["record"] == "serialized_example_inputs.pt"
    assert layout.metadata == {"version": want["schema_version"]}
    check_tiling(ck)
    # each storage's bytes are one data segment of the inner archive, named after it
    data_segments = {(s.offset, s.nbytes): s.record for s in ck.files[0].segments
                     if s.kind.value == "data"}
    for storage in layout.storages:
        assert data_segments[(storage.data_offset, storage.nbytes)] == storage.record


def test_torch27_tied_weights_and_views() -> None:
    ck = cl.open(legacy("tied"))
    assert ck.tensors["a.weight"].parts == ck.tensors["b.weight"].parts
    base, view = ck.tensors["base"].parts[0], ck.tensors["view"].parts[0]
    assert view.storage_key == base.storage_key
    assert view.offset == base.offset + 4 and view.stride == (4, 2)


def test_torch27_bytes_and_file_objects() -> None:
    """The inner archives are scanned through a window onto any source: the same parts."""
    data = legacy("const").read_bytes()
    by_path = cl.open(legacy("const"))
    for source in (data, io.BytesIO(b"x" * 7 + data)):
        if isinstance(source, io.BytesIO):
            source.seek(7)  # a checkpoint starts where the file object stands
        ck = cl.open(source)
        assert list(ck.tensors) == list(by_path.tensors)
        for fqn, entry in ck.tensors.items():
            assert [dataclasses.replace(p, file="") for p in entry.parts] == \
                [dataclasses.replace(p, file="") for p in by_path.tensors[fqn].parts]


def test_torch27_compressed_records(tmp_path: Path) -> None:
    data = legacy("linear").read_bytes()
    for short in INNER:
        with pytest.raises(UnsupportedFormatError, match="compressed") as info:
            cl.open(rezip(data, deflate=(short,)))
        assert info.value.record == short
    # the example inputs and the program are not tensors' bytes: deflated, they still read
    path = tmp_path / "deflated.pt2"
    path.write_bytes(rezip(data, deflate=("serialized_example_inputs.pt",
                                          "serialized_exported_program.json")))
    ck = cl.open(path)
    same(expected("linear")["state_dict"]["l.weight"], ck.read("l.weight"))


def test_torch27_records_in_any_order(tmp_path: Path) -> None:
    """torch 2.7 reads its records by top-level name: an extra file first changes nothing."""
    data = legacy("linear").read_bytes()
    path = tmp_path / "reordered.pt2"
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(path, "w") as zout:
        zout.writestr("extra_files/notes.txt", b"written first")
        for info in reversed(zin.infolist()):
            zout.writestr(info.filename, zin.read(info.filename))
    ck = cl.open(path)
    want = expected("linear")["state_dict"]
    assert list(ck.tensors) == list(want)
    for fqn, value in want.items():
        same(value, ck.read(fqn))
    check_tiling(ck)


def test_torch27_empty_constants_and_missing_records() -> None:
    data = legacy("const").read_bytes()
    ck = cl.open(rezip(data, {"serialized_constants.pt": b""}))  # torch writes None so
    assert list(ck.tensors) == ["w", "hp", "steps"]
    with pytest.raises(CorruptArchiveError, match="version"):
        cl.open(rezip(data, {"version": None}))
    with pytest.raises(CorruptArchiveError, match="JSON"):
        cl.open(rezip(data, {"serialized_exported_program.json": b"{not json"}))
    with pytest.raises(CorruptArchiveError, match=r"torch\.save archive") as info:
        cl.open(rezip(data, {"serialized_state_dict.pt": b"PK\x03\x04 not a zip"}))
    assert info.value.record == "serialized_state_dict.pt"


def test_torch27_truncations_are_archive_errors(tmp_path: Path) -> None:
    data = legacy("linear").read_bytes()
    for prefix in truncations(data, step=13):
        with pytest.raises(ArchiveError):
            cl.open(prefix)
    # the inner archive cut short, inside a well-formed outer zip
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        inner = z.read(INNER[0])
    for prefix in truncations(inner, step=17):
        if prefix:  # no bytes at all is how torch writes None: an empty state dict
            with pytest.raises(ArchiveError) as info:
                cl.open(rezip(data, {INNER[0]: prefix}))
            assert info.value.record == INNER[0]


def test_torch27_inner_archive_flipped(tmp_path: Path) -> None:
    """Bits of the inner archive's zip structure and pickle (every third byte, so every bit
    position) and of the outer records around it: ckptlab errors, or tensors that read."""
    data = legacy("linear").read_bytes()
    ck = cl.open(data)
    tensor_bytes = {(p.offset, p.offset + p.nbytes) for e in ck.tensors.values()
                    for p in e.parts}
    spans = [(s.offset, s.end_offset) for s in ck.files[0].segments
             if (s.record or "").startswith((INNER[0], "version")) and
             s.kind.value != "padding" and (s.offset, s.end_offset) not in tensor_bytes]
    indices = sorted({i for a, b in spans for i in range(a, b)})[::3]
    assert len(indices) > 400
    for _, mutated in bit_flips(data, [(i, i + 1) for i in indices]):
        open_and_read(mutated, tmp_path / "flipped.pt2")


@given(data=st.data())
def test_torch27_random_mutations(tmp_path_factory: pytest.TempPathFactory,
                                  data: st.DataObject) -> None:
    original = legacy("tied").read_bytes()
    mutated = data.draw(cst.overwritten_bytes(original))
    open_and_read(mutated, tmp_path_factory.mktemp("mut27") / "m.pt2")
