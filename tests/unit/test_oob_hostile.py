"""The out-of-band store under attack: real TCPStores on localhost, a forger and a flooder on connections of their own.

Someone on the same host without the job's secret can reach a TCPStore's port (it has no authentication). What must
hold: the server listens on the job's address only; a forged, deleted or replayed slot never becomes a hang verdict
(it becomes a ``tamper`` finding naming the slot); a message of an earlier run is refused after a restart; a flood of
keys does not grow the serving process's memory past a cap; the secret never shows in a ``repr``.
"""

from __future__ import annotations

import fcntl
import json
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from gemscout.oob import (
    OobChannel,
    OobConfig,
    ProgressConfig,
    ProgressPublisher,
    StallFinding,
    Watchdog,
    WatchdogConfig,
    serve_store,
)
from gemscout.oob.records import PROGRESS_KEY
from gemscout.watch import WatchConfig, finding_to_report

pytestmark = pytest.mark.timeout(60)

SECRET = b"hostile-test-secret-0123456789ab"
WORLD = 4


def _listen_address(port: int) -> str:
    """The local address the socket listening on ``port`` is bound to, from /proc/net/tcp{,6}."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1], line.split()[2], line.split()[3]
            addr, port_hex = local.split(":")
            if int(port_hex, 16) == port and state == "0A":  # LISTEN
                return addr
    raise AssertionError(f"nothing listens on port {port}")


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this host that is not loopback (ioctl SIOCGIFADDR per interface), or None."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                return address
    finally:
        probe.close()
    return None


def test_store_listens_on_the_jobs_address_only() -> None:
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    # Why serve_store exists: TCPStore's own server ignores host_name and listens on every interface.
    assert _listen_address(plain.port) in ("00000000", "00000000000000000000000000000000")
    bound = serve_store("127.0.0.1", 0, timeout=timedelta(seconds=5))
    assert _listen_address(bound.port) == "0100007F"  # 127.0.0.1, little-endian hex
    client = dist.TCPStore("127.0.0.1", bound.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert bound.get("k") == b"v"
    other = _non_loopback_ipv4()
    if other is not None:  # the same port from the host's other address is refused
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            assert s.connect_ex((other, bound.port)) != 0


def test_repr_hides_the_secret() -> None:
    assert SECRET.decode() not in repr(OobConfig(rank=0, secret=SECRET))
    assert "secret" not in repr(OobConfig(rank=0, secret=SECRET))
    assert SECRET.decode() not in repr(WatchConfig(secret=SECRET)) and "secret" not in repr(WatchConfig(secret=SECRET))


@pytest.fixture
def served() -> Iterator[tuple[dist.TCPStore, int]]:
    store = serve_store("127.0.0.1", 0, timeout=timedelta(seconds=10))
    yield store, store.port


def _job(port: int, epoch: str = "run-a") -> tuple[list[ProgressPublisher], OobChannel]:
    fast = ProgressConfig(publish_interval=timedelta(milliseconds=20), heartbeat_interval=timedelta(milliseconds=100))
    pubs = []
    for rank in range(WORLD):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        pubs.append(
            ProgressPublisher(
                OobChannel(client, config=OobConfig(rank=rank, secret=SECRET, epoch=epoch)), config=fast
            ).start()
        )
    observer_store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return pubs, OobChannel(observer_store, config=OobConfig(rank=None, secret=SECRET, epoch=epoch))


def _forge(port: int, seconds: float, done: list[int], ready: threading.Event) -> None:
    """The attacker: its own connection, no secret. A made-up MAC over a plausible record of rank 1, and rank 2's
    slot deleted, as fast as it can. (A thread, not a process: importing torch in a fresh process costs seconds on
    a loaded machine, and a connection is a connection.)"""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    ready.set()
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        payload = {"v": 2, "ns": "gemscout/oob", "epoch": "run-a", "rank": 1, "key": "progress", "seq": 2**62 + n}
        body = json.dumps(payload | {"payload": {}}, separators=(",", ":"))
        store.set("gemscout/oob/1/progress", "00" * 32 + "\n" + body)
        store.delete_key("gemscout/oob/2/progress")
        n += 1
    done.append(n)


def _watch(observer: OobChannel, seconds: float, findings: list[StallFinding], *, sweep: bool = True) -> None:
    cfg = WatchdogConfig(
        stall_threshold=timedelta(seconds=0.6),
        poll_interval=timedelta(milliseconds=50),
        heartbeat_timeout=timedelta(seconds=0.6),
        confirmations=2,
    )
    watchdog = Watchdog(observer, world_size=WORLD, config=cfg, callbacks=[findings.append], sweep=sweep)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watchdog.poll_once()
        time.sleep(0.05)


def _train_while(pubs: list[ProgressPublisher], seconds: float) -> None:
    end, step = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        step += 1
        for pub in pubs:
            pub.step(step)
        time.sleep(0.02)


def test_forger_without_the_secret_cannot_make_a_hang(served: tuple[dist.TCPStore, int]) -> None:
    """A process without the secret overwrites rank 1's slot and deletes rank 2's in a tight loop while the job
    trains: only ``tamper`` findings naming those slots, never a hang. Then a real death is still a hang."""
    _, port = served
    pubs, observer = _job(port)
    findings: list[StallFinding] = []
    done: list[int] = []
    ready = threading.Event()
    forger = threading.Thread(target=_forge, args=(port, 2.0, done, ready))
    trainer = threading.Thread(target=_train_while, args=(pubs, 2.5))
    forger.start()
    assert ready.wait(20), "the forger could not connect"
    trainer.start()
    _watch(observer, 2.5, findings)
    trainer.join(10)
    forger.join(10)
    assert done and done[0] > 10, "the forger did not run"
    kinds = [
        (f.kind, f.evidence.get("tamper", {}).get("slot"), f.evidence.get("tamper", {}).get("kind")) for f in findings
    ]
    assert ("tamper", "gemscout/oob/1/progress", "forged") in kinds, kinds
    # Rank 2's slot is deleted faster than the polls see it: whether or not a deletion is caught, no hang.
    assert all(f.kind == "tamper" and f.recommendation == "observe" for f in findings), findings
    report = finding_to_report(next(f for f in findings if f.ranks == (1,)))
    assert (
        report.kind.value == "tamper"
        and report.scope.value == "peer_group"
        and "gemscout/oob/1/progress" in report.reason
    )
    assert observer.stats.forged >= 1
    # Control: the same watchdog set-up still sees a real stop. Rank 3's process "dies" (no more heartbeats).
    pubs[3]._stopping = True  # noqa: SLF001 - end its publishing thread without the final 'closed' record
    with pubs[3]._cond:  # noqa: SLF001
        pubs[3]._cond.notify_all()  # noqa: SLF001
    after: list[StallFinding] = []
    _watch(observer, 2.0, after)
    for pub in pubs[:3]:
        pub.stop()
    hangs = [f for f in after if f.kind == "hang"]
    assert [f.ranks for f in hangs] == [(3,)] and hangs[0].recommendation == "restart_from_verified", after


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_deleted_and_overwritten_slots_never_make_a_hang(served: tuple[dist.TCPStore, int]) -> None:
    """Rank 2's slot deleted after the watchdog saw it, rank 3's overwritten with garbage, for far longer than the
    heartbeat timeout while the ranks train (fake clock, hand-flushed publishers): tamper findings, no hang."""
    store, port = served
    pubs, observer = _job(port)
    for pub in pubs:
        pub.stop()
    live = [
        ProgressPublisher(
            OobChannel(
                dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)),
                config=OobConfig(rank=r, secret=SECRET, epoch="run-a"),
            )
        )
        for r in range(WORLD)
    ]
    clock = FakeClock()
    cfg = WatchdogConfig(stall_threshold=timedelta(seconds=10), confirmations=2)
    findings: list[StallFinding] = []
    watchdog = Watchdog(observer, world_size=WORLD, config=cfg, clock=clock, callbacks=[findings.append])
    for step in range(1, 40):
        for pub in live:
            pub.step(step)
            pub.flush()
        if step >= 3:  # the attacker acts after each publish, before each poll
            store.delete_key("gemscout/oob/2/progress")
            store.set("gemscout/oob/3/progress", "ff" * 32 + "\n{}")
        clock.now += 1.0
        watchdog.poll_once()
    assert sorted((f.kind, f.ranks, f.evidence["tamper"]["kind"]) for f in findings) == [
        ("tamper", (2,), "deleted"), ("tamper", (3,), "forged")
    ]  # fmt: skip
    # Control: the attacker stops, rank 0 really stops publishing: a hang naming rank 0 once the window has passed.
    for _ in range(40):
        for pub in live[1:]:
            pub.flush()
        clock.now += 1.0
        watchdog.poll_once()
    hangs = [f for f in findings if f.kind == "hang"]
    assert [f.ranks for f in hangs] == [(0,)], findings


def test_replayed_message_is_refused_after_a_watchdog_restart(served: tuple[dist.TCPStore, int]) -> None:
    """Run A's authentic messages, written back into the store after the job restarted as run B (new epoch, new
    watchdog with no memory of A): refused as replays and reported as tamper, never taken as rank 1's progress."""
    store, port = served
    pubs_a, observer_a = _job(port, epoch="run-a")
    pubs_a[1].step(7)
    pubs_a[1].flush()
    captured = store.get("gemscout/oob/1/progress")
    assert observer_a.read(1, PROGRESS_KEY) is not None  # authentic in its own run
    for pub in pubs_a:
        pub.stop()
    # Restart on the same store: fresh epoch, fresh watchdog with no memory of run A. The run-B ranks publish, then
    # the attacker writes run A's captured record over rank 1's slot.
    findings: list[StallFinding] = []
    pubs_b, observer_b = _job(port, epoch="run-b")
    for pub in pubs_b:
        pub.stop()  # the ranks stop publishing: their slots hold their last run-B record
    watchdog = Watchdog(
        observer_b, world_size=WORLD, config=WatchdogConfig(stall_threshold=timedelta(seconds=5)),
        callbacks=[findings.append],
    )  # fmt: skip
    watchdog.poll_once()
    assert observer_b.stats.accepted == WORLD and findings == []
    store.set("gemscout/oob/1/progress", captured.decode())
    watchdog.poll_once()
    assert observer_b.read(1, PROGRESS_KEY) is None
    assert observer_b.stats.replayed == 1 and observer_b.stats.accepted == WORLD + 3
    assert [(f.kind, f.ranks, f.evidence["tamper"]["kind"]) for f in findings] == [("tamper", (1,), "replayed")]
    assert "epoch" in findings[0].reason


