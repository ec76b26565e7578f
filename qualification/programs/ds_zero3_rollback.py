"""One rank of a DeepSpeed ZeRO-3 run that rolls back in process: ``session.recover()`` mid-run, then trains on.

Trains ``--steps`` steps (``--ckpt``: under gemscout, certifying every capture up to ``--certify-until``); after
step ``--rollback-after`` every rank calls ``session.recover(min_trust=RECOVERY_VERIFIED)``, which restores the newest
certified step (``--certify-until``) into the live engine — whose persistent parameters are gathered, holding the
newer step's weights — and trains from there to ``--steps`` again. Without ``--ckpt`` it is the plain run. Writes
``<out>/rank<r>.json`` with ``state_digest`` / ``module_digest`` (:mod:`qualification.programs.ds_zero3`), the
losses of the last pass over every step, the recovery decision and the engine's ``global_steps``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from qualification.programs import ds_zero3
from qualification.programs._rank import finish, run
from qualification.programs.ds_rank import ds_config, import_deepspeed
from qualification.programs.specs import parse
from qualification.programs.specs.deepspeed import ZeRO3RollbackSpec
from qualification.workloads import build_model, lm_loss, synthetic_batch


def main() -> None:
    args = parse(ZeRO3RollbackSpec)
    torch.set_num_threads(1)
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60), verbose=False)
    rank = dist.get_rank()
    torch.manual_seed(17)
    model = build_model("three-block", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    engine, ds_opt, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=opt,
        lr_scheduler=sched,
        config=ds_config(3),
    )
    losses: dict[int, float] = {}
    session = decision = None
    if args.ckpt is not None:
        import gemscout

        cfg = gemscout.CheckpointConfig(
            directory=args.ckpt,
            run_id="rollback",
            keep_generations=args.steps + 2,
            persist_every=1,  # every capture on disk: the certified step 3 outlives the two memory slots
            timeout=timedelta(seconds=60),
            fsync=False,
        )
        session = gemscout.enable_resiliency(engine, ds_opt, checkpoint=cfg)
    step, rolled = 1, False
    while step <= args.steps:
        x, y = synthetic_batch(seed=0, step=step, rank=rank)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        losses[step] = loss.item()
        engine.step()
        if session is not None and step <= args.certify_until:
            session.certify(step)
        if session is not None and step == args.rollback_after and not rolled:
            rolled = True
            decision = session.recover(min_trust=gemscout.TrustState.RECOVERY_VERIFIED).to_dict()
            step = session.step + 1
            continue
        step += 1
    result: dict[str, Any] = {
        "rank": rank,
        "state_digest": ds_zero3.state_digest(engine),
        "module_digest": ds_zero3.module_digest(engine),
        "decision": decision,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "global_steps": int(engine.global_steps),
    }
    if session is not None:
        session.close()
    finish(args.out, rank, result)


if __name__ == "__main__":
    run(main)
