"""The DeepSpeed rank specs: ds_rank's and ds_zero3_rollback's arguments as one dataclass each. The files the cells
write (lifecycle, ds_scout_cell, ds_resize_cell) say exactly what their old flags said, and every DeepSpeed cell of
the campaigns writes a file ds_rank accepts. No process group, no torch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qualification import campaign
from qualification.programs import ds_resize_cell, ds_scout_cell, lifecycle
from qualification.programs.specs import parse, spec_argv, to_dict
from qualification.programs.specs.common import LifecycleSpec
from qualification.programs.specs.deepspeed import (
    STAGES,
    TOPOLOGIES,
    DeepSpeedSpec,
    ZeRO3RollbackSpec,
)

pytestmark = pytest.mark.timeout(60)

RANK_JSON = {  # just enough of a rank<r>.json for the cells to reach their verdict
    "reports": [],
    "cycles": {},
    "trust": {},
    "decisions": [],
    "decision": None,
    "losses": {},
    "state_digest": "",
    "module_digest": "",
    "resume_full": None,
    "resume_module": None,
    "final_full": None,
    "lr": 0.0,
}


def test_ds_rank_spec_extends_the_lifecycle_contract() -> None:
    assert issubclass(DeepSpeedSpec, LifecycleSpec)
    assert TOPOLOGIES == ("deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")
    assert STAGES == {"deepspeed-zero1": 1, "deepspeed-zero2": 2, "deepspeed-zero3": 3}


def test_the_defaults_are_the_old_flags_defaults(tmp_path: Path) -> None:
    """ds_rank's and ds_zero3_rollback's argparse defaults before the specs, copied."""
    ds = parse(DeepSpeedSpec, ["--out", str(tmp_path)], prog="ds_rank")
    old = {
        "out": tmp_path,
        "workload": "three-block",
        "topology": "deepspeed-zero1",
        "steps": 6,
        "seed": 0,
        "interval": 1,
        "accumulation": 1,
        "bf16": False,
        "ckpt": None,
        "run_id": "qualify",
        "ranks_per_node": 1,
        "persist_every": 1,
        "keep_generations": 2,
        "kill_rank": -1,
        "kill_step": -1,
        "kill_phase": "after-step",
        "kill_seed": 0,
        "sigterm_step": -1,
        "scout": False,
        "fault_rank": -1,
        "fault_step": -1,
        "heal_step": 1 << 30,
        "fault_block": 1,
        "scout_recipes": "embedding,hidden,output",
        "optimizer_slice_numel": 1 << 16,
        "optimizer_slices_per_cycle": 1,
        "replay_fault_rank": -1,
        "replay_fault_steps": "",
        "update_fault_rank": -1,
        "update_fault_step": -1,
        "param_groups": 1,
        "durable": None,
        "durable_every": 0,
        "certify": False,
        "straggler_margin_s": 0.0,
        "replay_delay_rank": -1,
        "replay_delay_s": 0.25,
        "full_state": False,
        "dump_full": None,
        "load_full": None,
    }
    # The lifecycle fields ds_rank never had take the only value it honours.
    lifecycle_only = {
        "replication": "ring",
        "schedule": "gpipe",
        "io_delay_ms": 0,
        "recovery_kill_phase": "",
    }
    assert dataclasses.asdict(ds) == old | lifecycle_only
    rollback = parse(ZeRO3RollbackSpec, ["--out", str(tmp_path)], prog="ds_zero3_rollback")
    assert dataclasses.asdict(rollback) == {
        "out": tmp_path,
        "steps": 6,
        "ckpt": None,
        "certify_until": 3,
        "rollback_after": 5,
    }


@pytest.mark.parametrize(
    "spec",
    [
        DeepSpeedSpec(out=Path("o")),
        DeepSpeedSpec(
            out=Path("o"),
            topology="deepspeed-zero3",
            ckpt=Path("ck"),
            durable=Path("du"),
            durable_every=2,
            certify=True,
            bf16=True,
            accumulation=2,
            param_groups=2,
            scout=True,
            scout_recipes="hidden,optimizer",
            replay_fault_steps="4,8",
            straggler_margin_s=0.5,
            replay_delay_s=1.0,
            full_state=True,
            dump_full=Path("d.pt"),
            load_full=Path("l.pt"),
        ),
        ZeRO3RollbackSpec(out=Path("o")),
        ZeRO3RollbackSpec(out=Path("o"), ckpt=Path("ck"), steps=8, certify_until=2),
    ],
    ids=["ds-defaults", "ds-everything", "rollback-defaults", "rollback-ckpt"],
)
def test_a_spec_round_trips_through_its_file(spec: Any, tmp_path: Path) -> None:
    assert parse(type(spec), spec_argv(spec, tmp_path / "spec.json"), prog="t") == spec


def test_a_lifecycle_field_ds_rank_cannot_honour_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for change in (
        {"replication": "natural"},
        {"io_delay_ms": 5},
        {"recovery_kill_phase": "recover-send"},
        {"schedule": "1f1b"},
        {"topology": "ddp"},
    ):
        spec = LifecycleSpec(out=tmp_path, **({"topology": "deepspeed-zero1"} | change))
        with pytest.raises(SystemExit) as exc:
            parse(DeepSpeedSpec, spec_argv(spec, tmp_path / "spec.json"), prog="ds_rank")
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and next(iter(change)) in err, err


def _spec_of(argv: list[str]) -> DeepSpeedSpec:
    assert argv[:2] == ["-m", "qualification.programs.ds_rank"] and argv[2] == "--spec", argv
    return parse(DeepSpeedSpec, argv[2:], prog="ds_rank")


def _fake_launch(seen: list[list[str]]) -> Any:
    """A ``launch`` that records each argv and leaves every rank's rank<r>.json as if it ran."""

    def launch(argv: list[str], *, world_size: int, **_: Any) -> SimpleNamespace:
        seen.append(list(argv))
        out = Path(json.loads(Path(argv[3]).read_text())["out"])
        for r in range(world_size):
            (out / f"rank{r}.json").write_text(json.dumps(RANK_JSON))
        return SimpleNamespace(ok=True)

    return launch


