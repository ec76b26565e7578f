"""``CheckpointConfig(when_busy="skip")`` with real 2-rank gloo launches and a slow io path (each replication sleeps
300 ms, steps take milliseconds): while earlier captures' io holds every slot, all ranks agree to skip the capture
(newest wins) instead of stalling the training thread. The ranks skip exactly the same steps (their io collectives
stay lined up: no hang, no error), and a SIGKILL plus node loss is still recovered bitwise from what was captured."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qualification.launch import launch

STEPS, KILL = 14, 8


def argv(out: Path, ckpt: Path | None, *extra: str) -> list[str]:
    base = ["-m", "qualification.programs.train_rank", "--out", str(out), "--steps", str(STEPS)]
    return (
        base
        + (["--ckpt", str(ckpt), "--when-busy", "skip", "--io-delay-ms", "300"] if ckpt else [])
        + list(extra)
    )


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
def test_skip_when_busy_coalesces_identically_and_recovers_bitwise(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    assert launch(
        argv(tmp_path / "base", None), world_size=2, timeout_s=120, log_dir=logs / "base"
    ).ok
    reference = ranks(tmp_path / "base")
    ckpt = tmp_path / "ckpt"
    first = launch(
        argv(tmp_path / "run", ckpt, "--kill-rank", "1", "--kill-step", str(KILL)),
        world_size=2,
        timeout_s=120,
        log_dir=logs,
    )
    assert first.returncodes[1] == -9, first
    shutil.rmtree(ckpt / "node-1")  # ranks_per_node=1: rank 1's node
    res = launch(argv(tmp_path / "run", ckpt), world_size=2, timeout_s=120, log_dir=logs, attempt=1)
    assert res.ok, res
    out = ranks(tmp_path / "run")
    decision = out[0]["decision"]
    assert decision["mode"] == "restore" and decision["sources"]["1"].startswith("peer:"), decision
    assert all(not r["errors"] for r in out), [r["errors"] for r in out]
    # Steps after the resume: the io (300 ms a capture) cannot keep up with the loop, so captures were skipped,
    # the same ones on both ranks.
    assert out[0]["skipped_steps"], "nothing was skipped: the test did not exercise coalescing"
    assert out[0]["skipped_steps"] == out[1]["skipped_steps"]
    assert all(r["state_digest"] == reference[i]["state_digest"] for i, r in enumerate(out)), (
        "not bitwise"
    )
    assert all(r["losses"] == reference[i]["losses"] for i, r in enumerate(out))
