"""One task of a job launched the Slurm way without torchrun (``srun python train.py``).

The environment is what ``srun`` gives a task: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
``SLURM_JOB_ID``, plus the ``MASTER_ADDR`` / ``MASTER_PORT`` a job script exports; no ``RANK``, ``WORLD_SIZE`` or
``LOCAL_WORLD_SIZE``. Several simulated nodes share this machine through ``GEMSCOUT_HOSTNAME``. The program starts
with ``gemscout.init_process_group``, trains plain DDP with GEMINI every step, and with ``--kill-step K`` every task
SIGKILLs itself once step K's capture is replicated (the whole job dies, as before a requeue). Writes
``<out>/rank<r>.json``: the recovery decision, the resume step, the replica placement and a digest of the final
parameters and optimizer state.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gemscout
from qualification.programs._rank import finish
from qualification.programs.specs import parse
from qualification.programs.specs.slurm import SlurmSpec
from qualification.programs.train_rank import state_digest


def main() -> None:
    args = parse(SlurmSpec)
    torch.set_num_threads(1)
    gemscout.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    decisions: list[dict[str, Any]] = []
    session = gemscout.enable_resiliency(
        model,
        optimizer,
        interval=1,
        checkpoint=gemscout.CheckpointConfig(
            directory=args.ckpt, fsync=False, handle_signals=False
        ),
        on_recovery_decision=lambda d: decisions.append(d.to_dict()),
    )
    assert session.checkpointer is not None
    placement = session.checkpointer.placement
    for step in range(session.resume_step + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(step * 101 + rank)
        x = torch.randn(8, 16, generator=gen)
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == args.kill_step:
            session.checkpointer.drain()  # step K's capture is replicated and persisted
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "rank": rank,
        "run_id": session.checkpointer.run_id,
        "resume_step": session.resume_step,
        "decisions": decisions,
        "ranks_per_node": placement.ranks_per_node,
        "replica_holder": placement.target(rank),
        "digest": state_digest(net, optimizer),
    }
    session.close()
    # finish: write the result, pass a barrier, leave without the process group's teardown (a normal exit after
    # destroy_process_group aborted one task in CI: "terminate called without an active exception", exit -6).
    finish(args.out, rank, doc)


if __name__ == "__main__":
    main()
