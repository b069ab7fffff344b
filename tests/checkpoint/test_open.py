"""``ckptlab.open``: every tensor kind torch.save writes, read back bit for bit without its pickle.

For each tensor ``ck.read(name)`` is compared with what ``torch.load(weights_only=False)`` gives
for the same path: same type, dtype, shape, stride, layout and values (quantized tensors by
their integer representation and quantizer, nested ones component by component). Every part's
bytes are the part's tensor bytes, and segments tile every file.
"""

from __future__ import annotations

import collections
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import ckptlab as cl
from ckptlab.checkpoint.model import Checkpoint
from ckptlab.errors import ArchiveError, CkptlabError, UnsupportedFormatError
from ckptlab.testing import strategies as cst

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def lookup(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key] if not hasattr(obj, "__dict__") or isinstance(obj, (dict, list, tuple)) \
            else getattr(obj, key)
    return obj


def same(want: torch.Tensor, got: torch.Tensor) -> None:
    assert type(got) is type(want) or (want.is_nested and got.is_nested), (type(want), type(got))
    assert got.dtype == want.dtype and got.layout == want.layout
    if want.is_nested:
        for a, b in zip(want.unbind(), got.unbind(), strict=True):
            same(a, b)
        return
    assert got.shape == want.shape
    if want.is_quantized:
        assert got.qscheme() == want.qscheme()
        assert torch.equal(got.int_repr(), want.int_repr())
        if want.qscheme() == torch.per_tensor_affine:
            assert (got.q_scale(), got.q_zero_point()) == (want.q_scale(), want.q_zero_point())
        else:
            assert torch.equal(got.q_per_channel_scales(), want.q_per_channel_scales())
            assert torch.equal(got.q_per_channel_zero_points(), want.q_per_channel_zero_points())
        return
    if want.layout != torch.strided:
        if want.layout == torch.sparse_coo:
            assert got.is_coalesced() == want.is_coalesced()
            assert torch.equal(got._indices(), want._indices())
            assert torch.equal(got._values(), want._values())
        else:
            assert torch.equal(got.values(), want.values())
        return
    assert got.stride() == want.stride() and got.requires_grad == want.requires_grad
    assert raw_bytes(got) == raw_bytes(want)  # bit for bit (NaNs, -0.0, every dtype)


def check_tiling(ck: Checkpoint) -> None:
    for f in ck.files:
        cursor = 0
        for s in f.segments:
            assert s.offset == cursor and s.nbytes > 0, (f.path, s)
            cursor = s.end_offset
        assert cursor == f.nbytes, (f.path, cursor, f.nbytes)


def raw_bytes(t: torch.Tensor) -> bytes:
    if t.is_quantized:
        t = t.int_repr()
    if t.numel() == 0:
        return b""
    dense = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t.detach())
    return bytes(dense.detach().reshape(-1).view(torch.uint8).numpy())


