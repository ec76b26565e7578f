"""The out-of-band store under attack: real TCPStores on localhost, a forger and a flooder on connections of their own.

Someone on the same host without the job's secret can reach a TCPStore's port (it has no authentication). What must
hold: the server listens on the job's address only; a forged, deleted or replayed slot never becomes a hang verdict
(it becomes a ``tamper`` finding naming the slot); a message of an earlier run is refused after a restart; a flood of
keys does not grow the training process at all (the store is served by a child process with a memory cap of its own,
whose loss is a finding); the secret never shows in a ``repr``.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist

from gemscout.watch import (
    OobChannel,
    OobConfig,
    ProgressConfig,
    ProgressPublisher,
    StallFinding,
    StoreServer,
    StoreServerConfig,
    StoreServerError,
    StoreStatus,
    Watchdog,
    WatchdogConfig,
    serve_store,
)
from gemscout.watch.records import PROGRESS_KEY
from gemscout.watch.service import WatchConfig, finding_to_report

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
                packed = fcntl.ioctl(
                    probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                return address
    finally:
        probe.close()
    return None


def test_store_listens_on_the_jobs_address_only() -> None:
    plain = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
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
    assert SECRET.decode() not in repr(WatchConfig(secret=SECRET)) and "secret" not in repr(
        WatchConfig(secret=SECRET)
    )


@pytest.fixture
def served() -> Iterator[tuple[dist.TCPStore, int]]:
    store = serve_store("127.0.0.1", 0, timeout=timedelta(seconds=10))
    yield store, store.port


def _job(port: int, epoch: str = "run-a") -> tuple[list[ProgressPublisher], OobChannel]:
    fast = ProgressConfig(
        publish_interval=timedelta(milliseconds=20), heartbeat_interval=timedelta(milliseconds=100)
    )
    pubs = []
    for rank in range(WORLD):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        pubs.append(
            ProgressPublisher(
                OobChannel(client, config=OobConfig(rank=rank, secret=SECRET, epoch=epoch)),
                config=fast,
            ).start()
        )
    observer_store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)
    )
    return pubs, OobChannel(observer_store, config=OobConfig(rank=None, secret=SECRET, epoch=epoch))


def _forge(port: int, seconds: float, done: list[int], ready: threading.Event) -> None:
    """The attacker: its own connection, no secret. A made-up MAC over a plausible record of rank 1, and rank 2's
    slot deleted, as fast as it can. (A thread, not a process: importing torch in a fresh process costs seconds on
    a loaded machine, and a connection is a connection.)"""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    ready.set()
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        payload = {
            "v": 2,
            "ns": "gemscout/oob",
            "epoch": "run-a",
            "rank": 1,
            "key": "progress",
            "seq": 2**62 + n,
        }
        body = json.dumps(payload | {"payload": {}}, separators=(",", ":"))
        store.set("gemscout/oob/1/progress", "00" * 32 + "\n" + body)
        store.delete_key("gemscout/oob/2/progress")
        n += 1
    done.append(n)


def _watch(
    observer: OobChannel, seconds: float, findings: list[StallFinding], *, sweep: bool = True
) -> None:
    cfg = WatchdogConfig(
        stall_threshold=timedelta(seconds=0.6),
        poll_interval=timedelta(milliseconds=50),
        heartbeat_timeout=timedelta(seconds=0.6),
        confirmations=2,
    )
    watchdog = Watchdog(
        observer, world_size=WORLD, config=cfg, callbacks=[findings.append], sweep=sweep
    )
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
        (f.kind, f.evidence.get("tamper", {}).get("slot"), f.evidence.get("tamper", {}).get("kind"))
        for f in findings
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
    assert [f.ranks for f in hangs] == [(3,)] and hangs[
        0
    ].recommendation == "restart_from_verified", after


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
    watchdog = Watchdog(
        observer, world_size=WORLD, config=cfg, clock=clock, callbacks=[findings.append]
    )
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
    for step in range(4, 44):  # ranks 1-3 train on; rank 0 is silent
        for pub in live[1:]:
            pub.step(step)
            pub.flush()
        clock.now += 1.0
        watchdog.poll_once()
    hangs = [f for f in findings if f.kind == "hang"]
    assert [f.ranks for f in hangs] == [(0,)], findings


class FloodedStore:
    """A stand-in for the store process's reports (``StoreHealth``): it has swept ``swept`` foreign keys so far."""

    def __init__(self) -> None:
        self.swept = 0

    def status(self) -> StoreStatus:
        return StoreStatus(
            swept=self.swept, sample=("flood/0",), swept_at=None, pressure=True, lost=None
        )


