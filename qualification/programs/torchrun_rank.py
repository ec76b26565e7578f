"""One rank of the DDP training run of :mod:`qualification.programs.train_rank`, written as a user writes it for torchrun.

``python -m torch.distributed.run ... -m qualification.programs.torchrun_rank --spec FILE`` (a
:class:`~qualification.programs.specs.torchrun.TorchrunSpec`; or its flags, ``--out DIR [--ckpt DIR] ...``). The rank
reads everything from torchrun's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT), starts
its group with ``gemscout.init_process_group`` and wraps the model in plain ``DistributedDataParallel``
(``--find-unused-parameters`` is the one DDP argument a cell may set). torchrun relaunches with the same arguments, so a
fault names the attempt it happens in:

- ``--kill-rank R --kill-step S --kill-phase P --kill-attempt A``: rank R SIGKILLs itself at step S, phase P (as in
  train_rank: ``after-step``, ``in-step``, ``capture``, ``persist``, ``replicate``, ``persist_replica``,
  ``random:<max_ms>``), in attempt A only;
- ``--lose-nodes N,M --lose-attempt A``: at the start of attempt A, before anything else, rank ``N * ranks-per-node``
  deletes ``<ckpt>/node-N`` (the node's disk is gone; the process is the replacement's).

What each rank held when recovery began is observed from outside the runtime: after the group is up and before any
rank attaches, local rank 0 of each node reads its node's checkpoint directory with :func:`gemscout.inventory.inventory`
(every rank's memory-tier slots and replicas, through the anchor its killed predecessor left, and its files on disk,
headers checked), and a barrier holds every rank until it is done, so nothing it reads changes under it. The ranks of
the previous attempt are dead by then (torchrun stops every worker before it relaunches), so this is also what the
kill left behind. ``held`` in the results (local rank 0's only) maps each rank of the node to
``{kind: {owner: [steps]}}``, kinds ``memory`` / ``own`` (its own slots / files) and ``memory_replica`` /
``replica`` (what it holds for ``owner``); the driver derives the step and per-rank sources recovery must choose.

Writes ``<out>/attempts/rank<r>-attempt<a>.json`` when an attempt starts, and how it ended when it ends with a gemscout
error (the one line, the exit code); ``<out>/rank<r>.json`` as train_rank does when the run completes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from qualification.programs._failstop import FailStop
from qualification.programs._rank import finish
from qualification.programs._recovery_times import Stamps
from qualification.programs.specs import parse
from qualification.programs.specs.torchrun import TorchrunSpec
from qualification.programs.train_rank import state_digest
from qualification.workloads import build_model, lm_loss, synthetic_batch


def _record(args: TorchrunSpec, rank: int, attempt: int, doc: dict[str, Any]) -> None:
    folder = args.out / "attempts"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}-attempt{attempt}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **doc}, indent=1))


def _lose_nodes(args: TorchrunSpec, rank: int, attempt: int) -> None:
    """The node's disk is gone before its replacement process starts: one rank per lost node deletes the folder."""
    rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.ckpt is None or attempt != args.lose_attempt or not args.lose_nodes:
        return
    for node in (int(n) for n in args.lose_nodes.split(",")):
        if rank == node * rpn:
            shutil.rmtree(args.ckpt / f"node-{node}", ignore_errors=True)


def _held(args: TorchrunSpec, world: int) -> dict[str, dict[str, dict[str, list[int]]]]:
    """What every rank with a folder in this node's checkpoint directory holds now (see the module docstring); empty
    when the directory holds no checkpoint yet. Collective: every rank calls it, local rank 0 reads."""
    from gemscout.errors import ConfigError
    from gemscout.inventory import inventory

    held: dict[str, dict[str, dict[str, list[int]]]] = {}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and args.ckpt is not None and args.ckpt.is_dir():
        try:
            found = inventory(args.ckpt, world_size=world)
        except (
            ConfigError
        ):  # nothing checkpointed yet (a first attempt, a replacement node's empty disk)
            found = None
        for entry in found.ranks if found else []:
            if entry.node is None:
                continue  # no folder here: another node's rank, or a rank whose node was lost
            tiers: dict[str, dict[str, list[int]]] = {}
            for f in entry.files:
                if f.status != "unusable":
                    tiers.setdefault(f.kind, {}).setdefault(str(f.owner), []).append(f.step)
            held[str(entry.rank)] = tiers
    dist.barrier()  # no rank attaches (and adopts, sweeps or writes) before the read is done
    return held


def _build(args: TorchrunSpec) -> tuple[torch.nn.Module, DDP, torch.optim.Optimizer, Any]:
    torch.manual_seed(args.seed + 17)  # dropout stream; identical on every rank, captured by GEMINI
    model = build_model(args.workload, seed=args.seed)
    ddp = DDP(model, find_unused_parameters=args.find_unused_parameters)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    return model, ddp, opt, sched


