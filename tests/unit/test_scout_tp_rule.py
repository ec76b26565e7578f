"""Which parameters make a replay run model-parallel collectives (:func:`gemscout.scout.materialize.param_model_dims`),
without a process group.

The rule decides which recipes get SCOUT's "replay on every rank or on none" readiness check on a mesh. Megatron Core's
TP shards are plain tensors flagged ``tensor_model_parallel=True`` (ColumnParallel / RowParallel linears, the
vocab-parallel embedding); a rule that saw only DTensors would let one TP rank skip a replay while its partner waits
inside the replay's all-reduce. DTensor parameters are covered for real by tests/distributed/test_topologies_scout.py
(FSDP2 x TP) and Megatron's flagged tensors by tests/distributed/test_megatron.py (TP=2 x DP=2, a capture dropped).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch import nn

from gemscout.adapters.megatron.topology import MEGATRON_PLACEMENT_FLAGS
from gemscout.scout.materialize import param_model_dims, uses_model_dims
from gemscout.topology import PlacementFlag, Topology, derive


def megatron_mesh(tp: int, cp: int = 1, flags: bool = True) -> Topology:
    """What gemscout.adapters.megatron.megatron_topology builds: (dp, [cp,] [tp]), dims of size 1 dropped but dp,
    with Megatron's placement flags (``flags=False``: the same mesh as any other framework's)."""
    sizes = {"dp": 2, "cp": cp, "tp": tp}
    dims = tuple(d for d in ("dp", "cp", "tp") if d == "dp" or sizes[d] > 1)
    shape = [sizes[d] for d in dims]
    n = 1
    for size in shape:
        n *= size
    return derive(
        dims=dims,
        shape=shape,
        ranks=range(n),
        data_dims=("dp",),
        shard_dims=(),
        rank=0,
        placement_flags=MEGATRON_PLACEMENT_FLAGS if flags else (),
    )


def flagged(value: object = True) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(4, 4))
    param.tensor_model_parallel = value  # type: ignore[attr-defined]
    param.partition_dim, param.partition_stride = 0, 1  # type: ignore[attr-defined]
    return param


@pytest.mark.timeout(30)
def test_megatron_tp_shards_run_collectives_along_tp() -> None:
    topology = megatron_mesh(tp=2)
    assert topology.model_dims == ("tp",)
    assert param_model_dims(flagged(), topology) == {"tp"}
    # A layer norm or a RowParallel bias next to the TP weights: replicated, no collective of its own.
    plain = nn.Parameter(torch.zeros(4))
    assert param_model_dims(plain, topology) == set()
    assert (
        param_model_dims(flagged(False), topology) == set()
    )  # Megatron's default for non-TP tensors
    assert (
        param_model_dims(flagged(1), topology) == set()
    )  # only Megatron's bool flag, not any truthy attribute
    # A block is collective as soon as one of its parameters is a TP shard.
    assert uses_model_dims([plain, flagged(False), flagged()], topology)
    assert not uses_model_dims([plain, flagged(False)], topology)
    assert not uses_model_dims([], topology)


@pytest.mark.timeout(30)
def test_the_core_knows_no_framework_flag() -> None:
    # The same (dp, tp) mesh without Megatron's rule: a tensor carrying Megatron's attribute is an ordinary tensor.
    topology = megatron_mesh(tp=2, flags=False)
    assert topology.model_dims == ("tp",)
    assert param_model_dims(flagged(), topology) == set() and not uses_model_dims(
        [flagged()], topology
    )
    # Any framework's own attribute works the same way once its adapter names it.
    other = dataclasses.replace(
        topology, placement_flags=(PlacementFlag("sharded_by_me", True, "tp"),)
    )
    mine = nn.Parameter(torch.zeros(2))
    mine.sharded_by_me = True  # type: ignore[attr-defined]
    assert param_model_dims(mine, other) == {"tp"} and param_model_dims(flagged(), other) == set()
    assert other.to_dict()["placement_flags"] == [["sharded_by_me", True, "tp"]]


@pytest.mark.timeout(30)
def test_no_tp_dim_means_no_collective() -> None:
    # TP=1: Megatron still flags its linears, but the topology has no tp dim, so nothing crosses peer groups.
    topology = megatron_mesh(tp=1)
    assert topology.model_dims == ()
    assert param_model_dims(flagged(), topology) == set() and not uses_model_dims(
        [flagged()], topology
    )
    # With context parallelism the flag still names tp only (CP's collectives are not the parameters' doing).
    assert param_model_dims(flagged(), megatron_mesh(tp=2, cp=2)) == {"tp"}
    assert param_model_dims(flagged(), megatron_mesh(tp=1, cp=2)) == set()


@pytest.mark.timeout(30)
@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
def test_the_flag_is_the_one_megatron_sets() -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    topology = megatron_mesh(tp=2)
    shard, replicated = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))
    set_tensor_model_parallel_attributes(
        shard, True, 0, 1
    )  # what ColumnParallelLinear does to its weight
    set_tensor_model_parallel_attributes(replicated, False, -1, 1)
    assert (
        param_model_dims(shard, topology) == {"tp"}
        and param_model_dims(replicated, topology) == set()
    )
