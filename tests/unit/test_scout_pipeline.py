"""SCOUT on pipeline stages, without a process group: the peer rule on a (pp, dp) mesh, the stage label that
qualifies recipe names, and the catalog each stage's module yields (stage 0: embedding + blocks, last stage: blocks +
output, every stage its optimizer slices). The distributed behaviour is in tests/distributed/test_topologies_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch

from gemscout.errors import ConfigError
from gemscout.scout.config import ScoutConfig
from gemscout.scout.recipes import RecipeKind, build_catalog
from gemscout.topology import derive
from qualification.workloads.pipeline import block_split, build_stage


def pipeline(shape: tuple[int, ...], rank: int, *, dp: bool = True):
    dims = ("pp", "dp") if dp else ("pp",)
    n = 1
    for size in shape:
        n *= size
    return derive(
        dims=dims,
        shape=shape,
        ranks=range(n),
        data_dims=("dp",) if dp else (),
        shard_dims=(),
        rank=rank,
        stage_dims=("pp",),
    )


@pytest.mark.timeout(30)
def test_pp_dp_peers_are_the_replicas_of_one_stage() -> None:
    for rank, peers, label in (
        (0, (0, 1), "pp0"),
        (1, (0, 1), "pp0"),
        (2, (2, 3), "pp1"),
        (3, (2, 3), "pp1"),
    ):
        t = pipeline((2, 2), rank)
        assert (t.peers, t.stage_label, t.kind, t.peer_dims) == (peers, label, "dp+pp", ("dp",))
    assert t.peer_groups == ((0, 1), (2, 3))
    assert "two peers" in t.reason and "pp1" in t.reason
    t3 = pipeline((2, 3), 4)
    assert t3.peers == (3, 4, 5) and t3.stage_label == "pp1" and "culprit" not in t3.reason


@pytest.mark.timeout(30)
def test_pure_pipeline_has_no_peers_and_says_why() -> None:
    t = pipeline((2,), 1, dp=False)
    assert not t.comparable and t.peer_groups == ((0,), (1,)) and t.stage_label == "pp1"
    assert "pipeline stages" in t.reason and "cannot compare" in t.reason


@pytest.mark.timeout(30)
def test_a_stage_dim_cannot_be_data_parallel() -> None:
    with pytest.raises(ValueError, match="overlap"):
        derive(
            dims=("pp", "dp"),
            shape=(2, 2),
            ranks=range(4),
            data_dims=("dp",),
            shard_dims=(),
            rank=0,
            stage_dims=("dp",),
        )


@pytest.mark.timeout(30)
def test_each_stage_finds_its_own_recipes() -> None:
    assert block_split(3, 2) == [range(0, 2), range(2, 3)]
    config = ScoutConfig()
    stages = [build_stage("three-block", seed=0, stage=s, n_stages=2) for s in range(2)]
    catalogs = [
        build_catalog(m, torch.optim.AdamW(m.parameters()), config, stage=f"pp{s}")
        for s, m in enumerate(stages)
    ]
    kinds = [{r.kind for r in c.recipes} for c in catalogs]
    assert kinds[0] == {RecipeKind.EMBEDDING, RecipeKind.HIDDEN, RecipeKind.OPTIMIZER}
    assert kinds[1] == {RecipeKind.HIDDEN, RecipeKind.OUTPUT, RecipeKind.OPTIMIZER}
    assert [r.name for r in catalogs[0].recipes if r.kind is RecipeKind.HIDDEN] == [
        "pp0.hidden.0",
        "pp0.hidden.1",
    ]
    assert catalogs[1]["pp1.output"].modules == ("norm", "head")
    assert not set(catalogs[0].names) & set(catalogs[1].names)  # no name is shared across stages
    # The stage holds exactly the unsplit model's blocks: stage 1's first block is the model's block 2.
    whole = build_stage("three-block", seed=0, stage=0, n_stages=1)
    assert torch.equal(stages[1].blocks[0].fc1.weight, whole.blocks[2].fc1.weight)
    # Outside a pipeline a missing boundary is still an error naming the field.
    with pytest.raises(ConfigError, match="ScoutConfig.embedding"):
        build_catalog(stages[1], None, ScoutConfig(recipes=("embedding",)))
    with pytest.raises(ConfigError, match="holds none of the recipe kinds"):
        build_catalog(stages[0], None, ScoutConfig(recipes=("output",)), stage="pp0")


@pytest.mark.timeout(30)
def test_mesh_field_is_checked() -> None:
    with pytest.raises(ConfigError, match="ScoutConfig.mesh"):
        ScoutConfig(mesh="pp")


@pytest.mark.timeout(30)
def test_several_stages_per_rank_are_named_by_their_own_stage() -> None:
    """Interleaved / looped schedules: pp coordinate c of a pp=2 mesh holds stages c and c + 2 (torch's looped order);
    the rank's nn.ModuleList of stage modules yields each module's recipes under its own stage, paths through the
    list, and optimizer slices that never span two stages."""
    assert [pipeline((2, 2), r).chunk_labels(2) for r in range(4)] == [("pp0", "pp2")] * 2 + [
        ("pp1", "pp3")
    ] * 2
    assert pipeline((2,), 1, dp=False).chunk_labels(3) == ("pp1", "pp3", "pp5")
    config = ScoutConfig(optimizer_slice_numel=20000)
    for coord in (0, 1):
        mods = torch.nn.ModuleList(
            build_stage("three-block", seed=0, stage=s, n_stages=4) for s in (coord, coord + 2)
        )
        opt = torch.optim.AdamW(mods.parameters())
        catalog = build_catalog(
            mods, opt, config, stage=f"pp{coord}", chunk_labels=(f"pp{coord}", f"pp{coord + 2}")
        )
        forward = {r.name: r.modules for r in catalog.recipes if r.kind is not RecipeKind.OPTIMIZER}
        if coord == 0:
            assert forward == {
                "pp0.embedding": ("0.embed",),
                "pp0.hidden.0": ("0.blocks.0",),
                "pp2.hidden.0": ("1.blocks.0",),
            }
        else:
            assert forward == {
                "pp1.hidden.0": ("0.blocks.0",),
                "pp3.hidden.0": ("1.blocks.0",),
                "pp3.output": ("1.norm", "1.head"),
            }
        slices = [r for r in catalog.recipes if r.kind is RecipeKind.OPTIMIZER]
        for r in slices:  # a slice's parameters all belong to the stage module its name says
            chunk = {p.split(".")[0] for p in r.params}
            assert chunk == {"0" if r.name.startswith(f"pp{coord}.") else "1"}, r
        assert {r.name.rsplit(".", 2)[0] for r in slices} == {f"pp{coord}", f"pp{coord + 2}"}
        covered = [p for r in slices for p in r.params]
        assert covered == [
            n for n, _ in mods.named_parameters()
        ]  # every parameter once, in optimizer order
    # Four stages of three-block: the workload is widened to one block per stage.
    assert len(build_stage("three-block", seed=0, stage=3, n_stages=4).blocks) == 1


@pytest.mark.timeout(30)
def test_several_stages_per_rank_need_one_stage_dim_and_a_module_list() -> None:
    two_stage_dims = derive(
        dims=("pp", "cp", "dp"),
        shape=(2, 1, 2),
        ranks=range(4),
        data_dims=("dp",),
        shard_dims=(),
        rank=0,
        stage_dims=("pp", "cp"),
    )
    with pytest.raises(ConfigError, match="exactly one pipeline dim"):
        two_stage_dims.chunk_labels(2)
    stage = build_stage("three-block", seed=0, stage=0, n_stages=4)
    with pytest.raises(ConfigError, match="nn.ModuleList of that many"):
        build_catalog(
            stage, None, ScoutConfig(recipes=("hidden",)), stage="pp0", chunk_labels=("pp0", "pp2")
        )


@pytest.mark.timeout(30)
def test_v_shaped_stages_are_named_by_their_own_stage() -> None:
    """ZBV Zero Bubble and DualPipeV place stages in a V: on a pp=2 mesh coordinate 0 holds stages 0 and 3 (the first
    and the last), coordinate 1 stages 1 and 2. ``ScoutConfig(stage_order="v")`` names each module of the rank's list
    by that stage, so stage 3's recipes (its block, norm and head) are ``pp3.*``, never ``pp2.*``."""
    from qualification.programs._pipeline import PIPELINE_TOPOLOGIES, fitting_schedules, stage_ids

    v = PIPELINE_TOPOLOGIES["pp-v-dp"]
    assert [stage_ids(v, c) for c in (0, 1)] == [(0, 3), (1, 2)]
    assert [stage_ids(PIPELINE_TOPOLOGIES["pp-virtual"], c) for c in (0, 1)] == [(0, 2), (1, 3)]
    assert fitting_schedules(v) == ("zbv", "dualpipev")
    assert "interleaved-zb" in fitting_schedules(PIPELINE_TOPOLOGIES["pp-virtual"])
    v_labels = [pipeline((2, 2), r).chunk_labels(2, order="v") for r in range(4)]
    assert v_labels == [("pp0", "pp3")] * 2 + [("pp1", "pp2")] * 2
    assert pipeline((3,), 2, dp=False).chunk_labels(2, order="v") == ("pp2", "pp3")
    with pytest.raises(ConfigError, match="two stages per rank"):
        pipeline((2, 2), 0).chunk_labels(3, order="v")
    with pytest.raises(ConfigError, match="ScoutConfig.stage_order"):
        ScoutConfig(stage_order="zigzag")
    config = ScoutConfig(optimizer_slice_numel=20000, stage_order="v")
    mods = torch.nn.ModuleList(
        build_stage("three-block", seed=0, stage=s, n_stages=4) for s in (0, 3)
    )
    catalog = build_catalog(
        mods,
        torch.optim.AdamW(mods.parameters()),
        config,
        stage="pp0",
        chunk_labels=pipeline((2, 2), 0).chunk_labels(2, order=config.stage_order),
    )
    forward = {r.name: r.modules for r in catalog.recipes if r.kind is not RecipeKind.OPTIMIZER}
    assert forward == {
        "pp0.embedding": ("0.embed",),
        "pp0.hidden.0": ("0.blocks.0",),
        "pp3.hidden.0": ("1.blocks.0",),
        "pp3.output": ("1.norm", "1.head"),
    }


@pytest.mark.timeout(60)
def test_fsdp_sharded_stages_take_the_pipeline_dim_from_the_mesh(one_rank: None) -> None:
    """A stage ``fully_shard``ed over ``dp`` of a (pp, dp) mesh: given ``ScoutConfig.mesh`` (the root mesh), the dim
    no parameter lives on (pp) is the stage dim and dp the shard dim; without it pp would be taken for a TP-like dim
    and stage names would be lost. Another mesh is refused naming the field. TP-sharded stages: pp is the stage dim,
    tp a model dim, no peers. (One-rank meshes: the rule is the same.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gemscout.topology_discovery import discover

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
    stage = build_stage("three-block", seed=0, stage=0, n_stages=2)
    for block in stage.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    t = discover(stage, data_dims=("dp",), rank=0, mesh=mesh)
    assert t is not None
    assert (t.stage_dims, t.shard_dims, t.peer_dims, t.stage_label) == (
        ("pp",),
        ("dp",),
        ("dp",),
        "pp0",
    )
    assert discover(stage, rank=0, mesh=mesh).stage_dims == ("pp",)  # dp found from fully_shard
    assert discover(stage, rank=0).stage_dims == ()  # no mesh given: pp is a model dim, not a stage
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    with pytest.raises(ConfigError, match="ScoutConfig.mesh"):
        discover(stage, data_dims=("dp",), rank=0, mesh=other)
    # TP-sharded stages (pp x tp): tp is the dim the parameters live on, pp the stage dim; no dp dim, no peers.
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "tp"))
    tp_stage = build_stage("three-block", seed=0, stage=1, n_stages=2)
    for block in tp_stage.blocks:
        parallelize_module(
            block, tp_mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
    t = discover(tp_stage, rank=0, mesh=tp_mesh)
    assert t is not None and (t.stage_dims, t.data_dims, t.model_dims) == (
        ("pp",),
        (),
        ("pp", "tp"),
    )
    assert not t.comparable and "pipeline stages" in t.reason
