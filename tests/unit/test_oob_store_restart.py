"""The out-of-band store heals: a store process that dies (a real child, a real SIGKILL) is restarted on its port.

What must hold: the owner's watchdog reports one ``store_lost`` finding per outage, naming the cause, then
``store_restored`` when a fresh process serves on the same port; another rank's watchdog (which sees the store only
through its connection) reconnects on its own; the ranks' publishers reconnect and their progress is readable again;
nobody is called hung across the outage; a message captured before the outage and written into the fresh store is
still refused as a replay; past ``max_restarts`` the store stays down, said once; ``close`` leaves no process behind,
even during a restart.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from gemscout.errors import ConfigError
from gemscout.watch import (
    OobChannel,
    OobConfig,
    ProgressConfig,
    ProgressPublisher,
    StallFinding,
    StoreServer,
    StoreServerConfig,
    Watchdog,
    WatchdogConfig,
)
from gemscout.watch.records import PROGRESS_KEY
from gemscout.watch.service import finding_to_report

SECRET = b"restart-test-secret-0123456789ab"
WORLD = 3
EPOCH = "run-r"
_CHILD_NAME = "_store_child.py"


def _start(max_restarts: int, backoff: timedelta = timedelta(milliseconds=100)) -> StoreServer:
    return StoreServer.start(
        "127.0.0.1", namespace="gemscout/oob", world_size=WORLD, keys=[PROGRESS_KEY],
        config=StoreServerConfig(max_restarts=max_restarts, restart_backoff=backoff),
    )  # fmt: skip


def _channel(port: int, rank: int | None) -> OobChannel:
    # What ``Watch`` makes: a channel that reconnects when the server dropped its connection.
    return OobChannel.connect(
        host="127.0.0.1", port=port, config=OobConfig(rank=rank, secret=SECRET, epoch=EPOCH)
    )


def _publishers(port: int) -> list[ProgressPublisher]:
    fast = ProgressConfig(
        publish_interval=timedelta(milliseconds=20), heartbeat_interval=timedelta(milliseconds=100)
    )
    return [ProgressPublisher(_channel(port, rank), config=fast).start() for rank in range(WORLD)]


def _until(condition: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, (
            f"not within {timeout} s: {what() if callable(what) else what}"
        )
        time.sleep(0.02)


def _poll(watchdog: Watchdog) -> bool:
    """One poll as the watchdog's thread makes it (a failed one is logged there, not raised)."""
    try:
        watchdog.poll_once()
    except Exception:
        pass
    return True


def _serves(port: int) -> bool:
    """Whether a fresh client can write and read back a key now."""
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        client.set("probe", "ok")
        ok = client.get("probe") == b"ok"
        client.delete_key("probe")
        return ok
    except (dist.DistNetworkError, dist.DistStoreError):
        return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kinds(findings: list[StallFinding]) -> list[str]:
    return [f.evidence["tamper"]["kind"] if f.kind == "tamper" else f.kind for f in list(findings)]


def _no_store_process_left() -> None:
    left = [p for p in psutil.Process().children() if _CHILD_NAME in " ".join(p.cmdline())]
    assert [p for p in left if not _gone(p.pid)] == [], left
    assert [t.name for t in threading.enumerate() if t.name.startswith("gemscout-oob-store")] == []


