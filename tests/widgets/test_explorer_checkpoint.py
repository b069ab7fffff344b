"""LayoutExplorer on the Checkpoint model: tensor table, search, sort, pages, file picker,
tensor selection (parts outlined on its file's map, its bytes in hex), for real files written
by torch.save, safetensors (a sharded Hugging Face directory) and dcp.save."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError
from ckptlab.testing.hexview import hex_bytes
from ckptlab.widgets import LayoutExplorer
from ckptlab.widgets.explorer import PAGE_ROWS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hf")
    g = torch.Generator().manual_seed(1)
    sd = {f"model.layers.{i}.mlp.weight": torch.randn(8, 4 + i, generator=g) for i in range(4)}
    sd["model.embed.weight"] = torch.randn(50, 8, generator=g)
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:2],
              "model-00002-of-00002.safetensors": names[2:]}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(root / shard))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}))
    return root


@pytest.fixture(scope="module")
def many_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("many") / "many.pt"
    torch.save({f"block.{i}.w": torch.full((i % 7 + 1,), float(i)) for i in range(450)}, path)
    return path


def listed(ex: LayoutExplorer) -> list[str]:
    return [v for _, v in ex.tensors.options]


def test_opens_on_the_tensors_of_a_sharded_directory(hf_dir):
    ck = cl.open(hf_dir)
    ex = LayoutExplorer(ck)
    assert ex.checkpoint is ck and len(ex.table) == len(ck.tensors) == 5
    assert listed(ex) == list(ck.tensors)  # the checkpoint's own order first
    assert "5</b> tensors" in ex.summary.value and f"{ck.parameters:,}" in ex.summary.value
    assert ex.files is not None
    assert {v for _, v in ex.files.options} == {f.path for f in ck.files}
    assert ex.files.value == ex.bytemap.file  # the largest file holding tensors
    ex.search.value = "mlp"
    assert listed(ex) == [n for n in ck.tensors if "mlp" in n]
    ex.sort.value = "size"
    sizes = [ck.tensors[n].nbytes for n in listed(ex)]
    assert sizes == sorted(sizes, reverse=True)
    ex.search.value = "*.embed.*"
    assert listed(ex) == ["model.embed.weight"]
    ex.search.value = "no such tensor"
    assert listed(ex) == [] and "no tensor matches" in ex.page_info.value


def test_selecting_a_tensor_outlines_its_parts_and_shows_its_bytes(hf_dir):
    ck = cl.open(hf_dir)
    ex = LayoutExplorer(hf_dir)  # a path opens with ckptlab.open
    for name, t in ck.tensors.items():
        part = t.parts[0]
        ex.tensors.value = name  # a pick in the table
        assert ex.selected_tensor == name
        assert ex.bytemap.file == part.file and ex.files.value == part.file
        (shape,) = ex.figure.layout.shapes
        assert (shape.x0, shape.x1) == (part.offset, part.offset + part.nbytes)
        raw = (hf_dir / part.file).read_bytes()
        assert hex_bytes(ex.hex.value) == raw[part.offset:part.offset + min(part.nbytes, 512)]
        assert name in ex.details.value
        # the item under the tensor's first byte names it
        assert any(lab.startswith(name + " ") for lab in ex.bytemap.tensors_at(part.offset))
    with pytest.raises(InvalidArgumentError, match="no tensor"):
        ex.select_tensor("missing")


def test_file_picker_switches_the_map(hf_dir):
    ex = LayoutExplorer(cl.open(hf_dir))
    other = next(v for _, v in ex.files.options if v != ex.files.value)
    ex.files.value = other
    assert ex.bytemap.file == other and ex.figure.layout.meta["file"] == other
    assert ex.figure.layout.meta["file_nbytes"] == (hf_dir / other).stat().st_size
    assert list(ex.figure.layout.xaxis.range) == [0, (hf_dir / other).stat().st_size]
    assert ex.figure.layout.shapes == ()
    with pytest.raises(InvalidArgumentError, match="no file"):
        ex.show_file("nope")


def test_pages_of_a_long_table(many_file):
    ex = LayoutExplorer(many_file)
    assert len(ex.tensors.options) == PAGE_ROWS
    assert f"1–{PAGE_ROWS} of 450" in ex.page_info.value and ex.prev_page.disabled
    ex.next_page.click()
    assert listed(ex)[0] == f"block.{PAGE_ROWS}.w"
    ex.next_page.click()
    assert len(ex.tensors.options) == 450 - 2 * PAGE_ROWS and ex.next_page.disabled
    ex.search.value = "block.1"
    want = [f"block.{i}.w" for i in range(450) if f"block.{i}.w".startswith("block.1")]
    assert listed(ex) == want and "filtered out" in ex.page_info.value


def test_a_dcp_directory(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd, "step": 3}, checkpoint_id=str(tmp_path / "ck"))
    ex = LayoutExplorer(tmp_path / "ck")
    assert ex.checkpoint.format == "dcp" and ex.files is not None
    ex.select_tensor("model.w")
    part = ex.checkpoint.tensors["model.w"].parts[0]
    raw = (tmp_path / "ck" / part.file).read_bytes()
    assert hex_bytes(ex.hex.value) == raw[part.offset:part.offset + part.nbytes]
    assert np.frombuffer(hex_bytes(ex.hex.value), dtype=np.float32).tolist() == list(
        map(float, range(12)))
    ex.files.value = ".metadata"
    assert ex.bytemap.lanes == ("metadata",)


def test_alignment_what_if_only_for_a_torch_save_zip(small_file, safetensors_file, hf_dir):
    ex = LayoutExplorer(small_file)
    assert ex.what_if is not None and ex.aligner is None  # built when opened
    ex.what_if.selected_index = 0
    assert ex.aligner is not None and ex.what_if.children == (ex.aligner,)
    assert ex.aligner.base == ex.archive
    assert ex.open_what_if() is ex.aligner  # once
    for other in (safetensors_file, hf_dir):
        ex = LayoutExplorer(other)
        assert ex.what_if is None
        with pytest.raises(InvalidArgumentError, match=r"torch\.save zip"):
            ex.open_what_if()


def test_statistics_on_demand(tmp_path):
    """Tick "statistics": the tensors listed are measured (as ckptlab.stats measures them),
    their line and the selected tensor's details say min, max, mean, std, NaN; the health
    line names the tensor with a NaN; a layout (no reader) has the box disabled."""
    from safetensors.torch import save_file

    sd = {"a.w": torch.arange(6.0).reshape(2, 3), "b.w": torch.tensor([1.0, float("nan")])}
    save_file(sd, str(tmp_path / "m.safetensors"))
    x = LayoutExplorer(tmp_path / "m.safetensors")
    assert x.health.value == "" and "min" not in x.tensors.options[0][0]
    x.statistics.value = True
    labels = dict((v, k) for k, v in x.tensors.options)
    assert "min 0 max 5 mean 2.5" in labels["a.w"] and "NaN 1" in labels["b.w"]
    assert "NaN or Inf in 1 tensor: b.w" in x.health.value
    want = cl.stats(tmp_path / "m.safetensors")["a.w"]
    assert x._stats["a.w"] == want
    x.select_tensor("a.w")
    assert "std 1.708" in x.details.value
    x.statistics.value = False
    assert x.health.value == ""
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    assert LayoutExplorer(cl.inspect(tmp_path / "m.pt")).statistics.disabled
