"""SCOUT's topology on the mesh ``fully_shard(model)`` builds when it is given none: one dim, no name.

The FSDP2 tutorial way (and transformers' own FSDP2 path) passes no mesh, so torch builds an unnamed 1-D mesh over
the world. That dim is data-parallel by construction and SCOUT labels it ``dp``; the same unnamed mesh under TP is
not, and stays refused with the fix, since comparing TP shards as replicas would report SDC on a healthy job.
"""

from __future__ import annotations

import pytest
from torch import nn

from gemscout.errors import ConfigError

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank")]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def test_fully_shard_without_a_mesh_gives_a_dp_topology() -> None:
    from torch.distributed.fsdp import fully_shard

    from gemscout.topology_discovery import discover, mesh_dims

    model = _net()
    fully_shard(model[0])
    fully_shard(model)
    mesh = next(model.parameters()).device_mesh
    assert mesh.mesh_dim_names is None and mesh_dims(mesh) == ("dp",)
    topology = discover(model, rank=0)
    assert topology is not None
    assert (topology.data_dims, topology.shard_dims, topology.model_dims) == (("dp",), ("dp",), ())


def test_an_unnamed_mesh_under_tp_is_refused_with_the_fix() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from gemscout.topology_discovery import discover

    model = _net()
    parallelize_module(
        model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    with pytest.raises(ConfigError, match="mesh_dim_names"):
        discover(model, rank=0)


def test_an_unnamed_two_dimensional_mesh_is_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from gemscout.topology_discovery import mesh_dims

    with pytest.raises(ConfigError, match="mesh_dim_names"):
        mesh_dims(init_device_mesh("cpu", (1, 1)))
