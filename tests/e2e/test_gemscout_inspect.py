"""``gemscout inspect``: the operator's offline view of a checkpoint directory written by a real 2-rank job (real
files, damaged on disk the way test_gemini_integrity damages them). What a restart would restore is recovery's own
choice; test_gemini_integrity checks that prediction against real restarts."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from gemscout.cli import main
from qualification.corruption import flip_byte, own_slot, replica_slot, truncate
from qualification.launch import launch

WORLD = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inspect")
    res = launch(
        [
            "-m",
            "qualification.programs.train_rank",
            "--out",
            str(root / "out"),
            "--steps",
            "6",
            "--ckpt",
            str(root / "ckpt"),
            "--certify",
            "--durable",
            str(root / "durable"),
            "--durable-every",
            "2",
        ],
        world_size=WORLD,
        timeout_s=120,
        log_dir=root / "logs",
    )
    assert res.ok, res
    return root


def case(job: Path, name: str) -> Path:
    shutil.copytree(job / "ckpt", job / name)
    return job / name


def run(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = main(["inspect", *args])
    return code, out.getvalue()


def as_json(*args: str) -> tuple[int, dict]:
    code, out = run(*args, "--json")
    return code, json.loads(out)


@pytest.mark.timeout(180)
def test_a_healthy_directory_lists_every_generation_and_restores_the_newest(job: Path) -> None:
    code, out = run(str(job / "ckpt"), "--durable", str(job / "durable"), "--verify")
    assert code == 0, out
    assert "a restart would RESTORE step 6 (rank 0: local, rank 1: local)" in " ".join(out.split())
    code, doc = as_json(str(job / "ckpt"), "--durable", str(job / "durable"), "--verify")
    assert (
        code == 0
        and doc["run_id"] == "qualify"
        and doc["world_size"] == WORLD
        and doc["unusable"] == []
    )
    for rank in doc["ranks"]:
        files = {(f["kind"], f["owner"], f["step"]): f["status"] for f in rank["files"]}
        other = 1 - rank["rank"]
        assert files == {
            ("own", rank["rank"], 5): "verified",
            ("own", rank["rank"], 6): "verified",
            ("replica", other, 5): "verified",
            ("replica", other, 6): "verified",
        }, files
        assert rank["trust"]["5"] == "recovery_verified"  # --certify stands in for SCOUT
    assert [d["step"] for d in doc["durable"]] == [6, 4, 2] and {
        d["status"] for d in doc["durable"]
    } == {"verified"}


@pytest.mark.timeout(180)
def test_node_loss_is_covered_by_the_peer_replica(job: Path) -> None:
    ckpt = case(job, "node-loss")
    shutil.rmtree(ckpt / "node-1")
    code, doc = as_json(
        str(ckpt)
    )  # rank 1's folder is gone: its existence is known from the replica rank 0 holds
    assert code == 0 and doc["world_size"] == 2
    assert doc["decision"]["step"] == 6 and doc["decision"]["sources"] == {
        "0": "local",
        "1": "peer:0",
    }


@pytest.mark.timeout(180)
def test_a_flipped_byte_needs_verify_and_then_the_peer_replica_is_chosen(job: Path) -> None:
    ckpt = case(job, "flip")
    flip_byte(own_slot(ckpt, 0, 6))
    code, doc = as_json(
        str(ckpt)
    )  # by header the file looks whole: recovery would find out only when loading it
    assert code == 0 and doc["decision"]["sources"]["0"] == "local"
    code, doc = as_json(str(ckpt), "--verify")
    assert code == 3, doc  # IntegrityError.exit_code: a file recovery must skip
    assert len(doc["unusable"]) == 1 and "step-000000006.gsc" in doc["unusable"][0]
    assert doc["decision"]["step"] == 6 and doc["decision"]["sources"]["0"] == "peer:1"


@pytest.mark.timeout(180)
def test_truncation_is_seen_without_verify_and_everything_gone_means_stop(job: Path) -> None:
    ckpt = case(job, "truncated")
    truncate(replica_slot(ckpt, 1, 6, world_size=WORLD))
    code, out = run(str(ckpt))
    assert code == 3 and "unusable" in out and "truncated" in out, out
    shutil.rmtree(
        ckpt / "node-1"
    )  # now step 6 of rank 1 exists nowhere usable: step 5 is the newest whole one
    code, doc = as_json(str(ckpt))
    assert (
        code == 3 and doc["decision"]["step"] == 5 and doc["decision"]["sources"]["1"] == "peer:0"
    )
    flip_byte(replica_slot(ckpt, 1, 5, world_size=WORLD))
    code, doc = as_json(str(ckpt), "--verify")
    assert code == 4, doc  # RecoveryError.exit_code: a restart would STOP, as the job itself would
    assert (
        doc["decision"]["mode"] == "stop"
        and "replica of rank 1 step 5" in doc["decision"]["reason"]
    )
    code, doc = as_json(str(ckpt), "--verify", "--durable", str(job / "durable"))
    assert code == 3 and doc["decision"]["mode"] == "durable" and doc["decision"]["step"] == 6


@pytest.mark.timeout(180)
def test_a_rejected_step_is_never_chosen(job: Path) -> None:
    ckpt = case(job, "rejected")
    status = ckpt / "node-1" / "rank-1" / "status.json"
    doc = json.loads(status.read_text())
    doc["states"]["6"] = "rejected"  # one rank's record is enough: the ranks' records are united
    status.write_text(json.dumps(doc))
    code, out = as_json(str(ckpt))
    assert (
        code == 0
        and out["decision"]["step"] == 5
        and "step 6 rejected" in out["decision"]["reason"]
    )
    code, out = as_json(str(ckpt), "--min-trust", "durable")
    assert code == 4 and out["decision"]["mode"] == "stop"  # step 5 is only recovery_verified


@pytest.mark.timeout(180)
def test_damaged_and_foreign_promotions_as_recovery_sees_them(job: Path) -> None:
    """Every local folder gone: the newest promotion damaged → the older one, the reason naming the refusal; every
    promotion damaged → STOP (not a fresh start); a promotion of another run is listed as not this job's and skipped."""
    ckpt, durable = case(job, "promotions"), job / "promotions-durable"
    shutil.copytree(job / "durable", durable)
    for node in ckpt.glob("node-*"):
        shutil.rmtree(node)
    steps = sorted(durable.iterdir())
    assert [p.name for p in steps] == ["step-000000002", "step-000000004", "step-000000006"]
    flip_byte(max(steps[-1].glob("*.distcp"), key=lambda f: f.stat().st_size))
    code, doc = as_json(
        str(ckpt), "--durable", str(durable), "--verify", "--world-size", str(WORLD)
    )
    assert code == 3 and doc["decision"]["mode"] == "durable" and doc["decision"]["step"] == 4, doc[
        "decision"
    ]
    assert "refused durable step 6" in doc["decision"]["reason"]
    sidecar = (
        steps[-2] / "gemscout-sidecar.json"
    )  # step 4 now belongs to another run: not ours, skipped
    side = json.loads(sidecar.read_text())
    side["run_id"] = "another-run"
    sidecar.write_text(json.dumps(side))
    code, doc = as_json(
        str(ckpt), "--durable", str(durable), "--verify", "--world-size", str(WORLD)
    )
    assert {d["step"]: d["status"] for d in doc["durable"]} == {
        6: "unusable",
        4: "foreign",
        2: "verified",
    }
    assert code == 3 and doc["decision"]["step"] == 2, doc["decision"]
    flip_byte(max(steps[0].glob("*.distcp"), key=lambda f: f.stat().st_size))
    code, doc = as_json(
        str(ckpt), "--durable", str(durable), "--verify", "--world-size", str(WORLD)
    )
    assert code == 4 and doc["decision"]["mode"] == "stop", doc["decision"]
    assert (
        "refused durable step 2" in doc["decision"]["reason"]
        and "refused durable step 6" in doc["decision"]["reason"]
    )


@pytest.mark.timeout(120)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("gemscout")
    for args, needle in (
        (["inspect", str(tmp_path / "missing")], "is not a directory"),
        (["inspect", str(tmp_path)], "holds no GEMINI checkpoint"),
        (["inspect", str(tmp_path), "--min-trust", "sure"], "--min-trust must be one of"),
    ):
        proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert (
            needle in proc.stderr
            and "Traceback" not in proc.stderr
            and len(proc.stderr.strip().splitlines()) == 1
        )
