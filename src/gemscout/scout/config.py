"""SCOUT's configuration: which recipes run, how often, where their boundaries are, and how long a cycle may wait."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from gemscout.config import require, strict_fields
from gemscout.scout.comm_probe import CommProbeConfig
from gemscout.scout.stragglers import StragglerConfig

__all__ = ["RECIPE_KINDS", "ScoutConfig"]

RECIPE_KINDS: tuple[str, ...] = ("embedding", "hidden", "output", "optimizer")
DEFAULT_MIN_CADENCE = 10
"""With ``ScoutConfig(interval=None)``, SCOUT's cadence is the smallest multiple of the capture interval >= this."""
"""Every recipe kind, in the order a cycle replays them."""


def _is_int(value: object) -> bool:
    return type(value) is int


@strict_fields
@dataclass(kw_only=True, slots=True, frozen=True)
class ScoutConfig:
    """How SCOUT captures and replays recipes. Every field is validated; a bad value raises ``ConfigError`` naming it.

    A step ``s`` is due for a recipe kind when ``s % interval_of(kind) == 0``. At a due step one cycle replays, for
    each due kind, the recipes the rotation picks for ``s`` (a pure function of ``s``, so every rank picks the same).
    """

    interval: int | None = None
    """SCOUT's cadence in optimizer steps: a cycle runs at steps divisible by it. ``None`` (default): chosen by
    ``enable_resiliency`` as the smallest multiple of the session's capture ``interval`` that is at least
    :data:`DEFAULT_MIN_CADENCE` (10) steps — GEMINI's default is a capture at every step, and a cycle replays a
    real slice of the step's work (one block's forward and backward, the output, an optimizer slice), so replaying
    at every step costs a large fraction of a step (docs/scout.md, "Healthy path"). An int >= 1: that cadence; with
    ``enable_resiliency`` it must be a multiple of the session's ``interval`` (a cycle runs where GEMINI captures,
    so the clean cycle can certify that capture). A ``Scout`` used without a session reads ``None`` as 1."""
    recipe_intervals: Mapping[str, int] = field(default_factory=dict, hash=False)
    """Per-kind cadence overrides, e.g. ``{"optimizer": 4}``; keys among :data:`RECIPE_KINDS`, values ints >= 1."""
    recipes: tuple[str, ...] = RECIPE_KINDS
    """Recipe kinds to run (non-empty subset of :data:`RECIPE_KINDS`)."""
    hidden_per_cycle: int | None = 1
    """Blocks replayed per due step, rotating through the blocks; None replays every block at every due step."""
    optimizer_slices_per_cycle: int | None = 1
    """Optimizer slices replayed per due step, rotating; None replays every slice at every due step."""
    rotate_kinds: bool = False
    """Replay one recipe kind per due step, the catalog's kinds in turn (embedding, hidden, output, optimizer),
    instead of every kind at every due step: a cycle costs roughly a quarter (what is replayed is one kind's
    recipes), and certification waits that many times more due steps (every recipe must still pass clean, see
    :mod:`~gemscout.scout.rotation`). Not with ``recipe_intervals``, nor on pipeline stages (their catalogs differ)."""
    optimizer_slice_numel: int = 1 << 16
    """Upper bound on the elements of one optimizer slice (whole parameters; a larger parameter is a slice alone)."""
    embedding: str | None = None
    """Module path of the token embedding (relative to the model under DDP's ``.module``); None: the first
    ``nn.Embedding``."""
    blocks: str | None = None
    """Module path of the ``nn.ModuleList`` of repeated blocks; None: the largest list of identical modules."""
    norm: str | None = None
    """Module path of the final norm before the head; None: the last norm module outside the blocks (if any)."""
    head: str | None = None
    """Module path of the output head; None: the last ``nn.Linear`` outside the blocks."""
    data_parallel_dims: tuple[str, ...] | None = None
    """On a DeviceMesh: the names of its data-parallel dims (peers differ only along them). None: the dims of every
    ``fully_shard`` module's mesh (none when the model has no FSDP module, e.g. pure TP). Set it for a mesh used
    without FSDP, e.g. ``("dp",)`` for DDP over the dp dim of a (dp, tp) mesh."""
    mesh: Any = field(default=None, hash=False, compare=False)
    """The DeviceMesh of a pipeline job: a stage with plain parameters replicated along ``data_parallel_dims`` by DDP
    or an all-reduce, or a stage ``fully_shard``ed / TP-sharded on a sub-mesh of it (then it must be that root mesh).
    None: read the mesh from DTensor parameters, or none. Its other dims that no parameter lives on are pipeline dims:
    ranks with different coordinates there hold different modules, so recipe names are qualified by the stage
    (``pp1.hidden.0``) and only ranks of the same stage are compared (docs/torchrun.md)."""
    stage_order: str = "loop"
    """With ``mesh``, the stages a rank holds when it gives an ``nn.ModuleList`` of several stage modules, in list
    order: ``"loop"`` (the rank at pipeline coordinate ``c`` of ``n`` holds ``c, c + n, c + 2n, ...``: Interleaved
    1F1B, Looped BFS, Interleaved Zero Bubble) or ``"v"`` (two stages, ``c`` and ``2n - 1 - c``: ZBV Zero Bubble,
    DualPipeV)."""
    timeout: timedelta = timedelta(seconds=120)
    """Bound on every collective of a cycle; a peer that misses it raises ``CollectiveTimeout``."""
    stragglers: StragglerConfig | None = field(default_factory=StragglerConfig)
    """Thresholds for the compute-straggler detectors fed with replay times (one per recipe); None disables them."""
    comm_probe: CommProbeConfig | None = None
    """Probe collectives on overlapping groups to find communication stragglers (None: off)."""
    job_collectives: bool = False
    """Time the job's own collectives and report a rank that is late to them as a communication straggler with its
    host, judged with ``stragglers``' margins: DDP's gradient all-reduces (a comm hook that scales and reduces exactly
    as DDP does; DDP takes one comm hook, so it is skipped, with a log line, when the model already has one) or FSDP2's
    all-gathers and reduce-scatters (its custom-comm seam, lateness judged within each shard group; HSDP's replica
    all-reduce is not timed). ``enable_resiliency`` installs it on a DDP or ``fully_shard`` model. Off by default:
    on a loaded host, scheduling noise alone makes ranks late by
    more than the default 2 ms margin — raise ``StragglerConfig.absolute_margin_s`` to what your network's jitter is."""

    def __post_init__(self) -> None:
        c = "ScoutConfig"
        require(
            self.interval is None or (_is_int(self.interval) and self.interval >= 1),
            c,
            "interval",
            f"must be None (chosen by enable_resiliency) or an int >= 1, got {self.interval!r}",
        )
        require(
            isinstance(self.recipe_intervals, Mapping),
            c,
            "recipe_intervals",
            f"must be a mapping of recipe kind to int, got {type(self.recipe_intervals).__name__}",
        )
        for kind, every in self.recipe_intervals.items():
            require(
                kind in RECIPE_KINDS,
                c,
                "recipe_intervals",
                f"unknown kind {kind!r}; use one of {RECIPE_KINDS}",
            )
            require(
                _is_int(every) and every >= 1,
                c,
                "recipe_intervals",
                f"[{kind!r}] must be an int >= 1, got {every!r}",
            )
        object.__setattr__(
            self, "recipe_intervals", types.MappingProxyType(dict(self.recipe_intervals))
        )
        require(
            type(self.rotate_kinds) is bool,
            c,
            "rotate_kinds",
            f"must be True or False, got {self.rotate_kinds!r}",
        )
        require(
            not (self.rotate_kinds and self.recipe_intervals),
            c,
            "rotate_kinds",
            "cannot be combined with recipe_intervals (one cadence, the kinds in turn); drop one of them",
        )
        require(
            isinstance(self.recipes, tuple | list) and len(self.recipes) > 0,
            c,
            "recipes",
            f"must be a non-empty tuple drawn from {RECIPE_KINDS}, got {self.recipes!r}",
        )
        unknown = [kind for kind in self.recipes if kind not in RECIPE_KINDS]
        require(
            not unknown, c, "recipes", f"unknown kind(s) {unknown}; use kinds from {RECIPE_KINDS}"
        )
        require(
            len(set(self.recipes)) == len(self.recipes),
            c,
            "recipes",
            f"lists a kind twice: {self.recipes!r}",
        )
        # Canonical order: the cycle's replay order (and so every rank's) never depends on how the user listed them.
        object.__setattr__(
            self, "recipes", tuple(kind for kind in RECIPE_KINDS if kind in self.recipes)
        )
        for name in ("hidden_per_cycle", "optimizer_slices_per_cycle"):
            value = getattr(self, name)
            require(
                value is None or (_is_int(value) and value >= 1),
                c,
                name,
                f"must be None (all) or an int >= 1, got {value!r}",
            )
        require(
            _is_int(self.optimizer_slice_numel) and self.optimizer_slice_numel >= 1,
            c,
            "optimizer_slice_numel",
            f"must be an int >= 1 (e.g. 65536), got {self.optimizer_slice_numel!r}",
        )
        for name in ("embedding", "blocks", "norm", "head"):
            value = getattr(self, name)
            require(
                value is None or (isinstance(value, str) and value.strip() != ""),
                c,
                name,
                f"must be None (discover) or a module path such as 'model.layers', got {value!r}",
            )
        dims = self.data_parallel_dims
        require(
            dims is None
            or (
                isinstance(dims, tuple | list)
                and len(dims) > 0
                and all(isinstance(d, str) and d for d in dims)
            ),
            c,
            "data_parallel_dims",
            f"must be None (from fully_shard) or a non-empty tuple of mesh dim names such as ('dp',), got {dims!r}",
        )
        require(
            self.mesh is None
            or (hasattr(self.mesh, "mesh_dim_names") and hasattr(self.mesh, "mesh")),
            c,
            "mesh",
            f"must be None or a torch DeviceMesh (init_device_mesh(...)), got {type(self.mesh).__name__}",
        )
        if dims is not None:
            object.__setattr__(self, "data_parallel_dims", tuple(dims))
        require(
            self.stage_order in ("loop", "v"),
            c,
            "stage_order",
            f"must be 'loop' (interleaved / looped schedules) or 'v' (ZBV, DualPipeV), got {self.stage_order!r}",
        )
        require(
            isinstance(self.timeout, timedelta) and self.timeout.total_seconds() > 0,
            c,
            "timeout",
            f"must be a positive datetime.timedelta, got {self.timeout!r}",
        )
        require(
            self.stragglers is None or isinstance(self.stragglers, StragglerConfig),
            c,
            "stragglers",
            f"must be a StragglerConfig or None, got {type(self.stragglers).__name__}",
        )
        require(
            type(self.job_collectives) is bool,
            c,
            "job_collectives",
            f"must be True or False, got {self.job_collectives!r}",
        )
        require(
            not self.job_collectives or self.stragglers is not None,
            c,
            "job_collectives",
            "needs stragglers=StragglerConfig(...) (its margins judge who is late); stragglers is None",
        )

    @property
    def cadence(self) -> int:
        """:attr:`interval`, with ``None`` read as 1 (``enable_resiliency`` replaces ``None`` before SCOUT starts)."""
        return self.interval or 1

    def interval_of(self, kind: str) -> int:
        """The cadence of ``kind``: its override, else :attr:`cadence`."""
        return self.recipe_intervals.get(kind, self.cadence)
