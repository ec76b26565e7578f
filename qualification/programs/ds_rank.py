"""One rank of a deterministic DeepSpeed ZeRO-1/2/3 run on CPU (gloo), with or without gemscout, with optional faults.

The DeepSpeed counterpart of :mod:`qualification.programs.train_rank`: same arguments for the lifecycle driver, same
``<out>/rank<r>.json`` (losses per step, resume step, recovery decision, ``state_digest``), plus the engine's
``global_steps`` / ``global_samples``. ``state_digest`` is a SHA-256 over this rank's module state (every parameter:
ZeRO-1/2 keep them all on every rank), its fp32 master partition and the optimizer state of that partition.
``deepspeed-zero3`` digests the parameter partitions instead and gathers the module for ``module_digest``
(:mod:`qualification.programs.ds_zero3`).

Faults: ``--kill-rank R --kill-step S --kill-phase P`` SIGKILLs rank R at step S in phase ``after-step``, ``in-step``
(between backward and engine.step), ``capture`` (inside GEMINI's capture), ``persist`` / ``replicate`` /
``persist_replica`` (GEMINI's io thread); ``--sigterm-step S`` sends SIGTERM to rank 0 after step S. With
``--scout``, SCOUT replays the forward recipes on the engine's module, and ``--fault-rank/--fault-step/--heal-step/
--fault-block`` add a persistent output corruption of one block on one rank (``qualification.faults``).
``--scout-recipes ...,optimizer`` adds the ZeRO optimizer recipe (the partition owner's update replayed by every
rank); ``--replay-fault-rank/--replay-fault-steps`` corrupt that rank's replay of the first due slice,
``--update-fault-rank/--update-fault-step`` flip a bit of that rank's master partition after its real update, and
``<out>/rank<r>.json`` gains ``cycles`` (per step: verdicts, certified step, replay seconds).

``--full-state`` adds ``resume_full`` / ``final_full``: per parameter, the SHA-256 of the fp32 master and AdamW moments
as DeepSpeed itself assembles them from every rank's fragment (``safe_get_full_*``), plus each group's step count and
lr — a world-size-independent picture of the optimizer state, to compare runs on different world sizes.

``--dump-full PATH`` writes (rank 0, ``torch.save``: test side only) that full state as tensors at the end, with the
module, step counts, hyper-parameters, lr scheduler, engine counters and torch RNG; ``--load-full PATH`` starts a
job without gemscout from such a dump through DeepSpeed's own ``safe_set_full_*`` setters — a reference resume on
any world size that shares no code with gemscout's durable tier.

DeepSpeed runs with ``DS_ACCELERATOR=cpu``; the C++ ``shm_comm`` op that ``deepspeed.init_distributed`` would JIT-build
(about 90 s with g++, used only by inference all-reduce) is skipped.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gemscout.scout import StragglerConfig
from qualification.programs import ds_zero3
from qualification.programs._failstop import FailStop
from qualification.programs._rank import finish, run
from qualification.programs.ds_state import (
    dump_full,
    full_state,
    load_full,
    module_digest,
    state_digest,
)
from qualification.programs.specs import parse
from qualification.programs.specs.deepspeed import STAGES, DeepSpeedSpec
from qualification.workloads import build_model, lm_loss, synthetic_batch

MICRO_BATCH = 4  # synthetic_batch's default batch


def import_deepspeed() -> Any:
    """Import deepspeed for CPU and stop ``init_distributed`` from compiling the shm_comm op."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # ``import deepspeed.comm.torch as m`` would bind torch itself (deepspeed.comm re-exports a ``torch`` name).
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    return deepspeed


