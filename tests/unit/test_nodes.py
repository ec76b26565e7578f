"""Ranks per node: from the launcher when it says, else from the ranks' host names; a layout that ring placement
cannot serve is refused, never guessed. And a Slurm task's rank and world size for ``init_process_group``."""

from __future__ import annotations

import pytest

from gemscout import elastic
from gemscout.errors import ConfigError
from gemscout.nodes import ranks_per_node_from_env, ranks_per_node_from_hosts

pytestmark = pytest.mark.timeout(30)


def test_block_layouts_give_their_block_size() -> None:
    assert ranks_per_node_from_hosts(["a", "a", "b", "b"]) == 2
    assert ranks_per_node_from_hosts(["a"] * 8 + ["b"] * 8 + ["c"] * 8) == 8
    assert ranks_per_node_from_hosts(["a", "a", "a"]) == 3  # one node
    assert ranks_per_node_from_hosts(["a", "b", "c"]) == 1


@pytest.mark.parametrize(
    ("hosts", "shown"),
    [(["a", "b", "a", "b"], "a: 1, b: 1, a: 1"), (["a", "a", "a", "b"], "a: 3, b: 1")],
    ids=["cyclic", "uneven"],
)
def test_layouts_ring_placement_cannot_serve_are_refused_with_the_fix(
    hosts: list[str], shown: str
) -> None:
    with pytest.raises(ConfigError, match="distribution=block") as err:
        ranks_per_node_from_hosts(hosts)
    assert shown in str(err.value) and "ranks_per_node" in str(err.value)


def test_the_launchers_figure_comes_first_and_a_bad_one_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_per_node_from_env() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert ranks_per_node_from_env() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_per_node_from_env() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE='eight'"):
        ranks_per_node_from_env()


def test_a_slurm_task_gets_its_rank_and_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    with pytest.raises(ConfigError, match="export MASTER_ADDR and MASTER_PORT"):
        elastic._slurm_rank({})
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert elastic._slurm_rank({}) == {"rank": 5, "world_size": 16}
    assert elastic._slurm_rank({"init_method": "tcp://x:1"}) == {}  # the caller's own wiring wins
    monkeypatch.setenv("RANK", "5")
    assert elastic._slurm_rank({}) == {}  # torchrun under srun: torchrun's variables win
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_NTASKS", "many")
    with pytest.raises(ConfigError, match="SLURM_NTASKS"):
        elastic._slurm_rank({})
