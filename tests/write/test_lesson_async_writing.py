"""The claims of notebooks/06_async_writing.ipynb, checked through the same public API the
notebook uses (the notebook shows them; these tests keep them true).

Bucket assignment on the sample model and on LLM shapes, the separation hint, the bucket
explorer; then the notebook's 20 MiB state dict saved with one AsyncWriter: what the first save
sets up and the second reuses, where dcp.save returns, a bit-exact stock dcp.load, snapshot
isolation; and the answers of the notebook's "Try this" exercises.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptlab as cl
from ckptlab.write import AsyncWriter, assign_buckets, sized_items

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STAGING_NBYTES = 20 << 20  # the lesson's state (about 20 MiB) in 4 KiB slots, to 2 MiB


def lesson_state() -> dict[str, Any]:
    """The notebook's state dict (section 2): about 20 MiB, fixed seed."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(4000, 512, generator=g).to(torch.bfloat16),
            "layer0.weight": torch.randn(1024, 1024, generator=g),
            "layer1.weight": torch.randn(1024, 1024, generator=g),
            "norm.weight": torch.ones(1024),
            "position_ids": torch.arange(4096),
        },
        "optim": {
            "layer0.exp_avg": torch.randn(1024, 1024, generator=g) * 1e-3,
            "layer1.exp_avg": torch.randn(1024, 1024, generator=g) * 1e-3,
            "lr": 3e-4,
        },
        "step": 100,
    }


def _leaves(obj: Any, prefix: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], obj


def _zeros_like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _zeros_like(v) for k, v in obj.items()}
    return type(obj)()


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def _same_state(got: Any, want: Any) -> bool:
    """Same keys, dtypes, shapes and bytes (the notebook's same_state)."""
    pairs = list(zip(_leaves(got), _leaves(want), strict=True))
    for (k1, a), (k2, b) in pairs:
        if k1 != k2:
            return False
        if isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                    a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                return False
        elif a != b:
            return False
    return True


def _load(path: Path, like: Any) -> Any:
    target = _zeros_like(like)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)  # stock FileSystemReader
    return target


def _span(timeline, *phases: str) -> tuple[float, float]:
    events = [e for e in timeline.events if e.phase in phases]
    return min(e.start_s for e in events), max(e.end_s for e in events)


# -- 1. buckets -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_no_bucket_exceeds_the_ideal_by_more_than_the_largest_item(n: int) -> None:
    items = sized_items(cl.samples.tiny_gpt())
    largest = max(i.nbytes for i in items)
    assignment = assign_buckets(items, n)
    assert assignment.ideal_nbytes() == sum(i.nbytes for i in items) / n
    assert all(b.nbytes <= assignment.ideal_nbytes() + largest for b in assignment.buckets)
    assert assignment.imbalance == max(assignment.bucket_nbytes) / assignment.ideal_nbytes()


def test_the_sample_model_in_four_buckets() -> None:
    items = sized_items(cl.samples.tiny_gpt())
    assert len(items) == 32 and max(items, key=lambda i: i.nbytes).key == \
        "transformer.wte.weight"
    assert 1.0 < assign_buckets(items, 4).imbalance < 1.01


@pytest.mark.parametrize("n", [4, 8, 16, 32])
def test_llama3_8b_with_adam_is_within_a_fraction_of_a_percent(n: int) -> None:
    assert assign_buckets(sized_items("llama3-8b", optimizer=True), n).imbalance < 1.005


def test_a_tied_embedding_sets_the_fullest_bucket_alone() -> None:
    weights = sized_items("llama3-1b", optimizer=False)
    embedding = max(weights, key=lambda i: i.nbytes)
    total = sum(i.nbytes for i in weights)
    assert embedding.key == "model.embed_tokens.weight"
    assert abs(embedding.nbytes / total - 1 / 5) < 0.02  # a fifth of the weights
    ideal_8 = total / 8
    assert assign_buckets(weights, 8).imbalance == embedding.nbytes / ideal_8
    assert round(embedding.nbytes / ideal_8, 2) == 1.70


def test_separation_hint_gives_the_optimizer_about_four_fifths_of_the_buckets() -> None:
    llama = sized_items("llama3-8b", optimizer=True)
    optim = sum(i.nbytes for i in llama if i.key.startswith("optim."))
    model = sum(i.nbytes for i in llama) - optim
    assert 3.9 < optim / model < 4.1  # Adam's float32 state: four times the bfloat16 weights
    plain = assign_buckets(llama, 8)
    hinted = assign_buckets(llama, 8, separation_hint="optim.")
    assert [len(plain.group_buckets(g)) for g in (0, 1)] == [8, 0]
    assert [len(hinted.group_buckets(g)) for g in (0, 1)] == [2, 6]
    assert max(hinted.bucket_nbytes) < 1.25 * max(plain.bucket_nbytes)
    assert hinted.imbalance < 1.001


def test_bucket_explorer_controls_do_what_assign_buckets_does() -> None:
    pytest.importorskip("ipywidgets", reason="the explorer is a widget: the 'widgets' extra")
    from ckptlab.widgets import BucketExplorer

    explorer = BucketExplorer(cl.samples.tiny_gpt(), buckets=4)
    explorer.source.value = "llama3-8b"
    explorer.optimizer.value = True
    explorer.buckets.value = 16
    explorer.separate.value = True
    want = assign_buckets(sized_items("llama3-8b", optimizer=True), 16,
                          separation_hint="optim.")
    assert explorer.assignment == want
    meta = explorer.figure.layout.meta
    assert meta["n_buckets"] == 16 and meta["imbalance"] < 1.01


