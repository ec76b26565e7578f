"""A Hugging Face ``transformers`` Llama under plain DDP (or FSDP2, ``--fsdp2``) with gemscout: GEMINI checkpoints,
SCOUT replaying its decoder layers, the data position restored with the model.

The model is built from a small config (no download); swap in ``AutoModelForCausalLM.from_pretrained(...)`` and your
tokenized dataset for real work — nothing else changes. Run it (2 processes, CPU, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node=2 examples/hf_llama.py --ckpt /tmp/ckpt --out /tmp/out

``make example-hf`` SIGKILLs rank 1 mid-run, starts the job again and checks it bit for bit against an uninterrupted
run (examples/run_kill.py). Each rank writes ``<out>/rank<r>.json`` like examples/ddp_tiny.py, plus SCOUT's
counters: every decoder layer must have been compared (``scout.unreplayable_recipes == 0``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import gemscout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_tiny import SampleLog, Tokens, crash, state_digest  # noqa: E402  (the same dataset, sample log and digest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--restore", choices=("candidate", "verified"), default="candidate")
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument(
        "--fsdp2",
        action="store_true",
        help="fully_shard every decoder layer and the model, not DDP",
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    llama = transformers.LlamaForCausalLM(config)
    if (
        args.fsdp2
    ):  # FSDP2 as its tutorial wraps a transformer; no mesh given: torch builds one over the world
        from torch.distributed.fsdp import fully_shard

        for layer in llama.model.layers:
            fully_shard(layer)
        model = fully_shard(llama)
    else:
        model = DistributedDataParallel(llama)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = StatefulDataLoader(
        Tokens(),
        batch_size=4,
        sampler=DistributedSampler(Tokens(), num_replicas=world, rank=rank, seed=0),
    )
    samples = SampleLog()
    trust = (
        gemscout.TrustState.RECOVERY_VERIFIED
        if args.restore == "verified"
        else gemscout.TrustState.CANDIDATE
    )
    session = gemscout.enable_resiliency(
        model,
        optimizer,
        interval=1,
        checkpoint=gemscout.CheckpointConfig(
            directory=args.ckpt, run_id="example-hf", min_trust=trust
        ),
        stateful={"loader": loader, "samples": samples},
        # SCOUT finds the recipes itself: model.embed_tokens, each of model.layers, model.norm + lm_head, the
        # optimizer; a decoder layer's position embeddings, ids, mask and DynamicCache are captured and replayed.
        scout=gemscout.ScoutConfig(interval=2),
    )
    first_run = (
        session.last_decision is not None
        and session.last_decision.mode == gemscout.RecoveryMode.FRESH
    )
    batches = iter(loader)
    for step in range(session.resume_step + 1, args.steps + 1):
        batch = next(batches)
        samples.add(batch["id"])
        loss = model(
            input_ids=batch["tokens"], labels=batch["tokens"]
        ).loss  # the model shifts the labels itself
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == args.kill_rank and step == args.kill_step and first_run:
            session.checkpointer.drain()  # the demo's crash, after this step's capture landed (a known restart point)
            crash(args.out, rank=rank, step=step)

    metrics = session.metrics()
    if metrics["scout.unreplayable_recipes"] or not metrics["scout.cycles"]:
        raise SystemExit(f"rank {rank}: SCOUT did not compare every recipe: {metrics}")
    decision = session.last_decision.to_dict() if session.last_decision is not None else None
    doc = {
        "rank": rank,
        "resume_step": session.resume_step,
        "decision": decision,
        "steps": args.steps,
        "state_digest": state_digest(llama, optimizer),  # under FSDP2: this rank's shards
        "samples_digest": samples.digest,
        "samples": samples.count,
        "metrics": metrics,
    }
    session.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(doc, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
