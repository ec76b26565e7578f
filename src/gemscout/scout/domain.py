"""Where a SCOUT cycle's peers live and what crosses them: the peer-domain protocol, and its flat (DDP) form.

The cycle (:mod:`~gemscout.scout.engine`) is the same on every topology: agree, send the source's inputs, replay,
gather the records, judge each recipe over the peer groups that replayed it, report. What differs is who takes
part in each collective and what must be gathered first, and that is the domain's:

- :class:`FlatDomain`: one group of replicas (DDP, DeepSpeed ZeRO's data-parallel group). Every rank is a peer of
  every other; nothing is gathered, nothing crosses groups.
- :class:`~gemscout.scout.mesh_domain.MeshDomain`: a DeviceMesh (FSDP2, HSDP, TP, pipeline stages), one peer
  group per model-parallel coordinate, with the mesh-wide collectives that cross them.
- a framework's own refinement of one of those, e.g. DeepSpeed ZeRO-3's
  (:class:`~gemscout.adapters.deepspeed.zero3_scout.Zero3Domain`), which gathers the partitioned parameters of the
  due blocks around the cycle and detaches DeepSpeed's hooks during a replay.

Every method that says *collective* is called by every rank of the domain, in the same order, whatever its local
state; every other method is pure or local.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from gemscout.errors import ConfigError
from gemscout.reports import FaultReport
from gemscout.scout.capture import Captured
from gemscout.scout.comm_probe import JobCollectiveTimer
from gemscout.scout.exchange import PeerExchange
from gemscout.scout.fsdp_comms import FsdpCollectiveTimer
from gemscout.scout.recipes import Catalog, Recipe
from gemscout.scout.stragglers import StragglerConfig

__all__ = ["JOB_TIMER_NEEDS", "FlatDomain", "PeerDomain"]

JOB_TIMER_NEEDS = (
    "Scout.time_job_collectives: needs a DDP or FSDP2 model (no pipeline stages) and "
    "ScoutConfig.stragglers"
)
"""The ``ConfigError`` a domain raises when it cannot time the job's own collectives."""


class PeerDomain(Protocol):
    """The peers of one rank's SCOUT cycle and the collectives that run across them."""

    peers: tuple[int, ...]
    """This rank's peer group (global ranks); the step's source is ``peers[step % len(peers)]``."""
    peer_groups: tuple[tuple[int, ...], ...]
    """Every peer group of the domain (one for a flat group)."""
    exchange: PeerExchange
    """The cycle's collectives over this rank's peer group (:mod:`~gemscout.scout.exchange`)."""
    job_names: tuple[str, ...]
    """Every recipe id certification must see clean, in a fixed order (set by :meth:`plan`)."""
    collective_recipes: frozenset[str]
    """Recipes whose replay runs collectives of its own (timed apart from compute)."""
    stops_on_wire_error: bool
    """Whether a disagreement in the inputs' hello ends the cycle at once (True where no collective of the cycle
    crosses peer groups; a mesh goes on so every group still meets the mesh-wide gathers)."""
    job_collectives: str
    """What the job's own collectives are, in reports (``"DDP gradient all-reduce"``)."""

    def plan(self, catalog: Catalog, modules: Mapping[str, Sequence[nn.Module]]) -> None:
        """At attach: read the catalog (which recipes replay with collectives, the job-wide recipe ids)."""
        ...

    def scope(
        self, due: Sequence[Recipe], modules: Mapping[str, Sequence[nn.Module]]
    ) -> contextlib.AbstractContextManager[None]:
        """Around the whole cycle of a due step (after nothing is skipped: collective where it does anything)."""
        ...

    def agree(self, step: int, fingerprint: int) -> str | None:
        """Collective: why the domain must stop before the inputs are sent (peers off by a step), or None."""
        ...

    def gather_slices(
        self,
        due: Sequence[Recipe],
        params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        step: int,
    ) -> dict[str, tuple[Captured, float]]:
        """Collective: this rank's inputs of the due optimizer recipes gathered whole, with the seconds, by
        name; ``{}`` where every peer already holds them whole."""
        ...

    def blocked(
        self, due: Sequence[Recipe], received: Mapping[str, Captured], wire_error: str | None
    ) -> dict[str, str]:
        """Collective: the due recipes no rank may replay, and why (a replay with collectives needs everyone)."""
        ...

    def gather_params(
        self, recipe: Recipe, modules: Sequence[nn.Module]
    ) -> tuple[list[dict[str, torch.Tensor]] | None, float | None]:
        """Collective: a forward recipe's parameters gathered whole and the seconds, or ``(None, None)`` where
        the live parameters are already whole."""
        ...

    def replaying(
        self, recipe: Recipe, modules: Sequence[nn.Module]
    ) -> contextlib.AbstractContextManager[None]:
        """Around this rank's replay of ``recipe`` (local)."""
        ...

    def gather_records(
        self,
        names: Sequence[str],
        records: Mapping[str, Any],
        comm_s: float | None,
        clock: float | None = None,
    ) -> dict[int, Mapping[str, Any]]:
        """Collective: every rank's ``{"threads", "records"[, "comm_s"][, "clock"]}`` by global rank, equal
        everywhere."""
        ...

    def judged_names(
        self, due: Sequence[Recipe], by_rank: Mapping[int, Mapping[str, Any]]
    ) -> list[str]:
        """The recipes this cycle judges, from the gathered records (pure: equal on every rank)."""
        ...

    def holding(self, name: str, by_rank: Mapping[int, Mapping[str, Any]]) -> list[Sequence[int]]:
        """The peer groups that replayed ``name`` (pure)."""
        ...

    def comm_reports(
        self,
        step: int,
        due: Sequence[Recipe],
        by_rank: Mapping[int, Mapping[str, Any]],
        config: StragglerConfig | None,
    ) -> list[FaultReport]:
        """Communication-straggler reports from what the domain's own collectives took (pure but stateful)."""
        ...

    def cycle_fields(
        self, due: Sequence[Recipe], by_rank: Mapping[int, Mapping[str, Any]]
    ) -> dict[str, Any]:
        """What the domain adds to the :class:`~gemscout.scout.cycle.CycleResult` (pure)."""
        ...

    def job_timer(self, model: nn.Module, config: Any) -> JobCollectiveTimer | FsdpCollectiveTimer:
        """Collective: the timer of the job's own collectives; ``ConfigError`` where there is none to time."""
        ...

    def reset(self) -> None:
        """Forget what earlier cycles taught (after a rewind)."""
        ...


