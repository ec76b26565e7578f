"""The fail-stop fault object: each phase kills only its rank, at its step, at its point of the step, with the kill
recorded first; everything else is a no-op. The kills are real (a child process SIGKILLs or SIGTERMs itself)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qualification.programs import _kills
from qualification.programs._failstop import FailStop
from qualification.programs.specs import parse
from qualification.programs.specs.train import TrainSpec

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
from qualification.programs._failstop import FailStop

faults = FailStop(**{**json.loads(sys.argv[1]), "out": Path(sys.argv[2])})
session = SimpleNamespace(step=0, checkpointer=None)
for step in range(1, 6):
    session.step = step
    faults.in_capture(session)
    faults.in_step(step)
    faults.after_step(session, step)
    print(f"step {step} done", flush=True)
import time
time.sleep(2)  # a random:<ms> kill fires from its timer while the process is here
print("survived", flush=True)
"""


def _child(tmp_path: Path, **fields: object) -> tuple[int, str, list[dict]]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(fields), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc.returncode, proc.stdout, _kills.read(tmp_path)


@pytest.mark.parametrize("phase", ["capture", "in-step", "after-step"])
def test_a_kill_lands_at_its_rank_step_and_phase_after_its_record(
    phase: str, tmp_path: Path
) -> None:
    code, out, kills = _child(tmp_path, rank=1, kill_rank=1, kill_step=3, phase=phase)
    assert code == -signal.SIGKILL
    assert "step 2 done" in out and "step 3 done" not in out
    assert [(k["rank"], k["step"], k["phase"]) for k in kills] == [(1, 3, phase)]


def test_a_random_kill_fires_later_from_its_timer(tmp_path: Path) -> None:
    code, out, kills = _child(tmp_path, rank=0, kill_rank=0, kill_step=2, phase="random:50")
    assert code == -signal.SIGKILL and "survived" not in out
    assert [(k["step"], k["phase"]) for k in kills] == [(2, "random:50")]


@pytest.mark.parametrize(
    "fields",
    [
        {"rank": 0, "kill_rank": 1, "kill_step": 3},  # another rank's kill
        {"rank": 1, "kill_rank": 1, "kill_step": 9},  # a step the run never reaches
        {"rank": 1, "kill_rank": 1, "kill_step": 3, "armed": False},  # another attempt's kill
        {"rank": 1, "kill_rank": 1, "kill_step": 3, "phase": "persist"},  # an io phase: arm_io's
        {"rank": 1, "sigterm_step": 2},  # SIGTERM is rank 0's
    ],
)
def test_nothing_fires_where_it_was_not_asked_for(fields: dict, tmp_path: Path) -> None:
    code, out, kills = _child(tmp_path, **fields)
    assert (code, kills) == (0, []) and "survived" in out


def test_sigterm_reaches_rank_0_after_its_step(tmp_path: Path) -> None:
    code, out, kills = _child(tmp_path, rank=0, sigterm_step=2)
    assert code == -signal.SIGTERM and "step 1 done" in out and "step 2 done" not in out
    assert kills == []


def test_an_io_phase_is_armed_on_the_checkpointer_hook(tmp_path: Path) -> None:
    checkpointer = SimpleNamespace(phase_hook=None)
    session = SimpleNamespace(step=0, checkpointer=checkpointer)
    FailStop(out=tmp_path, rank=0, kill_rank=1, kill_step=3, phase="replicate").arm_io(session)
    assert checkpointer.phase_hook is None  # not the killer: its hook stays
    FailStop(out=tmp_path, rank=1, kill_rank=1, kill_step=3, phase="after-step").arm_io(session)
    assert checkpointer.phase_hook is None  # not an io phase
    FailStop(out=tmp_path, rank=1, kill_rank=1, kill_step=3, phase="replicate").arm_io(session)
    assert callable(checkpointer.phase_hook)
    checkpointer.phase_hook("persist", 3)  # another phase of the same step: no kill
    checkpointer.phase_hook("replicate", 2)  # the phase at another step: no kill


def test_a_spec_gives_its_fail_stop_fields(tmp_path: Path) -> None:
    spec = parse(
        TrainSpec,
        ["--out", str(tmp_path), "--kill-rank", "2", "--kill-step", "4", "--kill-phase", "random:9"]
        + ["--kill-seed", "7", "--sigterm-step", "5"],
        prog="t",
    )
    faults = FailStop.of(spec, rank=2)
    assert (faults.kill_rank, faults.kill_step, faults.phase, faults.seed, faults.sigterm_step) == (
        2,
        4,
        "random:9",
        7,
        5,
    )
    assert faults.killer and not FailStop.of(spec, rank=1).killer
    # A spec without kill_phase / kill_seed / sigterm_step (TitanSpec, MoeSpec) gets the defaults.
    bare = FailStop.of(SimpleNamespace(out=tmp_path, kill_rank=0, kill_step=1), rank=0)
    assert (bare.phase, bare.seed, bare.sigterm_step) == ("after-step", 0, -1)
