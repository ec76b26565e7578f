"""OobChannel over real TCPStores: authentic messages pass; forged, moved, replayed and wrongly keyed ones do not."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from gemscout.errors import ConfigError
from gemscout.watch.channel import OobChannel, OobConfig, OobStore
from gemscout.watch.secret import SECRET_ENV, generate_secret

pytestmark = pytest.mark.timeout(30)

SECRET = b"0123456789abcdef-test-secret"


@pytest.fixture
def stores() -> Iterator[tuple[dist.TCPStore, dist.TCPStore]]:
    """A served TCPStore on an OS-chosen port and a second client connection to it."""
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    yield master, client


def _pair(
    stores: tuple[dist.TCPStore, dist.TCPStore], rank: int = 1
) -> tuple[OobChannel, OobChannel]:
    master, client = stores
    writer = OobChannel(client, config=OobConfig(rank=rank, secret=SECRET))
    reader = OobChannel(master, config=OobConfig(rank=None, secret=SECRET))
    return writer, reader


@pytest.mark.parametrize("kind", ["tcp", "hash"])
def test_store_contract(kind: str) -> None:
    """Every store the channel is given must set/get/check and time out its wait (the OobStore seam)."""
    store: OobStore
    if kind == "tcp":
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
        )
    else:
        store = dist.HashStore()
    assert isinstance(store, OobStore)
    assert not store.check(["k"])
    store.set("k", "v\nw")
    assert store.check(["k"]) and store.get("k") == b"v\nw"
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["absent"], timedelta(milliseconds=200))
    assert time.monotonic() - started < 3.0


def test_authentic_message_round_trips(stores: tuple[dist.TCPStore, dist.TCPStore]) -> None:
    writer, reader = _pair(stores)
    seq = writer.publish("progress", {"step": 7, "shapes": [[2, 3]], "name": "x"})
    assert reader.read(1, "progress") == {"step": 7, "shapes": [[2, 3]], "name": "x"}
    # Reading the same message again is not a replay: the writer simply has not published since.
    assert reader.read(1, "progress") == {"step": 7, "shapes": [[2, 3]], "name": "x"}
    assert writer.publish("progress", {"step": 8}) > seq
    assert reader.read(1, "progress") == {"step": 8}
    stats = reader.stats
    assert (stats.accepted, stats.forged, stats.replayed) == (3, 0, 0)
    assert writer.stats.published == 2


def test_absent_slot_returns_none_and_wait_is_bounded(
    stores: tuple[dist.TCPStore, dist.TCPStore],
) -> None:
    _, reader = _pair(stores)
    started = time.monotonic()
    assert reader.read(3, "progress") is None
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    assert reader.read(3, "progress", timeout=timedelta(milliseconds=300)) is None
    assert 0.25 <= time.monotonic() - started < 3.0


def test_read_waits_for_a_late_message(stores: tuple[dist.TCPStore, dist.TCPStore]) -> None:
    writer, reader = _pair(stores)
    later = threading.Timer(0.2, writer.publish, args=("status", {"ok": True}))
    later.start()
    try:
        assert reader.read(1, "status", timeout=timedelta(seconds=5)) == {"ok": True}
    finally:
        later.cancel()


def test_forged_mac_is_rejected_logged_and_counted(
    stores: tuple[dist.TCPStore, dist.TCPStore], caplog: pytest.LogCaptureFixture
) -> None:
    master, _ = stores
    writer, reader = _pair(stores)
    writer.publish("progress", {"step": 1})
    genuine = master.get(writer.slot(1, "progress"))
    mac, _, body = genuine.partition(b"\n")
    assert b'"step"' not in genuine  # the payload is sealed: a reader of the store does not see it
    # Tamper with exactly one character of the sealed payload and keep the old MAC.
    at = body.index(b'"sealed":"') + 20
    flipped = body[:at] + (b"A" if body[at : at + 1] != b"A" else b"B") + body[at + 1 :]
    master.set(writer.slot(1, "progress"), (mac + b"\n" + flipped).decode())
    with caplog.at_level(logging.WARNING, logger="gemscout.watch.channel"):
        assert reader.read(1, "progress") is None
        assert (
            reader.read(1, "progress") is None
        )  # polled again: still rejected, counted and logged once
    assert reader.stats.forged == 1 and reader.stats.accepted == 0
    assert [r.getMessage() for r in caplog.records if "bad HMAC" in r.getMessage()] != []
    assert len([r for r in caplog.records if "bad HMAC" in r.getMessage()]) == 1


@pytest.mark.parametrize("garbage", ["no newline at all", "deadbeef\n{not json", "\n"])
def test_malformed_envelope_is_rejected(
    stores: tuple[dist.TCPStore, dist.TCPStore], garbage: str
) -> None:
    master, _ = stores
    _, reader = _pair(stores)
    master.set(reader.slot(2, "progress"), garbage)
    assert reader.read(2, "progress") is None
    assert reader.stats.forged == 1


def test_wrong_secret_is_rejected(stores: tuple[dist.TCPStore, dist.TCPStore]) -> None:
    master, client = stores
    intruder = OobChannel(client, config=OobConfig(rank=1, secret=b"another-jobs-secret-0000"))
    reader = OobChannel(master, config=OobConfig(rank=None, secret=SECRET))
    intruder.publish("progress", {"step": 100})
    assert reader.read(1, "progress") is None
    assert reader.stats.forged == 1


def test_authentic_message_moved_to_another_rank_is_rejected(
    stores: tuple[dist.TCPStore, dist.TCPStore],
) -> None:
    master, _ = stores
    writer, reader = _pair(stores, rank=1)
    writer.publish("progress", {"step": 1})
    master.set(reader.slot(2, "progress"), master.get(reader.slot(1, "progress")).decode())
    master.set(reader.slot(1, "status"), master.get(reader.slot(1, "progress")).decode())
    assert reader.read(2, "progress") is None
    assert reader.read(1, "status") is None
    assert reader.stats.forged == 2


def test_replayed_older_message_is_rejected(stores: tuple[dist.TCPStore, dist.TCPStore]) -> None:
    master, _ = stores
    writer, reader = _pair(stores)
    writer.publish("progress", {"step": 1})
    old = master.get(writer.slot(1, "progress")).decode()
    assert reader.read(1, "progress") == {"step": 1}
    writer.publish("progress", {"step": 2})
    assert reader.read(1, "progress") == {"step": 2}
    master.set(writer.slot(1, "progress"), old)
    assert reader.read(1, "progress") is None
    assert reader.stats.replayed == 1 and reader.stats.forged == 0
    writer.publish("progress", {"step": 3})
    assert reader.read(1, "progress") == {"step": 3}


def test_restarted_rank_is_not_taken_for_a_replay(
    stores: tuple[dist.TCPStore, dist.TCPStore],
) -> None:
    master, client = stores
    writer, reader = _pair(stores)
    writer.publish("progress", {"step": 5})
    assert reader.read(1, "progress") == {"step": 5}
    reborn = OobChannel(client, config=OobConfig(rank=1, secret=SECRET))
    reborn.publish("progress", {"step": 0})
    assert reader.read(1, "progress") == {"step": 0}


def test_refuses_to_start_without_a_secret(
    stores: tuple[dist.TCPStore, dist.TCPStore],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    master, client = stores
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="GEMSCOUT_OOB_SECRET"):
        OobChannel(master, config=OobConfig(rank=0))
    with caplog.at_level(logging.WARNING):
        dev = OobChannel(master, config=OobConfig(rank=0, insecure_dev=True))
    assert any("insecure_dev" in r.getMessage() for r in caplog.records)
    dev.publish("k", {"a": 1})
    reader = OobChannel(client, config=OobConfig(rank=None, insecure_dev=True))
    assert reader.read(0, "k", timeout=timedelta(seconds=5)) == {"a": 1}


def test_secret_from_environment(
    stores: tuple[dist.TCPStore, dist.TCPStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    master, client = stores
    secret = generate_secret()
    monkeypatch.setenv(SECRET_ENV, secret)
    OobChannel(client, config=OobConfig(rank=4)).publish("k", {"a": 2})
    assert OobChannel(master, config=OobConfig(rank=None, secret=secret.encode())).read(4, "k") == {
        "a": 2
    }
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        OobChannel(master, config=OobConfig(rank=0))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": -1}, "rank"),
        ({"rank": 0, "secret": b"short"}, "secret"),
        ({"rank": 0, "namespace": "/x"}, "namespace"),
        ({"rank": 0, "max_message_bytes": 10}, "max_message_bytes"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"OobConfig.{field}"):
        OobConfig(**kwargs)  # type: ignore[arg-type]


def test_publish_guards(stores: tuple[dist.TCPStore, dist.TCPStore]) -> None:
    writer, reader = _pair(stores)
    with pytest.raises(ValueError, match="observer"):
        reader.publish("k", {})
    with pytest.raises(ValueError, match="without '/'"):
        writer.publish("a/b", {})
    with pytest.raises(ValueError):
        writer.publish("k", {"x": float("nan")})
    with pytest.raises(ValueError, match="max_message_bytes"):
        writer.publish("k", {"x": "y" * (2 << 20)})


def test_concurrent_publishers_get_unique_sequence_numbers(
    stores: tuple[dist.TCPStore, dist.TCPStore],
) -> None:
    writer, reader = _pair(stores)
    seqs: list[int] = []
    lock = threading.Lock()

    def burst() -> None:
        for i in range(50):
            s = writer.publish("k", {"i": i})
            with lock:
                seqs.append(s)

    threads = [threading.Thread(target=burst) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(set(seqs)) == 150
    assert reader.read(1, "k") is not None


def test_connect_serves_or_joins_a_store_by_address() -> None:
    server = OobChannel.connect(
        host="127.0.0.1", port=0, is_master=True, config=OobConfig(rank=0, secret=SECRET)
    )
    port = server.store.port  # type: ignore[attr-defined]
    joined = OobChannel.connect(
        host="127.0.0.1", port=port, config=OobConfig(rank=None, secret=SECRET)
    )
    server.publish("hello", {"from": 0})
    assert joined.read(0, "hello", timeout=timedelta(seconds=5)) == {"from": 0}
