"""The plan explorer: simulated N-rank save plans, one tensor's shards, and a resharded load."""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as w
import plotly.graph_objects as go

from ckptlab.errors import InvalidArgumentError
from ckptlab.plan import CONFIGS, GlobalPlan, global_plan, simulate_plans
from ckptlab.plan.examples import simulated_chunks
from ckptlab.viz._style import human_nbytes
from ckptlab.viz.plan import rank_bytes_figure, reshard_figure, shard_map_figure
from ckptlab.widgets._figure import FigureWidget

__all__ = ["WORLD_SIZES", "PlanExplorer", "PlannedSave"]

WORLD_SIZES: tuple[int, ...] = tuple(2**k for k in range(3, 12))  # 8 .. 2048
SHARDINGS = ("fsdp", "fsdp+tp")


@dataclass(frozen=True, eq=False)
class PlannedSave:
    """One simulated save: the global plan and what it took to make it."""

    config: str
    world_size: int
    sharding: str
    plan: GlobalPlan
    simulate_seconds: float  # building every rank's local plan (simulate_plans)
    plan_seconds: float  # the coordinator's global step (global_plan)

    @property
    def items(self) -> int:
        """Write items after dedup, over all ranks."""
        return sum(len(p.items) for p in self.plan.plans)


def _replace(widget: go.FigureWidget, fig: go.Figure) -> None:
    """Show ``fig`` in ``widget``: its traces and its whole layout, in one update.

    Traces of the same types are restyled in place: removing every trace and adding new
    ones is two messages the front end must apply in order, and a view still drawing its
    first frame could be left with empty -1..6 axes. Only a change in the number or types of
    traces takes that path.
    """
    same = len(widget.data) == len(fig.data) and all(
        a.type == b.type for a, b in zip(widget.data, fig.data, strict=True))
    with widget.batch_update():
        if same:
            for old, new in zip(widget.data, fig.data, strict=True):
                props = new.to_plotly_json()
                props.pop("type", None)
                for stale in set(old.to_plotly_json()) - set(props) - {"type", "uid"}:
                    props[stale] = None  # unset what the new trace does not have
                old.update(props, overwrite=True)
        else:
            widget.data = ()
            widget.add_traces(fig.data)
        widget.layout = fig.layout


