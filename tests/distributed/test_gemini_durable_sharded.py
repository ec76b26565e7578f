"""Sharded durable tier with real FSDP2 (2 ranks) and HSDP (2x2) launches on gloo: every rank writes its shards of
the same step into one DCP directory, committed with a SHA-256 sidecar only when all ranks succeeded. With every
rank's local folder deleted, the job resumes from the durable tier bitwise (the same final state and losses as the
uninterrupted run); FSDP2 also resumes on 4 ranks and HSDP (2x2) on FSDP2 over 2 ranks through DCP resharding, and a
tampered promotion is refused. With persist_every=2 the promotion takes the newest certified step that was written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from _heavy import heavy

from gemscout.gemini.durable import SIDECAR
from qualification.launch import launch


def argv(out: Path, ckpt: Path, durable: Path, steps: int, topology: str, *extra: str) -> list[str]:
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
        "--topology",
        topology,
        "--workload",
        "three-block",
        *extra,
    ]


def ranks(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def first_run(tmp_path: Path, topology: str, world: int, *extra: str) -> tuple[Path, list[dict]]:
    """8 steps, every capture certified, a promotion every 3 verified steps (steps 3 and 6)."""
    durable = tmp_path / "durable"
    res = launch(
        argv(
            tmp_path / "a",
            tmp_path / "local-a",
            durable,
            8,
            topology,
            "--durable-every",
            "3",
            "--certify",
            *extra,
        ),
        world_size=world,
        timeout_s=150,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    out = ranks(tmp_path / "a", world)
    assert all(not r["errors"] for r in out), [r["errors"] for r in out]
    assert sorted(p.name for p in durable.iterdir()) == ["step-000000003", "step-000000006"]
    sidecar = json.loads((durable / "step-000000006" / SIDECAR).read_text())
    assert sidecar["sharded"] and sidecar["world_size"] == world
    # The sidecar covers every file of the directory, DCP's metadata included, and one data file per writing rank.
    files = {p.name for p in (durable / "step-000000006").iterdir()} - {SIDECAR}
    assert set(sidecar["files"]) == files and ".metadata" in files
    meta = dcp.FileSystemReader(str(durable / "step-000000006")).read_metadata()
    assert any(k.startswith("s/model/") for k in meta.state_dict_metadata), (
        "shards are not saved as global tensors"
    )
    return durable, out


def resumed_bitwise(
    a: list[dict[str, Any]], b: list[dict[str, Any]], step: int
) -> list[dict[str, Any]]:
    """``b`` resumed from the durable promotion of ``step`` and ended on ``a``'s trajectory, bit for bit."""
    assert all(r["decision"]["mode"] == "durable" and r["decision"]["step"] == step for r in b), b[
        0
    ]["decision"]
    for ra, rb in zip(a, b, strict=True):
        assert rb["state_digest"] == ra["state_digest"], (
            f"rank {ra['rank']}: resumed trajectory is not bitwise"
        )
        assert rb["losses"] == ra["losses"]
    return b


