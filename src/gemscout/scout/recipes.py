"""Recipes: the pieces of one training step that SCOUT replays, found in the model and scheduled by step.

* ``embedding`` — the token embedding: input ids → embeddings (backward: the embedding weight's gradient).
* ``hidden.<i>`` — block ``i`` of the repeated blocks: input activation → output activation (backward: input and
  parameter gradients from the captured output gradient).
* ``output`` — the final norm and the head on the final hidden state. Its backward starts from the gradient of the
  head's output captured during the real backward, so no loss function or targets are needed: the loss is part of
  the step that produced that gradient, and replaying norm + head from it checks the same arithmetic.
* ``optimizer.<j>`` — slice ``j`` of the parameters (whole parameters, at most ``optimizer_slice_numel`` elements,
  never across param groups): one update on private copies.

On a pipeline stage (``stage`` given, e.g. ``"pp1"``) the model is one stage's module: a recipe kind whose boundary
the stage does not hold is left out (stage 0 has no head, the last stage no embedding), and every name is qualified
by the stage (``pp1.hidden.0``, ``pp0.optimizer.0``) so recipes of different stages never share a name. A rank that
holds several stages passes an ``nn.ModuleList`` of them: each stage's recipes are named by its own stage.

The catalog is a pure function of the model's module tree, the optimizer's param groups and the config, so every
peer builds the same one; :meth:`Catalog.due` is a pure function of the step, so every peer picks the same recipes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gemscout._modules import unwrap  # re-exported: callers import it from here
from gemscout.errors import ConfigError
from gemscout.scout.boundaries import (
    find_blocks,
    find_first,
    find_last,
    find_last_norm,
    holds,
    resolve,
)
from gemscout.scout.config import ScoutConfig

__all__ = ["Catalog", "Recipe", "RecipeKind", "build_catalog", "optimizer_params", "unwrap"]


class RecipeKind(enum.StrEnum):
    """What a recipe replays."""

    EMBEDDING = "embedding"
    HIDDEN = "hidden"
    OUTPUT = "output"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """One replayable piece of a step. Names are stable across peers and runs: ``"hidden.2"``, ``"optimizer.0"``."""

    name: str
    """Recipe id used in verdicts and reports."""
    kind: RecipeKind
    """What it replays."""
    modules: tuple[str, ...] = ()
    """Module paths run in order (forward recipes); the first receives the captured inputs."""
    params: tuple[str, ...] = ()
    """Parameter names of an optimizer slice, in optimizer order."""
    group_index: int = 0
    """The optimizer param group of an optimizer slice."""

    @property
    def has_module(self) -> bool:
        """True for forward recipes (embedding, hidden, output)."""
        return self.kind is not RecipeKind.OPTIMIZER


def optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's parameters by stable name, in optimizer order: the model's name for the parameter, else
    ``group<g>.param<i>`` (a parameter the optimizer holds but the model does not)."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    return {
        names.get(id(p), f"group{g}.param{i}"): p
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
    }


def _optimizer_slices(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    bound: int,
    owner: Callable[[str], str] | None = None,
) -> list[Recipe]:
    """Slices of whole parameters in optimizer order, named ``optimizer.<j>``; with ``owner`` (parameter name →
    stage label) a slice never spans two owners and is named ``<owner>.optimizer.<j>``, ``j`` counted per owner."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    slices: list[Recipe] = []
    count: dict[str, int] = {}
    current: list[str] = []
    numel, group, label = 0, 0, ""

    def close() -> None:
        if current:
            j = count[label] = count.get(label, -1) + 1
            slices.append(
                Recipe(
                    name=f"{label}.optimizer.{j}" if label else f"optimizer.{j}",
                    kind=RecipeKind.OPTIMIZER,
                    params=tuple(current),
                    group_index=group,
                )
            )

    for name, param in optimizer_params(model, optimizer).items():
        g = group_of[id(param)]
        o = owner(name) if owner is not None else ""
        # A slice never spans param groups (its replay runs one group's hyper-parameters) nor stages.
        if current and (g != group or o != label or numel + param.numel() > bound):
            close()
            current, numel = [], 0
        current.append(name)
        numel += param.numel()
        group, label = g, o
    close()
    return slices