@pytest.mark.timeout(60)
def test_a_killed_store_comes_back_on_its_port_and_watching_resumes() -> None:
    """Three ranks train and publish; rank 0's watchdog follows the store process, another rank's only its
    connection. SIGKILL the store process: ``store_lost`` naming the signal, a fresh process serving on the same
    port, every rank's progress readable again, ``store_restored`` from both watchdogs, no hang although the outage
    is longer than the heartbeat timeout; a message of rank 1 captured before the outage, written into the fresh
    store, is refused as a replay."""
    # The restart waits 1.5 s, longer than the watchdogs' 1 s heartbeat timeout: the outage must be long enough for
    # a false hang to be possible (a fresh child's torch import alone took 0.9 s on an idle machine).
    server = _start(max_restarts=2, backoff=timedelta(seconds=1.5))
    port, first_pid = server.port, server.pid
    pubs: list[ProgressPublisher] = []
    watchdogs: list[Watchdog] = []
    stop = threading.Event()
    trainer: threading.Thread | None = None
    try:
        pubs = _publishers(port)
        steps = [0]

        def train() -> None:
            while not stop.is_set():
                steps[0] += 1
                for pub in pubs:
                    pub.step(steps[0])
                time.sleep(0.02)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        cfg = WatchdogConfig(
            stall_threshold=timedelta(seconds=5),
            poll_interval=timedelta(milliseconds=50),
            heartbeat_timeout=timedelta(seconds=1),  # shorter than the outage (the 1.5 s backoff)
            store_unreachable=timedelta(milliseconds=500),
        )
        owner_found: list[StallFinding] = []
        other_found: list[StallFinding] = []
        owner = Watchdog(
            _channel(port, None), world_size=WORLD, config=cfg, callbacks=[owner_found.append],
            store=server,
        )  # fmt: skip
        other = Watchdog(
            _channel(port, None), world_size=WORLD, config=cfg, callbacks=[other_found.append]
        )
        watchdogs = [owner.start(), other.start()]
        check = _channel(port, None)
        _until(
            lambda: len(check.read_many(range(WORLD), PROGRESS_KEY)) == WORLD, 10, "first records"
        )
        before = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        captured = before.get(check.slot(1, PROGRESS_KEY))

        os.kill(first_pid, signal.SIGKILL)
        killed_at, step_at_kill = time.monotonic(), steps[0]
        _until(lambda: "store_lost" in _kinds(owner_found), 5, "the owner's store_lost")
        lost = owner_found[0]
        assert f"store process {first_pid} was killed by SIGKILL" in lost.reason, lost.reason
        assert "being restarted on the same port" in lost.reason and lost.evidence["restarting"]
        status = server.status()
        assert status.outages == 1 and (status.lost is not None or status.restarts == 1), status

        _until(lambda: server.status().lost is None, 30, "a restarted store process serving")
        assert server.port == port and server.pid != first_pid and _gone(first_pid)
        assert server.status().restarts == 1 and _serves(port)
        _until(
            lambda: (
                "store_restored" in _kinds(owner_found) and "store_restored" in _kinds(other_found)
            ),
            15,
            lambda: f"store_restored from both: {_kinds(owner_found)} / {_kinds(other_found)}",
        )
        outage = time.monotonic() - killed_at
        # Every rank's publisher reconnects and re-publishes its whole record into the empty store.
        _until(
            lambda: all(
                (check.read(rank, PROGRESS_KEY) or {}).get("step", -1) > step_at_kill
                for rank in range(WORLD)
            ),
            10,
            "fresh progress of every rank",
        )
        time.sleep(1.0)  # a false hang would come within two polls of the watchdogs resuming
        assert outage > cfg.heartbeat_timeout.total_seconds()  # type: ignore[union-attr]
        for found in (owner_found, other_found):
            assert _kinds(found) == ["store_lost", "store_restored"], [f.reason for f in found]
            assert all(f.recommendation == "observe" for f in found)
        restored = owner_found[1]
        assert "restored after" in restored.reason and "watching resumes" in restored.reason
        assert finding_to_report(restored).kind.value == "tamper"
        assert "unreachable from this watchdog" in other_found[0].reason

        # Replay protection survives the restart: the reader remembers the sequence numbers it accepted.
        stop.set()
        trainer.join(5)
        pubs[1].stop()
        _until(lambda: (check.read(1, PROGRESS_KEY) or {}).get("closed") is True, 5, "closed")
        replayed = check.stats.replayed
        after = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        after.set(check.slot(1, PROGRESS_KEY), captured)
        assert check.read(1, PROGRESS_KEY) is None and check.stats.replayed == replayed + 1
        print(f"outage {outage:.1f} s; findings {_kinds(owner_found)} / {_kinds(other_found)}")
    finally:
        stop.set()
        if trainer is not None:
            trainer.join(5)
        for watchdog in watchdogs:
            watchdog.stop()
        for pub in pubs:
            pub.stop()
        server.close()
    assert _gone(server.pid) and _gone(first_pid)
    _no_store_process_left()


