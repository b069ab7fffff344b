"""``ckptlab.diff`` and ``ckptlab diff``: every figure against torch computing the same thing
on the tensors its own loaders give (``torch.load``, ``safetensors.torch.load_file``,
``dcp.load``), across formats: torch.save vs safetensors, DCP vs safetensors, fp32 vs bf16.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.compare import _kernels

pytestmark = pytest.mark.usefixtures("loops")  # NumPy loops, then compiled (conftest.py)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"emb.weight": torch.randn(10, 4), "layers.0.w": torch.randn(4, 4),
            "layers.0.b": torch.randn(4), "layers.1.w": torch.randn(4, 4),
            "layers.1.b": torch.zeros(4), "steps": torch.arange(6),
            "mask": torch.tensor([True, False, True])}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A (torch.save) and B (safetensors): layers.0.w fine-tuned, a NaN planted in
    layers.1.w, steps advanced, layers.0.b renamed, mask dropped, head.w added."""
    base = tmp_path_factory.mktemp("pair")
    a = _state()
    torch.save(a, base / "a.pt")
    b = {k: v.clone() for k, v in a.items()}
    b["layers.0.w"] += 0.01 * torch.randn(4, 4)
    b["layers.1.w"][1, 2] = float("nan")
    b["steps"] += 1
    b["layers.0.bias_renamed"] = b.pop("layers.0.b")
    del b["mask"]
    b["head.w"] = torch.ones(2, 2)
    save_file(b, str(base / "b.safetensors"))
    return base / "a.pt", base / "b.safetensors"


def _truth(ta: torch.Tensor, tb: torch.Tensor) -> dict[str, Any]:
    a, b = ta.double().reshape(-1), tb.double().reshape(-1)
    nan = torch.isnan(a) | torch.isnan(b)
    equal = (a == b) | (torch.isnan(a) & torch.isnan(b))
    d = (a - b)[~nan]
    na, nb = a[~nan].norm().item(), b[~nan].norm().item()
    return {"n_diff": int((~equal).sum()), "max_abs": d.abs().max().item() if d.numel() else 0,
            "rel_l2": d.norm().item() / na if na else (0.0 if d.norm() == 0 else math.inf),
            "cosine": (a[~nan] @ b[~nan]).item() / (na * nb) if na and nb else None}


def test_a_fine_tuning_pair_across_formats(pair: tuple[Path, Path]) -> None:
    a_path, b_path = pair
    result = cl.diff(a_path, b_path)
    ta = torch.load(a_path, weights_only=True)
    tb = load_file(str(b_path))
    assert result.mapping == "exact"
    assert result.only_a == ("layers.0.b", "mask")
    assert set(result.only_b) == {"layers.0.bias_renamed", "head.w"}
    assert result.renamed == {"layers.0.b": "layers.0.bias_renamed"}
    assert {k for k, t in result.tensors.items() if t.identical} == {"emb.weight",
                                                                     "layers.1.b"}
    assert {k for k, t in result.tensors.items() if t.changed} == {"layers.0.w", "layers.1.w",
                                                                   "steps"}
    for name, t in result.tensors.items():
        want = _truth(ta[name], tb[name])
        assert t.n_diff == want["n_diff"], name
        assert t.max_abs == pytest.approx(want["max_abs"], rel=1e-12, abs=0), name
        assert t.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-12), name
        if want["cosine"] is not None:
            assert t.cosine == pytest.approx(want["cosine"], rel=1e-12), name
    nan = result.tensors["layers.1.w"]
    assert (nan.nan_a, nan.nan_b, nan.n_diff) == (0, 1, 1)
    assert result.differs
    summary = result.summary()
    assert "2 identical, 3 changed" in summary and "renamed  layers.0.b" in summary


def test_prefixes_are_matched(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "plain.pt")
    save_file({f"module.{k}": v for k, v in state.items()}, str(tmp_path / "ddp.safetensors"))
    result = cl.diff(tmp_path / "plain.pt", tmp_path / "ddp.safetensors")
    assert "'module.' stripped from B" in result.mapping
    assert not result.differs and len(result.tensors) == len(state)
    back = cl.diff(tmp_path / "ddp.safetensors", tmp_path / "plain.pt")
    assert "'module.' stripped from A" in back.mapping and not back.differs
    forced = cl.diff(tmp_path / "plain.pt", tmp_path / "ddp.safetensors",
                     rename=lambda n: n)
    assert forced.mapping.startswith("rename=") and len(forced.only_a) == len(state)


