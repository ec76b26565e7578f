"""Root-rank logic (pure) and the Watchdog reading real publishers through a real TCPStore, on a fake clock."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from gemscout.errors import ConfigError
from gemscout.watch.channel import OobChannel, OobConfig
from gemscout.watch.findings import StallFinding
from gemscout.watch.progress import ProgressPublisher
from gemscout.watch.records import PROGRESS_KEY, CollectiveFingerprint, ProgressRecord
from gemscout.watch.rootcause import locate_root
from gemscout.watch.stalls import StallConfig
from gemscout.watch.watchdog import Watchdog, WatchdogConfig

pytestmark = pytest.mark.timeout(30)

SECRET = b"watchdog-test-secret-0123456789"


def _rec(
    rank: int,
    *,
    step: int = 10,
    seq: int = 42,
    active: bool = True,
    op: str = "all_reduce",
    shapes: tuple[tuple[int, ...], ...] = ((4,),),
    group: str = "world",
    section: str | None = None,
) -> ProgressRecord:
    coll = CollectiveFingerprint(op=op, group=group, shapes=shapes, seq=seq, active=active)
    return ProgressRecord(
        rank=rank, host=f"node{rank}", step=step, events=1, heartbeat=1, closed=False, collective=coll,
        group_seqs={group: seq}, section=section,
    )  # fmt: skip


# -- locate_root ----------------------------------------------------------------------------------------------------


def test_rank_that_never_entered_the_collective_is_root() -> None:
    """Ranks 0, 2, 3 wait in all_reduce #42; rank 1 left #41 and never entered #42 → rank 1."""
    records = {r: _rec(r) for r in (0, 2, 3)} | {1: _rec(1, seq=41, active=False)}
    verdict = locate_root(records, stuck=[0, 1, 2, 3])
    assert verdict.ranks == (1,) and verdict.kind == "hang" and verdict.step == 10
    assert (
        verdict.evidence["reference"]["seq"] == 42 and verdict.evidence["reference"]["waiting"] == 3
    )


def test_root_stuck_in_the_dataloader_makes_a_data_stall() -> None:
    records = {r: _rec(r) for r in (0, 1)} | {
        2: _rec(2, seq=41, active=False, section="dataloader")
    }
    verdict = locate_root(records, stuck=[0, 1, 2])
    assert verdict.ranks == (2,) and verdict.kind == "data_stall"


def test_desynchronized_fingerprint_is_root() -> None:
    records = {r: _rec(r) for r in (0, 1, 3)} | {2: _rec(2, op="all_gather", shapes=((8,),))}
    verdict = locate_root(records, stuck=[0, 1, 2, 3])
    assert verdict.ranks == (2,) and "different op or shapes" in verdict.reason


def test_everyone_waiting_in_the_same_collective_has_no_culprit() -> None:
    verdict = locate_root({r: _rec(r) for r in range(4)}, stuck=range(4))
    assert verdict.ranks == () and verdict.kind == "hang" and "no rank lags" in verdict.reason


def test_dead_rank_is_root() -> None:
    verdict = locate_root({r: _rec(r) for r in range(3)}, stuck=[], dead=[2])
    assert verdict.ranks == (2,) and "heartbeat" in verdict.reason


def test_step_lag_outside_collectives() -> None:
    records = {r: _rec(r, step=5, active=False) for r in range(3)} | {
        3: _rec(3, step=4, active=False)
    }
    assert locate_root(records, stuck=[3]).ranks == (3,)
    same = {r: _rec(r, step=5, active=False) for r in range(3)}
    assert locate_root(same, stuck=[0, 1, 2]).ranks == ()
    assert locate_root(same, stuck=[1]).ranks == (1,)


def test_subgroup_members_are_the_ranks_that_used_it() -> None:
    # Ranks 0 and 1 form group "tp0": rank 0 waits in #7 while rank 1 is at #6; ranks 2, 3 never used tp0.
    records = {
        0: _rec(0, group="tp0", seq=7),
        1: _rec(1, group="tp0", seq=6, active=False),
        2: _rec(2, group="tp1", seq=7, active=False),
        3: _rec(3, group="tp1", seq=7, active=False),
    }
    assert locate_root(records, stuck=[0, 1]).ranks == (1,)


