"""One rank of a DDP job under ``enable_resiliency(watch=...)`` with injected stalls, for hang/stall cells and tests.

Faults (by rank and step): ``--data-delay-rank R --data-delay-s S`` slows every DataLoader fetch of rank R from step
``--delay-from`` on; ``--io-delay-rank R --io-delay-s S`` slows rank R's checkpoint writes (timed through
``session.checkpoint_io("write")``); ``--hang-rank R --hang-step N`` makes rank R stop before the backward of step N
(its peers then wait in DDP's all-reduce). Every FaultReport and RecoveryDecision the session delivers is appended
to ``<out>/rank<r>.reports.jsonl`` as it arrives, so a driver can read them while the job hangs.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import gemscout
from qualification.programs.specs import parse
from qualification.programs.specs.watch import WatchSpec
from qualification.workloads import build_model, lm_loss, synthetic_batch


class Tokens(Dataset):
    def __init__(self, rank: int, n: int, delay_s: float, delay_from: int) -> None:
        self.rank, self.n, self.delay_s, self.delay_from = rank, n, delay_s, delay_from

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s and i + 1 >= self.delay_from:
            time.sleep(self.delay_s)
        x, y = synthetic_batch(seed=0, step=i + 1, rank=self.rank, batch=1)
        return x[0], y[0]


def main() -> None:
    args = parse(WatchSpec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    sink = args.out / f"rank{rank}.reports.jsonl"

    def record(kind: str, doc: dict) -> None:
        with open(sink, "a") as fh:
            fh.write(json.dumps({"type": kind, "t": time.time(), **doc}) + "\n")

    model = DDP(build_model("tiny-causal-lm", seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = gemscout.WatchConfig(
        stall_threshold=timedelta(seconds=args.threshold_s),
        poll_interval=timedelta(seconds=0.1),
        section_absolute_s=0.2,
        section_relative=3.0,
    )
    checkpoint = gemscout.CheckpointConfig(directory=args.ckpt, fsync=False) if args.ckpt else None
    session = gemscout.enable_resiliency(
        model,
        opt,
        watch=watch,
        checkpoint=checkpoint,
        on_fault_report=lambda r: record("report", r.to_dict()),
        on_recovery_decision=lambda d: record("decision", d.to_dict()),
    )
    delay = args.data_delay_s if rank == args.data_delay_rank else 0.0
    loader = session.instrument_dataloader(
        DataLoader(Tokens(rank, args.steps * 4, delay, args.delay_from * 4), batch_size=4)
    )
    for step, (x, y) in enumerate(loader, start=1):
        if step > args.steps:
            break
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        if rank == args.hang_rank and step == args.hang_step:
            record("injected", {"fault": "hang", "step": step})
            time.sleep(3600)  # stops before the backward's all-reduce; the driver kills the job
        loss.backward()
        opt.step()
        with session.checkpoint_io("write"):
            if rank == args.io_delay_rank and step >= args.delay_from:
                time.sleep(args.io_delay_s)
            else:
                time.sleep(0.01)
    record("finished", {"step": session.step})
    session.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
