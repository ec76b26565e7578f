"""One rank of a job under GEMINI + SCOUT with injected faults, for the SCOUT cells and tests.

From step ``--fault-step`` to ``--heal-step`` (exclusive) rank ``--fault-rank`` runs a forward hook that corrupts the
output of ``blocks[--fault-block]`` in every forward, training and replay alike (``qualification.faults``: the fault
enters through an ordinary module hook). Writes ``<out>/rank<r>.json``: per step the recipes due, every FaultReport,
every RecoveryDecision, and the trust ledger at the end.

``--topology`` (default ``ddp``) wraps the model as :func:`qualification.programs.train_rank.wrap` does (FSDP2, HSDP,
TP, FSDP2 x TP) and reads the data shard :func:`~qualification.programs.train_rank.data_rank` gives; SCOUT then finds
its peers on the mesh. ``--baseline`` trains the same steps again without gemscout and records both state digests
(``state_digest``, ``baseline_digest``: this rank's shards) so a test can check SCOUT left training bit for bit
unchanged. ``--collective-delay-rank`` delays every collective of that rank's replays from
``--collective-delay-step`` on (a slow TP collective). ``cycles`` records each step's SCOUT verdicts.

Pipeline topologies (:data:`qualification.programs._pipeline.PIPELINE_TOPOLOGIES`, ``--schedule``): each rank trains
its stage(s) (:mod:`qualification.programs._pipeline`) and gives SCOUT the mesh (``ScoutConfig(mesh=...,
data_parallel_dims=("dp",))``); recipe names carry the stage (``pp1.hidden.0``) and ``--fault-block`` indexes the
stage's own blocks (one stage per rank, no DDP wrapper).
"""

from __future__ import annotations

import os
import shutil
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import gemscout
from gemscout.nodes import HOST_ENV
from gemscout.scout.comm_probe import CommProbeConfig
from gemscout.scout.cycle import CycleResult
from gemscout.scout.stragglers import StragglerConfig
from qualification.faults import (
    CollectiveDelay,
    Injector,
    ReplayDelay,
    ReplayFault,
    corrupt_module_output,
)
from qualification.programs._pipeline import (
    PIPELINE_TOPOLOGIES,
    Pipeline,
    build_pipeline,
)
from qualification.programs._rank import write_result
from qualification.programs.specs import parse
from qualification.programs.specs.scout import ScoutSpec
from qualification.programs.specs.train import TOPOLOGIES  # noqa: F401  (kept: the names scout_rank offers)
from qualification.programs.train_rank import data_rank, state_digest, wrap
from qualification.workloads import build_model, lm_loss, synthetic_batch


def summary(result: CycleResult) -> dict[str, Any]:
    """What a test needs from one cycle: verdicts (with reasons), reports, certification, communication times."""
    return {
        "certified": result.certified_step,
        "peers": list(result.peers),
        "peer_groups": [list(g) for g in result.peer_groups],
        "verdicts": {
            n: {
                "verdict": r.verdict.value,
                "ranks": list(r.ranks),
                "pre_ok": r.preconditions_ok,
                "reason": r.reason,
            }
            for n, r in result.results.items()
        },
        "reports": [
            {
                "kind": p.kind.value,
                "scope": p.scope.value,
                "ranks": list(p.ranks),
                "recipe": p.recipe,
                "signal": p.evidence.get("signal"),
            }
            for p in result.reports
        ],
        "replay_s": {n: {str(k): v for k, v in t.items()} for n, t in result.replay_s.items()},
        "gather_s": {n: {str(k): v for k, v in t.items()} for n, t in result.gather_s.items()},
        "collective_s": {
            n: {str(k): v for k, v in t.items()} for n, t in result.collective_s.items()
        },
    }


def build(
    topology: str, world: int, schedule: str
) -> tuple[torch.nn.Module, torch.nn.Module, Pipeline | None]:
    """(the module that holds ``blocks``, what the optimizer and gemscout get, the pipeline or None)."""
    if topology in PIPELINE_TOPOLOGIES:
        pipe = build_pipeline(topology, "three-block", seed=0, schedule=schedule)
        return pipe.module, pipe.module, pipe
    model = build_model("three-block", seed=0)
    return model, wrap(model, topology, world), None


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    topology: str,
    rank: int,
    pipe: Pipeline | None = None,
) -> None:
    x, y = synthetic_batch(seed=0, step=step, rank=data_rank(topology, rank))
    if pipe is not None:
        opt.zero_grad(set_to_none=True)
        pipe.step(x, y)
    else:
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
    opt.step()


