"""``ckptlab diff --json`` and ``ckptlab stats --json`` against their JSON Schemas
(``ckptlab/schemas/diff.schema.json``, ``stats.schema.json``): the outputs of a pair written by
the real libraries (safetensors, torch.save) with every kind of figure (identical, changed,
a NaN, an all-zero tensor from zero, a dtype cast, a shape change, names on one side, an
unreadable tensor) validate; the schemas are not vacuous."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from typing import Any

import jsonschema
import pytest
import torch
from safetensors.torch import save_file

from ckptlab.cli import main
from ckptlab.schemas import schema


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("json")
    torch.manual_seed(12)
    a = {"same": torch.randn(5), "w": torch.randn(4, 4), "zero": torch.zeros(3),
         "cast": torch.randn(6), "reshaped": torch.ones(2, 3), "gone": torch.ones(1)}
    b = {"same": a["same"].clone(), "w": a["w"] + 0.1, "zero": torch.ones(3),
         "cast": a["cast"].to(torch.bfloat16), "reshaped": torch.ones(3, 2),
         "new": torch.ones(1)}
    b["w"][0, 0] = float("nan")
    save_file(a, str(base / "a.safetensors"))
    torch.save(b, base / "b.pt")
    out: dict[str, Any] = {}
    for name, argv in (("diff", ["diff", str(base / "a.safetensors"), str(base / "b.pt")]),
                       ("stats", ["stats", str(base / "b.pt")])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main([*argv, "--json"])
        out[name] = json.loads(buf.getvalue())
    return out


@pytest.mark.parametrize("name", ["diff", "stats"])
def test_the_json_validates(docs: dict[str, Any], name: str) -> None:
    validator = jsonschema.Draft202012Validator(schema(name))
    errors = sorted(validator.iter_errors(docs[name]), key=str)
    assert not errors, "\n".join(str(e) for e in errors[:5])


def test_the_documents_hold_every_kind_of_figure(docs: dict[str, Any]) -> None:
    d = docs["diff"]
    assert d["tensors"]["same"]["identical"] and d["tensors"]["zero"]["rel_l2"] == "inf"
    assert d["tensors"]["reshaped"]["max_abs"] is None  # a shape change: nothing compared
    assert d["tensors"]["cast"]["dtype"] == ["float32", "bfloat16"]
    assert d["tensors"]["w"]["nan_b"] == 1 and d["only_a"] == ["gone"]
    assert docs["stats"]["tensors"]["w"]["nan"] == 1


@pytest.mark.parametrize("name, breaks", [
    ("diff", lambda d: d.pop("tensors")),
    ("diff", lambda d: d["tensors"]["w"].update(n_diff=-1)),
    ("diff", lambda d: d["tensors"]["w"].update(dtype=["torch.float32", "float32"])),
    ("diff", lambda d: d["tensors"]["w"].update(rel_l2="big")),
    ("stats", lambda d: d["tensors"]["w"].update(nan=-1)),
    ("stats", lambda d: d["tensors"]["w"]["hist"].pop("counts")),
    ("stats", lambda d: d.pop("health")),
])
def test_a_broken_document_fails(docs: dict[str, Any], name: str, breaks: Any) -> None:
    doc = copy.deepcopy(docs[name])
    breaks(doc)
    assert list(jsonschema.Draft202012Validator(schema(name)).iter_errors(doc))
