"""Checks shared by the DeepSpeed tests (ZeRO-1/2 in test_deepspeed.py, ZeRO-3 in test_deepspeed_zero3.py)."""

from __future__ import annotations

import json
from typing import Any


def check_sdc_attributed_and_gated(
    results: list[dict[str, Any]], *, fault_rank: int, fault_step: int, heal_step: int, block: int
) -> None:
    """Every rank's reports name exactly ``fault_rank`` for ``hidden.<block>`` at ``fault_step`` (the block rotates
    with the step: block 1 is replayed at step 4), the SDC decision restores a step before the fault, nothing between
    it and the healing is certified, certification resumes after it, and the ranks agree on every trust state."""
    for r in results:
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc"]
        assert [(rep["step"], rep["recipe"], list(rep["ranks"])) for rep in sdc] == [
            (fault_step, f"hidden.{block}", [fault_rank])
        ]
        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore" and decision["step"] < fault_step, decision
        trust = {int(k): v for k, v in r["trust"].items()}
        assert trust[decision["step"]] == "recovery_verified"
        assert all(
            trust.get(s) != "recovery_verified" for s in range(decision["step"] + 1, heal_step)
        ), trust
        assert any(st == "recovery_verified" for s, st in trust.items() if s >= heal_step), (
            trust
        )  # healed
    assert len({json.dumps(r["trust"], sort_keys=True) for r in results}) == 1, (
        "ranks disagree on trust states"
    )