def build_catalog(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ScoutConfig,
    stage: str = "",
    chunk_labels: Sequence[str] = (),
) -> Catalog:
    """Find the recipe boundaries in ``model`` (DDP's ``.module`` is unwrapped) and list every recipe.

    ``stage``: this rank's pipeline stage label (``Topology.stage_label``); non-empty means ``model`` is one stage:
    kinds it has no boundary for are skipped and names are qualified by the label. ``chunk_labels``: ``model`` is an
    ``nn.ModuleList`` of this rank's stage modules (several stages per rank, ``Topology.chunk_labels``): each
    module's recipes are found in it and named by its own stage (``pp2.hidden.0``), and the optimizer is sliced per
    stage module (a slice never spans two). Raises ``ConfigError`` naming the field to set when an enabled recipe kind
    has no boundary in the model (outside a pipeline), when an override path does not exist, when ``optimizer`` is
    None but the optimizer recipe is enabled, or when a stage has no recipe.
    """
    model = unwrap(model)
    if chunk_labels:
        if not isinstance(model, nn.ModuleList) or len(model) != len(chunk_labels):
            raise ConfigError(
                f"SCOUT: {len(chunk_labels)} stages on this rank need an nn.ModuleList of that many "
                f"stage modules; got {type(model).__name__}"
            )
        recipes = _chunk_recipes(model, optimizer, config, chunk_labels)
    else:
        recipes = _recipes(model, optimizer, config, stage)
    if stage and not recipes:
        raise ConfigError(
            f"ScoutConfig.recipes: pipeline stage {stage} holds none of the recipe kinds "
            f"{list(config.recipes)}; enable 'optimizer' (every stage has parameters)"
        )
    return Catalog(tuple(recipes), config)


def _chunk_recipes(
    model: nn.ModuleList,
    optimizer: torch.optim.Optimizer | None,
    config: ScoutConfig,
    labels: Sequence[str],
) -> list[Recipe]:
    """Every stage module's forward recipes (paths through ``model``), then the optimizer slices, per stage."""
    paths = {id(m): name for name, m in model.named_modules()}
    recipes: list[Recipe] = []
    for chunk, label in zip(model, labels, strict=True):
        inner = unwrap(chunk)
        prefix = paths[id(inner)] + "."
        recipes += [
            dataclasses.replace(r, modules=tuple(prefix + m for m in r.modules))
            for r in _recipes(inner, None, config, label, optimizer_kind=False)
        ]
    if "optimizer" in config.recipes:
        if optimizer is None:
            raise ConfigError(
                "ScoutConfig.recipes: 'optimizer' needs the optimizer; pass it to attach() or drop it"
            )
        owner = {n: labels[int(n.split(".", 1)[0])] for n, _ in model.named_parameters()}
        recipes += _optimizer_slices(
            model,
            optimizer,
            config.optimizer_slice_numel,
            owner=lambda name: owner.get(name, labels[0]),
        )
    return recipes