def test_fp32_against_bf16(tmp_path: Path) -> None:
    state = {k: v for k, v in _state().items() if v.is_floating_point()}
    torch.save(state, tmp_path / "fp32.pt")
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()},
              str(tmp_path / "bf16.safetensors"))
    result = cl.diff(tmp_path / "fp32.pt", tmp_path / "bf16.safetensors")
    for name, t in result.tensors.items():
        assert t.dtype == ("float32", "bfloat16")
        # a change of dtype alone (zeros stay zeros) is within tolerance, not a change
        exact = bool((state[name].to(torch.bfloat16).float() == state[name]).all())
        assert t.changed is not exact and t.within is exact and not t.identical
        want = _truth(state[name], state[name].to(torch.bfloat16))
        assert t.max_abs == pytest.approx(want["max_abs"], rel=1e-12, abs=0)
        assert t.max_abs <= state[name].abs().max().item() * 2 ** -8  # bf16 rounding
    assert "layers.1.b: float32 -> bfloat16, the values within tolerance" in result.summary()
    assert not cl.diff(tmp_path / "fp32.pt", tmp_path / "bf16.safetensors",
                       rtol=2 ** -8).differs  # a good bfloat16 copy, within its precision


def test_dcp_against_safetensors(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {k: v for k, v in _state().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "dcp")
    save_file(state, str(tmp_path / "model.safetensors"))
    result = cl.diff(tmp_path / "dcp", tmp_path / "model.safetensors")
    assert not result.differs and all(t.identical for t in result.tensors.values())
    assert len(result.tensors) == len(state)


def test_tolerances(tmp_path: Path) -> None:
    a = {"w": torch.ones(8)}
    b = {"w": torch.ones(8) + 1e-6}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    assert cl.diff(tmp_path / "a.pt", tmp_path / "b.pt").differs
    loose = cl.diff(tmp_path / "a.pt", tmp_path / "b.pt", atol=1e-5)
    assert not loose.differs and loose.tensors["w"].within and not loose.tensors["w"].identical
    assert torch.isclose(a["w"], b["w"], atol=1e-5, rtol=0).all()  # the rule it follows
    assert cl.diff(tmp_path / "a.pt", tmp_path / "b.pt", rtol=1e-5).differs is False


def test_an_unreadable_tensor_is_said_and_the_diff_goes_on(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1000), "b": torch.ones(4)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(1000), "b": torch.ones(4)}, str(tmp_path / "y.safetensors"))
    ck_y = cl.open(tmp_path / "y.safetensors")
    data = (tmp_path / "y.safetensors").read_bytes()
    (tmp_path / "y.safetensors").write_bytes(data[:-100])  # cut after it was opened
    result = cl.diff(tmp_path / "x.safetensors", ck_y)
    bad = [k for k, t in result.tensors.items() if t.error]
    assert bad and all("cannot be read" in result.tensors[k].error for k in bad)
    assert result.differs and len(result.tensors) == 2


