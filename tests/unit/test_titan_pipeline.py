"""SCOUT's topology for TorchTitan pipeline parallelism, without torchtitan: the rules of
:mod:`gemscout.adapters.torchtitan.topology` for ``pp`` > 1.

What is real: FSDP2 (``fully_shard``) on a one-rank gloo DeviceMesh named as TorchTitan names it (``fsdp``, or
``dp_replicate`` x ``fsdp``), so the parameters are DTensors whose placements and FSDP state SCOUT reads. What stands
in, and why: a 4-rank ``("pp", ...)`` layout needs 4 processes, so ``parallel_dims.get_optional_mesh`` answers with
a stand-in mesh (dim names and the rank grid, all SCOUT reads of it); the 4-rank runs of the real Trainer are in
tests/distributed/test_torchtitan_cpu.py. The schedules are stand-ins carrying ``stage_index`` per stage, as torch's
``PipelineStage`` does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gemscout.adapters.torchtitan.adapter import _scout_config
from gemscout.adapters.torchtitan.topology import _stage_order, pipeline_topology
from gemscout.errors import ConfigError
from gemscout.scout.config import ScoutConfig
from gemscout.topology import derive

pytestmark = pytest.mark.timeout(120)


class GridMesh:
    """The part of a DeviceMesh SCOUT's topology reads: dim names, the rank grid, slicing by one name."""

    def __init__(self, names: tuple[str, ...], grid: torch.Tensor, rank: int = 0) -> None:
        self.mesh_dim_names, self.mesh, self._rank = names, grid, rank

    def __getitem__(self, name: str) -> GridMesh:
        axis = self.mesh_dim_names.index(name)
        where = (self.mesh == self._rank).nonzero()[0].tolist()
        index = [slice(None) if i == axis else c for i, c in enumerate(where)]
        return GridMesh((name,), self.mesh[tuple(index)], self._rank)