@pytest.mark.timeout(400)
def test_fsdp2_durable_resume_same_and_other_mesh_and_refuse_tampering(tmp_path: Path) -> None:
    durable, a = first_run(tmp_path, "fsdp2", 2, "--full-digest")
    shutil.rmtree(tmp_path / "local-a")  # every node's local folder is gone

    b_args = argv(tmp_path / "b", tmp_path / "local-b", durable, 8, "fsdp2", "--full-digest")
    res = launch(b_args, world_size=2, timeout_s=150, log_dir=tmp_path / "logs", attempt=1)
    assert res.ok, res
    b = resumed_bitwise(a, ranks(tmp_path / "b", 2), 6)
    at_six = b[0]["resume_full_digest"]
    assert all(r["resume_full_digest"] == at_six for r in b)

    # Another mesh: 4 ranks load the 2-rank promotion; DCP reshards onto the live mesh.
    res = launch(
        argv(tmp_path / "c", tmp_path / "local-c", durable, 6, "fsdp2", "--full-digest"),
        world_size=4,
        timeout_s=150,
        log_dir=tmp_path / "logs",
        attempt=2,
    )
    assert res.ok, res
    c = ranks(tmp_path / "c", 4)
    assert all(r["decision"]["mode"] == "durable" and r["decision"]["step"] == 6 for r in c)
    assert all(r["resume_full_digest"] == at_six for r in c), "resharded restore is not bitwise"

    # A flipped byte in the newest promotion: it is refused (fail closed) and step 3 is restored instead.
    data_file = next(p for p in (durable / "step-000000006").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data_file.write_bytes(bytes(raw))
    res = launch(
        argv(tmp_path / "d", tmp_path / "local-d", durable, 3, "fsdp2"),
        world_size=2,
        timeout_s=150,
        log_dir=tmp_path / "logs",
        attempt=3,
    )
    assert res.ok, res
    assert all(
        r["decision"]["mode"] == "durable" and r["decision"]["step"] == 3
        for r in ranks(tmp_path / "d", 2)
    )


@heavy(
    "lifecycle-durable-fallback-hsdp-*",
    "topologies",
    "4 + 8 HSDP ranks, ~70 s on 2 cores; FSDP2 proves the other-mesh resume",
)
@pytest.mark.timeout(400)
def test_hsdp_durable_resume_after_all_local_storage_is_lost_and_on_another_mesh(
    tmp_path: Path,
) -> None:
    durable, a = first_run(tmp_path, "hsdp", 4)
    shutil.rmtree(tmp_path / "local-a")
    res = launch(
        argv(tmp_path / "b", tmp_path / "local-b", durable, 8, "hsdp", "--full-digest"),
        world_size=4,
        timeout_s=150,
        log_dir=tmp_path / "logs",
        attempt=1,
    )
    assert res.ok, res
    b = ranks(tmp_path / "b", 4)
    assert all(r["decision"]["mode"] == "durable" and r["decision"]["step"] == 6 for r in b)
    for ra, rb in zip(a, b, strict=True):
        assert rb["state_digest"] == ra["state_digest"], (
            f"rank {ra['rank']}: resumed trajectory is not bitwise"
        )
        assert rb["losses"] == ra["losses"]
    at_six = {r["resume_full_digest"] for r in b}
    assert len(at_six) == 1

    # The HSDP (2x2) promotion on another mesh: FSDP2 over 2 ranks; DCP reshards the global tensors onto it.
    res = launch(
        argv(tmp_path / "c", tmp_path / "local-c", durable, 6, "fsdp2", "--full-digest"),
        world_size=2,
        timeout_s=150,
        log_dir=tmp_path / "logs",
        attempt=2,
    )
    assert res.ok, res
    c = ranks(tmp_path / "c", 2)
    assert all(r["decision"]["mode"] == "durable" and r["decision"]["step"] == 6 for r in c)
    assert {r["resume_full_digest"] for r in c} == at_six, (
        "the HSDP state restored on FSDP2 x 2 is not bitwise"
    )


@pytest.mark.timeout(300)
def test_fsdp2_promotes_newest_persisted_certified_step_when_persist_every_is_2(
    tmp_path: Path,
) -> None:
    """persist_every=2, durable_every=5, every capture certified: the fifth certified capture (step 5) was never
    written to disk, so the promotion takes the newest certified step that was (4). With every local folder lost,
    the relaunched job restores step 4 from the durable tier and ends bitwise equal to the uninterrupted run."""
    durable = tmp_path / "durable"
    common = ("--persist-every", "2", "--full-digest")
    res = launch(
        argv(
            tmp_path / "a",
            tmp_path / "local-a",
            durable,
            8,
            "fsdp2",
            "--durable-every",
            "5",
            "--certify",
            *common,
        ),
        world_size=2,
        timeout_s=150,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    a = ranks(tmp_path / "a", 2)
    assert all(not r["errors"] for r in a), [r["errors"] for r in a]
    assert sorted(p.name for p in durable.iterdir()) == ["step-000000004"]
    shutil.rmtree(tmp_path / "local-a")

    res = launch(
        argv(tmp_path / "b", tmp_path / "local-b", durable, 8, "fsdp2", *common),
        world_size=2,
        timeout_s=150,
        log_dir=tmp_path / "logs",
        attempt=1,
    )
    assert res.ok, res
    b = resumed_bitwise(a, ranks(tmp_path / "b", 2), 4)
    for ra, rb in zip(a, b, strict=True):
        assert rb["full_digest"] == ra["full_digest"]