class PlanExplorer(w.VBox):
    """Simulated DCP save plans for a model on 8 to 2048 ranks, tensor by tensor.

    Pick a model (:data:`ckptlab.plan.CONFIGS`, with Adam's state), a world size and a
    sharding; the explorer simulates every rank's local plan, runs the coordinator's global
    step, and shows the bytes per rank, a summary, and the shard map of the picked tensor. A
    second world size is the target of a resharded load of that tensor: its saved chunks,
    the chunks each target rank loads, the read items and the read amplification.

    Each (model, world size, sharding) is simulated once per explorer (kept in
    :attr:`saves`); large models on thousands of ranks take seconds to a minute the first
    time.

    Parameters
    ----------
    config
        A :data:`~ckptlab.plan.CONFIGS` name.
    world_size, target
        Ranks that save, and ranks that load (each one of :data:`WORLD_SIZES`).
    sharding
        ``"fsdp"`` or ``"fsdp+tp"`` (see :func:`~ckptlab.plan.simulate_plans`).
    tensor
        The tensor shown first (default: the first one of the state dict).
    tp
        Tensor-parallel degree of ``"fsdp+tp"`` (every world size it is used with must be a
        multiple of it).
    world_sizes
        The choices of both sliders.

    Attributes
    ----------
    model, sharding, tensor : ipywidgets.Dropdown / ToggleButtons
    ranks, target : ipywidgets.SelectionSlider
    summary : ipywidgets.HTML
    shard_figure, bytes_figure, reshard_figure : plotly.graph_objects.FigureWidget
    saves : dict
        ``(config, world_size, sharding)`` -> :class:`PlannedSave`.
    current : PlannedSave
        The save shown.
    """

    def __init__(self, config: str = "tiny", world_size: int = 8, sharding: str = "fsdp", *,
                 tensor: str | None = None, target: int = 16, tp: int = 8,
                 world_sizes: Sequence[int] = WORLD_SIZES) -> None:
        world_sizes = list(world_sizes)
        if config not in CONFIGS:
            raise InvalidArgumentError(f"config must be one of {list(CONFIGS)}, got {config!r}")
        for name, value in (("world_size", world_size), ("target", target)):
            if value not in world_sizes:
                raise InvalidArgumentError(f"{name} must be one of {world_sizes}, got {value!r}")
        if sharding not in SHARDINGS:
            raise InvalidArgumentError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
        self.tp = tp
        self.saves: dict[tuple[str, int, str], PlannedSave] = {}
        self._busy = False
        self.model = w.Dropdown(options=list(CONFIGS), value=config, description="model")
        self.sharding = w.ToggleButtons(options=list(SHARDINGS), value=sharding,
                                        description="sharding")
        self.ranks = w.SelectionSlider(options=world_sizes, value=world_size,
                                       description="save on", continuous_update=False,
                                       layout=w.Layout(width="60%"))
        self.summary = w.HTML()
        self.tensor = w.Dropdown(options=[], description="tensor",
                                 layout=w.Layout(width="70%"))
        self.target = w.SelectionSlider(options=world_sizes, value=target,
                                        description="load on", continuous_update=False,
                                        layout=w.Layout(width="60%"))
        self.current = self._planned(config, world_size, sharding)
        names = list(self.current.plan.tensors)
        if tensor is not None and tensor not in names:
            raise InvalidArgumentError(f"no tensor {tensor!r} in {config}'s state dict")
        self.tensor.options = names
        self.tensor.value = tensor if tensor is not None else names[0]
        self.shard_figure = FigureWidget(shard_map_figure(self.current.plan,
                                                             self.tensor.value))
        self.bytes_figure = FigureWidget(rank_bytes_figure(self.current.plan))
        self.reshard_figure = FigureWidget(self._reshard())
        self.summary.value = self._summary()
        for control in (self.model, self.sharding, self.ranks):
            control.observe(self._on_save, names="value")
        self.tensor.observe(self._on_tensor, names="value")
        self.target.observe(self._on_target, names="value")
        super().__init__([
            w.HBox([self.model, self.sharding]), self.ranks, self.summary, self.bytes_figure,
            self.tensor, self.shard_figure, self.target, self.reshard_figure])
        self.add_class("ckptlab-plan-explorer")

    # -- core calls, cached -------------------------------------------------------------------
    def _planned(self, config: str, world_size: int, sharding: str) -> PlannedSave:
        key = (config, world_size, sharding)
        saved = self.saves.get(key)
        if saved is None:
            t0 = time.perf_counter()
            local = simulate_plans(config, world_size, sharding=sharding, tp=self.tp)
            t1 = time.perf_counter()
            plan = global_plan(local)
            t2 = time.perf_counter()
            saved = self.saves[key] = PlannedSave(config, world_size, sharding, plan, t1 - t0,
                                                  t2 - t1)
        return saved

    def _reshard(self) -> go.Figure:
        cur, fqn = self.current, self.tensor.value
        entry = cur.plan.tensors[fqn]
        wanted = simulated_chunks(cur.config, fqn, self.target.value, sharding=cur.sharding,
                                  tp=self.tp)
        return reshard_figure(fqn, entry.size, entry.chunks, wanted, dtype=entry.dtype,
                              saved_ranks=entry.writers)

    # -- events -------------------------------------------------------------------------------
    def _on_save(self, change: dict[str, Any]) -> None:
        if not self._busy:
            self.show(config=self.model.value, world_size=self.ranks.value,
                      sharding=self.sharding.value)

    def _on_tensor(self, change: dict[str, Any]) -> None:
        if not self._busy and change["new"] is not None:
            self.show(tensor=change["new"])

    def _on_target(self, change: dict[str, Any]) -> None:
        if not self._busy:
            self.show(target=change["new"])

    def show(self, *, config: str | None = None, world_size: int | None = None,
             sharding: str | None = None, tensor: str | None = None,
             target: int | None = None) -> None:
        """Show another save, tensor or load target (controls and figures follow).

        Parameters
        ----------
        config, world_size, sharding
            The save; a new one is simulated and planned (once: see :attr:`saves`).
        tensor
            The tensor of the shard map and the reshard view; after a change of model the
            same name is kept when the new model has it, else the first tensor is shown.
        target
            The world size of the resharded load.
        """
        config = self.current.config if config is None else config
        world_size = self.current.world_size if world_size is None else world_size
        sharding = self.current.sharding if sharding is None else sharding
        target = self.target.value if target is None else target
        if config not in CONFIGS:
            raise InvalidArgumentError(f"config must be one of {list(CONFIGS)}, got {config!r}")
        if sharding not in SHARDINGS:
            raise InvalidArgumentError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
        for name, value in (("world_size", world_size), ("target", target)):
            if value not in self.ranks.options:
                raise InvalidArgumentError(
                    f"{name} must be one of {list(self.ranks.options)}, got {value!r}")
        new_save = (config, world_size, sharding) != (
            self.current.config, self.current.world_size, self.current.sharding)
        self._busy = True
        try:
            self.model.value, self.ranks.value, self.sharding.value = config, world_size, sharding
            self.target.value = target
            if new_save:
                self.summary.value = (f"<i>simulating {html.escape(config)} on {world_size:,} "
                                      f"ranks ({html.escape(sharding)})…</i>")
                self.current = self._planned(config, world_size, sharding)
                names = list(self.current.plan.tensors)
                keep = tensor if tensor is not None else self.tensor.value
                if list(self.tensor.options) != names:
                    self.tensor.options = names
                self.tensor.value = keep if keep in names else names[0]
                _replace(self.bytes_figure, rank_bytes_figure(self.current.plan))
                self.summary.value = self._summary()
            elif tensor is not None:
                if tensor not in self.current.plan.tensors:
                    raise InvalidArgumentError(
                        f"no tensor {tensor!r} in {config}'s state dict")
                self.tensor.value = tensor
            if new_save or tensor is not None:
                _replace(self.shard_figure, shard_map_figure(self.current.plan,
                                                             self.tensor.value))
            _replace(self.reshard_figure, self._reshard())
        finally:
            self._busy = False

    def _summary(self) -> str:
        cur = self.current
        plan = cur.plan
        heavy = max(range(plan.world_size), key=lambda r: plan.rank_nbytes[r])
        return (f'<div class="ckptlab-plan-summary"><b>{html.escape(cur.config)}</b> with Adam '
                f"on <b>{cur.world_size:,}</b> ranks ({html.escape(cur.sharding)}) · "
                f"{cur.items:,} write items after dedup · {len(plan.tensors):,} tensors, "
                f"{len(plan.objects)} pickled objects · {human_nbytes(plan.nbytes)} · "
                f"imbalance {plan.imbalance:.3f} (heaviest rank {heavy}: "
                f"{human_nbytes(plan.rank_nbytes[heavy])}) · local plans "
                f"{1e3 * cur.simulate_seconds:,.1f} ms, global plan "
                f"{1e3 * cur.plan_seconds:,.1f} ms</div>")
