"""SCOUT's forward recipes under DeepSpeed ZeRO-3: replay on the gathered parameters of the replayed blocks.

Under ZeRO-3 a block's parameters are empty placeholders outside DeepSpeed's forward and backward; at the step
pre-hook, where the SCOUT cycle runs, the non-persistent ones are partitioned again. :class:`Zero3Scout` is the
default :class:`~gemscout.scout.engine.Scout` on a :class:`Zero3Domain`: the flat data-parallel peer domain
(:class:`~gemscout.scout.domain.FlatDomain`) with two additions:

- around each cycle it all-gathers the parameters of the due recipes' modules that are not available (DeepSpeed's
  own ``param.all_gather`` over the parameters' partition group, the collective ``GatheredParameters`` uses; every
  rank gathers the same list, since the due recipes and the persistence of each parameter are the same on every
  rank), and partitions them again afterwards without writing anything back. Inside the cycle the blocks hold
  their full weights: the precondition digest and the replay see what the real forward saw;
- during a replay it detaches DeepSpeed's forward hooks from the replayed modules (they would fetch and release
  parameters and register the gradient reduction on the live module); every other hook stays, a user's
  module hook (a persistent fault) included.

Peers are every rank of the data-parallel group (ZeRO-3 replicates the computation: every rank runs the whole
model on its own micro-batch), compared by strict majority as for DDP. The optimizer recipe is not built for
ZeRO-3 (the fp32 partitions are not in the torch optimizer's param groups outside DeepSpeed's step): asking for it
raises ConfigError at attach.

Nothing here imports deepspeed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemscout.scout.config import ScoutConfig
from gemscout.scout.domain import FlatDomain
from gemscout.scout.engine import Scout
from gemscout.scout.materialize import without_wrapper_hooks
from gemscout.scout.recipes import Recipe
from gemscout.topology import Topology

__all__ = ["Zero3Domain", "Zero3Scout"]


def _owned_by_deepspeed(hook: Any) -> bool:
    return str(getattr(hook, "__module__", "") or "").startswith("deepspeed.")


class Zero3Domain(FlatDomain):
    """The data-parallel group of a ZeRO-3 engine: a flat peer domain whose due blocks are gathered around the cycle
    and replayed without DeepSpeed's forward hooks (see the module doc)."""

    @contextlib.contextmanager
    def scope(
        self, due: Sequence[Recipe], modules: Mapping[str, Sequence[nn.Module]]
    ) -> Iterator[None]:
        """Collective over the partition group when some due block's parameters are partitioned: gather them for
        the cycle, partition them again afterwards (nothing is written back)."""
        seen: set[int] = set()
        gather: list[nn.Parameter] = []
        for recipe in due:
            for module in modules.get(recipe.name, ()) if recipe.has_module else ():
                for p in module.parameters():
                    status = getattr(getattr(p, "ds_status", None), "name", None)
                    if id(p) not in seen and status == "NOT_AVAILABLE":
                        seen.add(id(p))
                        gather.append(p)
        if not gather:
            yield
            return
        gather[0].all_gather(param_list=gather)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            gather[0].partition(param_list=gather, has_been_updated=False)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def replaying(self, recipe: Recipe, modules: Sequence[nn.Module]) -> Iterator[None]:
        with without_wrapper_hooks(modules, owned_by=_owned_by_deepspeed):
            yield


class Zero3Scout(Scout):
    """SCOUT on a DeepSpeed ZeRO-3 engine's module (see the module doc): a :class:`Scout` on a
    :class:`Zero3Domain`, attached to the engine's module."""

    def __init__(self, config: ScoutConfig | None = None) -> None:
        super().__init__(config, flat_domain=Zero3Domain)

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        group: dist.ProcessGroup | None = None,
        topology: Topology | None = None,
        first_step: int = 1,
    ) -> Scout:
        root = getattr(
            model, "zero3_module", model
        )  # the adapter's state view holds the engine's module
        return super().attach(
            root, optimizer, group=group, topology=topology, first_step=first_step
        )