def components(want: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors torch stores for ``want``, by ckptlab's part roles."""
    if want.is_quantized:
        out = {"data": want}
        if want.qscheme() != torch.per_tensor_affine:
            out.update(scales=want.q_per_channel_scales(),
                       zero_points=want.q_per_channel_zero_points())
        return out
    if want.layout == torch.sparse_coo:
        return {"indices": want._indices(), "values": want._values()}
    if want.layout in (torch.sparse_csr, torch.sparse_bsr):
        return {"crow_indices": want.crow_indices(), "col_indices": want.col_indices(),
                "values": want.values()}
    if want.layout in (torch.sparse_csc, torch.sparse_bsc):
        return {"ccol_indices": want.ccol_indices(), "row_indices": want.row_indices(),
                "values": want.values()}
    if want.is_nested or type(want) not in (torch.Tensor, torch.nn.Parameter):
        return {}
    return {"data": want}


def check_parts(ck: Checkpoint, loaded: Any) -> None:
    """Every contiguous part's bytes in the file are the bytes of the tensor torch loads."""
    for entry in ck.tensors.values():
        want = components(lookup(loaded, entry.path))
        for part in entry.parts:
            if part.role not in want or not part.contiguous:
                continue
            with open(ck.file(part.file).full_path, "rb") as f:
                f.seek(part.offset)
                raw = f.read(part.nbytes)
            assert raw == raw_bytes(want[part.role]), (entry.name, part.role)


def check_all(ck: Checkpoint, loaded: Any) -> None:
    check_tiling(ck)
    check_parts(ck, loaded)
    for name, entry in ck.tensors.items():
        want = lookup(loaded, entry.path)
        if type(want).__name__ == "TwoTensor":
            with pytest.raises(UnsupportedFormatError, match="never imports a class"):
                ck.read(name)
            assert {p.role for p in entry.parts} == {"a", "b"}
            continue
        same(want, ck.read(name))


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from torch.testing._internal.two_tensor import TwoTensor

    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    coo = torch.sparse_coo_tensor(i, torch.tensor([3.0, 4.0, 5.0]), (2, 3))
    dd: collections.defaultdict[str, Any] = collections.defaultdict(list)
    dd["k"] = torch.ones(2)
    base = torch.arange(24.0).reshape(4, 6)
    obj = {
        "coo": coo, "coo_coalesced": coo.coalesce(), "csr": coo.to_sparse_csr(),
        "csc": coo.to_sparse_csc(), "bsr": torch.eye(4).to_sparse_bsr((2, 2)),
        "bsc": torch.eye(4).to_sparse_bsc((2, 2)),
        "q": torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 10, torch.quint8),
        "qc": torch.quantize_per_channel(torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]),
                                         torch.tensor([1, 2, 3]), 0, torch.qint8),
        "nested": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
        "jagged": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)],
                                             layout=torch.jagged),
        "two": TwoTensor(torch.randn(3), torch.randn(3)), "dd": dd,
        "view": base[1:3, ::2], "t": base.t(), "param": torch.nn.Parameter(torch.randn(2)),
        "bf16": torch.randn(3).bfloat16(), "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 3), "scalar": torch.tensor(7),
        "step": 5, "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam"},
    }
    path = tmp_path_factory.mktemp("kinds") / "kinds.pt"
    torch.save(obj, path)
    return path, obj


def test_every_tensor_kind_reads_back_exactly(every_kind) -> None:
    path, _ = every_kind
    ck = cl.open(path)
    assert ck.format == "torch-zip" and ck.files[0].path == "kinds.pt"
    loaded = torch.load(path, weights_only=False)
    kinds = {name: e.kind for name, e in ck.tensors.items()}
    assert kinds["coo"] == kinds["csr"] == kinds["bsc"] == "sparse"
    assert kinds["q"] == kinds["qc"] == "quantized"
    assert kinds["nested"] == kinds["jagged"] == "nested" and kinds["two"] == "subclass"
    assert "dd.k" in kinds and not any("args[" in n for n in kinds)
    assert ck.objects == {"step": 5, "cfg": {"lr": 0.1, "betas": [0.9, 0.99], "name": "adam"}}
    assert ck.tensors["coo"].layout == "sparse_coo"
    assert [p.role for p in ck.tensors["qc"].parts] == ["data", "scales", "zero_points"]
    check_all(ck, loaded)


def test_reads_into_a_scratch_give_the_same_tensors(every_kind, tmp_path: Path) -> None:
    """Read one after another into one Scratch (memory reused, a tensor's parts in distinct
    buffers), every kind is what torch.load gives; the memory is the scratch's, not new."""
    from ckptlab.checkpoint import Scratch

    path, _ = every_kind
    ck = cl.open(path)
    loaded = torch.load(path, weights_only=False)
    scratch = Scratch()
    for name, entry in ck.tensors.items():
        if entry.kind == "subclass":
            continue
        same(lookup(loaded, entry.path), ck.read(name, scratch=scratch))
    torch.manual_seed(0)
    save_file({"a": torch.randn(1000), "b": torch.randn(10)}, str(tmp_path / "w.safetensors"))
    st_ck = cl.open(tmp_path / "w.safetensors")
    first = st_ck.read("a", scratch=scratch)
    address = first.data_ptr()
    assert torch.equal(first, load_file(str(tmp_path / "w.safetensors"))["a"])
    del first
    second = st_ck.read("b", scratch=scratch)  # into the buffer "a" was read into
    assert second.data_ptr() == address
    assert torch.equal(second, load_file(str(tmp_path / "w.safetensors"))["b"])


