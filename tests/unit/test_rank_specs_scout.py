"""The SCOUT rank programs' specs (scout_rank, moe_rank): they round-trip through a spec file, keep the defaults the
programs' flags had, and the spec file each cell writes is what the cell's old flags told the ranks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from qualification.launch import LaunchResult
from qualification.programs import moe_cell, scout_cell
from qualification.programs.specs import parse, spec_argv
from qualification.programs.specs import train as train_specs
from qualification.programs.specs.scout import MoeSpec, ScoutSpec

pytestmark = pytest.mark.timeout(60)

# The argparse defaults of the programs before their specs (git show HEAD:qualification/programs/<program>.py).
OLD_SCOUT_DEFAULTS: dict[str, Any] = {
    "steps": 16,
    "fault_rank": 2,
    "fault_step": 6,
    "heal_step": 10,
    "fault_block": 1,
    "fault": "bitflip",
    "replay_delay_rank": -1,
    "replay_delay_s": 0.5,
    "comm_delay_rank": -1,
    "comm_delay_s": 0.4,
    "comm_probe_interval": 0,
    "replay_fault_rank": -1,
    "replay_fault_step": -1,
    "replay_fault_recipe": "hidden.0",
    "topology": "ddp",
    "schedule": "gpipe",
    "keep_ckpt": False,
    "baseline": False,
    "collective_delay_rank": -1,
    "collective_delay_s": 0.4,
    "collective_delay_step": 0,
    "job_delay_rank": -1,
    "job_delay_s": 0.4,
    "job_delay_step": 1,
    "straggler_margin_s": 0.25,
    "diverge_rank": -1,
    "diverge_step": 0,
    "recover_on_sdc": False,
    "optimizer_slice_numel": 1 << 16,
}
OLD_MOE_DEFAULTS: dict[str, Any] = {
    "workload": "moe",
    "steps": 8,
    "seed": 0,
    "etp": 1,
    "ckpt": None,
    "baseline": False,
    "kill_rank": -1,
    "kill_step": -1,
    "replay_fault_rank": -1,
    "replay_fault_step": -1,
    "replay_fault_recipe": "hidden.1",
    "a2a_corrupt_rank": -1,
    "a2a_corrupt_step": -1,
}


@pytest.mark.parametrize(
    ("cls", "old"),
    [(ScoutSpec, OLD_SCOUT_DEFAULTS), (MoeSpec, OLD_MOE_DEFAULTS)],
    ids=["ScoutSpec", "MoeSpec"],
)
def test_the_defaults_are_the_old_flags_defaults(
    cls: type, old: dict[str, Any], tmp_path: Path
) -> None:
    spec = cls(out=tmp_path)
    # ScoutSpec's seed is RunSpec's, narrowed to the one seed scout_rank trains (it had no --seed flag).
    fields = (
        {f.name for f in dataclasses.fields(cls)}
        - {"out"}
        - ({"seed"} if cls is ScoutSpec else set())
    )
    assert fields == set(old)
    assert {name: getattr(spec, name) for name in old} == old
    assert parse(cls, ["--out", str(tmp_path)], prog="t") == spec


@pytest.mark.parametrize(
    "spec",
    [
        ScoutSpec(out=Path("/tmp/o")),
        ScoutSpec(
            out=Path("/tmp/o"),
            topology="pp-dp",
            schedule="1f1b",
            baseline=True,
            keep_ckpt=True,
            recover_on_sdc=True,
            job_delay_rank=1,
            job_delay_s=0.25,
            straggler_margin_s=1.0,
        ),
        MoeSpec(out=Path("/tmp/o")),
        MoeSpec(out=Path("/tmp/o"), workload="cp", etp=2, ckpt=Path("/tmp/ck"), baseline=True),
    ],
    ids=["scout-default", "scout-pp", "moe-default", "moe-cp"],
)
def test_a_spec_round_trips_through_its_file(spec: Any, tmp_path: Path) -> None:
    assert parse(type(spec), spec_argv(spec, tmp_path / "spec.json"), prog="t") == spec


def _captured(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[list[str]]:
    """Stand in for the launcher: record each launch's argv and report every rank failed (the cell stops there)."""
    launches: list[list[str]] = []

    def fake_launch(argv: list[str], world_size: int, **_: Any) -> LaunchResult:
        launches.append(list(argv))
        return LaunchResult(
            returncodes=[1] * world_size, first_failed=0, duration_s=0.0, timed_out=False
        )

    monkeypatch.setattr(module, "launch", fake_launch)
    return launches


def test_scout_cell_writes_what_its_old_flags_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    launches = _captured(monkeypatch, scout_cell)
    cell = {
        "id": "c",
        "world_size": 4,
        "topology": "pp-dp",
        "params": {"steps": 12, "schedule": "1f1b", "optimizer_slice_numel": 4096},
        "fault": {"kind": "persistent", "rank": 2, "step": 5, "block": 0},
    }
    assert scout_cell.run_cell(cell, tmp_path)["status"] == "error"
    (argv,) = launches
    out = tmp_path / "ranks"
    assert argv == [
        "-m",
        "qualification.programs.scout_rank",
        "--spec",
        str(out / "spec-run.json"),
    ]
    # The pre-spec launcher's argv for this cell (git show HEAD:qualification/programs/scout_cell.py).
    old = [
        "--out",
        str(out),
        "--steps",
        "12",
        "--fault-rank",
        "2",
        "--fault-step",
        "5",
        "--heal-step",
        "13",
        "--fault-block",
        "0",
        "--fault",
        "bitflip",
        "--topology",
        "pp-dp",
        "--baseline",
        "--schedule",
        "1f1b",
        "--optimizer-slice-numel",
        "4096",
    ]
    assert parse(ScoutSpec, argv[2:], prog="t") == parse(ScoutSpec, old, prog="t")


