"""The launcher's store port: chosen below the kernel's ephemeral range (which gloo's listeners and every outgoing
connection draw from, so a concurrent job can take a kernel-assigned port before rank 0 binds it), and when rank 0
still finds its port taken, the ranks are started again on a fresh one instead of failing the job."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import qualification.launch as launch_mod
from qualification.launch import free_port, launch

# Rank 0 binds a real TCPStore on MASTER_PORT, as init_process_group(env://) does.
STORE = (
    "import os, datetime, torch.distributed as d; d.TCPStore('127.0.0.1', int(os.environ['MASTER_PORT']), 1, "
    "True, timeout=datetime.timedelta(seconds=5)); open(os.environ['OUT'], 'w').write(os.environ['MASTER_PORT'])"
)


def test_the_port_is_free_and_below_the_ephemeral_range() -> None:
    low = launch_mod._ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert launch_mod._PORT_FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binding it does not raise


@pytest.mark.timeout(90)
def test_a_taken_store_port_is_retried_on_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy, free_port()])
        monkeypatch.setattr(launch_mod, "free_port", lambda: next(ports))
        res = launch(
            ["-c", STORE],
            world_size=1,
            timeout_s=60,
            log_dir=tmp_path / "logs",
            env={"OUT": str(tmp_path / "bound")},
        )
        assert res.ok, res
        bound = int((tmp_path / "bound").read_text())
        assert bound != busy  # the second start, on the fresh port, is the one that ran


@pytest.mark.timeout(90)
def test_another_failure_of_rank_0_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counted() -> int:
        calls.append(1)
        return 29999

    monkeypatch.setattr(launch_mod, "free_port", counted)
    res = launch(
        ["-c", "raise SystemExit(3)"], world_size=2, timeout_s=60, log_dir=tmp_path / "logs"
    )
    assert not res.ok and res.first_failed is not None and 3 in res.returncodes
    assert len(calls) == 1