def test_json_has_files_and_tensor_fields(every_kind) -> None:
    path, _ = every_kind
    data = json.loads(json.dumps(cl.open(path).to_dict()))
    assert data["files"] == [{"path": "kinds.pt", "format": "torch-zip",
                              "nbytes": path.stat().st_size}]
    for t in data["tensors"]:
        assert {"name", "path", "dtype", "shape", "stride", "kind", "nbytes", "parts"} <= set(t)
        for p in t["parts"]:
            assert {"role", "file", "offset", "nbytes"} <= set(p)


def test_file_object_is_read_from_its_position(tmp_path: Path) -> None:
    buf = io.BytesIO(b"JUNK" * 10)
    buf.seek(40)
    torch.save({"a": torch.arange(3.0)}, buf)
    buf.seek(40)
    ck = cl.open(buf)
    assert list(ck.tensors) == ["a"] and ck.tensors["a"].shape == (3,)
    with pytest.raises(UnsupportedFormatError, match="needs a path"):
        ck.read("a")


def test_safetensors_file_and_metadata(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16),
               "s": torch.tensor(1.5), "e": torch.empty(0, 2)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    ck = cl.open(tmp_path / "m.safetensors")
    assert ck.format == "safetensors" and ck.objects == {"__metadata__": {"format": "pt"}}
    check_all(ck, load_file(tmp_path / "m.safetensors"))


def test_dcp_directory_assembles_tensors_and_values(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.randn(4, 3), "opt": {"step": 3, "lr": 0.1},
          "b": torch.arange(6, dtype=torch.bfloat16)}
    dcp.save(sd, checkpoint_id=tmp_path / "ck")
    ck = cl.open(tmp_path / "ck")
    assert ck.format == "dcp" and set(ck.tensors) == {"w", "b"}
    assert ck.objects == {"opt.step": 3, "opt.lr": 0.1}
    assert ck.tensors["w"].path == ("w",) and ck.tensors["w"].parts[0].chunk_offsets == (0, 0)
    check_tiling(ck)
    for name in ("w", "b"):
        assert torch.equal(ck.read(name), sd[name]) and ck.read(name).dtype == sd[name].dtype


