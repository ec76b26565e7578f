"""Plain DDP on a tiny language model with gemscout: in-memory checkpoints (GEMINI), replay checks (SCOUT), and the
data position restored with the model (torchdata's ``StatefulDataLoader`` passed as ``stateful=``).

Run it (2 processes on one machine, CPU, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node=2 examples/ddp_tiny.py --ckpt /tmp/ckpt --out /tmp/out

Run it again with the same ``--ckpt`` after a crash and it resumes where the checkpoint left off: the model, the
optimizer, the RNG streams and the loader's position. ``make example-ddp`` does exactly that: it SIGKILLs rank 1 in
the middle of a run, starts the job again and checks the result bit for bit against an uninterrupted run
(examples/run_kill.py).

Each rank writes ``<out>/rank<r>.json``: the step it resumed from, the recovery decision, a digest of its final
parameters and optimizer state, and a digest of every sample id it trained on, in order (``SampleLog``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import gemscout

VOCAB, SEQ, WIDTH = 64, 16, 32


class Tokens(Dataset):
    """Sample ``i``: a fixed random token sequence (what a tokenized corpus would hold), and its id."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(i)
        return {"id": i, "tokens": torch.randint(0, VOCAB, (SEQ + 1,), generator=gen)}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, repeated blocks, final norm, head: the shape SCOUT finds its recipes in."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class SampleLog:
    """Your own state object: a running digest of the sample ids trained on. Anything with ``state_dict()`` and
    ``load_state_dict()`` can go in ``stateful=``; this one shows that no sample is skipped or repeated on restart."""

    def __init__(self) -> None:
        self.digest, self.count = hashlib.sha256(b"samples").hexdigest(), 0

    def add(self, ids: torch.Tensor) -> None:
        self.digest = hashlib.sha256(f"{self.digest}:{ids.tolist()}".encode()).hexdigest()
        self.count += len(ids)

    def state_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.digest, self.count = state["digest"], state["count"]


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over the exact bytes of the parameters, buffers and optimizer state."""

    def raw(t: torch.Tensor) -> bytes:
        if hasattr(t, "to_local"):  # a DTensor (FSDP2, TP): this rank's shard
            t = t.to_local()
        return t.detach().reshape(-1).view(torch.uint8).numpy().tobytes()

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + raw(t))
    for idx, st in sorted(optimizer.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}.{key}".encode() + (raw(v) if torch.is_tensor(v) else repr(v).encode()))
    return h.hexdigest()


def crash(out: Path, *, rank: int, step: int) -> None:
    """The demo's crash: write when it happens to ``<out>/kill.json`` (fsynced, before the signal, since nothing
    runs after it), then SIGKILL this process. examples/run_kill.py measures the recovery from that record."""
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "event": "sigkill",
        "wall": time.time(),
        "rank": rank,
        "step": step,
        "pid": os.getpid(),
    }
    fd = os.open(out / "kill.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ckpt", type=Path, required=True, help="checkpoint folder (local disk of each node)"
    )
    ap.add_argument("--out", type=Path, required=True, help="where each rank writes rank<r>.json")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--scout-interval",
        type=int,
        default=None,
        help="ScoutConfig.interval (default: every 10th step)",
    )
    ap.add_argument(
        "--restore",
        choices=("candidate", "verified"),
        default="candidate",
        help="what a restart restores: the newest capture (default) or the newest SCOUT has verified",
    )
    ap.add_argument("--kill-rank", type=int, default=-1, help="demo: this rank SIGKILLs itself ...")
    ap.add_argument(
        "--kill-step", type=int, default=-1, help="... right after this step, in the first run only"
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(TinyLM())  # plain DDP, default arguments
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(Tokens(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(Tokens(), batch_size=4, sampler=sampler)
    samples = SampleLog()

    trust = (
        gemscout.TrustState.RECOVERY_VERIFIED
        if args.restore == "verified"
        else gemscout.TrustState.CANDIDATE
    )
    session = gemscout.enable_resiliency(
        model,
        optimizer,
        interval=1,  # capture every step
        checkpoint=gemscout.CheckpointConfig(
            directory=args.ckpt, run_id="example-ddp", min_trust=trust
        ),
        stateful={
            "loader": loader,
            "samples": samples,
        },  # restored with the model, before the first step
        scout=gemscout.ScoutConfig(interval=args.scout_interval),
    )
    first_run = (
        session.last_decision is not None
        and session.last_decision.mode == gemscout.RecoveryMode.FRESH
    )
    batches = iter(
        loader
    )  # after enable_resiliency: a restored loader continues from its saved position
    for step in range(session.resume_step + 1, args.steps + 1):
        batch = next(
            batches
        )  # fetch before optimizer.step(): the capture inside it must count this batch
        samples.add(batch["id"])
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # gemscout captures here (and runs SCOUT's replay on its due steps)
        if rank == args.kill_rank and step == args.kill_step and first_run:
            # The demo's crash. It waits for this step's capture to land first only so that the restart point is
            # known in advance (examples/check_resume.py asserts it); a real crash takes whatever had landed.
            session.checkpointer.drain()
            crash(
                args.out, rank=rank, step=step
            )  # no flush, no cleanup, no goodbye to the other rank

    decision = session.last_decision.to_dict() if session.last_decision is not None else None
    doc = {
        "rank": rank,
        "resume_step": session.resume_step,
        "decision": decision,
        "steps": args.steps,
        "state_digest": state_digest(model.module, optimizer),
        "samples_digest": samples.digest,
        "samples": samples.count,
        "metrics": session.metrics(),
    }
    session.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(doc, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