def test_a_flood_that_silences_every_rank_is_no_hang(served: tuple[dist.TCPStore, int]) -> None:
    """A store filled to its cap refuses the ranks' heartbeats too. While the store process keeps sweeping foreign
    keys, far longer than the heartbeat timeout, with no rank publishing (fake clock): one tamper finding, no hang.
    Then the flood ends and rank 0 really stays silent: a hang naming it once the window has passed."""
    _, port = served
    live = [
        ProgressPublisher(
            OobChannel(
                dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)),
                config=OobConfig(rank=r, secret=SECRET, epoch="run-a"),
            )
        )
        for r in range(WORLD)
    ]
    observer = OobChannel(
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)),
        config=OobConfig(rank=None, secret=SECRET, epoch="run-a"),
    )
    clock, flood = FakeClock(), FloodedStore()
    findings: list[StallFinding] = []
    cfg = WatchdogConfig(stall_threshold=timedelta(seconds=10), confirmations=2)
    watchdog = Watchdog(
        observer,
        world_size=WORLD,
        config=cfg,
        clock=clock,
        callbacks=[findings.append],
        store=flood,
    )
    for step in range(1, 4):
        for pub in live:
            pub.step(step)
            pub.flush()
        clock.now += 1.0
        watchdog.poll_once()
    for _ in range(40):  # nothing reaches the store; its process sweeps the flood
        flood.swept += 100
        clock.now += 1.0
        watchdog.poll_once()
    assert [(f.kind, f.ranks, f.evidence["tamper"]["kind"]) for f in findings] == [
        ("tamper", (), "foreign_keys")
    ]
    for step in range(4, 44):  # ranks 1-3 train on; rank 0 is silent
        for pub in live[1:]:
            pub.step(step)
            pub.flush()
        clock.now += 1.0
        watchdog.poll_once()
    hangs = [f for f in findings if f.kind == "hang"]
    assert [f.ranks for f in hangs] == [(0,)], findings


def test_replayed_message_is_refused_after_a_watchdog_restart(
    served: tuple[dist.TCPStore, int],
) -> None:
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
    assert [(f.kind, f.ranks, f.evidence["tamper"]["kind"]) for f in findings] == [
        ("tamper", (1,), "replayed")
    ]
    assert "epoch" in findings[0].reason


def test_leftovers_of_an_earlier_run_are_refused_without_a_finding(
    served: tuple[dist.TCPStore, int],
) -> None:
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


_FLOODER = """
import sys
from datetime import timedelta
from torch.distributed import DistNetworkError, TCPStore
port, keys, oversized = int(sys.stdin.readline()), int(sys.argv[1]), sys.argv[2] == "1"
value, store, sent, dropped = "x" * (1 << 16), None, 0, 0
for i in range(keys):
    try:
        if store is None:
            store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        store.set(f"flood/{i}", value)
        sent += 1
    except DistNetworkError:  # the store refused a message past its cap and dropped us: come back, keep flooding
        store, dropped = None, dropped + 1
if oversized:
    if store is None:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    store.set("gemscout/oob/1/progress", "y" * (1 << 20))
print(sent, dropped, flush=True)
"""