def test_the_scout_cell_writes_what_its_flags_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(ds_scout_cell, "launch", _fake_launch(seen))
    cell = {
        "id": "t",
        "workload": "three-block",
        "topology": "deepspeed-zero1",
        "world_size": 3,
        "seed": 0,
        "params": {"steps": 13},
        "fault": {"kind": "replay", "rank": 2, "steps": [4, 8]},
    }
    ds_scout_cell.run_cell(cell, tmp_path)
    assert [a[3] for a in seen] == [
        str(tmp_path / "baseline" / "spec-baseline.json"),
        str(tmp_path / "run" / "spec-run.json"),
    ]
    # The run launch as ds_scout_cell built it before the specs: "--out" first, then common + scout.
    old = [
        "--out",
        str(tmp_path / "run"),
        "--topology",
        "deepspeed-zero1",
        "--workload",
        "three-block",
        "--seed",
        "0",
        "--steps",
        "13",
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--keep-generations",
        "15",
        "--scout",
        "--scout-recipes",
        "hidden,optimizer",
        "--optimizer-slice-numel",
        "20000",
        "--optimizer-slices-per-cycle",
        "0",
        "--replay-fault-rank",
        "2",
        "--replay-fault-steps",
        "4,8",
    ]
    assert _spec_of(seen[1]) == parse(DeepSpeedSpec, old, prog="ds_rank")
    baseline = old[:10]
    assert _spec_of(seen[0]) == parse(
        DeepSpeedSpec, ["--out", str(tmp_path / "baseline"), *baseline[2:]], prog="ds_rank"
    )


