"""The report's sections: every heading names one section, and the byte maps' lane key sits
under the first byte map's heading (not under the files table or the bytes-per-file chart)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import ckptlab as cl
from ckptlab.viz import report_html
from ckptlab.viz._style import LANE_LABELS


def _headings(doc: str) -> list[str]:
    return re.findall(r"<h2>(.*?)</h2>", doc)


def _section_after(doc: str, heading: str) -> str:
    """What follows `<h2>heading</h2>` up to the next heading."""
    start = doc.index(f"<h2>{heading}</h2>") + len(f"<h2>{heading}</h2>")
    end = doc.find("<h2>", start)
    return doc[start:end if end >= 0 else len(doc)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hf")
    sd = {f"model.layers.{i}.mlp.weight": torch.ones(8, 4 + i) for i in range(4)}
    shards = {"model-00001-of-00002.safetensors": sorted(sd)[:2],
              "model-00002-of-00002.safetensors": sorted(sd)[2:]}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(root / shard))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}))
    return root


def test_sharded_report_headings_are_distinct_and_the_key_is_under_the_first_map(hf_dir):
    ck = cl.open(hf_dir)
    doc = report_html(ck)
    heads = _headings(doc)
    assert len(heads) == len(set(heads)), f"repeated headings: {heads}"
    assert "Files" in heads and "Bytes per file" in heads, heads
    assert heads.index("Files") < heads.index("Bytes per file")
    # the files table's section has the table only; the chart's has the files figure only
    assert 'class="legend"' not in _section_after(doc, "Files")
    files_chart = _section_after(doc, "Bytes per file")
    assert 'class="legend"' not in files_chart and files_chart.count("ckptlab-figure") == 1
    maps = [h for h in heads if h.startswith("Byte map · ")]
    assert {h.removeprefix("Byte map · ") for h in maps} == {
        t.file for t in ck.tensors.values()}
    first = _section_after(doc, maps[0])
    assert first.lstrip().startswith('<div class="legend">'), first[:200]
    assert first.index('class="legend"') < first.index('class="ckptlab-figure"')
    assert LANE_LABELS["data"] in first.split('class="ckptlab-figure"')[0]
    assert doc.count('class="legend"') == 1


def test_single_file_report_has_its_key_under_the_byte_map(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(16, 16), "b": torch.zeros(16)}, path)
    for doc in (report_html(cl.open(path)), report_html(cl.inspect(path))):
        heads = _headings(doc)
        assert len(heads) == len(set(heads)), heads
        assert "Bytes per file" not in heads and "Files" not in heads
        section = _section_after(doc, "Byte map")
        assert section.lstrip().startswith('<div class="legend">'), section[:200]
        assert doc.count('class="legend"') == 1


def test_byte_maps_go_to_the_shards_with_structure(tmp_path: Path) -> None:
    """Nine large one-tensor shards and one small shard of five tensors: the report's eight
    byte maps include the small shard (the most tensors first), not eight solid bars only,
    and say how they were chosen."""
    from safetensors.torch import save_file

    weight_map = {}
    for i in range(9):
        name = f"model-{i:05d}-of-00010.safetensors"
        save_file({f"big.{i}": torch.ones(64, 64)}, str(tmp_path / name))
        weight_map[f"big.{i}"] = name
    small = "model-00009-of-00010.safetensors"
    save_file({f"small.{j}": torch.ones(2) for j in range(5)}, str(tmp_path / small))
    weight_map.update({f"small.{j}": small for j in range(5)})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    doc = report_html(cl.open(tmp_path))
    maps = [h for h in _headings(doc) if h.startswith("Byte map · ")]
    assert len(maps) == 8 and maps[0] == f"Byte map · {small}"
    assert "Byte maps of the 8 with the most tensors of the 10 files" in doc
