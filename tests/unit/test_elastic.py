"""gemscout.elastic: the per-attempt store under torchrun's shared store, its argument checks, and the STOP record.

The store protocol runs against real TCPStores on localhost (the test plays the agent: it hosts the shared store);
ranks are threads, since the protocol is store traffic only. A real torchrun relaunch is tests/e2e/test_torchrun.py.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from gemscout import elastic
from gemscout.errors import CollectiveTimeout, ConfigError, RecoveryError

pytestmark = pytest.mark.timeout(60)


def _dead_port() -> int:
    """A port nobody listens on (bound, then closed: what an earlier attempt's rank 0 leaves behind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def agent() -> dist.TCPStore:
    """The agent's shared store, as torchrun hosts it for the whole job."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False
    )


def _ranks(agent: dist.TCPStore, world: int, *, start_first: int = 0) -> dict[int, dist.Store]:
    got: dict[int, dist.Store] = {}
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            got[rank] = elastic.attempt_store(
                "127.0.0.1", agent.port, rank, "job", timedelta(seconds=20)
            )
        except BaseException as exc:  # reported below: a thread's exception is otherwise lost
            errors.append(exc)

    order = sorted(range(world), key=lambda r: r != start_first)
    threads = [threading.Thread(target=one, args=(r,)) for r in order]
    for i, t in enumerate(threads):
        t.start()
        if i == 0:
            t.join(
                timeout=0.5
            )  # the first one named really runs first (and, if it is not rank 0, waits)
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert sorted(got) == list(range(world))
    return got


def test_every_rank_gets_rank_zeros_fresh_store(agent: dist.TCPStore) -> None:
    got = _ranks(agent, 3)
    nonce = got[0].get(elastic._NONCE)
    assert all(s.get(elastic._NONCE) == nonce for s in got.values())
    got[1].set("written-by-1", "x")
    assert got[2].get("written-by-1") == b"x"  # one store, shared by the attempt
    assert not agent.check(["written-by-1"])  # and not the agent's


def test_a_stale_advertisement_is_refused_until_this_attempts_rank_zero_writes(
    agent: dist.TCPStore,
) -> None:
    agent.set(elastic._ADVERT + "job", f"{_dead_port()} earlier-attempt")
    got = _ranks(agent, 2, start_first=1)  # rank 1 reads the earlier attempt's port first
    assert got[1].get(elastic._NONCE) == got[0].get(elastic._NONCE)


def test_a_reused_port_answering_another_nonce_is_not_taken(agent: dist.TCPStore) -> None:
    stranger = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    stranger.set(elastic._NONCE, "someone-else")
    assert elastic._probe("127.0.0.1", f"{stranger.port} mine", 5.0) is None
    assert elastic._probe("127.0.0.1", f"{_dead_port()} mine", 5.0) is None
    stranger.set(elastic._NONCE, "mine")
    assert elastic._probe("127.0.0.1", f"{stranger.port} mine", 5.0) is not None


def test_no_rank_zero_is_a_collective_timeout(agent: dist.TCPStore) -> None:
    agent.set(elastic._ADVERT + "job", f"{_dead_port()} earlier-attempt")
    with pytest.raises(CollectiveTimeout, match="did not advertise|no store advertised"):
        elastic.attempt_store("127.0.0.1", agent.port, 1, "job", timedelta(seconds=1.5))


def test_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        elastic.init_process_group("gloo", timeout=30)  # type: ignore[arg-type]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError, match="store= is set from torchrun"):
        elastic.init_process_group("gloo", store=object())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        elastic.init_process_group("gloo")


def test_stop_record_stands_for_every_later_attempt(tmp_path: Path) -> None:
    elastic.check_stop(tmp_path, "run-1")  # nothing recorded: no-op
    raised = elastic.record_stop(
        tmp_path, RecoveryError("recovery stopped: every source exhausted"), "run-1", fsync=False
    )
    assert str(raised).startswith("recovery stopped: every source exhausted; recorded in ")
    for attempt in range(3):
        with pytest.raises(RecoveryError) as info:
            elastic.check_stop(tmp_path, "run-1")
        assert str(info.value) == str(raised), attempt  # the same line on every relaunch
        assert info.value.exit_code == 4
    elastic.check_stop(tmp_path, "run-2")  # another run's record is not this run's
    with pytest.raises(RecoveryError):
        elastic.check_stop(tmp_path, None)  # no explicit id: the directory's record applies
    (tmp_path / elastic.STOP_FILE).unlink()
    elastic.check_stop(tmp_path, "run-1")  # deleted: recovery is tried again


def test_an_unreadable_stop_record_still_stops(tmp_path: Path) -> None:
    (tmp_path / elastic.STOP_FILE).write_text("{not json")
    with pytest.raises(RecoveryError, match="unreadable.*delete the file"):
        elastic.check_stop(tmp_path, "run-1")


def test_a_stop_record_that_cannot_be_written_keeps_the_original_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    original = RecoveryError("recovery stopped: x")
    assert elastic.record_stop(blocker / "sub", original, "r", fsync=False) is original
