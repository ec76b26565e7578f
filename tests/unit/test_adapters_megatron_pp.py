"""SCOUT's view of Megatron pipeline stages, without a process group: which module paths the adapter fills on each
stage (:func:`gemscout.adapters.megatron._scout_config`), the stage catalogs they give (names qualified by the stage,
virtual stages in Megatron's interleaved order), and what stays refused. Stand-ins: plain modules laid out as
Megatron's ``GPTModel`` is (``embedding``, ``decoder.layers``, ``decoder.final_layernorm``, ``output_layer``), with
``pre_process`` / ``post_process`` deciding what a stage holds; the real GPTModel under Megatron's schedules runs in
tests/distributed/test_megatron_pp_scout.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gemscout import ConfigError, ScoutConfig
from gemscout.adapters.megatron.adapter import _scout_config
from gemscout.scout.recipes import build_catalog
from gemscout.topology import derive

pytestmark = pytest.mark.timeout(60)


class Embedding(
    nn.Module
):  # LanguageModelEmbedding: not an nn.Embedding subclass, found only by its path
    def __init__(self) -> None:
        super().__init__()
        self.word = nn.Parameter(torch.zeros(16, 8))


class Decoder(nn.Module):
    def __init__(self, layers: int, post_process: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        if post_process:
            self.final_layernorm = nn.LayerNorm(8)


class Stage(nn.Module):
    """A GPTModel stage: the embedding on the first, the final norm and output layer on the last."""

    def __init__(self, pre_process: bool, post_process: bool, layers: int = 2) -> None:
        super().__init__()
        if pre_process:
            self.embedding = Embedding()
        self.decoder = Decoder(layers, post_process)
        if post_process:
            self.output_layer = nn.Linear(8, 16)


class Wrapper(nn.Module):  # Megatron's DistributedDataParallel keeps the chunk as .module
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


CONFIG = ScoutConfig(recipes=("embedding", "hidden", "output"))


def _catalog(
    model: nn.Module, scout: ScoutConfig, stage: str, chunks: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    catalog = build_catalog(model, None, scout, stage=stage, chunk_labels=chunks)
    return [(r.name, *r.modules) for r in catalog.recipes]


def test_each_stage_replays_what_it_holds_named_by_its_stage() -> None:
    first, last = Wrapper(Stage(True, False)), Wrapper(Stage(False, True))
    scout0, scout1 = _scout_config(CONFIG, first, 1, 2), _scout_config(CONFIG, last, 1, 2)
    # Named whether present or not (a stage skips what it lacks); the norm only where the head has one.
    assert (scout0.embedding, scout0.blocks, scout0.head, scout0.norm) == (
        "embedding",
        "decoder.layers",
        "output_layer",
        None,
    )
    assert scout1.norm == "decoder.final_layernorm"
    assert _catalog(first, scout0, "pp0") == [
        ("pp0.embedding", "embedding"),
        ("pp0.hidden.0", "decoder.layers.0"),
        ("pp0.hidden.1", "decoder.layers.1"),
    ]
    assert _catalog(last, scout1, "pp1") == [
        ("pp1.hidden.0", "decoder.layers.0"),
        ("pp1.hidden.1", "decoder.layers.1"),
        ("pp1.output", "decoder.final_layernorm", "output_layer"),
    ]
    middle = Wrapper(Stage(False, False))
    assert _catalog(middle, _scout_config(CONFIG, middle, 1, 3), "pp1") == [
        ("pp1.hidden.0", "decoder.layers.0"),
        ("pp1.hidden.1", "decoder.layers.1"),
    ]
    named = ScoutConfig(
        recipes=("embedding", "hidden", "output"),
        head="output_layer",
        norm="decoder.final_layernorm",
    )
    assert (
        _scout_config(named, last, 1, 2).norm == "decoder.final_layernorm"
    )  # the caller's names are kept


def test_virtual_stages_follow_megatrons_interleaved_order() -> None:
    # pp=2 x vpp=2: pp coordinate 1 holds virtual stages 1 and 3; the last virtual stage holds the head.
    chunks = nn.ModuleList([Wrapper(Stage(False, False, 1)), Wrapper(Stage(False, True, 1))])
    scout = _scout_config(CONFIG, chunks, 2, 2, 2)
    mesh = derive(
        dims=("pp", "dp"),
        shape=(2, 2),
        ranks=range(4),
        data_dims=("dp",),
        shard_dims=(),
        rank=3,
        stage_dims=("pp",),
    )
    labels = mesh.chunk_labels(2, order=scout.stage_order)
    assert labels == ("pp1", "pp3") and mesh.peers == (2, 3)
    assert _catalog(chunks, scout, mesh.stage_label, labels) == [
        ("pp1.hidden.0", "0.module.decoder.layers.0"),
        ("pp3.hidden.0", "1.module.decoder.layers.0"),
        ("pp3.output", "1.module.decoder.final_layernorm", "1.module.output_layer"),
    ]
    # With a torch optimizer (not a MegatronOptimizer) each virtual stage's parameters are sliced on their own.
    every = _scout_config(ScoutConfig(), chunks, 2, 2, 2)
    catalog = build_catalog(
        chunks,
        torch.optim.SGD(chunks.parameters(), lr=0.1),
        every,
        stage="pp1",
        chunk_labels=labels,
    )
    slices = {
        r.name: {p.split(".")[0] for p in r.params}
        for r in catalog.recipes
        if r.kind.value == "optimizer"
    }
    assert slices == {"pp1.optimizer.0": {"0"}, "pp3.optimizer.0": {"1"}}, slices


def test_what_stays_refused_names_the_fix() -> None:
    two = nn.ModuleList([Stage(True, False), Stage(False, True)])
    with pytest.raises(
        ConfigError,
        match=r"2 model chunks on this rank, but parallel_state has "
        r"pipeline_model_parallel_size=1",
    ):
        _scout_config(CONFIG, two, 2, 1)
    with pytest.raises(ConfigError, match=r"virtual_pipeline_model_parallel_size=3"):
        _scout_config(CONFIG, two, 2, 2, 3)
    with pytest.raises(
        ConfigError, match=r"ScoutConfig.stage_order: Megatron's interleaved schedule"
    ):
        _scout_config(ScoutConfig(stage_order="v"), two, 2, 2, 2)
    with pytest.raises(
        ConfigError, match=r"ScoutConfig.mesh: under Megatron Core the pipeline stages come from"
    ):
        _scout_config(ScoutConfig(mesh=_Mesh()), Stage(True, True), 1, 2)
    with pytest.raises(ConfigError, match=r"ScoutConfig.data_parallel_dims"):
        _scout_config(ScoutConfig(data_parallel_dims=("dp",)), Stage(True, True), 1, 2)


class _Mesh:  # what ScoutConfig checks a DeviceMesh by
    mesh_dim_names = ("pp", "dp")
    mesh = torch.arange(4).reshape(2, 2)
