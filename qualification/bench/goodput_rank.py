"""One rank of the goodput benchmark: DDP training under torchrun with a failure schedule, for one arm.

Arms: ``none`` (no checkpoint, no failure: the ideal step time), ``gemscout`` (``enable_resiliency`` at its
defaults), ``gemscout-skip`` (the same with ``when_busy="skip"``: a capture that would wait for a free slot is
skipped on every rank, so training never waits for checkpoint io), ``dcp`` (what users do today: ``torch.distributed.checkpoint.async_save`` every ``--dcp-every`` steps,
restart from the newest complete save with ``dcp.load``), ``calibrate`` (``async_save`` every step, no failure: the
blocking cost of one save, which the driver puts into the Young/Daly rule).

The failure schedule: during step ``f`` for every ``f`` in ``--fail-steps`` (after forward and backward, before
``optimizer.step``: step ``f``'s work is lost in every arm), one rank SIGKILLs itself, rank ``i % world`` at the
``i``-th failure; torchrun then restarts the whole job (``--max-restarts``). A marker file written and fsynced first
keeps a relaunch from firing the same failure again. Every arm starts its process group with
``gemscout.init_process_group``: plain ``env://`` start-up cannot survive a torchrun restart on torch 2.13 with gloo
(docs/torchrun.md), so the baseline needs it too.

Rank 0 appends one JSON line per event to ``--events``: ``start`` (attempt, resume step, seconds since the
process began and in the arm's own setup), ``step`` (step, wall time),
``save`` (blocking seconds of an ``async_save``), ``done`` (final state digest).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gemscout
from qualification.bench import _model
from qualification.programs.specs import parse
from qualification.programs.specs.bench import GOODPUT_ARMS, GoodputSpec
from qualification.programs.train_rank import state_digest

ARMS = GOODPUT_ARMS


class Log:
    def __init__(self, path: Path, rank: int) -> None:
        self._file = path.open("a") if rank == 0 else None

    def __call__(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            self._file.flush()  # a SIGKILL of this process keeps what was written


def newest_save(root: Path) -> int:
    """The newest step whose DCP save completed (its ``.metadata`` is written last), else 0."""
    done = [int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / ".metadata").exists()]
    return max(done, default=0)


def fire(marker_dir: Path, step: int, victim: int, rank: int) -> None:
    """The scheduled failure of ``step``, once: the victim marks it fired, then SIGKILLs itself."""
    marker = marker_dir / f"fired-{step}"
    if rank != victim or marker.exists():
        return
    with marker.open("w") as f:
        f.write(str(time.time()))
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def process_age_s() -> float:
    """Seconds since this process began (Linux ``/proc``): its imports, process group and model included."""
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = parse(GoodputSpec)
    torch.set_num_threads(1)
    gemscout.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = Log(args.events, rank)
    net = _model.build(args.state_mib)
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fails = [int(s) for s in args.fail_steps.split(",") if s.strip()]
    start = 0
    session = None
    t_setup = time.time()
    if args.arm in ("gemscout", "gemscout-skip"):
        when_busy = "skip" if args.arm == "gemscout-skip" else "wait"
        session = gemscout.enable_resiliency(
            model,
            optimizer,
            checkpoint=gemscout.CheckpointConfig(directory=args.work / "ckpt", when_busy=when_busy),
        )
        start = session.resume_step
    elif args.arm == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        start = newest_save(args.work / "dcp")
        load_group = dist.new_group(backend="gloo")
        if start:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(
                state,
                checkpoint_id=str(args.work / "dcp" / f"step-{start}"),
                process_group=load_group,
            )
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
    now = time.time()
    log(
        "start",
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        resume=start,
        boot_s=round(
            process_age_s(), 3
        ),  # this process: imports, process group, model, the arm's setup
        setup_s=round(
            now - t_setup, 3
        ),  # the arm's setup: enable_resiliency (with its recovery) or dcp.load
    )
    pending = None
    # async_save's background collectives need a group of their own: on the training group they interleave with
    # DDP's all-reduces from another thread, and gloo hangs (torch's async_save docs pass a gloo group for this).
    save_group = dist.new_group(backend="gloo") if args.arm in ("dcp", "calibrate") else None
    width = _model.shape_for(args.state_mib)[0]
    for step in range(start + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(step * 7919 + rank)
        x = torch.randn(args.batch, width, generator=gen)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step in fails:
            fire(args.work, step, fails.index(step) % world, rank)
        optimizer.step()
        if args.arm in ("dcp", "calibrate") and step % args.dcp_every == 0:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            t0 = time.perf_counter()
            if pending is not None:
                pending.result()  # one save in flight at a time, as DCP's docs do it
            msd, osd = get_state_dict(model, optimizer)
            pending = dcp.async_save(
                {"model": msd, "optim": osd},
                checkpoint_id=str(args.work / "dcp" / f"step-{step}"),
                process_group=save_group,
            )
            log("save", step=step, blocking_s=time.perf_counter() - t0)
        log("step", step=step)
    if pending is not None:
        pending.result()
    log("done", digest=state_digest(net, optimizer))
    if session is not None:
        session.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
