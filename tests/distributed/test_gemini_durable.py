"""Durable tier: verified steps are promoted to a standard DCP directory with a SHA-256 sidecar; a job that lost all
local storage resumes from it on a different world size; a tampered promotion is never loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from _heavy import heavy

from gemscout.gemini.durable import SIDECAR
from qualification.launch import launch


def argv(out: Path, ckpt: Path, durable: Path, steps: int, *extra: str) -> list[str]:
    return [
        "-m",
        "qualification.programs.train_rank",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--ckpt",
        str(ckpt),
        "--durable",
        str(durable),
        *extra,
    ]


def ranks(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(300)
def test_resume_from_durable_on_another_world_size_and_refuse_tampering(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    first = launch(
        argv(
            tmp_path / "w2", tmp_path / "local-w2", durable, 6, "--durable-every", "3", "--certify"
        ),
        world_size=2,
        timeout_s=120,
        log_dir=tmp_path / "logs",
    )
    assert first.ok, first
    promoted = sorted(p.name for p in durable.iterdir())
    assert promoted == ["step-000000003", "step-000000006"]
    # Any DCP user can read a promotion: plain DCP metadata. The replicated model and optimizer are stored once
    # (keys g/...), each rank's own RNG streams and caller state under r<rank>/...
    meta = dcp.FileSystemReader(str(durable / "step-000000006")).read_metadata()
    keys = set(meta.state_dict_metadata)
    assert any(k.startswith("g/model/") for k in keys) and any(
        k.startswith("g/optimizer/") for k in keys
    )
    assert {k.split("/")[0] for k in keys if k.startswith("r")} == {"r0", "r1"}
    assert not any(
        k.startswith(("r0/model", "r1/model", "r0/optimizer", "r1/optimizer")) for k in keys
    )
    sidecar = json.loads((durable / "step-000000006" / SIDECAR).read_text())
    assert all(len(f["sha256"]) == 64 for f in sidecar["files"].values())
    at_six = ranks(tmp_path / "w2", 2)[0]["state_digest"]

    # All local storage is gone; three ranks now. The durable step 6 is restored on every rank.
    res = launch(
        argv(tmp_path / "w3", tmp_path / "local-w3", durable, 8),
        world_size=3,
        timeout_s=120,
        log_dir=tmp_path / "logs",
        attempt=1,
    )
    assert res.ok, res
    out = ranks(tmp_path / "w3", 3)
    assert all(r["decision"]["mode"] == "durable" and r["decision"]["step"] == 6 for r in out)
    assert all(r["resume_digest"] == at_six for r in out), "durable restore is not bitwise"
    assert all(r["replicas_equal"] for r in out)

    # Tamper with the newest promotion: it is refused and the older one is used.
    data_file = next(p for p in (durable / "step-000000006").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data_file.write_bytes(bytes(raw))
    shutil.rmtree(tmp_path / "local-w3")
    res = launch(
        argv(tmp_path / "w3b", tmp_path / "local-w3b", durable, 8),
        world_size=3,
        timeout_s=120,
        log_dir=tmp_path / "logs",
        attempt=2,
    )
    assert res.ok, res
    decision = ranks(tmp_path / "w3b", 3)[0]["decision"]
    assert decision["step"] == 3 and "refused durable step 6" in decision["reason"], decision

    # Every promotion damaged and no local storage: the job stops (exit 4) naming them; it does not start fresh.
    data_file = next(p for p in (durable / "step-000000003").iterdir() if p.suffix == ".distcp")
    data_file.write_bytes(data_file.read_bytes()[:-1] + bytes([data_file.read_bytes()[-1] ^ 1]))
    shutil.rmtree(tmp_path / "local-w3b")
    res = launch(
        argv(tmp_path / "w3c", tmp_path / "local-w3c", durable, 8),
        world_size=3,
        timeout_s=120,
        log_dir=tmp_path / "logs",
        attempt=3,
    )
    assert res.returncodes[res.first_failed or 0] == 4, res
    log = (tmp_path / "logs" / "rank0.attempt3.log").read_text()
    assert "refused durable step 3" in log and "Traceback" not in log, log[-2000:]


@pytest.mark.timeout(200)
def test_replicated_promotion_takes_newest_persisted_certified_step(tmp_path: Path) -> None:
    """DDP, persist_every=2, durable_every=3, every capture certified: when the third certified capture (step 3) is
    due it was never written, so rank 0 promotes step 2; at step 6 (written) it promotes 6. The promotions restore."""
    durable = tmp_path / "durable"
    res = launch(
        argv(
            tmp_path / "a",
            tmp_path / "local-a",
            durable,
            6,
            "--durable-every",
            "3",
            "--certify",
            "--persist-every",
            "2",
        ),
        world_size=2,
        timeout_s=120,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    a = ranks(tmp_path / "a", 2)
    assert all(not r["errors"] for r in a), [r["errors"] for r in a]
    assert sorted(p.name for p in durable.iterdir()) == ["step-000000002", "step-000000006"]
    shutil.rmtree(tmp_path / "local-a")
    res = launch(
        argv(tmp_path / "b", tmp_path / "local-b", durable, 6),
        world_size=2,
        timeout_s=120,
        log_dir=tmp_path / "logs",
        attempt=1,
    )
    assert res.ok, res
    b = ranks(tmp_path / "b", 2)
    assert all(r["decision"]["mode"] == "durable" and r["decision"]["step"] == 6 for r in b)
    assert [r["resume_digest"] for r in b] == [r["state_digest"] for r in a], (
        "durable restore is not bitwise"
    )
    # Each rank got its own caller state back (its own loss history), not rank 0's.
    assert [r["losses"] for r in b] == [r["losses"] for r in a] and a[0]["losses"] != a[1]["losses"]


@heavy(
    "lifecycle-durable-fallback-pp-w2-*", "topologies", "three pipeline launches, ~39 s on 2 cores"
)
@pytest.mark.timeout(240)
def test_pipeline_stages_are_promoted_rank_by_rank_and_resume_only_on_their_world_size(
    tmp_path: Path,
) -> None:
    """Pipeline stages are plain tensors under the same names on every rank (each stage has its own blocks.0): a
    promotion must keep each rank's own, where DCP would store one tensor per name for all. Resumed on 2 ranks after
    every local folder is lost, each stage gets its own state back bitwise; on 4 ranks the promotion is refused with
    one clear line (exit 2), not loaded into the wrong stages."""
    durable = tmp_path / "durable"
    pp = ("--topology", "pp", "--workload", "three-block", "--schedule", "1f1b")
    res = launch(
        argv(
            tmp_path / "a",
            tmp_path / "local-a",
            durable,
            6,
            "--durable-every",
            "3",
            "--certify",
            *pp,
        ),
        world_size=2,
        timeout_s=120,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    a = ranks(tmp_path / "a", 2)
    keys = set(
        dcp.FileSystemReader(str(durable / "step-000000006")).read_metadata().state_dict_metadata
    )
    assert "r0/model/blocks.0.fc1.weight" in keys and "r1/model/blocks.0.fc1.weight" in keys
    assert "g/model/blocks.0.fc1.weight" not in keys
    res = launch(
        argv(tmp_path / "b", tmp_path / "local-b", durable, 6, *pp),
        world_size=2,
        timeout_s=120,
        log_dir=tmp_path / "logs",
        attempt=1,
    )
    assert res.ok, res
    b = ranks(tmp_path / "b", 2)
    assert all(r["decision"]["mode"] == "durable" and r["decision"]["step"] == 6 for r in b)
    assert [r["resume_digest"] for r in b] == [r["state_digest"] for r in a], (
        "a stage did not get its own state"
    )
    res = launch(
        argv(
            tmp_path / "c",
            tmp_path / "local-c",
            durable,
            6,
            "--topology",
            "pp-dp",
            "--workload",
            "three-block",
            "--schedule",
            "1f1b",
        ),
        world_size=4,
        timeout_s=120,
        log_dir=tmp_path / "logs",
        attempt=2,
    )
    assert res.returncodes[res.first_failed or 0] == 2, res
    log = (tmp_path / "logs" / f"rank{res.first_failed}.attempt2.log").read_text()
    assert "restores on 2 ranks only, not 4" in log and "Traceback" not in log, log[-2000:]
