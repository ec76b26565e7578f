"""One rank of TorchTitan's real ``Trainer.train()`` on CPU (gloo), with or without gemscout, with an optional kill.

Runs under the .venv-tt interpreter (torchtitan 0.3.0 beside torch 2.13.0+cpu) through :mod:`qualification.launch`.
The CPU layer (:mod:`qualification.frameworks.torchtitan_cpu`) is applied first; then, exactly as a user would::

    trainer = Trainer(config)                       # llama3 debug model, FSDP2 over the ranks
    session = gemscout.enable_resiliency(trainer, None, checkpoint=CheckpointConfig(...))
    trainer.train()                                 # unchanged

Writes ``<out>/rank<r>.json``: the resume step, the recovery decision, per-step losses (from torchtitan's own metrics
logger), the fault reports, recovery decisions and trust ledger, the number of ``model_parts`` (pipeline stages on
this rank), and digests of what must come back bit for bit: every parameter's local shard, the inner optimizers'
state, the lr schedulers' state, ``trainer.step``, ``trainer.ntokens_seen`` and the dataloader's state.
``--pp N --pp-schedule NAME``: TorchTitan's own pipeline split and schedule (``1F1B``, ``Interleaved1F1B``, ...).

``--kill-rank R --kill-step S`` SIGKILLs rank R right after step S: an optimizer post-hook registered after the
session's (so step S was captured), after its checkpoint drained. ``--scout`` attaches SCOUT too;
``--replay-fault-rank R --replay-fault-step S`` flips one bit of rank R's replay of ``--replay-fault-recipe`` at step
S (a rank computing wrong numbers, as SCOUT sees it; training itself is untouched); under pipeline parallelism the
recipe carries its stage (``pp0.embedding``). ``--scout-per-cycle N`` replays N blocks and N optimizer slices per due
step (0: all of them, so a clean cycle certifies its capture at once).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from datetime import timedelta
from typing import Any

import torch

from qualification.frameworks import torchtitan_cpu
from qualification.programs._failstop import FailStop
from qualification.programs._rank import finish, run
from qualification.programs._recovery_times import Stamps
from qualification.programs._tensor_bytes import tensor_bytes
from qualification.programs.specs import parse
from qualification.programs.specs.titan import TitanSpec


def _plain(value: Any) -> Any:
    """A JSON-able view of a state (tensors as dtype, shape and SHA-256 of their bytes)."""
    if torch.is_tensor(value):
        return {
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "sha256": hashlib.sha256(tensor_bytes(value)).hexdigest(),
        }
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return hashlib.sha256(value).hexdigest()
    return value if isinstance(value, int | float | str | bool | type(None)) else repr(value)


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(_plain(value), sort_keys=True).encode()).hexdigest()


def state(trainer: Any) -> dict[str, Any]:
    """Digests of this rank's training state (its shards), one per part, and the counters in clear."""
    params = hashlib.sha256()
    for i, part in enumerate(trainer.model_parts):
        for name, t in part.state_dict().items():
            params.update(f"{i}.{name}".encode())
            params.update(tensor_bytes(t))
    loader = trainer.dataloader.state_dict()
    unpickled = {
        k: pickle.loads(v) if isinstance(v, bytes) else v for k, v in loader.items()
    }  # our own bytes
    return {
        "params": params.hexdigest(),
        "optimizer": _sha([opt.state_dict() for opt in trainer.optimizers.optimizers]),
        "lr_schedulers": _sha(trainer.lr_schedulers.state_dict()),
        "lr": [g["lr"] for opt in trainer.optimizers.optimizers for g in opt.param_groups],
        "step": int(trainer.step),
        "ntokens_seen": int(trainer.ntokens_seen),
        "dataloader": _sha(unpickled),
    }


def scout_topology(session: Any) -> dict[str, Any] | None:
    """SCOUT's view of the mesh on this rank (peers, stage label, ...) and the stage order it names stages by."""
    scout = getattr(session, "scout", None)
    topology = getattr(scout, "topology", None)
    if topology is None:
        return None
    return {
        **topology.to_dict(),
        "stage_order": scout.config.stage_order,
        "catalog": list(scout.catalog.names),
    }