@pytest.mark.parametrize(
    ("kind", "seconds", "old_tail"),
    [
        ("replay-delay", 0.7, ["--replay-delay-rank", "1", "--replay-delay-s", "0.7"]),
        (
            "comm-delay",
            None,
            ["--comm-delay-rank", "1", "--comm-delay-s", "0.4", "--comm-probe-interval", "2"],
        ),
        (
            "collective-delay",
            None,
            [
                "--collective-delay-rank",
                "1",
                "--collective-delay-s",
                "0.3",
                "--collective-delay-step",
                "3",
            ],
        ),
        (
            "job-delay",
            0.5,
            ["--job-delay-rank", "1", "--job-delay-s", "0.5", "--job-delay-step", "3"],
        ),
        (
            "replay",
            None,
            [
                "--replay-fault-rank",
                "1",
                "--replay-fault-step",
                "3",
                "--replay-fault-recipe",
                "embedding",
            ],
        ),
    ],
)
def test_scout_cell_straggler_and_replay_faults_are_the_old_flags(
    kind: str, seconds: float | None, old_tail: list[str], tmp_path: Path
) -> None:
    fault: dict[str, Any] = {"kind": kind, "rank": 1, "step": 3}
    if seconds is not None:
        fault["seconds"] = seconds
    spec = scout_cell._spec({"fault": fault}, tmp_path)
    old = ["--out", str(tmp_path), "--steps", "16", "--fault-rank", "-1", *old_tail]
    assert spec == parse(ScoutSpec, old, prog="t")


def test_moe_cell_writes_what_its_old_flags_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    launches = _captured(monkeypatch, moe_cell)
    base = {"id": "c", "workload": "moe", "world_size": 8, "params": {"steps": 6, "etp": 2}}
    replay = {"kind": "replay", "rank": 3, "step": 4}
    assert moe_cell.run_cell({**base, "fault": replay}, tmp_path / "a")["status"] == "error"
    sigkill = {"kind": "sigkill", "rank": 1, "step": 3}
    assert moe_cell.run_cell({**base, "fault": sigkill}, tmp_path / "b")["status"] == "error"
    run, killed = launches
    assert run[:3] == ["-m", "qualification.programs.moe_rank", "--spec"]
    assert run[3] == str(tmp_path / "a" / "ranks" / "spec-run.json")
    assert killed[3] == str(tmp_path / "b" / "killed" / "spec-faulted.json")
    # The pre-spec launcher's argv for these launches (git show HEAD:qualification/programs/moe_cell.py).
    head = ["--workload", "moe", "--steps", "6", "--etp", "2"]
    old_run = [
        "--out",
        str(tmp_path / "a" / "ranks"),
        *head,
        "--ckpt",
        str(tmp_path / "a" / "ckpt"),
        "--baseline",
        "--replay-fault-rank",
        "3",
        "--replay-fault-step",
        "4",
        "--replay-fault-recipe",
        "hidden.1",
    ]
    old_killed = [
        "--out",
        str(tmp_path / "b" / "killed"),
        *head,
        "--ckpt",
        str(tmp_path / "b" / "ckpt"),
        "--kill-rank",
        "1",
        "--kill-step",
        "3",
    ]
    assert parse(MoeSpec, run[2:], prog="t") == parse(MoeSpec, old_run, prog="t")
    assert parse(MoeSpec, killed[2:], prog="t") == parse(MoeSpec, old_killed, prog="t")


def test_moe_cell_alltoall_and_relaunch_specs(tmp_path: Path) -> None:
    spec = moe_cell._spec(
        {"workload": "cp"},
        tmp_path,
        ckpt=tmp_path / "ck",
        baseline=True,
        a2a_corrupt_rank=2,
        a2a_corrupt_step=5,
    )
    old = [
        "--out",
        str(tmp_path),
        "--workload",
        "cp",
        "--steps",
        "8",
        "--etp",
        "1",
        "--ckpt",
        str(tmp_path / "ck"),
        "--baseline",
        "--a2a-corrupt-rank",
        "2",
        "--a2a-corrupt-step",
        "5",
    ]
    assert spec == parse(MoeSpec, old, prog="t")


def test_the_scout_choices_are_the_native_programs() -> None:
    """ScoutSpec takes train_rank's topologies and schedules (a test in test_rank_specs keeps those equal to
    qualification.programs._pipeline's)."""
    fields = {f.name: f for f in dataclasses.fields(ScoutSpec)}
    assert fields["topology"].metadata["choices"] == train_specs.TOPOLOGIES
    assert fields["schedule"].metadata["choices"] == train_specs.SCHEDULES