@pytest.mark.timeout(60)
def test_past_its_restart_limit_the_store_stays_down_with_one_finding() -> None:
    """``max_restarts=1``: the first death is restarted, the second is not. Findings: ``store_lost`` (restarting),
    ``store_restored``, ``store_lost`` (stays down), and nothing more on later polls; the port refuses at once."""
    server = _start(max_restarts=1)
    port = server.port
    found: list[StallFinding] = []
    cfg = WatchdogConfig(
        stall_threshold=timedelta(seconds=5), poll_interval=timedelta(milliseconds=50)
    )
    watchdog = Watchdog(
        _channel(port, None), world_size=WORLD, config=cfg, callbacks=[found.append], store=server
    )
    try:
        assert watchdog.poll_once() == []
        pids = [server.pid]
        os.kill(pids[0], signal.SIGKILL)
        _until(lambda: _poll(watchdog) and len(found) >= 1, 5, "first loss")
        _until(lambda: server.status().lost is None, 30, "the restart serving")
        pids.append(server.pid)
        assert pids[1] != pids[0] and server.port == port and _serves(port)
        watchdog.poll_once()
        assert _kinds(found) == ["store_lost", "store_restored"], [f.reason for f in found]
        os.kill(pids[1], signal.SIGKILL)
        _until(lambda: _poll(watchdog) and len(found) >= 3, 5, "second loss")
        assert f"store process {pids[1]} was killed by SIGKILL" in found[2].reason
        assert "stays down" in found[2].reason and found[2].evidence["restarting"] is False
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert watchdog.poll_once() == []
            time.sleep(0.05)
        status = server.status()
        assert status.lost is not None and not status.restarting and status.outages == 2
        assert server.pid == pids[1] and _gone(pids[1])
        with pytest.raises(
            ConnectionRefusedError
        ):  # refused at once: nobody holds the port in a backlog
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert _kinds(found) == ["store_lost", "store_restored", "store_lost"]
    finally:
        server.close()
    _no_store_process_left()


@pytest.mark.timeout(60)
def test_close_after_a_restart_and_during_one_leaves_no_process() -> None:
    """A store restarted once, then killed again and closed while its next restart is under way: ``close`` returns
    within its stop timeout, and no store process, reader or supervisor thread is left."""
    server = StoreServer.start(
        "127.0.0.1", namespace="gemscout/oob", world_size=WORLD, keys=[PROGRESS_KEY],
        config=StoreServerConfig(max_restarts=3, restart_backoff=timedelta(milliseconds=50)),
    )  # fmt: skip
    pids = [server.pid]
    try:
        os.kill(pids[0], signal.SIGKILL)
        _until(
            lambda: server.status().restarts == 1 and server.status().lost is None, 30, "restart"
        )
        pids.append(server.pid)
        os.kill(pids[1], signal.SIGKILL)
        _until(lambda: server.pid != pids[1], 5, "the next restart under way")
        pids.append(server.pid)
        assert server.status().lost is not None  # importing torch: not serving yet
    finally:
        started = time.monotonic()
        server.close()
        took = time.monotonic() - started
    assert took < server.config.stop_timeout.total_seconds() + 1, took
    assert all(_gone(pid) for pid in pids), pids
    server.close()  # idempotent
    _no_store_process_left()


def test_restart_settings_are_validated() -> None:
    assert StoreServerConfig().max_restarts == 3
    for bad in (-1, 1.5, True, 1001):
        with pytest.raises(ConfigError, match="max_restarts"):
            StoreServerConfig(max_restarts=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="restart_backoff"):
        StoreServerConfig(restart_backoff=timedelta(0))