def _recipes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ScoutConfig,
    stage: str,
    *,
    optimizer_kind: bool = True,
) -> list[Recipe]:
    enabled = set(config.recipes)
    if not optimizer_kind:
        enabled.discard("optimizer")
    if stage:
        # A stage holds part of the model: a kind is skipped when its override path is not in this stage, or when no
        # boundary for it is found here.
        if config.blocks is not None and not holds(model, config.blocks):
            enabled.discard("hidden")
        for kind, path in (("embedding", config.embedding), ("output", config.head)):
            if path is not None and not holds(model, path):
                enabled.discard(kind)
    recipes: list[Recipe] = []
    search_blocks = "hidden" in enabled or bool(config.blocks)
    if stage:  # always, when the stage has them: they bound where the embedding and the head are looked for
        search_blocks = config.blocks is None or holds(model, config.blocks)
    blocks = find_blocks(model, config) if search_blocks else None
    if stage:
        if blocks is None:
            enabled.discard("hidden")
        if config.embedding is None and find_first(model, (nn.Embedding,), blocks) is None:
            enabled.discard("embedding")
        if config.head is None and find_last(model, (nn.Linear,), blocks) is None:
            enabled.discard("output")
    if "embedding" in enabled:
        path = config.embedding or find_first(model, (nn.Embedding,), blocks)
        if path is None:
            raise ConfigError(
                "ScoutConfig.embedding: no nn.Embedding found in the model; name the embedding module "
                "(e.g. embedding='tok_embeddings') or drop 'embedding' from ScoutConfig.recipes"
            )
        resolve(model, path, "embedding")
        recipes.append(Recipe(name="embedding", kind=RecipeKind.EMBEDDING, modules=(path,)))
    if "hidden" in enabled:
        if blocks is None:
            raise ConfigError(
                "ScoutConfig.blocks: no nn.ModuleList of identical blocks found in the model; name it "
                "(e.g. blocks='layers') or drop 'hidden' from ScoutConfig.recipes"
            )
        keys = [
            key for key, _ in model.get_submodule(blocks).named_children()
        ]  # "0", "1", ... (list or dict)
        recipes += [
            Recipe(name=f"hidden.{i}", kind=RecipeKind.HIDDEN, modules=(f"{blocks}.{key}",))
            for i, key in enumerate(keys)
        ]
    if "output" in enabled:
        head = config.head or find_last(model, (nn.Linear,), blocks)
        if head is None:
            raise ConfigError(
                "ScoutConfig.head: no nn.Linear head found outside the blocks; name the head "
                "(e.g. head='lm_head') or drop 'output' from ScoutConfig.recipes"
            )
        resolve(model, head, "head")
        norm = config.norm or find_last_norm(model, blocks)
        if norm is not None:
            resolve(model, norm, "norm")
        recipes.append(
            Recipe(
                name="output",
                kind=RecipeKind.OUTPUT,
                modules=(head,) if norm is None else (norm, head),
            )
        )
    if "optimizer" in enabled:
        if optimizer is None:
            raise ConfigError(
                "ScoutConfig.recipes: 'optimizer' needs the optimizer; pass it to attach() or drop it"
            )
        recipes += _optimizer_slices(model, optimizer, config.optimizer_slice_numel)
    if stage:
        recipes = [dataclasses.replace(r, name=f"{stage}.{r.name}") for r in recipes]
    return recipes


class Catalog:
    """Every recipe of one model, and which of them are due at a step."""

    def __init__(self, recipes: tuple[Recipe, ...], config: ScoutConfig) -> None:
        self.recipes = recipes
        self.config = config
        self._by_name = {recipe.name: recipe for recipe in recipes}
        self._by_kind = {kind: [r for r in recipes if r.kind is kind] for kind in RecipeKind}

    @property
    def names(self) -> tuple[str, ...]:
        """Every recipe id, in replay order."""
        return tuple(self._by_name)

    def __getitem__(self, name: str) -> Recipe:
        return self._by_name[name]

    def __len__(self) -> int:
        return len(self.recipes)

    def fingerprint(self) -> int:
        """A signed 64-bit fingerprint of the recipe ids, modules and slices; equal on peers with equal catalogs."""
        text = json.dumps(
            [[r.name, list(r.modules), list(r.params), r.group_index] for r in self.recipes]
        )
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)

    def due(self, step: int) -> tuple[Recipe, ...]:
        """The recipes to replay at ``step``, in replay order. Pure: every peer gets the same answer.

        A kind with cadence ``k`` is due when ``step % k == 0``; its ``n``-th due step (``n = step // k``) takes the
        next ``per_cycle`` members of the kind, wrapping around, so every member comes up within
        ``ceil(len / per_cycle)`` consecutive due steps. With ``rotate_kinds`` the ``n``-th due step (``n = step //
        interval``) replays one kind only, the catalog's kinds in turn, and that kind's ``n // kinds``-th turn picks
        its members the same way.
        """
        if self.config.rotate_kinds:
            present = [kind for kind in RecipeKind if self._by_kind[kind]]
            if not present or step % self.config.cadence:
                return ()
            n = step // self.config.cadence
            return self._take(present[n % len(present)], n // len(present))
        out: list[Recipe] = []
        for kind in RecipeKind:
            every = self.config.interval_of(kind.value)
            if self._by_kind[kind] and not step % every:
                out += self._take(kind, step // every)
        return tuple(out)

    def _take(self, kind: RecipeKind, turn: int) -> tuple[Recipe, ...]:
        """The members of ``kind`` replayed at its ``turn``-th due step (every member with no per-cycle limit)."""
        members = self._by_kind[kind]
        take = {
            RecipeKind.HIDDEN: self.config.hidden_per_cycle,
            RecipeKind.OPTIMIZER: self.config.optimizer_slices_per_cycle,
        }.get(kind)
        if take is None or take >= len(members):
            return tuple(members)
        return tuple(members[(turn * take + j) % len(members)] for j in range(take))
