"""blockmap_figure / block_classes and transfer_figure, checked against the layout's bytes."""

from __future__ import annotations

import numpy as np
import pytest

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError
from ckptlab.viz import block_classes, blockmap_figure, transfer_figure


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, cl.format.ArchiveLayout]:
    d = tmp_path_factory.mktemp("blocks")
    for a in (64, 4096):
        (d / f"a{a}").mkdir()
    return {a: cl.inspect(cl.samples.write_sample(d / f"a{a}" / "s.pt", storage_alignment=a))
            for a in (64, 4096)}


def _slow_classes(layout: cl.format.ArchiveLayout, block: int) -> list[int]:
    owner = np.zeros(layout.file_nbytes, dtype=bool)
    for s in layout.storages:
        owner[s.data_offset : s.data_offset + s.nbytes] = True
    out = []
    for start in range(0, layout.file_nbytes, block):
        part = owner[start : start + block]
        out.append(0 if not part.any() else 1 if part.all() else 2)
    return out


@pytest.mark.parametrize("alignment", [64, 4096])
@pytest.mark.parametrize("block", [512, 4096, 10000])
def test_block_classes_match_a_byte_by_byte_count(layouts, alignment, block) -> None:
    layout = layouts[alignment]
    assert block_classes(layout, block).tolist() == _slow_classes(layout, block)


def test_at_4096_only_tails_are_shared(layouts) -> None:
    layout = layouts[4096]
    classes = block_classes(layout)
    tails = {(s.data_offset + s.nbytes) // 4096 for s in layout.storages
             if s.nbytes and (s.data_offset + s.nbytes) % 4096}
    assert set(np.flatnonzero(classes == 2).tolist()) == tails
    fig = blockmap_figure(layout)
    counts = fig.layout.meta["counts"]
    assert counts == {k: int((classes == i).sum()) for i, k in
                      enumerate(("metadata", "payload", "shared"))}
    z = np.array(fig.data[0].z, dtype=float).ravel()
    assert np.array_equal(z[: len(classes)], classes)
    assert np.isnan(z[len(classes):]).all()
    # a legend names each colour with its count
    assert fig.layout.showlegend and [t.name for t in fig.data[1:]] == [
        f"{k} ({counts[k]:,})" for k in ("metadata", "payload", "shared")]
    assert [t.marker.color for t in fig.data[1:]] == list(fig.data[0].colorscale[i][1]
                                                          for i in (0, 2, 4))


def test_many_blocks_are_aggregated_worst_first(layouts) -> None:
    layout = layouts[64]
    fig = blockmap_figure(layout, block=16)  # 90k blocks: fits, one per cell
    assert fig.layout.meta["blocks_per_cell"] == 1
    fig = blockmap_figure(layout, block=4)  # 362k blocks: two per cell
    per = fig.layout.meta["blocks_per_cell"]
    assert per == 2
    classes = block_classes(layout, 4)
    cells = np.array(fig.data[0].z, dtype=float).ravel()[: -(-len(classes) // per)]
    want = np.pad(classes, (0, (-len(classes)) % per)).reshape(-1, per).max(axis=1)
    assert np.array_equal(cells, want)


def test_transfer_figure_data() -> None:
    fig = transfer_figure({"torch.save": 0.5, "odirect": 1.5}, limit=("raw", 2.0))
    assert list(fig.data[0].x) == ["torch.save", "odirect"]
    assert list(fig.data[0].y) == [0.5, 1.5]
    assert fig.layout.shapes[0].y0 == 2.0
    # the legend holds the limit's words only: no unnamed "trace 0" for the bars
    assert [t.name for t in fig.data if t.showlegend is not False] == ["raw 2.00 GB/s"]
    with pytest.raises(InvalidArgumentError):
        transfer_figure({})
    with pytest.raises(InvalidArgumentError):
        block_classes(cl.inspect(cl.samples.sample_path()), 0)
