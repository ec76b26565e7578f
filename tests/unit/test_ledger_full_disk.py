"""A full file system under the trust ledger: certification and rejection inside ``optimizer.step()`` keep
training going, the change is kept in memory and retried, a FaultReport says what happened, and a restart reads
only what the disk recorded. The disk is real: a 1 MiB tmpfs mounted for the test (skipped, with the reason, where
mounting is not allowed), filled with a real file until ENOSPC; one rank on a real gloo group."""

from __future__ import annotations

import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gemscout
from gemscout.config import TrustState
from gemscout.gemini import store
from gemscout.gemini.lifecycle import TrustLedger


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(
            f"cannot mount a size-limited tmpfs here: {res.stderr.strip() or res.returncode}"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30, check=False)


def fill(mnt: Path) -> Path:
    """Write a file until the file system is full (ENOSPC); returns it (delete it to free the space)."""
    filler = mnt / "filler"
    with open(
        filler, "wb", buffering=0
    ) as fh:  # unbuffered: the ENOSPC comes from write(), not from close()
        try:
            while True:
                fh.write(b"\1" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


@pytest.mark.timeout(90)
def test_enospc_during_certify_and_reject_keeps_training(small_fs: Path, one_rank: None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = gemscout.enable_resiliency(
        model,
        opt,
        checkpoint=gemscout.CheckpointConfig(
            directory=small_fs / "ckpt", run_id="full", fsync=False, handle_signals=False
        ),
    )
    ck = session.checkpointer
    assert ck is not None
    certify_in_hook = {"on": True}

    def certify(
        optimizer: object, args: object, kwargs: object
    ) -> None:  # where SCOUT certifies: in the hook
        if certify_in_hook["on"]:
            session.certify(session.step)

    handle = opt.register_step_post_hook(certify)

    def step() -> None:
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ck.drain()

    step()
    step()
    assert TrustLedger.load(ck.paths.status).states[2] == TrustState.RECOVERY_VERIFIED
    filler = fill(small_fs)
    step()  # step 3: the capture's file and the certification's ledger write both hit ENOSPC
    assert (
        ck.ledger.states[3] == TrustState.RECOVERY_VERIFIED
    )  # in memory: this process may restore it
    assert ck.ledger.unsaved is not None and "ENOSPC" in ck.ledger.unsaved
    reports = [r for r in session.reports if "trust ledger" in r.reason]
    assert (
        len(reports) == 1
        and reports[0].kind == "health"
        and reports[0].evidence["errno"] == "ENOSPC"
    )
    assert (
        TrustLedger.load(ck.paths.status).states.get(3) != TrustState.RECOVERY_VERIFIED
    )  # what a restart reads
    certify_in_hook["on"] = False
    step()  # step 4: a candidate, in memory only
    assert store.step_file(ck.paths.own, 4).exists() or ck.persisted_step < 4
    rejected = session.reject_candidates(
        "test: SDC"
    )  # the disk is still full: the rejection cannot be recorded
    assert 4 in rejected and ck.ledger.states[4] == TrustState.REJECTED
    # A restart cannot restore it: the disk recorded the rejection (pruning freed a block), or its file is gone.
    recorded = TrustLedger.load(ck.paths.status).states.get(4) == TrustState.REJECTED
    assert recorded or not store.step_file(ck.paths.own, 4).exists()
    step()
    step()  # training went on through every failure
    assert session.step == 6
    filler.unlink()
    time.sleep(1.1)  # the session retries at most once a second
    step()
    assert ck.ledger.unsaved is None
    on_disk = TrustLedger.load(ck.paths.status)
    assert (
        on_disk.states[3] == TrustState.RECOVERY_VERIFIED
        and on_disk.states[4] == TrustState.REJECTED
    )
    handle.remove()
    session.close()
