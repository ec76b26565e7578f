"""Corrupted checkpoints on disk are never loaded: recovery falls back to another source or an older generation,
the decision says why, and with nothing left it STOPs instead of restarting forever. Real files, real processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gemscout.inventory import Inventory, inventory
from qualification.corruption import drop_digest, flip_byte, own_slot, replica_slot, truncate
from qualification.launch import launch

WORLD = 3


def argv(out: Path, ckpt: Path | None, steps: int) -> list[str]:
    a = ["-m", "qualification.programs.train_rank", "--out", str(out), "--steps", str(steps)]
    return a + (["--ckpt", str(ckpt)] if ckpt else [])


def own(ckpt: Path, rank: int, step: int) -> Path:
    return own_slot(ckpt, rank, step)


def replica(ckpt: Path, owner: int, step: int) -> Path:
    return replica_slot(ckpt, owner, step, world_size=WORLD)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("integrity")
    assert launch(
        argv(root / "base", None, 8), world_size=WORLD, timeout_s=120, log_dir=root / "logs"
    ).ok
    assert launch(
        argv(root / "first", root / "ckpt", 6),
        world_size=WORLD,
        timeout_s=120,
        log_dir=root / "logs",
        attempt=1,
    ).ok
    reference = json.loads((root / "base" / "rank0.json").read_text())
    return root, reference


def relaunch(
    trained: tuple[Path, dict], name: str, corrupt
) -> tuple[object, list[dict] | None, Path, Inventory]:
    """Copy the checkpoints, damage them, read them offline as ``gemscout inspect --verify`` does (what a restart
    should restore), then restart the job on them."""
    root, _ = trained
    case = root / name
    shutil.copytree(root / "ckpt", case / "ckpt")
    corrupt(case / "ckpt")
    predicted = inventory(case / "ckpt", verify=True, world_size=WORLD)
    res = launch(
        argv(case / "out", case / "ckpt", 8), world_size=WORLD, timeout_s=120, log_dir=case / "logs"
    )
    if not res.ok:
        return res, None, case, predicted
    return (
        res,
        [json.loads((case / "out" / f"rank{r}.json").read_text()) for r in range(WORLD)],
        case,
        predicted,
    )


CASES = {
    "byte-flip-local": (lambda c: flip_byte(own(c, 1, 6)), 6, "peer:2", "own step 6"),
    "truncated-local": (lambda c: truncate(own(c, 1, 6)), 6, "peer:2", "truncated"),
    "deleted-digest-local": (lambda c: drop_digest(own(c, 1, 6)), 6, "peer:2", "malformed"),
    "byte-flip-replica-after-node-loss": (
        lambda c: (shutil.rmtree(c / "node-1"), flip_byte(replica(c, 1, 6))),
        5,
        "peer:2",
        "replica of rank 1 step 6",
    ),
    "deleted-digest-replica-after-node-loss": (
        lambda c: (shutil.rmtree(c / "node-1"), drop_digest(replica(c, 1, 6))),
        5,
        "peer:2",
        "malformed",
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_corruption_is_refused_and_recovery_falls_back(trained, name: str) -> None:
    corrupt, step, source, why = CASES[name]
    ok, ranks, case, predicted = relaunch(trained, name, corrupt)
    assert ok and ranks is not None, (case / "logs").as_posix()
    decision = ranks[0]["decision"]
    assert decision["step"] == step
    assert decision["sources"]["1"] == source
    assert why in decision["reason"]
    # The offline inventory found the damaged file and predicted exactly what the restart did.
    assert any(why in bad or "digest" in bad for bad in predicted.unusable), predicted.unusable
    assert (predicted.decision.step, predicted.decision.to_dict()["sources"]) == (
        step,
        decision["sources"],
    )
    _, reference = trained
    assert all(r["state_digest"] == reference["state_digest"] for r in ranks), (
        "recovered run diverged"
    )


@pytest.mark.timeout(300)
def test_every_source_corrupted_stops_with_a_report(trained) -> None:
    def corrupt_all(c: Path) -> None:
        shutil.rmtree(c / "node-1")
        for step in (5, 6):
            flip_byte(replica(c, 1, step))

    res, _, case, predicted = relaunch(trained, "all-corrupt", corrupt_all)
    assert not res.ok and 4 in res.returncodes, res  # RecoveryError.exit_code
    assert predicted.decision.mode == "stop", predicted.decision  # gemscout inspect saw it coming
    status = json.loads((case / "ckpt" / "node-0" / "rank-0" / "status.json").read_text())
    assert status["last_decision"]["mode"] == "stop"
    assert "replica of rank 1 step 5" in status["last_decision"]["reason"]
    log = (case / "logs" / "rank0.attempt0.log").read_text()
    assert "RecoveryError: recovery stopped" in log and "Traceback" not in log


@pytest.mark.timeout(300)
def test_checkpoints_of_another_run_are_refused_with_exit_code_2(trained) -> None:
    root, _ = trained
    case = root / "other-run"
    shutil.copytree(root / "ckpt", case / "ckpt")
    res = launch(
        argv(case / "out", case / "ckpt", 8) + ["--run-id", "someone-else"],
        world_size=WORLD,
        timeout_s=120,
        log_dir=case / "logs",
    )
    assert not res.ok and 2 in res.returncodes, res  # RunMismatchError.exit_code
    log = (case / "logs" / f"rank{res.first_failed}.attempt0.log").read_text()
    assert (
        "RunMismatchError" in log
        and "resume with run_id='qualify'" in log
        and "Traceback" not in log
    )
