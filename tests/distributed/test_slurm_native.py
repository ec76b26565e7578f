"""A job launched the Slurm way without torchrun: ``srun python train.py``, one task per rank.

The tasks get Slurm's variables (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_JOB_ID``) and the exported rendezvous
address, not torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``. Four tasks on two simulated nodes
(``GEMSCOUT_HOSTNAME``): before, every rank counted as one node, so rank 2's replica was held by rank 3 on the same
node and losing that node lost both. What must hold: the process group starts from Slurm's variables, the run id is
the job id, each replica is held on the other node, and after the whole job is SIGKILLed and node 1's local storage
is deleted, the requeued job restores node 1's ranks from node 0's replicas and ends bitwise equal to a job that was
never interrupted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qualification.launch import free_port

WORLD, PER_NODE, KILL_STEP, STEPS = 4, 2, 3, 5
_DROP = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "GEMSCOUT_RUN_ID",
)


def srun(out: Path, ckpt: Path, *extra: str, job: str = "4242") -> list[int]:
    """What ``srun --ntasks=4 --distribution=block python slurm_rank.py`` starts, on this machine."""
    port = free_port()
    procs = []
    for task in range(WORLD):
        env = {k: v for k, v in os.environ.items() if k not in _DROP}
        env.update(
            SLURM_PROCID=str(task),
            SLURM_NTASKS=str(WORLD),
            SLURM_LOCALID=str(task % PER_NODE),
            SLURM_JOB_ID=job,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GEMSCOUT_HOSTNAME=f"node{task // PER_NODE}",
        )
        log = open(out.parent / f"{out.name}-task{task}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "qualification.programs.slurm_rank",
                    "--out",
                    str(out),
                    "--ckpt",
                    str(ckpt),
                    "--steps",
                    str(STEPS),
                    *extra,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=120))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
    return codes


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(300)
def test_srun_without_torchrun_places_replicas_across_nodes_and_survives_a_node_loss(
    tmp_path: Path,
) -> None:
    assert srun(tmp_path / "reference", tmp_path / "ckpt-ref") == [0] * WORLD
    reference = ranks(tmp_path / "reference")
    for doc in reference:
        assert doc["run_id"] == "4242" and doc["ranks_per_node"] == PER_NODE
        assert doc["replica_holder"] // PER_NODE != doc["rank"] // PER_NODE, (
            doc
        )  # held on the other node

    ckpt = tmp_path / "ckpt"
    assert (
        srun(tmp_path / "first", ckpt, "--kill-step", str(KILL_STEP)) == [-signal.SIGKILL] * WORLD
    )
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("node-")) == [
        "node-0",
        "node-1",
    ]
    shutil.rmtree(ckpt / "node-1")  # node 1 is replaced: its local storage is gone
    assert srun(tmp_path / "requeued", ckpt) == [0] * WORLD
    for doc, ref in zip(ranks(tmp_path / "requeued"), reference, strict=True):
        decision = doc["decisions"][0]
        assert doc["resume_step"] == KILL_STEP and decision["step"] == KILL_STEP, decision
        source = decision["sources"][str(doc["rank"])]
        if doc["rank"] // PER_NODE == 1:
            assert source == f"peer:{doc['rank'] - PER_NODE}", decision  # from node 0's replica
        else:
            assert not source.startswith("peer"), decision
        assert doc["digest"] == ref["digest"], (
            f"rank {doc['rank']} ended unlike the uninterrupted job"
        )
