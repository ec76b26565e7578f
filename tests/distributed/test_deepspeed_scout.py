"""SCOUT's optimizer recipe on DeepSpeed ZeRO-1/2: the partition owner's update replayed by every rank.

Real gloo ranks on DeepSpeed's CPU accelerator (``[deepspeed]`` extra), 3 ranks, fp32, the rank program
``qualification.programs.ds_rank`` (it skips DeepSpeed's shm_comm JIT build). Each rank's fp32 partition is cut into 3
slices (``--optimizer-slice-numel 20000``: aligned starts, the last one ending at the partition's end); at step ``s``
the owner ``s % 3`` broadcasts all of its slices and every rank replays them.

- healthy: every slice AGREEs at every due step (and ``hidden.*`` beside it), no report, the rotation certifies, and
  the run equals a DeepSpeed run without gemscout bit for bit (state digest: module, master partition, AdamW state);
- a replay-only bit flip on rank 2, once while rank 1 owns the slices (a peer's replay) and once while rank 2 owns
  them (the owner's own replay disagreeing with its update): both ATTRIBUTED to rank 2 and nothing else, candidates
  rejected with a decision naming a verified step before the fault, certification resumes after the last fault, and
  training is untouched (bitwise equal to the baseline);
- a fault in the owner's real update (a bit flipped in its fp32 master partition right after the optimizer ran) is
  ATTRIBUTED to the owner, with two param groups (two partitions per rank) whose other slices all agree;
- bf16 module weights with gradient accumulation and the optimizer recipe alone: every slice agrees, bitwise equal;
- a rank whose slice replays are slow is a compute straggler after ``compute_confirmations`` rounds, with no SDC.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from _heavy import heavy

from gemscout.scout.stragglers import StragglerConfig
from qualification.launch import launch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install -e '.[deepspeed]')",
)

WORLD, STEPS, SLICES = 3, 13, 3
SCOUT = [
    "--scout",
    "--scout-recipes",
    "hidden,optimizer",
    "--optimizer-slice-numel",
    "20000",
    "--optimizer-slices-per-cycle",
    "0",
    "--keep-generations",
    "16",
]


def run(tmp: Path, name: str, topology: str, extra: list[str]) -> list[dict[str, Any]]:
    argv = [
        "-m",
        "qualification.programs.ds_rank",
        "--out",
        str(tmp / name),
        "--topology",
        topology,
        "--steps",
        str(STEPS),
        *extra,
    ]
    for attempt in range(2):
        res = launch(
            argv, world_size=WORLD, timeout_s=240, log_dir=tmp / "logs" / name, attempt=attempt
        )
        log = (tmp / "logs" / name / f"rank0.attempt{attempt}.log").read_text(errors="replace")
        if res.ok or "EADDRINUSE" not in log:
            break  # another job on this machine may take the rendezvous port between its probe and the bind
    assert res.ok, res
    return [json.loads((tmp / name / f"rank{r}.json").read_text()) for r in range(WORLD)]


def slices(step: int) -> list[str]:
    return [f"optimizer.rank{step % WORLD}.{j}" for j in range(SLICES)]


def sdc(result: dict[str, Any]) -> list[tuple[int, str, list[int]]]:
    return [
        (r["step"], r["recipe"], list(r["ranks"])) for r in result["reports"] if r["kind"] == "sdc"
    ]


def check_cycles(result: dict[str, Any], faults: dict[int, str]) -> None:
    """Every step was due: each slice of its owner AGREEs, except the faulted one, ATTRIBUTED to rank 2."""
    cycles = result["cycles"]
    assert sorted(map(int, cycles)) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        verdicts = {
            n: v for n, v in cycles[str(step)]["results"].items() if n.startswith("optimizer.")
        }
        assert sorted(verdicts) == slices(step), (step, verdicts)
        for name, (verdict, ranks) in verdicts.items():
            expected = ["attributed", [2]] if faults.get(step) == name else ["agree", []]
            assert [verdict, ranks] == expected, (step, name, verdict, ranks)
        hidden = [v for n, v in cycles[str(step)]["results"].items() if n.startswith("hidden.")]
        assert hidden == [["agree", []]], (step, hidden)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "topology",
    [
        pytest.param(
            "deepspeed-zero1",
            marks=heavy(
                "ds_scout_cell-scout-optimizer-deepspeed-zero1-*",
                "topologies",
                "~50 s on 2 cores; test_deepspeed keeps a ZeRO SCOUT fault in CI",
            ),
        ),
        pytest.param(
            "deepspeed-zero2",
            marks=heavy(
                "ds_scout_cell-scout-optimizer-deepspeed-zero2-*",
                "topologies",
                "~55 s on 2 cores; ZeRO-1 runs the same recipe",
            ),
        ),
    ],
)
def test_zero_optimizer_recipe_agrees_and_attributes_replay_faults(
    tmp_path: Path, topology: str
) -> None:
    baseline = run(tmp_path, "baseline", topology, [])
    healthy = run(tmp_path, "healthy", topology, ["--ckpt", str(tmp_path / "ckpt-healthy"), *SCOUT])
    for r, base in zip(healthy, baseline, strict=True):
        check_cycles(r, {})
        assert (
            r["reports"] == [] and [d for d in r["decisions"] if d["failure_kind"] != "none"] == []
        )
        assert (r["state_digest"], r["losses"]) == (base["state_digest"], base["losses"])
        assert (
            r["cycles"][str(STEPS)]["certified"] == STEPS - WORLD + 1
        )  # every owner's slices within 3 steps
        assert r["trust"][str(STEPS - WORLD + 1)] == "recovery_verified"

    fault_steps = (4, 8)  # owners: rank 1 (rank 2 is a peer), then rank 2 itself
    faulty = run(
        tmp_path,
        "faulty",
        topology,
        [
            "--ckpt",
            str(tmp_path / "ckpt-faulty"),
            *SCOUT,
            "--replay-fault-rank",
            "2",
            "--replay-fault-steps",
            "4,8",
        ],
    )
    faults = {s: slices(s)[0] for s in fault_steps}
    for r, base in zip(faulty, baseline, strict=True):
        check_cycles(r, faults)
        assert sdc(r) == [(s, faults[s], [2]) for s in fault_steps]
        assert (r["state_digest"], r["losses"]) == (base["state_digest"], base["losses"]), (
            "replay touched training"
        )
        first = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert (
            first["failure_kind"] == "sdc"
            and first["mode"] == "restore"
            and first["step"] < fault_steps[0]
        )
        trust = {int(k): v for k, v in r["trust"].items()}
        assert trust[first["step"]] == "recovery_verified"
        # Candidates taken from the first fault on were rejected or never taken until the rotation came clean.
        assert all(
            trust.get(s) != "recovery_verified"
            for s in range(first["step"] + 1, fault_steps[1] + 1)
        ), trust
        assert any(st == "recovery_verified" for s, st in trust.items() if s > fault_steps[1]), (
            trust
        )  # resumed
    assert len({json.dumps(r["trust"], sort_keys=True) for r in faulty}) == 1, (
        "ranks disagree on trust states"
    )


@pytest.mark.timeout(400)
def test_zero2_owner_update_fault_is_attributed_to_the_owner(tmp_path: Path) -> None:
    """Two param groups (two partitions per rank); the owner's real update of group 0 goes wrong at one step."""
    step = 5  # owner: rank 2; the flipped element (index 1 of group 0) lies in its first slice
    results = run(
        tmp_path,
        "run",
        "deepspeed-zero2",
        [
            "--ckpt",
            str(tmp_path / "ckpt"),
            *SCOUT,
            "--param-groups",
            "2",
            "--update-fault-rank",
            "2",
            "--update-fault-step",
            str(step),
        ],
    )
    for r in results:
        assert sdc(r) == [(step, "optimizer.rank2.0", [2])], r["reports"]
        for s, cycle in r["cycles"].items():
            verdicts = {n: v for n, v in cycle["results"].items() if n.startswith("optimizer.")}
            assert len(verdicts) > SLICES and all(
                n.startswith(f"optimizer.rank{int(s) % WORLD}.") for n in verdicts
            )
            expected = {
                n: ["attributed", [2]]
                if (int(s), n) == (step, "optimizer.rank2.0")
                else ["agree", []]
                for n in verdicts
            }
            assert verdicts == expected, (s, verdicts)