def _uninterrupted(args: TorchrunSpec, rank: int) -> dict[str, Any]:
    """The same job trained from scratch, without gemscout, in this process after the run (a fresh model, DDP,
    optimizer and RNG stream): the reference for ``--inline-baseline``, one torchrun launch cheaper than a separate
    uninterrupted run."""
    model, ddp, opt, sched = _build(args)
    losses = {}
    for step in range(1, args.steps + 1):
        x, y = synthetic_batch(seed=args.seed, step=step, rank=rank)
        loss = lm_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        losses[str(step)] = loss.item()
        opt.step()
        sched.step()
    return {"state_digest": state_digest(model, opt), "losses": losses}


def main(args: TorchrunSpec, rank: int, attempt: int) -> None:
    import gemscout

    timeout = timedelta(seconds=args.timeout_s)
    torch.set_num_threads(1)
    gemscout.init_process_group("gloo", timeout=timeout)
    world = dist.get_world_size()
    held = _held(args, world) if args.ckpt is not None else {}
    if held:
        _record(
            args, rank, attempt, {"held": held}
        )  # before attaching: a STOP attempt keeps it too
    model, ddp, opt, sched = _build(args)
    losses: dict[int, float] = {}
    # torchrun's kill_attempt names the attempt that kills; a random kill's delay is seeded by the run's seed
    faults = FailStop.of(
        args, rank, seed=args.seed, attempt=attempt, armed=attempt == args.kill_attempt
    )
    stamps = Stamps()
    session = None
    decision = None
    if args.ckpt is not None:

        def extra() -> dict[str, Any]:
            faults.in_capture(session)
            return {"losses": {str(k): v for k, v in losses.items()}}

        def load_extra(state: dict[str, Any]) -> None:
            losses.clear()
            losses.update({int(k): float(v) for k, v in state["losses"].items()})

        cfg = gemscout.CheckpointConfig(
            directory=args.ckpt,
            run_id=args.run_id,
            ranks_per_node=args.ranks_per_node or None,
            timeout=timeout,
            fsync=False,
        )
        session = gemscout.enable_resiliency(
            ddp,
            opt,
            checkpoint=cfg,
            schedulers=[sched],
            extra_state_fn=extra,
            load_extra_state_fn=load_extra,
        )
        stamps.restored()
        decision = session.last_decision.to_dict() if session.last_decision else None
        _record(
            args,
            rank,
            attempt,
            {"decision": decision, "resume_step": session.resume_step},
        )
        faults.arm_io(session)
    start = session.resume_step + 1 if session else 1
    for step in range(start, args.steps + 1):
        x, y = synthetic_batch(seed=args.seed, step=step, rank=rank)
        loss = lm_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        faults.in_step(step)
        losses[step] = loss.item()
        opt.step()
        sched.step()
        faults.after_step(session, step)
        stamps.stepped()
        (args.out / "progress").mkdir(parents=True, exist_ok=True)
        (args.out / "progress" / f"rank{rank}").write_text(
            str(step)
        )  # where a driver's external kill lands
        if args.step_sleep:
            time.sleep(args.step_sleep)
    digest = state_digest(model, opt)
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, digest)
    result = {
        "rank": rank,
        "world_size": world,
        "attempt": attempt,
        "resume_step": session.resume_step if session else 0,
        "decision": decision,
        "held": held,
        "times": stamps.times,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "state_digest": digest,
        "replicas_equal": len(set(digests)) == 1,
        "final_step": args.steps,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "0")),
    }
    if session:
        session.close()
    if args.inline_baseline:
        result["baseline"] = _uninterrupted(args, rank)
    finish(args.out, rank, result)


def entry() -> None:
    """A gemscout error ends the rank with its exit code and one line (as docs/torchrun.md tells users to write),
    and the attempt's record says so; os._exit for the reason given in qualification.programs._rank.run."""
    from gemscout.errors import GemscoutError

    args = parse(TorchrunSpec)
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _record(
        args,
        rank,
        attempt,
        {
            "pid": os.getpid(),
            "started": time.time(),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "0")),
        },
    )
    _lose_nodes(args, rank, attempt)
    try:
        main(args, rank, attempt)
    except GemscoutError as exc:
        line = f"gemscout: {type(exc).__name__}: {exc}"
        print(line, flush=True)
        _record(
            args, rank, attempt, {"error": line, "exit_code": exc.exit_code, "ended": time.time()}
        )
        sys.stderr.flush()
        os._exit(exc.exit_code)


if __name__ == "__main__":
    entry()
