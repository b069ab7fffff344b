"""``ckptlab.convert``: every format ckptlab opens, rewritten as safetensors and torch.save,
held bit for bit to the library's own load of the source and of the result; tied weights,
values carried or dropped, GDS-ready alignment, atomic replacement under kill -9, and the
source's pickle never run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptlab
from ckptlab.cli import main
from ckptlab.testing.payloads import Reduce


def _flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Name -> tensor of a loaded object, keys joined with '.' (ckptlab's names)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def _load_result(path: Path, to: str) -> dict[str, torch.Tensor]:
    """The converted checkpoint, as the target's own library loads it."""
    if to == "torch":
        return _flat(torch.load(path, weights_only=True))
    if path.is_dir():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            out.update(load_file(path / shard))
        assert set(out) == set(index["weight_map"])
        return out
    return load_file(path)


# -- sources, each with its library's own load -----------------------------------------------
def _torch_zip(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {"a": torch.randn(4, 3), "b": torch.arange(6, dtype=torch.int64),
          "h": torch.randn(5).to(torch.bfloat16), "m": torch.tensor([True, False])}
    path = root / "zip.pt"
    torch.save(sd, path)
    return path, _flat(torch.load(path, weights_only=True))


def _legacy(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {"layer": {"w": torch.randn(3, 2), "b": torch.zeros(2)}}
    path = root / "legacy.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    return path, _flat(torch.load(path, weights_only=True))


def _torchscript(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = root / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), path)
    return path, dict(torch.jit.load(path).state_dict())


def _pt2(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = root / "net.pt2"
    torch.export.save(torch.export.export(torch.nn.Linear(4, 3), (torch.randn(2, 4),)), path)
    return path, dict(torch.export.load(path).state_dict)


def _safetensors(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = root / "w.safetensors"
    save_file({"x": torch.randn(2, 2), "y": torch.ones(3, dtype=torch.float16)}, path)
    return path, load_file(path)


def _hf(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32,
                                     n_positions=16)
    out = root / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(out, max_shard_size="4KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    want: dict[str, torch.Tensor] = {}
    for shard in set(index["weight_map"].values()):
        want.update(load_file(out / shard))
    return out, want


def _dcp(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    out = root / "dcp"
    dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    loaded = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(loaded, checkpoint_id=str(out), no_dist=True)
    return out, loaded


SOURCES = {"zip": _torch_zip, "legacy": _legacy, "torchscript": _torchscript, "pt2": _pt2,
           "safetensors": _safetensors, "hf": _hf, "dcp": _dcp}


@pytest.mark.parametrize("to", ["safetensors", "torch"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_round_trip_is_bit_exact(tmp_path: Path, source: str, to: str) -> None:
    src, want = SOURCES[source](tmp_path)
    dst = tmp_path / ("out.safetensors" if to == "safetensors" else "out.pt")
    result = ckptlab.convert(src, dst, to=to)
    assert result.verified
    got = _load_result(dst, to)
    for name, tensor in want.items():
        if name in result.aliases:
            name = result.aliases[name]
        assert name in got, (name, sorted(got))
        assert _same_bits(got[name], tensor), name


def test_sharded_safetensors_load_with_from_pretrained(tmp_path: Path) -> None:
    import transformers

    src, _ = _hf(tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(src)
    dst = tmp_path / "resharded"
    result = ckptlab.convert(src, dst, shard_size=1500)
    assert len([f for f in result.files if f.endswith(".safetensors")]) > 1
    (dst / "config.json").write_text((src / "config.json").read_text())
    again = transformers.GPT2LMHeadModel.from_pretrained(dst)
    for name, tensor in model.state_dict().items():
        assert _same_bits(again.state_dict()[name], tensor), name


def test_tied_weights_are_written_once_and_values_carried_or_dropped(tmp_path: Path) -> None:
    import argparse

    lin = torch.nn.Linear(3, 3)
    src = tmp_path / "train.pt"
    torch.save({"model": lin.state_dict(), "tied": lin.weight, "view": lin.weight[1:],
                "step": 7, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}, "blob": b"\x00\x01",
                "args": argparse.Namespace(a=1)}, src)
    st = ckptlab.convert(src, tmp_path / "out.safetensors")
    assert st.aliases == {"tied": "model.weight"}
    assert st.dropped["args"].startswith("built from argparse.Namespace")
    assert "bytes" in st.dropped["blob"]  # JSON has no bytes
    from safetensors import safe_open

    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        meta = f.metadata()
        assert json.loads(meta["step"]) == 7 and json.loads(meta["cfg"])["betas"] == [0.9, 0.99]
        assert _same_bits(f.get_tensor("view"), lin.weight[1:].detach())
    pt = ckptlab.convert(src, tmp_path / "out.pt", to="torch")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded["tied"] is loaded["model"]["weight"]
    # a view keeps sharing its storage, as in the source
    assert loaded["view"].untyped_storage().data_ptr() == \
        loaded["model"]["weight"].untyped_storage().data_ptr()
    assert loaded["step"] == 7 and loaded["cfg"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    assert loaded["blob"] == b"\x00\x01" and "args" not in loaded
    assert "args" in pt.dropped


def test_alignment_4096_is_gds_ready(tmp_path: Path, capsys) -> None:
    src, _ = _torch_zip(tmp_path)
    dst = tmp_path / "aligned.pt"
    assert main(["convert", str(src), str(dst), "--to", "torch", "--alignment", "4096"]) == 0
    capsys.readouterr()
    layout = ckptlab.inspect(dst)
    assert layout.storage_alignment == 4096
    assert all(s.data_offset % 4096 == 0 for s in layout.storages)
    main(["readiness", str(dst)])
    assert "READY" in capsys.readouterr().out


def test_the_source_pickle_never_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / "ran"
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Reduce(os.system, (f"touch {sentinel}",))}, src)
    result = ckptlab.convert(src, tmp_path / "safe.pt", to="torch")
    assert not sentinel.exists()
    assert "x" in result.dropped and result.tensors == ["w"]
    assert ckptlab.scan(tmp_path / "safe.pt").verdict == "weights-only"


def test_cli_json_and_errors(tmp_path: Path, capsys) -> None:
    src, _ = _torch_zip(tmp_path)
    assert main(["convert", str(src), str(tmp_path / "o.safetensors"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] is True and doc["tensors"] == 4 and doc["to"] == "safetensors"
    assert main(["convert", str(src), str(tmp_path / "x.st"), "--shard-size", "5XB"]) == 2
    assert main(["convert", str(src), str(tmp_path / "no" / "x.st")]) == 2
    assert main(["convert", str(src), str(tmp_path / "x.pt"), "--alignment", "3"]) == 2
    assert "--shard-size" in capsys.readouterr().err


# -- kill -9 ---------------------------------------------------------------------------------
_KILLED = """
import sys, ckptlab
ckptlab.convert(sys.argv[1], sys.argv[2], to=sys.argv[3])
"""


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_kill_at_any_moment_leaves_the_old_file_or_a_whole_new_one(tmp_path: Path,
                                                                   to: str) -> None:
    src = tmp_path / "big.pt"
    torch.save({f"t{i}": torch.full((1 << 20,), float(i)) for i in range(24)}, src)  # 96 MiB
    dst = tmp_path / ("dst.safetensors" if to == "safetensors" else "dst.pt")
    old = b"the old file"
    outcomes = set()
    for delay in (0.05, 0.3, 0.6, 0.9, 1.2, 1.6, 2.0, 2.5, 3.0, 4.0):
        dst.write_bytes(old)
        proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(src), str(dst), to])
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        data = dst.read_bytes() if dst.exists() else None
        if data == old:
            outcomes.add("old")
            continue
        assert data is not None  # a file replaces a file in one rename
        got = _load_result(dst, to)  # whole: every tensor there, with its values
        assert sorted(got) == sorted(f"t{i}" for i in range(24))
        assert all(bool((got[f"t{i}"] == i).all()) for i in range(24))
        outcomes.add("new")
    assert outcomes  # (which ones depends on the machine's speed)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst")]
    assert len(leftovers) <= 10  # temporary directories of killed runs, never at dst


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_convert_of_a_url(tmp_path: Path, to: str) -> None:
    from ckptlab.testing.nginx import NGINX_MISSING, NginxServer, nginx_executable

    if nginx_executable() is None:
        if os.environ.get("CI"):
            pytest.fail(NGINX_MISSING)
        pytest.skip(NGINX_MISSING)
    served = tmp_path / "served"
    served.mkdir()
    src, want = _torch_zip(served)
    dst = tmp_path / ("out.safetensors" if to == "safetensors" else "out.pt")
    with NginxServer(served) as server:
        result = ckptlab.convert(server.url(src.name), dst, to=to)
    assert result.verified
    got = _load_result(dst, to)
    assert all(_same_bits(got[n], t) for n, t in want.items())


# -- sparse, quantized and nested tensors --------------------------------------------------
def _odd(root: Path, *, quantized: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """A torch.save file of sparse (COO, CSR, BSR), nested and, with ``quantized``,
    quantized tensors beside dense ones and a view."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's beta / prototype / deprecation notes)
        base = torch.arange(12.0)
        obj = {"dense": base, "view": base[2:8].reshape(2, 3),
               "coo": torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]),
                                              torch.tensor([3.0, 4.0, 5.0]), (2, 3)),
               "csr": torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse_csr(),
               "bsr": torch.eye(4).to_sparse_bsr((2, 2))}
        if quantized:
            obj["q"] = torch.quantize_per_tensor(torch.tensor([-1.0, 0.0, 1.5]), 0.1, 10,
                                                 torch.quint8)
            obj["qc"] = torch.quantize_per_channel(
                torch.arange(6.0).reshape(2, 3) - 2, torch.tensor([0.1, 0.2]),
                torch.tensor([0, 1]), 0, torch.qint8)
            obj["nested"] = torch.nested.nested_tensor([torch.arange(3.0), torch.ones(5)])
    path = root / ("odd_q.pt" if quantized else "odd.pt")
    torch.save(obj, path)
    return path, obj


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor as torch sees it: layout, dtype, shape and every stored value (the
    indices of a sparse one, the integers and parameters of a quantized one)."""
    if a.layout != b.layout or a.dtype != b.dtype or a.is_nested != b.is_nested:
        return False
    if a.is_nested:
        return all(_same_bits(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
    if a.is_quantized:
        same_q = (a.qscheme() == b.qscheme() and _same_bits(a.int_repr(), b.int_repr()))
        if a.qscheme() == torch.per_tensor_affine:
            return same_q and (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point())
        return (same_q and torch.equal(a.q_per_channel_scales(), b.q_per_channel_scales())
                and torch.equal(a.q_per_channel_zero_points(), b.q_per_channel_zero_points()))
    if a.layout == torch.sparse_coo:
        return (_same_bits(a._indices(), b._indices()) and _same_bits(a._values(), b._values())
                and a.shape == b.shape)
    if a.layout != torch.strided:
        return a.shape == b.shape and _same_bits(a.to_dense(), b.to_dense())
    return _same_bits(a, b)


@pytest.mark.parametrize("quantized", [False, True])
def test_sparse_quantized_and_nested_tensors_stay_as_they_are_in_torch(
        tmp_path: Path, quantized: bool) -> None:
    src, obj = _odd(tmp_path, quantized=quantized)
    dst = tmp_path / "out.pt"
    result = ckptlab.convert(src, dst, to="torch", alignment=4096)
    assert result.verified and not result.dropped
    loaded = torch.load(dst, weights_only=True)
    assert set(loaded) == set(obj)
    for name, tensor in obj.items():
        assert _same_tensor(tensor, loaded[name]), name
    # the view still views the dense tensor's storage, as in the source
    assert loaded["view"].untyped_storage().data_ptr() == \
        loaded["dense"].untyped_storage().data_ptr()
    held = [n for n in result.notes if n.startswith("every tensor held in memory")]
    if quantized:  # torch writes quantized and nested tensors only with their bytes
        assert len(held) == 1 and "skip_data" in held[0]
    else:  # sparse ones stream: torch lays the file out, the bytes are put in after
        assert not held
        assert all(s.data_offset % 4096 == 0 for s in ckptlab.inspect(dst).storages)
    assert ckptlab.scan(dst).verdict == "weights-only"


@pytest.mark.parametrize("shard_size", [None, 64])
def test_safetensors_holds_sparse_dense_and_quantized_dequantized(
        tmp_path: Path, shard_size: int | None) -> None:
    src, obj = _odd(tmp_path, quantized=True)
    dst = tmp_path / ("out" if shard_size else "out.safetensors")
    result = ckptlab.convert(src, dst, shard_size=shard_size)
    assert result.verified
    assert list(result.dropped) == ["nested"] and "--to torch" in result.dropped["nested"]
    notes = "\n".join(result.notes)
    for name in ("coo", "csr", "bsr"):
        assert f"{name}: a sparse_" in notes and "written dense" in notes
    assert "q: a quint8 quantized tensor, dequantized to float32" in notes
    loaded = _load_result(dst, "safetensors")
    assert set(loaded) == set(obj) - {"nested"}
    for name, tensor in obj.items():
        if name == "nested":
            continue
        want = (tensor.dequantize() if tensor.is_quantized else
                tensor.to_dense() if tensor.layout != torch.strided else tensor)
        assert _same_bits(want, loaded[name]), name
    if shard_size:  # the index counts the bytes as written (dense, dequantized)
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in loaded.values())


def test_the_command_does_not_show_torchs_notes_on_its_own_api(tmp_path: Path) -> None:
    """Rebuilding sparse and quantized tensors calls torch's beta and deprecated constructors,
    which warn about torch itself: the command's output is its own lines only."""
    src, _ = _odd(tmp_path, quantized=True)
    done = subprocess.run([sys.executable, "-m", "ckptlab", "convert", str(src),
                           str(tmp_path / "out.safetensors")], capture_output=True, text=True,
                          check=False, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "verified" in done.stdout