# -- 2-4. saves with one writer -------------------------------------------------------------
def test_first_save_sets_up_and_the_second_returns_after_staging(tmp_path: Path) -> None:
    state = lesson_state()
    with AsyncWriter(tmp_path / "step_100", workers=2) as writer:
        assert writer.staging_nbytes == 0
        dcp.save(state, checkpoint_id=str(tmp_path / "step_100"), storage_writer=writer,
                 no_dist=True)
        first = writer.wait()
        assert writer.staging_nbytes == STAGING_NBYTES  # mapped by the first save
        dcp.save(state, checkpoint_id=str(tmp_path / "step_101"), storage_writer=writer,
                 no_dist=True)
        second = writer.wait()
        assert writer.staging_nbytes == STAGING_NBYTES  # reused, not mapped again
    # the first save maps its staging memory first, a phase of its own; the second does not
    [reserve] = [e for e in first.events if e.phase == "reserve"]
    assert reserve.nbytes == STAGING_NBYTES and reserve.end_s <= _span(first, "plan")[0]
    assert not any(e.phase == "reserve" for e in second.events)
    for timeline, name in ((first, "step_100"), (second, "step_101")):
        assert timeline.committed and (tmp_path / name / ".metadata").exists()
        plan_from, plan_to = _span(timeline, "plan")
        stage_from, stage_to = _span(timeline, "stage")
        commit = next(e for e in timeline.events if e.phase == "commit")
        # DCP's planning, then the writer's plan, the copy, the return; the commit comes last
        assert 0 < plan_from <= plan_to <= stage_from <= stage_to <= timeline.returned_s
        assert timeline.returned_s <= commit.start_s <= commit.end_s == timeline.finished_s
        assert _span(timeline, "write", "fsync")[1] <= commit.start_s
        assert len({e.bucket for e in timeline.events if e.phase == "write"}) == 2
    assert second.nbytes == first.nbytes > 20_000_000 and first.nbytes % 4096 == 0
    # Try this, 1: the two files of the save
    assert second.assignment.bucket_nbytes == (12_484_608, 8_425_472)
    assert sorted(p.name for p in (tmp_path / "step_100").iterdir()) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert _same_state(_load(tmp_path / "step_100", state), state)  # stock dcp.load


def test_changes_after_the_return_do_not_reach_the_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("tqdm", reason="save_progress is a tqdm bar: the 'widgets' extra")
    from ckptlab.widgets import save_progress

    state = lesson_state()
    before = _clone(state)
    with AsyncWriter(tmp_path / "step_102", workers=2) as writer:
        dcp.save(state, checkpoint_id=str(tmp_path / "step_102"), storage_writer=writer,
                 no_dist=True)
        with torch.no_grad():  # the notebook's "training step", right after the return
            for _, t in _leaves(state):
                if isinstance(t, torch.Tensor):
                    t.add_(1)
        state["step"] = 101
        timeline = save_progress(writer, file=io.StringIO())
    assert timeline.committed and timeline.nbytes > 20_000_000
    loaded = _load(tmp_path / "step_102", before)
    assert _same_state(loaded, before)
    assert not _same_state(loaded, state)
    assert loaded["step"] == 100 and state["step"] == 101


# -- Try this -------------------------------------------------------------------------------
def test_try_this_more_buckets_for_five_large_items() -> None:
    items = sized_items(lesson_state())
    got = {n: assign_buckets(items, n) for n in (2, 3, 4)}
    assert {n: round(a.imbalance, 3) for n, a in got.items()} == {2: 1.194, 3: 1.204,
                                                                  4: 1.586}
    assert {n: max(a.bucket_nbytes) for n, a in got.items()} == {
        2: 12_484_608, 3: 8_388_608, 4: 8_290_304}


def test_try_this_separation_hint_files(tmp_path: Path) -> None:
    with AsyncWriter(tmp_path / "hinted", separation_hint="optim.") as writer:
        dcp.save(lesson_state(), checkpoint_id=str(tmp_path / "hinted"), storage_writer=writer,
                 no_dist=True)
        writer.wait()
    files: dict[str, set[str]] = {}
    for item in cl.inspect(tmp_path / "hinted").items:
        files.setdefault(item.file, set()).add(item.fqn)
    assert files == {
        "__0_0.distcp": {"step", "model.embed.weight", "model.layer0.weight",
                         "model.layer1.weight", "model.norm.weight", "model.position_ids"},
        "__0_1.distcp": {"optim.lr", "optim.layer0.exp_avg", "optim.layer1.exp_avg"}}


def test_try_this_reserve_maps_the_memory_before_the_first_save(tmp_path: Path) -> None:
    state = lesson_state()
    state_nbytes = sum(v.numel() * v.element_size() for _, v in _leaves(state)
                       if isinstance(v, torch.Tensor))
    assert 19 << 20 < state_nbytes < 20 << 20  # "about 20 MiB"
    with AsyncWriter(tmp_path / "fresh", workers=2) as fresh:
        fresh.reserve(state_nbytes)
        assert fresh.staging_nbytes == STAGING_NBYTES
        dcp.save(state, checkpoint_id=str(tmp_path / "fresh"), storage_writer=fresh,
                 no_dist=True)
        timeline = fresh.wait()
        assert timeline.committed
        assert fresh.staging_nbytes == STAGING_NBYTES  # the save mapped nothing more
        assert not any(e.phase == "reserve" for e in timeline.events)
