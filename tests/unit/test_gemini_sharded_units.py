"""Pure pieces of the sharded durable tier, natural replicas and capture coalescing (no process group)."""

from __future__ import annotations

import pytest
import torch

from gemscout import CheckpointConfig
from gemscout.errors import ConfigError
from gemscout.gemini.durable.keys import tensor_entries
from gemscout.gemini.natural import NaturalPlacement, _diff, replicate_groups
from gemscout.gemini.slots import SlotPool
from gemscout.state.layout import Layout, build_header, frame_prefix, parse_prefix, tensor_digests


@pytest.mark.timeout(30)
def test_tensor_entries_key_shards_globally_and_the_rest_per_rank() -> None:
    skeleton = {
        "model": {"w": {"__dt__": [1, [4, 2], [2, 1]]}, "b": {"__t__": 0}},
        "optimizer": {"state": {"__dict__": [[0, {"exp_avg": {"__dt__": [2, [4, 2], [2, 1]]}}]]}},
        "rng": {"python": {"__tuple__": [3, {"__t__": 3}, None]}},
    }
    assert tensor_entries(skeleton, 5) == [
        ("r5/model/b", None, None),
        ("s/model/w", [4, 2], [2, 1]),
        ("s/optimizer/state/0/exp_avg", [4, 2], [2, 1]),
        ("r5/rng/python/1", None, None),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("field", "value"), [("replication", "star"), ("when_busy", "drop")])
def test_new_config_fields_refuse_bad_values_by_name(tmp_path, field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(directory=tmp_path, **{field: value})


@pytest.mark.timeout(30)
def test_natural_placement_rings_inside_each_replicate_group() -> None:
    p = NaturalPlacement(6, 1, 1, groups=((0, 2, 4), (1, 3, 5)))
    assert [p.target(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [p.source(r) for r in range(6)] == [4, 5, 0, 1, 2, 3]


@pytest.mark.timeout(30)
def test_natural_needs_dtensor_parameters() -> None:
    with pytest.raises(ConfigError, match="natural"):
        replicate_groups(torch.nn.Linear(2, 2))


@pytest.mark.timeout(30)
def test_digest_diff_names_only_differing_tensors_and_none_for_another_layout() -> None:
    def parsed(*tensors: torch.Tensor):  # type: ignore[no-untyped-def]
        layout = Layout.of(list(tensors))
        data = torch.empty(layout.data_nbytes, dtype=torch.uint8)
        for v, t in zip(layout.views(data), tensors, strict=True):
            v.copy_(t)
        return parse_prefix(
            frame_prefix(build_header(layout, tensor_digests(layout, data), {}, {}))
        )

    a = parsed(torch.ones(4), torch.zeros(3), torch.arange(5.0))
    b = parsed(torch.ones(4), torch.ones(3), torch.arange(5.0))
    assert _diff(a, b) == [1]
    assert _diff(a, parsed(torch.ones(4))) is None


@pytest.mark.timeout(30)
def test_slot_pool_reports_a_free_slot_until_every_slot_is_pinned() -> None:
    from datetime import timedelta

    pool = SlotPool(2)
    layout = Layout.of([torch.ones(2)])
    first = pool.acquire(layout, timeout=timedelta(seconds=1))
    assert pool.has_free()
    pool.acquire(layout, timeout=timedelta(seconds=1))
    assert not pool.has_free()
    pool.release(first)
    assert pool.has_free()