def test_leftovers_of_an_earlier_run_are_refused_without_a_finding(served: tuple[dist.TCPStore, int]) -> None:
    """A reused store still holds run A's last records when run B's watchdog starts: refused, not reported."""
    _, port = served
    pubs_a, _ = _job(port, epoch="run-a")
    for pub in pubs_a:
        pub.stop()
    observer_b = OobChannel(
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)),
        config=OobConfig(rank=None, secret=SECRET, epoch="run-b"),
    )
    findings: list[StallFinding] = []
    Watchdog(observer_b, world_size=WORLD, callbacks=[findings.append]).poll_once()
    assert findings == [] and observer_b.stats.replayed == WORLD and observer_b.stats.accepted == 0


def test_namespace_is_inside_the_mac(served: tuple[dist.TCPStore, int]) -> None:
    store, port = served
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    job_a = OobChannel(client, config=OobConfig(rank=0, secret=SECRET, namespace="job-a"))
    job_b = OobChannel(store, config=OobConfig(rank=None, secret=SECRET, namespace="job-b"))
    job_a.publish("progress", {"step": 1})
    store.set(job_b.slot(0, "progress"), store.get(job_a.slot(0, "progress")).decode())
    assert job_b.read(0, "progress") is None and job_b.stats.forged == 1


