"""``torch.distributed.destroy_process_group`` closes the live sessions first — only while one is live
(gemscout._teardown); ``import gemscout`` itself leaves torch alone (test_import_isolation.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import gemscout
from gemscout import _teardown

pytestmark = pytest.mark.timeout(120)


def _session(tmp_path: Path) -> gemscout.Session:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = gemscout.CheckpointConfig(
        directory=tmp_path / "ckpt", fsync=False, timeout=timedelta(seconds=30)
    )
    return gemscout.enable_resiliency(model, opt, checkpoint=cfg)


def test_destroying_the_group_closes_the_live_session_first_and_restores_torch(
    tmp_path: Path,
) -> None:
    torchs = distributed_c10d.destroy_process_group
    session = _session(tmp_path)
    assert dist.destroy_process_group is not torchs and _teardown.holding()
    dist.destroy_process_group()
    assert session.closed
    assert dist.destroy_process_group is torchs and not _teardown.holding()
    assert not dist.is_initialized()


def test_closing_the_last_session_restores_torch(tmp_path: Path) -> None:
    torchs = distributed_c10d.destroy_process_group
    session = _session(tmp_path)
    session.close()
    assert dist.destroy_process_group is torchs and not _teardown.holding()
    dist.destroy_process_group()