def test_hf_style_directory_with_index_and_extra_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    root = tmp_path / "hf"
    root.mkdir()
    a, b = torch.randn(2, 2), torch.randn(3)
    save_file({"a.w": a}, root / "model-00001-of-00002.safetensors")
    save_file({"b.w": b}, root / "model-00002-of-00002.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 28}, "weight_map": {
            "a.w": "model-00001-of-00002.safetensors",
            "b.w": "model-00002-of-00002.safetensors"}}))
    torch.save({"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]},
               root / "optimizer.pt")
    (root / "config.json").write_text('{"model_type": "x"}')
    ck = cl.open(root)
    assert ck.format == "hf"
    assert list(ck.tensors) == ["a.w", "b.w", "optimizer.pt.state.0.exp_avg"]
    assert {f.path for f in ck.files} == {"config.json", "model.safetensors.index.json",
                                          "model-00001-of-00002.safetensors",
                                          "model-00002-of-00002.safetensors", "optimizer.pt"}
    assert ck.objects["config.json"] == {"model_type": "x"}
    assert torch.equal(ck.read("a.w"), a) and torch.equal(ck.read("b.w"), b)
    assert torch.equal(ck.read("optimizer.pt.state.0.exp_avg"), torch.ones(2))
    check_tiling(ck)


def test_refusals_name_what_the_file_is(tmp_path: Path) -> None:
    import gzip

    (tmp_path / "x.gz").write_bytes(gzip.compress(b"hello"))
    (tmp_path / "empty").mkdir()
    for target, pattern in ((tmp_path / "x.gz", "not a checkpoint"),
                            (tmp_path / "empty", "without checkpoint files"),
                            (tmp_path / "missing.pt", "no such file")):
        with pytest.raises(ArchiveError, match=pattern):
            cl.open(target)


@settings(max_examples=25)
@given(obj=cst.state_dicts(max_leaves=6), protocol=st.sampled_from([2, 3, 4, 5]))
def test_random_state_dicts_read_back(tmp_path_factory, obj: Any, protocol: int) -> None:
    path = tmp_path_factory.mktemp("prop") / "obj.pt"
    torch.save(obj, path, pickle_protocol=protocol)
    ck = cl.open(path)
    loaded = torch.load(path, weights_only=False)
    want = list(cst.iter_tensors(loaded))
    assert len(ck.tensors) == len(want)
    for (wpath, wtensor), entry in zip(want, ck.tensors.values(), strict=True):
        assert entry.path == wpath
        try:
            same(wtensor, ck.read(entry.name))
        except CkptlabError as exc:  # pragma: no cover - reported with the case
            raise AssertionError(f"{entry.name}: {exc}") from exc


def test_safetensors_every_dtype_it_writes(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    raw = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    names = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
             "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
             "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex64", "uint16",
             "uint32", "uint64")
    dtypes = [getattr(torch, n) for n in names if hasattr(torch, n)]  # older torch: fewer
    tensors = {str(dtype).removeprefix("torch."): raw.clone().view(dtype) if dtype.itemsize == 1 else
               torch.arange(12).reshape(3, 4).to(dtype) for dtype in dtypes}
    tensors["bool"] = torch.arange(12).reshape(3, 4) % 3 == 0
    tensors["zero_d"] = torch.tensor(2.5)
    tensors["empty"] = torch.empty(0, 5)
    save_file(tensors, tmp_path / "all.safetensors")
    ck = cl.open(tmp_path / "all.safetensors")
    with safe_open(tmp_path / "all.safetensors", "pt") as f:
        assert set(f.keys()) == set(ck.tensors)
        for name in f.keys():
            want = f.get_tensor(name)
            entry = ck.tensors[name]
            assert entry.dtype == str(want.dtype).removeprefix("torch.")
            assert entry.shape == tuple(want.shape), name
            same(want, ck.read(name))
    check_tiling(ck)


def test_alignment_65536_that_torch_reads_opens(tmp_path: Path) -> None:
    from torch.utils.serialization import config

    obj = {"a": torch.arange(5.0), "b": torch.ones(3, dtype=torch.int64)}
    with config.patch({"save.storage_alignment": 65536}):
        torch.save(obj, tmp_path / "big.pt")
    loaded = torch.load(tmp_path / "big.pt", weights_only=True)  # torch reads it
    assert all(torch.equal(loaded[k], obj[k]) for k in obj)
    layout = cl.inspect(tmp_path / "big.pt")
    assert layout.storage_alignment == 65536
    assert cl.storage_offsets(tmp_path / "big.pt").offsets == {
        s.key: s.data_offset for s in layout.storages}
    ck = cl.open(tmp_path / "big.pt")
    check_all(ck, loaded)


def test_inspect_and_offsets_of_a_file_object_count_from_its_position() -> None:
    plain = io.BytesIO()
    torch.save({"a": torch.arange(3.0)}, plain)
    buf = io.BytesIO(b"JUNK" * 10)
    buf.seek(40)
    torch.save({"a": torch.arange(3.0)}, buf)
    buf.seek(40)
    layout = cl.inspect(buf)
    assert layout.file_nbytes == len(plain.getvalue())
    assert layout.storages == cl.inspect(io.BytesIO(plain.getvalue())).storages
    buf.seek(40)
    assert cl.storage_offsets(buf).offsets == {s.key: s.data_offset for s in layout.storages}
    buf.seek(40)
    assert torch.equal(torch.load(buf)["a"], torch.arange(3.0))  # torch reads from there too


def test_module_state_dict_with_its_metadata(tmp_path: Path) -> None:
    """``state_dict()`` is an OrderedDict whose ``_metadata`` torch pickles with BUILD."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    ck = cl.open(tmp_path / "sd.pt")
    assert list(ck.tensors) == list(model.state_dict())
    check_all(ck, torch.load(tmp_path / "sd.pt", weights_only=True))


def test_torch_functions_called_wrongly_and_int_grads_are_ckptlab_errors(tmp_path: Path) -> None:
    from ckptlab.errors import CorruptArchiveError
    from ckptlab.testing.pickles import torch_zip

    with pytest.raises(CorruptArchiveError, match="arguments it does not take"):
        cl.open(torch_zip(b"\x80\x02ccollections\nOrderedDict\n(K\x01K\x02tR."))
    storage = (b"(X\x07\x00\x00\x00storagectorch\nLongStorage\nX\x01\x00\x00\x000"
               b"X\x03\x00\x00\x00cpuK\x02tQ")
    pkl = (b"\x80\x02}X\x01\x00\x00\x00pctorch._utils\n_rebuild_parameter\n("
           b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage +
           b"K\x00K\x02\x85K\x01\x85\x88ccollections\nOrderedDict\n)RtR\x88"
           b"ccollections\nOrderedDict\n)RtRs.")
    buf = io.BytesIO()
    torch.save({"p": torch.zeros(2, dtype=torch.int64)}, buf)
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in src.namelist():
            z.writestr(name, pkl if name.endswith("data.pkl") else src.read(name))
    (tmp_path / "intgrad.pt").write_bytes(out.getvalue())
    ck = cl.open(tmp_path / "intgrad.pt")
    assert ck.tensors["p"].requires_grad and ck.tensors["p"].dtype == "int64"
    with pytest.raises(CorruptArchiveError, match="requires grad"):
        ck.read("p")


def test_tied_weights_are_counted_once(tmp_path) -> None:
    """A weight saved under two names (one storage: ``lm_head.weight`` is ``wte.weight``) is
    one tensor's bytes: ``tied`` names it, and the parameter and byte totals of the
    checkpoint, the table, the dtype lines and the CLI count it once (as
    ``model.num_parameters()`` does), while a view of another part of the storage is not
    tied."""
    import torch

    from ckptlab.cli import main
    from ckptlab.viz.checkpoint import dtype_totals, tensor_table

    w = torch.randn(10, 4)
    path = tmp_path / "tied.pt"
    torch.save({"wte.weight": w, "lm_head.weight": w, "half": w[5:], "b": torch.zeros(3)},
               path)
    ck = cl.open(path)
    assert ck.tied() == {"lm_head.weight": "wte.weight"}
    assert ck.parameters == 40 + 20 + 3 and ck.tensor_nbytes == 4 * (40 + 20 + 3)
    table = tensor_table(ck)
    assert table.total_parameters == ck.parameters and table.total_nbytes == ck.tensor_nbytes
    (total,) = dtype_totals(ck)
    assert (total.tensors, total.parameters) == (4, 63)
    assert main(["inspect", str(path)]) == 0
    # the served workbench's index (also read back from its disk cache) says the same
    from ckptlab.checkpoint._cache import CheckpointIndex
    from ckptlab.widgets._tensor_table import index_summary_html

    index = CheckpointIndex.from_checkpoint(ck)
    assert (index.total_parameters, index.tensor_nbytes) == (ck.parameters, ck.tensor_nbytes)
    assert index.totals_by_dtype() == {"float32": (4, 63, 4 * 63)}
    assert "1 tied tensor (another's bytes, e.g. lm_head.weight) counted once" in \
        index_summary_html(index)


def test_tied_line_in_the_cli(tmp_path, capsys) -> None:
    import torch

    from ckptlab.cli import main

    w = torch.randn(3)
    torch.save({"a": w, "b": w}, tmp_path / "t.pt")
    assert main(["inspect", str(tmp_path / "t.pt")]) == 0
    out = capsys.readouterr().out
    assert "3 parameters" in out and "tied: 1 tensor stored as another's bytes (b = a)" in out
