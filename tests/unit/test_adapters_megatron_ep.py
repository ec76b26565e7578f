"""SCOUT's view of Megatron expert parallelism, without a process group.

- :func:`gemscout.scout.materialize.param_model_dims`: Megatron flags expert weights under expert parallelism
  ``allreduce=False`` (and its TP shards ``tensor_model_parallel``): they lie on the topology's ``ep`` (``tp``) dim,
  so a MoE layer replays with its AllToAlls on every rank; everything else is replicated along every model dim.
- :func:`gemscout.adapters.megatron.topology.megatron_topology` for layouts a CPU test cannot afford to launch for real (each
  needs 4–8 Megatron ranks): ``parallel_state``'s size getters and ``torch.distributed``'s rank / group queries are
  stood in (monkeypatched) with what Megatron reports for that layout. The mesh it derives, the live-group check and
  what stays refused (expert parallelism with TP or CP, an expert TP of its own), each naming the fix. The real
  layouts run in tests/distributed/test_megatron_moe.py (ep=2 x expert-dp=2) and test_megatron.py (ep=2 x tp=2,
  refused).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from gemscout import ConfigError
from gemscout.adapters.megatron.topology import MEGATRON_PLACEMENT_FLAGS
from gemscout.scout.materialize import param_model_dims, uses_model_dims
from gemscout.topology import derive

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="megatron-core is not installed (pip install -e '.[megatron]')",
    ),
]


def _param(**flags: Any) -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(2))
    for name, value in flags.items():
        setattr(p, name, value)
    return p


def _mesh(model_dim: str) -> Any:
    """A (dp, <model_dim>) mesh of 2 x 2 with Megatron's placement flags, as megatron_topology builds it."""
    return derive(
        dims=("dp", model_dim),
        shape=(2, 2),
        ranks=range(4),
        data_dims=("dp",),
        shard_dims=(),
        rank=0,
        placement_flags=MEGATRON_PLACEMENT_FLAGS,
    )


def test_expert_weights_lie_on_the_ep_dim() -> None:
    ep, dense = _mesh("ep"), _mesh("tp")
    expert = _param(
        allreduce=False, tensor_model_parallel=True
    )  # SequentialMLP's fc1 at expert TP 1
    assert param_model_dims(expert, ep) == {"ep"}
    assert param_model_dims(expert, dense) == {
        "tp"
    }  # no ep dim on that mesh: only its TP flag counts
    assert param_model_dims(_param(allreduce=True, tensor_model_parallel=True), ep) == set()
    assert param_model_dims(_param(), ep) == set()  # the router, norms: replicated along ep
    assert uses_model_dims([_param(), expert], ep) and not uses_model_dims(
        [_param(allreduce=True)], ep
    )


class _Layout:
    """What parallel_state and torch.distributed report for one layout (Megatron's default order tp-cp-ep-dp-pp)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        *,
        world: int,
        rank: int,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        edp_group: list[int],
        ep_group: list[int],
    ) -> None:
        from megatron.core import parallel_state as ps

        import gemscout.adapters.megatron.topology as adapter

        etp = tp if etp is None else etp
        sizes = {
            "pipeline_model_parallel": 1,
            "data_parallel": world // (tp * cp),
            "context_parallel": cp,
            "tensor_model_parallel": tp,
            "expert_model_parallel": ep,
            "expert_tensor_parallel": etp,
            "expert_data_parallel": world // (ep * etp),
        }
        for name, size in sizes.items():
            monkeypatch.setattr(ps, f"get_{name}_world_size", lambda size=size: size)
        groups = {"dp": list(range(world)), "edp": edp_group, "ep": ep_group}
        monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
        monkeypatch.setattr(ps, "get_data_parallel_group", lambda: "dp")
        monkeypatch.setattr(ps, "get_expert_data_parallel_group", lambda: "edp")
        monkeypatch.setattr(ps, "get_expert_model_parallel_group", lambda: "ep")
        monkeypatch.setattr(adapter.dist, "get_rank", lambda: rank)
        monkeypatch.setattr(adapter.dist, "get_world_size", lambda: world)
        monkeypatch.setattr(adapter.dist, "get_process_group_ranks", lambda group: groups[group])


def test_expert_parallel_peers_are_the_expert_data_parallel_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gemscout.adapters.megatron.topology import megatron_topology

    _Layout(monkeypatch, world=6, rank=3, ep=2, edp_group=[1, 3, 5], ep_group=[2, 3])
    topo = megatron_topology()
    assert (topo.dims, topo.shape, topo.model_dims, topo.peers) == (
        ("dp", "ep"),
        (3, 2),
        ("ep",),
        (1, 3, 5),
    )
    assert topo.peer_groups == ((0, 2, 4), (1, 3, 5))


def test_a_custom_order_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemscout.adapters.megatron.topology import megatron_topology

    _Layout(monkeypatch, world=4, rank=0, ep=2, edp_group=[0, 1], ep_group=[0, 2])  # ep outside dp
    with pytest.raises(
        ConfigError,
        match=r"the expert-data-parallel group of rank 0 is \[0, 1\], but the default "
        r"order tp-cp-ep-dp-pp gives \[0, 2\]",
    ):
        megatron_topology()


@pytest.mark.parametrize(
    ("layout", "names"),
    [
        ({"world": 8, "tp": 2, "ep": 2}, "'tensor_model_parallel_size': 2"),
        ({"world": 8, "cp": 2, "ep": 2}, "'context_parallel_size': 2"),
        ({"world": 8, "tp": 2, "ep": 2, "etp": 1}, "'expert_tensor_parallel_size': 1"),
        (
            {"world": 4, "tp": 2, "etp": 1},
            "'expert_model_parallel_size': 1",
        ),  # an expert TP of its own, no EP
    ],
)
def test_what_stays_refused_names_the_layout_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, layout: dict[str, int], names: str
) -> None:
    from gemscout.adapters.megatron.topology import megatron_topology

    _Layout(monkeypatch, rank=0, edp_group=[0], ep_group=[0], **layout)
    with pytest.raises(ConfigError, match=r"SCOUT does not support this expert layout yet") as info:
        megatron_topology()
    assert names in str(info.value) and "pass scout=None (GEMINI alone works)" in str(info.value)