def _flood(port: int, keys: int, done: list[bool]) -> None:
    """The flooder: its own connection, no secret, 64 KiB values under fresh keys, then an oversized real slot."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    value = "x" * (1 << 16)
    for i in range(keys):
        store.set(f"flood/{i}", value)
    store.set("gemscout/oob/1/progress", "y" * (1 << 20))
    done.append(True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_a_flood_is_swept_and_leaves_nothing_behind(served: tuple[dist.TCPStore, int]) -> None:
    """2,000 x 64 KiB keys (125 MiB) written at the store this process serves, while the watchdog sweeps: foreign
    keys and the oversized slot are deleted and reported as tamper, and the serving process's memory peaks below
    the flood. TCPStore's server has no key or size cap of its own: between two sweeps a flood is held in full."""
    store, port = served
    observer = OobChannel(
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)),
        config=OobConfig(rank=None, secret=SECRET, epoch="run-a"),
    )
    before = _rss_bytes()
    keys = 2000
    done: list[bool] = []
    flooder = threading.Thread(target=_flood, args=(port, keys, done))
    findings: list[StallFinding] = []
    cfg = WatchdogConfig(stall_threshold=timedelta(seconds=30), poll_interval=timedelta(milliseconds=20))
    watchdog = Watchdog(observer, world_size=WORLD, config=cfg, callbacks=[findings.append], sweep=True)
    peak = before
    flooder.start()
    while flooder.is_alive():
        watchdog.poll_once()
        peak = max(peak, _rss_bytes())
        time.sleep(0.02)
    assert done == [True]
    watchdog.poll_once()
    watchdog.poll_once()
    flood_bytes = keys * (1 << 16)
    growth = peak - before
    assert growth < flood_bytes * 3 // 4, (
        f"serving process grew {growth >> 20} MiB under a {flood_bytes >> 20} MiB flood"
    )
    assert all(not k.startswith("flood/") for k in store.list_keys()), store.num_keys()
    assert store.num_keys() <= WORLD
    assert observer.stats.swept >= keys // 2
    kinds = {f.evidence["tamper"]["kind"] for f in findings if f.kind == "tamper"}
    assert {"foreign_keys", "oversized"} <= kinds, findings
    assert all(f.kind == "tamper" for f in findings)
