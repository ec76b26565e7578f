"""One rank of a DDP job under GEMINI + SCOUT with a persistent fault, for the persistent-SDC cell and test.

From step ``--fault-step`` to ``--heal-step`` (exclusive) rank ``--fault-rank`` runs a forward hook that corrupts the
output of ``blocks[--fault-block]`` in every forward, training and replay alike (``qualification.faults``: the fault
enters through an ordinary module hook). Writes ``<out>/rank<r>.json``: per step the recipes due, every FaultReport,
every RecoveryDecision, and the trust ledger at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gemscout
from gemscout.scout.stragglers import StragglerConfig
from qualification.faults import corrupt_module_output
from qualification.workloads import build_model, lm_loss, synthetic_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--fault-rank", type=int, default=2)
    ap.add_argument("--fault-step", type=int, default=6)
    ap.add_argument("--heal-step", type=int, default=10)
    ap.add_argument("--fault-block", type=int, default=1)
    ap.add_argument("--fault", default="bitflip")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(17)
    model = build_model("three-block", seed=0)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    reports: list[dict] = []
    decisions: list[dict] = []
    ckpt = args.out / "ckpt"
    session = gemscout.enable_resiliency(
        ddp, opt, interval=1,
        checkpoint=gemscout.CheckpointConfig(directory=ckpt, run_id="scout", fsync=False, keep_generations=8,
                                             min_trust=gemscout.TrustState.RECOVERY_VERIFIED),
        # 4 ranks on 2 cores: scheduling alone moves replay times by tens of ms, so the compute-straggler margin is
        # raised above that noise here (the default 2 ms suits one rank per core).
        scout=gemscout.ScoutConfig(stragglers=StragglerConfig(absolute_margin_s=0.25)),
        on_fault_report=lambda r: reports.append(r.to_dict()),
        on_recovery_decision=lambda d: decisions.append(d.to_dict()))
    assert session.scout is not None
    due = {}
    hook = None
    for step in range(1, args.steps + 1):
        due[step] = [r.name for r in session.scout.catalog.due(step)]
        if rank == args.fault_rank and step == args.fault_step:
            hook = corrupt_module_output(model.blocks[args.fault_block], args.fault)
        if hook is not None and step == args.heal_step:
            hook.remove()
            hook = None
        x, y = synthetic_batch(seed=0, step=step, rank=rank)
        loss = lm_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert session.checkpointer is not None
    session.checkpointer.drain()
    trust = {str(s): st.value for s, st in sorted(session.checkpointer.ledger.states.items())}
    session.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "due": due, "reports": reports, "decisions": decisions, "trust": trust}, indent=1,
        default=str))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
