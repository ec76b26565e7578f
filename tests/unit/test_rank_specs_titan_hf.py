"""The TorchTitan and Hugging Face rank specs: each round-trips through its spec file; the flags the cells passed before
the specs (copied from the pre-spec launchers) parse to the very spec the cells now write; the cells build their specs
without torch or torchtitan. No process group, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qualification.launch import LaunchResult
from qualification.programs import hf_cell, titan_cell
from qualification.programs.specs import parse, spec_argv, to_dict
from qualification.programs.specs.hf import CASES, FAMILIES, HfSpec
from qualification.programs.specs.titan import TitanSpec, TorchTitanSpec

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "spec",
    [
        TitanSpec(out=Path("/r/out"), assets=Path("/r/assets")),
        TitanSpec(
            out=Path("/r/run"),
            assets=Path("/r/assets"),
            steps=5,
            pp=2,
            dp_replicate=2,
            pp_schedule="Interleaved1F1B",
            ckpt=Path("/r/ckpt"),
            scout=True,
            scout_per_cycle=0,
            replay_fault_rank=1,
            replay_fault_step=3,
            replay_fault_recipe="pp0.embedding",
        ),
        TorchTitanSpec(out=Path("/r/out")),
        TorchTitanSpec(out=Path("/r/out"), ckpt=Path("/r/ckpt"), kill_rank=1, kill_step=4),
        HfSpec(out=Path("/r/out")),
        HfSpec(
            out=Path("/r/out"),
            family=("llama", "gpt2"),
            case=("healthy",),
            unreplayable="llama",
            fsdp2=("llama",),
            steps=4,
            fault_block=0,
        ),
    ],
    ids=lambda s: type(s).__name__,
)
def test_a_spec_round_trips_through_its_file(spec: Any, tmp_path: Path) -> None:
    assert parse(type(spec), spec_argv(spec, tmp_path / "spec.json"), prog="t") == spec


def test_the_defaults_are_the_old_flags_defaults(tmp_path: Path) -> None:
    titan = parse(TitanSpec, ["--out", str(tmp_path), "--assets", str(tmp_path / "a")], prog="t")
    assert (titan.steps, titan.seq_len, titan.batch, titan.dp_replicate, titan.pp) == (
        6,
        128,
        2,
        1,
        1,
    )
    assert (titan.pp_schedule, titan.ckpt, titan.interval, titan.kill_rank, titan.kill_step) == (
        "1F1B",
        None,
        1,
        -1,
        -1,
    )
    assert not titan.scout and (titan.replay_fault_rank, titan.replay_fault_step) == (-1, -1)
    assert (titan.replay_fault_recipe, titan.scout_per_cycle) == ("embedding", -1)
    hf = parse(HfSpec, ["--out", str(tmp_path)], prog="t")
    # No --family / --case / --fsdp2: empty, which hf_rank reads as "every family, every case" as before.
    assert (hf.family, hf.case, hf.fsdp2, hf.unreplayable) == ((), (), (), None)
    assert (hf.steps, hf.interval, hf.fault_rank, hf.fault_step, hf.fault_block) == (6, 2, 2, 3, 1)
    tt = parse(TorchTitanSpec, ["--out", str(tmp_path)], prog="t")
    assert (tt.ckpt, tt.kill_rank, tt.kill_step) == (None, -1, -1)


def test_repeated_flags_and_choices_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--out", str(tmp_path), "--family", "llama", "--family", "qwen2", "--fsdp2", "gpt2"]
    spec = parse(HfSpec, [*flags, "--case", "replay"], prog="t")
    assert (
        spec.family == ("llama", "qwen2") and spec.fsdp2 == ("gpt2",) and spec.case == ("replay",)
    )
    for bad in (["--family", "bert"], ["--case", "sideways"], ["--unreplayable", "bert"]):
        with pytest.raises(SystemExit) as exc:
            parse(HfSpec, ["--out", str(tmp_path), *bad], prog="t")
        assert exc.value.code == 2
    capsys.readouterr()
    # The programs train with a fixed seed and have no field for one: a spec asking for a seed is refused.
    cases: list[tuple[type, dict[str, Any]]] = [
        (HfSpec, {}),
        (TitanSpec, {"assets": tmp_path}),
        (TorchTitanSpec, {}),
    ]
    for cls, extra in cases:
        data = to_dict(cls(out=tmp_path, **extra)) | {"seed": 1}
        path = tmp_path / f"{cls.__name__}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(SystemExit) as exc:
            parse(cls, ["--spec", str(path)], prog="t")
        assert exc.value.code == 2 and "seed" in capsys.readouterr().err


def test_the_choice_constants_are_the_programs() -> None:
    """hf_rank takes its families and cases from the spec module (imported there, so no copy can drift)."""
    source = (Path(hf_cell.__file__).parent / "hf_rank.py").read_text()
    assert "from qualification.programs.specs.hf import CASES, FAMILIES, HfSpec" in source
    assert FAMILIES == ("llama", "gpt2", "qwen2") and CASES == ("healthy", "persistent", "replay")


class _Launches:
    """Stands in for :func:`qualification.launch.launch`: records each argv; the reference run succeeds, the next
    launch fails (so the cell stops there, with nothing else to read)."""

    def __init__(self) -> None:
        self.argvs: list[list[str]] = []

    def __call__(self, argv: list[str], *, world_size: int, **kw: Any) -> LaunchResult:
        self.argvs.append(list(argv))
        ok = len(self.argvs) == 1 and "spec-reference.json" in argv[-1]
        return LaunchResult([0 if ok else 1] * world_size, None if ok else 0, 0.1, False)


def _titan_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, topology: str, fault: dict, params: dict
) -> list[list[str]]:
    launches = _Launches()
    monkeypatch.setattr(titan_cell.titan_env, "python", lambda: "/tt/bin/python")
    monkeypatch.setattr(titan_cell.titan_env, "unavailable", lambda python=None: None)
    monkeypatch.setattr(titan_cell._Job, "assets", lambda self: None)
    monkeypatch.setattr(titan_cell, "launch", launches)
    cell = {
        "id": "t/titan_cell",
        "program": "titan_cell",
        "workload": "llama3-debug",
        "topology": topology,
        "world_size": 4,
        "fault": fault,
        "seed": 0,
        "params": params,
    }
    result = titan_cell.run_cell(cell, tmp_path)
    assert result["status"] != "passed"  # the stand-in failed the second launch on purpose
    return launches.argvs


def test_the_titan_cell_writes_what_its_old_flags_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = {"kind": "replay", "rank": 1, "step": 3, "recipe": "pp0.embedding"}
    params = {"steps": 5, "schedule": "Interleaved1F1B", "scout_per_cycle": 0}
    reference, run = _titan_cell(tmp_path, monkeypatch, "pp-ddp", fault, params)
    assert reference[:2] == run[:2] == ["-m", "qualification.programs.titan_rank"]
    assert reference[2:] == ["--spec", str(tmp_path / "reference" / "spec-reference.json")]
    assert run[2:] == ["--spec", str(tmp_path / "run" / "spec-run.json")]
    # The pre-spec titan_cell's flags for these two launches (git show HEAD:qualification/programs/titan_cell.py).
    common = [
        "--assets",
        str(tmp_path / "assets"),
        "--steps",
        "5",
        "--seq-len",
        "128",
        "--batch",
        "2",
        "--pp",
        "2",
        "--dp-replicate",
        "2",
        "--pp-schedule",
        "Interleaved1F1B",
    ]
    old_reference = ["--out", str(tmp_path / "reference"), *common]
    old_run = ["--out", str(tmp_path / "run"), *common, "--ckpt", str(tmp_path / "ckpt")]
    old_run += ["--scout", "--scout-per-cycle", "0", "--replay-fault-rank", "1"]
    old_run += ["--replay-fault-step", "3", "--replay-fault-recipe", "pp0.embedding"]
    assert parse(TitanSpec, reference[2:], prog="t") == parse(TitanSpec, old_reference, prog="t")
    assert parse(TitanSpec, run[2:], prog="t") == parse(TitanSpec, old_run, prog="t")


def test_the_titan_cell_names_the_faulted_launch_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = {"kind": "sigkill", "rank": 1, "step": 3}
    reference, faulted = _titan_cell(tmp_path, monkeypatch, "hsdp", fault, {})
    assert faulted[2:] == ["--spec", str(tmp_path / "run" / "spec-faulted.json")]
    old = ["--out", str(tmp_path / "run"), "--assets", str(tmp_path / "assets"), "--steps", "6"]
    old += ["--seq-len", "128", "--batch", "2", "--dp-replicate", "2", "--pp-schedule", "1F1B"]
    old += ["--ckpt", str(tmp_path / "ckpt"), "--kill-rank", "1", "--kill-step", "3"]
    assert parse(TitanSpec, faulted[2:], prog="t") == parse(TitanSpec, old, prog="t")


def test_every_titan_topology_is_spec_fields(tmp_path: Path) -> None:
    for topology, fields in titan_cell.TOPOLOGIES.items():
        values: dict[str, Any] = {"out": tmp_path, "assets": tmp_path, **fields}
        spec = TitanSpec(**values)
        assert parse(TitanSpec, spec_argv(spec, tmp_path / f"{topology}.json"), prog="t") == spec


@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_the_hf_cell_writes_what_its_old_flags_said(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches = _Launches()
    monkeypatch.setattr(hf_cell, "launch", launches)
    cell = {
        "id": "t/hf_cell",
        "program": "hf_cell",
        "workload": "gpt2",
        "topology": how,
        "world_size": 4,
        "fault": {"kind": "decoder-layer", "rank": 2, "step": 3, "block": 0},
        "seed": 0,
        "params": {"steps": 4, "interval": 2},
    }
    assert hf_cell.run_cell(cell, tmp_path)["status"] != "passed"
    [argv] = launches.argvs  # its one launch (the stand-in fails it: nothing to read)
    out = tmp_path / "ranks"
    assert argv == ["-m", "qualification.programs.hf_rank", "--spec", str(out / "spec-run.json")]
    # The pre-spec hf_cell's flags (git show HEAD:qualification/programs/hf_cell.py).
    old = ["--out", str(out), "--family" if how == "ddp" else f"--{how}", "gpt2", "--steps", "4"]
    old += ["--interval", "2", "--fault-rank", "2", "--fault-step", "3", "--fault-block", "0"]
    assert parse(HfSpec, argv[2:], prog="t") == parse(HfSpec, old, prog="t")


def test_the_torchtitan_rank_flags_before_the_separator(tmp_path: Path) -> None:
    """The GPU test's flags (tests/gpu/test_torchtitan.py) for a killed run, as torchtitan_rank splits them."""
    argv = ["--out", str(tmp_path), "--ckpt", str(tmp_path / "ck"), "--kill-rank", "1"]
    argv += ["--kill-step", "4", "--", "--module", "llama3", "--training.steps", "6"]
    ours, _, titan_args = " ".join(argv).partition(" -- ")
    spec = parse(TorchTitanSpec, ours.split(), prog="t")
    assert spec == TorchTitanSpec(out=tmp_path, ckpt=tmp_path / "ck", kill_rank=1, kill_step=4)
    assert titan_args.split() == ["--module", "llama3", "--training.steps", "6"]
    assert parse(TorchTitanSpec, spec_argv(spec, tmp_path / "s.json"), prog="t") == spec


def test_the_specs_and_cells_build_without_torch_or_torchtitan() -> None:
    code = (
        "import sys\n"
        "import qualification.programs.specs.titan, qualification.programs.specs.hf\n"
        "import qualification.programs.titan_cell, qualification.programs.hf_cell\n"
        "heavy = sorted(m for m in ('torch', 'torchtitan', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    root = Path(titan_cell.__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=60)
