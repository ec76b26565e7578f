"""Where a rank's SCOUT peers come from, at attach: a ready-made group of replicas, an explicit topology, or the
model's own DeviceMesh; and the peer domain (:class:`~gemscout.scout.domain.PeerDomain`) built over them.

A replicated model without a mesh gets a flat domain over a group of replicas (the caller's, or a new gloo group of
every rank); a mesh with data-parallel peers a :class:`~gemscout.scout.mesh_domain.MeshDomain`; a mesh without them
(pure TP) no domain at all: SCOUT stays attached but cannot compare (:attr:`Topology.reason` says why).
:meth:`~gemscout.scout.engine.Scout.attach` calls these in that order, with the catalog built between them (its
recipe names depend on the topology's pipeline stage).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from gemscout.errors import ConfigError
from gemscout.scout.config import ScoutConfig
from gemscout.scout.domain import FlatDomain, PeerDomain
from gemscout.scout.mesh_domain import MeshDomain
from gemscout.topology import Topology
from gemscout.topology_discovery import discover, has_dtensor_params

__all__ = ["FlatDomainFactory", "find_topology", "peer_domain"]

log = logging.getLogger("gemscout")

FlatDomainFactory = Callable[[dist.ProcessGroup, int, timedelta], FlatDomain]
"""Builds the domain of a group of replicas from (group, rank, timeout): :class:`FlatDomain` or a refinement."""


def find_topology(
    root: nn.Module,
    config: ScoutConfig,
    rank: int,
    *,
    group: dist.ProcessGroup | None,
    topology: Topology | None,
) -> Topology | None:
    """The topology SCOUT compares on: ``topology`` when given, None with a ready-made ``group`` of replicas, else
    what :func:`~gemscout.topology_discovery.discover` reads from ``root`` (None for plain parameters). Raises
    ``ConfigError`` for a ``group`` given with a topology or a sharded model, or a mesh that cannot be read."""
    if group is not None and (topology is not None or has_dtensor_params(root)):
        raise ConfigError(
            "Scout.attach: group= is for replicated models; on a sharded or parallel model leave it "
            "out (peers come from the DeviceMesh) or pass topology=from_mesh(mesh, ...)"
        )
    if group is None and topology is None:
        topology = discover(root, data_dims=config.data_parallel_dims, rank=rank, mesh=config.mesh)
    return topology


def peer_domain(
    topology: Topology | None,
    group: dist.ProcessGroup | None,
    rank: int,
    timeout: timedelta,
    flat_domain: FlatDomainFactory,
) -> PeerDomain | None:
    """The peer domain over ``topology`` (from :func:`find_topology`), or None (logged) where it has no
    data-parallel peers. No topology: ``flat_domain`` over ``group``, or over a new gloo group of every rank.
    Collective on the default group where it creates process groups (every rank calls it)."""
    if topology is None:
        flat = group if group is not None else dist.new_group(backend="gloo", timeout=timeout)
        return flat_domain(flat, rank, timeout)
    if topology.comparable:
        return MeshDomain(topology, rank, timeout)
    log.warning(
        "gemscout: SCOUT cannot compare on this %s topology: %s", topology.kind, topology.reason
    )
    return None
