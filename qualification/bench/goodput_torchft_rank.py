"""One replica of the goodput benchmark's torchft arm: the same training as :mod:`goodput_rank`, fault-tolerant the
way torchft does it.

The two ranks of the other arms become two replica groups of one rank each (``REPLICA_GROUP_ID``), each launched by
its own ``torchrun --max-restarts`` and coordinated by a torchft lighthouse (``TORCHFT_LIGHTHOUSE``). The gradient
all-reduce goes through torchft's ``Manager`` (its ``DistributedDataParallel`` and ``OptimizerWrapper``), so when one
replica is SIGKILLed the other goes on training alone, and the relaunched replica joins the next quorum and receives
the live state from its peer (torchft's HTTP checkpoint transport): nothing is restored from disk.

Replica ``g`` trains on the batches rank ``g`` trains on in the other arms, and the same schedule kills it (the
``i``-th failure hits replica ``i % 2``), after backward and before ``optimizer.step``, once both replicas are in the
quorum (:func:`pending`). The job is done when the first replica has trained every step: a replica relaunched
after that exits without training (with nothing to join, it would only train again from step 0). At the first attempt both
replicas wait for each other (a file barrier) so that the first quorum holds both; a relaunch does not wait.

Each replica appends JSON lines to ``--events``: ``start`` (attempt), ``step`` (the step after the quorum, its
participants, whether it was committed), ``done`` (final state digest), ``late`` (relaunched after the end). A relaunched replica's first step says where
it resumed.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from qualification.bench import _model
from qualification.bench.goodput_rank import fire
from qualification.programs.specs import parse
from qualification.programs.specs.bench import GoodputTorchftSpec
from qualification.programs.train_rank import state_digest

REPLICAS = 2
BARRIER_S = 300.0


def barrier(work: Path, gid: int) -> None:
    """Both replicas' managers are up before either takes a step (first attempt only)."""
    (work / f"ready-{gid}").touch()
    deadline = time.monotonic() + BARRIER_S
    while not all((work / f"ready-{g}").exists() for g in range(REPLICAS)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {gid}: the other replica did not start in {BARRIER_S:g} s")
        time.sleep(0.05)


def pending(work: Path, fails: list[int], step: int) -> int | None:
    """The earliest scheduled failure at or before ``step`` that has not fired yet.

    A failure fires only while both replicas are in the quorum: in the other arms the whole job is up at every step,
    and a failure that hit the survivor while its peer is still being relaunched would leave no live state to recover
    from (torchft alone keeps none on disk). So here a failure due while one replica is away waits for its return:
    the schedule is the same list of steps, each hitting a whole job, as it does in the other arms.
    """
    return next((f for f in fails if f <= step and not (work / f"fired-{f}").exists()), None)


def main() -> None:
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    args = parse(GoodputTorchftSpec)
    torch.set_num_threads(1)
    gid = int(os.environ["REPLICA_GROUP_ID"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = args.events.open("a")

    def log(event: str, **fields: Any) -> None:
        events.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        events.flush()

    net = _model.build(args.state_mib)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"goodput_{gid}",
        timeout=timeout,
    )
    model = DistributedDataParallel(manager, net)
    opt = OptimizerWrapper(manager, optimizer)
    if attempt == 0:
        barrier(args.work, gid)
    fails = [int(s) for s in args.fail_steps.split(",") if s.strip()]
    log("start", attempt=attempt)
    width = _model.shape_for(args.state_mib)[0]
    finished = args.work / "finished"
    while manager.current_step() < args.steps:
        if finished.exists():  # the job is done: a replica relaunched after it has nothing to join
            log("late", step=manager.current_step())
            manager.shutdown(wait=False)
            return
        opt.zero_grad()  # starts the quorum; a joining replica receives the live state in it
        participants = (
            manager.num_participants()
        )  # waits for the quorum: the step is known after it
        step = manager.current_step() + 1
        gen = torch.Generator().manual_seed(step * 7919 + gid)
        x = torch.randn(args.batch, width, generator=gen)
        model(x).pow(2).mean().backward()
        due = pending(args.work, fails, step)
        if due is not None and participants == REPLICAS:
            fire(args.work, due, fails.index(due) % REPLICAS, gid)
        opt.step()  # commits only if every participant's all-reduce succeeded
        log(
            "step",
            step=step,
            participants=participants,
            committed=manager.current_step() == step,
        )
    finished.touch()
    log("done", digest=state_digest(net, optimizer), step=manager.current_step())
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