def _flooder(keys: int, *, oversized: bool) -> subprocess.Popen[str]:
    """The flooder: a process of its own, no secret, ``keys`` x 64 KiB values under fresh keys (reconnecting when the
    store drops it), then (``oversized``) a 1 MiB value in rank 1's slot. It imports torch first, then reads the port
    from stdin, so its start overlaps the store's."""
    command = [sys.executable, "-c", _FLOODER, str(keys), "1" if oversized else "0"]
    # Its stderr is torch's warning per dropped connection: noise, not evidence.
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )


def _rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


FLOOD_KEYS = 2000  # x 64 KiB = 125 MiB


def test_a_flood_does_not_grow_the_training_process_and_leaves_nothing_behind() -> None:
    """125 MiB of foreign keys from another process, while ranks 0, 2, 3 publish and the watchdog polls: the store is
    served by a capped child process, so this (the training) process does not grow; the child stays under its cap and
    serves on; the flood and the oversized slot are deleted and reported as tamper, and the ranks' records still
    arrive. (A sweeper inside this process could not do it: one writer floods faster than a reader lists and
    deletes.)"""
    flooder = _flooder(FLOOD_KEYS, oversized=True)
    cap = 256 << 20
    server = StoreServer.start(
        "127.0.0.1", namespace="gemscout/oob", world_size=WORLD, keys=[PROGRESS_KEY],
        config=StoreServerConfig(memory_cap_bytes=cap, max_restarts=0),
    )  # fmt: skip
    try:
        assert (
            _listen_address(server.port) == "0100007F"
        )  # the child serves on loopback only, like serve_store
        pubs, observer = _job(server.port)
        pubs[
            1
        ].stop()  # rank 1's slot is where the flooder puts its oversized value; nothing overwrites it
        findings: list[StallFinding] = []
        cfg = WatchdogConfig(
            stall_threshold=timedelta(seconds=30), poll_interval=timedelta(milliseconds=20)
        )
        watchdog = Watchdog(
            observer, world_size=WORLD, config=cfg, callbacks=[findings.append], store=server
        )
        watchdog.poll_once()
        before, child_before = _rss_bytes(), _rss_bytes(server.pid)
        peak, child_peak = before, child_before
        assert flooder.stdin is not None and flooder.stdout is not None
        flooder.stdin.write(f"{server.port}\n")
        flooder.stdin.flush()
        deadline = time.monotonic() + 30
        while flooder.poll() is None and time.monotonic() < deadline:
            watchdog.poll_once()
            peak, child_peak = max(peak, _rss_bytes()), max(child_peak, _rss_bytes(server.pid))
            time.sleep(0.02)
        sent, dropped = map(int, flooder.stdout.read().split())
        assert flooder.wait(5) == 0 and sent == FLOOD_KEYS and dropped == 0
        check = dist.TCPStore(
            "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10)
        )
        deadline = time.monotonic() + 10
        # The child reports what it swept every 0.25 s, so the count lags the deletions: wait for both.
        while time.monotonic() < deadline and (
            any(k.startswith("flood/") for k in check.list_keys())
            or not {"foreign_keys", "oversized"} <= _kinds(findings)
            or observer.stats.swept < FLOOD_KEYS // 2
        ):
            watchdog.poll_once()
            time.sleep(0.05)
        growth = peak - before
        assert growth < 8 << 20, (
            f"the training process grew {growth >> 20} MiB under a 125 MiB flood"
        )
        assert child_peak - child_before < cap and server.status().lost is None
        assert [k for k in check.list_keys() if not k.endswith("/progress")] == []
        assert {"foreign_keys", "oversized"} <= _kinds(findings), findings
        assert all(f.kind == "tamper" and f.recommendation == "observe" for f in findings), findings
        assert observer.stats.swept >= FLOOD_KEYS // 2
        pubs[0].step(99)
        pubs[0].flush()
        assert (observer.read(0, PROGRESS_KEY) or {}).get(
            "step"
        ) == 99  # the store still serves the job
        # The store process dies (what the kernel's OOM killer would do to it): one finding naming the cause, and the
        # watchdog reads nothing more; publishing fails without blocking and without raising into training.
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "store_lost" not in _kinds(findings):
            watchdog.poll_once()
            time.sleep(0.02)
        (lost,) = [f for f in findings if f.evidence["tamper"]["kind"] == "store_lost"]
        assert (
            f"store process {server.pid} was killed by SIGKILL" in lost.reason
            and lost.recommendation == "observe"
        )
        assert watchdog.poll_once() == []
        started = time.monotonic()
        for pub in pubs:
            pub.step(100)
            pub.stop()
        assert time.monotonic() - started < 5
    finally:
        flooder.kill()
        server.close()
    assert _gone(server.pid)


