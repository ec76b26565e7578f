"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from gemscout.state import integrity

KEY = bytes(range(32))
"""The job key the ``keyed`` fixture puts in force."""


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo process group for the test (file store in the test's folder), destroyed after it."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's integrity key set to ``KEY`` for the test (the environment's cleared), unset after it."""
    monkeypatch.delenv(integrity.ENV_KEY, raising=False)
    monkeypatch.delenv(integrity.ENV_KEY_FILE, raising=False)
    integrity.use_key(KEY)
    yield
    integrity.use_key(None)
