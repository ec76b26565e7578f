"""Timing primitives (InstrumentedLoader, checkpoint_io) and the StallDetector's confirmation logic."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from gemscout.errors import ConfigError
from gemscout.watch.channel import OobChannel, OobConfig
from gemscout.watch.findings import StallFinding
from gemscout.watch.progress import ProgressPublisher
from gemscout.watch.stalls import (
    InstrumentedLoader,
    RecordingSink,
    SectionSink,
    StallConfig,
    StallDetector,
    checkpoint_io,
    section_kind,
)

pytestmark = pytest.mark.timeout(30)

FAST = StallConfig(
    absolute_threshold=timedelta(milliseconds=20), relative_factor=3.0, confirmations=2
)


def _publisher_sink() -> SectionSink:
    store = dist.HashStore()
    return ProgressPublisher(OobChannel(store, config=OobConfig(rank=0, secret=b"x" * 16)))


def _rounds(sink: SectionSink, section: str) -> list[float]:
    if isinstance(sink, RecordingSink):
        return sink.rounds.get(section, [])
    assert isinstance(sink, ProgressPublisher)
    return [seconds for _, seconds, _ in sink.snapshot().timings.get(section, ())]


def _active(sink: SectionSink) -> str | None:
    if isinstance(sink, RecordingSink):
        return sink.active
    assert isinstance(sink, ProgressPublisher)
    return sink.snapshot().section


SINKS: dict[str, Callable[[], SectionSink]] = {
    "recording": RecordingSink,
    "publisher": _publisher_sink,
}


@pytest.mark.parametrize("make", SINKS.values(), ids=SINKS.keys())
def test_section_sink_contract(make: Callable[[], SectionSink]) -> None:
    """A completed section is one round; a section ended with None is not; the active section is cleared."""
    sink = make()
    assert isinstance(sink, SectionSink)
    sink.enter_section("dataloader")
    assert _active(sink) == "dataloader"
    sink.exit_section("dataloader", 0.5)
    sink.enter_section("dataloader")
    sink.exit_section("dataloader", None)
    sink.enter_section("checkpoint_write")
    sink.exit_section("checkpoint_write", 0.25)
    assert _active(sink) is None
    assert _rounds(sink, "dataloader") == [0.5]
    assert _rounds(sink, "checkpoint_write") == [0.25]


# -- StallDetector -------------------------------------------------------------------------------------------------


def test_confirmed_after_two_consecutive_slow_rounds() -> None:
    detector = StallDetector(FAST)
    assert detector.observe("dataloader", 0, {0: 0.01, 1: 0.20, 2: 0.01}) is None
    finding = detector.observe(
        "dataloader", 1, {0: 0.01, 1: 0.30, 2: 0.012}, step=4, hosts={1: "node-b"}
    )
    assert isinstance(finding, StallFinding)
    assert finding.kind == "data_stall" and finding.ranks == (1,) and finding.step == 4
    assert (
        finding.confirmations == 2
        and finding.host == "node-b"
        and finding.recommendation == "observe"
    )
    assert [r["round"] for r in finding.evidence["slow_rounds"]["1"]] == [0, 1]
    # Reported once per streak, not every further slow round.
    assert detector.observe("dataloader", 2, {0: 0.01, 1: 0.30, 2: 0.01}) is None
    assert json.loads(finding.to_json())["ranks"] == [1]


def test_a_fast_round_resets_the_streak() -> None:
    detector = StallDetector(FAST)
    assert detector.observe("dataloader", 0, {0: 0.01, 1: 0.2, 2: 0.01}) is None
    assert detector.observe("dataloader", 1, {0: 0.01, 1: 0.01, 2: 0.01}) is None
    assert detector.observe("dataloader", 2, {0: 0.01, 1: 0.2, 2: 0.01}) is None
    assert detector.observe("dataloader", 3, {0: 0.01, 1: 0.2, 2: 0.01}) is not None


@pytest.mark.parametrize(
    "times",
    [
        {0: 0.001, 1: 0.015, 2: 0.001},  # 15x the others but under the absolute threshold
        {0: 0.10, 1: 0.25, 2: 0.10},  # over the absolute threshold but only 2.5x the others
        {0: 0.30, 1: 0.30, 2: 0.01},  # the majority is slow: nobody stands out
    ],
)
def test_both_margins_are_required(times: dict[int, float]) -> None:
    detector = StallDetector(FAST)
    for round_index in range(4):
        assert detector.observe("dataloader", round_index, times) is None


def test_sections_are_confirmed_separately_and_mapped_to_kinds() -> None:
    detector = StallDetector(FAST)
    assert detector.observe("checkpoint_write", 0, {0: 0.5, 1: 0.01}) is None
    assert detector.observe("dataloader", 0, {0: 0.5, 1: 0.01}) is None
    finding = detector.observe("checkpoint_write", 1, {0: 0.5, 1: 0.01})
    assert finding is not None and finding.kind == "checkpoint_stall" and finding.ranks == (0,)
    assert (
        section_kind("checkpoint_read") == "checkpoint_stall"
        and section_kind("dataloader") == "data_stall"
    )


def test_two_ranks_confirmed_in_one_round_share_a_finding() -> None:
    detector = StallDetector(
        StallConfig(absolute_threshold=timedelta(milliseconds=20), confirmations=1)
    )
    finding = detector.observe("dataloader", 0, {0: 0.01, 1: 0.5, 2: 0.01, 3: 0.6, 4: 0.01})
    assert finding is not None and finding.ranks == (1, 3)


def test_a_single_rank_cannot_be_compared() -> None:
    assert StallDetector(FAST).observe("dataloader", 0, {0: 100.0}) is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"absolute_threshold": timedelta(0)}, "absolute_threshold"),
        ({"relative_factor": 1.0}, "relative_factor"),
        ({"confirmations": 0}, "confirmations"),
    ],
)
def test_stall_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"StallConfig.{field}"):
        StallConfig(**kwargs)  # type: ignore[arg-type]


# -- InstrumentedLoader and checkpoint_io --------------------------------------------------------------------------


class _TinyDataset(Dataset[torch.Tensor]):
    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)  # the injected slow storage of one rank
        return torch.full((3,), float(index))


def test_instrumented_dataloader_localizes_the_slow_rank() -> None:
    """Three simulated ranks each iterate a real DataLoader; rank 1's fetches sleep. Confirmed on round 1."""
    sinks = {rank: RecordingSink() for rank in range(3)}
    batches: dict[int, list[torch.Tensor]] = {}
    for rank, sink in sinks.items():
        loader = DataLoader(_TinyDataset(8, delay_s=0.03 if rank == 1 else 0.0), batch_size=2)
        wrapped = InstrumentedLoader(loader, sink)
        assert len(wrapped) == 4
        batches[rank] = list(wrapped)
    plain = list(DataLoader(_TinyDataset(8, delay_s=0.0), batch_size=2))
    assert all(torch.equal(a, b) for a, b in zip(batches[0], plain, strict=True))
    assert all(
        len(s.rounds["dataloader"]) == 4 for s in sinks.values()
    )  # StopIteration is not a round
    assert min(sinks[1].rounds["dataloader"]) >= 0.06
    detector = StallDetector(FAST)
    findings = [
        detector.observe(
            "dataloader", r, {rank: s.rounds["dataloader"][r] for rank, s in sinks.items()}
        )
        for r in range(4)
    ]
    assert findings[0] is None
    assert (
        findings[1] is not None and findings[1].ranks == (1,) and findings[1].kind == "data_stall"
    )
    assert findings[2] is None and findings[3] is None


def test_loader_error_is_not_a_round_and_propagates() -> None:
    def broken() -> object:
        yield 1
        raise OSError("disk gone")

    sink = RecordingSink()
    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for item in InstrumentedLoader(broken(), sink):  # type: ignore[arg-type]
            seen.append(item)
    assert seen == [1] and len(sink.rounds["dataloader"]) == 1 and sink.active is None


def test_checkpoint_io_times_one_round() -> None:
    sink = RecordingSink()
    with checkpoint_io(sink, "write"):
        assert sink.active == "checkpoint_write"
        time.sleep(0.02)
    with pytest.raises(RuntimeError), checkpoint_io(sink, "read"):
        raise RuntimeError("read failed")
    assert sink.rounds == {"checkpoint_write": [pytest.approx(0.02, abs=0.5)]}
    assert sink.rounds["checkpoint_write"][0] >= 0.02 and sink.active is None
    with pytest.raises(ConfigError, match="kind"), checkpoint_io(sink, "delete"):  # type: ignore[arg-type]
        pass
