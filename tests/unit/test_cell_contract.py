"""The cell contract's shared judgements: trust gating says nothing was rejected when nothing was ever certified; and
its entry point leaves no binary training state in the cell's folder (a bundle seals observations, not checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qualification.programs._contract import cell_main, measured, trust_gating

pytestmark = pytest.mark.timeout(30)

SDC = [{"failure_kind": "sdc", "step": 3}]


def test_gating_flags_hold_when_the_fault_step_alone_is_left_uncertified() -> None:
    trust = {3: "recovery_verified", 4: "unverified", 5: "recovery_verified"}
    assert trust_gating(trust, SDC, 4) == {
        "decision_before_fault": True,
        "fault_step_rejected": True,
        "certified_after": True,
    }


def test_every_flag_is_false_when_nothing_was_ever_certified() -> None:
    # A run whose certification never worked must not "reject" the faulty step for free.
    trust = {3: "unverified", 4: "unverified", 5: "unverified"}
    assert trust_gating(trust, SDC, 4) == {
        "decision_before_fault": False,
        "fault_step_rejected": False,
        "certified_after": False,
    }
    assert trust_gating({}, [], 4)["fault_step_rejected"] is False


def _run_leaving_state(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    """A cell program that leaves what real ones leave: GEMINI files, a DCP promotion, a torch save, JSON records."""
    for rel in (
        "ckpt/node-0/rank-0/step-000000004.gsc",
        "ckpt/node-0/rank-0/replicas/owner-1/step-000000004.gsc",
        "durable/step-000000004/__0_0.distcp",
        "durable/step-000000004/.metadata",
        "full-step6.pt",
    ):
        (celldir / rel).parent.mkdir(parents=True, exist_ok=True)
        (celldir / rel).write_bytes(b"\0" * 64)
    (celldir / "ckpt/node-0/rank-0/status.json").write_text("{}")
    (celldir / "durable/step-000000004/gemscout-sidecar.json").write_text("{}")
    (celldir / "rank0.json").write_text("{}")
    return measured(cell, {"ok": True}, [], 0.0)


@pytest.mark.parametrize("keep", [False, True])
def test_the_entry_point_drops_binary_state_and_keeps_the_records(
    tmp_path: Path, keep: bool
) -> None:
    cell = {"id": "t/cell", "params": {"keep_checkpoints": True} if keep else {}}
    (tmp_path / "cell.json").write_text(json.dumps(cell))
    out = tmp_path / "celldir"
    assert (
        cell_main(
            "t", _run_leaving_state, ["--cell", str(tmp_path / "cell.json"), "--out", str(out)]
        )
        == 0
    )
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    records = [
        "ckpt/node-0/rank-0/status.json",
        "durable/step-000000004/gemscout-sidecar.json",
        "rank0.json",
        "result.json",
    ]
    if keep:
        assert len(left) == len(records) + 5
    else:
        assert left == records
        assert not (
            out / "ckpt/node-0/rank-0/replicas"
        ).exists()  # a folder that held only state goes too
