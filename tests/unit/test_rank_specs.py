"""Rank specs: every rank program's arguments are one dataclass, written by its cell and read back exactly; a bad spec
file ends the rank with one line and exit code 2; the lifecycle cell's file is valid for every program it launches."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import pkgutil
from pathlib import Path

import jsonschema
import pytest

import qualification.programs.specs as specs_pkg
from qualification.programs import lifecycle
from qualification.programs.specs import _base, parse, schema, spec_argv, to_dict, write
from qualification.programs.specs.common import LifecycleSpec
from qualification.programs.specs.train import TrainSpec

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _spec_classes() -> list[type]:
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(specs_pkg.__path__):
        module = importlib.import_module(f"{specs_pkg.__name__}.{info.name}")
        for value in vars(module).values():
            if dataclasses.is_dataclass(value) and value.__module__.startswith(specs_pkg.__name__):
                found[value.__qualname__] = value
    return sorted(found.values(), key=lambda c: c.__name__)


SPEC_CLASSES = _spec_classes()


def _rank_programs() -> list[Path]:
    programs = ROOT / "qualification" / "programs"
    found = [
        *programs.glob("*_rank.py"),
        programs / "ds_zero3_rollback.py",
        *(ROOT / "qualification" / "bench").glob("*_rank.py"),
    ]
    return sorted(p for p in found if not p.name.startswith("_"))


def _required_values(cls: type, tmp_path: Path) -> dict[str, object]:
    """A value of the right type (the first of its choices) for each field without a default."""
    values: dict[str, object] = {}
    for f, base, _optional, repeated in _base._fields(cls):
        if not _base._required(f):
            continue
        choices = f.metadata.get("choices") or ()
        value = choices[0] if choices else {Path: tmp_path, int: 1, float: 1.0, str: "x"}[base]
        values[f.name] = (value,) if repeated else value
    return values


@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=lambda c: c.__name__)
def test_every_spec_has_a_valid_schema_and_round_trips(cls: type, tmp_path: Path) -> None:
    sch = schema(cls)
    jsonschema.Draft202012Validator.check_schema(sch)
    assert sch["additionalProperties"] is False
    spec = cls(**_required_values(cls, tmp_path))
    argv = spec_argv(spec, tmp_path / "spec.json")
    assert parse(cls, argv, prog="t") == spec
    # The file holds every field, so a reader sees exactly what the rank was told.
    assert set(json.loads((tmp_path / "spec.json").read_text())) == {
        f.name for f in dataclasses.fields(cls)
    }


def test_the_flags_and_the_spec_file_are_one_definition(tmp_path: Path) -> None:
    flags = [
        "--out",
        str(tmp_path),
        "--topology",
        "hsdp",
        "--kill-rank",
        "1",
        "--kill-step",
        "3",
        "--kill-phase",
        "random:40",
        "--ckpt",
        str(tmp_path / "ck"),
        "--certify",
        "--io-delay-ms",
        "5",
    ]
    from_flags = parse(TrainSpec, flags, prog="t")
    assert from_flags.kill_rank == 1 and from_flags.certify and from_flags.ckpt == tmp_path / "ck"
    assert (
        from_flags.steps == 6 and from_flags.replication == "ring"
    )  # defaults, as the flags had them
    from_file = parse(TrainSpec, spec_argv(from_flags, tmp_path / "s.json"), prog="t")
    assert from_file == from_flags


def _refused(capsys: pytest.CaptureFixture[str], cls: type, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(cls, argv, prog="train_rank")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"kill_rnak": 1}, "kill_rnak"),
        ({"steps": "six"}, "steps"),
        ({"topology": "ring-of-fire"}, "topology"),
        ({"replication": "natrual"}, "replication"),
        ({"certify": 1}, "certify"),
    ],
)
def test_a_bad_spec_file_is_refused_with_one_line_naming_it(
    change: dict, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = to_dict(TrainSpec(out=tmp_path)) | change
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    err = _refused(capsys, TrainSpec, ["--spec", str(path)])
    assert named in err and str(path) in err


def test_missing_required_unreadable_and_mixed_arguments_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "no-out.json"
    path.write_text(json.dumps({"steps": 3}))
    assert "'out' is a required property" in _refused(capsys, TrainSpec, ["--spec", str(path)])
    (tmp_path / "torn.json").write_text('{"out": ')
    assert "cannot read" in _refused(capsys, TrainSpec, ["--spec", str(tmp_path / "torn.json")])
    assert "--out" in _refused(capsys, TrainSpec, ["--steps", "3"])
    write(TrainSpec(out=tmp_path), tmp_path / "ok.json")
    mixed = ["--spec", str(tmp_path / "ok.json"), "--steps", "3"]
    assert "not both" in _refused(capsys, TrainSpec, mixed)


def _parsed_spec_class(program: Path) -> type | None:
    """The class a rank program passes to ``parse(...)``, resolved among the spec classes."""
    by_name = {c.__name__: c for c in SPEC_CLASSES}
    for node in ast.walk(ast.parse(program.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "parse"
            and node.args
            and isinstance(node.args[0], ast.Name)
        ):
            return by_name.get(node.args[0].id)
    return None


@pytest.mark.parametrize("program", _rank_programs(), ids=lambda p: p.stem)
def test_every_rank_program_reads_a_spec_and_declares_no_flags_of_its_own(program: Path) -> None:
    source = program.read_text()
    assert "add_argument" not in source, f"{program.name} declares flags outside its spec"
    assert _parsed_spec_class(program) is not None, f"{program.name} does not parse a rank spec"


@pytest.mark.parametrize(
    ("topology", "durable_every"),
    [
        ("ddp", 2),
        ("hsdp", 2),
        ("pp-dp", 2),
        ("deepspeed-zero3", 2),
        ("megatron-tp2", 2),
        ("megatron-pp2", 0),
    ],
)
def test_the_lifecycle_cell_writes_a_spec_its_program_accepts(
    topology: str, durable_every: int, tmp_path: Path
) -> None:
    cell = {
        "workload": "three-block",
        "topology": topology,
        "seed": 3,
        "params": {"steps": 5, "durable_every": durable_every},
    }
    argv = lifecycle._rank_argv(
        tmp_path / "run", cell, tmp_path / "ckpt", "faulted", kill_rank=1, kill_step=2
    )
    module = argv[1]
    program = ROOT / (module.replace(".", "/") + ".py")
    cls = _parsed_spec_class(program)
    assert cls is not None and issubclass(cls, LifecycleSpec), module
    spec = parse(cls, argv[2:], prog="t")
    assert (spec.topology, spec.seed, spec.steps, spec.kill_rank, spec.kill_step) == (
        topology,
        3,
        5,
        1,
        2,
    )
    durable = tmp_path / "durable" if durable_every else None
    assert (spec.certify, spec.durable, spec.durable_every) == (
        bool(durable),
        durable,
        durable_every,
    )
    assert argv[3] == str(tmp_path / "run" / "spec-faulted.json")


def test_a_program_refuses_a_lifecycle_field_it_cannot_honour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cell = {"workload": "gpt-megatron", "topology": "megatron-pp2", "params": {"durable_every": 2}}
    argv = lifecycle._rank_argv(tmp_path / "run", cell, tmp_path / "ckpt", "run")
    from qualification.programs.specs.megatron import MegatronLoopSpec

    assert "durable_every" in _refused(capsys, MegatronLoopSpec, argv[2:])


def test_the_pipeline_topologies_and_schedules_match_the_programs() -> None:
    from qualification.programs import _pipeline
    from qualification.programs.specs import train

    assert set(train.PIPELINE_TOPOLOGIES) == set(_pipeline.PIPELINE_TOPOLOGIES)
    assert train.SCHEDULES == _pipeline.SCHEDULES
