"""ckptlab.plan.examples: a real 2-rank save and a 3-rank resharded load (one spawn each), the
write items the ranks report against the checkpoint on disk, and simulated_chunks against
simulate_plans."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError
from ckptlab.plan import (
    CONFIGS,
    Chunk,
    global_plan,
    read_items,
    run_ranks,
    shard_chunk,
    simulate_plans,
    state_shapes,
)
from ckptlab.plan.examples import (
    REPLICATED,
    SAMPLE_OBJECTS,
    load_resharded,
    sample_state,
    simulated_chunks,
)

SAVE_RANKS, LOAD_RANKS = 2, 3


@pytest.fixture(scope="module")
def saved(sample_sharded_save: tuple[Path, list[Any]]) -> tuple[Path, list[Any]]:
    assert len(sample_sharded_save[1]) == SAVE_RANKS  # (tests/plan/conftest.py)
    return sample_sharded_save


@pytest.fixture(scope="module")
def loaded(saved) -> list[dict[str, Any]]:
    path, _ = saved
    return run_ranks(load_resharded, LOAD_RANKS, str(path), "S1", timeout=180)


def test_sample_state_is_deterministic_and_uneven() -> None:
    a, b = sample_state(), sample_state()
    assert list(a) == list(b) and REPLICATED in a and "lm_head.weight" not in a
    for name, t in a.items():
        assert t.dtype == b[name].dtype and torch.equal(t, b[name])
    assert {str(t.dtype) for t in a.values()} >= {"torch.float32", "torch.bfloat16",
                                                  "torch.int64", "torch.bool"}
    rows = a["transformer.wte.weight"].shape[0]
    assert rows % SAVE_RANKS and rows % LOAD_RANKS  # uneven shards both ways
    assert not torch.equal(sample_state(seed=1)["transformer.wte.weight"],
                           a["transformer.wte.weight"])


@pytest.mark.slow  # the saved / loaded fixtures spawn 2 and 3 ranks: 34 s + 42 s
def test_save_writes_what_the_ranks_planned(saved) -> None:
    path, plans = saved
    full = sample_state()
    plan = global_plan(plans)  # valid: no overlap, no gap
    assert [p.rank for p in plans] == [0, 1]
    assert set(plan.tensors) == set(full)
    assert set(plan.objects) == {"step", "config.lr", "config.name", "tag"}
    for fqn, t in full.items():
        entry = plan.tensors[fqn]
        assert entry.size == tuple(t.shape)
        assert entry.dtype == str(t.dtype).removeprefix("torch.")
        if fqn == REPLICATED:
            assert entry.chunks == (Chunk((0,), tuple(t.shape)),)
        else:
            assert entry.chunks == tuple(shard_chunk(t.shape, (2,), (r,), ["S0"])
                                         for r in range(SAVE_RANKS))
            assert entry.writers == (0, 1)
    # the checkpoint on disk has the same chunks, each in its writer's file
    layout = cl.inspect(path)
    assert isinstance(layout, cl.plan.DcpLayout)
    assert sorted(n for n, _ in layout.files) == ["__0_0.distcp", "__1_0.distcp"]
    for fqn, entry in plan.tensors.items():
        on_disk = sorted((i.chunk_offsets, i.chunk_sizes, i.file) for i in layout.items
                         if i.fqn == fqn)
        if fqn == REPLICATED:  # one copy; which rank writes it is the planner's choice
            assert [(o, s) for o, s, _ in on_disk] == [(c.offsets, c.sizes)
                                                      for c in entry.chunks]
        else:
            assert on_disk == sorted((c.offsets, c.sizes, f"__{r}_0.distcp")
                                     for c, r in zip(entry.chunks, entry.writers))


@pytest.mark.slow  # the saved / loaded fixtures spawn 2 and 3 ranks: 34 s + 42 s
def test_shard_map_of_the_real_checkpoint_matches_the_plan(saved) -> None:
    pytest.importorskip("plotly", reason="the shard map is a figure: the 'widgets' extra")
    from ckptlab.viz import shard_map_figure

    path, plans = saved
    layout, plan = cl.inspect(path), global_plan(plans)
    fqn = "transformer.wte.weight"
    from_disk = shard_map_figure(layout, fqn).layout.meta
    from_plan = shard_map_figure(plan, fqn).layout.meta
    assert [(c["offsets"], c["sizes"], c["rank"]) for c in from_disk["chunks"]] == \
        [(c["offsets"], c["sizes"], c["rank"]) for c in from_plan["chunks"]] == \
        [([0, 0], [19, 12], 0), ([19, 0], [18, 12], 1)]
    assert from_disk["chunks"][1]["where"].startswith("rank 1 · __1_0.distcp @ ")


@pytest.mark.slow  # the saved / loaded fixtures spawn 2 and 3 ranks: 34 s + 42 s
def test_resharded_load_is_bit_exact_on_every_rank(loaded) -> None:
    full = sample_state()
    assert [r["rank"] for r in loaded] == list(range(LOAD_RANKS))
    for result in loaded:
        assert result["exact"] == dict.fromkeys(full, True)
        assert result["objects"] == SAMPLE_OBJECTS
        for fqn, t in full.items():
            dim = 1 if t.ndim >= 2 and fqn != REPLICATED else 0
            placement = ["R"] if fqn == REPLICATED else [f"S{dim}"]
            box = shard_chunk(t.shape, (LOAD_RANKS,), (result["rank"],), placement)
            assert result["chunks"][fqn] == (box.offsets, box.sizes)
    wte = [r["chunks"]["transformer.wte.weight"][1] for r in loaded]
    assert wte == [(37, 4), (37, 4), (37, 4)]  # Shard(1): columns, 12 over 3


@pytest.mark.slow  # the saved / loaded fixtures spawn 2 and 3 ranks: 34 s + 42 s
def test_ckptlab_read_items_are_the_ones_torch_planned(saved, loaded) -> None:
    path, _ = saved
    layout = cl.inspect(path)
    saved_chunks = {fqn: [Chunk(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
                    for fqn, md in layout.metadata.state_dict_metadata.items()
                    if hasattr(md, "chunks")}
    for result in loaded:
        ours = []
        for fqn, (offsets, sizes) in result["chunks"].items():
            chunks = saved_chunks[fqn]
            for it in read_items(fqn, chunks, [Chunk(offsets, sizes)]):
                if it.numel == 0:
                    continue
                ours.append((fqn, chunks[it.storage_index].offsets, it.storage_offsets,
                             it.dest_offsets, it.lengths))
        theirs = [r for r in result["read_items"] if all(n for n in r[4])]
        assert sorted(ours) == theirs


def test_bad_placement_is_refused_before_any_collective() -> None:
    with pytest.raises(InvalidArgumentError, match="placement"):
        load_resharded(0, 1, "unused", "S9")


@pytest.mark.parametrize("sharding", ["fsdp", "fsdp+tp"])
@pytest.mark.parametrize("world_size", [8, 16, 64])
def test_simulated_chunks_match_simulate_plans(sharding: str, world_size: int) -> None:
    plans = simulate_plans("tiny", world_size, sharding=sharding)
    tensors, _ = state_shapes("tiny")
    for spec in tensors[::7]:
        expected = tuple(next(it.chunk for it in p.items if it.fqn == spec.fqn) for p in plans)
        assert simulated_chunks("tiny", spec.fqn, world_size, sharding=sharding) == expected
        assert simulated_chunks(CONFIGS["tiny"], spec.fqn, world_size,
                                sharding=sharding) == expected


def test_simulated_chunks_refuse_bad_arguments() -> None:
    fqn = "model.embed_tokens.weight"
    for kwargs in ({"config": "gpt-9", "fqn": fqn, "world_size": 8},
                   {"config": "tiny", "fqn": "nope", "world_size": 8},
                   {"config": "tiny", "fqn": fqn, "world_size": 0},
                   {"config": "tiny", "fqn": fqn, "world_size": 12, "sharding": "fsdp+tp"},
                   {"config": "tiny", "fqn": fqn, "world_size": 8, "sharding": "ddp"}):
        with pytest.raises(InvalidArgumentError):
            simulated_chunks(**kwargs)


def test_examples_import_no_ui_library() -> None:
    code = ("import sys, ckptlab.plan.examples\n"
            "bad = [m for m in ('ipywidgets', 'panel', 'plotly', 'IPython') if m in sys.modules]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
