"""Durable keys are unique by construction: adversarial caller-state keys promote and load back exactly (real DCP
save and load on a one-rank gloo group), a collision that escaping cannot prevent is refused with a ConfigError, and
a promotion of today's format (2) still loads."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from durable_support import promote, sources

from gemscout.errors import ConfigError
from gemscout.gemini.durable import DurableTier
from gemscout.gemini.durable.keys import key_component, tensor_entries
from gemscout.state.codec import encode

DATA = Path(__file__).parent / "data"


def _equal(a: Any, b: Any, *, ordered: bool = True) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        same_keys = list(a) == list(b) if ordered else sorted(map(repr, a)) == sorted(map(repr, b))
        return (
            isinstance(b, dict)
            and same_keys
            and all(_equal(a[k], b[k], ordered=ordered) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_equal(x, y, ordered=ordered) for x, y in zip(a, b, strict=True))
        )
    return a == b


FORMAT2_MODEL = {
    "weight": torch.tensor(
        [
            float.fromhex(h)
            for h in (
                "-0x1.4a574cp-9",
                "0x1.186d2ep-2",
                "-0x1.d54c8ep-2",
                "-0x1.923e12p-2",
                "-0x1.5b01d6p-3",
                "0x1.3c8e3cp-3",
            )
        ]
    ).reshape(2, 3),
    "bias": torch.tensor([float.fromhex("0x1.198e8ep-8"), float.fromhex("0x1.9a7a2ap-2")]),
}

ADVERSARIAL: dict[Any, Any] = {
    "a/b": torch.full((2,), 1.0),
    "a": {"b": torch.full((2,), 2.0), "b%2F": torch.full((1,), 3.0)},
    "a%2Fb": torch.full((3,), 4.0),
    "%25": torch.full((1,), 5.0),
    "": {"": torch.full((1,), 6.0)},
    "mixed": {
        1: torch.full((1,), 7.0),
        "1": torch.full((1,), 8.0),
        False: torch.full((1,), 9.0),
        1.5: torch.full((1,), 10.0),
        "%s1": torch.full((1,), 11.0),
        -1: torch.full((1,), 12.0),
    },
    "list": [torch.full((1,), 13.0), {"0": torch.full((1,), 14.0)}],
    "__t__": torch.full((1,), 15.0),  # a reserved marker name as a caller key
}


@pytest.mark.timeout(30)
def test_adversarial_keys_get_distinct_dcp_keys() -> None:
    skeleton, tensors = encode({"extra": ADVERSARIAL})
    keys = [k for k, _, _ in tensor_entries(skeleton, 0)]
    assert len(keys) == len(set(keys)) == len(tensors)
    assert "r0/extra/a%2Fb" in keys and "r0/extra/a/b" in keys and "r0/extra/a%252Fb" in keys
    assert (
        key_component("model.0.weight") == "model.0.weight"
    )  # model names: the same key as format 2


@pytest.mark.timeout(60)
def test_adversarial_caller_state_round_trips_through_dcp(tmp_path: Path, one_rank: None) -> None:
    src, box = sources(ADVERSARIAL)
    want_model = {k: v.clone() for k, v in src.model.state_dict().items()}
    tier = promote(tmp_path / "durable", src, 5, tmp_path)
    other, other_box = sources({k: v for k, v in ADVERSARIAL.items()}, seed=1)
    other_box["extra"] = None
    tier.load(5, other)
    assert _equal(other_box["extra"], ADVERSARIAL)
    assert _equal(dict(other.model.state_dict()), want_model)


@pytest.mark.timeout(60)
def test_a_collision_escaping_cannot_prevent_is_refused_with_a_config_error(
    tmp_path: Path, one_rank: None
) -> None:
    src, _ = sources(
        {float("nan"): torch.ones(1), float("nan"): torch.zeros(1)}
    )  # two keys, both "%fnan"
    with pytest.raises(ConfigError, match="map to the DCP key .r0/extra/%fnan"):
        promote(tmp_path / "durable", src, 5, tmp_path)
    assert not (tmp_path / "durable" / "step-000000005").exists()


@pytest.mark.timeout(60)
def test_a_format_2_promotion_still_loads(tmp_path: Path, one_rank: None) -> None:
    # Written by the format-2 code (unescaped keys); the load takes every key from the sidecar.
    shutil.copytree(DATA / "durable-format2", tmp_path / "durable")
    g = torch.Generator().manual_seed(7)
    want = {
        "a/b": torch.randn(3, generator=g),
        "c": {"d": torch.arange(4)},
        "n": 5,
        "%x": torch.ones(2),
    }
    src, box = sources(None, seed=3)
    import torch.distributed as dist

    tier = DurableTier(
        tmp_path / "durable", run_id="storage-test", fsync=False, group=dist.group.WORLD, rank=0
    )
    assert tier.newest_step() == 4
    tier.load(4, src)
    assert _equal(box["extra"], want, ordered=False)  # format 2 sorted the keys of a plain dict
    # The model the fixture holds, bit for bit. It is not recomputed here: one SGD step's float rounding differs
    # by an ulp between CPU kernels (AVX2 / AVX-512), and the fixture was written on another machine.
    assert _equal(dict(src.model.state_dict()), FORMAT2_MODEL)
