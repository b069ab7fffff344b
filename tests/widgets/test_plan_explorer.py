"""PlanExplorer without a browser: move the controls the way a user does and check that the
figures show what the pure builders make for the new choice."""

from __future__ import annotations

import pytest

from ckptlab.errors import InvalidArgumentError
from ckptlab.plan import global_plan, simulate_plans
from ckptlab.plan.examples import simulated_chunks
from ckptlab.viz import rank_bytes_figure, reshard_figure, shard_map_figure
from ckptlab.widgets import PlanExplorer
from ckptlab.widgets.plan import WORLD_SIZES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"


def _expected_reshard(explorer: PlanExplorer) -> dict:
    cur = explorer.current
    fqn = explorer.tensor.value
    entry = cur.plan.tensors[fqn]
    wanted = simulated_chunks(cur.config, fqn, explorer.target.value, sharding=cur.sharding)
    return reshard_figure(fqn, entry.size, entry.chunks, wanted, dtype=entry.dtype,
                          saved_ranks=entry.writers).layout.meta


@pytest.fixture
def explorer() -> PlanExplorer:
    return PlanExplorer()


def test_starts_small(explorer) -> None:
    assert (explorer.model.value, explorer.ranks.value, explorer.sharding.value) == \
        ("tiny", 8, "fsdp")
    assert list(explorer.ranks.options) == list(WORLD_SIZES) == [2**k for k in range(3, 12)]
    assert explorer.tensor.value == EMBED and explorer.target.value == 16
    plan = explorer.current.plan
    assert list(explorer.tensor.options) == list(plan.tensors)
    assert explorer.shard_figure.layout.meta == shard_map_figure(plan, EMBED).layout.meta
    assert explorer.bytes_figure.layout.meta == rank_bytes_figure(plan).layout.meta
    assert explorer.reshard_figure.layout.meta == _expected_reshard(explorer)
    assert set(explorer.saves) == {("tiny", 8, "fsdp")}
    summary = explorer.summary.value
    assert f"{explorer.current.items:,} write items" in summary
    assert f"imbalance {plan.imbalance:.3f}" in summary and "global plan" in summary


def test_world_size_changes_the_plan_and_the_figures(explorer) -> None:
    first = explorer.current
    explorer.ranks.value = 64
    cur = explorer.current
    assert cur.world_size == 64 and cur.plan.world_size == 64
    meta = explorer.bytes_figure.layout.meta
    assert meta["world_size"] == 64 and sum(meta["rank_nbytes"]) == cur.plan.nbytes
    assert len(explorer.shard_figure.layout.meta["chunks"]) == 64
    assert explorer.shard_figure.layout.meta == shard_map_figure(cur.plan, EMBED).layout.meta
    assert explorer.reshard_figure.layout.meta == _expected_reshard(explorer)
    assert len(explorer.reshard_figure.layout.meta["saved"]) == 64
    assert "<b>64</b> ranks" in explorer.summary.value
    # back to 8: the cached save, not a new simulation
    explorer.ranks.value = 8
    assert explorer.current is first
    assert set(explorer.saves) == {("tiny", 8, "fsdp"), ("tiny", 64, "fsdp")}
    assert explorer.bytes_figure.layout.meta["world_size"] == 8


def test_tensor_pick_updates_shard_map_and_reshard_only(explorer) -> None:
    bytes_meta = explorer.bytes_figure.layout.meta
    explorer.tensor.value = NORM
    assert explorer.shard_figure.layout.meta["fqn"] == NORM
    assert explorer.shard_figure.layout.meta["grid"] == [1, 64]
    assert explorer.reshard_figure.layout.meta["fqn"] == NORM
    assert explorer.reshard_figure.layout.meta == _expected_reshard(explorer)
    assert explorer.bytes_figure.layout.meta == bytes_meta


