"""Shared test hooks: no test leaves GEMINI memory-tier folders behind in /dev/shm.

A test whose ranks end by SIGKILL, a STOP or a timeout keeps their memory tier there, by design (a restart would
recover from it; a later job sweeps it once its grace period is over). The machine's /dev/shm is shared, so after
each test that used ``tmp_path``, and at the end of the session for everything under pytest's base temp folder
(module fixtures), the folders whose owner was a process of these tests (its ``owner.json`` names a checkpoint
directory under that folder) and is gone are removed. Never another session's, never a live process's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gemscout.gemini.config import CheckpointConfig

_BASE = CheckpointConfig.__dataclass_fields__["memory_directory"].default


def _sweep(under: Path) -> None:
    if _BASE is None or not Path(_BASE).is_dir():
        return
    from gemscout.gemini import shm_sweep

    mine = str(under.resolve())
    for owner in Path(_BASE).glob("*/node-*/rank-*/owner.json"):
        try:
            doc = json.loads(owner.read_text())
        except (OSError, ValueError):
            continue
        where = str(doc.get("directory", "")) if isinstance(doc, dict) else ""
        if (where == mine or where.startswith(mine + "/")) and not shm_sweep.owner_alive(doc):
            shutil.rmtree(owner.parent, ignore_errors=True)
            for parent in list(owner.parent.parents)[
                :2
            ]:  # node-<n>, then the run's folder, once empty
                try:
                    parent.rmdir()
                except OSError:
                    break


@pytest.fixture(autouse=True, scope="session")
def _no_memory_tier_left_by_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    _sweep(tmp_path_factory.getbasetemp())


@pytest.fixture(autouse=True)
def _no_memory_tier_left_by_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    # Taken before the test runs: a fixture requested here is torn down after this one, not before.
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None:
        _sweep(tmp)
