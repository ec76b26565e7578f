"""SCOUT's peer domain on a DeviceMesh (:class:`~gemscout.scout.domain.PeerDomain`): agreement across peer groups,
gathered optimizer slices and parameters, replays that run collectives, and communication evidence.

On a mesh there are several peer groups (one per model-parallel coordinate, or per HSDP shard), and some collectives
cross them: gathers along the shard dims and a TP block's own all-reduces. So besides each group's own exchange,
every rank of the mesh (the *domain*) takes part, in the same order, in:

1. an all-gather of (step, catalog fingerprint): any disagreement stops every group, together;
2. the gathers of the optimizer slices due, then of each forward recipe's parameters (:mod:`~gemscout.scout.materialize`);
3. when a due recipe's replay runs collectives, an all-gather of who has the inputs for it: a replay runs on every
   rank or on none, so a TP partner is never left waiting inside a collective;
4. the all-gather of every rank's records, from which every rank judges every group (same verdicts everywhere).

Pipeline stages (``Topology.stage_dims``) hold different catalogs: each rank replays only its stage's recipes, but
every rank judges every recipe of every stage from the gathered records (:meth:`MeshDomain.judged_names`, each over
the peer groups that hold it, :meth:`MeshDomain.holding`) and tracks certification over the job-wide catalog
(:attr:`MeshDomain.job_names`), so verdicts, reports, rejections and certified steps are identical on every rank.

Communication evidence: the seconds each rank spent gathering, and inside the replay's collectives, are compared per
group of the dim they ran along (shard groups for gathers, model-parallel groups for replay collectives). A group's
time is its *fastest* member's: a member that arrived late (slow at compute) makes the others wait but itself waits
little, so the minimum is the time the collective itself took; a slow link or a delayed collective slows every
member, the minimum included. Groups past the straggler margins are reported (kind ``straggler``, evidence signal
``communication``) naming their ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemscout._dist import gather_json, wait_all
from gemscout.errors import ConfigError
from gemscout.reports import FaultReport
from gemscout.scout.capture import Captured, capture_optimizer
from gemscout.scout.domain import JOB_TIMER_NEEDS
from gemscout.scout.exchange import PeerExchange
from gemscout.scout.fsdp_comms import FsdpCollectiveTimer
from gemscout.scout.materialize import Materializer, local_tensor, param_model_dims, uses_model_dims
from gemscout.scout.recipes import Catalog, Recipe
from gemscout.scout.stragglers import CommStragglerDetector, GroupTiming, StragglerConfig
from gemscout.topology import Topology
from gemscout.topology_discovery import create_groups

__all__ = ["MeshDomain"]


class MeshDomain:
    """The peer domain of a DeviceMesh, for one rank. Every method that says *collective* must be called by every
    rank of the mesh, in the same order, whatever its local state. Construct on every rank of the default group
    (it creates SCOUT's gloo groups, :func:`~gemscout.topology_discovery.create_groups`)."""

    stops_on_wire_error = False
    job_collectives = "FSDP2 all-gather / reduce-scatter"

    def __init__(self, topology: Topology, rank: int, timeout: timedelta) -> None:
        self.topology = topology
        self.domain, group = create_groups(topology, timeout)
        """SCOUT's gloo group over every rank of the mesh."""
        self.domain_ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(self.domain))
        self.peers: tuple[int, ...] = topology.peers
        self.peer_groups: tuple[tuple[int, ...], ...] = topology.peer_groups
        self.exchange = PeerExchange(group, self.peers, rank, timeout)
        self.materializer = Materializer(topology, timeout)
        self.timeout = timeout
        self.collective_recipes: frozenset[str] = frozenset()
        """Recipes whose replay runs collectives (parameters placed on a model-parallel dim: DTensors, or plain
        tensors the topology's placement flags place, :func:`~gemscout.scout.materialize.param_model_dims`)."""
        self._model_dims: dict[str, tuple[str, ...]] = {}
        self._detectors: dict[str, CommStragglerDetector] = {}
        self.job_names: tuple[str, ...] = ()
        """Every recipe id of every rank's catalog (this rank's own on a mesh without pipeline stages), in a fixed
        order: what certification must see clean."""

    def plan(self, catalog: Catalog, modules: Mapping[str, Sequence[nn.Module]]) -> None:
        """Note which recipes replay with collectives, and along which model-parallel dims. With pipeline stages,
        collective over the mesh: gather every rank's recipe ids into :attr:`job_names`. Raises ``ConfigError`` when
        the stages would disagree on which steps are due (a step due on one stage only would run the cycle's
        collectives on part of the mesh)."""
        self.job_names = catalog.names
        if self.topology.stage_dims and catalog.config.rotate_kinds:
            raise ConfigError(
                "ScoutConfig.rotate_kinds: pipeline stages hold different recipe kinds, so a kind's "
                "turn would be due on some stages only; leave rotate_kinds off with pipelining"
            )
        if self.topology.stage_dims:
            cadences = sorted({catalog.config.interval_of(r.kind.value) for r in catalog.recipes})
            everyone = gather_json(
                {"names": list(catalog.names), "cadences": cadences},
                group=self.domain,
                timeout=self.timeout,
            )
            if len({tuple(doc["cadences"]) for doc in everyone}) > 1:
                raise ConfigError(
                    "ScoutConfig.recipe_intervals: pipeline stages hold different recipe kinds, and with "
                    f"these cadences they would be due at different steps ({[d['cadences'] for d in everyone]}"
                    "); give every recipe kind the same interval"
                )
            self.job_names = tuple(dict.fromkeys(name for doc in everyone for name in doc["names"]))
        for recipe in catalog.recipes:
            params = [p for m in modules[recipe.name] for p in m.parameters()]
            if recipe.has_module and uses_model_dims(params, self.topology):
                names = set().union(*(param_model_dims(p, self.topology) for p in params))
                self._model_dims[recipe.name] = tuple(
                    d for d in self.topology.model_dims if d in names
                )
        self.collective_recipes = frozenset(self._model_dims)

    def gather_records(
        self,
        names: Sequence[str],
        records: Mapping[str, Any],
        comm_s: float | None,
        clock: float | None = None,
    ) -> dict[int, Mapping[str, Any]]:
        """Collective over the mesh: every rank's records by global rank, as fixed-size rows
        (:meth:`PeerExchange.gather_records` over the domain), or with pipeline stages as JSON (a row's layout is
        the recipe list, and stages record different recipes; the job's collectives are not timed there)."""
        if not self.topology.stage_dims:
            return self.exchange.gather_records(
                names,
                records,
                comm_s=comm_s,
                clock=clock,
                group=self.domain,
                ranks=self.domain_ranks,
            )
        entry: dict[str, Any] = {"threads": torch.get_num_threads(), "records": dict(records)}
        if clock is not None:
            entry["clock"] = clock
        gathered = gather_json(
            entry,
            group=self.domain,
            timeout=self.timeout,
        )
        return dict(zip(self.domain_ranks, gathered, strict=True))

    def judged_names(
        self, due: Sequence[Recipe], by_rank: Mapping[int, Mapping[str, Any]]
    ) -> list[str]:
        """The recipes this cycle judges: those due here and, with pipeline stages, every recipe any rank recorded
        (the other stages'), in :attr:`job_names` order. Pure, from the gathered records: equal on every rank."""
        if not self.topology.stage_dims:
            return [r.name for r in due]
        recorded = {name for entry in by_rank.values() for name in entry["records"]}
        return [name for name in self.job_names if name in recorded]

    def holding(self, name: str, by_rank: Mapping[int, Mapping[str, Any]]) -> list[Sequence[int]]:
        """The peer groups that replayed ``name`` (some member recorded it): another stage's groups never did."""
        groups = self.peer_groups
        if not self.topology.stage_dims:
            return list(groups)
        return [g for g in groups if any(name in by_rank[r]["records"] for r in g)]

    def reset(self) -> None:
        """Forget the communication baselines (after a rewind)."""
        self._detectors.clear()

    def job_timer(self, model: nn.Module, config: Any) -> FsdpCollectiveTimer:
        """Collective: the timer of FSDP2's own all-gathers and reduce-scatters, lateness judged per shard group.
        ``ConfigError`` with pipeline stages, without shard dims, or with ``config.stragglers`` None."""
        topology = self.topology
        if config.stragglers is None or topology.stage_dims or not topology.shard_dims:
            raise ConfigError(JOB_TIMER_NEEDS)
        return FsdpCollectiveTimer(
            model,
            group=self.domain,
            groups=topology.groups_along(topology.shard_dims),
            timeout=config.timeout,
        )

    @contextlib.contextmanager
    def scope(
        self, due: Sequence[Recipe], modules: Mapping[str, Sequence[nn.Module]]
    ) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def replaying(self, recipe: Recipe, modules: Sequence[nn.Module]) -> Iterator[None]:
        yield

    # -- collectives ----------------------------------------------------------------------------------------------
    def agree(self, step: int, fingerprint: int) -> str | None:
        """Collective: gather every rank's step and catalog fingerprint; return why the mesh must stop, or None.

        The step must be equal everywhere, the fingerprint within each peer group (pipeline stages could hold
        different catalogs). Every rank computes the same answer from the same gathered values."""
        mine = torch.tensor([step, fingerprint], dtype=torch.int64)
        everyone = [torch.zeros(2, dtype=torch.int64) for _ in self.domain_ranks]
        wait_all(
            [dist.all_gather(everyone, mine, group=self.domain, async_op=True)],
            self.timeout,
            "scout mesh hello",
        )
        steps = {rank: int(t[0]) for rank, t in zip(self.domain_ranks, everyone, strict=True)}
        prints = {rank: int(t[1]) for rank, t in zip(self.domain_ranks, everyone, strict=True)}
        if len(set(steps.values())) > 1:
            return f"peers disagree on the step (steps by rank {steps}); nothing was replayed"
        for group in self.topology.peer_groups:
            if len({prints[r] for r in group}) > 1:
                return f"peers disagree on the recipe catalog (peer group {list(group)}); nothing was replayed"
        return None

    def gather_slices(
        self,
        due: Sequence[Recipe],
        params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        step: int,
    ) -> dict[str, tuple[Captured, float]]:
        """Collective: every due optimizer recipe's slice gathered whole (:meth:`gather_slice`), by name."""
        return {
            r.name: self.gather_slice(r, params, optimizer, step) for r in due if not r.has_module
        }

    def gather_params(
        self, recipe: Recipe, modules: Sequence[nn.Module]
    ) -> tuple[list[dict[str, torch.Tensor]] | None, float | None]:
        """Collective: a forward recipe's parameters gathered whole along the shard dims, and the seconds."""
        return self.materializer.gather_modules(recipe.modules, modules)

    def gather_slice(
        self,
        recipe: Recipe,
        params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        step: int,
    ) -> tuple[Captured, float]:
        """Collective: this rank's optimizer-slice inputs gathered whole along the shard dims, and the seconds.

        Every rank gathers (a gather is collective), so every peer also holds what the source sends; the source's
        copy is what is replayed. A TP-sharded tensor keeps only this rank's TP part: the update is elementwise, and
        the ranks sharing this TP coordinate hold the same part. An optimizer value that cannot travel (neither a
        tensor nor plain JSON) is an error on every rank alike, before any gather."""
        try:
            live = capture_optimizer(recipe, params, optimizer, step)
        except (TypeError, KeyError) as exc:
            return Captured(step=step, error=str(exc)), 0.0
        gathered, seconds = self.materializer.gather_named(live.tensors)
        live.tensors = {key: local_tensor(tensor).detach() for key, tensor in gathered.items()}
        return live, seconds

    def blocked(
        self, due: Sequence[Recipe], received: Mapping[str, Captured], wire_error: str | None
    ) -> dict[str, str]:
        """Collective when a due recipe replays with collectives: which of those no rank may replay, and why.

        A rank without inputs would skip the replay and leave its TP partners (in another peer group) waiting in
        the replay's collectives; so either every rank has the inputs, or no rank replays it."""
        names = [r.name for r in due if r.name in self.collective_recipes]
        if not names:
            return {}
        ready = torch.tensor(
            [
                int(wire_error is None and (c := received.get(n)) is not None and c.error is None)
                for n in names
            ],
            dtype=torch.int64,
        )
        everyone = [torch.zeros(len(names), dtype=torch.int64) for _ in self.domain_ranks]
        wait_all(
            [dist.all_gather(everyone, ready, group=self.domain, async_op=True)],
            self.timeout,
            "scout replay readiness",
        )
        out = {}
        for i, name in enumerate(names):
            missing = [
                rank
                for rank, flags in zip(self.domain_ranks, everyone, strict=True)
                if not int(flags[i])
            ]
            if missing:
                out[name] = (
                    f"not replayed on any rank: ranks {missing} have no inputs for it, and its replay runs "
                    f"collectives along {list(self._model_dims[name])} across peer groups"
                )
        return out

    # -- evidence (pure, from the gathered records) -----------------------------------------------------------------
    def cycle_fields(
        self, due: Sequence[Recipe], by_rank: Mapping[int, Mapping[str, Any]]
    ) -> dict[str, Any]:
        """The gather and replay-collective seconds of the cycle, per recipe per rank."""
        return {
            "gather_s": self.side_times(due, by_rank, "gather_s"),
            "collective_s": self.side_times(due, by_rank, "collective_s"),
        }

    def side_times(
        self, due: Sequence[Recipe], by_rank: Mapping[int, Mapping[str, Any]], key: str
    ) -> dict[str, dict[int, float]]:
        """``key`` ("gather_s" or "collective_s") per recipe per rank, for the ranks that recorded it."""
        out: dict[str, dict[int, float]] = {}
        for recipe in due:
            found = {
                rank: float(rec[key])
                for rank, entry in by_rank.items()
                if (rec := entry["records"].get(recipe.name)) and rec.get(key) is not None
            }
            if found:
                out[recipe.name] = found
        return out

    def comm_reports(
        self,
        step: int,
        due: Sequence[Recipe],
        by_rank: Mapping[int, Mapping[str, Any]],
        config: StragglerConfig | None,
    ) -> list[FaultReport]:
        """Communication-straggler reports from this cycle's gather and replay-collective times.

        One detector per channel (gathers along the shard dims; replay collectives along each set of model dims).
        Per recipe a group's time is its fastest member's (see the module docstring); a channel adds its recipes
        up, so every group of a round carried the same payloads, whatever the rotation picked."""
        if config is None:
            return []
        gathers = self.side_times(due, by_rank, "gather_s")
        collectives = self.side_times(due, by_rank, "collective_s")
        rounds: dict[tuple[str, tuple[str, ...]], dict[tuple[int, ...], float]] = {}
        for recipe in due:
            channels = (
                ("gather", self.topology.shard_dims, gathers.get(recipe.name, {})),
                (
                    "collective",
                    self._model_dims.get(recipe.name, ()),
                    collectives.get(recipe.name, {}),
                ),
            )
            for channel, dims, seconds in channels:
                if not dims or set(seconds) != set(self.domain_ranks):
                    continue  # nothing ran along this channel, or some rank did not get that far
                totals = rounds.setdefault((channel, dims), {})
                for group in self.topology.groups_along(dims):
                    totals[group] = totals.get(group, 0.0) + min(seconds[r] for r in group)
        reports = []
        for (channel, dims), totals in rounds.items():
            if len(totals) < 2:
                continue  # one group (e.g. pure FSDP's single shard group): nothing to compare it with
            name = f"{channel}[{','.join(dims)}]"
            timings = {
                f"{name}:{'-'.join(map(str, g))}": GroupTiming(frozenset(g), t)
                for g, t in totals.items()
            }
            detector = self._detectors.setdefault(name, CommStragglerDetector(config))
            report = detector.observe(step, timings)
            if report is not None:
                reports.append(report)
        return reports