def ds_config(stage: int, *, accumulation: int = 1, bf16: bool = False) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": ds_zero3.zero3_config() if stage == 3 else {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def main() -> None:
    args = parse(DeepSpeedSpec)
    torch.set_num_threads(1)
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60), verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + 17)  # dropout stream; identical on every rank, captured by GEMINI
    model = build_model(args.workload, seed=args.seed)
    if (
        args.param_groups == 2
    ):  # no weight decay on vectors (norms, biases): two ZeRO partitions per rank
        decay = [p for p in model.parameters() if p.dim() > 1]
        flat = [p for p in model.parameters() if p.dim() <= 1]
        opt = torch.optim.AdamW(
            [{"params": decay}, {"params": flat, "weight_decay": 0.0}], lr=3e-3, weight_decay=0.01
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    engine, ds_opt, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=opt,
        lr_scheduler=sched,
        config=ds_config(STAGES[args.topology], accumulation=args.accumulation, bf16=args.bf16),
    )
    losses: dict[int, float] = {}
    reports: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    faults = FailStop.of(args, rank)
    session = None
    decision = None
    resume_digest = resume_full = resume_module = None
    times: dict[str, float] = {}
    if args.ckpt is not None:
        import gemscout

        def extra() -> dict[str, Any]:
            faults.in_capture(session)
            return {"losses": {str(k): v for k, v in losses.items()}}

        def load_extra(state: dict[str, Any]) -> None:
            losses.clear()
            losses.update({int(k): float(v) for k, v in state["losses"].items()})

        cfg = gemscout.CheckpointConfig(
            directory=args.ckpt,
            run_id=args.run_id,
            ranks_per_node=args.ranks_per_node,
            persist_every=args.persist_every,
            keep_generations=args.keep_generations,
            timeout=timedelta(seconds=60),
            fsync=False,
            durable_directory=args.durable,
            durable_every=args.durable_every,
        )
        kinds = tuple(args.scout_recipes.split(","))
        per_cycle = args.optimizer_slices_per_cycle or None
        stragglers = (
            StragglerConfig(absolute_margin_s=args.straggler_margin_s)
            if args.straggler_margin_s > 0
            else None
        )
        scout = (
            gemscout.ScoutConfig(
                interval=args.interval,
                recipes=kinds,
                stragglers=stragglers,
                optimizer_slice_numel=args.optimizer_slice_numel,
                optimizer_slices_per_cycle=per_cycle,
            )
            if args.scout
            else None
        )
        t_attach = time.time()
        session = gemscout.enable_resiliency(
            engine,
            ds_opt,
            interval=args.interval,
            checkpoint=cfg,
            scout=scout,
            extra_state_fn=extra,
            load_extra_state_fn=load_extra,
            on_fault_report=lambda r: reports.append(r.to_dict()),
            on_recovery_decision=lambda d: decisions.append(d.to_dict()),
        )
        decision = session.last_decision.to_dict() if session.last_decision else None
        resume_digest = state_digest(engine)
        resume_full = full_state(engine) if args.full_state and session.resume_step > 0 else None
        resume_module = module_digest(engine)
        times = {"attach_wall": t_attach, "restored_wall": time.time()}
        faults.arm_io(session)
    if session is not None and session.scout is not None and args.replay_fault_steps:
        from qualification.faults import Injector, fail_at

        zero_due = getattr(session.scout, "zero_due", None)
        assert zero_due is not None, "--replay-fault-* needs --scout-recipes with 'optimizer'"
        steps = [int(s) for s in args.replay_fault_steps.split(",")]
        Injector(session.scout).set(
            *(
                fail_at("bitflip", rank=args.replay_fault_rank, step=s, recipe=zero_due(s)[0].name)
                for s in steps
            )
        )
    if session is not None and session.scout is not None and args.replay_delay_rank >= 0:
        from qualification.faults import Injector, ReplayDelay

        Injector(session.scout).set(ReplayDelay(args.replay_delay_s, args.replay_delay_rank))
    if rank == args.update_fault_rank and session is not None:
        live = session

        def flip(optimizer: Any, *_: Any) -> None:
            # A real update fault: the owner's own fp32 master partition goes wrong after the optimizer ran.
            master = optimizer.param_groups[0]["params"][0]  # DeepSpeed steps one group at a time
            if (
                live.step + 1 == args.update_fault_step
                and master is engine.optimizer.single_partition_of_fp32_groups[0]
            ):
                with torch.no_grad():
                    bits = master[1:2].view(torch.int32)
                    bits ^= 1 << 20

        engine.optimizer.optimizer.register_step_post_hook(flip)
    cycles: dict[str, dict[str, Any]] = {}
    fault = None
    start = session.resume_step + 1 if session else 1
    if args.load_full is not None:
        assert session is None, "--load-full is the reference resume without gemscout"
        start = load_full(engine, args.load_full) + 1
        resume_full, resume_module = full_state(engine), module_digest(engine)
    for step in range(start, args.steps + 1):
        if rank == args.fault_rank and step == args.fault_step:
            from qualification.faults import corrupt_module_output

            fault = corrupt_module_output(engine.module.blocks[args.fault_block], "bitflip")
        if fault is not None and step == args.heal_step:
            fault.remove()
            fault = None
        for micro in range(
            args.accumulation
        ):  # engine.step() updates the weights after the last one
            x, y = synthetic_batch(seed=args.seed, step=step * args.accumulation + micro, rank=rank)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            faults.in_step(step)
            losses[step] = (
                loss.item()
            )  # before engine.step(): GEMINI takes caller state at the end of the step
            engine.step()
        if session is not None:  # the first step trained after the restore (recovery wall time)
            times.setdefault("first_step_wall", time.time())
        if session is not None and args.certify:
            session.certify(session.step)
        cycle = (
            session.scout.last_result if session is not None and session.scout is not None else None
        )
        if cycle is not None and cycle.step == step:
            cycles[str(step)] = {
                "source": cycle.source_rank,
                "certified": cycle.certified_step,
                "results": {n: [r.verdict.value, list(r.ranks)] for n, r in cycle.results.items()},
                "replay_s": {
                    n: {str(k): v for k, v in t.items()} for n, t in cycle.replay_s.items()
                },
            }
        faults.after_step(session, step)
    digest = state_digest(engine)
    final_full = full_state(engine) if args.full_state else None
    if args.dump_full is not None:
        dump_full(engine, args.dump_full)
    modules = [None] * world
    dist.all_gather_object(
        modules, module_digest(engine)
    )  # test-side comparison only; gemscout never pickles
    trust: dict[str, str] = {}
    if session is not None and session.checkpointer is not None:
        session.checkpointer.drain()
        trust = {str(s): st.value for s, st in sorted(session.checkpointer.ledger.states.items())}
    result = {
        "rank": rank,
        "world_size": world,
        "topology": args.topology,
        "resume_step": session.resume_step if session else 0,
        "decision": decision,
        "resume_digest": resume_digest,
        "resume_full": resume_full,
        "final_full": final_full,
        "resume_module": resume_module,
        "module_digest": modules[rank],
        "times": times,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "state_digest": digest,
        "replicas_equal": len(set(modules)) == 1,
        "final_step": args.steps,
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "lr": float(engine.optimizer.optimizer.param_groups[0]["lr"]),
        "stats": session.checkpointer.stats if session and session.checkpointer else {},
        "errors": session.checkpointer.errors if session and session.checkpointer else [],
        "reports": reports,
        "decisions": decisions,
        "trust": trust,
        "cycles": cycles,
    }
    if session:
        session.close()
    finish(args.out, rank, result)


if __name__ == "__main__":
    run(main)