def main() -> None:
    args = parse(ScoutSpec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ[HOST_ENV] = (
        f"host-{rank}"  # one simulated host per rank, so a straggler maps to its node
    )
    torch.manual_seed(17)
    model, ddp, pipe = build(args.topology, world, args.schedule)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    reports: list[dict] = []
    decisions: list[dict] = []
    ckpt = args.out / "ckpt"
    session = gemscout.enable_resiliency(
        ddp,
        opt,
        interval=1,
        checkpoint=gemscout.CheckpointConfig(
            directory=ckpt,
            run_id="scout",
            fsync=False,
            keep_generations=8,
            min_trust=gemscout.TrustState.RECOVERY_VERIFIED,
        ),
        # 4 ranks on 2 cores: scheduling alone moves replay times by tens of ms, so the compute-straggler margin is
        # raised above that noise here (the default 2 ms suits one rank per core).
        scout=gemscout.ScoutConfig(
            interval=1,  # a cycle at every step (the default would be every 10th)
            stragglers=StragglerConfig(absolute_margin_s=args.straggler_margin_s),
            optimizer_slice_numel=args.optimizer_slice_numel,
            comm_probe=CommProbeConfig(
                interval=args.comm_probe_interval,
                stragglers=StragglerConfig(absolute_margin_s=0.15),
            )
            if args.comm_probe_interval
            else None,
            mesh=pipe.mesh if pipe is not None else None,
            data_parallel_dims=pipe.data_dims if pipe else None,
            stage_order=pipe.order if pipe is not None else "loop",
            job_collectives=args.job_delay_rank >= 0,
        ),
        on_fault_report=lambda r: reports.append(r.to_dict()),
        on_recovery_decision=lambda d: decisions.append(d.to_dict()),
    )
    assert session.scout is not None
    injector = Injector(session.scout)
    if rank == args.replay_delay_rank:
        injector.set(ReplayDelay(args.replay_delay_s, rank))
    faults: list[ReplayFault | ReplayDelay | CollectiveDelay] = list(injector.faults)
    if rank == args.replay_fault_rank:
        faults.append(
            ReplayFault("bitflip", rank, args.replay_fault_step, args.replay_fault_recipe)
        )
    if rank == args.collective_delay_rank:
        faults.append(
            CollectiveDelay(args.collective_delay_s, rank, from_step=args.collective_delay_step)
        )
    injector.set(*faults)
    if rank == args.comm_delay_rank and session.comm_probe is not None:
        session.comm_probe.register_before_collective(lambda group: time.sleep(args.comm_delay_s))
    late = {"armed": False}
    if args.job_delay_rank >= 0:
        timer = session.scout.time_job_collectives(ddp)  # the one enable_resiliency installed

        def arrive_late(_which: object) -> None:
            if late["armed"]:
                late["armed"] = False  # once per step: the first of the step's collectives
                time.sleep(args.job_delay_s)

        if rank == args.job_delay_rank:
            timer.register_before_collective(arrive_late)
    due = {}
    cycles: dict[int, dict[str, Any]] = {}
    # A diverged replica changes training from then on: the baseline comparison stops the step before (unless the
    # job rolls back to a verified step, which must take it back onto the fault-free trajectory).
    compared_steps = (
        args.diverge_step - 1 if args.diverge_step > 0 and not args.recover_on_sdc else args.steps
    )
    digest = None
    hook = None
    diverged = False
    recoveries: list[dict[str, Any]] = []
    seen_decisions = 0
    step = 0
    while step < args.steps:
        step += 1
        due[step] = [r.name for r in session.scout.catalog.due(step)]
        if rank == args.fault_rank and step == args.fault_step:
            hook = corrupt_module_output(model.blocks[args.fault_block], args.fault)
        if hook is not None and step == args.heal_step:
            hook.remove()
            hook = None
        if rank == args.diverge_rank and step == args.diverge_step and not diverged:
            diverged = True
            weight = model.blocks[args.fault_block].fc1.weight
            with (
                torch.no_grad()
            ):  # this rank's stored copy (its local shard, under FSDP) silently changes
                (weight.to_local() if hasattr(weight, "to_local") else weight)[0, 0] += 1.0
        late["armed"] = step >= args.job_delay_step
        train(ddp, opt, step, args.topology, rank, pipe)
        result = session.scout.last_result
        if result is not None and result.step == step:
            cycles[step] = summary(result)
        if step == compared_steps:
            digest = state_digest(model, opt)
        fresh, seen_decisions = decisions[seen_decisions:], len(decisions)
        if args.recover_on_sdc and any(
            d["failure_kind"] == "sdc" and d["mode"] == "restore" for d in fresh
        ):
            decision = session.recover("sdc", min_trust=gemscout.TrustState.RECOVERY_VERIFIED)
            recoveries.append(
                {"at": step, "to": session.step, "sources": decision.to_dict().get("sources")}
            )
            seen_decisions = len(decisions)
            step = session.step  # train on from the restored step
    assert session.checkpointer is not None
    session.checkpointer.drain()
    trust = {str(s): st.value for s, st in sorted(session.checkpointer.ledger.states.items())}
    topology = session.scout.topology.to_dict() if session.scout.topology is not None else None
    disabled = session.scout.disabled_reason
    metrics = session.metrics()
    session.close()
    doc: dict[str, Any] = {
        "rank": rank,
        "due": due,
        "reports": reports,
        "decisions": decisions,
        "trust": trust,
        "recoveries": recoveries,
        "metrics": metrics,
    }
    if args.topology != "ddp" or args.baseline:
        doc.update(
            topology=topology,
            disabled_reason=disabled,
            cycles=cycles,
            fired=injector.fired,
            state_digest=digest,
            compared_steps=compared_steps,
        )
    if args.baseline:
        torch.manual_seed(17)  # the same training RNG stream, with no gemscout at all
        plain, plain_wrapped, plain_pipe = build(args.topology, world, args.schedule)
        plain_opt = torch.optim.AdamW(plain_wrapped.parameters(), lr=3e-3)
        for step in range(1, compared_steps + 1):
            train(plain_wrapped, plain_opt, step, args.topology, rank, plain_pipe)
        doc["baseline_digest"] = state_digest(plain, plain_opt)
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(args.out, rank, doc)
    dist.barrier()
    if rank == 0 and not args.keep_ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