def test_reshard_target_updates_the_reshard_view(explorer) -> None:
    shard_meta = explorer.shard_figure.layout.meta
    for target in (8, 32, 2048):
        explorer.target.value = target
        meta = explorer.reshard_figure.layout.meta
        assert len(meta["wanted"]) == target
        assert meta == _expected_reshard(explorer)
    assert explorer.shard_figure.layout.meta == shard_meta
    explorer.target.value = 8  # the same sharding: every rank loads exactly its saved chunk
    assert explorer.reshard_figure.layout.meta["amplification"] == 1.0
    assert explorer.reshard_figure.layout.meta["read_items"] == 8
    explorer.target.value = 16  # 125 rows saved, 63 loaded: some loads straddle two chunks
    assert explorer.reshard_figure.layout.meta["amplification"] > 1.0


def test_sharding_and_model_switch(explorer) -> None:
    explorer.sharding.value = "fsdp+tp"
    explorer.tensor.value = "model.layers.0.self_attn.o_proj.weight"
    meta = explorer.shard_figure.layout.meta
    assert meta["cells"] == [1, 8]  # one row of fsdp ranks, 8 tp columns
    explorer.tensor.value = "lm_head.weight"
    explorer.model.value = "llama3-1b"  # tied embeddings: no lm_head, so the first tensor
    cur = explorer.current
    assert (cur.config, cur.world_size, cur.sharding) == ("llama3-1b", 8, "fsdp+tp")
    assert explorer.tensor.value == EMBED and "lm_head.weight" not in explorer.tensor.options
    assert explorer.shard_figure.layout.meta["size"] == [128256, 2048]
    expected = global_plan(simulate_plans("llama3-1b", 8, sharding="fsdp+tp"))
    assert explorer.bytes_figure.layout.meta["rank_nbytes"] == list(expected.rank_nbytes)
    explorer.tensor.value = NORM
    explorer.model.value = "tiny"  # the name exists in both: kept
    assert explorer.tensor.value == NORM
    assert explorer.shard_figure.layout.meta["fqn"] == NORM


def test_show_sets_the_controls(explorer) -> None:
    explorer.show(world_size=16, tensor=NORM, target=32)
    assert (explorer.ranks.value, explorer.tensor.value, explorer.target.value) == (16, NORM, 32)
    assert explorer.shard_figure.layout.meta["fqn"] == NORM
    assert len(explorer.shard_figure.layout.meta["chunks"]) == 16
    assert len(explorer.reshard_figure.layout.meta["wanted"]) == 32
    for bad in ({"world_size": 12}, {"target": 3}, {"config": "gpt-9"}, {"sharding": "ddp"},
                {"tensor": "nope"}):
        with pytest.raises(InvalidArgumentError):
            explorer.show(**bad)


def test_bad_arguments() -> None:
    for kwargs in ({"config": "gpt-9"}, {"world_size": 7}, {"target": 5}, {"sharding": "x"},
                   {"tensor": "nope"}):
        with pytest.raises(InvalidArgumentError):
            PlanExplorer(**kwargs)


def _traces(fig) -> list[dict]:
    """The traces as JSON data (typed arrays decoded), uids left out."""
    import json

    import plotly.io as pio

    out = json.loads(pio.to_json(fig, validate=False))["data"]
    for t in out:
        t.pop("uid", None)
    return out


def test_figures_after_moves_are_the_builders_figures(explorer) -> None:
    """Restyled in place or replaced, each figure's traces are exactly the fresh figure's,
    with nothing left over from the figure before."""
    for move in ({"world_size": 64}, {"tensor": NORM}, {"target": 8}, {"world_size": 8}):
        explorer.show(**move)
        cur = explorer.current
        fqn = explorer.tensor.value
        entry = cur.plan.tensors[fqn]
        wanted = simulated_chunks(cur.config, fqn, explorer.target.value, sharding=cur.sharding)
        assert _traces(explorer.bytes_figure) == _traces(rank_bytes_figure(cur.plan)), move
        assert _traces(explorer.shard_figure) == _traces(shard_map_figure(cur.plan, fqn)), move
        assert _traces(explorer.reshard_figure) == _traces(reshard_figure(
            fqn, entry.size, entry.chunks, wanted, dtype=entry.dtype,
            saved_ranks=entry.writers)), move
