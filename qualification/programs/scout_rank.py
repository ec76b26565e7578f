"""One rank of a DDP job under GEMINI + SCOUT with a persistent fault, for the persistent-SDC cell and test.

From step ``--fault-step`` to ``--heal-step`` (exclusive) rank ``--fault-rank`` runs a forward hook that corrupts the
output of ``blocks[--fault-block]`` in every forward, training and replay alike (``qualification.faults``: the fault
enters through an ordinary module hook). Writes ``<out>/rank<r>.json``: per step the recipes due, every FaultReport,
every RecoveryDecision, and the trust ledger at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gemscout
from gemscout.scout.comm_probe import HOST_ENV, CommProbeConfig
from gemscout.scout.stragglers import StragglerConfig
from qualification.faults import Injector, ReplayDelay, ReplayFault, corrupt_module_output
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
    ap.add_argument("--replay-delay-rank", type=int, default=-1, help="compute straggler: sleep in every replay")
    ap.add_argument("--replay-delay-s", type=float, default=0.5)
    ap.add_argument("--comm-delay-rank", type=int, default=-1, help="slow link: sleep before every probe collective")
    ap.add_argument("--comm-delay-s", type=float, default=0.4)
    ap.add_argument("--comm-probe-interval", type=int, default=0)
    ap.add_argument("--replay-fault-rank", type=int, default=-1, help="transient fault in one replay only")
    ap.add_argument("--replay-fault-step", type=int, default=-1)
    ap.add_argument("--replay-fault-recipe", default="hidden.0")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    os.environ[HOST_ENV] = f"host-{rank}"  # one simulated host per rank, so a straggler maps to its node
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
        scout=gemscout.ScoutConfig(
            stragglers=StragglerConfig(absolute_margin_s=0.25),
            comm_probe=CommProbeConfig(interval=args.comm_probe_interval,
                                       stragglers=StragglerConfig(absolute_margin_s=0.15))
            if args.comm_probe_interval else None),
        on_fault_report=lambda r: reports.append(r.to_dict()),
        on_recovery_decision=lambda d: decisions.append(d.to_dict()))
    assert session.scout is not None
    injector = Injector(session.scout)
    if rank == args.replay_delay_rank:
        injector.set(ReplayDelay(args.replay_delay_s, rank))
    if rank == args.replay_fault_rank:
        injector.set(ReplayFault("bitflip", rank, args.replay_fault_step, args.replay_fault_recipe))
    if rank == args.comm_delay_rank and session.comm_probe is not None:
        session.comm_probe.register_before_collective(lambda group: time.sleep(args.comm_delay_s))
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