def main() -> None:
    args = parse(TitanSpec)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    faults = FailStop.of(args, rank)
    # The datasets library caches the json it parses; one folder per rank, never the user's home.
    os.environ.setdefault("HF_DATASETS_CACHE", str(args.out / "hf-cache" / f"rank{rank}"))
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    torchtitan_cpu.apply()
    from torchtitan.trainer import Trainer

    import gemscout

    config = torchtitan_cpu.trainer_config(
        assets=args.assets,
        dump=args.out / "dump",
        steps=args.steps,
        seq_len=args.seq_len,
        local_batch=args.batch,
        dp_replicate=args.dp_replicate,
        pp=args.pp,
        pp_schedule=args.pp_schedule,
    )
    trainer = Trainer(config)
    losses: dict[int, float] = {}
    log = trainer.metrics_processor.log

    def record_loss(step: int, global_avg_loss: float, *a: Any, **k: Any) -> Any:
        losses[int(step)] = float(global_avg_loss)  # the loss torchtitan itself logs for this step
        return log(step, global_avg_loss, *a, **k)

    trainer.metrics_processor.log = record_loss
    session = None
    reports: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    cycles: dict[str, Any] = {}
    if args.ckpt is not None:
        cfg = gemscout.CheckpointConfig(
            directory=args.ckpt,
            run_id="titan-cpu",
            ranks_per_node=1,
            fsync=False,
            timeout=timedelta(seconds=120),
        )
        per = args.scout_per_cycle
        rotation = (
            {}
            if per < 0
            else {"hidden_per_cycle": per or None, "optimizer_slices_per_cycle": per or None}
        )
        scout = gemscout.ScoutConfig(interval=args.interval, **rotation) if args.scout else None
        session = gemscout.enable_resiliency(
            trainer,
            None,
            interval=args.interval,
            checkpoint=cfg,
            scout=scout,
            on_fault_report=lambda r: reports.append(r.to_dict()),
            on_recovery_decision=lambda d: decisions.append(d.to_dict()),
        )
        if session.scout is not None and args.replay_fault_rank == rank:
            from qualification.faults import Injector, ReplayFault

            Injector(session.scout).set(
                ReplayFault("bitflip", rank, args.replay_fault_step, args.replay_fault_recipe)
            )
        if session.scout is not None:

            def record_cycle(opt: Any, a: Any, k: Any) -> None:
                result = (
                    session.scout.last_result
                    if session is not None and session.scout is not None
                    else None
                )
                if result is not None and result.step == session.step:
                    cycles[str(result.step)] = {
                        "certified": result.certified_step,
                        "peers": list(result.peers),
                        "verdicts": {n: r.verdict.value for n, r in result.results.items()},
                        "reasons": {n: r.reason for n, r in result.results.items() if r.reason},
                    }

            trainer.optimizers.register_step_post_hook(
                record_cycle
            )  # after the session's post-hook
        if faults.killer:

            def kill(opt: Any, a: Any, k: Any) -> None:
                if session is not None:  # step S is out (own disk, peer): the process dies now
                    faults.after_step(session, session.step)

            trainer.optimizers.register_step_post_hook(kill)  # after the session's post-hook
    stamps = Stamps()
    if session is not None:
        stamps.restored()
        # After the session's hooks: the step (its checkpoint included) is done.
        trainer.optimizers.register_step_post_hook(lambda opt, a, k: stamps.stepped())
    resume = {
        "resume_step": session.resume_step if session else 0,
        "resume_state": state(trainer) if session and session.resume_step else None,
        "decision": session.last_decision.to_dict() if session and session.last_decision else None,
    }
    t0, cpu0 = time.monotonic(), time.process_time()
    trainer.train()
    wall, cpu = (
        time.monotonic() - t0,
        time.process_time() - cpu0,
    )  # CPU: every thread of this rank's process
    trust: dict[str, str] = {}
    if session is not None and session.checkpointer is not None:
        session.checkpointer.drain()
        trust = {str(s): st.value for s, st in sorted(session.checkpointer.ledger.states.items())}
    result = {
        "rank": rank,
        **resume,
        "times": stamps.times,
        "train_wall_s": wall,
        "train_cpu_s": cpu,
        "model_parts": len(trainer.model_parts),
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "state": state(trainer),
        "reports": reports,
        "decisions": decisions,
        "trust": trust,
        "scout_cycles": cycles,
        "scout_disabled": getattr(session.scout, "disabled_reason", None) if session else None,
        "scout_topology": scout_topology(session),
        "errors": session.checkpointer.errors if session and session.checkpointer else [],
    }
    if session is not None:
        session.close()
    finish(args.out, rank, result)


if __name__ == "__main__":
    run(main)
