"""The torchrun, Slurm, watch and perf rank specs: each round-trips through its spec file, and what each launcher now
writes is what its old flags said (the flag lists below are copied from the launchers before the change)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from qualification.programs import _torchrun as tr
from qualification.programs import healthy_path, torchrun_cell
from qualification.programs.specs import parse, spec_argv
from qualification.programs.specs.perf import PerfSpec
from qualification.programs.specs.slurm import SlurmSpec
from qualification.programs.specs.torchrun import TorchrunSpec
from qualification.programs.specs.watch import WatchSpec

pytestmark = pytest.mark.timeout(60)


def _required(cls: type, tmp_path: Path) -> dict[str, Any]:
    return {
        f.name: tmp_path / f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


@pytest.mark.parametrize(
    "cls", [TorchrunSpec, SlurmSpec, WatchSpec, PerfSpec], ids=lambda c: c.__name__
)
def test_a_default_spec_round_trips_through_its_file(cls: type, tmp_path: Path) -> None:
    spec = cls(**_required(cls, tmp_path))
    assert parse(cls, spec_argv(spec, tmp_path / "spec.json"), prog="t") == spec
    # The flags with only the required ones given have the same defaults as the dataclass.
    flags = [
        a
        for name, v in _required(cls, tmp_path).items()
        for a in ("--" + name.replace("_", "-"), str(v))
    ]
    assert parse(cls, flags, prog="t") == spec


def test_the_defaults_are_the_old_argparse_defaults(tmp_path: Path) -> None:
    assert TorchrunSpec(out=tmp_path) == TorchrunSpec(
        out=tmp_path,
        workload="tiny-causal-lm",
        steps=6,
        seed=0,
        ckpt=None,
        run_id="torchrun-cell",
        ranks_per_node=0,
        find_unused_parameters=False,
        kill_rank=-1,
        kill_step=-1,
        kill_phase="after-step",
        kill_attempt=0,
        lose_nodes="",
        lose_attempt=1,
        step_sleep=0.0,
        timeout_s=60.0,
        inline_baseline=False,
    )
    assert (
        SlurmSpec(out=tmp_path, ckpt=tmp_path).steps,
        SlurmSpec(out=tmp_path, ckpt=tmp_path).kill_step,
    ) == (
        6,
        -1,
    )
    w = WatchSpec(out=tmp_path)
    assert (
        w.steps,
        w.threshold_s,
        w.data_delay_rank,
        w.data_delay_s,
        w.io_delay_rank,
        w.io_delay_s,
    ) == (
        12,
        1.5,
        -1,
        0.0,
        -1,
        0.0,
    )
    assert (w.delay_from, w.hang_rank, w.hang_step, w.ckpt) == (3, -1, -1, None)
    p = PerfSpec(out=tmp_path, ckpt=tmp_path)
    assert (
        p.mode,
        p.segments,
        p.segment_steps,
        p.workload,
        p.seed,
        p.warmup,
        p.steps,
        p.interval,
    ) == (
        None,
        "",
        20,
        "three-block",
        0,
        5,
        40,
        1,
    )
    assert (p.device, p.rotate_kinds, p.scout_interval) == ("cpu", False, None)


def _after_module(argv: list[str], module: str) -> list[str]:
    return argv[argv.index(module) + 1 :]


def test_the_torchrun_cell_writes_what_its_flags_said(tmp_path: Path) -> None:
    """The CI cell: a worker kill with node loss under --max-restarts, an inline baseline."""
    cell = {
        "id": "test/torchrun",
        "workload": "tiny-causal-lm",
        "world_size": 2,
        "seed": 0,
        "params": {
            "steps": 6,
            "max_restarts": 1,
            "find_unused_parameters": True,
            "baseline": "inline",
        },
    }
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    old = [
        *["--out", str(out), "--workload", "tiny-causal-lm", "--steps", "6", "--seed", "0"],
        *["--timeout-s", "60", "--find-unused-parameters", "--inline-baseline"],
        *["--ckpt", str(ckpt), "--ranks-per-node", "1", "--kill-rank", "1", "--kill-step", "3"],
        *["--kill-phase", "after-step", "--lose-nodes", "1", "--lose-attempt", "1"],
    ]
    fields = torchrun_cell._kill_fields(tmp_path, 1, 3, "after-step", [1])
    argv = tr.torchrun(tr.single_node(2, 1), out, cell, "run", **fields)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--max-restarts=1" in argv
    rank_args = _after_module(argv, tr.RANK_PROGRAM)
    assert rank_args == ["--spec", str(out / "spec-run.json")]
    assert parse(TorchrunSpec, rank_args, prog="t") == parse(TorchrunSpec, old, prog="t")


def test_the_two_agent_and_baseline_launches_keep_their_own_spec_files(tmp_path: Path) -> None:
    cell = {"workload": "tiny-causal-lm", "seed": 2, "params": {"steps": 8, "step_sleep": 0.3}}
    old = [
        *[
            "--out",
            str(tmp_path / "run"),
            "--workload",
            "tiny-causal-lm",
            "--steps",
            "8",
            "--seed",
            "2",
        ],
        *["--timeout-s", "60", "--step-sleep", "0.3", "--ckpt", str(tmp_path / "disk1")],
    ]
    argv = tr.torchrun([], tmp_path / "run", cell, "node1-b", ckpt=tmp_path / "disk1")
    assert argv[-1] == str(tmp_path / "run" / "spec-node1-b.json")
    assert parse(TorchrunSpec, _after_module(argv, tr.RANK_PROGRAM), prog="t") == parse(
        TorchrunSpec, old, prog="t"
    )
    base = tr.torchrun([], tmp_path / "baseline", cell, "baseline")
    spec = parse(TorchrunSpec, _after_module(base, tr.RANK_PROGRAM), prog="t")
    assert spec.ckpt is None and spec.kill_rank == -1 and spec.out == tmp_path / "baseline"


def test_the_srun_flags_parse_to_the_slurm_spec(tmp_path: Path) -> None:
    flags = [
        "--out",
        str(tmp_path / "first"),
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--steps",
        "6",
        "--kill-step",
        "3",
    ]
    spec = parse(SlurmSpec, flags, prog="t")
    assert spec == SlurmSpec(out=tmp_path / "first", ckpt=tmp_path / "ckpt", steps=6, kill_step=3)
    assert parse(SlurmSpec, spec_argv(spec, tmp_path / "s.json"), prog="t") == spec


def test_a_slurm_or_watch_spec_asking_for_another_seed_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for cls, data in ((SlurmSpec, {"ckpt": str(tmp_path)}), (WatchSpec, {})):
        path = tmp_path / f"{cls.__name__}.json"
        path.write_text(json.dumps({"out": str(tmp_path), "seed": 1, **data}))
        with pytest.raises(SystemExit) as exc:
            parse(cls, ["--spec", str(path)], prog="t")
        assert exc.value.code == 2 and "seed" in capsys.readouterr().err


def test_the_hang_cell_writes_what_its_flags_said(tmp_path: Path) -> None:
    from qualification.programs import hang_cell  # imports gemscout.watch, and torch with it

    cell = {
        "world_size": 3,
        "params": {"steps": 10},
        "fault": {"hang_rank": 1, "hang_step": 5, "threshold_s": 1.5},
    }
    out = tmp_path / "ranks"
    old = [
        *["--out", str(out), "--steps", "10", "--threshold-s", "1.5"],
        *["--data-delay-rank", "-1", "--data-delay-s", "0.15", "--io-delay-rank", "-1"],
        *["--io-delay-s", "0.5", "--hang-rank", "1", "--hang-step", "5"],
    ]
    argv = hang_cell._rank_argv(cell, out)
    assert argv == ["-m", "qualification.programs.watch_rank", "--spec", str(out / "spec-run.json")]
    assert parse(WatchSpec, argv[2:], prog="t") == parse(WatchSpec, old, prog="t")


def test_the_healthy_path_cell_writes_what_its_flags_said(tmp_path: Path) -> None:
    cell = {
        "workload": "three-block",
        "seed": 1,
        "params": {
            "steps": 12,
            "warmup": 2,
            "interval": 2,
            "rotate_kinds": True,
            "scout_interval": 4,
        },
    }
    out = tmp_path / "modes" / "scout-0"
    old = [
        *["--out", str(out), "--mode", "scout", "--steps", "12", "--workload", "three-block"],
        *[
            "--seed",
            "1",
            "--warmup",
            "2",
            "--interval",
            "2",
            "--ckpt",
            str(tmp_path / "ckpt" / "scout-0"),
        ],
        *["--device", "cpu", "--rotate-kinds", "--scout-interval", "4"],
    ]
    argv = healthy_path._rank_argv(cell, tmp_path, out, "scout", 0, ["scout"], 0)
    assert argv == [
        "-m",
        "qualification.programs.perf_rank",
        "--spec",
        str(out / "spec-scout.json"),
    ]
    assert parse(PerfSpec, argv[2:], prog="t") == parse(PerfSpec, old, prog="t")
    # Interleaved: one launch, the modes in segments (ABBA), no --mode / --steps.
    cell = {"workload": "three-block", "params": {"segment_steps": 6}}
    out = tmp_path / "modes" / "interleaved-1"
    modes = ["baseline", "scout", "scout", "baseline"]
    old = [
        *["--out", str(out), "--segments", ",".join(modes), "--segment-steps", "6"],
        *["--workload", "three-block", "--seed", "0", "--warmup", "5", "--interval", "1"],
        *["--ckpt", str(tmp_path / "ckpt" / "interleaved-1"), "--device", "cpu"],
    ]
    argv = healthy_path._rank_argv(cell, tmp_path, out, "interleaved", 1, modes, 1)
    spec = parse(PerfSpec, argv[2:], prog="t")
    assert spec == parse(PerfSpec, old, prog="t") and spec.mode is None and spec.steps == 40
