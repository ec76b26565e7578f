"""One rank of TorchTitan's own training entry point (``python -m torchtitan.train``) with gemscout attached.

GPU tier (a real ``Trainer`` needs CUDA). TorchTitan builds its trainer from its own command line; this program wraps
``Trainer.train`` so that, once the trainer is built, ``enable_resiliency(trainer, None, checkpoint=...)`` attaches
(and restores, after a kill) before the loop runs, then records the result. Arguments after ``--`` go to torchtitan
unchanged (e.g. ``--module llama3 --config llama3_debugmodel --training.steps 6``).

Writes ``<out>/rank<r>.json``: the resume step, the recovery decision, the final ``trainer.step`` and a SHA-256 over
this rank's model parts (local shards) and optimizer state. ``--kill-step S`` SIGKILLs rank ``--kill-rank`` after
step S (its checkpoint drained first).
"""

from __future__ import annotations

import hashlib
import runpy
import sys
from datetime import timedelta
from typing import Any

import torch

from qualification.programs._kills import sigkill_self
from qualification.programs._tensor_bytes import tensor_bytes
from qualification.programs.specs import parse
from qualification.programs.specs.titan import TorchTitanSpec


def digest(trainer: Any) -> str:
    h = hashlib.sha256()
    for i, part in enumerate(trainer.model_parts):
        for name, t in part.state_dict().items():
            h.update(f"{i}.{name}".encode())
            h.update(tensor_bytes(t, as_float=True))
    for opt in trainer.optimizers.optimizers:
        for idx, state in sorted(opt.state_dict()["state"].items()):
            for key, value in sorted(state.items()):
                h.update(f"{idx}.{key}".encode())
                h.update(
                    tensor_bytes(value, as_float=True)
                    if torch.is_tensor(value)
                    else repr(value).encode()
                )
    return h.hexdigest()


def trainer_class() -> Any:
    try:
        from torchtitan.trainer import Trainer  # torchtitan 0.3.0
    except ImportError:
        from torchtitan.train import Trainer  # earlier releases
    return Trainer


def main() -> None:
    ours, _, titan_args = " ".join(sys.argv[1:]).partition(" -- ")
    args = parse(TorchTitanSpec, ours.split())
    trainer_cls = trainer_class()
    original = trainer_cls.train

    def train(self: Any) -> None:
        import torch.distributed as dist

        import gemscout

        session = None
        if args.ckpt is not None:
            cfg = gemscout.CheckpointConfig(
                directory=args.ckpt, run_id="titan", timeout=timedelta(seconds=120)
            )
            session = gemscout.enable_resiliency(self, None, checkpoint=cfg)
            rank = dist.get_rank()
            if rank == args.kill_rank:

                def kill(opt: Any, a: Any, k: Any) -> None:
                    if (
                        session is not None
                        and session.step == args.kill_step
                        and session.checkpointer
                    ):
                        session.checkpointer.drain()
                        sigkill_self(args.out, rank=rank, step=session.step, phase="after-step")

                self.optimizers.register_step_post_hook(
                    kill
                )  # after the session's post-hook: the step is captured
        resume = session.resume_step if session else 0
        original(self)
        if session is not None and session.checkpointer is not None:
            session.checkpointer.drain()
        import json

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{dist.get_rank()}.json").write_text(
            json.dumps(
                {
                    "resume_step": resume,
                    "step": int(self.step),
                    "state_digest": digest(self),
                    "decision": session.last_decision.to_dict()
                    if session and session.last_decision
                    else None,
                }
            )
        )
        if session is not None:
            session.close()

    trainer_cls.train = train
    sys.argv = ["torchtitan.train", *titan_args.split()]
    runpy.run_module("torchtitan.train", run_name="__main__")


if __name__ == "__main__":
    main()