class FlatDomain:
    """One group of replicas: every rank of ``group`` is a peer of every other (DDP, ZeRO's data-parallel group).
    Nothing is gathered before a replay and nothing crosses groups; the job's own collectives are DDP's."""

    stops_on_wire_error = True
    job_collectives = "DDP gradient all-reduce"
    collective_recipes: frozenset[str] = frozenset()

    def __init__(self, group: dist.ProcessGroup, rank: int, timeout: timedelta) -> None:
        self.group = group
        self.timeout = timeout
        self.peers: tuple[int, ...] = tuple(dist.get_process_group_ranks(group))
        self.peer_groups: tuple[tuple[int, ...], ...] = (self.peers,)
        self.exchange = PeerExchange(group, self.peers, rank, timeout)
        self.job_names: tuple[str, ...] = ()

    def plan(self, catalog: Catalog, modules: Mapping[str, Sequence[nn.Module]]) -> None:
        self.job_names = catalog.names

    @contextlib.contextmanager
    def scope(
        self, due: Sequence[Recipe], modules: Mapping[str, Sequence[nn.Module]]
    ) -> Iterator[None]:
        yield

    def agree(self, step: int, fingerprint: int) -> str | None:
        return None  # the inputs' hello carries the step and the fingerprint: one group needs nothing earlier

    def gather_slices(
        self,
        due: Sequence[Recipe],
        params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        step: int,
    ) -> dict[str, tuple[Captured, float]]:
        return {}

    def blocked(
        self, due: Sequence[Recipe], received: Mapping[str, Captured], wire_error: str | None
    ) -> dict[str, str]:
        return {}

    def gather_params(
        self, recipe: Recipe, modules: Sequence[nn.Module]
    ) -> tuple[list[dict[str, torch.Tensor]] | None, float | None]:
        return None, None

    @contextlib.contextmanager
    def replaying(self, recipe: Recipe, modules: Sequence[nn.Module]) -> Iterator[None]:
        yield

    def gather_records(
        self,
        names: Sequence[str],
        records: Mapping[str, Any],
        comm_s: float | None,
        clock: float | None = None,
    ) -> dict[int, Mapping[str, Any]]:
        return self.exchange.gather_records(names, records, comm_s=comm_s, clock=clock)

    def judged_names(
        self, due: Sequence[Recipe], by_rank: Mapping[int, Mapping[str, Any]]
    ) -> list[str]:
        return [r.name for r in due]

    def holding(self, name: str, by_rank: Mapping[int, Mapping[str, Any]]) -> list[Sequence[int]]:
        return list(self.peer_groups)

    def comm_reports(
        self,
        step: int,
        due: Sequence[Recipe],
        by_rank: Mapping[int, Mapping[str, Any]],
        config: StragglerConfig | None,
    ) -> list[FaultReport]:
        return []

    def cycle_fields(
        self, due: Sequence[Recipe], by_rank: Mapping[int, Mapping[str, Any]]
    ) -> dict[str, Any]:
        return {}

    def job_timer(self, model: nn.Module, config: Any) -> JobCollectiveTimer:
        if config.stragglers is None:
            raise ConfigError(JOB_TIMER_NEEDS)
        return JobCollectiveTimer(model, group=self.group, timeout=config.timeout)

    def reset(self) -> None:
        pass
