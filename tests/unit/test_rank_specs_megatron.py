"""The Megatron rank specs: each round-trips through its spec file; the flags the launchers used to pass and the spec
files they write now are the same arguments; the lifecycle fields the programs cannot honour are refused; the
topologies name the same layouts as the old flag lists; every campaign lifecycle cell on a Megatron topology writes a
spec its program accepts. No process groups, no torch."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from qualification import campaign
from qualification.programs import lifecycle, megatron_scout_cell
from qualification.programs.specs import parse, spec_argv, to_dict, write
from qualification.programs.specs.common import LifecycleSpec
from qualification.programs.specs.megatron import (
    GPT_TOPOLOGIES,
    LOOP_TOPOLOGIES,
    MegatronGpuSpec,
    MegatronLoopSpec,
    MegatronSpec,
)

pytestmark = pytest.mark.timeout(60)

_GPT, _LOOP = "qualification.programs.megatron_rank", "qualification.programs.megatron_loop_rank"
SPEC_OF = {_GPT: MegatronSpec, _LOOP: MegatronLoopSpec}


@pytest.mark.parametrize(
    "spec",
    [
        lambda p: MegatronSpec(out=p, topology="megatron-ep2", ckpt=p / "ck", scout=True, etp=1),
        lambda p: MegatronLoopSpec(out=p, pp=2, vpp=2, distopt=True, fault_rank=1, fault_step=3),
        lambda p: MegatronGpuSpec(out=p, ckpt=p / "ck", kill_rank=1, kill_step=3),
    ],
    ids=["MegatronSpec", "MegatronLoopSpec", "MegatronGpuSpec"],
)
def test_every_megatron_spec_round_trips_through_its_file(spec: Any, tmp_path: Path) -> None:
    s = spec(tmp_path)
    assert parse(type(s), spec_argv(s, tmp_path / "spec.json"), prog="t") == s


def test_the_specs_extend_the_lifecycle_contract_with_the_old_defaults(tmp_path: Path) -> None:
    assert issubclass(MegatronSpec, LifecycleSpec) and issubclass(MegatronLoopSpec, LifecycleSpec)
    gpt, loop, gpu = (c(out=tmp_path) for c in (MegatronSpec, MegatronLoopSpec, MegatronGpuSpec))
    for s in (gpt, loop):
        assert (s.workload, s.steps, s.seed, s.interval, s.persist_every, s.ranks_per_node) == (
            "gpt-megatron",
            6,
            0,
            1,
            1,
            1,
        )
        assert (s.kill_rank, s.kill_step, s.kill_phase, s.sigterm_step, s.ckpt, s.topology) == (
            -1,
            -1,
            "after-step",
            -1,
            None,
            None,
        )
        assert (s.keep_generations, s.scout, s.fault_rank, s.fault_step) == (2, False, -1, -1)
    assert (gpt.tp, gpt.ep, gpt.experts, gpt.etp, gpt.fault_recipe, gpt.fault_kind) == (
        1,
        1,
        0,
        None,
        "hidden.0",
        "bitflip",
    )
    assert (gpt.run_id, gpt.durable, gpt.durable_every, gpt.certify) == ("qualify", None, 0, False)
    assert (loop.pp, loop.vpp, loop.layers, loop.distopt, loop.overlap, loop.fault_recipe) == (
        1,
        1,
        0,
        False,
        False,
        "hidden.1",
    )
    assert (gpu.steps, gpu.ckpt, gpu.kill_rank, gpu.kill_step) == (6, None, -1, -1)


def _old_lifecycle_flags(out: Path, cell: dict[str, Any], ckpt: Path | None) -> list[str]:
    """What the lifecycle passed before the specs (``git show HEAD:qualification/programs/lifecycle.py``)."""
    p = cell.get("params", {})
    argv = [
        "--out",
        str(out),
        "--workload",
        cell["workload"],
        "--topology",
        str(cell.get("topology", "ddp")),
        "--steps",
        str(p.get("steps", 6)),
        "--seed",
        str(cell.get("seed", 0)),
        "--interval",
        str(p.get("interval", 1)),
        "--persist-every",
        str(p.get("persist_every", 1)),
        "--ranks-per-node",
        str(p.get("ranks_per_node", 1)),
    ]
    if ckpt is not None:
        argv += ["--ckpt", str(ckpt)]
        if int(p.get("durable_every", 0)) > 0:
            argv += [
                "--durable",
                str(ckpt.parent / "durable"),
                "--durable-every",
                str(p["durable_every"]),
                "--certify",
            ]
    return argv


@pytest.mark.parametrize(
    ("topology", "params"),
    [
        ("megatron-tp2", {"steps": 6, "durable_every": 2}),
        ("megatron-ep2", {"steps": 6}),
        ("megatron-pp2", {"steps": 6}),
        ("megatron-pp2-vpp2", {"steps": 5, "persist_every": 2}),
    ],
)
def test_the_old_lifecycle_flags_and_its_spec_file_are_the_same_arguments(
    topology: str, params: dict[str, Any], tmp_path: Path
) -> None:
    cell = {"workload": "gpt-megatron", "topology": topology, "seed": 3, "params": params}
    kill = {"kill_rank": 1, "kill_step": 4, "kill_phase": "after-step", "kill_seed": 3}
    argv = lifecycle._rank_argv(tmp_path / "run", cell, tmp_path / "ckpt", "faulted", **kill)
    cls = SPEC_OF[argv[1]]
    old = _old_lifecycle_flags(tmp_path / "run", cell, tmp_path / "ckpt")
    old += [
        "--kill-rank",
        "1",
        "--kill-step",
        "4",
        "--kill-phase",
        "after-step",
        "--kill-seed",
        "3",
    ]
    assert parse(cls, argv[2:], prog="t") == parse(cls, old, prog="t")
    assert argv[3] == str(tmp_path / "run" / "spec-faulted.json")


class _Launched(Exception):
    pass


def _scout_cell_spec(
    monkeypatch: pytest.MonkeyPatch, cell: dict[str, Any], celldir: Path, name: str, extra: dict
) -> tuple[str, list[str]]:
    """The program and arguments megatron_scout_cell launches (the launch itself stopped)."""
    seen: list[list[str]] = []

    def fake_launch(argv: list[str], **_: Any) -> None:
        seen.append(argv)
        raise _Launched

    monkeypatch.setattr(megatron_scout_cell, "launch", fake_launch)
    with pytest.raises(_Launched):
        megatron_scout_cell._launch(cell, celldir, name, extra)
    (argv,) = seen
    assert argv[0] == "-m" and argv[2:4] == ["--spec", str(celldir / name / f"spec-{name}.json")]
    return argv[1], argv[2:]


@pytest.mark.parametrize(
    ("topology", "old_layout"),
    [
        ("megatron-pp2", ["--pp", "2", "--layers", "4", "--distopt", "--overlap"]),
        ("megatron-pp2-vpp2", ["--pp", "2", "--vpp", "2", "--distopt", "--overlap"]),
        ("megatron-ep2", ["--topology", "megatron-ep2"]),
    ],
)
def test_the_old_scout_cell_flags_and_its_spec_file_are_the_same_arguments(
    topology: str, old_layout: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cell = {"topology": topology, "world_size": 4, "seed": 2, "params": {"steps": 8}}
    extra = {
        "ckpt": tmp_path / "ckpt",
        "scout": True,
        "keep_generations": 16,
        "fault_rank": 2,
        "fault_step": 5,
        "fault_recipe": "pp0.hidden.1",
    }
    program, argv = _scout_cell_spec(monkeypatch, cell, tmp_path, "run", extra)
    old = ["--out", str(tmp_path / "run"), "--steps", "8", "--seed", "2", *old_layout]
    old += ["--ckpt", str(tmp_path / "ckpt"), "--scout", "--keep-generations", "16"]
    old += ["--fault-rank", "2", "--fault-step", "5", "--fault-recipe", "pp0.hidden.1"]
    cls = SPEC_OF[program]
    assert parse(cls, argv, prog="t") == parse(cls, old, prog="t")
    program, argv = _scout_cell_spec(monkeypatch, cell, tmp_path, "baseline", {})
    old = ["--out", str(tmp_path / "baseline"), "--steps", "8", "--seed", "2", *old_layout]
    assert parse(SPEC_OF[program], argv, prog="t") == parse(SPEC_OF[program], old, prog="t")


def test_the_gpu_rank_reads_the_flags_its_test_passes(tmp_path: Path) -> None:
    flags = ["--out", str(tmp_path), "--steps", "6", "--ckpt", str(tmp_path / "ck")]
    flags += ["--kill-rank", "1", "--kill-step", "3"]
    spec = parse(MegatronGpuSpec, flags, prog="t")
    assert spec == MegatronGpuSpec(
        out=tmp_path, steps=6, ckpt=tmp_path / "ck", kill_rank=1, kill_step=3
    )


# The old megatron_loop_rank: a --topology re-parsed the arguments with these flags appended.
OLD_LOOP_TOPOLOGIES = {
    "megatron-ddp": ["--overlap"],
    "megatron-distopt": ["--distopt", "--overlap"],
    "megatron-pp2": ["--pp", "2", "--distopt"],
    "megatron-pp2-vpp2": ["--pp", "2", "--vpp", "2", "--distopt", "--overlap"],
}


@pytest.mark.parametrize("topology", sorted(OLD_LOOP_TOPOLOGIES))
def test_the_loop_topologies_set_what_their_old_flags_set(topology: str, tmp_path: Path) -> None:
    given = ["--out", str(tmp_path), "--topology", topology, "--pp", "3", "--layers", "6"]
    old = parse(MegatronLoopSpec, [*given, *OLD_LOOP_TOPOLOGIES[topology]], prog="t")
    new = dataclasses.replace(parse(MegatronLoopSpec, given, prog="t"), **LOOP_TOPOLOGIES[topology])
    assert new == old
    assert set(MegatronLoopSpec.__dataclass_fields__["topology"].metadata["choices"]) == set(
        OLD_LOOP_TOPOLOGIES
    )


def test_the_gpt_topologies_are_the_old_layouts() -> None:
    old = {"megatron-tp1": (1, 1, 0), "megatron-tp2": (2, 1, 0), "megatron-ep2": (1, 2, 4)}
    assert GPT_TOPOLOGIES == old
    assert MegatronSpec.__dataclass_fields__["topology"].metadata["choices"] == tuple(sorted(old))


@pytest.mark.parametrize("cls", [MegatronSpec, MegatronLoopSpec], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "change",
    [
        {"kill_phase": "in-step"},
        {"replication": "natural"},
        {"schedule": "1f1b"},
        {"io_delay_ms": 5},
        {"recovery_kill_phase": "recover-send"},
        {"topology": "ddp"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_lifecycle_spec_asking_for_what_the_program_cannot_do_is_refused(
    cls: type, change: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topology = "megatron-tp1" if cls is MegatronSpec else "megatron-ddp"
    path = write(
        dataclasses.replace(LifecycleSpec(out=tmp_path, topology=topology), **change),
        tmp_path / "spec.json",
    )
    with pytest.raises(SystemExit) as exc:
        parse(cls, ["--spec", str(path)], prog="t")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and next(iter(change)) in err, err


def _megatron_lifecycle_cells() -> list[campaign.Cell]:
    return [
        c
        for path in campaign.campaign_files()
        for c in campaign.load(path).cells
        if c.program == "lifecycle" and c.topology.startswith("megatron-")
    ]


@pytest.mark.parametrize("cell", _megatron_lifecycle_cells(), ids=lambda c: c.id)
def test_every_campaign_megatron_lifecycle_cell_writes_specs_its_program_accepts(
    cell: campaign.Cell, tmp_path: Path
) -> None:
    doc = cell.to_json()
    fault = doc["fault"]
    launches: list[tuple[Path | None, str, dict[str, Any]]] = [
        (None, "baseline", {}),
        (tmp_path / "ckpt", "run", {}),
    ]
    if fault["kind"] == "sigkill":
        kill = {
            "kill_rank": int(fault["rank"]),
            "kill_step": int(fault["step"]),
            "kill_phase": str(fault.get("phase", "after-step")),
            "kill_seed": int(doc.get("seed", 0)),
        }
        launches.append((tmp_path / "ckpt", "faulted", kill))
    elif fault["kind"] == "sigterm":
        launches.append((tmp_path / "ckpt", "faulted", {"sigterm_step": int(fault["step"])}))
    second = fault.get("recovery_kill")
    if second:
        rk = {"kill_rank": int(second["rank"]), "recovery_kill_phase": str(second["phase"])}
        launches.append((tmp_path / "ckpt", "recovery-kill", rk))
    for ckpt, label, faults in launches:
        argv = lifecycle._rank_argv(tmp_path / "run", doc, ckpt, label, **faults)
        spec = parse(SPEC_OF[argv[1]], argv[2:], prog="t")
        assert to_dict(spec)["topology"] == cell.topology