def test_cli(pair: tuple[Path, Path], tmp_path: Path, capsys: Any) -> None:
    a_path, b_path = pair
    assert main(["diff", str(a_path), str(b_path)]) == 1
    out = capsys.readouterr().out
    assert "changed  layers.0.w" in out and "only A   mask" in out
    assert main(["diff", str(a_path), str(b_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"a", "b", "mapping", "only_a", "only_b", "renamed", "tensors",
                        "summary"}
    assert set(doc["summary"]) >= {"identical", "changed", "only_a", "only_b"}
    w = doc["tensors"]["layers.0.w"]
    assert set(w) >= {"identical", "dtype", "shape", "max_abs", "rel_l2", "cosine", "n_diff"}
    assert w["dtype"] == ["float32", "float32"] and w["shape"] == [[4, 4], [4, 4]]
    assert main(["diff", str(a_path), str(a_path)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a_path), str(b_path), "--filter", "emb"]) == 0  # only emb.weight
    capsys.readouterr()
    assert main(["diff", str(a_path), str(tmp_path / "missing.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptlab: error: ") and "missing.pt" in err
    assert main(["diff", str(a_path), str(b_path), "--step", "3"]) == 2
    assert "--step is for a training run" in capsys.readouterr().err
    assert main(["diff", str(a_path), str(b_path), "--atol", "-1"]) == 2


def test_slices_join_exactly(pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Compared in slices of 5 elements, every figure is the one-pass figure."""
    whole = cl.diff(*pair)
    monkeypatch.setattr(_kernels, "SLICE", 5)
    sliced = cl.diff(*pair)
    for name, t in whole.tensors.items():
        s = sliced.tensors[name]
        assert (s.n_diff, s.nan_a, s.nan_b, s.identical, s.within) == (
            t.n_diff, t.nan_a, t.nan_b, t.identical, t.within), name
        for field in ("max_abs", "rel_l2", "cosine"):
            assert getattr(s, field) == pytest.approx(getattr(t, field), rel=1e-12), name


def test_norms_and_modules_against_torch(pair: tuple[Path, Path]) -> None:
    """Each tensor's norms (identical ones too: one pass with the NaN count), and each
    module's change over its tensors together, as torch computes them on the loaded pair."""
    a_path, b_path = pair
    result = cl.diff(a_path, b_path)
    ta = torch.load(a_path, weights_only=True)
    tb = load_file(str(b_path))
    for name, t in result.tensors.items():
        a, b = ta[name].double().reshape(-1), tb[name].double().reshape(-1)
        ok = ~(torch.isnan(a) | torch.isnan(b))
        assert t.norm_a == pytest.approx(a[ok].norm().item(), rel=1e-12), name
        assert t.norm_b == pytest.approx(b[ok].norm().item(), rel=1e-12), name
    modules = {m: (rel, changed, n) for m, rel, changed, n in result.by_module()}
    assert set(modules) == {"emb", "layers.0", "layers.1", "(top)"}
    assert modules["emb"] == (0.0, 0, 1)
    for module in ("layers.0", "layers.1"):
        names = [k for k in result.tensors if k.startswith(module + ".")]
        num = den = 0.0
        for k in names:
            a, b = ta[k].double().reshape(-1), tb[k].double().reshape(-1)
            ok = ~(torch.isnan(a) | torch.isnan(b))
            num += ((a - b)[ok] ** 2).sum().item()
            den += (a[ok] ** 2).sum().item()
        assert modules[module][0] == pytest.approx(math.sqrt(num / den), rel=1e-12), module
        assert modules[module][1:] == (sum(result.tensors[k].changed for k in names),
                                       len(names))
    assert result.by_module(depth=1)[1][0] == "layers"  # cut to one name component


def test_a_bias_from_zero_does_not_make_its_layer_infinite(tmp_path: Path) -> None:
    """A tensor all zero in A has rel_l2 inf and is listed after the finite changes; its
    module's change is over the module's tensors together."""
    torch.manual_seed(4)
    a = {"l.w": torch.randn(8, 8), "l.b": torch.zeros(8), "m.w": torch.randn(8, 8)}
    b = {"l.w": a["l.w"] + 0.1, "l.b": torch.full((8,), 0.5), "m.w": a["m.w"] * 1.5}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    result = cl.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert result.tensors["l.b"].rel_l2 == math.inf
    assert [n for n, _ in result.largest()] == ["m.w", "l.w", "l.b"]
    rel = dict((m, r) for m, r, _, _ in result.by_module())
    want = math.sqrt((0.1 ** 2 * 64 + 0.25 * 8) / (a["l.w"].double() ** 2).sum().item())
    assert rel["l"] == pytest.approx(want, rel=1e-6) and rel["m"] == pytest.approx(0.5)


def test_the_steps_of_a_run(tmp_path: Path) -> None:
    """step_diffs: each save of a Trainer-style run against the one before it."""
    from ckptlab.compare import step_diffs

    torch.manual_seed(5)
    w = torch.randn(4, 4)
    for step, delta in ((10, 0.0), (20, 0.5), (30, 0.5)):
        d = tmp_path / "run" / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text("{}")
        w = w + delta
        save_file({"layer.w": w, "layer.b": torch.ones(4)}, str(d / "model.safetensors"))
    steps = step_diffs(tmp_path / "run")
    assert [(x, y) for x, y, _ in steps] == [("checkpoint-10", "checkpoint-20"),
                                             ("checkpoint-20", "checkpoint-30")]
    assert all(d.tensors["layer.b"].identical for _, _, d in steps)
    assert steps[0][2].tensors["layer.w"].changed
    with pytest.raises(cl.CkptlabError, match="not a training run"):
        step_diffs(tmp_path / "run" / "checkpoint-10")


def test_large_tensors_are_compared_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              read_sizes: list[int]) -> None:
    """With pieces of 4 KiB, no read is larger than a piece, and every figure is the one a
    whole-tensor comparison gives: float32 against bfloat16, a NaN, an identical tensor, a
    complex one, a sparse one (read whole), torch.save against safetensors."""
    torch.manual_seed(9)
    a = {"w": torch.randn(3000), "same": torch.randn(5000), "c": torch.randn(2000,
                                                                        dtype=torch.cfloat),
         "s": torch.eye(50).to_sparse()}
    b = {"w": a["w"].to(torch.bfloat16), "same": a["same"].clone(), "c": a["c"] * 2,
         "s": (torch.eye(50) * 2).to_sparse()}
    b["same"][10] = a["same"][10]
    a["w"][7] = float("nan")
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    whole = cl.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    read_sizes.clear()  # (the reads of the whole-tensor pass above)
    monkeypatch.setattr(_kernels, "CHUNK_NBYTES", 4096)
    pieces = cl.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    dense = [n for n in a if n != "s"]
    assert max(read_sizes) == 4096 and len(read_sizes) > 10  # (the sparse parts are small)
    for name in a:
        w, p = whole.tensors[name], pieces.tensors[name]
        assert (w.identical, w.changed, w.n_diff, w.nan_a, w.nan_b, w.max_abs) == (
            p.identical, p.changed, p.n_diff, p.nan_a, p.nan_b, p.max_abs), name
        for field in ("rel_l2", "cosine", "norm_a", "norm_b"):
            assert getattr(p, field) == pytest.approx(getattr(w, field), rel=1e-12), name
    assert pieces.tensors["same"].identical and pieces.tensors["w"].nan_a == 1
    assert pieces.tensors["c"].compared.endswith("(complex as real and imaginary parts)")
    truth = _truth(a["w"], b["w"])
    assert pieces.tensors["w"].n_diff == truth["n_diff"] and dense


def test_sparse_quantized_and_nested_copies_are_identical(tmp_path: Path) -> None:
    """A sparse, quantized or nested tensor stored alike on both sides (each part's bytes,
    its layout and parameters) is identical; the same values stored otherwise (a COO tensor
    coalesced on one side only, another scale) are equal values, not identical."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's beta / prototype / deprecation notes)
        coo = torch.sparse_coo_tensor(torch.tensor([[1, 0], [0, 2]]), torch.tensor([4.0, 3.0]),
                                      (2, 3))
        q = torch.quantize_per_tensor(torch.tensor([-1.0, 0.0, 1.5]), 0.5, 2, torch.qint8)
        a = {"coo": coo, "csr": torch.eye(3).to_sparse_csr(), "q": q,
             "nested": torch.nested.nested_tensor([torch.arange(3.0), torch.ones(5)])}
        b = {name: t.clone() for name, t in a.items()}
        b_other = {**b, "coo": coo.coalesce(),  # the same values, indices in another order
                   "q": torch.quantize_per_tensor(q.dequantize(), 0.25, 4, torch.qint8)}
    for name, side in (("a", a), ("b", b), ("other", b_other)):
        torch.save(side, tmp_path / f"{name}.pt")
    same = cl.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert all(t.identical for t in same.tensors.values()), same.summary()
    other = cl.diff(tmp_path / "a.pt", tmp_path / "other.pt")
    for name in ("coo", "q"):
        t = other.tensors[name]
        assert not t.identical and t.n_diff == 0 and t.within, name
    assert other.tensors["csr"].identical and other.tensors["nested"].identical
