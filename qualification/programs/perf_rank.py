"""One rank of the healthy-path performance suite: one workload in one mode, timed step by step.

Modes: ``baseline`` (no gemscout), ``gemini`` (GEMINI only), ``scout`` (SCOUT only), ``combined``. Every mode uses
the same seed, workload (``--workload``: its model and batch shape, :data:`qualification.workloads.BATCH_SHAPES`),
DDP settings and thread count; ``--device cuda`` puts the model and batches on the GPU. Writes ``<out>/rank<r>.json``
with, per measured step (after warm-up): its number, wall latency, the training thread's CPU time
(``time.thread_time``) and the whole process's CPU time (``time.process_time``: GEMINI's and SCOUT's background
threads included, so a busy shared machine, which stretches wall time, barely moves it), the minor page faults
(``minor_faults``); and the peak RSS.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from qualification.programs._rank import write_result
from qualification.programs.specs import parse
from qualification.programs.specs.perf import PerfSpec
from qualification.workloads import BATCH_SHAPES, build_model, lm_loss, synthetic_batch


def main() -> None:
    args = parse(PerfSpec)
    if not args.segments and args.mode is None:
        print("perf_rank: error: give --mode or --segments", file=sys.stderr, flush=True)
        raise SystemExit(2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(args.seed + 17)
    device = torch.device(args.device)
    model = build_model(args.workload, seed=args.seed).to(device)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    if args.segments:
        # One process, the modes alternating segment by segment after a warm-up without gemscout: what differs
        # between two launches (memory layout, core placement, a neighbour's load) then hits every mode alike.
        schedule = [("baseline", args.warmup, False)]
        schedule += [(m, args.segment_steps, True) for m in args.segments.split(",")]
    else:
        schedule = [(args.mode, args.warmup, False), (args.mode, args.steps, True)]
    rec: dict[str, list] = {
        k: []
        for k in (
            "modes",
            "steps",
            "due",
            "latencies_s",
            "thread_cpu_s",
            "process_cpu_s",
            "minor_faults",
        )
    }
    replay: dict[str, list[float]] = {}
    batch, seq = BATCH_SHAPES[args.workload]
    step, session, attached, due_every = 0, None, None, args.interval
    for i, (mode, steps, measure) in enumerate(schedule):
        if mode != attached:
            if session is not None:
                session.close()
            session = _attach(mode, ddp, opt, args, segment=i)
            attached = mode
            due_every = _due_every(mode, session, args.interval)
        for _ in range(steps):
            step += 1
            x, y = (
                t.to(device)
                for t in synthetic_batch(seed=args.seed, step=step, rank=rank, batch=batch, seq=seq)
            )
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            loss = lm_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()  # a step ends when its kernels do
            if not measure:
                continue
            rec["latencies_s"].append(time.perf_counter() - t0)
            rec["thread_cpu_s"].append(time.thread_time() - c0)
            rec["process_cpu_s"].append(time.process_time() - p0)
            rec["minor_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            rec["modes"].append(mode)
            rec["steps"].append(step)
            # The session counts its own steps from attach: a step is due when it captures or replays.
            own = session.step if session is not None else step
            rec["due"].append(mode != "baseline" and own % due_every == 0)
            cycle = (
                session.scout.last_result
                if session is not None and session.scout is not None
                else None
            )
            if cycle is not None and cycle.step == own:
                for recipe, by_rank in cycle.replay_s.items():
                    if rank in by_rank or str(rank) in by_rank:
                        replay.setdefault(recipe, []).append(
                            float(by_rank.get(rank, by_rank.get(str(rank))))
                        )
    dist.barrier()
    if session is not None:
        session.close()
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(
        args.out,
        rank,
        {
            "rank": rank,
            "mode": args.mode or "interleaved",
            **rec,
            "due_every": due_every,
            "replay_s": replay,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        },
    )
    dist.barrier()
    # Process-group teardown can deadlock in gloo (its worker frees tensors and needs the GIL while the group's
    # destructor holds it): every rank has written its result and passed the barrier, so leave without it.
    sys.stdout.flush()
    os._exit(0)


def _attach(
    mode: str, ddp: DDP, opt: torch.optim.Optimizer, args: PerfSpec, *, segment: int
) -> Any:
    """gemscout in ``mode`` on the live model and optimizer (None for the baseline)."""
    if mode == "baseline":
        return None
    import gemscout

    kwargs: dict[str, Any] = {}
    if mode in ("gemini", "combined"):
        kwargs["checkpoint"] = gemscout.CheckpointConfig(
            directory=args.ckpt / f"segment{segment}", run_id=f"perf-{mode}-{segment}", fsync=False
        )
    if mode in ("scout", "combined"):
        kwargs["scout"] = gemscout.ScoutConfig(
            interval=args.scout_interval, rotate_kinds=args.rotate_kinds
        )
    return gemscout.enable_resiliency(ddp, opt, interval=args.interval, **kwargs)


def _due_every(mode: str, session: Any, interval: int) -> int:
    """The finer cadence of the work that runs in ``mode``: GEMINI's captures, SCOUT's replays."""
    cadences = [interval] if mode in ("gemini", "combined") else []
    if session is not None and session.scout is not None:
        cadences.append(session.scout.config.interval)
    return min(cadences) if cadences else interval


if __name__ == "__main__":
    main()