# -- the Watchdog over a real store ----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def job() -> Iterator[tuple[dist.TCPStore, list[ProgressPublisher], OobChannel]]:
    """Four ranks' publishers (flushed by hand, no threads) and an observer channel, all on one real TCPStore."""
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    pubs = [
        ProgressPublisher(OobChannel(client, config=OobConfig(rank=r, secret=SECRET)))
        for r in range(4)
    ]
    observer = OobChannel(master, config=OobConfig(rank=None, secret=SECRET))
    yield master, pubs, observer


CFG = WatchdogConfig(
    stall_threshold=timedelta(seconds=10), poll_interval=timedelta(seconds=1), confirmations=2
)


def _train(
    pubs: list[ProgressPublisher], steps: range, *, skip_last_for: int | None = None
) -> None:
    for step in steps:
        for pub in pubs:
            pub.step(step)
            if pub.snapshot().rank == skip_last_for and step == steps[-1]:
                continue  # this rank stops before the collective of the last step
            pub.enter_collective("all_reduce", "world", [(4,)])
            if step != steps[-1]:
                pub.exit_collective()


def _tick(
    clock: FakeClock, watchdog: Watchdog, pubs: list[ProgressPublisher], seconds: float
) -> list[StallFinding]:
    clock.now += seconds
    for pub in pubs:
        pub.flush()  # heartbeats keep coming: the processes are alive
    return watchdog.poll_once()


def test_watchdog_names_the_hung_rank_after_confirmation(job: tuple) -> None:  # type: ignore[type-arg]
    _, pubs, observer = job
    clock = FakeClock()
    delivered: list[StallFinding] = []

    def broken_callback(_: StallFinding) -> None:
        raise RuntimeError("callback bug")

    watchdog = Watchdog(
        observer,
        world_size=4,
        config=CFG,
        clock=clock,
        callbacks=[broken_callback, delivered.append],
    )
    _train(pubs, range(1, 6), skip_last_for=1)
    assert _tick(clock, watchdog, pubs, 0) == []
    assert _tick(clock, watchdog, pubs, 9.0) == []  # under the threshold
    assert _tick(clock, watchdog, pubs, 1.5) == []  # stalled, first agreeing poll
    found = _tick(clock, watchdog, pubs, 1.0)
    assert len(found) == 1 and delivered == found
    finding = found[0]
    assert finding.kind == "hang" and finding.ranks == (1,) and finding.host
    assert finding.recommendation == "restart_from_verified" and finding.confirmations == 2
    assert finding.evidence["reference"] == {
        "group": "world", "seq": 5, "op": "all_reduce", "shapes": [[4]], "waiting": 3, "members": 4,
    }  # fmt: skip
    assert _tick(clock, watchdog, pubs, 1.0) == []  # one report per episode
    # Rank 1 recovers and everyone moves on: the episode ends, a new stall is a new report.
    pubs[1].enter_collective("all_reduce", "world", [(4,)])
    for pub in pubs:
        pub.exit_collective()
    assert _tick(clock, watchdog, pubs, 1.0) == []
    _train(pubs, range(6, 8), skip_last_for=3)
    for _ in range(12):
        found = _tick(clock, watchdog, pubs, 1.0)
        if found:
            break
    assert [f.ranks for f in found] == [(3,)] and len(watchdog.findings) == 2


