"""The durable tier's codec seam: a partition codec an adapter registers decides how a promotion stores its state and
how that promotion loads back (a real one-rank DCP save and load on gloo).

The codec here is the test's own: it stores every floating-point tensor negated under its own keys, so a promotion that was not
written through it, or a load that bypassed it, cannot come back equal. DeepSpeed's two codecs are the production
implementations of the same protocol (tests/distributed/test_deepspeed*.py run them end to end)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from durable_support import promote, sources

from gemscout.errors import RunMismatchError
from gemscout.gemini.durable import SIDECAR, codecs
from gemscout.state import training_state
from gemscout.state.codec import decode
from gemscout.state.layout import Parsed

NAME = "test.negated.v1"


def _flip(t: torch.Tensor) -> torch.Tensor:
    """Its own inverse: a float tensor negated; anything else (RNG states, counters) as it is."""
    return t.neg() if t.is_floating_point() else t.clone()


class Negated:
    """Stores each tensor of a capture under ``c/<index>``, float ones negated; accepts a capture whose caller state says so."""

    name = NAME

    def __init__(self) -> None:
        self.loads = 0

    def accepts(self, skeleton: Any) -> bool:
        return isinstance(skeleton, dict) and "negate-me" in str(skeleton.get("extra"))

    def promotion_items(
        self, parsed: Parsed, data: torch.Tensor, rank: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        views = parsed.layout.views(data)
        items = {f"c/{i}": _flip(v) for i, v in enumerate(views)}
        record = {"codec": NAME, "identity": parsed.identity, "skeleton": parsed.skeleton}
        return items, {**record, "count": len(views)}

    def load(
        self,
        folder: Path,
        records: list[dict[str, Any]],
        sources: training_state.StateSources,
        *,
        group: dist.ProcessGroup,
        rank: int,
    ) -> None:
        import torch.distributed.checkpoint as dcp

        self.loads += 1
        mine = records[rank % len(records)]
        meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        targets = {
            f"c/{i}": torch.empty(meta[f"c/{i}"].size, dtype=meta[f"c/{i}"].properties.dtype)  # type: ignore[union-attr]
            for i in range(mine["count"])
        }
        dcp.load(targets, checkpoint_id=str(folder), process_group=group)
        tensors = [_flip(targets[f"c/{i}"]) for i in range(mine["count"])]
        training_state.restore(sources, decode(mine["skeleton"], tensors))


@pytest.fixture
def negated(monkeypatch: pytest.MonkeyPatch) -> Negated:
    """The test codec, registered in an otherwise empty registry (the process-wide one is left as it was)."""
    monkeypatch.setattr(codecs, "_REGISTERED", {})
    codec = Negated()
    codecs.register(codec)
    return codec


CALLER = {"tag": "negate-me", "t": torch.arange(4, dtype=torch.float32)}


@pytest.mark.timeout(60)
def test_a_registered_codec_writes_the_promotion_and_loads_it_back(
    tmp_path: Path, one_rank: None, negated: Negated
) -> None:
    import torch.distributed.checkpoint as dcp

    src, _ = sources(CALLER)
    want_model = {k: v.clone() for k, v in src.model.state_dict().items()}
    tier = promote(tmp_path / "durable", src, 5, tmp_path)
    folder = tier.path(5)
    sidecar = tier.verify(5)
    assert [r["codec"] for r in sidecar["ranks"]] == [NAME]
    stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert stored and all(
        k.startswith("c/") for k in stored
    )  # the codec's keys, not the default layout's
    assert (folder / SIDECAR).is_file()

    other, other_box = sources({"tag": "", "t": torch.zeros(4)}, seed=1)
    tier.load(5, other)
    assert negated.loads == 1
    assert other_box["extra"]["tag"] == "negate-me"
    assert torch.equal(other_box["extra"]["t"], CALLER["t"])
    got = other.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want_model.items())


@pytest.mark.timeout(60)
def test_a_capture_no_codec_accepts_uses_the_default_layout(
    tmp_path: Path, one_rank: None, negated: Negated
) -> None:
    src, _ = sources({"tag": "plain", "t": torch.ones(2)})
    tier = promote(tmp_path / "durable", src, 5, tmp_path)
    assert all(r.get("codec") is None for r in tier.verify(5)["ranks"])
    other, other_box = sources({"tag": "", "t": torch.zeros(2)}, seed=1)
    tier.load(5, other)
    assert negated.loads == 0 and other_box["extra"]["tag"] == "plain"


@pytest.mark.timeout(60)
def test_a_promotion_of_a_codec_this_process_lacks_is_refused_by_name(
    tmp_path: Path, one_rank: None, negated: Negated, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _ = sources(CALLER)
    tier = promote(tmp_path / "durable", src, 5, tmp_path)
    monkeypatch.setattr(codecs, "_REGISTERED", {})  # a job of another kind: nothing registered
    other, other_box = sources({"tag": "", "t": torch.zeros(4)}, seed=1)
    with pytest.raises(RunMismatchError, match=f"holds {NAME} state"):
        tier.load(5, other)
    assert other_box["extra"]["tag"] == ""  # nothing restored


@pytest.mark.timeout(30)
def test_registering_a_name_twice_keeps_the_first(negated: Negated) -> None:
    codecs.register(Negated())
    assert codecs.named(NAME) is negated
    assert codecs.for_skeleton({"extra": "negate-me"}) is negated
    assert codecs.for_skeleton({"extra": "other"}) is None
    assert codecs.named("absent") is None
