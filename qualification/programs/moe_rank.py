"""One rank of an expert-parallel (MoE, mesh ("dp", "ep")) or context-parallel (mesh ("dp", "cp")) job under GEMINI +
SCOUT, with the AllToAll check on the MoE dispatch, and optional faults.

``--workload moe|cp`` on a (world/2) x 2 mesh. Under MoE every rank reads its own batch; under CP the two ranks of a
CP group read one batch of their dp row, each its half of the sequence. Gradients are averaged by hand
(:func:`qualification.workloads.moe.sync_grads`). ``--etp 2`` (MoE only): expert tensor parallelism on a
(world/4, 2, 2) mesh ("dp", "ep", "etp"): each expert's MLP sharded over etp (w1 by column, w2 by row), the etp
partners reading the same batch; SCOUT's peers vary along dp and keep the ep and etp coordinates.

Faults: ``--kill-rank R --kill-step S`` SIGKILLs rank R right after step S (its checkpoint drained), for a relaunch
to recover; ``--replay-fault-rank R --replay-fault-step S --replay-fault-recipe N`` flips a bit in one SCOUT replay;
``--a2a-corrupt-rank R --a2a-corrupt-step S`` flips one byte of rank R's send buffer in the ``balanced`` AllToAll
replay at S (after R digested it: the bytes change on the way, toward R's first EP group rank).

Writes ``<out>/rank<r>.json``: losses, resume step, every FaultReport, RecoveryDecision, the trust ledger, SCOUT's
verdicts per step, the AllToAll check's results per step, the topology, and ``state_digest`` (this rank's parameters
and optimizer state); ``--baseline`` adds ``baseline_digest`` from the same steps trained without gemscout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from qualification.programs._failstop import FailStop
from qualification.programs._rank import finish, run
from qualification.programs._recovery_times import Stamps
from qualification.programs.specs import parse
from qualification.programs.specs.scout import MoeSpec
from qualification.programs.train_rank import state_digest
from qualification.workloads import lm_loss, synthetic_batch
from qualification.workloads.cp import build_cp, seq_chunk
from qualification.workloads.moe import build_moe, place_on_mesh, sync_grads


class Job:
    """The mesh, the model and one training step, for either workload."""

    def __init__(self, workload: str, seed: int, etp: int = 1) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.workload, self.seed, self.etp = workload, seed, etp
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if etp > 1 and workload != "moe":
            raise SystemExit(f"--etp {etp}: expert tensor parallelism needs --workload moe")
        if self.world % (2 * etp):
            raise SystemExit(
                f"--etp {etp}: the world size {self.world} must be a multiple of 2 x {etp}"
            )
        self.model_dim = "ep" if workload == "moe" else "cp"
        inner = ((self.model_dim, 2),) + ((("etp", etp),) if etp > 1 else ())
        self.mesh = init_device_mesh(
            "cpu",
            (self.world // (2 * etp), *(n for _, n in inner)),
            mesh_dim_names=("dp", *(d for d, _ in inner)),
        )
        self.data_rank = self.rank // etp  # etp partners read the same batch
        self.dp_rank, self.mp_rank, self.etp_rank = (
            self.data_rank // 2,
            self.data_rank % 2,
            self.rank % etp,
        )
        self.dp_group, self.mp_group = (
            self.mesh.get_group("dp"),
            self.mesh.get_group(self.model_dim),
        )
        self.etp_group = self.mesh.get_group("etp") if etp > 1 else None

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if self.workload == "moe":
            model: torch.nn.Module = build_moe(
                seed=self.seed,
                ep_size=2,
                ep_rank=self.mp_rank,
                group=self.mp_group,
                etp_size=self.etp,
                etp_rank=self.etp_rank,
                etp_group=self.etp_group,
            )
            place_on_mesh(model, self.mesh, shard_dim="ep", tp_dim="etp" if self.etp > 1 else None)
        else:
            model = build_cp(seed=self.seed, cp_rank=self.mp_rank, cp_size=2, group=self.mp_group)
            place_on_mesh(model, self.mesh, shard_dim=None)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def step(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        step: int,
        losses: dict[int, float],
    ) -> None:
        if self.workload == "moe":
            x, y = synthetic_batch(seed=self.seed, step=step, rank=self.data_rank)
        else:
            x, y = (
                seq_chunk(t, self.mp_rank, 2)
                for t in synthetic_batch(seed=self.seed, step=step, rank=self.dp_rank)
            )
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_grads(
            model,
            dp_group=self.dp_group,
            world_size=self.world,
            dp_size=self.world // (2 * self.etp),
        )
        losses[step] = (
            loss.item()
        )  # before the update: GEMINI takes the caller state inside opt.step()
        opt.step()


def main() -> None:
    import gemscout
    from gemscout.scout.alltoall import AllToAllConfig
    from gemscout.scout.stragglers import StragglerConfig
    from qualification.faults import Injector, ReplayFault
    from qualification.programs.scout_rank import summary

    args = parse(MoeSpec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    job = Job(args.workload, args.seed, args.etp)
    rank = job.rank
    faults = FailStop.of(args, rank)
    torch.manual_seed(17)
    model, opt = job.build()
    reports: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    losses: dict[int, float] = {}
    session = gemscout.enable_resiliency(
        model,
        opt,
        interval=1,
        checkpoint=gemscout.CheckpointConfig(
            directory=args.ckpt,
            run_id=f"{args.workload}-job",
            fsync=False,
            keep_generations=8,
            timeout=timedelta(seconds=60),
        ),
        extra_state_fn=lambda: {"losses": {str(k): v for k, v in losses.items()}},
        load_extra_state_fn=lambda st: losses.update(
            {int(k): float(v) for k, v in st["losses"].items()}
        ),
        # 4 ranks on 2 shared cores: scheduling noise alone is tens of ms, above the default straggler margin.
        scout=gemscout.ScoutConfig(
            interval=1,
            data_parallel_dims=("dp",),
            stragglers=StragglerConfig(absolute_margin_s=0.25),
        ),
        on_fault_report=lambda r: reports.append(r.to_dict()),
        on_recovery_decision=lambda d: decisions.append(d.to_dict()),
    )
    stamps = Stamps()
    stamps.restored()
    assert session.scout is not None and session.checkpointer is not None
    start = session.resume_step + 1
    a2a: dict[int, list[dict[str, Any]]] = {}
    check = None
    if args.workload == "moe":
        # The session runs the check in its optimizer pre-hook and gates the step's capture on it (job-wide).
        check = session.check_alltoall(
            *[block.moe for block in model.blocks],  # type: ignore[union-attr]
            config=AllToAllConfig(),
        )
        if rank == args.a2a_corrupt_rank:

            def corrupt(case: str, step: int, buffer: torch.Tensor) -> torch.Tensor | None:
                if case != "balanced" or step != args.a2a_corrupt_step:
                    return None
                bad = buffer.clone()
                bad.view(-1).view(torch.uint8)[0] ^= 0x10
                return bad

            check.register_send_hook(corrupt)
    injector = Injector(session.scout)
    if rank == args.replay_fault_rank:
        injector.set(ReplayFault("bitflip", rank, args.replay_fault_step, args.replay_fault_recipe))
    cycles: dict[int, dict[str, Any]] = {}
    for step in range(start, args.steps + 1):
        job.step(model, opt, step, losses)
        stamps.stepped()
        if (
            check is not None
        ):  # the session checked this step's recorded AllToAlls before its update
            a2a[step] = [r.to_dict() for r in check.last_results]
        result = session.scout.last_result
        if result is not None and result.step == step:
            cycles[step] = summary(result)
        faults.after_step(session, step)
    session.checkpointer.drain()
    doc: dict[str, Any] = {
        "rank": rank,
        "resume_step": session.resume_step,
        "times": stamps.times,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "reports": reports,
        "decisions": decisions,
        "cycles": cycles,
        "a2a": a2a,
        "fired": injector.fired,
        "trust": {str(s): st.value for s, st in sorted(session.checkpointer.ledger.states.items())},
        "topology": session.scout.topology.to_dict()
        if session.scout.topology is not None
        else None,
        "disabled_reason": session.scout.disabled_reason,
        "state_digest": state_digest(model, opt),
    }
    session.close()
    if args.baseline:
        torch.manual_seed(17)
        plain, plain_opt = job.build()
        plain_losses: dict[int, float] = {}
        for step in range(1, args.steps + 1):
            job.step(plain, plain_opt, step, plain_losses)
        doc["baseline_losses"] = {str(k): v for k, v in sorted(plain_losses.items())}
        doc["baseline_digest"] = state_digest(plain, plain_opt)
    finish(args.out, rank, doc)


if __name__ == "__main__":
    run(main)
