"""One rank of a deterministic DDP training run, with or without gemscout, with optional fault injection.

Run under :mod:`qualification.launch` (or torchrun). Writes ``<out>/rank<r>.json``: losses per step, the resume step,
the recovery decision, and a SHA-256 over every parameter and optimizer-state byte (``state_digest``), so a driver can
compare a recovered run against an uninterrupted one bit for bit.

Faults (all real): ``--kill-rank R --kill-step S --kill-phase P`` SIGKILLs rank R at step S, phase P in
``after-step`` (in the loop, right after optimizer.step), ``in-step`` (between backward and optimizer.step),
``capture`` (inside the capture, from the caller-state callback), ``persist``, ``replicate``, ``persist_replica``
(on GEMINI's io thread, through its phase hook), or ``random:<max_ms>`` (a timer fires a random delay after step S,
wherever the rank then is). ``--sigterm-step S`` sends SIGTERM to itself after step S (flush test). Each SIGKILL is
recorded under ``--out`` right before it is sent (:mod:`qualification.programs._kills`), so drivers measure from it;
``times.first_step_wall`` is when the first step after a restore finished.

Pipeline topologies (``pp``, ``pp-dp``, ``pp-dp3``, ``pp3``, ``pp3-dp2``, ``pp-dp-ddp``, ``pp-fsdp``: ``--schedule
gpipe|1f1b``; ``pp-virtual``, ``pp-virtual-dp``: ``--schedule interleaved-1f1b|looped-bfs|interleaved-zb``; ``pp-v``,
``pp-v-dp``: ``--schedule zbv|dualpipev``): each rank builds and trains only its stage(s)
(:mod:`qualification.programs._pipeline`) and hands that stage module (the ``nn.ModuleList`` of its stage modules,
the DDP-wrapped or ``fully_shard``ed stage) and its optimizer to gemscout unchanged.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from qualification.programs._failstop import FailStop
from qualification.programs._pipeline import (
    PIPELINE_TOPOLOGIES,
    Pipeline,
    build_pipeline,
    replica_of,
)
from qualification.programs._rank import finish, run
from qualification.programs._recovery_faults import armed
from qualification.programs._tensor_bytes import tensor_bytes
from qualification.programs.specs import parse
from qualification.programs.specs.train import TrainSpec
from qualification.workloads import build_model, lm_loss, synthetic_batch


def state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 over this rank's parameters, buffers and optimizer state (its shards, when sharded)."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor_bytes(p))
    for idx, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{idx}.{k}".encode())
            h.update(tensor_bytes(v) if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def full_state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 over the whole (unsharded) parameters and optimizer state: equal across meshes of any size.
    Collective under sharding (DTensor.full_tensor): every rank calls it at the same point."""

    def full(t: torch.Tensor) -> bytes:
        return tensor_bytes(t.full_tensor() if hasattr(t, "full_tensor") else t)

    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(full(p))
    for idx, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{idx}.{k}".encode())
            h.update(full(v) if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def data_rank(topology: str, rank: int) -> int:
    """Which data shard a rank reads: tensor-parallel peers read the same batch, and so do the stages of one
    pipeline (its replica index along dp)."""
    if topology in PIPELINE_TOPOLOGIES:
        return replica_of(topology, rank)
    return {"tp": 0, "fsdp2-tp": rank // 2}.get(topology, rank)


def _tensor_parallel(model: torch.nn.Module, tp_mesh: object) -> None:
    """Megatron-style MLP sharding: fc1 column-wise, fc2 row-wise (attention stays replicated)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def wrap(model: torch.nn.Module, topology: str, world: int) -> torch.nn.Module:
    """DDP, FSDP2 on a 1-D mesh, HSDP on a (replicate, shard) mesh, TP, or FSDP2 x TP on a (dp, tp) mesh."""
    if topology == "ddp":
        return DDP(model, find_unused_parameters=True)  # a reducer that never rebuilds its buckets
    if topology == "ddp-default":
        # DDP's defaults: buckets rebuilt in gradient-ready order after each process's first backward, a layout
        # gemscout records and puts back on a restart (gemscout.adapters.ddp_buckets).
        return DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if topology == "tp":
        _tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
        return model
    if topology == "fsdp2-tp":
        mesh2d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, mesh2d["tp"])
        mesh = mesh2d["dp"]
    elif topology == "fsdp2":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    elif topology == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        raise SystemExit(f"unknown topology {topology!r}")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _buckets(model: torch.nn.Module) -> dict | None:
    """A plain DDP's bucket layout as DDP reports it: the parameter count and the rebuilt layout (None until DDP
    has rebuilt; the initial layout is one bucket in registration order)."""
    if not isinstance(model, DDP):
        return None
    from gemscout.adapters.ddp_buckets import logged_layout

    return {
        "params": len(list(p for p in model.parameters() if p.requires_grad)),
        "rebuilt": logged_layout(model),
    }


def main() -> None:
    args = parse(TrainSpec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + 17)  # dropout stream; identical on every rank, captured by GEMINI
    pipe: Pipeline | None = None
    if args.topology in PIPELINE_TOPOLOGIES:
        pipe = build_pipeline(args.topology, args.workload, seed=args.seed, schedule=args.schedule)
        model = ddp = pipe.module  # the stage module is what gemscout gets
    else:
        model = build_model(args.workload, seed=args.seed)
        ddp = wrap(model, args.topology, world)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    losses: dict[int, float] = {}
    faults = FailStop.of(args, rank)
    killer = faults.killer
    session = None
    decision = None
    resume_digest = None
    resume_full_digest = None
    times: dict[str, float] = {}
    if args.ckpt is not None:
        import gemscout

        def extra() -> dict:
            faults.in_capture(session)
            return {"losses": {str(k): v for k, v in losses.items()}}

        def load_extra(state: dict) -> None:
            in_restore()  # the recovery-kill injector's point inside the restore (a no-op otherwise)
            losses.clear()
            losses.update({int(k): float(v) for k, v in state["losses"].items()})

        cfg = gemscout.CheckpointConfig(
            directory=args.ckpt,
            run_id=args.run_id,
            ranks_per_node=args.ranks_per_node,
            persist_every=args.persist_every,
            async_copy=not args.no_async,
            chunk_bytes=args.chunk_bytes,
            timeout=timedelta(seconds=60),
            fsync=False,
            durable_directory=args.durable,
            durable_every=args.durable_every,
            replication=args.replication,
            when_busy=args.when_busy,
        )
        t_attach = time.time()
        injector = (
            armed(args.recovery_kill_phase, args.chunk_bytes, args.out, rank)
            if killer and args.recovery_kill_phase
            else nullcontext(lambda: None)
        )
        with injector as in_restore:
            session = gemscout.enable_resiliency(
                ddp,
                opt,
                interval=args.interval,
                checkpoint=cfg,
                schedulers=[sched],
                extra_state_fn=extra,
                load_extra_state_fn=load_extra,
            )
        decision = session.last_decision.to_dict() if session.last_decision else None
        resume_digest = state_digest(model, opt)
        if args.full_digest:
            resume_full_digest = full_state_digest(model, opt)
        times = {"attach_wall": t_attach, "restored_wall": time.time()}
        if args.io_delay_ms and session.checkpointer:

            def slow(phase: str, step: int) -> None:
                if phase == "replicate":
                    time.sleep(args.io_delay_ms / 1000)

            session.checkpointer.phase_hook = slow
        faults.arm_io(session)  # after the slow hook: a kill phase replaces it
    start = session.resume_step + 1 if session else 1
    for step in range(start, args.steps + 1):
        x, y = synthetic_batch(seed=args.seed, step=step, rank=data_rank(args.topology, rank))
        if pipe is not None:
            opt.zero_grad(set_to_none=True)
            loss = pipe.step(
                x, y
            )  # every micro-batch's forward and backward, then the dp gradient average
        else:
            loss = lm_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        faults.in_step(step)
        losses[step] = loss.item()  # before opt.step(): GEMINI takes caller state inside the step
        opt.step()
        sched.step()
        if (
            step == start and session is not None
        ):  # the first step trained after the restore (recovery wall time)
            times["first_step_wall"] = time.time()
        if session is not None and args.certify and session.step % args.interval == 0:
            session.certify(session.step)
        faults.after_step(session, step)
    digest = state_digest(model, opt)
    full_digest = full_state_digest(model, opt) if args.full_digest else None
    digests = [None] * world
    dist.all_gather_object(
        digests, digest
    )  # test-side comparison only; gemscout itself never pickles
    result = {
        "rank": rank,
        "world_size": world,
        "resume_step": session.resume_step if session else 0,
        "decision": decision,
        "resume_digest": resume_digest,
        "times": times,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "state_digest": digest,
        "replicas_equal": len(set(digests)) == 1 if args.topology.startswith("ddp") else True,
        "ddp_buckets": _buckets(ddp),
        "final_step": args.steps,
        "stats": session.checkpointer.stats if session and session.checkpointer else {},
        "errors": session.checkpointer.errors if session and session.checkpointer else [],
        "skipped_steps": session.checkpointer.skipped_steps
        if session and session.checkpointer
        else [],
        "full_digest": full_digest,
        "resume_full_digest": resume_full_digest,
    }
    if session:
        session.close()
    finish(args.out, rank, result)


if __name__ == "__main__":
    run(main)