def test_the_resize_cell_writes_what_its_flags_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(ds_resize_cell, "launch", _fake_launch(seen))
    cell = {
        "id": "t",
        "workload": "three-block",
        "topology": "deepspeed-zero2",
        "world_size": 4,
        "seed": 0,
        "params": {"bf16": True, "param_groups": 2},
        "fault": {"kind": "resize", "from_world": 2},
    }
    ds_resize_cell.run_cell(cell, tmp_path)
    assert [Path(a[3]).name for a in seen] == [
        "spec-first.json",
        "spec-resumed.json",
        "spec-reference.json",
    ]
    common = [
        "--full-state",
        "--topology",
        "deepspeed-zero2",
        "--workload",
        "three-block",
        "--seed",
        "0",
        "--param-groups",
        "2",
        "--bf16",
    ]
    durable, dump = str(tmp_path / "durable"), str(tmp_path / "full-step4.pt")
    old = {
        "first": [
            *common,
            "--ckpt",
            str(tmp_path / "local-first"),
            "--durable",
            durable,
            "--steps",
            "4",
            "--durable-every",
            "2",
            "--certify",
            "--dump-full",
            dump,
        ],
        "resumed": [
            *common,
            "--ckpt",
            str(tmp_path / "local-resumed"),
            "--durable",
            durable,
            "--steps",
            "6",
        ],
        "reference": [*common, "--steps", "6", "--load-full", dump],
    }
    for argv, (name, flags) in zip(seen, old.items(), strict=True):
        flags = ["--out", str(tmp_path / name), *flags]
        assert _spec_of(argv) == parse(DeepSpeedSpec, flags, prog="ds_rank"), name


def test_the_lifecycle_writes_what_its_flags_said_for_ds_rank(tmp_path: Path) -> None:
    cell = {
        "workload": "three-block",
        "topology": "deepspeed-zero1",
        "seed": 0,
        "params": {"steps": 6, "durable_every": 2},
    }
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    kill = {"kill_rank": 1, "kill_step": 5, "kill_phase": "after-step", "kill_seed": 0}
    argv = lifecycle._rank_argv(out, cell, ckpt, "faulted", **kill)
    # The faulted launch of lifecycle-durable-fallback-deepspeed-zero1 as _rank_argv built it before the specs.
    old = [
        "--out",
        str(out),
        "--workload",
        "three-block",
        "--topology",
        "deepspeed-zero1",
        "--steps",
        "6",
        "--seed",
        "0",
        "--interval",
        "1",
        "--persist-every",
        "1",
        "--ranks-per-node",
        "1",
        "--ckpt",
        str(ckpt),
        "--durable",
        str(tmp_path / "durable"),
        "--durable-every",
        "2",
        "--certify",
        "--kill-rank",
        "1",
        "--kill-step",
        "5",
        "--kill-phase",
        "after-step",
        "--kill-seed",
        "0",
    ]
    assert _spec_of(argv) == parse(DeepSpeedSpec, old, prog="ds_rank")


def _deepspeed_cells() -> list[campaign.Cell]:
    return [
        c
        for path in campaign.campaign_files()
        for c in campaign.load(path).cells
        if c.topology.startswith("deepspeed-")
    ]


def test_every_deepspeed_cell_of_the_campaigns_writes_specs_ds_rank_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cells = _deepspeed_cells()
    assert {c.program for c in cells} >= {"lifecycle", "ds_scout_cell", "ds_resize_cell"}
    for n, c in enumerate(cells):
        celldir = tmp_path / str(n)
        record = c.to_json()
        if c.program == "lifecycle":
            fault = c.fault
            faults: dict[str, Any] = {}
            if fault["kind"] == "sigkill":
                faults = {
                    "kill_rank": int(fault["rank"]),
                    "kill_step": int(fault["step"]),
                    "kill_phase": str(fault.get("phase", "after-step")),
                    "kill_seed": c.seed,
                }
            elif fault["kind"] == "sigterm":
                faults = {"sigterm_step": int(fault["step"])}
            for label, ckpt, extra in (
                ("baseline", None, {}),
                ("run", celldir / "ckpt", {}),
                ("faulted", celldir / "ckpt", faults),
            ):
                argv = lifecycle._rank_argv(celldir / label, record, ckpt, label, **extra)
                spec = _spec_of(argv)
                assert (spec.topology, spec.workload) == (c.topology, c.workload), c.id
                assert to_dict(spec)["kill_rank"] == extra.get("kill_rank", -1), c.id
            continue
        module = {"ds_scout_cell": ds_scout_cell, "ds_resize_cell": ds_resize_cell}[c.program]
        seen: list[list[str]] = []
        monkeypatch.setattr(module, "launch", _fake_launch(seen))
        module.run_cell(record, celldir)
        assert len(seen) == (2 if c.program == "ds_scout_cell" else 3), c.id
        for argv in seen:
            assert _spec_of(argv).topology == c.topology, c.id
