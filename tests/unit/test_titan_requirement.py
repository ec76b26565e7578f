"""The ``torchtitan_cpu`` requirement: TorchTitan runs in a separate interpreter (``.venv-tt`` or
``$GEMSCOUT_TT_PYTHON``), so a campaign cell cannot ask for it as a module of the main one. The probe runs that
interpreter for real (a missing path, stand-in interpreters that are small shell scripts answering with a version or
failing, and this very interpreter, which has no torchtitan); the engine skips such a cell with the probe's reason, and
the driver run anyway reports ``error`` naming what is missing. Nothing here needs torchtitan."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from qualification import engine
from qualification.campaign import Cell, validate_document
from qualification.frameworks import titan_env
from qualification.outcome import Verdict
from qualification.programs import titan_cell

pytestmark = pytest.mark.timeout(120)


def fake_python(folder: Path, body: str) -> str:
    exe = folder / "python"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_probe_names_the_missing_interpreter_the_wrong_version_and_the_fix(tmp_path: Path) -> None:
    missing = titan_env.unavailable(str(tmp_path / "nope" / "python"))
    assert (
        missing is not None
        and "no TorchTitan interpreter at" in missing
        and "make test-torchtitan" in missing
    )
    old = titan_env.unavailable(fake_python(tmp_path, "echo 0.2.0"))
    assert old is not None and "has torchtitan 0.2.0, needs 0.3.0" in old
    assert "not installed" in (
        titan_env.unavailable(sys.executable) or ""
    )  # the main venv never has torchtitan
    broken = tmp_path / "b"
    broken.mkdir()
    assert "not installed" in (titan_env.unavailable(fake_python(broken, "exit 1")) or "")
    ok = tmp_path / "ok"
    ok.mkdir()
    assert titan_env.unavailable(fake_python(ok, "echo 0.3.0")) is None


def test_interpreter_comes_from_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(titan_env.ENV_VAR, "/somewhere/bin/python")
    assert titan_env.python() == "/somewhere/bin/python"
    monkeypatch.delenv(titan_env.ENV_VAR)
    assert titan_env.python().endswith(".venv-tt/bin/python")


def cell(requires: tuple[str, ...]) -> Cell:
    return Cell(
        id="t/titan_cell-healthy-fsdp2-w2-none-s0",
        program="titan_cell",
        workload="llama3-debug",
        topology="fsdp2",
        world_size=2,
        fault={"kind": "none"},
        seed=0,
        timeout_s=60.0,
        params={},
        expect={"bitwise_equal": True},
        requires=requires,
    )


def test_engine_skips_the_cell_with_the_reason_and_the_driver_alone_reports_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(titan_env.ENV_VAR, str(tmp_path / "absent" / "python"))
    engine._probe.cache_clear()
    try:
        [outcome] = engine.run_cells([cell(("torchtitan_cpu",))], tmp_path / "run")
    finally:
        engine._probe.cache_clear()
    assert outcome.verdict is Verdict.SKIPPED, outcome
    assert outcome.reason.startswith("requires torchtitan_cpu: no TorchTitan interpreter at ")
    assert str(tmp_path / "absent" / "python") in outcome.reason
    assert not (tmp_path / "run" / "cells").exists()  # nothing was started
    # Without the requirement the driver runs, finds no interpreter, and says so (status error: the cell fails).
    result = titan_cell.run_cell(cell(()).to_json(), tmp_path / "driver")
    assert result["status"] == "error" and "no TorchTitan interpreter" in result["message"], result
    assert 'requires = ["torchtitan_cpu"]' in result["message"]
    json.dumps(result)


def test_the_campaign_schema_accepts_the_requirement() -> None:
    document = {
        "name": "t",
        "tier": "cpu",
        "description": "d",
        "boundaries": {"validated": ["x"], "not_validated": ["y"]},
        "matrix": [
            {
                "program": "titan_cell",
                "workload": "llama3-debug",
                "topology": "fsdp2",
                "world_size": 2,
                "fault": {"kind": "none"},
                "seed": 0,
                "timeout_s": 900,
                "requires": ["torchtitan_cpu"],
            }
        ],
    }
    validate_document(document, path=Path("t.toml"))
