"""A STOP at attach through ``enable_resiliency`` (one real gloo rank, real files): recorded in the checkpoint
directory, and every later attach stops with the same line before it restores anything. The torchrun view of the
same thing (attempts, exit codes) is tests/e2e/test_torchrun.py and the ``torchrun`` campaign's stop cell."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

import gemscout
from gemscout import elastic
from gemscout.errors import RecoveryError

pytestmark = pytest.mark.timeout(60)


def _attach(
    ckpt: Path, run_id: str = "run-1"
) -> tuple[gemscout.Session, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = gemscout.CheckpointConfig(
        directory=ckpt,
        run_id=run_id,
        fsync=False,
        timeout=timedelta(seconds=20),
        handle_signals=False,
    )
    return gemscout.enable_resiliency(model, opt, checkpoint=cfg), model, opt


def test_a_stop_is_recorded_and_every_later_attach_stops_with_the_same_line(
    one_rank: None, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    session, model, opt = _attach(ckpt)
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    session.close()
    files = list(ckpt.rglob("*.gsc"))
    assert files
    for path in files:  # every copy corrupted: the history is there, nothing is restorable
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(RecoveryError) as first:
        _attach(ckpt)
    assert str(first.value).startswith("recovery stopped: every source exhausted: ")
    assert str(first.value).endswith(
        "every relaunch stops here with exit 4 until that file is deleted"
    )
    assert (ckpt / elastic.STOP_FILE).is_file()
    for path in files:
        path.unlink()  # the record, not the files, stops the next attempt: nothing left would even mean "fresh"
    t0 = time.monotonic()
    with pytest.raises(RecoveryError) as again:
        _attach(ckpt)
    assert str(again.value) == str(first.value) and again.value.exit_code == 4
    assert time.monotonic() - t0 < 5
    (ckpt / elastic.STOP_FILE).unlink()
    fresh, _, _ = _attach(
        ckpt
    )  # the record deleted: recovery runs again (here a fresh start, the files are gone)
    assert fresh.last_decision is not None and fresh.last_decision.mode.value == "fresh"
    fresh.close()