class Dims:
    """``ParallelDims`` as the adapter reads it: degrees, world size, and the ("pp", ...) mesh of the whole job."""

    def __init__(
        self, pp: int, dp_replicate: int, dp_shard: int, tp: int = 1, cp: int = 1, ep: int = 1
    ) -> None:
        self.pp, self.dp_replicate, self.dp_shard, self.tp, self.cp, self.ep = (
            pp,
            dp_replicate,
            dp_shard,
            tp,
            cp,
            ep,
        )
        self.world_size = pp * dp_replicate * dp_shard * tp * cp
        self.asked: list[tuple[list[str], bool]] = []

    def get_optional_mesh(
        self, dims: list[str], *, include_singleton_axes: bool = False
    ) -> GridMesh:
        self.asked.append((list(dims), include_singleton_axes))
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "fsdp": self.dp_shard}
        shape = [sizes[d] for d in dims]
        # This rank's slice: with a dim the names leave out (tp innermost) it holds every stride-th rank only.
        count = int(torch.tensor(shape).prod())
        return GridMesh(
            tuple(dims), (torch.arange(count) * (self.world_size // count)).reshape(shape)
        )


def stage(names: tuple[str, ...]) -> nn.Module:
    """A small first-stage module, FSDP2-sharded on a one-rank mesh with TorchTitan's dim names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(16, 8)
    model.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(2)})
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_pp_x_fsdp_pairs_the_shard_ranks_of_each_stage(one_rank: None) -> None:
    dims = Dims(pp=2, dp_replicate=1, dp_shard=2)
    topo = pipeline_topology(stage(("fsdp",)), dims, None)
    assert dims.asked == [
        (["pp", "fsdp"], True)
    ]  # size-1 dims are asked for too: FSDP2 keeps a 1-rank fsdp mesh
    assert (topo.dims, topo.shape, topo.kind) == (("pp", "fsdp"), (2, 2), "fsdp+pp")
    assert (topo.data_dims, topo.shard_dims, topo.peer_dims, topo.stage_dims) == (
        ("fsdp",),
        ("fsdp",),
        ("fsdp",),
        ("pp",),
    )
    assert (
        topo.peer_groups == ((0, 1), (2, 3)) and topo.peers == (0, 1) and topo.stage_label == "pp0"
    )


def test_pp_x_replicas_pair_the_replicas_and_gather_the_one_shard(one_rank: None) -> None:
    """TorchTitan's DDP under PP is HSDP with one shard: peers along dp_replicate, a trivial gather along fsdp."""
    topo = pipeline_topology(
        stage(("dp_replicate", "fsdp")), Dims(pp=2, dp_replicate=2, dp_shard=1), None
    )
    assert (topo.dims, topo.shape, topo.kind) == (
        ("pp", "dp_replicate", "fsdp"),
        (2, 2, 1),
        "hsdp+pp",
    )
    assert (topo.peer_dims, topo.shard_dims) == (("dp_replicate",), ("fsdp",))
    assert topo.peer_groups == ((0, 1), (2, 3)) and "replicas" in topo.reason


def test_pp_alone_has_no_peers_and_says_why(one_rank: None) -> None:
    topo = pipeline_topology(stage(("fsdp",)), Dims(pp=2, dp_replicate=1, dp_shard=1), None)
    assert (topo.dims, topo.data_dims, topo.stage_dims, topo.comparable) == (
        ("pp",),
        (),
        ("pp",),
        False,
    )
    assert "no data-parallel dim in mesh (pp=2)" in topo.reason


def test_pipeline_topology_refusals_name_the_fix(one_rank: None) -> None:
    plain = nn.Linear(
        4, 4
    )  # TorchTitan always fully_shards each stage; plain parameters name no mesh
    with pytest.raises(ConfigError, match=r"reads each stage's peers from its FSDP2 parameters"):
        pipeline_topology(plain, Dims(pp=2, dp_replicate=1, dp_shard=2), None)
    short = Dims(pp=2, dp_replicate=1, dp_shard=2)
    short.world_size = 8  # e.g. a TP dim the parameters do not live on
    with pytest.raises(ConfigError, match=r"does not cover the 8 ranks"):
        pipeline_topology(stage(("fsdp",)), short, None)
    with pytest.raises(ConfigError, match=r"ScoutConfig.data_parallel_dims: \['dp'\] are not dims"):
        pipeline_topology(stage(("fsdp",)), Dims(pp=2, dp_replicate=1, dp_shard=2), ("dp",))


class Stage:
    def __init__(self, index: int) -> None:
        self.stage_index = index


class ScheduleInterleaved1F1B:
    def __init__(self, *indices: int) -> None:
        self._stages = [Stage(i) for i in indices]


class ScheduleZBVZeroBubble:
    """A V schedule whose stages cannot be read: the class name decides."""


def test_stage_order_follows_the_schedules_stages() -> None:
    topo = derive(
        dims=("pp", "fsdp"),
        shape=(2, 2),
        ranks=range(4),
        data_dims=("fsdp",),
        shard_dims=("fsdp",),
        rank=2,
        stage_dims=("pp",),
    )  # pp coordinate 1 of 2

    class Trainer:
        def __init__(self, schedule: Any) -> None:
            self.pp_schedule = schedule

    assert _stage_order(Trainer(ScheduleInterleaved1F1B(1, 3)), topo, 2) == "loop"
    assert _stage_order(Trainer(ScheduleInterleaved1F1B(1, 2)), topo, 2) == "v"
    assert _stage_order(Trainer(ScheduleZBVZeroBubble()), topo, 2) == "v"
    assert _stage_order(Trainer(object()), topo, 1) == "loop"
    with pytest.raises(
        ConfigError, match=r"holds pipeline stages \[3, 1\], neither the looped nor the V order"
    ):
        _stage_order(Trainer(ScheduleInterleaved1F1B(3, 1)), topo, 2)


def test_scout_under_pp_is_refused_with_tp_cp_or_ep() -> None:
    scout = ScoutConfig()
    for extra, match in (
        ({"tp": 2}, r"validated with data parallelism only.*tp=2"),
        ({"cp": 2}, r"validated with data parallelism only.*cp=2"),
        ({"ep": 2}, r"SCOUT under TorchTitan expert parallelism"),
    ):
        with pytest.raises(ConfigError, match=match):
            _scout_config(scout, Dims(pp=2, dp_replicate=1, dp_shard=2, **extra), 1)
    with pytest.raises(ConfigError, match=r"2 model_parts but parallel_dims.pp is 1"):
        _scout_config(scout, Dims(pp=1, dp_replicate=1, dp_shard=2), 2)
    kept = _scout_config(scout, Dims(pp=2, dp_replicate=2, dp_shard=1), 2, model_skips_head=True)
    assert kept.recipes == (
        "embedding",
        "hidden",
        "optimizer",
    )  # ChunkedLossWrapper on the last stage: no output
