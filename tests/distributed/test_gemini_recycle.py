"""Recycled generation files in a real run: 2 gloo ranks, a capture every step, fsync on.

Pruned files become their folder's spare (a temp file) and the next write there overwrites it. A rank SIGKILLed just
before writing its own file leaves its spares behind; the relaunch removes them as stale temps, recovers bitwise
from the published files, and a clean close leaves only published, verified files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemscout.gemini import store
from qualification.launch import launch

STEPS, KILL = 10, 6


def argv(out: Path, ckpt: Path | None, *extra: str) -> list[str]:
    base = ["-m", "qualification.programs.train_rank", "--out", str(out), "--steps", str(STEPS)]
    return base + (["--ckpt", str(ckpt)] if ckpt else []) + list(extra)


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def temps(root: Path) -> list[Path]:
    return sorted(root.rglob(".tmp-*"))


@pytest.mark.timeout(300)
def test_spares_of_a_killed_rank_are_cleaned_and_recovery_is_bitwise(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    assert launch(
        argv(tmp_path / "base", None), world_size=2, timeout_s=120, log_dir=logs / "base"
    ).ok
    reference = ranks(tmp_path / "base")
    ckpt = tmp_path / "ckpt"
    first = launch(
        argv(
            tmp_path / "run",
            ckpt,
            "--kill-rank",
            "1",
            "--kill-step",
            str(KILL),
            "--kill-phase",
            "persist",
        ),
        world_size=2,
        timeout_s=120,
        log_dir=logs,
    )
    assert first.returncodes[1] == -9, first
    # Killed before writing step KILL: the captures before it pruned into spares, one per folder of rank 1.
    own = ckpt / "node-1" / "rank-1" / "own"
    spares = [p for p in temps(ckpt / "node-1") if p.name.endswith("-spare")]
    assert any(p.parent == own for p in spares), sorted(p.name for p in own.iterdir())
    assert all(p.parent.name in ("own",) or p.parent.name.startswith("owner-") for p in spares), (
        spares
    )
    assert store.list_steps(own)[0] == KILL - 1

    res = launch(argv(tmp_path / "run", ckpt), world_size=2, timeout_s=120, log_dir=logs, attempt=1)
    assert res.ok, res
    out = ranks(tmp_path / "run")
    assert all(not r["errors"] for r in out), [r["errors"] for r in out]
    assert all(r["state_digest"] == reference[i]["state_digest"] for i, r in enumerate(out)), (
        "not bitwise"
    )
    assert all(r["losses"] == reference[i]["losses"] for i, r in enumerate(out))
    # The relaunch removed the dead writer's spares; its own close discarded its own: only published files remain.
    assert temps(ckpt) == []
    for rank in range(2):
        root = ckpt / f"node-{rank}" / f"rank-{rank}"
        folders = [root / "own", *sorted((root / "replicas").iterdir())]
        for folder in folders:
            steps = store.list_steps(folder)
            assert steps and steps[0] == STEPS and len(steps) <= 3, (folder, steps)
            for step in steps:
                parsed, _ = store.read_verified(store.step_file(folder, step))
                assert parsed.identity["step"] == step
