"""SCOUT's peer rule on a DeviceMesh, without a process group: who each rank's peers are on DDP, FSDP, HSDP, TP and
FSDP x TP meshes, and how per-group verdicts combine into one verdict for the whole job."""

from __future__ import annotations

import pytest

from gemscout.scout.consensus import C3Result, Verdict, c3
from gemscout.scout.cycle import combine_groups
from gemscout.scout.rotation import is_sdc
from gemscout.topology import derive


def mesh(
    dims: tuple[str, ...],
    shape: tuple[int, ...],
    data: tuple[str, ...],
    shard: tuple[str, ...],
    rank: int = 0,
):
    n = 1
    for size in shape:
        n *= size
    return derive(
        dims=dims, shape=shape, ranks=range(n), data_dims=data, shard_dims=shard, rank=rank
    )


def test_fsdp_peers_are_the_whole_shard_group_and_parameters_are_gathered() -> None:
    t = mesh(("shard",), (4,), ("shard",), ("shard",), rank=2)
    assert t.kind == "fsdp" and t.peers == (0, 1, 2, 3) and t.materializes and t.comparable
    assert "no replica" in t.reason


def test_hsdp_peers_hold_the_same_shard() -> None:
    for rank, peers in ((0, (0, 2)), (1, (1, 3)), (2, (0, 2)), (3, (1, 3))):
        t = mesh(("replicate", "shard"), (2, 2), ("replicate", "shard"), ("shard",), rank=rank)
        assert t.kind == "hsdp" and t.peers == peers and t.peer_dims == ("replicate",)
    assert t.peer_groups == ((0, 2), (1, 3))
    assert t.groups_along(t.shard_dims) == (
        (0, 1),
        (2, 3),
    )  # what each peer gathers from: its own replica
    assert "two peers" in t.reason and "independent replicas" in t.reason


def test_fsdp_tp_peers_keep_the_tp_coordinate() -> None:
    t = mesh(("dp", "tp"), (2, 2), ("dp",), ("dp",), rank=3)
    assert t.kind == "fsdp+tp" and t.model_dims == ("tp",) and t.peers == (1, 3)
    assert t.peer_groups == ((0, 2), (1, 3))
    assert t.groups_along(("tp",)) == ((0, 1), (2, 3))


def test_tp_alone_has_no_peers() -> None:
    t = mesh(("tp",), (2,), (), (), rank=1)
    assert t.kind == "tp" and t.peers == (1,) and not t.comparable
    assert "no data-parallel dim" in t.reason and "cannot compare" in t.reason


def test_replicated_mesh_is_plain_data_parallel() -> None:
    t = mesh(("dp",), (3,), ("dp",), (), rank=1)
    assert t.kind == "dp" and t.replicated and t.peers == (0, 1, 2) and not t.materializes


def test_groups_follow_the_mesh_layout_not_rank_order() -> None:
    # A transposed layout: row-major coordinates, not sorted ranks, decide the groups and their source order.
    t = derive(
        dims=("dp", "tp"),
        shape=(2, 2),
        ranks=[0, 2, 1, 3],
        data_dims=("dp",),
        shard_dims=("dp",),
        rank=0,
    )
    assert t.peer_groups == ((0, 1), (2, 3))


def test_bad_meshes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fill"):
        derive(dims=("dp",), shape=(4,), ranks=[0, 1], data_dims=("dp",), shard_dims=(), rank=0)
    with pytest.raises(ValueError, match="not in the mesh"):
        derive(dims=("dp",), shape=(2,), ranks=[0, 1], data_dims=("dp",), shard_dims=(), rank=5)


def _group(digests: dict[int, str]) -> tuple[tuple[int, ...], C3Result]:
    return tuple(digests), c3(digests, recipe="hidden.1", step=7)


def test_combined_verdicts() -> None:
    clean = combine_groups("hidden.1", 7, [_group({0: "a", 2: "a"}), _group({1: "b", 3: "b"})])
    assert clean.verdict is Verdict.AGREE and not is_sdc(clean) and not clean.outputs_disagree
    two = combine_groups("hidden.1", 7, [_group({0: "a", 2: "x"}), _group({1: "b", 3: "b"})])
    assert two.verdict is Verdict.INCONCLUSIVE and is_sdc(two) and two.ranks == ()
    report = two.fault_report()
    assert report is not None and report.scope.value == "peer_group" and report.ranks == (0, 2)
    assert "peer group [0, 2]" in two.reason and "detection without a culprit" in two.reason
    named = combine_groups(
        "hidden.1", 7, [_group({0: "a", 2: "a", 4: "x"}), _group({1: "b", 3: "b", 5: "b"})]
    )
    assert named.verdict is Verdict.ATTRIBUTED and named.ranks == (4,)
    failed = C3Result(
        verdict=Verdict.INCONCLUSIVE,
        recipe="hidden.1",
        step=7,
        reason="precondition x",
        preconditions_ok=False,
    )
    pre = combine_groups("hidden.1", 7, [((0, 2), failed), _group({1: "b", 3: "b"})])
    assert pre.verdict is Verdict.INCONCLUSIVE and not pre.preconditions_ok and not is_sdc(pre)
    assert (
        not pre.outputs_disagree
    )  # the groups' digests differ from each other, never inside a group
    single = _group({0: "a", 1: "a"})
    assert combine_groups("hidden.1", 7, [single]) is single[1]