def test_forged_progress_cannot_clear_the_root(job: tuple) -> None:  # type: ignore[type-arg]
    """An attacker rewrites rank 1's record to claim it waits in the collective too: rejected, rank 1 still named."""
    master, pubs, observer = job
    clock = FakeClock()
    patient = WatchdogConfig(
        stall_threshold=timedelta(seconds=10), heartbeat_timeout=timedelta(seconds=60)
    )
    watchdog = Watchdog(observer, world_size=4, config=patient, clock=clock)
    _train(pubs, range(1, 4), skip_last_for=1)
    _tick(clock, watchdog, pubs, 0)
    intruder = OobChannel(master, config=OobConfig(rank=1, secret=b"guessed-wrong-secret-000"))
    lie = pubs[0].snapshot().to_payload() | {"rank": 1, "host": "node1"}
    intruder.publish(PROGRESS_KEY, lie)
    honest = [pubs[0], pubs[2], pubs[3]]
    first = _tick(clock, watchdog, honest, 11)
    second = _tick(clock, watchdog, honest, 1)
    # The forgery itself is reported as tamper naming the slot; the hang comes from the honest ranks' own stop, with
    # rank 1 named from its last authentic record.
    assert [(f.kind, f.ranks, f.evidence["tamper"]["slot"]) for f in first] == [
        ("tamper", (1,), "gemscout/oob/1/progress")
    ]
    assert [(f.kind, f.ranks) for f in second] == [("hang", (1,))]
    assert second[0].evidence["tampered_slots"] == ["gemscout/oob/1/progress"]
    assert observer.stats.forged == 1


def test_dead_and_missing_ranks(job: tuple) -> None:  # type: ignore[type-arg]
    _, pubs, observer = job
    clock = FakeClock()
    watchdog = Watchdog(observer, world_size=5, config=CFG, clock=clock)  # rank 4 never publishes
    _train(pubs, range(1, 3))
    found: list[StallFinding] = []
    for _ in range(14):
        clock.now += 1
        for pub in pubs[:3]:  # rank 3's process died: no more heartbeats
            pub.flush()
        found += watchdog.poll_once()
    assert [f.ranks for f in found] == [(3, 4)] and "heartbeat" in found[0].reason


def test_watchdog_feeds_section_rounds_to_the_stall_detector(job: tuple) -> None:  # type: ignore[type-arg]
    _, pubs, observer = job
    clock = FakeClock()
    stall = StallConfig(absolute_threshold=timedelta(milliseconds=100), confirmations=2)
    watchdog = Watchdog(observer, world_size=4, config=CFG, stall_config=stall, clock=clock)
    found: list[StallFinding] = []
    for round_index in range(4):
        for pub in pubs:
            pub.step(round_index)
            pub.enter_section("checkpoint_read")
            pub.exit_section(
                "checkpoint_read", 0.5 if pub.snapshot().rank == 2 and round_index >= 1 else 0.01
            )
            if pub.snapshot().rank == 0 and round_index == 1:
                found += _tick(
                    clock, watchdog, pubs[:1], 0.1
                )  # rank 0 ahead: round 1 not complete elsewhere
        found += _tick(clock, watchdog, pubs, 0.1)
    assert [(f.kind, f.ranks, f.evidence["round"]) for f in found] == [
        ("checkpoint_stall", (2,), 2)
    ]


def test_watchdog_thread_starts_and_stops(job: tuple) -> None:  # type: ignore[type-arg]
    _, pubs, observer = job
    for pub in pubs:
        pub.start()
    watchdog = Watchdog(
        observer,
        world_size=4,
        config=WatchdogConfig(
            stall_threshold=timedelta(seconds=5), poll_interval=timedelta(milliseconds=20)
        ),
    ).start()
    try:
        for pub in pubs:
            pub.step(1)
            pub.flush(timeout=timedelta(seconds=5))
    finally:
        watchdog.stop(timeout=timedelta(seconds=5))
        for pub in pubs:
            pub.stop(timeout=timedelta(seconds=5))
    assert watchdog.findings == []
    closed = observer.read_many(range(4), PROGRESS_KEY)
    assert all(ProgressRecord.from_payload(p).closed for p in closed.values()) and len(closed) == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stall_threshold": timedelta(0)}, "stall_threshold"),
        ({"poll_interval": timedelta(seconds=500)}, "poll_interval"),
        ({"confirmations": 0}, "confirmations"),
        ({"heartbeat_timeout": timedelta(milliseconds=1)}, "heartbeat_timeout"),
    ],
)
def test_watchdog_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"WatchdogConfig.{field}"):
        WatchdogConfig(**kwargs)  # type: ignore[arg-type]