def _flood_from_here(port: int, keys: int) -> int:
    """Write ``keys`` x 64 KiB foreign keys, coming back each time the store drops the connection (at most 3 times:
    at the cap each reconnect waits out its timeout); return how often it did."""
    value, store, dropped = "x" * (1 << 16), None, 0
    for i in range(keys):
        try:
            if store is None:
                store = dist.TCPStore(
                    "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1)
                )
            store.set(f"flood/{i}", value)
        except (
            dist.DistNetworkError,
            dist.DistStoreError,
        ):  # dropped at the cap; a reconnect at the cap times out
            store, dropped = None, dropped + 1
            if dropped == 3:
                break
    return dropped


def _serves(port: int, timeout: float, *, pid: int) -> bool:
    """Whether a fresh client can write and read back a key within ``timeout`` seconds (no, at once, when the store
    process ``pid`` is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not _gone(pid):
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
            client.set("probe", "ok")
            if client.get("probe") == b"ok":
                return True
        except (dist.DistNetworkError, dist.DistStoreError):
            time.sleep(0.2)
    return False


def _kinds(findings: list[StallFinding]) -> set[str]:
    return {f.evidence["tamper"]["kind"] for f in findings if f.kind == "tamper"}


def _event(proc: subprocess.Popen[str], name: str, timeout: float = 30.0) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no {name!r} from the training process within {timeout} s"
    line = proc.stdout.readline()
    assert line, f"the training process ended before {name!r} (rc {proc.poll()})"
    event = json.loads(line)
    assert event["event"] == name, event
    return event


def _tell(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(word + "\n")
    proc.stdin.flush()


@pytest.mark.timeout(90)
def test_a_flood_above_the_cap_and_a_lost_store_are_findings_never_a_hang() -> None:
    """A training process (one rank, gloo, a ``Watch`` whose store process is capped at 32 MiB and sweeps every 2 s)
    while 125 MiB are flooded at its store: the store fills to its cap and refuses (it drops the flooder, which comes
    back). Then either it lives and serves again once swept, or — torch's server does not survive every failed
    allocation: a SIGSEGV was seen with two busy loops beside the test — it dies; either way the training side gets a
    tamper finding (``foreign_keys`` or ``store_lost``) and no hang. A store that lived is then SIGKILLed (what the
    kernel's OOM killer would do): a ``store_lost`` finding naming the cause, training goes on, ``Watch.close``
    returns at once. Then the training process itself is SIGKILLed: its store process does not outlive it."""
    program = Path(__file__).with_name("watch_flood_support.py")
    training = subprocess.Popen(
        [sys.executable, str(program), "32"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    store_pids: list[int] = []
    try:
        ready = _event(training, "ready", timeout=60)
        store_pids.append(ready["store_pid"])
        dropped = _flood_from_here(
            ready["port"], FLOOD_KEYS
        )  # this process is not the training process
        assert dropped >= 1, dropped  # the store refused past its cap: it dropped the flooder
        # Full to its cap, the store refused everyone; its sweeps (the reserve above the cap) make it serve again.
        survived = _serves(ready["port"], timeout=15, pid=ready["store_pid"])
        _tell(training, "flooded")
        seen = _event(training, "flood_seen")
        assert [k for k in seen["reports"] if k[0] != "tamper"] == [], seen
        assert (seen["store"] is None) == survived, seen
        assert any(k[1] in ("foreign_keys", "store_lost") for k in seen["reports"]), seen
        if survived:
            os.kill(ready["store_pid"], signal.SIGKILL)
        _tell(training, "killed")
        lost = _event(training, "lost")
        (reason,) = [k[2] for k in lost["reports"] if k[1] == "store_lost"]
        assert f"store process {ready['store_pid']} " in reason and (
            not survived or "SIGKILL" in reason
        ), reason
        assert [k for k in lost["reports"] if k[0] != "tamper"] == [] and lost["trained"] > 0, lost
        closed = _event(training, "closed")
        assert closed["seconds"] < 5, closed
        second = _event(training, "second", timeout=60)
        store_pids.append(second["store_pid"])
        assert not _gone(second["store_pid"])
        training.kill()
        training.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not _gone(second["store_pid"]):
            time.sleep(0.05)
        assert _gone(second["store_pid"]), "the store process outlived its training process"
    finally:
        training.kill()
        training.wait(10)
        for pid in store_pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_lost_store_is_reported_by_every_ranks_watchdog() -> None:
    """The store process (a real child, SIGKILLed) serves 4 publishing ranks and two watchdogs: rank 0's, which has
    the process at hand, and another rank's, which sees the store only through its connection (what every rank's
    watchdog is with ``watchdog_on="all"``). Both report one ``store_lost`` tamper finding, no hang: the owner at
    once, naming the signal; the other once its reads have failed for ``store_unreachable`` (1 s here), naming
    that; neither reports again on later polls."""
    server = StoreServer.start(
        "127.0.0.1", namespace="gemscout/oob", world_size=WORLD, keys=[PROGRESS_KEY],
        config=StoreServerConfig(max_restarts=0),  # stays down: test_oob_store_restart.py has the restarts
    )  # fmt: skip
    pubs: list[ProgressPublisher] = []
    try:
        pubs, observer = _job(server.port)
        other = OobChannel.connect(
            host="127.0.0.1",
            port=server.port,
            config=OobConfig(rank=None, secret=SECRET, epoch="run-a"),
        )
        cfg = WatchdogConfig(
            stall_threshold=timedelta(seconds=30),
            poll_interval=timedelta(milliseconds=50),
            store_unreachable=timedelta(seconds=1),
        )
        owner_found: list[StallFinding] = []
        other_found: list[StallFinding] = []
        owner = Watchdog(
            observer, world_size=WORLD, config=cfg, callbacks=[owner_found.append], store=server
        )
        peer = Watchdog(other, world_size=WORLD, config=cfg, callbacks=[other_found.append])
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline and len(other.read_many(range(WORLD), PROGRESS_KEY)) < WORLD
        ):
            time.sleep(0.05)
        assert owner.poll_once() == [] and peer.poll_once() == []
        os.kill(server.pid, signal.SIGKILL)
        killed = time.monotonic()
        lost_at: dict[str, float] = {}
        while time.monotonic() < killed + 15 and len(lost_at) < 2:
            for name, watchdog in (("owner", owner), ("other", peer)):
                try:
                    watchdog.poll_once()
                except (
                    Exception
                ):  # a failed poll before the outage counts: what the watchdog thread would log
                    pass
                found = owner_found if name == "owner" else other_found
                if found and name not in lost_at:
                    lost_at[name] = time.monotonic() - killed
            time.sleep(0.05)
        for found in (owner_found, other_found):
            assert [(f.kind, f.evidence["tamper"]["kind"], f.recommendation) for f in found] == [
                ("tamper", "store_lost", "observe")
            ], found
        assert "killed by SIGKILL" in owner_found[0].reason, owner_found[0].reason
        assert "unreachable from this watchdog for" in other_found[0].reason, other_found[0].reason
        assert lost_at["owner"] < 3 and 1 <= lost_at["other"] < 8, lost_at
        assert owner.poll_once() == [] and peer.poll_once() == []  # reported once, and quiet after
        print(f"store_lost after SIGKILL: {lost_at}")
        assert len(owner_found) == 1 and len(other_found) == 1
    finally:
        for pub in pubs:
            pub.stop()
        server.close()


_BIG = 8 << 20  # the largest value the libuv TCPStore server takes (it drops a client sending more)


@pytest.mark.timeout(120)
def test_a_slot_as_large_as_the_cap_is_refused_without_being_read() -> None:
    """An outsider puts 8 MiB (the most one value can be) in rank 1's and rank 2's slots, where a reader refuses
    anything over ``max_message_bytes`` (256 KiB). A watchdog's channel (``OobChannel.connect``) refuses rank 1's
    slot from its length alone: the read's peak Python allocation (tracemalloc) stays under 1 MiB, the slot is
    reported ``oversized`` ("not read") and deleted. The control, a channel over a plain ``TCPStore`` connection,
    takes rank 2's value whole first (a peak of at least 8 MiB) and refuses it only then."""
    server = StoreServer.start(
        "127.0.0.1",
        namespace="gemscout/oob",
        world_size=WORLD,
        keys=[PROGRESS_KEY],
    )
    try:
        attacker = dist.TCPStore(
            "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30)
        )
        for rank in (1, 2):
            attacker.set(f"gemscout/oob/{rank}/{PROGRESS_KEY}", b"x" * _BIG)
        config = OobConfig(rank=None, secret=SECRET, epoch="run-a")
        bounded = OobChannel.connect(host="127.0.0.1", port=server.port, config=config)
        plain = OobChannel(
            dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10)),
            config=config,
        )
        tracemalloc.start()
        try:
            got = bounded.read(1, PROGRESS_KEY)
            bounded_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            plain_got = plain.read(2, PROGRESS_KEY)
            plain_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got is None and plain_got is None
        assert bounded_peak < 1 << 20, bounded_peak
        assert plain_peak >= _BIG, plain_peak  # the control: TCPStore.get takes it whole
        events = [(e.kind, e.rank, e.reason) for e in bounded.tamper_events()]
        assert [(k, r) for k, r, _ in events] == [("oversized", 1)], events
        assert f"message of {_BIG} bytes" in events[0][2] and "not read" in events[0][2], events
        assert not attacker.check([bounded.slot(1, PROGRESS_KEY)])  # deleted: its owner republishes
        print(
            f"peak Python allocation of one read: bounded {bounded_peak} B, plain {plain_peak >> 20} MiB"
        )
    finally:
        server.close()


def test_a_store_process_that_cannot_start_is_a_clear_error() -> None:
    """An interpreter that exits at once, and one that is not serving within the start timeout: ``StoreServerError``
    naming the cause, no process left behind, and no hang."""
    with pytest.raises(
        StoreServerError, match="could not start: store process [0-9]+ exited with 1"
    ):
        StoreServer.start(
            "127.0.0.1",
            namespace="ns",
            world_size=1,
            keys=["k"],
            config=StoreServerConfig(python="/bin/false"),
        )
    started = time.monotonic()
    slow = StoreServerConfig(
        start_timeout=timedelta(milliseconds=50)
    )  # importing torch takes far longer
    with pytest.raises(
        StoreServerError, match="not serving within .* raise StoreServerConfig.start_timeout"
    ):
        StoreServer.start("127.0.0.1", namespace="ns", world_size=1, keys=["k"], config=slow)
    assert time.monotonic() - started < 10
    assert [p for p in psutil.Process().children() if _CHILD_NAME in " ".join(p.cmdline())] == []


_CHILD_NAME = "_store_child.py"