@pytest.mark.timeout(400)
def test_zero2_bf16_accumulation_optimizer_recipe_alone_is_bitwise(tmp_path: Path) -> None:
    """bf16 module weights (fp32 master partition), 2 micro-batches per step, the optimizer recipe as the only one."""
    common = ["--bf16", "--accumulation", "2"]
    baseline = run(tmp_path, "baseline", "deepspeed-zero2", common)
    scout = [*SCOUT[:2], "optimizer", *SCOUT[3:]]
    results = run(
        tmp_path, "run", "deepspeed-zero2", [*common, "--ckpt", str(tmp_path / "ckpt"), *scout]
    )
    for r, base in zip(results, baseline, strict=True):
        assert r["reports"] == []
        assert sorted(map(int, r["cycles"])) == list(range(1, STEPS + 1))
        for step, cycle in r["cycles"].items():
            assert cycle["results"] == {name: ["agree", []] for name in slices(int(step))}, (
                step,
                cycle,
            )
        assert (r["state_digest"], r["losses"]) == (base["state_digest"], base["losses"])


@pytest.mark.timeout(400)
def test_zero2_slow_slice_replay_is_a_compute_straggler(tmp_path: Path) -> None:
    """Rank 1 sleeps inside each of its slice replays: a compute straggler named after R rounds, whoever owns the
    slices (the rotation changes owner every step), and no SDC."""
    scout = [*SCOUT[:2], "optimizer", *SCOUT[3:]]
    results = run(
        tmp_path,
        "run",
        "deepspeed-zero2",
        [
            "--ckpt",
            str(tmp_path / "ckpt"),
            *scout,
            "--straggler-margin-s",
            "0.1",
            "--replay-delay-rank",
            "1",
            "--replay-delay-s",
            "0.1",
        ],
    )
    for r in results:
        assert sdc(r) == []
        late = [rep for rep in r["reports"] if rep["kind"] == "straggler"]
        assert late and {(rep["evidence"]["signal"], tuple(rep["ranks"])) for rep in late} == {
            ("compute", (1,))
        }, late
        first = (
            StragglerConfig().compute_confirmations
        )  # a slice is replayed every step: named at round R
        assert late[0]["step"] == first and late[0]["recipe"] == "optimizer", late[0]
        assert [rep["step"] for rep in late] == list(range(first, STEPS + 1))
        times = late[0]["evidence"]["times_s"]
        assert times["1"] > 3 * 0.1 and max(times["0"], times["2"]) < 3 * 0.1, times
